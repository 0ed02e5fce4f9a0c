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
