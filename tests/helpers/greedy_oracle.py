"""An oracle for ``coverage_select`` at sizes where the literal reference (O(n k) Python steps) is too slow.

It runs the greedy of ``eq:chunk_coverage_greedy`` step by step, as ``coverage_select_ref`` does, but compares only
one candidate per chunk at each step: every token of a chunk gets the same bonus, and ``s + b`` rounds monotonically
in ``s``, so a chunk's best candidate under the greedy's order (value, then score, then lower index) is its unpicked
token with the highest (score, lower index). O(n log n) to order each chunk, then O(C) per step. It shares no code
and no argument with the fast paths' sort-based merge (all steps as one global sort); the tests hold it to
``coverage_select_ref`` on small inputs.
"""

from __future__ import annotations

import math

import torch


def coverage_greedy_order(scores: torch.Tensor, chunk_ids: torch.Tensor, coverage_weight: float) -> list[int]:
    """All indices in the order the greedy picks them; the selection for budget k is the first k, sorted."""
    values = scores.to(torch.float64).tolist()
    chunks = chunk_ids.tolist()
    heads: dict[int, list[int]] = {}
    for j in sorted(range(len(values)), key=lambda j: (-values[j], j)):
        heads.setdefault(chunks[j], []).append(j)
    members = list(heads.values())
    picked = [0] * len(members)  # r_c: tokens already taken from chunk c
    order = []
    for _ in range(len(values)):
        best, best_key = -1, None
        for c, tokens in enumerate(members):
            if picked[c] < len(tokens):
                j = tokens[picked[c]]
                key = (values[j] + math.sqrt(coverage_weight / (1 + picked[c])), values[j], -j)
                if best_key is None or key > best_key:
                    best, best_key = c, key
        order.append(members[best][picked[best]])
        picked[best] += 1
    return order


def coverage_greedy(scores: torch.Tensor, chunk_ids: torch.Tensor, k: int, coverage_weight: float) -> torch.Tensor:
    """The greedy's k picks, ascending (what ``coverage_select`` returns)."""
    return torch.tensor(sorted(coverage_greedy_order(scores, chunk_ids, coverage_weight)[:k]), dtype=torch.long)
