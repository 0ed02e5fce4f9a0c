"""What a keep ratio costs: the paper's cost model and exact accounting of one run.

Two views, both in this module:

* **The paper's model** (Appendix E of ``macer_paper.tex``). Closed forms in the keep ratio rho and a few per-model
  constants: the multimodal token-layer proxy ``eq:appendix_efficiency`` and the attention-corrected FLOPs ratios of
  input-prune methods ``eq:appendix_input_flops`` and probe-prune methods ``eq:appendix_probe_flops``. They reproduce
  ``tab:token_layer_cost``, ``tab:flops_ratios_macer`` and the FLOPs column of ``tab:main`` (see ``docs/cost.md`` for
  the two printed cells they miss by 0.1 point).
* **Exact accounting** of a run. From the sequence length entering each decoder layer (``trace.layer_tokens`` of
  ``macer.compress``, or ``staged_layer_tokens`` for a hypothetical run) and the model's text config: the
  token-layer ratio (text tokens included, the earlier audio stage credited), decoder FLOPs split into the linear
  (projection + MLP) and causal-attention terms, the KV-cache bytes after prefill, and the attention share eta that
  the paper's FLOPs formulas take as a constant.

All ratios are "MACER / full prefill" of the same prompt. The closed forms accept ``float`` or
``fractions.Fraction`` and compute in the type given, so exact inputs give exact ratios.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction
from itertools import pairwise
from typing import Any

import torch

from macer.core.checks import check_count, check_real
from macer_kernels import decimal_fraction

Real = float | Fraction

__all__ = [
    "FASTV_PRUNE_LAYER",
    "METHOD_PRUNE_STYLE",
    "PAPER_CONSTANTS",
    "CostConstants",
    "DecoderFlops",
    "DecoderShape",
    "RunCost",
    "attention_share",
    "decoder_flops",
    "input_prune_flops_ratio",
    "kv_cache_bytes",
    "paper_flops_ratio",
    "policy_flops_ratio",
    "policy_layer_tokens",
    "policy_token_layer_proxy",
    "probe_prune_flops_ratio",
    "run_cost",
    "staged_layer_tokens",
    "token_layer_proxy",
    "trace_cost",
]


@dataclass(frozen=True)
class CostConstants:
    """Per-model constants of the paper's cost model (Appendix E, ``app:flops_accounting``).

    ``num_layers`` is L, ``prune_layer`` is ``L_p = max(l_a, l_v)`` (the later readout layer, counted from 1) and
    ``attention_share`` is eta, the attention share of the decoder computation.
    """

    num_layers: int
    prune_layer: int
    attention_share: float


PAPER_CONSTANTS: dict[str, CostConstants] = {
    "qwen2.5-omni-7b": CostConstants(num_layers=28, prune_layer=5, attention_share=0.235),
    "qwen2.5-omni-3b": CostConstants(num_layers=36, prune_layer=7, attention_share=0.36),
}
"""The constants the paper states for its two backbones (``app:flops_accounting``)."""

FASTV_PRUNE_LAYER = 5
"""L_p with which ``tab:main`` charges FastV. The paper does not state it; 5 is the only integer L_p for which
``eq:appendix_probe_flops`` gives the printed FastV cells on both scales (54.1% on 7B, 49.2% on 3B), see
``tests/tools/test_cost.py``."""

METHOD_PRUNE_STYLE: dict[str, str] = {"macer": "probe", "fastv": "probe", "omnizip": "input", "random": "input"}
"""How ``tab:main`` charges each method: ``"input"`` = pruned before the decoder (``eq:appendix_input_flops``),
``"probe"`` = full context up to a shallow readout layer, pruned after it (``eq:appendix_probe_flops``)."""


def _ratio(name: str, value: Any, lo: float, hi: float, *, lo_open: bool = False) -> Real:
    """Validate a real number in an interval; keep a ``Fraction`` a ``Fraction`` so exact inputs stay exact."""
    check_real(name, value, lo, hi, lo_open=lo_open)
    return value if isinstance(value, Fraction) else float(value)


def _depth(num_layers: Any, prune_layer: Any) -> tuple[int, int]:
    num_layers = check_count("num_layers", num_layers)
    if num_layers < 1:
        raise ValueError(f"num_layers must be an integer >= 1, got {num_layers}")
    prune_layer = check_count("prune_layer", prune_layer)
    if prune_layer > num_layers:
        raise ValueError(f"prune_layer must be in [0, num_layers={num_layers}], got {prune_layer}")
    return num_layers, prune_layer


def token_layer_proxy(keep_ratio: Real, num_layers: int, prune_layer: int) -> Real:
    """Multimodal token-layer cost proxy, ``eq:appendix_efficiency``: ``(L_p + rho (L - L_p)) / L``.

    The multimodal tokens pass ``L_p`` layers at full length and ``L - L_p`` layers at ``rho`` of it; text tokens
    and the quadratic attention term are ignored (``tab:token_layer_cost``).

    Args:
        keep_ratio: rho in (0, 1].
        num_layers: L >= 1.
        prune_layer: L_p in [0, L], the last layer that still sees every multimodal token (counted from 1).
    """
    rho = _ratio("keep_ratio", keep_ratio, 0.0, 1.0, lo_open=True)
    num_layers, prune_layer = _depth(num_layers, prune_layer)
    return (prune_layer + rho * (num_layers - prune_layer)) / num_layers


def input_prune_flops_ratio(keep_ratio: Real, attention_share: Real) -> Real:
    """Attention-corrected FLOPs ratio of a method that prunes before the decoder, ``eq:appendix_input_flops``:
    ``rho (1 - eta (1 - rho))``.

    With eta the attention share of the full decoder, the linear part scales by rho and the attention part by
    rho^2: ``(1 - eta) rho + eta rho^2``.

    Args:
        keep_ratio: rho in (0, 1].
        attention_share: eta in [0, 1].
    """
    rho = _ratio("keep_ratio", keep_ratio, 0.0, 1.0, lo_open=True)
    eta = _ratio("attention_share", attention_share, 0.0, 1.0)
    return rho * (1 - eta * (1 - rho))


def probe_prune_flops_ratio(keep_ratio: Real, num_layers: int, prune_layer: int, attention_share: Real) -> Real:
    """Attention-corrected FLOPs ratio of a method that reads a shallow layer on the full context and prunes after
    it, ``eq:appendix_probe_flops``: ``(L_p + (L - L_p) rho (1 - eta (1 - rho))) / L``.

    Args:
        keep_ratio: rho in (0, 1].
        num_layers: L >= 1.
        prune_layer: L_p in [0, L]; for MACER ``max(l_a, l_v)`` (charges all multimodal tokens up to the later
            readout, no credit for the earlier audio stage).
        attention_share: eta in [0, 1].
    """
    num_layers, prune_layer = _depth(num_layers, prune_layer)
    pruned = input_prune_flops_ratio(keep_ratio, attention_share)
    return (prune_layer + (num_layers - prune_layer) * pruned) / num_layers


def paper_flops_ratio(method: str, model: str, keep_ratio: Real) -> Real:
    """The FLOPs ratio ``tab:main`` reports for ``method`` on ``model`` at ``keep_ratio`` (the retained ratio).

    Args:
        method: one of ``METHOD_PRUNE_STYLE`` (``"macer"``, ``"fastv"``, ``"omnizip"``, ``"random"``).
        model: one of ``PAPER_CONSTANTS`` (``"qwen2.5-omni-7b"``, ``"qwen2.5-omni-3b"``).
        keep_ratio: rho in (0, 1].
    """
    if method not in METHOD_PRUNE_STYLE:
        raise ValueError(f"method must be one of {sorted(METHOD_PRUNE_STYLE)}, got {method!r}")
    if model not in PAPER_CONSTANTS:
        raise ValueError(f"model must be one of {sorted(PAPER_CONSTANTS)}, got {model!r}")
    c = PAPER_CONSTANTS[model]
    # The constants are decimal numbers: an exact keep ratio gets the exact eta, read as split_budget reads its
    # ratios (one definition: decimal_fraction), so the result stays exact.
    eta = decimal_fraction(c.attention_share) if isinstance(keep_ratio, Fraction) else c.attention_share
    if METHOD_PRUNE_STYLE[method] == "input":
        return input_prune_flops_ratio(keep_ratio, eta)
    prune_layer = FASTV_PRUNE_LAYER if method == "fastv" else c.prune_layer
    return probe_prune_flops_ratio(keep_ratio, c.num_layers, prune_layer, eta)


def policy_flops_ratio(policy: Any, model: str) -> Real:
    """The paper's FLOPs ratio (``eq:appendix_probe_flops``) of a selection policy on one of its backbones.

    A policy prunes its multimodal tokens to ``keep_ratio`` after ``policy.prune_layer`` full-length layers: MACER
    at ``L_p = max(l_a, l_v)``, FastV as probe-prune at ``L_p = layer``, Random as input-prune (``L_p = 0``, where the
    formula is ``eq:appendix_input_flops``). ``policy_flops_ratio(RandomConfig(0.55), "qwen2.5-omni-7b")`` and
    ``FastVConfig(0.5, layer=FASTV_PRUNE_LAYER)`` give ``tab:main``'s Random and FastV cells.

    Args:
        policy: a ``macer`` policy (``keep_ratio`` and ``prune_layer``).
        model: one of ``PAPER_CONSTANTS``.
    """
    if model not in PAPER_CONSTANTS:
        raise ValueError(f"model must be one of {sorted(PAPER_CONSTANTS)}, got {model!r}")
    c = PAPER_CONSTANTS[model]
    return probe_prune_flops_ratio(policy.keep_ratio, c.num_layers, policy.prune_layer, c.attention_share)


def policy_token_layer_proxy(policy: Any, num_layers: int) -> Real:
    """``eq:appendix_efficiency`` for a policy: ``(L_p + rho (L - L_p)) / L`` with its ``prune_layer``."""
    return token_layer_proxy(policy.keep_ratio, num_layers, policy.prune_layer)


def policy_layer_tokens(policy: Any, n_text: int, n_audio: int, n_video: int, num_layers: int) -> list[int]:
    """Sequence length entering each decoder layer when ``policy`` runs on a prompt with these counts (exact: the
    policy's own stages and budgets; a joint selection's audio/video split does not change the lengths)."""
    for name, value in (("n_text", n_text), ("n_audio", n_audio), ("n_video", n_video)):
        check_count(name, value)
    num_layers, _ = _depth(num_layers, 0)
    policy.check_depth(num_layers)
    return policy.layer_tokens(n_text, n_audio, n_video, num_layers)


# ---------------------------------------------------------------------------------------------------------------
# Exact accounting
# ---------------------------------------------------------------------------------------------------------------


def staged_layer_tokens(
    n_text: int,
    n_audio: int,
    n_video: int,
    kept_audio: int,
    kept_video: int,
    audio_layer: int,
    video_layer: int,
    num_layers: int,
) -> list[int]:
    """Sequence length entering each decoder layer under MACER's staged pruning in one prefill.

    Layers are counted from 1 as in the paper: the audio scores are read inside layer ``l_a`` and the dropped audio
    tokens are gone from layer ``l_a + 1`` on; video likewise at ``l_v``. Entry ``i`` (0-based) is
    ``n_text + (kept_audio if i >= l_a else n_audio) + (kept_video if i >= l_v else n_video)``.

    Args:
        n_text, n_audio, n_video: token counts of the prompt (non-negative).
        kept_audio, kept_video: K_a <= n_audio and K_v <= n_video (e.g. from ``macer_kernels.split_budget``).
        audio_layer, video_layer: l_a and l_v in [1, num_layers].
        num_layers: L >= 1.

    Returns:
        ``num_layers`` ints, non-increasing.
    """
    n_text, n_audio, n_video = (check_count(k, v) for k, v in
                                (("n_text", n_text), ("n_audio", n_audio), ("n_video", n_video)))
    kept_audio, kept_video = check_count("kept_audio", kept_audio), check_count("kept_video", kept_video)
    if kept_audio > n_audio:
        raise ValueError(f"kept_audio must be in [0, n_audio={n_audio}], got {kept_audio}")
    if kept_video > n_video:
        raise ValueError(f"kept_video must be in [0, n_video={n_video}], got {kept_video}")
    num_layers, _ = _depth(num_layers, 0)
    for name, layer in (("audio_layer", audio_layer), ("video_layer", video_layer)):
        if check_count(name, layer) < 1 or layer > num_layers:
            raise ValueError(f"{name} must be in [1, num_layers={num_layers}], got {layer}")
    return [n_text + (kept_audio if i >= audio_layer else n_audio) + (kept_video if i >= video_layer else n_video)
            for i in range(num_layers)]


@dataclass(frozen=True)
class DecoderShape:
    """The sizes of a decoder-only text model that its FLOPs and KV cache depend on (GQA, SwiGLU MLP)."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int

    @classmethod
    def from_config(cls, model_or_config: Any) -> DecoderShape:
        """Read the text model's sizes from a model or a config.

        Accepts a ``torch.nn.Module`` with ``.config``, a full Omni config (``thinker_config.text_config``), a thinker
        config (``text_config``) or a text config.
        """
        config = getattr(model_or_config, "config", model_or_config)
        config = getattr(config, "thinker_config", config)
        config = getattr(config, "text_config", config)
        missing = [name for name in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
                   if not isinstance(getattr(config, name, None), int)]
        if missing:
            raise ValueError(f"model_or_config must be a model or a (text) config with integer {missing}; "
                             f"got {type(model_or_config).__name__}")
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        return cls(config.hidden_size, config.intermediate_size, config.num_hidden_layers, heads, kv_heads, head_dim)

    @property
    def linear_flops_per_token(self) -> int:
        """FLOPs of one token through one layer's matmuls: q, k, v, o projections and the gate/up/down MLP (2 per
        multiply-add; biases, norms, RoPE and activations are below 0.1% and left out)."""
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return 2 * (self.hidden_size * (q + 2 * kv) + q * self.hidden_size + 3 * self.hidden_size
                    * self.intermediate_size)

    def attention_flops(self, n: int) -> int:
        """FLOPs of causal self-attention over ``n`` tokens in one layer: ``QK^T`` and ``AV``, each
        ``Hq d n (n + 1) / 2`` multiply-adds (query ``i`` sees ``i + 1`` keys)."""
        return 2 * self.num_heads * self.head_dim * n * (n + 1)

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """Bytes one token occupies in one layer's KV cache (keys and values)."""
        return 2 * self.num_kv_heads * self.head_dim * dtype_bytes


@dataclass(frozen=True)
class DecoderFlops:
    """Prefill FLOPs of the decoder layers (the LM head and the encoders are not included)."""

    linear: int
    attention: int

    @property
    def total(self) -> int:
        return self.linear + self.attention


def _layer_tokens(layer_tokens: Sequence[int], shape: DecoderShape | None = None) -> list[int]:
    tokens = [check_count(f"layer_tokens[{i}]", n) for i, n in enumerate(layer_tokens)]
    if not tokens:
        raise ValueError("layer_tokens must list the sequence length of at least one layer, got an empty sequence")
    if shape is not None and len(tokens) != shape.num_layers:
        raise ValueError(f"layer_tokens must have one entry per decoder layer ({shape.num_layers}), got {len(tokens)}")
    return tokens


def decoder_flops(layer_tokens: Sequence[int], model_or_config: Any) -> DecoderFlops:
    """Prefill FLOPs of the decoder when layer ``i`` processes ``layer_tokens[i]`` tokens.

    Each layer costs ``n * linear_flops_per_token + attention_flops(n)``: after a stage boundary a layer's queries
    and keys are both the shorter sequence (its cache holds only the kept tokens).

    Args:
        layer_tokens: one non-negative length per decoder layer.
        model_or_config: anything ``DecoderShape.from_config`` reads, or a ``DecoderShape``.
    """
    shape = model_or_config if isinstance(model_or_config, DecoderShape) else DecoderShape.from_config(model_or_config)
    tokens = _layer_tokens(layer_tokens, shape)
    return DecoderFlops(linear=sum(n * shape.linear_flops_per_token for n in tokens),
                        attention=sum(shape.attention_flops(n) for n in tokens))


def attention_share(model_or_config: Any, seq_len: int) -> float:
    """eta of ``eq:appendix_input_flops``: the attention share of the full decoder's prefill FLOPs at ``seq_len``.

    The paper treats eta as a per-model constant; it grows with the context length (``docs/cost.md`` lists the
    lengths at which the real 7B and 3B configs reach the paper's 0.235 and 0.36).
    """
    shape = model_or_config if isinstance(model_or_config, DecoderShape) else DecoderShape.from_config(model_or_config)
    seq_len = check_count("seq_len", seq_len)
    if seq_len < 1:
        raise ValueError(f"seq_len must be an integer >= 1, got {seq_len}")
    flops = decoder_flops([seq_len] * shape.num_layers, shape)
    return flops.attention / flops.total


def kv_cache_bytes(layer_tokens: Sequence[int], model_or_config: Any, dtype_bytes: int = 2) -> int:
    """Bytes of the KV cache right after a prefill in which layer ``i`` cached ``layer_tokens[i]`` tokens.

    With ``trim_early_cache=False`` (the paper's single pass) the layers before a stage keep their full-length cache,
    so this equals ``sum(layer_tokens) * 2 * Hkv * d * dtype_bytes``.
    """
    shape = model_or_config if isinstance(model_or_config, DecoderShape) else DecoderShape.from_config(model_or_config)
    tokens = _layer_tokens(layer_tokens, shape)
    if check_count("dtype_bytes", dtype_bytes) < 1:
        raise ValueError(f"dtype_bytes must be an integer >= 1, got {dtype_bytes}")
    return sum(tokens) * shape.kv_bytes_per_token(dtype_bytes)


@dataclass(frozen=True)
class RunCost:
    """Cost of one MACER prefill next to the full prefill of the same prompt (see ``run_cost``)."""

    layer_tokens: tuple[int, ...]
    """Sequence length entering each decoder layer."""
    full_tokens: int
    """N, the prompt length (every layer of the full prefill sees N tokens)."""
    multimodal_tokens: int
    """n_a + n_v of the prompt."""
    kept_multimodal: int
    """K_mm = K_a + K_v."""
    prune_layer: int
    """Number of leading layers at full length (L_p = max(l_a, l_v) when both stages prune)."""
    token_layer_ratio: float
    """``sum_i layer_tokens[i] / (L N)``: all tokens, staged credit included. Also the KV-cache-bytes ratio."""
    multimodal_token_layer_ratio: float
    """Left side of ``eq:appendix_efficiency`` for the staged run: multimodal tokens only, per layer."""
    paper_proxy: float
    """Right side of ``eq:appendix_efficiency`` with rho = K_mm / (n_a + n_v) and this run's L_p."""
    flops: DecoderFlops
    full_flops: DecoderFlops
    attention_share: float
    """eta of the full prefill of this prompt."""
    shape: DecoderShape
    kv_dtype_bytes: int | None = None
    """Bytes per element of the KV cache (the model's dtype: 4 for float32, 2 for bfloat16); None when the model or
    config did not say, and 2 (bfloat16, the paper's) is assumed."""

    @property
    def flops_ratio(self) -> float:
        return self.flops.total / self.full_flops.total

    def kv_cache_bytes(self, dtype_bytes: int | None = None) -> tuple[int, int]:
        """``(MACER, full)`` KV-cache bytes right after prefill, at ``dtype_bytes`` per element (default: the run's
        ``kv_dtype_bytes``, else 2)."""
        size = dtype_bytes or self.kv_dtype_bytes or 2
        return (kv_cache_bytes(self.layer_tokens, self.shape, size),
                kv_cache_bytes([self.full_tokens] * self.shape.num_layers, self.shape, size))

    def summary(self) -> str:
        """A few lines a user can print after a run, in units that fit the model's size."""
        macer_kv, full_kv = self.kv_cache_bytes()
        dtype = (f"{self.kv_dtype_bytes}-byte elements" if self.kv_dtype_bytes else
                 "2-byte elements assumed: the model's dtype is unknown, pass kv_dtype_bytes")
        return "\n".join([
            f"tokens per layer: {list(self.layer_tokens)} (full: {self.full_tokens})",
            f"multimodal tokens kept: {self.kept_multimodal} / {self.multimodal_tokens} in the last "
            f"{self.shape.num_layers - self.prune_layer} of {self.shape.num_layers} layers",
            f"token-layer ratio {self.token_layer_ratio:.1%} (multimodal only {self.multimodal_token_layer_ratio:.1%},"
            f" paper proxy {self.paper_proxy:.1%})",
            f"decoder prefill FLOPs {_scaled(self.flops.total, self.full_flops.total, 1000, _FLOP_UNITS)} vs "
            f"{_scaled(self.full_flops.total, self.full_flops.total, 1000, _FLOP_UNITS)} full = {self.flops_ratio:.1%} "
            f"(attention share of full eta = {self.attention_share:.3f})",
            f"KV cache after prefill ({dtype}): {_scaled(macer_kv, full_kv, 1024, _BYTE_UNITS)} vs "
            f"{_scaled(full_kv, full_kv, 1024, _BYTE_UNITS)} full",
        ])


_FLOP_UNITS = ("FLOP", "kFLOP", "MFLOP", "GFLOP", "TFLOP", "PFLOP", "EFLOP")
_BYTE_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def _scaled(value: float, reference: float, step: int, units: Sequence[str]) -> str:
    """``value`` in the largest unit in which ``reference`` is at least 1 (both numbers of a comparison in one unit),
    to 3 significant digits."""
    power = 0
    while power + 1 < len(units) and abs(reference) >= step ** (power + 1):
        power += 1
    return f"{value / step**power:.3g} {units[power]}"


def _kv_element_size(model_or_config: Any) -> int | None:
    """Bytes per element of the KV cache a model writes: its first floating parameter's (the k/v projections compute
    in the weights' dtype); for a config, its ``dtype`` (or the thinker's or text config's); None if neither says."""
    if isinstance(model_or_config, torch.nn.Module):
        return next((p.element_size() for p in model_or_config.parameters() if p.is_floating_point()), None)
    top = model_or_config
    for config in (top, getattr(top, "thinker_config", None), getattr(top, "text_config", None)):
        dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype, None)
        if isinstance(dtype, torch.dtype):
            return dtype.itemsize
    return None


def run_cost(layer_tokens: Sequence[int], model_or_config: Any, multimodal_tokens: int,
             prompt_length: int | None = None, kv_dtype_bytes: int | None = None) -> RunCost:
    """Exact cost of a prefill whose layer ``i`` saw ``layer_tokens[i]`` tokens, against the full prefill.

    Args:
        layer_tokens: one length per decoder layer; the last entry is ``n_text + K_mm``.
        model_or_config: anything ``DecoderShape.from_config`` reads, or a ``DecoderShape``.
        multimodal_tokens: n_a + n_v of the prompt, in ``[N - layer_tokens[-1], N]``.
        prompt_length: N; default ``layer_tokens[0]`` (right for MACER and FastV, which never prune before layer 1
            has run; a policy that prunes before the decoder, ``RandomConfig``, must pass it).
        kv_dtype_bytes: bytes per KV-cache element; default the model's dtype (its parameters', or a config's
            ``dtype``), unknown for a ``DecoderShape`` (then 2 is assumed and ``summary`` says so).
    """
    shape = model_or_config if isinstance(model_or_config, DecoderShape) else DecoderShape.from_config(model_or_config)
    tokens = _layer_tokens(layer_tokens, shape)
    if kv_dtype_bytes is None:
        kv_dtype_bytes = None if isinstance(model_or_config, DecoderShape) else _kv_element_size(model_or_config)
    elif check_count("kv_dtype_bytes", kv_dtype_bytes) < 1:
        raise ValueError(f"kv_dtype_bytes must be an integer >= 1, got {kv_dtype_bytes}")
    if any(b > a for a, b in pairwise(tokens)):
        raise ValueError(f"layer_tokens must be non-increasing (tokens are only ever dropped), got {tokens}")
    n = tokens[0] if prompt_length is None else check_count("prompt_length", prompt_length)
    if tokens[0] > n:
        raise ValueError(f"prompt_length must be >= layer_tokens[0] = {tokens[0]}, got {n}")
    dropped = n - tokens[-1]
    n_mm = check_count("multimodal_tokens", multimodal_tokens)
    if not dropped <= n_mm <= n:
        raise ValueError(f"multimodal_tokens must be in [{dropped}, {n}] (dropped tokens .. prompt length), got {n_mm}")
    n_text = n - n_mm
    num_layers = shape.num_layers
    prune_layer = next((i for i, t in enumerate(tokens) if t == tokens[-1]), num_layers)
    full = decoder_flops([n] * num_layers, shape)
    token_layers = sum(tokens)
    if n_mm:
        mm_ratio = (token_layers - n_text * num_layers) / (n_mm * num_layers)
        rho = (n_mm - dropped) / n_mm
        proxy = (prune_layer + rho * (num_layers - prune_layer)) / num_layers
    else:
        mm_ratio = proxy = 1.0
    return RunCost(
        layer_tokens=tuple(tokens), full_tokens=n, multimodal_tokens=n_mm, kept_multimodal=n_mm - dropped,
        prune_layer=prune_layer, token_layer_ratio=token_layers / (n * num_layers) if n else 1.0,
        multimodal_token_layer_ratio=mm_ratio, paper_proxy=proxy, flops=decoder_flops(tokens, shape),
        full_flops=full, attention_share=full.attention / full.total if full.total else 0.0, shape=shape,
        kv_dtype_bytes=kv_dtype_bytes)


def trace_cost(trace: Any, model_or_config: Any, kv_dtype_bytes: int | None = None) -> RunCost:
    """``run_cost`` of the last prefill recorded by ``macer.compress``: reads ``trace.layer_tokens`` and
    ``trace.budget`` (the multimodal count is ``N - layer_tokens[-1] + budget.total``); the KV element size is the
    model's dtype's unless ``kv_dtype_bytes`` is given.

    Example::

        with macer.compress(model, config) as trace:
            model.generate(**inputs, max_new_tokens=64)
        print(macer.cost.trace_cost(trace, model).summary())
    """
    layer_tokens = getattr(trace, "layer_tokens", None)
    budget = getattr(trace, "budget", None)
    if not layer_tokens or budget is None:
        raise ValueError("trace must hold a finished prefill (trace.layer_tokens and trace.budget are empty); "
                         "run the model inside `macer.compress` first")
    tokens = list(layer_tokens)
    last = getattr(trace, "last", None)
    if last is not None:  # the record knows the prompt (also for a policy that prunes before layer 1)
        return run_cost(tokens, model_or_config, last.n_audio + last.n_video, last.prompt_length, kv_dtype_bytes)
    return run_cost(tokens, model_or_config, tokens[0] - tokens[-1] + int(budget.total), None, kv_dtype_bytes)
