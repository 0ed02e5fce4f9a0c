"""Staged MACER pruning inside one decoder prefill, installed as a reversible patch (``macer.compress``).

The machinery here is model-independent; an adapter (``macer.adapters``) says where the decoder is and how to label
a prompt's tokens. Procedure (``tab:macer_algorithm``; layers counted from 1):

1. At the start of a prefill (the decoder runs with an empty cache) the prompt's audio/visual counts give the budget
   ``split_budget(n_a, n_v, rho, alpha)``, computed once. The question rows Q are the last ``query_tokens`` tokens
   before the prompt's last end-of-turn token.
2. Inside the attention call of ``layers[l - 1]`` for a readout layer l (``audio_layer`` / ``video_layer``), a
   registered attention function (transformers' ``AttentionInterface``) runs the user's backend unchanged and hands
   Q's post-RoPE queries and that layer's post-RoPE keys to ``macer_kernels.modality_scores`` (``eq:macer_score``).
   Audio keeps ``topk_indices`` of its scores (``Top-k``), video ``coverage_select`` over chunks from the temporal
   M-RoPE row (``eq:chunk_coverage_greedy``).
3. A forward pre-hook on ``layers[l]`` compacts, in one ``compact_many``: the hidden states, RoPE ``cos``/``sin``
   and per-token position ids; the 4-D attention mask is compacted along queries and keys (for a causal mask over a
   sorted subset this *is* the causal mask of the shorter sequence; SDPA's ``None`` mask stays ``None``). Text is
   never dropped, order is preserved, and every later layer receives the compacted tensors.
4. Layers keep the KV cache of the sequence they saw (the paper's single pass): full before the first stage. After
   prefill, with ``trim_early_cache``, the dropped tokens are also removed from the earlier layers' caches.
5. Decoding: ``generate`` passes explicit positions, so only the mask needs care: a mask tensor sized against
   layer 0's cache is compacted along keys to each layer's own cache rows.
"""

from __future__ import annotations

import contextlib
import inspect
import threading
import time
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from macer.adapters import AUDIO, TEXT, VISUAL, Adapter, DecoderParts, get_adapter
from macer.config import MacerConfig
from macer.trace import PrefillRecord, Stage, Trace
from macer_kernels import (
    compact,
    compact_many,
    coverage_select,
    modality_scores,
    split_budget,
    temporal_chunks,
    topk_indices,
)

__all__ = ["SUPPORTED_ATTENTION", "compress"]

SUPPORTED_ATTENTION = ("sdpa", "eager", "flash_attention_2")
"""Attention implementations the patch wraps (the user's choice runs unchanged)."""

_PREFIX = "macer_"
_lock = threading.Lock()
# id(attention module) -> (session, layer index): how the registered attention function finds its session.
_ACTIVE: dict[int, tuple[_Session, int]] = {}
# registered macer attention names -> number of live sessions using them
_NAMES_IN_USE: dict[str, int] = {}

_MODALITY_NAMES = {AUDIO: "audio", VISUAL: "video"}


def _base_attention(base: str, module: nn.Module):
    """The user's attention function for ``module``: transformers' registered one, or the modeling file's eager."""
    if base == "eager":
        return inspect.getmodule(type(module)).eager_attention_forward
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return ALL_ATTENTION_FUNCTIONS[base]


def _make_attention(base: str):
    def macer_attention(module, query, key, value, attention_mask, **kwargs):
        entry = _ACTIVE.get(id(module))
        if entry is not None:
            entry[0]._readout(entry[1], module, query, key, kwargs)
        return _base_attention(base, module)(module, query, key, value, attention_mask, **kwargs)

    macer_attention.__name__ = f"{_PREFIX}{base}"
    return macer_attention


def _register_names(base: str) -> str:
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.modeling_utils import AttentionInterface

    name = f"{_PREFIX}{base}"
    with _lock:
        if _NAMES_IN_USE.get(name, 0) == 0:
            AttentionInterface.register(name, _make_attention(base))
            # Without a mask function of the same name, create_causal_mask silently returns None.
            AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[base])
        _NAMES_IN_USE[name] = _NAMES_IN_USE.get(name, 0) + 1
    return name


def _unregister_names(name: str) -> None:
    from transformers.masking_utils import AttentionMaskInterface
    from transformers.modeling_utils import AttentionInterface

    with _lock:
        _NAMES_IN_USE[name] -= 1
        if _NAMES_IN_USE[name] == 0:
            del _NAMES_IN_USE[name]
            AttentionInterface._global_mapping.pop(name, None)
            AttentionMaskInterface._global_mapping.pop(name, None)


@contextlib.contextmanager
def compress(model: nn.Module, config: MacerConfig, *, profile: bool = False) -> Iterator[Trace]:
    """Run MACER's staged pruning in every prefill of ``model`` inside the ``with`` block.

    ``model(**inputs)`` and ``model.generate(**inputs)`` work as usual (batch size 1); each prefill is pruned on its
    own, decoding runs on the compacted caches, and leaving the block (also by an exception) restores the model
    exactly: hooks removed, attention implementation restored, nothing else touched.

    Args:
        model: a model whose ``config.model_type`` has an adapter (``macer.adapters.supported_model_types()``).
        config: ``MacerConfig``; its readout layers must lie in ``[1, num_layers - 1]``.
        profile: synchronise the device around MACER's own work and record it in ``PrefillRecord.overhead_s``.

    Yields:
        ``macer.Trace``: budgets, kept tokens, tokens per layer and cache lengths of every prefill.
    """
    if not isinstance(config, MacerConfig):
        raise TypeError(f"macer.compress: config must be a macer.MacerConfig, got {type(config).__name__}")
    adapter = get_adapter(model)
    parts = adapter.parts(model)
    config.check_depth(len(parts.layers))
    if any(id(module) in _ACTIVE for layer in parts.layers for module in layer.modules()):
        raise ValueError("macer.compress: this model is already inside a macer.compress context")
    base = parts.attn_config._attn_implementation
    if base not in SUPPORTED_ATTENTION:
        raise ValueError(f"macer.compress: attention implementation {base!r} is not supported; "
                         f"supported: {list(SUPPORTED_ATTENTION)}")
    layer_types = getattr(parts.attn_config, "layer_types", None) or []
    if any(t != "full_attention" for t in layer_types):
        raise ValueError(f"macer.compress: only full-attention decoders are supported, got layer_types "
                         f"{sorted(set(layer_types))} (sliding-window caches cannot be compacted)")
    session = _Session(model, config, adapter, parts, base, profile)
    session.install()
    try:
        yield session.trace
    finally:
        session.uninstall()


@dataclass
class _Prefill:
    """State of one prefill pass through the decoder."""

    labels: torch.Tensor  # [N] modality label per prompt token
    temporal: torch.Tensor  # [N] temporal position per prompt token
    question: torch.Tensor  # [Lq] prompt positions of the question rows
    stages: list[tuple[int, tuple[int, ...]]]  # (0-based readout layer index, modalities) sorted by layer
    budget: Any
    record: PrefillRecord
    current: torch.Tensor  # prompt positions of the rows currently in the sequence
    pending: torch.Tensor | None = None  # rows of the current sequence to keep, applied at the next layer
    inputs: dict[str, Any] = field(default_factory=dict)  # compacted per-token layer kwargs after the last stage
    layer_rows: list[torch.Tensor] = field(default_factory=list)  # rows present at each layer (= its cache rows)
    overhead: float = 0.0


class _Session:
    """One ``compress`` context: hooks, the per-prefill state, and the rows each cached layer holds."""

    def __init__(self, model, config: MacerConfig, adapter: Adapter, parts: DecoderParts, base: str, profile: bool):
        self.model, self.config, self.adapter, self.parts = model, config, adapter, parts
        self.base, self.profile = base, profile
        self.trace = Trace()
        self.handles: list[Any] = []
        self.name: str | None = None
        self.prompt_ids: torch.Tensor | None = None
        self.state: _Prefill | None = None
        # cache object -> (prompt rows held by each layer, prompt length): decode sizes masks per layer from them
        self.caches: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.decode_rows: list[torch.Tensor] | None = None
        self.decode_masks: dict[tuple[int, int], torch.Tensor] = {}

    # ---------------------------------------------------------------- install / uninstall
    def install(self) -> None:
        try:
            self.name = _register_names(self.base)
            self.parts.attn_config._attn_implementation = self.name
            for i, layer in enumerate(self.parts.layers):
                for module in layer.modules():
                    if hasattr(module, "layer_idx"):
                        _ACTIVE[id(module)] = (self, i)
                self.handles.append(layer.register_forward_pre_hook(self._layer_hook(i), with_kwargs=True))
            for outer in self.parts.outer:
                self.handles.append(outer.register_forward_pre_hook(self._outer_hook, with_kwargs=True))
            self.handles.append(self.parts.root.register_forward_pre_hook(self._root_hook, with_kwargs=True))
            self.handles.append(self.parts.decoder.register_forward_pre_hook(self._begin, with_kwargs=True))
            self.handles.append(self.parts.decoder.register_forward_hook(self._end, with_kwargs=True))
        except BaseException:
            self.uninstall()
            raise

    def uninstall(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
        for layer in self.parts.layers:
            for module in layer.modules():
                if _ACTIVE.get(id(module), (None,))[0] is self:
                    del _ACTIVE[id(module)]
        if self.name is not None:
            self.parts.attn_config._attn_implementation = self.base
            _unregister_names(self.name)
            self.name = None
        self.state = None

    # ---------------------------------------------------------------- hooks
    def _outer_hook(self, module, args, kwargs):
        if kwargs.get("labels") is not None:
            raise ValueError("macer.compress: labels (a training loss) are not supported; a pruned prefill returns "
                             "logits for the kept tokens only. Call the model outside compress for a loss.")

    def _root_hook(self, module, args, kwargs):
        self.prompt_ids = kwargs.get("input_ids", args[0] if args else None)

    def _begin(self, module, args, kwargs):
        """Decoder pre-hook: start a prefill (empty cache) or a decode step (non-empty cache)."""
        input_ids, self.prompt_ids = self.prompt_ids, None
        self.state, self.decode_rows = None, None
        self.decode_masks.clear()
        embeds = kwargs.get("inputs_embeds")
        tokens = embeds if embeds is not None else kwargs.get("input_ids", args[0] if args else None)
        batch, length, device = tokens.shape[0], tokens.shape[1], tokens.device
        cache = kwargs.get("past_key_values")
        if cache is not None and cache.get_seq_length() > 0:
            return self._begin_decode(cache, args, kwargs)
        if batch != 1:
            raise ValueError(f"macer.compress supports batch size 1 for now; got a batch of {batch} (generate with "
                             "num_beams > 1 or num_return_sequences > 1 also expands the batch: beam search and "
                             "several returned sequences are not supported; greedy and sampling are)")
        if cache is not None and getattr(cache, "is_compileable", False):
            raise ValueError(f"macer.compress: {type(cache).__name__} is not supported (static caches cannot hold "
                             "layers of different lengths); use the default DynamicCache")
        mask = kwargs.get("attention_mask")
        if isinstance(mask, dict):
            raise ValueError("macer.compress: precomputed attention-mask dicts are not supported; pass a 2-D mask")
        if isinstance(mask, torch.Tensor) and mask.ndim == 2 and not bool(mask.bool().all()):
            raise ValueError("macer.compress: attention_mask has padding (zeros); batch size 1 without padding only")
        if isinstance(mask, torch.Tensor) and mask.ndim != 2:
            raise ValueError(f"macer.compress: attention_mask must be 2-D [1, N], got shape {tuple(mask.shape)}")
        if input_ids is None or input_ids.shape[-1] != length:
            raise ValueError("macer.compress needs the prompt's input_ids to label audio/video tokens; a prefill "
                             "from inputs_embeds alone is not supported")
        self.state = self._plan(input_ids.to(device), kwargs, length, device)
        return None

    def _begin_decode(self, cache, args, kwargs):
        entry = self.caches.get(cache)
        if entry is None:
            return None  # a cache this session did not prune: every layer holds the same rows, nothing to do
        rows, prompt_len = entry
        self.decode_rows = rows
        mask = kwargs.get("attention_mask")
        if isinstance(mask, torch.Tensor) and mask.ndim == 2 and rows[0].numel() != prompt_len:
            # trim_early_cache: layer 0 holds only the kept prompt rows; a 2-D mask over the original prompt must
            # lose the dropped columns to line up with it.
            tail = torch.arange(prompt_len, mask.shape[-1], device=mask.device)
            kwargs["attention_mask"] = compact(mask, torch.cat([rows[0].to(mask.device), tail]), dim=-1)
            return args, kwargs
        return None

    def _layer_hook(self, index: int):
        def hook(module, args, kwargs):
            if self.state is not None:
                return self._prefill_layer(index, args, kwargs)
            if self.decode_rows is not None:
                return self._decode_layer(index, args, kwargs)
            return None

        return hook

    def _end(self, module, args, kwargs, output):
        """Decoder post-hook: finish a prefill (cache bookkeeping, optional trimming, trace record)."""
        state, self.state = self.state, None
        if state is None:
            return None
        start = self._tick()
        record = state.record
        cache = getattr(output, "past_key_values", None)
        cache = kwargs.get("past_key_values") if cache is None else cache
        n = state.labels.numel()
        rows = list(state.layer_rows)
        if cache is not None and len(rows) == len(self.parts.layers) and state.record.stages:
            final = state.current
            if self.config.trim_early_cache:
                for i, layer_rows in enumerate(rows):
                    if layer_rows.numel() != final.numel():
                        keep = torch.searchsorted(layer_rows, final)
                        layer = cache.layers[i]
                        layer.keys, layer.values = compact_many([layer.keys, layer.values], keep, [-2, -2])
                rows = [final] * len(rows)
            if any(r.numel() != n for r in rows):
                self.caches[cache] = (rows, n)
        if cache is not None:
            record.cache_lengths = [int(layer.get_seq_length()) for layer in cache.layers[: len(self.parts.layers)]]
        state.overhead += self._tock(start)
        record.overhead_s = state.overhead if self.profile else None
        kept = state.labels[state.current]
        record.audio_kept = state.current[kept == AUDIO].tolist()
        record.video_kept = state.current[kept == VISUAL].tolist()
        self.trace.history.append(record)
        return None

    # ---------------------------------------------------------------- prefill
    def _plan(self, input_ids: torch.Tensor, kwargs: dict[str, Any], n: int, device: torch.device) -> _Prefill:
        cfg = self.config
        labels = self.adapter.labels(self.model, input_ids).to(device)
        n_audio, n_video = int((labels == AUDIO).sum()), int((labels == VISUAL).sum())
        question = torch.empty(0, dtype=torch.long)
        if n_audio + n_video:
            question = self._question_rows(input_ids.reshape(-1), labels)
        question = question.to(device)
        record = PrefillRecord(prompt_length=n, n_audio=n_audio, n_video=n_video, budget=None,
                               query_positions=question.tolist())
        stages: list[tuple[int, tuple[int, ...]]] = []
        budget = None
        if n_audio + n_video:
            budget = split_budget(n_audio, n_video, cfg.keep_ratio, cfg.audio_share)
            record.budget = budget
            wanted = [(cfg.audio_layer - 1, AUDIO, n_audio), (cfg.video_layer - 1, VISUAL, n_video)]
            for layer in sorted({w[0] for w in wanted}):
                mods = tuple(m for lay, m, count in wanted if lay == layer and count > 0)
                if mods:
                    stages.append((layer, mods))
        temporal = self.adapter.temporal_positions(kwargs, n, device).to(device)
        return _Prefill(labels=labels, temporal=temporal, question=question, stages=stages, budget=budget,
                        record=record, current=torch.arange(n, device=device))

    def _question_rows(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        cfg = self.config
        n = ids.numel()
        end = n
        if cfg.end_of_turn_token_id is not None:
            hits = (ids == cfg.end_of_turn_token_id).nonzero()
            if hits.numel():
                end = int(hits[-1])
        if end < cfg.query_tokens:
            raise ValueError(f"macer.compress: the question span needs query_tokens={cfg.query_tokens} tokens before "
                             f"the last end-of-turn token (position {end}); the prompt has only {end} there")
        rows = torch.arange(end - cfg.query_tokens, end)
        last_mm = int((labels != TEXT).nonzero()[-1])
        if int(rows[0]) <= last_mm:
            raise ValueError(
                    f"macer.compress: the question rows (prompt positions {int(rows[0])}..{int(rows[-1])}: the last "
                    f"query_tokens={cfg.query_tokens} tokens before the last end-of-turn token "
                    f"{cfg.end_of_turn_token_id}) must come after every audio/video token (last at {last_mm}); "
                    "check end_of_turn_token_id and the prompt layout")
        return rows

    def _readout(self, index: int, module: nn.Module, query: torch.Tensor, key: torch.Tensor,
                 kwargs: dict[str, Any]) -> None:
        """Inside the attention call of ``layers[index]``: score and select when a stage reads this layer."""
        state = self.state
        if state is None or not state.stages or state.stages[0][0] != index:
            return
        _, modalities = state.stages.pop(0)
        start = self._tick()
        cfg = self.config
        current = state.current
        labels = state.labels[current]
        rows = torch.searchsorted(current, state.question)
        scale = kwargs.get("scaling") or getattr(module, "scaling", None)
        scores = modality_scores(query[:, :, rows], key, labels[None], rows[None], scale=scale, eps=cfg.eps)[0]
        keep = torch.ones(current.numel(), dtype=torch.bool, device=current.device)
        for modality in modalities:
            members = (labels == modality).nonzero().reshape(-1)
            if modality == AUDIO:
                chosen = topk_indices(scores[members], state.budget.audio)
            else:
                chunks = temporal_chunks(state.temporal[current[members]], cfg.num_chunks)
                chosen = coverage_select(scores[members], chunks, state.budget.video, cfg.coverage_weight)
            keep[members] = False
            keep[members[chosen]] = True
        before = current.numel()
        kept = keep.nonzero().reshape(-1)
        state.record.stages.append(Stage(layer=index + 1, modalities=tuple(_MODALITY_NAMES[m] for m in modalities),
                                         tokens_before=before, tokens_after=kept.numel()))
        if kept.numel() < before:
            state.pending = kept
        state.overhead += self._tock(start)

    def _prefill_layer(self, index: int, args: tuple, kwargs: dict[str, Any]):
        state = self.state
        if state.pending is not None:
            start = self._tick()
            keep, state.pending = state.pending, None
            hidden = args[0] if args else kwargs["hidden_states"]
            names, tensors, dims = ["hidden_states"], [hidden], [1]
            source = state.inputs or kwargs
            cos, sin = source[self.adapter.position_embeddings_kwarg]
            names += ["cos", "sin"]
            tensors += [cos, sin]
            dims += [1, 1]
            for name, dim in self.adapter.layer_token_kwargs.items():
                if isinstance(source.get(name), torch.Tensor):
                    names.append(name)
                    tensors.append(source[name])
                    dims.append(dim)
            out = dict(zip(names, compact_many(tensors, keep, dims)))
            inputs = {self.adapter.position_embeddings_kwarg: (out.pop("cos"), out.pop("sin"))}
            hidden = out.pop("hidden_states")
            inputs.update(out)
            mask = source.get("attention_mask")
            if isinstance(mask, torch.Tensor):
                # Rows and columns of a causal mask restricted to a sorted subset = the causal mask of the subset.
                mask = compact(mask, keep, dim=-1)
                if mask.ndim == 4:
                    mask = compact(mask, keep, dim=-2)
            inputs["attention_mask"] = mask
            state.inputs = inputs
            state.current = state.current[keep]
            args = (hidden, *args[1:]) if args else args
            if not args:
                kwargs["hidden_states"] = hidden
            state.overhead += self._tock(start)
        if state.inputs:
            kwargs.update(state.inputs)
        hidden = args[0] if args else kwargs["hidden_states"]
        state.record.layer_tokens.append(int(hidden.shape[1]))
        state.layer_rows.append(state.current)
        return args, kwargs

    # ---------------------------------------------------------------- decode
    def _decode_layer(self, index: int, args: tuple, kwargs: dict[str, Any]):
        mask = kwargs.get("attention_mask")
        rows = self.decode_rows
        if not isinstance(mask, torch.Tensor) or rows[index] is rows[0]:
            return None
        key = (id(rows[index]), id(mask))
        if key not in self.decode_masks:
            base = rows[0].to(mask.device)
            own = torch.searchsorted(base, rows[index].to(mask.device))
            tail = torch.arange(base.numel(), mask.shape[-1], device=mask.device)
            self.decode_masks[key] = compact(mask, torch.cat([own, tail]), dim=-1)
        kwargs["attention_mask"] = self.decode_masks[key]
        return args, kwargs

    # ---------------------------------------------------------------- timing
    def _sync(self) -> None:
        if self.profile and torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()

    def _tick(self) -> float:
        self._sync()
        return time.perf_counter()

    def _tock(self, start: float) -> float:
        self._sync()
        return time.perf_counter() - start
