"""No host synchronisation inside a stage, a compacted layer, the end of a prefill or a decode step (issue #10 item 2).

On a CPU machine nothing synchronises, so the test counts the *patterns* that do on a GPU: every call of
``Tensor.item / tolist / numpy / cpu / nonzero / __bool__ / __int__ / __float__ / __index__`` (and ``torch.nonzero``,
``torch.equal``, ``torch.allclose``, ``.to("cpu")``, and the aten ops whose output size is read back: ``nonzero``,
``masked_select`` and indexing with a boolean tensor, ``t[mask]``) made by the model layer (``macer.*``; torch's own
Python helpers called from it count too) while the runtime is inside a readout, a layer pre-hook, the prefill's end,
a decode step or Qwen3-Omni's deepstack remap. The host plan at the start of a prefill is outside that window: it is
the prefill's one device read.
The ops' own argument checks (``macer_kernels``) are outside this test: the GPU hot-path issue (#9) makes them
sync-free and tests them there. The one read the prefill's end makes on purpose, of every stage's non-finite flags
(``macer.hf.prefill.raise_if_nonfinite``), is counted apart: at most one per prefill.
"""

from __future__ import annotations

import contextlib

import macer
import pytest
import torch
from macer.hf import plan as prefill_module
from macer.hf import session as runtime
from macer.hf.adapters.qwen3_omni import Qwen3OmniAdapter
from macer.testing import build_thinker, clip_inputs, macer_config_for
from sync_guard import READ_METHODS, counting, model_layer_caller
from torch.utils._python_dispatch import TorchDispatchMode

CLIP = {"frames": 4, "grid_hw": (8, 8), "audio_tokens": 60, "seed": 1}
_FUNCTIONS = ("nonzero", "equal", "allclose")


class SyncLog(list):
    """The ``(pattern, where)`` sync calls found; ``flag_reads``: per prefill end, the number of stage flags read in
    ``raise_if_nonfinite``'s one copy (0: no scored stage, nothing read)."""

    flag_reads: list[int]


@contextlib.contextmanager
def count_syncs(monkeypatch):
    """Yields the ``SyncLog`` of sync calls the model layer made inside the runtime's hot window."""
    found = SyncLog()
    found.flag_reads = []
    window = [0]

    for name in READ_METHODS:
        monkeypatch.setattr(torch.Tensor, name,
                            counting(f"Tensor.{name}", getattr(torch.Tensor, name), window, found, __name__))
    for name in _FUNCTIONS:
        monkeypatch.setattr(torch, name, counting(f"torch.{name}", getattr(torch, name), window, found, __name__))
    original_to = torch.Tensor.to

    def to(self, *args, **kwargs):
        target = kwargs.get("device", args[0] if args else None)
        if window[0] and str(target) == "cpu":
            where = model_layer_caller(__name__)
            if where is not None:
                found.append(("Tensor.to(cpu)", where))
        return original_to(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", to)

    class SizeReads(TorchDispatchMode):
        """Ops whose output size is data-dependent (a boolean index's ``nonzero`` included: ``t[mask]``)."""

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            reads = name in ("nonzero", "masked_select")
            if name in ("index", "index_put", "index_put_") and len(args) > 1:
                reads = any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1])
                name += "(bool)"
            if reads:
                where = model_layer_caller(__name__)
                if where is not None:
                    found.append((f"aten.{name}", where))
            return func(*args, **(kwargs or {}))

    def hot(original):
        def wrapped(*args, **kwargs):
            window[0] += 1
            try:
                with SizeReads() if window[0] == 1 else contextlib.nullcontext():
                    return original(*args, **kwargs)
            finally:
                window[0] -= 1

        return wrapped

    for owner, names in ((runtime.Session, ("readout", "_prefill_layer", "_end")),
                         (runtime.DecodeSteps, ("begin", "_decode_layer"))):  # the session's decode steps
        for name in names:
            monkeypatch.setattr(owner, name, hot(getattr(owner, name)))
    monkeypatch.setattr(Qwen3OmniAdapter, "deepstack", hot(Qwen3OmniAdapter.deepstack))
    check = runtime.raise_if_nonfinite

    def flag_read(entries):
        found.flag_reads.append(len(entries))
        window[0] -= 1  # its one read is counted here, not as a stray sync
        try:
            return check(entries)
        finally:
            window[0] += 1

    monkeypatch.setattr(runtime, "raise_if_nonfinite", flag_read)
    yield found


@pytest.fixture(scope="module")
def models():
    return {attn: build_thinker(num_layers=5, hidden_size=64, attn_implementation=attn, seed=4)
            for attn in ("sdpa", "eager")}


POLICIES = {
    "macer": lambda m: macer_config_for(m, keep_ratio=0.3, audio_layer=1, video_layer=3),
    "macer-trim": lambda m: macer_config_for(m, keep_ratio=0.3, audio_layer=2, video_layer=2, trim_early_cache=True),
    "macer-raw": lambda m: macer_config_for(m, keep_ratio=0.3, audio_layer=1, video_layer=3, scoring="raw"),
    "fastv": lambda m: macer.FastVConfig(keep_ratio=0.3, layer=2),
    "random": lambda m: macer.RandomConfig(keep_ratio=0.3, seed=3),
}


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_no_host_sync_in_stages_compacted_layers_and_decode(models, monkeypatch, attn, policy):
    model = models[attn]
    inputs = clip_inputs(model, **CLIP)
    config = POLICIES[policy](model)
    with count_syncs(monkeypatch) as found, torch.no_grad(), macer.compress(model, config) as trace:
        model.generate(**inputs, max_new_tokens=3, do_sample=False)
    assert trace.history[0].layer_tokens[-1] < inputs["input_ids"].shape[1]  # something was pruned
    assert found == [], f"host synchronisations in the hot path ({policy}, {attn}): {found}"
    # one prefill: one read of its stages' flags at its end (none for random, which scores nothing)
    assert [n for n in found.flag_reads if n] == ([] if policy == "random" else [len(trace.history[0].stages)])


def test_the_counter_sees_a_sync_added_to_a_stage(models, monkeypatch):
    """The detector is not vacuous: a ``.item()`` put into the stage's device work is caught."""
    from macer.core import stage as policy_module

    original = policy_module.prepared_stage

    class WithSync:
        """The prepared stage with a read of its keep after each run."""

        def __init__(self, prepared):
            self.prepared = prepared

        def run(self, *args, **kwargs):
            out = self.prepared.run(*args, **kwargs)
            assert int(out[0][0, 0].item()) >= 0  # the kind of read-back that must not come back
            return out

        def __getattr__(self, name):  # the rest of the prepared stage (the deferred path's allocate_gathered)
            return getattr(self.prepared, name)

    monkeypatch.setattr(policy_module, "prepared_stage", lambda *args, **kwargs: WithSync(original(*args, **kwargs)))
    model = models["sdpa"]
    with count_syncs(monkeypatch) as found, torch.no_grad(), macer.compress(model, POLICIES["macer"](model)):
        model(**clip_inputs(model, **CLIP))
    assert found and {name for name, _ in found} <= {"Tensor.item", "Tensor.__int__"}
    assert all(where.startswith("macer.core.stage:") for _, where in found), found


def test_one_host_read_per_prefill_and_none_for_cpu_inputs(models, monkeypatch):
    """The plan brings ids, temporal row and mask to the host in one ``_to_host`` call per prefill; tensors already
    on the CPU are passed through without a copy."""
    calls = []
    original = prefill_module.to_host

    def spy(*tensors):
        out = original(*tensors)
        calls.append(all(o is t for o, t in zip(out, tensors, strict=True)))
        return out

    monkeypatch.setattr(prefill_module, "to_host", spy)
    model = models["eager"]
    inputs = clip_inputs(model, **CLIP)
    with torch.no_grad(), macer.compress(model, POLICIES["macer"](model)) as trace:
        model.generate(**inputs, max_new_tokens=3, do_sample=False)  # one prefill, then decode steps
        model(**inputs)
    assert len(trace.history) == 2 and calls == [True, True]


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("policy", ["macer", "macer-trim", "random"])
def test_no_host_sync_in_a_batch(models, monkeypatch, attn, policy):
    """A left-padded batch (issue #11): per-sample stages, the re-packing and batched decode read nothing back, and
    the plan is still one host read per prefill."""
    from macer.testing import batch_inputs

    model = models[attn]
    batch = batch_inputs([clip_inputs(model, frames=0, audio_tokens=50, use_audio_in_video=False, seed=2),
                          clip_inputs(model, **CLIP, use_audio_in_video=False)])
    reads = []
    original = prefill_module.to_host
    monkeypatch.setattr(prefill_module, "to_host", lambda *t: reads.append(len(t)) or original(*t))
    with count_syncs(monkeypatch) as found, torch.no_grad(), \
            macer.compress(model, POLICIES[policy](model)) as trace:
        model.generate(**batch, max_new_tokens=3, do_sample=False)
    assert all(s.pruned for s in trace.samples) and len(reads) == 1
    assert found == [], f"host synchronisations in the batch hot path ({policy}, {attn}): {found}"
    assert len([n for n in found.flag_reads if n]) == (0 if policy == "random" else 1)


@pytest.mark.parametrize(("audio_layer", "video_layer", "reads"), [(1, 2, 2), (2, 2, 1), (4, 4, 0)])
def test_qwen3_deepstack_reads_once_per_stage_before_a_deepstack_level(monkeypatch, audio_layer, video_layer, reads):
    """Issue 23 item 6: Qwen3-Omni's deepstack remap selects the kept visual rows with a boolean mask, which reads
    its count back: once per stage placed before a deepstack level (after layers 1-3), none for later stages; the
    docs say so. The detector saw nothing of it before it counted boolean indexing and the remap's window."""
    from macer.testing_qwen3 import build_qwen3_thinker, qwen3_clip_inputs

    model = build_qwen3_thinker(num_layers=5, hidden_size=64, attn_implementation="sdpa", seed=5)
    inputs = qwen3_clip_inputs(model, frames=4, grid_hw=(8, 8), seconds=4.0, seed=1)
    config = macer_config_for(model, keep_ratio=0.3, audio_layer=audio_layer, video_layer=video_layer)
    with count_syncs(monkeypatch) as found, torch.no_grad(), macer.compress(model, config) as trace:
        model.generate(**inputs, max_new_tokens=2, do_sample=False)
    assert trace.history[0].layer_tokens[-1] < inputs["input_ids"].shape[1]
    assert [name for name, _ in found] == ["aten.index(bool)"] * reads, found
    assert all(where.startswith("macer.hf.adapters.qwen3_omni:") for _, where in found), found
