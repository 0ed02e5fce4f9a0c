"""modality_scores on non-finite inputs: one rule for every backend (``modality_scores``' docstring, README).

Tokens labelled 0 score exactly 0. In a batch element where a query row, or a key that some query row sees, holds a
NaN or an infinity, every token labelled > 0 scores NaN; keys no row sees and the other batch elements do not
matter. The oracle is written here: NaN / 0 on the broken batch element, the float64 reference on the others.
"""

from __future__ import annotations

import pytest
import torch
from score_inputs import rel_err, score_inputs

from macer_kernels import StageModality, modality_scores, select_stage
from macer_kernels.reference import modality_scores_ref

# The Triton interpreter computes with numpy, which warns on the NaN arithmetic these inputs are made of.
pytestmark = [pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
              pytest.mark.filterwarnings("ignore:All-NaN slice encountered:RuntimeWarning")]

B, HQ, HKV, LQ, N, D = 2, 4, 2, 2, 40, 8
POSITIONS = [[20, 29], [25, 39]]  # batch 0 sees keys 0..29 only: keys 30..39 are seen by no row


def _poison(case: str, q: torch.Tensor, k: torch.Tensor) -> int | None:
    """Write the non-finite values of ``case`` into q / k (CPU, in place); return the batch element it breaks."""
    if case == "nan key element":  # one element of one KV head: breaks that head's rows only, the rule all
        k[0, 1, 7, 3] = float("nan")
        return 0
    if case == "+inf key row":
        k[1, 0, 33, :] = float("inf")
        return 1
    if case == "-inf query element":
        q[1, 3, 0, 5] = float("-inf")
        return 1
    if case == "key only seen by the last row":  # the earlier row of batch 0 cannot see it
        k[0, 0, 25, 0] = float("nan")
        return 0
    if case == "inf key with -inf logits only":
        # Every logit against key 12 is -inf (finite elements times a positive query, +inf times a negative one): IEEE
        # softmax would give it weight 0 and leave the scores finite; the rule does not depend on those signs.
        q[0, :, :, 0] = -q[0, :, :, 0].abs() - 0.5
        k[0, :, 12, 0] = float("inf")
        return 0
    if case == "nan key that no row sees":
        k[0, :, 35, :] = float("nan")
        return None
    raise AssertionError(case)


CASES = ["nan key element", "+inf key row", "-inf query element", "key only seen by the last row",
         "inf key with -inf logits only", "nan key that no row sees"]


@pytest.mark.parametrize("case", CASES)
def test_non_finite_inputs_follow_the_rule(backend, case):
    _, device = backend
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    q, k, m = score_inputs(B, HQ, HKV, LQ, N, D, seed=seed)
    m[:, :3] = 0  # every batch element has text, audio (1) and video (2) tokens
    m[:, 3:6] = 1
    m[:, 6:9] = 2
    positions = torch.tensor(POSITIONS)
    broken = _poison(case, q, k)
    out = modality_scores(q.to(device), k.to(device), m.to(device), positions.to(device)).cpu()
    _check_rule(out, q, k, m, positions, broken, f"case {case!r}, seed {seed}")


def _check_rule(out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, m: torch.Tensor, positions: torch.Tensor,
                broken: int | None, msg: str) -> None:
    """The rule's oracle: text exactly 0 everywhere, NaN on the scored tokens of ``broken``, the float64 reference
    on every other batch element."""
    for b in range(out.shape[0]):
        text, scored = m[b] == 0, m[b] != 0
        assert torch.all(out[b, text] == 0), f"{msg}: text tokens of batch {b} must score exactly 0, got {out[b, text]}"
        if b == broken:
            assert torch.isnan(out[b, scored]).all(), f"{msg}: batch {b} must be NaN on scored tokens, got {out[b]}"
        else:
            ref = modality_scores_ref(q[b:b + 1], k[b:b + 1], m[b:b + 1], positions[b:b + 1])
            assert not torch.isnan(out[b]).any(), f"{msg}: batch {b} is not broken, got {out[b]}"
            assert rel_err(out[b:b + 1], ref) < 1e-5, msg


@pytest.mark.triton
@pytest.mark.parametrize("store_logits", [False, True])
@pytest.mark.parametrize(("hq", "lq"), [(8, 3), (4, 17)])
@pytest.mark.parametrize("value", [float("nan"), float("-inf")])
def test_triton_flags_the_last_row_in_both_strategies(store_logits, hq, lq, value):
    # The Triton kernels carry the rule as a per-row flag (tile maximum NaN in phase 1, weight slot 0 after the
    # combine) that phase 3 reduces over all HKV * R rows of a batch element in blocks of ROWS. Only the last query
    # row of the last head is broken, so the flag must be found in the last block: 24 rows in blocks of 16 at
    # (8, 3); 68 rows per KV head at (4, 17), above MAX_DOT_ROWS, so the kernels also loop over row blocks.
    pytest.importorskip("triton")
    from macer_kernels.triton.modality_scores import modality_scores_triton

    device = "cuda" if torch.cuda.is_available() else "cpu"
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    q, k, m = score_inputs(B, hq, HKV, lq, N, D, seed=seed)
    m[:, :3] = 0
    m[:, 3:6] = 1
    positions = torch.stack([torch.arange(30 - lq, 30), torch.arange(N - lq, N)])
    q[1, -1, -1, 2] = value  # batch 1, last head, last row
    out = modality_scores_triton(q.to(device), k.to(device), m.to(device), positions.to(device), D ** -0.5, 1e-6,
                                 store_logits=store_logits).cpu()
    _check_rule(out, q, k, m, positions, 1, f"store_logits={store_logits}, Hq={hq}, Lq={lq}, {value}, seed {seed}")


def test_select_stage_scores_follow_the_rule(backend):
    # select_stage calls the backend's scoring function directly (not the public op): its scores obey the same rule.
    # Which tokens a stage keeps from NaN scores is not part of the rule, so only the scores are checked here.
    _, device = backend
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    q, k, m = score_inputs(B, HQ, HKV, LQ, N, D, seed=seed)
    m[:] = 0
    m[:, 5:25] = 1
    m[:, 25:35] = 2
    positions = torch.tensor(POSITIONS)
    broken = _poison("nan key element", q, k)
    mods = [StageModality(label=1, count=20, keep=5), StageModality(label=2, count=10, keep=3)]
    keep, out = select_stage(q.to(device), k.to(device), m.to(device), mods, query_positions=positions.to(device),
                             return_scores=True)
    assert keep.shape == (B, N - 22), f"seed {seed}"
    _check_rule(out.cpu(), q, k, m, positions, broken, f"select_stage, seed {seed}")
