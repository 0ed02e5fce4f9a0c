"""Diagnostics of the paper's Sec. 3 observations and appendix figures, from a model's own queries and keys.

```python
report = macer.diagnose(model, inputs, config)
report.log_mass_ratio        # per decoder layer 1..L: log(mass_a / n_a) - log(mass_v / n_v)   (Observation 1)
report.q_centroid_cosine     # per layer: (cos(q, c_a), cos(q, c_v))                             (app:q_centroid)
report.temporal_gini         # per policy: Gini of kept audio / video tokens over 2-second blocks (tab:temporal_gini)
report.readout_sweep         # per modality: overlap of each layer's selection with the chosen layer's (Observation 3)
report.save("out/diagnose")  # JSON + PNG figures (the teaser's log-ratio-by-layer curve, per policy)
```

How: one forward of ``model(**inputs)`` with every decoder layer's attention call tapped (a registered attention
function that hands the post-RoPE queries and the layer's keys to the diagnostics, then runs the user's attention
unchanged: sdpa, eager or flash). No ``output_attentions``: the question rows' attention probabilities are recomputed
from the tapped ``Q`` and ``K`` (``softmax(scale * Q K^T)`` with the causal mask, in float32, float64 for a float64
model), which costs ``Lq x N`` per head instead of ``N x N``. Per policy, one more forward inside
``macer.compress(model, policy)`` gives the kept tokens (``temporal_gini``) and the log-ratio curve over the tokens
each layer still holds (``policy_log_mass_ratio``).

Definitions (batch size 1; rows = the question rows Q of ``config``, the last ``query_tokens`` tokens before the last
end-of-turn token; heads = the query heads, a KV head shared by its ``num_key_value_groups`` query heads):

* ``mass_m``: the attention probability the rows put on modality m's keys, averaged over rows and heads;
* ``log_mass_ratio = log(mass_a / n_a) - log(mass_v / n_v)`` (per-token masses, ``tab:q2prime_layer``);
* ``q_centroid_cosine = (cos(q, c_a), cos(q, c_v))``: ``q`` the head's mean question-row query, ``c_m`` the mean of
  modality m's keys of the head's KV head (``eq:decomp``), averaged over heads;
* ``readout_sweep[m]["overlap"][l - 1] = |S_l ∩ S_chosen| / |S_chosen|``: ``S_l`` is the selection MACER would make
  for modality m (its budget from ``split_budget``; audio top-k, video chunk-coverage greedy) from the ANMS scores
  (``eq:macer_score``) read at layer l of the unpruned forward, ``S_chosen`` the one at the config's readout layer;
* ``temporal_gini[policy][m]``: Gini coefficient of the counts of modality m's kept tokens per 2-second block of the
  clip (the temporal M-RoPE row divided by ``position_id_per_seconds * seconds_per_chunk``, the model's native
  chunk), over the blocks holding at least one token of m in the prompt; 0 = even coverage. ``"full"`` keeps all.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from macer.core.config import MacerConfig
from macer.core.policy import PromptFacts, question_rows
from macer.core.stage import score
from macer.hf.adapters import AUDIO, TEXT, VISUAL, get_adapter
from macer.hf.attention import call_as, register_refcounted, unregister_names
from macer_kernels import coverage_select, temporal_chunks, topk_indices

__all__ = ["DiagnosticReport", "default_policies", "diagnose", "gini"]

_TAP_PREFIX = "macer_diag_"
# id(attention module) -> callback(module, query, key, kwargs): how the tap finds the running diagnosis.
_TAPS: dict[int, Callable[..., None]] = {}


@dataclass
class DiagnosticReport:
    """What ``diagnose`` measured; lists indexed by decoder layer ``l - 1`` for layers ``l = 1..num_layers``."""

    num_layers: int
    prompt_length: int
    n_audio: int
    n_video: int
    query_positions: list[int]
    mass: list[tuple[float, float]]
    """Per layer ``(mass_a, mass_v)``."""
    log_mass_ratio: list[float | None]
    """Per layer ``log(mass_a / n_a) - log(mass_v / n_v)`` (> 0: audio gets more attention per token; None where a
    modality's mass is 0)."""
    q_centroid_cosine: list[tuple[float, float]]
    """Per layer ``(cos(q, c_a), cos(q, c_v))``, averaged over heads."""
    readout_sweep: dict[str, dict[str, Any]]
    """``{"audio"|"video": {"chosen_layer", "budget", "kept" (prompt positions at the chosen layer), "overlap"}}``."""
    temporal_gini: dict[str, dict[str, float | None]]
    """``{policy: {"audio": gini, "video": gini}}``; None where a modality keeps nothing."""
    policy_log_mass_ratio: dict[str, list[float | None]] = field(default_factory=dict)
    """Per policy, the log ratio at each layer over the tokens that layer holds under the policy (None once a
    modality is gone); ``"full"`` equals ``log_mass_ratio``."""
    block_positions: int = 50

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def save(self, out_dir: str | Path, *, plot: bool = True) -> list[Path]:
        """Write ``diagnostics.json`` and, with ``plot``, ``log_mass_ratio.png`` (the teaser's curve, per policy)
        and ``diagnostics.png`` (centroid cosines, readout sweep, temporal Gini) to ``out_dir``."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        paths = [out / "diagnostics.json"]
        paths[0].write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        if plot:
            from macer.tools.plots import diagnostics_figures

            paths += diagnostics_figures(self, out)
        return paths


def gini(counts: list[int] | list[float]) -> float | None:
    """Gini coefficient ``sum_ij |x_i - x_j| / (2 n^2 mean)`` of non-negative counts; None when they sum to 0."""
    n = len(counts)
    total = float(sum(counts))
    if n == 0 or total == 0:
        return None
    return sum(abs(a - b) for a in counts for b in counts) / (2 * n * total)


def default_policies(config: MacerConfig, num_layers: int) -> dict[str, Any]:
    """The policies ``diagnose`` compares by default, at ``config``'s keep ratio and question rows: ``macer``
    (``config``), ``no_coverage`` (``coverage_weight=0``, the score-only selection of ``tab:temporal_gini``),
    ``shared_topk`` (one joint top-K read at ``video_layer``, the ablation), ``fastv`` (the prompt's last row, after
    layer ``macer.cost.FASTV_PRUNE_LAYER`` = 5 as ``tab:main`` charges it, or the last prunable layer of a shallower
    decoder) and ``random`` (seed 0)."""
    from macer.core.policies import FastVConfig, RandomConfig
    from macer.tools.cost import FASTV_PRUNE_LAYER

    question: dict[str, Any] = {"query_tokens": config.query_tokens,
                                "end_of_turn_token_id": config.end_of_turn_token_id,
                                "question_span": config.question_span}
    return {
        "macer": config,
        "no_coverage": config.replace(coverage_weight=0.0),
        "shared_topk": FastVConfig(keep_ratio=config.keep_ratio, layer=config.video_layer, query="question",
                                   **question),
        "fastv": FastVConfig(keep_ratio=config.keep_ratio, layer=min(FASTV_PRUNE_LAYER, num_layers - 1),
                             **question),
        "random": RandomConfig(keep_ratio=config.keep_ratio),
    }


def diagnose(model: nn.Module, inputs: Mapping[str, Any], config: MacerConfig, *,
             policies: Mapping[str, Any] | None = None, block_positions: int | None = None) -> DiagnosticReport:
    """Measure the paper's diagnostics on one prompt (batch size 1, audio and video tokens both present).

    Args:
        model: a model with a ``macer`` adapter (``macer.supported_model_types()``), not inside ``macer.compress``.
        inputs: the keyword arguments of ``model(**inputs)``, with ``input_ids``.
        config: ``MacerConfig``: the question rows (``query_tokens``, ``end_of_turn_token_id``), the chosen readout
            layers, and the budget and selection rules of the readout sweep.
        policies: ``{name: policy}`` run inside ``macer.compress`` for ``temporal_gini`` and
            ``policy_log_mass_ratio``; default ``default_policies(config, num_layers)``: MACER, its no-coverage
            and shared top-K ablations, FastV and Random at ``config.keep_ratio``.
        block_positions: temporal M-RoPE units per block of ``temporal_gini``; default the model's 2-second chunk,
            ``position_id_per_seconds * seconds_per_chunk`` of its config.
    """
    if not isinstance(config, MacerConfig):
        raise TypeError(f"macer.diagnose: config must be a macer.MacerConfig, got {type(config).__name__}")
    adapter = get_adapter(model)
    parts = adapter.parts(model)
    num_layers = len(parts.layers)
    config.check_depth(num_layers)
    input_ids = inputs.get("input_ids")
    if not isinstance(input_ids, torch.Tensor) or input_ids.ndim != 2 or input_ids.shape[0] != 1:
        raise ValueError("macer.diagnose: inputs['input_ids'] must be a [1, N] tensor (batch size 1)")
    ids = input_ids[0].cpu()
    labels = adapter.labels(model, ids).cpu()
    n = ids.numel()
    n_audio, n_video = int((labels == AUDIO).sum()), int((labels == VISUAL).sum())
    if not n_audio or not n_video:
        raise ValueError(f"macer.diagnose: the prompt needs audio and video tokens (has {n_audio} audio, {n_video} "
                         "video): the diagnostics compare the two modalities")
    eot = config.end_of_turn_token_id
    eot = adapter.end_of_turn_token_id(model) if eot is None else eot
    # The runtime's own rule for the question rows; the temporal row is not needed for it (known only in the forward).
    facts = PromptFacts(labels=labels, temporal=torch.zeros_like(labels), input_ids=ids, end_of_turn_token_id=eot,
                        num_layers=num_layers)
    question = question_rows(facts, config.query_tokens, config.question_span)
    block = _block_positions(model, block_positions)
    if policies is None:
        policies = default_policies(config, num_layers)

    full = _FullForward(labels, question, config)
    temporal = _run_tapped(model, parts, adapter, inputs, n, full.on_layer)
    budget = config.budget(n_audio, n_video)
    sweep = {
        "audio": _sweep(full.scores, labels, temporal, AUDIO, budget.audio, config.audio_layer, config),
        "video": _sweep(full.scores, labels, temporal, VISUAL, budget.video, config.video_layer, config),
    }
    if len(full.mass) != num_layers:
        raise RuntimeError(f"macer.diagnose: the attention tap saw {len(full.mass)} of {num_layers} layers")
    log_ratio = [_log_ratio(a, n_audio, v, n_video) for a, v in full.mass]
    gini_by_policy = {"full": {"audio": _temporal_gini(labels == AUDIO, labels, temporal, AUDIO, block),
                               "video": _temporal_gini(labels == VISUAL, labels, temporal, VISUAL, block)}}
    curves: dict[str, list[float | None]] = {"full": list(log_ratio)}
    for name, policy in policies.items():
        kept, curve = _policy_forward(model, parts, adapter, inputs, policy, labels, question, num_layers)
        gini_by_policy[name] = {"audio": _temporal_gini(kept, labels, temporal, AUDIO, block),
                                "video": _temporal_gini(kept, labels, temporal, VISUAL, block)}
        curves[name] = curve
    return DiagnosticReport(
        num_layers=num_layers, prompt_length=n, n_audio=n_audio, n_video=n_video,
        query_positions=question.tolist(), mass=full.mass, log_mass_ratio=log_ratio,
        q_centroid_cosine=full.cosine, readout_sweep=sweep, temporal_gini=gini_by_policy,
        policy_log_mass_ratio=curves, block_positions=block)


# ---------------------------------------------------------------------------------------------------------------
# The prompt
# ---------------------------------------------------------------------------------------------------------------


def _block_positions(model: nn.Module, block_positions: int | None) -> int:
    if block_positions is not None:
        if isinstance(block_positions, bool) or not isinstance(block_positions, int) or block_positions < 1:
            raise ValueError(f"macer.diagnose: block_positions must be an integer >= 1, got {block_positions!r}")
        return block_positions
    config = getattr(model, "config", None)
    config = getattr(config, "thinker_config", None) or config
    per_second = getattr(config, "position_id_per_seconds", None)
    seconds = getattr(config, "seconds_per_chunk", None)
    if not isinstance(per_second, (int, float)) or not isinstance(seconds, (int, float)):
        raise ValueError("macer.diagnose: the model's config has no position_id_per_seconds / seconds_per_chunk; "
                         "pass block_positions (temporal position units per block of temporal_gini)")
    return max(1, round(per_second * seconds))


# ---------------------------------------------------------------------------------------------------------------
# The attention tap
# ---------------------------------------------------------------------------------------------------------------


def _tap_attention(inner: str) -> Callable:
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    def macer_diag_attention(module, query, key, value, attention_mask, **kwargs):
        callback = _TAPS.get(id(module))
        if callback is not None:
            callback(module, query, key, kwargs)
        default = inspect.getmodule(type(module)).eager_attention_forward
        return call_as(inner, ALL_ATTENTION_FUNCTIONS.get_interface(inner, default), module, query, key, value,
                       attention_mask, **kwargs)

    macer_diag_attention.__name__ = f"{_TAP_PREFIX}{inner}"
    return macer_diag_attention


@contextlib.contextmanager
def _tap_name(inner: str) -> Iterator[str]:
    """Register ``macer_diag_<inner>``: the tap, then the attention function named ``inner`` (with its mask
    function: without one of the same name ``create_causal_mask`` silently returns None)."""
    name = register_refcounted(f"{_TAP_PREFIX}{inner}", inner, lambda: _tap_attention(inner))
    try:
        yield name
    finally:
        unregister_names(name)


def _run_tapped(model: nn.Module, parts: Any, adapter: Any, inputs: Mapping[str, Any], n: int,
                on_layer: Callable[[int, nn.Module, torch.Tensor, torch.Tensor, dict], None]) -> torch.Tensor:
    """Run ``model(**inputs)`` once with ``on_layer(index, module, query, key, kwargs)`` called inside every decoder
    layer's attention; return the prompt's temporal positions ``[N]`` (CPU).

    The switch to the tap happens in a pre-hook of the decoder, so it wraps whatever attention the decoder runs at
    that moment (the user's, or ``macer.compress``'s own wrapper), and is undone in its post-hook or on error."""
    attention = [m for layer in parts.layers for m in layer.modules() if hasattr(m, "layer_idx")]
    if len(attention) != len(parts.layers):
        raise ValueError(f"macer.diagnose: found {len(attention)} attention modules in {len(parts.layers)} layers")
    if any(id(m) in _TAPS for m in attention):
        raise ValueError("macer.diagnose: this model is already being diagnosed")
    state: dict[str, Any] = {"previous": None, "temporal": None}
    stack = contextlib.ExitStack()

    def begin(module, args, kwargs):
        if state["temporal"] is not None:
            return None  # a later decoder call (a decode step) is not diagnosed
        temporal = adapter.temporal_positions(kwargs, n)
        # None: the text model uses arange positions itself (no multimodal grid).
        state["temporal"] = torch.arange(n) if temporal is None else temporal.reshape(-1).cpu()
        state["previous"] = parts.attn_config._attn_implementation
        parts.attn_config._attn_implementation = stack.enter_context(_tap_name(state["previous"]))
        return None

    def restore(*_):
        if state["previous"] is not None and parts.attn_config._attn_implementation.startswith(_TAP_PREFIX):
            parts.attn_config._attn_implementation = state["previous"]
        state["previous"] = None

    for index, module in enumerate(attention):
        _TAPS[id(module)] = lambda mod, q, k, kw, i=index: on_layer(i, mod, q, k, kw) if state["previous"] else None
    handles = [parts.decoder.register_forward_pre_hook(begin, with_kwargs=True),
               parts.decoder.register_forward_hook(restore)]
    try:
        with torch.no_grad(), stack:
            model(**inputs)
    finally:
        restore()
        for handle in handles:
            handle.remove()
        for module in attention:
            _TAPS.pop(id(module), None)
    if state["temporal"] is None:
        raise RuntimeError("macer.diagnose: the decoder was not called by model(**inputs)")
    return state["temporal"]


def _question_probs(module: nn.Module, query: torch.Tensor, key: torch.Tensor, rows: torch.Tensor,
                    kwargs: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(probs [Hq, Lq, Nk], q [Hq, Lq, D], k [Hkv, Nk, D])``: the rows' attention probabilities over the layer's
    keys (causal: row at sequence index p sees keys 0..p), recomputed from the tapped post-RoPE tensors."""
    dtype = torch.float64 if query.dtype == torch.float64 else torch.float32
    q = query[0, :, rows.to(query.device)].to(dtype)  # [Hq, Lq, D]
    k = key[0].to(dtype)  # [Hkv, Nk, D]
    hq, lq, d = q.shape
    hkv, nk = k.shape[0], k.shape[1]
    scale = kwargs.get("scaling") or getattr(module, "scaling", None) or 1.0 / math.sqrt(d)
    # Query heads h * G .. (h + 1) * G - 1 share KV head h (transformers' repeat_kv order): no expanded K copy.
    logits = scale * torch.matmul(q.reshape(hkv, (hq // hkv) * lq, d), k.transpose(1, 2)).reshape(hq, lq, nk)
    visible = torch.arange(nk, device=k.device)[None, :] <= rows.to(k.device)[:, None]  # [Lq, Nk]
    logits = logits.masked_fill(~visible[None], float("-inf"))
    return torch.softmax(logits, dim=-1), q, k


def _log_ratio(mass_a: float, n_a: int, mass_v: float, n_v: int) -> float | None:
    if not n_a or not n_v or mass_a <= 0 or mass_v <= 0:
        return None
    return math.log(mass_a / n_a) - math.log(mass_v / n_v)


class _FullForward:
    """Per-layer statistics of the unpruned forward, computed inside each layer's attention call."""

    def __init__(self, labels: torch.Tensor, question: torch.Tensor, config: MacerConfig):
        self.labels, self.question, self.config = labels, question, config
        self.mass: list[tuple[float, float]] = []
        self.cosine: list[tuple[float, float]] = []
        self.scores: list[torch.Tensor] = []  # ANMS per prompt token at each layer (CPU, float64)

    def on_layer(self, index: int, module: nn.Module, query: torch.Tensor, key: torch.Tensor, kwargs: dict) -> None:
        if index != len(self.mass):
            raise RuntimeError(f"macer.diagnose: layer {index + 1} ran out of order")
        if key.shape[2] != self.labels.numel():
            raise RuntimeError(f"macer.diagnose: layer {index + 1} holds {key.shape[2]} tokens, the prompt has "
                               f"{self.labels.numel()}; call diagnose outside macer.compress (it runs the policies "
                               "itself)")
        labels = self.labels.to(key.device)
        probs, q, k = _question_probs(module, query, key, self.question, kwargs)
        is_audio, is_video = labels == AUDIO, labels == VISUAL
        mass_a = probs[..., is_audio].sum(-1).mean()
        mass_v = probs[..., is_video].sum(-1).mean()
        groups = q.shape[0] // k.shape[0]
        q_mean = q.mean(dim=1)  # [Hq, D]
        cos = []
        for members in (is_audio, is_video):
            centroid = k[:, members].mean(dim=1).repeat_interleave(groups, dim=0)  # [Hq, D]
            cos.append(torch.nn.functional.cosine_similarity(q_mean, centroid, dim=-1).mean())
        scale = kwargs.get("scaling") or getattr(module, "scaling", None)
        rows = self.question.to(query.device)
        scores = score(query, key, labels, rows, self.config.scoring, scale=scale, eps=self.config.eps)
        # One host copy per layer; the diagnostics are an analysis pass, not the pruning hot path.
        values = torch.stack([mass_a, mass_v, cos[0], cos[1]]).double().cpu().tolist()
        self.mass.append((values[0], values[1]))
        self.cosine.append((values[2], values[3]))
        self.scores.append(scores.double().cpu())


def _sweep(scores: list[torch.Tensor], labels: torch.Tensor, temporal: torch.Tensor, modality: int, budget: int,
           chosen_layer: int, config: MacerConfig) -> dict[str, Any]:
    """MACER's selection for ``modality`` read at every layer of the unpruned forward, against the chosen layer's."""
    members = (labels == modality).nonzero().reshape(-1)
    chunks = temporal_chunks(temporal[members], config.num_chunks) if modality == VISUAL else None
    selections = []
    for layer_scores in scores:
        values = layer_scores[members].float()
        if chunks is None:  # audio
            chosen = topk_indices(values, budget)
        else:
            chosen = coverage_select(values, chunks, budget, config.coverage_weight)
        selections.append(set(members[chosen].tolist()))
    reference = selections[chosen_layer - 1]
    overlap = [len(s & reference) / len(reference) if reference else None for s in selections]
    return {"chosen_layer": chosen_layer, "budget": budget, "kept": sorted(reference), "overlap": overlap}


def _temporal_gini(kept: torch.Tensor, labels: torch.Tensor, temporal: torch.Tensor, modality: int,
                   block: int) -> float | None:
    """Gini of the kept tokens of ``modality`` (``kept``: a bool mask over the prompt) per temporal block. Blocks
    count from the clip's start (the first audio/video token's temporal position: M-RoPE offsets the clip by the
    text before it)."""
    members = labels == modality
    start = temporal[labels != TEXT].min()
    blocks = torch.div(temporal[members] - start, block, rounding_mode="floor").long()
    kept_blocks = torch.div(temporal[members & kept] - start, block, rounding_mode="floor").long()
    ids = blocks.unique()
    counts = [(kept_blocks == b).sum().item() for b in ids]
    return gini(counts)


# ---------------------------------------------------------------------------------------------------------------
# Under a policy
# ---------------------------------------------------------------------------------------------------------------


def _policy_forward(model: nn.Module, parts: Any, adapter: Any, inputs: Mapping[str, Any], policy: Any,
                    labels: torch.Tensor, question: torch.Tensor,
                    num_layers: int) -> tuple[torch.Tensor, list[float | None]]:
    """One forward inside ``macer.compress(model, policy)``: the kept-token mask over the prompt and the log ratio
    at each layer over the tokens it holds."""
    from macer.hf.compress import compress

    n = labels.numel()
    tail = n - int(question[0])  # rows from the first question row to the end: text, never dropped
    lq = question.numel()
    p_bar: list[torch.Tensor] = []

    def on_layer(index: int, module: nn.Module, query: torch.Tensor, key: torch.Tensor, kwargs: dict) -> None:
        length = key.shape[2]
        rows = torch.arange(length - tail, length - tail + lq)
        probs, _, _ = _question_probs(module, query, key, rows, kwargs)
        p_bar.append(probs.mean(dim=(0, 1)).double().cpu())

    with compress(model, policy) as trace:
        _run_tapped(model, parts, adapter, inputs, n, on_layer)
    record = trace.last
    assert record is not None  # the forward above ran one prefill inside compress
    kept = labels == TEXT
    kept[record.audio_kept] = True
    kept[record.video_kept] = True
    curve: list[float | None] = []
    for index, layer_probs in enumerate(p_bar[:num_layers]):
        present = _rows_at(index, record, labels, kept)
        if present.numel() != layer_probs.numel():
            raise RuntimeError(f"macer.diagnose: layer {index + 1} holds {layer_probs.numel()} tokens, the trace "
                               f"implies {present.numel()}")
        present_labels = labels[present]
        curve.append(_log_ratio(layer_probs[present_labels == AUDIO].sum().item(),
                                int((present_labels == AUDIO).sum()),
                                layer_probs[present_labels == VISUAL].sum().item(),
                                int((present_labels == VISUAL).sum())))
    return kept, curve


def _rows_at(index: int, record: Any, labels: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    """Prompt positions held by 0-based layer ``index``: a modality's dropped tokens are gone from the layer after
    the stage that selected it (``Stage.layer``, 1-based) on."""
    present = torch.ones(labels.numel(), dtype=torch.bool)
    names = {"audio": AUDIO, "video": VISUAL}
    for stage in record.stages:
        if index >= stage.layer:
            for name in stage.modalities:
                members = labels == names[name]
                present[members] = kept[members]
    return present.nonzero().reshape(-1)


# ---------------------------------------------------------------------------------------------------------------
# `macer diagnose`
# ---------------------------------------------------------------------------------------------------------------


def command(args: Any, checkpoint: bool) -> int:
    """``macer diagnose`` with its arguments parsed and checked (``macer.tools.cli``): the diagnostics of one prompt as
    JSON + PNG figures, on a random thinker built in code (a synthetic clip) or, with ``checkpoint``, a local
    Qwen2.5-Omni checkpoint with a video and a question."""
    from macer.tools import _cli_args as flags

    if checkpoint:
        from macer.tools.checkpoint import load_checkpoint

        case = load_checkpoint(args)
        model, inputs, config = case.model, case.inputs, case.config
    else:
        from macer.tools.synthetic.qwen2_5_omni import build_thinker, clip_inputs, macer_config_for

        torch.manual_seed(args.seed)
        model = build_thinker(num_layers=args.layers, hidden_size=args.hidden, num_heads=args.heads,
                              num_kv_heads=args.kv_heads, intermediate_size=3 * args.hidden)
        inputs = clip_inputs(model, frames=args.frames, audio_tokens=args.audio_tokens, seed=args.seed)
        config = macer_config_for(model, keep_ratio=args.keep_ratio, **flags.readout_layers(args))
    report = diagnose(model, inputs, config)
    print(f"prompt {report.prompt_length} tokens: {report.n_audio} audio, {report.n_video} video; question rows "
          f"{report.query_positions}; {config}")
    print("layer  log(mass_a/n_a)-log(mass_v/n_v)  cos(q,c_a)  cos(q,c_v)  sweep overlap audio/video")
    for i in range(report.num_layers):
        overlap = [report.readout_sweep[m]["overlap"][i] for m in ("audio", "video")]
        ratio = report.log_mass_ratio[i]
        print(f"{i + 1:5d}  {'-' if ratio is None else f'{ratio:+.4f}':>31}  {report.q_centroid_cosine[i][0]:+10.4f}  "
              f"{report.q_centroid_cosine[i][1]:+10.4f}  " + "/".join(f"{v:.2f}" for v in overlap))
    for name, values in report.temporal_gini.items():
        print(f"temporal Gini {name}: " + ", ".join(f"{m} {'-' if v is None else f'{v:.3f}'}"
                                                  for m, v in values.items()))
    for path in report.save(args.out, plot=not args.no_plot):
        print(f"wrote {path}")
    return 0
