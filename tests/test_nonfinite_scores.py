"""modality_scores on non-finite inputs: one rule for every backend (``modality_scores``' docstring, README).

Tokens labelled 0 score exactly 0. In a batch element where a query row, or a key that some query row sees, holds a
NaN or an infinity, every token labelled > 0 scores NaN; keys no row sees and the other batch elements do not
matter. The oracle is written here: NaN / 0 on the broken batch element, the float64 reference on the others.
"""

from __future__ import annotations

import pytest
import torch
from score_inputs import rel_err, score_inputs

from macer_kernels import modality_scores
from macer_kernels.reference import modality_scores_ref

# The Triton interpreter computes with numpy, which warns on the NaN arithmetic these inputs are made of.
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")

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


# What the Triton kernels (macer_kernels/triton/modality_scores.py) must change to follow the rule; until then their
# cases are expected to fail (strict: a fix makes them pass, and this mark must go).
TRITON_GAP = ("Triton: a broken row (a non-finite logit of a kept pair) must make its weights for labels >= 1 NaN "
              "(the combine's `acc > 0.0` turns NaN mass into weight 0, and -inf logits are never noticed), and "
              "phase 3 must store exactly 0 for label-0 keys (it stores sum_r p * 0 = NaN when p is NaN)")

CASES = ["nan key element", "+inf key row", "-inf query element", "key only seen by the last row",
         "inf key with -inf logits only", "nan key that no row sees"]


@pytest.mark.parametrize("case", CASES)
def test_non_finite_inputs_follow_the_rule(backend, case, request):
    name, device = backend
    if name == "triton" and case != "nan key that no row sees":
        request.applymarker(pytest.mark.xfail(strict=True, reason=TRITON_GAP))
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    q, k, m = score_inputs(B, HQ, HKV, LQ, N, D, seed=seed)
    m[:, :3] = 0  # every batch element has text, audio (1) and video (2) tokens
    m[:, 3:6] = 1
    m[:, 6:9] = 2
    positions = torch.tensor(POSITIONS)
    broken = _poison(case, q, k)
    out = modality_scores(q.to(device), k.to(device), m.to(device), positions.to(device)).cpu()
    msg = f"case {case!r}, seed {seed}"
    for b in range(B):
        text, scored = m[b] == 0, m[b] != 0
        assert torch.all(out[b, text] == 0), f"{msg}: text tokens of batch {b} must score exactly 0, got {out[b, text]}"
        if b == broken:
            assert torch.isnan(out[b, scored]).all(), f"{msg}: batch {b} must be NaN on scored tokens, got {out[b]}"
        else:
            ref = modality_scores_ref(q[b:b + 1], k[b:b + 1], m[b:b + 1], positions[b:b + 1])
            assert not torch.isnan(out[b]).any(), f"{msg}: batch {b} is not broken, got {out[b]}"
            assert rel_err(out[b:b + 1], ref) < 1e-5, msg
