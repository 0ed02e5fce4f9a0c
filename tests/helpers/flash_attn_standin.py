"""A stand-in ``flash_attn`` package (SDPA inside) so that transformers runs its real FlashAttention-2 integration on
a machine without a GPU (``transformers.integrations.flash_attention``, ``modeling_flash_attention_utils``: the lazy
import, the unpadding, the varlen path and the padding back).

It has flash-attn 2.8's call signatures and semantics: ``[B, N, H, D]`` / ``[total, H, D]`` layouts, grouped-query
heads, and the causal mask aligned to the bottom-right corner when queries and keys differ in length (flash-attn
>= 2.1). Each sequence runs ``torch.nn.functional.scaled_dot_product_attention`` on the same views transformers'
SDPA path uses, so a prompt without padding gives SDPA's result bit for bit. Features it does not model (dropout,
sliding windows, softcap, ALiBi, paged caches) raise instead of being ignored.

``install(monkeypatch)`` registers it the way transformers looks for it: ``flash_attn`` and ``flash_attn.bert_padding``
in ``sys.modules``, and ``is_flash_attn_2_available`` true where transformers' FA2 code reads it (the real check also
requires CUDA, the one thing this machine lacks); transformers' cache of the loaded implementation is reset.
Everything is undone by the ``monkeypatch`` fixture.
"""

from __future__ import annotations

import importlib.machinery
import itertools
import sys
import types

import torch
import torch.nn.functional as F

__version__ = "2.8.3"


def _refuse(name: str, value, default) -> None:
    if value != default and value is not None:
        raise NotImplementedError(f"flash_attn stand-in: {name}={value!r} is not modelled (only {default!r})")


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None, causal: bool) -> torch.Tensor:
    """One sequence: ``q`` ``[1, H, Nq, D]``, ``k``/``v`` ``[1, Hkv, Nk, D]`` -> ``[1, H, Nq, D]``."""
    nq, nk = q.shape[2], k.shape[2]
    gqa = q.shape[1] != k.shape[1]
    if not causal or nq == 1:  # a single query row sees every key under the bottom-right alignment
        return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=gqa)
    if nq == nk:
        return F.scaled_dot_product_attention(q, k, v, scale=scale, is_causal=True, enable_gqa=gqa)
    # Bottom-right alignment: query row i sees keys 0 .. i + nk - nq.
    allowed = torch.arange(nk, device=q.device)[None, :] <= torch.arange(nq, device=q.device)[:, None] + (nk - nq)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale, enable_gqa=gqa)


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """``q`` ``[B, Nq, H, D]``, ``k``/``v`` ``[B, Nk, Hkv, D]`` -> ``[B, Nq, H, D]``."""
    _refuse("dropout_p", dropout_p, 0.0)
    _refuse("window_size", tuple(window_size), (-1, -1))
    _refuse("softcap", softcap, 0.0)
    _refuse("alibi_slopes", alibi_slopes, None)
    _refuse("return_attn_probs", return_attn_probs, False)
    out = _attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), softmax_scale, causal)
    return out.transpose(1, 2)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None):
    """Packed sequences: ``q`` ``[total_q, H, D]``, ``k``/``v`` ``[total_k, Hkv, D]``, sequence ``i`` at rows
    ``cu_seqlens[i]:cu_seqlens[i + 1]`` -> ``[total_q, H, D]``."""
    _refuse("dropout_p", dropout_p, 0.0)
    _refuse("window_size", tuple(window_size), (-1, -1))
    _refuse("softcap", softcap, 0.0)
    _refuse("alibi_slopes", alibi_slopes, None)
    _refuse("return_attn_probs", return_attn_probs, False)
    _refuse("block_table", block_table, None)
    bq, bk = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    if len(bq) != len(bk):
        raise ValueError(f"flash_attn stand-in: {len(bq) - 1} query sequences, {len(bk) - 1} key sequences")
    if max(b - a for a, b in itertools.pairwise(bq)) > int(max_seqlen_q):
        raise ValueError("flash_attn stand-in: a query sequence is longer than max_seqlen_q")
    outs = []
    for (q0, q1), (k0, k1) in zip(itertools.pairwise(bq), itertools.pairwise(bk)):
        outs.append(_attend(q[q0:q1].transpose(0, 1)[None], k[k0:k1].transpose(0, 1)[None],
                            v[k0:k1].transpose(0, 1)[None], softmax_scale, causal)[0].transpose(0, 1))
    return torch.cat(outs)


def flash_attn_with_kvcache(*args, **kwargs):
    raise NotImplementedError("flash_attn stand-in: flash_attn_with_kvcache (paged caches) is not modelled")


def unpad_input(hidden_states, attention_mask, unused_mask=None):
    """flash-attn's ``bert_padding.unpad_input``: the rows where ``attention_mask`` is set, and their bookkeeping."""
    mask = attention_mask if unused_mask is None else attention_mask + unused_mask
    seqlens = mask.sum(dim=-1, dtype=torch.int32)
    used = attention_mask.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(mask.flatten(), as_tuple=False).flatten()
    cu_seqlens = F.pad(torch.cumsum(seqlens, dim=0, dtype=torch.int32), (1, 0))
    flat = hidden_states.reshape(-1, *hidden_states.shape[2:])
    return flat[indices], indices, cu_seqlens, int(seqlens.max()), used


def pad_input(hidden_states, indices, batch, seqlen):
    """flash-attn's ``bert_padding.pad_input``: scatter packed rows back into ``[batch, seqlen, ...]`` (zeros
    elsewhere)."""
    out = torch.zeros(batch * seqlen, *hidden_states.shape[1:], device=hidden_states.device,
                      dtype=hidden_states.dtype)
    out[indices] = hidden_states
    return out.view(batch, seqlen, *hidden_states.shape[1:])


def install(monkeypatch) -> types.ModuleType:
    """Register the stand-in for transformers (undone by ``monkeypatch``); returns the ``flash_attn`` module."""
    import transformers.modeling_flash_attention_utils as fa_utils

    package = types.ModuleType("flash_attn")
    package.__spec__ = importlib.machinery.ModuleSpec("flash_attn", None, is_package=True)
    package.__version__ = __version__
    package.flash_attn_func = flash_attn_func
    package.flash_attn_varlen_func = flash_attn_varlen_func
    package.flash_attn_with_kvcache = flash_attn_with_kvcache
    padding = types.ModuleType("flash_attn.bert_padding")
    padding.__spec__ = importlib.machinery.ModuleSpec("flash_attn.bert_padding", None)
    padding.pad_input, padding.unpad_input = pad_input, unpad_input
    package.bert_padding = padding
    monkeypatch.setitem(sys.modules, "flash_attn", package)
    monkeypatch.setitem(sys.modules, "flash_attn.bert_padding", padding)
    monkeypatch.setattr(fa_utils, "is_flash_attn_2_available", lambda *args, **kwargs: True)
    # transformers keeps the functions of the last implementation it imported: start from none, and restore
    # whatever was there afterwards.
    for name in ("_loaded_implementation", "_flash_fn", "_flash_varlen_fn", "_flash_with_kvcache_fn", "_pad_fn",
                 "_unpad_fn", "_process_flash_kwargs_fn", "_process_with_kvcache_kwargs_fn"):
        monkeypatch.setattr(fa_utils, name, None)
    return package


def use_flash_attention_2(model) -> None:
    """Switch a model built with another attention to ``flash_attention_2``, as ``from_pretrained(...,
    attn_implementation="flash_attention_2")`` leaves it (its load-time checks want a GPU; the forward is what the
    stand-in serves)."""
    model.config._attn_implementation = "flash_attention_2"
