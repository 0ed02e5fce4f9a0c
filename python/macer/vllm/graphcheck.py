"""The load-time check of FULL decode CUDA graphs on the user's own machine (``check_decode_graphs``).

No GPU with vLLM has run the plugin's graph path, so an engine that captured FULL decode graphs proves it before it
serves anyone: after capture, two made-up requests with the same prompt each run a prefill and a decode with compacted
layers (a drop at every segment of the captured layout), the first decode replaying the captured FULL graph (its
compacted layers reading the buffers ``macer.vllm.backend.StageMetadata`` refills in place), the second run without a
FULL graph (piecewise graphs or eager, the compacted layers' metadata built for that step alone). Each decode is the
first step after its own prefill, so the runner feeds both the same token the same way. Their hidden states must
agree; on any difference (or if the check cannot run) the engine turns FULL graphs off for the compacted layers' steps,
with one WARNING naming why, and serves them without (``RunnerBinding.full_graphs``).

The requests go through the worker's own ``execute_model`` / ``sample_tokens`` with scheduler outputs made here
(vLLM 0.32's ``SchedulerOutput``, ``NewRequestData``, ``CachedRequestData``), on KV blocks nobody holds yet (the
scheduler has not run a step), blocks of their own in each KV cache group as the scheduler would give them, and make no
record. Their prefill is text only (unpruned); the compacted layouts of
their decodes are written into the planner's states afterwards, so the check needs no multimodal input and no
readout, only what a decode step reads.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch

__all__ = ["QUIET_PREFIX", "check_decode_graphs"]

logger = logging.getLogger("vllm.macer")

QUIET_PREFIX = "macer-graph-check-"
"""Request ids of the check's made-up requests (they make no record)."""

TOLERANCE = 1e-2
"""Largest relative difference (L2) between the two decodes' hidden states: a FULL graph runs the same kernels with
the capture's launch sizes (e.g. FlashAttention's split count for ``max_seq_len = max_model_len``), so bf16 rounding
may differ; a wrong length, slot or block table changes the attention's output by far more."""


def _scheduler_output(new: list[Any] | None = None, cached: Any = None, scheduled: dict[str, int] | None = None,
                      finished: set[str] | None = None) -> Any:
    from vllm.v1.core.sched.output import CachedRequestData, SchedulerOutput

    scheduled = scheduled or {}
    return SchedulerOutput(scheduled_new_reqs=new or [], scheduled_cached_reqs=cached or CachedRequestData.make_empty(),
                           num_scheduled_tokens=scheduled, total_num_scheduled_tokens=sum(scheduled.values()),
                           scheduled_spec_decode_tokens={}, scheduled_encoder_inputs={},
                           finished_req_ids=finished or set(), free_encoder_mm_hashes=[])


def _step(worker: Any, output: Any) -> None:
    out = worker.execute_model(output)
    if out is None:
        out = worker.sample_tokens(None)
    if hasattr(out, "get_output"):
        out.get_output()


def _text_prompt(decoder: Any, length: int) -> list[int]:
    """``length`` token ids the architecture labels as text (not its end-of-turn id)."""
    from macer.core.policy import TEXT

    vocab = decoder.vllm_config.model_config.get_vocab_size()
    ids = torch.arange(min(vocab, 4096))
    text = [int(i) for i, label in zip(ids.tolist(), decoder.prompt.labels(ids).tolist(), strict=True)
            if label == TEXT and i != decoder.prompt.end_of_turn_token_id]
    if not text:
        raise RuntimeError("no text token id among the first 4096")
    return [text[(7 * i) % len(text)] for i in range(length)]


def _compacted_layout(prompt_len: int, bounds: tuple[int, ...], num_layers: int) -> tuple[int, ...]:
    """Prompt rows per layer of a made-up pruned request: 3 more rows dropped at every boundary."""
    return tuple(prompt_len - 3 * sum(1 for b in bounds if b <= layer) for layer in range(num_layers))


def check_decode_graphs(worker: Any, decoder: Any) -> str | None:
    """Run the check (module docstring) on ``worker``'s runner, bound to ``decoder`` (a ``StagedDecoder``). None: the
    two decodes agree; else why not (the caller turns FULL graphs off and says so)."""
    from vllm import SamplingParams
    from vllm.utils.math_utils import cdiv
    from vllm.v1.core.sched.output import CachedRequestData, NewRequestData

    from macer.core.layout import RequestLayout

    runner, planner, binding = decoder.runner, decoder.planner, decoder.binding
    bounds, num_layers = decoder.bounds, len(decoder.layers)
    prompt_len = min(24 + 3 * len(bounds), decoder.vllm_config.model_config.max_model_len - 4)
    prompt = _text_prompt(decoder, prompt_len)
    layout = RequestLayout(prompt_len, _compacted_layout(prompt_len, bounds, num_layers))
    groups = len(runner.kv_cache_config.kv_cache_groups)
    blocks = max(cdiv(prompt_len + 2, runner.input_batch.block_table[g].block_size) for g in range(groups))
    if runner.kv_cache_config.num_blocks <= 2 * groups * blocks + 1:
        return None  # too small a cache to hold two made-up requests: nothing to check with
    model = runner.get_model()
    seen: list[torch.Tensor] = []
    compute = model.compute_logits

    def recording(hidden: torch.Tensor) -> Any:
        seen.append(hidden.detach().float().clone())
        return compute(hidden)

    ids = [f"{QUIET_PREFIX}{name}" for name in ("graph", "eager")]
    planner.quiet.update(ids)
    model.compute_logits = recording
    reason = None
    try:
        for index, request_id in enumerate(ids):
            # Blocks of its own in each KV cache group (block 0 is vLLM's null block): the groups overlay each other
            # in memory, a block id being one group's at a time, and a FULL path that read another group's block
            # table must not find the same blocks there.
            first = 1 + index * groups * blocks
            block_ids = tuple(list(range(first + g * blocks, first + (g + 1) * blocks)) for g in range(groups))
            new = NewRequestData(req_id=request_id, prompt_token_ids=prompt, mm_features=[],
                                 sampling_params=SamplingParams(max_tokens=4, temperature=0.0), pooling_params=None,
                                 block_ids=block_ids, num_computed_tokens=0, lora_request=None)
            _step(worker, _scheduler_output(new=[new], scheduled={request_id: prompt_len}))
            state = planner.states.get(request_id)
            planner.states.add(dataclasses.replace(state, layout=layout, prefill=None, prefilled=True,
                                                   recorded=True))
            binding.full_graphs = index == 0
            cached = CachedRequestData(req_ids=[request_id], resumed_req_ids=set(), new_token_ids=[[]],
                                       all_token_ids={}, new_block_ids=[None], num_computed_tokens=[prompt_len],
                                       num_output_tokens=[1])
            graphs: list[Any] = []
            record = decoder.on_step

            def tapped(step: Any, bound: Any, _record: Any = record, _graphs: list = graphs) -> None:
                _graphs.append(step.graph)
                if _record is not None:
                    _record(step, bound)

            decoder.on_step = tapped
            try:
                _step(worker, _scheduler_output(cached=cached, scheduled={request_id: 1}))
            finally:
                decoder.on_step = record
            if graphs != [index == 0]:
                reason = (f"the {'first' if index == 0 else 'second'} decode was "
                          f"{'not ' if index == 0 else ''}dispatched to a FULL graph")
                break
    except Exception as error:  # a runner this check does not know: no proof, so no FULL graphs
        reason = f"the check could not run ({type(error).__name__}: {error})"
    finally:
        model.compute_logits = compute
        binding.full_graphs = True
    try:  # the made-up requests leave the runner and the planner, whatever happened above
        _step(worker, _scheduler_output(finished=set(ids)))
    except Exception as error:
        reason = reason or f"the check could not finish its requests ({type(error).__name__}: {error})"
    finally:
        planner.quiet.difference_update(ids)
    if reason is not None:
        return reason
    if len(seen) != 4:
        return f"the check saw {len(seen)} sampled steps, not 4"
    graph, eager = seen[1][0], seen[3][0]
    difference = float((graph - eager).norm() / eager.norm().clamp_min(1e-12))
    if not difference <= TOLERANCE:  # also catches NaN
        return (f"a replayed FULL decode graph's hidden state differs from the same decode without it by "
                f"{difference:.3g} (relative L2; at most {TOLERANCE} allowed)")
    return None
