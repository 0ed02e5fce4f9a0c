"""Triton backend on padded batches (CONTRACT of issues #9 / #11): PAD keys in the scoring, per-sample budgets and
right-aligned rows in ``stage_select``, 2-D keep in ``compact_many``.

The backend functions are called directly (the public layer's checks may not accept label -1, per-sample budgets or
a 2-D keep yet). Every oracle is independent of the kernels: a sample's scores are the float64 reference on that
sample alone with its PAD keys removed; a sample's kept set is ``reference.stage_select_ref`` on its non-PAD tokens
with its own budgets; compaction is ``torch.gather``. Inputs are fresh random draws from the test's seed (named in
every assertion; ``--seed`` reruns it). Shapes are small: on CPU the kernels run in Triton's interpreter.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from score_inputs import rel_err

from macer_kernels import modality_scores, use_backend
from macer_kernels.reference import modality_scores_ref

pytestmark = [pytest.mark.triton,
              # The interpreter computes with numpy, which warns on the NaN arithmetic of the non-finite case.
              pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
              pytest.mark.filterwarnings("ignore:All-NaN slice encountered:RuntimeWarning")]

ON_GPU = shutil.which("nvidia-smi") is not None  # the same proxy as conftest: no CUDA initialisation at import
DEVICE = "cuda" if ON_GPU else "cpu"
PAD = -1  # macer_kernels.PAD_LABEL (the contract's value; the constant arrives with the lead's public layer)


@pytest.fixture(autouse=True)
def _triton_importable():
    pytest.importorskip("triton")


# ---- 1. modality_scores with PAD keys --------------------------------------------------------------------------------


def _padded_scoring_batch(g, lengths, hq, hkv, lq, d, dtype, *, scattered=False):
    """A batch of ``len(lengths)`` samples, sample b holding ``lengths[b]`` real keys: left-padded to the longest
    (or, with ``scattered``, PAD keys also spread through the real ones). Returns ``(q, k, labels, positions)`` on the
    CPU; the PAD keys' K rows are garbage (large values, and a NaN and an inf row), which must not matter."""
    b, n = len(lengths), max(lengths) + (3 if scattered else 0)
    q = torch.randn(b, hq, lq, d, generator=g)
    k = torch.randn(b, hkv, n, d, generator=g)
    labels = torch.randint(0, 4, (b, n), generator=g)
    positions = torch.empty(b, lq, dtype=torch.long)
    for i, length in enumerate(lengths):
        pad = torch.zeros(n, dtype=torch.bool)
        pad[:n - length] = True
        if scattered:  # move a few PAD slots into the real part (not at the last key: it is a query row)
            pad[:n - length] = False
            pad[torch.randperm(n - 1, generator=g)[:n - length]] = True
        labels[i, pad] = PAD
        k[i, :, pad] = 40.0 * torch.randn(hkv, int(pad.sum()), d, generator=g)  # would dominate every softmax
        real = (~pad).nonzero().flatten()
        if len(real) < n:
            k[i, 0, (pad.nonzero().flatten())[0], 0] = float("nan")
            k[i, hkv - 1, (pad.nonzero().flatten())[-1], :] = float("inf")
        # Query rows at real keys: the last real key and earlier ones spread over the real part, per sample.
        rows = torch.cat([real[torch.randperm(len(real) - 1, generator=g)[:lq - 1]], real[-1:]]).sort().values
        positions[i] = rows
    return q.to(dtype), k.to(dtype), labels, positions


def _alone(q, k, labels, positions, i):
    """Sample i alone, its PAD keys removed and its query positions shifted to the remaining keys."""
    real = (labels[i] != PAD).nonzero().flatten()
    shift = torch.cumsum((labels[i] == PAD).long(), 0)  # PAD keys at or before each key
    return (q[i:i + 1], k[i:i + 1, :, real], labels[i:i + 1, real], (positions[i] - shift[positions[i]])[None], real)


def _scores_triton(q, k, labels, positions, scale, eps, **kwargs):
    from macer_kernels.triton.modality_scores import modality_scores_triton

    out = modality_scores_triton(q.to(DEVICE), k.to(DEVICE), labels.to(DEVICE), positions.to(DEVICE), scale, eps,
                                 **kwargs)
    return out.cpu()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("store", [False, True], ids=["recompute", "store"])
def test_scores_of_a_left_padded_batch_equal_each_sample_alone(seed, dtype, store):
    """Left-padded samples of different lengths, GQA (4 query heads per KV head): each sample's scores on its real
    keys are those of the sample alone without padding (the kernel's error at most twice the fp32 PyTorch path's on
    the sample alone, floor 2e-6), and its PAD keys score exactly 0."""
    g = torch.Generator().manual_seed(seed)
    lengths = [70, 41, 57, 12]
    hq, hkv, lq, d = 8, 2, 3, 32
    q, k, labels, positions = _padded_scoring_batch(g, lengths, hq, hkv, lq, d, dtype)
    scale, eps = d**-0.5, 1e-6
    out = _scores_triton(q, k, labels, positions, scale, eps, store_logits=store)
    assert out.shape == labels.shape and out.dtype == torch.float32
    for i in range(len(lengths)):
        qi, ki, li, pi, real = _alone(q, k, labels, positions, i)
        ref = modality_scores_ref(qi, ki, li, pi, scale=scale, eps=eps)
        with use_backend("torch"):
            torch_err = rel_err(modality_scores(qi, ki, li, pi, scale=scale, eps=eps), ref)
        err = rel_err(out[i:i + 1, real], ref)
        assert err <= max(2 * torch_err, 2e-6) and err <= 1e-5, f"seed={seed} sample={i} err={err} torch={torch_err}"
        assert torch.all(out[i, labels[i] == PAD] == 0), f"seed={seed} sample={i}: a PAD key scored"


def test_scores_with_pad_keys_anywhere_gqa_row_loop(seed):
    """PAD keys in the middle of a sample too (the rule is per key, not a left-padding prefix), and 7 query heads per
    KV head x 10 query rows = 70 rows per KV head, so both phases loop over blocks of query rows."""
    g = torch.Generator().manual_seed(seed)
    lengths = [33, 50]
    q, k, labels, positions = _padded_scoring_batch(g, lengths, 14, 2, 10, 16, torch.float32, scattered=True)
    assert (labels == PAD).any(dim=1).all()
    out = _scores_triton(q, k, labels, positions, 0.25, 1e-3)
    for i in range(len(lengths)):
        qi, ki, li, pi, real = _alone(q, k, labels, positions, i)
        ref = modality_scores_ref(qi, ki, li, pi, scale=0.25, eps=1e-3)
        assert rel_err(out[i:i + 1, real], ref) <= 1e-5, f"seed={seed} sample={i}"
        assert torch.all(out[i, labels[i] == PAD] == 0), f"seed={seed} sample={i}"


def test_pad_keys_stay_zero_in_a_broken_sample(seed):
    """The non-finite rule with padding: a NaN in a real key breaks its sample (every scored real key NaN), but its
    PAD and label-0 keys stay exactly 0 and the other sample is unaffected; the garbage in the PAD rows (NaN, inf)
    breaks nothing."""
    g = torch.Generator().manual_seed(seed)
    q, k, labels, positions = _padded_scoring_batch(g, [30, 22], 4, 2, 2, 16, torch.float32)
    real0 = (labels[0] != PAD).nonzero().flatten()
    k[0, 1, real0[0], 3] = float("nan")  # the first real key: every query row sees it
    out = _scores_triton(q, k, labels, positions, 0.25, 1e-6)
    scored = labels[0] > 0
    assert torch.isnan(out[0, scored]).all() and torch.all(out[0, ~scored] == 0), f"seed={seed}"
    qi, ki, li, pi, real = _alone(q, k, labels, positions, 1)
    assert rel_err(out[1:2, real], modality_scores_ref(qi, ki, li, pi, scale=0.25)) <= 1e-5, f"seed={seed}"
    assert torch.all(out[1, labels[1] == PAD] == 0), f"seed={seed}"


# ---- 2. stage_select with per-sample budgets, PAD tokens, right-aligned rows -----------------------------------------


def _selection_batch(g, n, lengths, counts, *, ties, dtype):
    """Left-padded rows: sample b has ``lengths[b]`` real tokens, ``counts[b][label]`` of each stage label, the rest
    text (0) or label 2 (not a stage label: always kept). PAD tokens get the largest scores (a kernel that ranked
    them would pick them first)."""
    b = len(lengths)
    labels = torch.full((b, n), PAD, dtype=torch.long)
    for i, (length, row_counts) in enumerate(zip(lengths, counts)):
        rest = length - sum(row_counts.values())
        row = torch.cat([torch.full((c,), label) for label, c in row_counts.items()] +
                        [torch.randint(0, 2, (rest,), generator=g) * 2])
        labels[i, n - length:] = row[torch.randperm(length, generator=g)]
    scores = torch.randint(0, 5, (b, n), generator=g).to(dtype) if ties else torch.rand(b, n, generator=g).to(dtype)
    scores = torch.where(labels == PAD, torch.tensor(100.0, dtype=dtype), scores)
    return scores, labels, torch.randint(0, 3, (b, n), generator=g)


def _selection_oracle(scores, labels, chunks, spec, keeps, out_len):
    """Per sample: ``reference.stage_select_ref`` on its non-PAD tokens with its own budgets, mapped back to row
    indices and right-aligned; all -1 for a row that contradicts its budgets (a modality with fewer tokens than its
    keep, a negative keep) or does not fit ``out_len``."""
    from types import SimpleNamespace

    from macer_kernels.reference import stage_select_ref

    b = labels.shape[0]
    out = torch.full((b, out_len), -1, dtype=torch.long)
    for i in range(b):
        real = (labels[i] >= 0).nonzero().flatten()
        row_keeps = [keep for _, keep, _, _ in spec] if keeps is None else keeps[i].tolist()
        if any(k < 0 or k > int((labels[i] == label).sum()) for (label, _, _, _), k in zip(spec, row_keeps)):
            continue
        mods = [SimpleNamespace(label=label, keep=k, coverage_weight=w) for (label, _, w, _), k in zip(spec, row_keeps)]
        kept = real[stage_select_ref(scores[i, real][None], labels[i, real][None], mods, chunks[i, real][None])[0]]
        if len(kept) <= out_len:
            out[i, out_len - len(kept):] = kept
    return out


def _stage_select(scores, labels, chunks, spec, out_len, keeps):
    from macer_kernels.triton.stage import stage_select_triton

    keeps = None if keeps is None else keeps.to(DEVICE)
    return stage_select_triton(scores.to(DEVICE), labels.to(DEVICE), chunks.to(DEVICE), spec, out_len, keeps).cpu()


def _kept_len(labels, spec, keeps):
    """Host length of each row: its non-PAD tokens of no stage label plus its budgets."""
    stage = torch.zeros_like(labels, dtype=torch.bool)
    for label, _, _, _ in spec:
        stage |= labels == label
    return ((labels >= 0) & ~stage).sum(dim=1) + keeps.sum(dim=1)


STAGE_LABELS = (1, 3, 7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_stage_select_per_sample_budgets_right_aligned(seed, dtype):
    """Four left-padded samples of different lengths and compositions (sample 2 has no label-3 token), top-K and
    coverage modalities, budgets per sample from 0 to the full count, coarse (tied) and distinct scores; each row
    equals the reference selection of that sample alone, right-aligned with -1 on the left."""
    g = torch.Generator().manual_seed(seed)
    n, lengths = 160, [160, 97, 130, 41]
    counts = [{1: 40, 3: 50, 7: 9}, {1: 20, 3: 31, 7: 5}, {1: 33, 3: 0, 7: 9}, {1: 6, 3: 11, 7: 2}]
    count = torch.tensor([[row[label] for label in STAGE_LABELS] for row in counts], dtype=torch.int32)
    for ties in (True, False):
        scores, labels, chunks = _selection_batch(g, n, lengths, counts, ties=ties, dtype=dtype)
        for weights in ((None, 0.5, 2.0), (0.0, None, None), (None, None, None), (0.3, 0.7, 0.1)):
            keeps = (torch.rand(count.shape, generator=g) * (count + 1)).floor().to(torch.int32).clamp_max(count)
            keeps[0] = count[0]  # the full count
            keeps[1, 0] = 0
            spec = tuple((label, int(keeps[:, m].max()), w, None if w is not None else 0)
                         for m, (label, w) in enumerate(zip(STAGE_LABELS, weights)))
            out_len = int(_kept_len(labels, spec, keeps).max())
            got = _stage_select(scores, labels, chunks, spec, out_len, keeps)
            want = _selection_oracle(scores, labels, chunks, spec, keeps, out_len)
            assert (want >= 0).sum(dim=1).tolist() == _kept_len(labels, spec, keeps).tolist()  # no row discarded
            assert torch.equal(got, want), f"seed={seed} ties={ties} weights={weights} keeps={keeps.tolist()}"


def test_stage_select_without_keeps_on_a_padded_batch(seed):
    """``keeps=None``: every sample keeps the spec's budgets; PAD tokens are never kept, so the shorter samples'
    rows are right-aligned behind -1."""
    g = torch.Generator().manual_seed(seed)
    n, lengths = 90, [90, 64, 35]
    counts = [{1: 30, 3: 20, 7: 5}, {1: 12, 3: 20, 7: 3}, {1: 10, 3: 8, 7: 3}]
    scores, labels, chunks = _selection_batch(g, n, lengths, counts, ties=True, dtype=torch.float32)
    spec = ((1, 7, None, 0), (3, 8, 0.5, None), (7, 3, None, 0))
    keeps = torch.tensor([[7, 8, 3]] * 3, dtype=torch.int32)
    out_len = int(_kept_len(labels, spec, keeps).max())
    got = _stage_select(scores, labels, chunks, spec, out_len, None)
    want = _selection_oracle(scores, labels, chunks, spec, None, out_len)
    assert (want[2] == -1).sum() > 0 and torch.equal(got, want), f"seed={seed}"


def test_stage_select_contradicting_rows_are_all_minus_one(seed):
    """Rows that contradict the host: a budget above the modality's count in that row (top-K and coverage), a
    negative budget, and a row longer than ``out_len``: all -1; the other rows are unaffected."""
    g = torch.Generator().manual_seed(seed)
    n, lengths = 70, [70, 70, 50, 60, 44]
    counts = [{1: 10, 3: 10}] * 5
    scores, labels, chunks = _selection_batch(g, n, lengths, counts, ties=False, dtype=torch.float32)
    spec = ((1, 11, None, 0), (3, 11, 0.5, None))
    keeps = torch.tensor([[4, 5], [11, 2], [3, 11], [-1, 3], [2, 2]], dtype=torch.int32)
    out_len = int(_kept_len(labels, spec, keeps)[[0, 4]].max())  # row 4 fits; rows 1, 2, 3 contradict anyway
    got = _stage_select(scores, labels, chunks, spec, out_len, keeps)
    assert torch.equal(got, _selection_oracle(scores, labels, chunks, spec, keeps, out_len)), f"seed={seed}"
    assert torch.all(got[1:4] == -1) and torch.all(got[0, -1] >= 0), f"seed={seed}"
    short = _stage_select(scores, labels, chunks, spec, out_len - 1, keeps)  # row 0 or 4 no longer fits
    assert torch.equal(short, _selection_oracle(scores, labels, chunks, spec, keeps, out_len - 1)), f"seed={seed}"
    assert (short == -1).all(dim=1).sum() >= 4, f"seed={seed}"


def test_stage_select_garbage_data_stays_in_bounds(seed):
    """Whatever the device data (labels outside 0..8 and below -1, budgets far above the counts or negative, NaN and
    inf scores, huge chunk ids): no crash, and every row is either all -1 or a run of -1 then strictly increasing
    indices of non-PAD tokens."""
    g = torch.Generator().manual_seed(seed)
    b, n = 6, 75
    labels = torch.randint(-4, 12, (b, n), generator=g)
    scores = torch.randn(b, n, generator=g)
    scores[0, :5] = float("nan")
    scores[1, ::7] = float("inf")
    chunks = torch.randint(-(2**40), 2**40, (b, n), generator=g)
    spec = ((1, 9, None, 0), (3, 9, 0.5, None), (7, 9, 1.0, None))
    for keeps in (torch.randint(-3, 80, (b, 3), generator=g, dtype=torch.int32),
                  torch.full((b, 3), 2**30, dtype=torch.int32), torch.randint(0, 3, (b, 3), generator=g,
                                                                           dtype=torch.int32)):
        for out_len in (1, 20, n):
            got = _stage_select(scores, labels, chunks, spec, out_len, keeps)
            for i, row in enumerate(got):
                tail = row[row >= 0]
                assert torch.all(row[: out_len - len(tail)] == -1), f"seed={seed} row={i}"
                assert torch.all(tail[1:] > tail[:-1]) and torch.all(labels[i, tail] >= 0), f"seed={seed} row={i}"


def test_stage_select_keeps_argument_errors():
    from macer_kernels.triton.stage import stage_select_triton

    scores, labels = torch.rand(2, 10), torch.ones(2, 10, dtype=torch.long)
    spec = ((1, 3, None, 0),)
    for bad in (torch.ones(2, 1, dtype=torch.int64), torch.ones(2, 2, dtype=torch.int32),
                torch.ones(1, 1, dtype=torch.int32), torch.ones(2, 2, dtype=torch.int32)[:, ::2]):
        with pytest.raises(ValueError, match=r"keeps must be a contiguous int32 tensor \[B=2, M=1\]"):
            stage_select_triton(scores, labels, None, spec, 3, bad)
    with pytest.raises(TypeError, match="keeps must be None or an int32 tensor"):
        stage_select_triton(scores, labels, None, spec, 3, [[3], [3]])


def test_stage_select_above_the_one_program_limit_takes_keeps(seed, monkeypatch):
    """Above the one-program limits the backend hands the same arguments, ``keeps`` included, to the PyTorch
    composition (the lead's backend), which must give the same rows."""
    import inspect

    from macer_kernels.triton import stage as triton_stage

    if "keeps" not in inspect.signature(triton_stage._stage_select_torch).parameters:
        pytest.skip("the PyTorch stage_select does not take keeps yet (the lead's public layer)")
    monkeypatch.setattr(triton_stage, "ONE_PROGRAM_MAX_N", 0)
    monkeypatch.setattr(triton_stage, "COVERAGE_ONE_PROGRAM_MAX_N", 0)
    g = torch.Generator().manual_seed(seed)
    counts = [{1: 12, 3: 15, 7: 4}, {1: 6, 3: 9, 7: 0}]
    scores, labels, chunks = _selection_batch(g, 50, [50, 31], counts, ties=True, dtype=torch.float32)
    keeps = torch.tensor([[12, 4, 2], [3, 9, 0]], dtype=torch.int32)
    spec = ((1, 12, None, 0), (3, 9, 0.5, None), (7, 2, None, 0))
    out_len = int(_kept_len(labels, spec, keeps).max())
    got = _stage_select(scores, labels, chunks, spec, out_len, keeps)
    assert torch.equal(got, _selection_oracle(scores, labels, chunks, spec, keeps, out_len)), f"seed={seed}"


# ---- 3. compact_many with a 2-D keep ---------------------------------------------------------------------------------


def _batched_keep(g, n, kept):
    """keep ``[B, W]`` with W = max(kept): row b is -1 then ``kept[b]`` strictly increasing indices in [0, n)."""
    w = max(kept)
    keep = torch.full((len(kept), w), -1, dtype=torch.long)
    for b, k in enumerate(kept):
        if k:
            keep[b, w - k:] = torch.randperm(n, generator=g)[:k].sort().values
    return keep


def _gather_oracle(x, keep, dim):
    """``out[..., b, r, ...] = x[..., b, keep[b, r], ...]``, zero where ``keep[b, r] == -1``, by ``torch.gather``."""
    view = [1] * (dim - 1) + list(keep.shape) + [1] * (x.dim() - dim - 1)
    shape = list(x.shape)
    shape[dim] = keep.shape[1]
    index = keep.clamp_min(0).view(view).expand(shape)
    out = torch.gather(x, dim, index)
    return torch.where((keep >= 0).view(view).expand(shape), out, torch.zeros((), dtype=x.dtype))


def _compact_triton(tensors, keep, dims):
    from macer_kernels.triton.compact import compact_many_triton

    return [t.cpu() for t in compact_many_triton([t.to(DEVICE) for t in tensors], keep.to(DEVICE), dims)]


def test_compact_many_with_a_batched_keep(seed):
    """A stage's tensors of a padded batch in one call: hidden ``[B, N, H]`` bf16 (a transposed view), cos / sin
    ``[B, N, D]`` fp32 (one with a strided head dimension), position ids ``[3, B, N]`` int64 at dim 2 (a view whose
    outer dimensions do not merge: the copy path), a bool mask; rows of different kept lengths, one empty, one full."""
    g = torch.Generator().manual_seed(seed)
    b, n, h, d = 4, 29, 40, 8
    keep = _batched_keep(g, n, [17, 29, 0, 9])
    hidden = torch.randn(n, b, h, generator=g).to(torch.bfloat16).transpose(0, 1)
    cos = torch.randn(b, n, d, generator=g)
    sin = torch.randn(b, n, 2 * d, generator=g)[..., ::2]
    pos = torch.randint(0, 1000, (b, 3, n), generator=g).transpose(0, 1)
    mask = torch.rand(b, n, generator=g) > 0.5
    tensors, dims = [hidden, cos, sin, pos, mask], [1, 1, -2, 2, 1]
    assert not any(t.is_contiguous() for t in (hidden, sin, pos))
    got = _compact_triton(tensors, keep, dims)
    for i, (t, dim, out) in enumerate(zip(tensors, [1, 1, 1, 2, 1], got)):
        want = _gather_oracle(t, keep, dim)
        assert out.dtype == t.dtype and out.is_contiguous() and torch.equal(out, want), f"seed={seed} tensor={i}"
    assert torch.all(got[0][2] == 0) and torch.equal(got[0][1], hidden[1]), f"seed={seed}"


def test_compact_many_batched_keep_more_dims_and_nine_tensors(seed):
    """A cache ``[B, H, N, D]`` at dim 2 (batch not just before the sequence: refused), the same as ``[H, B, N, D]``
    (accepted), a batch of one, and nine tensors of every dtype (two launches' worth of slots)."""
    g = torch.Generator().manual_seed(seed)
    b, n = 3, 21
    keep = _batched_keep(g, n, [5, 21, 12])
    cache = torch.randn(2, b, n, 6, generator=g)
    assert torch.equal(_compact_triton([cache], keep, [2])[0], _gather_oracle(cache, keep, 2)), f"seed={seed}"
    with pytest.raises(ValueError, match=r"tensors\[0\] must have the batch dimension \(size B=3"):
        _compact_triton([cache.transpose(0, 1)], keep, [2])
    with pytest.raises(ValueError, match=r"tensors\[0\] must have the batch dimension"):
        _compact_triton([torch.randn(n, 4)], keep, [0])
    one = _batched_keep(g, n, [8])
    x = torch.randn(1, n, 5, generator=g)
    assert torch.equal(_compact_triton([x], one, [1])[0], _gather_oracle(x, one, 1)), f"seed={seed}"
    dtypes = [torch.bfloat16, torch.float32, torch.float64, torch.int64, torch.int32, torch.int8, torch.uint8,
              torch.bool, torch.float16]
    tensors = [(torch.randn(b, n, 3, generator=g) * 50).to(dtype) for dtype in dtypes]
    for i, (t, out) in enumerate(zip(tensors, _compact_triton(tensors, keep, [1] * 9))):
        assert torch.equal(out, _gather_oracle(t, keep, 1)), f"seed={seed} tensor={i} {t.dtype}"


def test_compact_many_strided_keep(seed):
    """A strided keep view (1-D every other entry, 2-D a column slice) is read by value, not as dense memory."""
    g = torch.Generator().manual_seed(seed)
    n = 30
    x = torch.randn(2, n, 4, generator=g)
    keep = torch.randperm(n, generator=g)[:12].sort().values
    assert torch.equal(_compact_triton([x], keep[::2], [1])[0], x[:, keep[::2]]), f"seed={seed}"
    wide = _batched_keep(g, n, [10, 10])
    assert torch.equal(_compact_triton([x], wide[:, 4:], [1])[0], _gather_oracle(x, wide[:, 4:], 1)), f"seed={seed}"


# ---- 4. a batched stage: a fixed number of launches for the whole batch, no host read --------------------------------


@pytest.fixture
def launches(monkeypatch):
    """The names of the Triton kernels launched in the test (compiled or interpreted), in order."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    names: list[str] = []
    for cls in (JITFunction, InterpretedFunction):
        original = cls.run

        def counting(self, *args, _original=original, **kwargs):
            if not kwargs.get("warmup", False):
                names.append(getattr(self, "__name__", getattr(self.fn, "__name__", "?")))
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(cls, "run", counting)
    return names


def test_a_padded_batch_stage_is_four_launches_and_reads_nothing_back(seed, launches):
    """A stage over a left-padded batch of 4 samples with per-sample budgets: the three scoring launches and ONE
    stage_select launch for the whole batch, then ONE compaction launch for hidden, cos, sin and position ids; no
    macer_kernels code reads a tensor value on the host (``sync_guard``). The kept rows are the oracle's selection
    on the kernel's own scores."""
    from sync_guard import no_host_reads

    from macer_kernels.triton.compact import compact_many_triton
    from macer_kernels.triton.modality_scores import modality_scores_triton
    from macer_kernels.triton.stage import stage_select_triton

    g = torch.Generator().manual_seed(seed)
    lengths = [60, 33, 47, 20]
    q, k, labels, positions = _padded_scoring_batch(g, lengths, 8, 2, 2, 16, torch.float32)
    labels = torch.where(labels == 3, 7, labels)  # stage labels 1 (top-K) and 2 (coverage); 7 is always kept
    chunks = torch.randint(0, 4, labels.shape, generator=g)
    count = torch.stack([(labels == 1).sum(1), (labels == 2).sum(1)], dim=1).to(torch.int32)
    keeps = (count + 1) // 2
    spec = ((1, int(keeps[:, 0].max()), None, 0), (2, int(keeps[:, 1].max()), 0.5, None))
    out_len = int(_kept_len(labels, spec, keeps).max())
    b, n = labels.shape
    hidden, cos = torch.randn(b, n, 24, generator=g), torch.randn(b, n, 16, generator=g)
    pos = torch.arange(n).expand(3, b, n)
    args = [t.to(DEVICE) for t in (q, k, labels, positions, chunks, keeps, hidden, cos, pos)]
    with no_host_reads():
        scores = modality_scores_triton(*args[:4], 0.25, 1e-6)
        keep = stage_select_triton(scores, args[2], args[4], spec, out_len, args[5])
        out = compact_many_triton([args[6], args[7], args[7], args[8]], keep, [1, 1, 1, 2])
    assert launches == ["_partial_stats_kernel", "_combine_kernel", "_scores_kernel", "_stage_select_kernel",
                        "_compact_kernel"], launches
    want = _selection_oracle(scores.cpu(), labels, chunks, spec, keeps, out_len)
    assert torch.equal(keep.cpu(), want), f"seed={seed}"
    for t, dim, o in zip((hidden, cos, cos, pos), (1, 1, 1, 2), out):
        assert torch.equal(o.cpu(), _gather_oracle(t, want, dim)), f"seed={seed}"


def test_batched_compaction_is_one_launch_per_eight_tensors(seed, launches):
    from sync_guard import no_host_reads

    from macer_kernels.triton.compact import compact_many_triton

    g = torch.Generator().manual_seed(seed)
    keep = _batched_keep(g, 15, [3, 15, 0]).to(DEVICE)
    tensors = [torch.randn(3, 15, 2, generator=g).to(DEVICE) for _ in range(17)]
    with no_host_reads():
        compact_many_triton(tensors[:8], keep, [1] * 8)
        assert len(launches) == 1, launches
        compact_many_triton(tensors, keep, [1] * 17)
    assert launches == ["_compact_kernel"] * 4, launches
