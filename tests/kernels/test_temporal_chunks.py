"""temporal_chunks: floor(C (t - t_min) / (t_max - t_min + 1))."""

import random

import pytest
import torch

from macer_kernels import temporal_chunks
from macer_kernels.reference import temporal_chunks_ref


def test_arange_gives_equal_bins():
    assert torch.bincount(temporal_chunks(torch.arange(864), 8)).tolist() == [108] * 8


@pytest.mark.parametrize("dtype", [torch.long, torch.int32, torch.float32, torch.float64])
def test_matches_reference(device, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    t = torch.randint(-50, 400, (333,), generator=g).to(dtype).to(device)
    if dtype.is_floating_point:
        t = t + torch.rand(333, generator=g).to(dtype).to(device)
    out = temporal_chunks(t, 8)
    assert out.dtype == torch.long and out.device == t.device
    assert torch.equal(out.cpu(), temporal_chunks_ref(t.cpu(), 8)), seed
    assert 0 <= int(out.min()) and int(out.max()) <= 7


def test_qwen_temporal_rows():
    # Qwen2.5-Omni: 12 frames, temporal grid of 2 frames, 144 tokens per grid, +50 position units per grid (2 s at
    # 25 units per s). Six temporal groups in 8 chunks: every group stays whole, two chunks stay empty.
    t = torch.arange(6).repeat_interleave(144) * 50 + 7
    ids = temporal_chunks(t, 8)
    assert ids.reshape(6, 144).unique(dim=1).shape[1] == 1
    assert ids[::144].tolist() == [0, 1, 3, 4, 6, 7]  # floor(8 * 50 g / 251)


def test_constant_and_empty():
    assert temporal_chunks(torch.full((5,), 3), 8).tolist() == [0] * 5
    assert temporal_chunks(torch.empty(0, dtype=torch.long), 8).numel() == 0
    assert temporal_chunks(torch.arange(3), 1).tolist() == [0, 0, 0]


@pytest.mark.parametrize(
    ("t", "c", "error", "message"),
    [
        (torch.arange(4), 0, ValueError, r"num_chunks must be an integer >= 1 .*got 0"),
        (torch.arange(4), -1, ValueError, r"num_chunks must be an integer >= 1 .*got -1"),
        (torch.arange(4), 2.0, ValueError, r"num_chunks must be an integer >= 1 .*got 2.0"),
        (torch.arange(4), 2**31, ValueError, r"num_chunks must be an integer >= 1 \(and < 2\*\*31\)"),
        (torch.tensor([-(2**62), 2**62]), 2, ValueError, r"span less than 2\*\*63 - 1 .*t_min=-4611686018427387904"),
        (torch.tensor([-(2**63), 2**63 - 1]), 2, ValueError, "must span less than 2"),
        (torch.arange(4)[None], 2, ValueError, "temporal_positions must have 1 dimensions"),
        (torch.tensor([0.0, float("inf")]), 2, ValueError, "temporal_positions must be finite"),
        (torch.tensor([True, False]), 2, TypeError, "temporal_positions must be integer or floating"),
    ],
)
def test_errors(t, c, error, message):
    with pytest.raises(error, match=message):
        temporal_chunks(t, c)


def _exact(t: list[int], c: int) -> list[int]:
    """Python-int oracle (unbounded integers): floor(C (t - t_min) / (t_max - t_min + 1))."""
    lo, hi = min(t), max(t)
    return [c * (x - lo) // (hi - lo + 1) for x in t]


@pytest.mark.parametrize("c", [1, 2, 7, 8, 1000, 2**31 - 1])
@pytest.mark.parametrize("base", [0, -(2**62), 2**62 - 1])
def test_exact_near_int64_limits(c, base):
    # Spans near 2**63 / C and up to the largest allowed (t_max - t_min + 1 = 2**63 - 1), where C (t - t_min) no
    # longer fits int64; every id against Python's unbounded integers, including each chunk's first/last position.
    seed = torch.seed() % 2**31
    rng = random.Random(seed)
    for span in {min(2**63 // c - 1, 2**63 - 1), min(2**63 // c + 12345, 2**63 - 1), 2**62 + 3, 2**63 - 1}:
        lo = max(-(2**63), min(base, 2**63 - span))  # keeps t_max = lo + span - 1 within int64
        offsets = [rng.randrange(span) for _ in range(200)]
        starts = [-(-k * span // c) for k in range(1, min(c, 50))]  # ceil(k span / C): first position of chunk k
        t = [lo, lo + span - 1, *(lo + o for o in offsets), *(lo + s for s in starts), *(lo + s - 1 for s in starts)]
        out = temporal_chunks(torch.tensor(t), c)
        assert out.tolist() == _exact(t, c), f"seed={seed} span={span} base={base} c={c}"
        assert 0 <= int(out.min()) and int(out.max()) <= c - 1


def test_matches_python_ints_on_random_small_ranges():
    seed = torch.seed() % 2**31
    g = torch.Generator().manual_seed(seed)
    for _ in range(20):
        c = int(torch.randint(1, 20, (1,), generator=g))
        t = torch.randint(-1000, 1000, (int(torch.randint(1, 60, (1,), generator=g)),), generator=g)
        assert temporal_chunks(t, c).tolist() == _exact(t.tolist(), c), f"seed={seed} c={c} t={t.tolist()}"


@pytest.mark.parametrize("op", [temporal_chunks, temporal_chunks_ref], ids=["op", "reference"])
@pytest.mark.parametrize(
    ("t", "c"),
    [
        (torch.tensor([0.0, 3e38]), 8),  # float32: t_max - t_min + 1 rounds to t_max - t_min, the quotient to C
        (torch.tensor([0.0, 2.0**54], dtype=torch.float64), 2),
        (torch.tensor([-1e308, 0.0, 1e308], dtype=torch.float64), 2**31 - 1),  # t - t_min overflows float64 unscaled
        (torch.tensor([-1.7e308, 1.7e308, 5.0], dtype=torch.float64), 3),
        (torch.tensor([2.0**60, 2.0**60 + 2.0**10, 2.0**61], dtype=torch.float64), 1000),
        (torch.tensor([0, 2**54]), 2),  # integers stay exact in both
    ],
)
def test_extreme_values_stay_in_range(op, t, c):
    """Guards issue 21.8: for floats with a span past 2**53 (``[0., 3e38]``, C = 8 gave ``[0, 8]``; a float64 span of
    2**54 with C = 2 gave ``[0, 2]``) the op and the reference returned id C, and past ~1.8e308 t - t_min overflowed to
    inf (NaN ids). Every id must lie in [0, C - 1], t_min in chunk 0, t_max in chunk C - 1 (its exact value,
    floor(C span / (span + 1)), is C - 1 for any span >= C - 1), and the ids must not decrease with t."""
    ids = op(t, c)
    assert ids.dtype == torch.long and ids.shape == t.shape
    assert 0 <= int(ids.min()) and int(ids.max()) <= c - 1, ids.tolist()
    assert int(ids[t.argmin()]) == 0 and int(ids[t.argmax()]) == c - 1, ids.tolist()
    order = t.double().argsort()
    assert bool((ids[order].diff() >= 0).all()), ids.tolist()


def test_op_matches_reference_on_wide_float_spans(seed):
    """The scaled float formula of the op and of the reference agree id for id on random float64 positions whose span
    runs from small to past 2**53 and up to ~1e308 (guards the two drifting apart: one scaled, one not)."""
    g = torch.Generator().manual_seed(seed)
    for exponent in (1, 20, 53, 60, 300, 307):
        t = (torch.rand(200, generator=g, dtype=torch.float64) * 2 - 1) * 10.0**exponent
        for c in (1, 3, 8, 2**31 - 1):
            assert torch.equal(temporal_chunks(t, c), temporal_chunks_ref(t, c)), f"seed={seed} 1e{exponent} c={c}"
