"""A left-padded batch through one stage (issue #11 item 3): PAD_LABEL keys, per-sample budgets, right-aligned keep
rows and batched compaction, on every backend, against each sample run alone.

The oracle of every test is the sample alone: its real tokens only (padding cut off, positions shifted), through
the float64 reference or through the same public op at batch 1. Shapes are small: Triton runs in the interpreter
on machines without a GPU.
"""

from __future__ import annotations

import pytest
import torch
from score_inputs import rel_err

from macer_kernels import PAD_LABEL, StageModality, compact, compact_many, modality_scores, select_stage
from macer_kernels.reference import modality_scores_ref, stage_ref

Mod = StageModality


def padded_batch(seed, lengths, counts, *, hq=4, hkv=2, lq=3, d=16, dtype=torch.float32, device="cpu", chunks=4):
    """A left-padded batch: sample b has ``lengths[b]`` real tokens with ``counts[b][label]`` tokens of each label at
    random places (label 0 elsewhere; the last ``lq`` real tokens are text: the question rows). Returns query, key,
    labels (PAD_LABEL on the padding), chunk ids, the query positions of each sample's last ``lq`` rows and pads."""
    g = torch.Generator().manual_seed(seed)
    b, n = len(lengths), max(lengths)
    pads = [n - length for length in lengths]
    query = torch.randn(b, hq, lq, d, generator=g)
    key = torch.randn(b, hkv, n, d, generator=g)
    labels = torch.full((b, n), PAD_LABEL, dtype=torch.long)
    for i, (length, pad) in enumerate(zip(lengths, pads, strict=True)):
        body = torch.cat([torch.full((c,), label) for label, c in counts[i].items()] +
                         [torch.zeros(length - lq - sum(counts[i].values()), dtype=torch.long)])
        labels[i, pad:n - lq] = body[torch.randperm(length - lq, generator=g)]
        labels[i, n - lq:] = 0
    chunk_ids = torch.randint(0, chunks, (b, n), generator=g)
    positions = torch.arange(n - lq, n).expand(b, lq)
    return (query.to(dtype).to(device), key.to(dtype).to(device), labels.to(device), chunk_ids.to(device),
            positions.to(device), pads)


def test_reference_padding_is_the_sample_alone(seed):
    """The float64 reference itself: a PAD key changes nothing for its sample (the oracle the kernels are held to)."""
    q, k, labels, _, positions, pads = padded_batch(seed, [30, 22, 17], [{1: 9, 2: 6}, {1: 4, 2: 8}, {2: 5}])
    scores = modality_scores_ref(q, k, labels, positions)
    for i, pad in enumerate(pads):
        alone = modality_scores_ref(q[i:i + 1], k[i:i + 1, :, pad:], labels[i:i + 1, pad:], positions[i:i + 1] - pad)
        # float64 sums over a different number of zero terms round alike up to a few ulps
        assert rel_err(scores[i:i + 1, pad:], alone) <= 1e-13, f"seed={seed} sample {i}"
        assert torch.all(scores[i, :pad] == 0), f"seed={seed} sample {i}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_scores_of_a_padded_batch_are_each_sample_alone(backend, dtype, seed):
    _, device = backend
    q, k, labels, _, positions, pads = padded_batch(seed, [41, 26, 33], [{1: 12, 2: 9}, {1: 7, 2: 5}, {1: 3, 2: 20}],
                                                    hq=6, hkv=2, dtype=dtype, device=device)
    scores = modality_scores(q, k, labels, positions)
    for i, pad in enumerate(pads):
        alone = modality_scores_ref(q[i:i + 1].cpu(), k[i:i + 1, :, pad:].cpu(), labels[i:i + 1, pad:].cpu(),
                                    positions[i:i + 1].cpu() - pad)
        err = rel_err(scores[i:i + 1, pad:], alone)
        assert err <= 2e-6, f"seed={seed} sample {i}: rel err {err}"
        assert torch.all(scores[i, :pad].cpu() == 0), f"seed={seed} sample {i}: padding must score exactly 0"


def _alone(q, k, labels, chunks, positions, pad, mods_b, **kwargs):
    """One sample through select_stage at batch 1 on its real tokens, as positions of the padded row."""
    uses_chunks = any(m.coverage_weight is not None for m in mods_b)
    keep = select_stage(q, k[:, :, pad:], labels[:, pad:], mods_b, chunk_ids=chunks[:, pad:] if uses_chunks else None,
                        query_positions=positions - pad, **kwargs)
    return keep[0] + pad


def test_stage_with_per_sample_budgets_is_each_sample_alone(backend, seed):
    """Different lengths, padding, counts and budgets per sample (top-K and coverage, a keep of 0, a keep of the whole
    count, a sample without one modality) in one call: each row is the sample alone, right-aligned after -1s. A large
    eps (0.3), so the batched path is checked to apply it (the default moves no selection)."""
    eps = 0.3
    _, device = backend
    counts = [{1: 12, 2: 9, 3: 2}, {1: 7, 2: 0, 3: 4}, {1: 3, 2: 20}]
    q, k, labels, chunks, positions, pads = padded_batch(seed, [45, 28, 36], counts, device=device)
    keeps = [(5, 4), (7, 0), (0, 11)]
    mods = [Mod(1, [c[1] for c in counts], [kp[0] for kp in keeps]),
            Mod(2, [c[2] for c in counts], [kp[1] for kp in keeps], coverage_weight=0.3, num_chunks=4)]
    keep, scores = select_stage(q, k, labels, mods, chunk_ids=chunks, query_positions=positions, padding=pads,
                                return_scores=True, eps=eps)
    lengths = [labels.shape[1] - pad - sum(c[m] - kp[j] for j, m in enumerate((1, 2)))
               for pad, c, kp in zip(pads, counts, keeps, strict=True)]
    assert keep.shape == (3, max(lengths)) and keep.dtype == torch.long, f"seed={seed}"
    for i, (pad, length) in enumerate(zip(pads, lengths, strict=True)):
        mods_b = [Mod(1, counts[i][1], keeps[i][0]), Mod(2, counts[i][2], keeps[i][1], coverage_weight=0.3)]
        alone = _alone(q[i:i + 1], k[i:i + 1], labels[i:i + 1], chunks[i:i + 1], positions[i:i + 1], pad, mods_b,
                       eps=eps)
        row = keep[i].cpu()
        assert torch.all(row[:keep.shape[1] - length] == -1), f"seed={seed} sample {i}: left fill"
        assert torch.equal(row[keep.shape[1] - length:], alone.cpu()), f"seed={seed} sample {i}"
        # And against the float64 reference on the sample alone (scores and selection).
        ref_keep, ref_scores = stage_ref(q[i:i + 1], k[i:i + 1, :, pad:], labels[i:i + 1, pad:], mods_b,
                                         chunks[i:i + 1, pad:], positions[i:i + 1] - pad, eps=eps)
        assert torch.equal(row[keep.shape[1] - length:], ref_keep[0] + pad), f"seed={seed} sample {i} vs stage_ref"
        err = rel_err(scores[i:i + 1, pad:].cpu(), ref_scores)
        assert err <= 2e-6, f"seed={seed} sample {i}: scores rel err {err} vs stage_ref"
    assert torch.all(scores[0, :pads[0]].cpu() == 0), f"seed={seed}"


def test_uniform_budgets_with_padding_and_no_padding(backend, seed):
    """Uniform budgets (host integers only, no budget table) with padding; and without padding the result is
    today's full [B, out_len]."""
    _, device = backend
    counts = [{1: 8, 2: 6}] * 3
    q, k, labels, chunks, positions, pads = padded_batch(seed, [30, 24, 30], counts, device=device)
    mods = [Mod(1, 8, 3), Mod(2, 6, 2)]
    keep = select_stage(q, k, labels, mods, query_positions=positions, padding=pads)
    for i, pad in enumerate(pads):
        alone = _alone(q[i:i + 1], k[i:i + 1], labels[i:i + 1], chunks[i:i + 1], positions[i:i + 1], pad, mods)
        row = keep[i].cpu()
        assert torch.equal(row[row >= 0], alone.cpu()) and torch.all(row[:pad] == -1), f"seed={seed} sample {i}"
    full = select_stage(q[[0, 2]], k[[0, 2]], labels[[0, 2]], mods, query_positions=positions[[0, 2]])
    assert full.shape == (2, 30 - 5 - 4) and torch.all(full >= 0), f"seed={seed}"


def test_batched_compaction_gathers_each_row_and_zero_fills(backend, seed):
    _, device = backend
    g = torch.Generator().manual_seed(seed)
    b, n, w = 3, 19, 11
    rows = []
    for length in (11, 6, 0):
        picks = torch.sort(torch.randperm(n, generator=g)[:length]).values
        rows.append(torch.cat([torch.full((w - length,), -1), picks]))
    keep = torch.stack(rows).to(device)
    hidden = torch.randn(b, n, 24, generator=g).to(device)
    cos = torch.randn(b, n, 8, generator=g).to(torch.bfloat16).to(device)
    pos = torch.randint(0, 100, (3, b, n), generator=g).to(device)
    view = torch.randn(b, 24, n, generator=g).to(device).transpose(1, 2)  # non-contiguous [B, N, 24]
    outs = compact_many([hidden, cos, pos, view], keep, [1, 1, 2, 1])
    assert torch.equal(compact(hidden, keep, 1).cpu(), outs[0].cpu()), f"seed={seed}"
    for x, d, out in zip([hidden, cos, pos, view], [1, 1, 2, 1], outs, strict=True):
        x, kc = x.cpu(), keep.cpu()
        assert out.shape[d] == w and out.dtype == x.dtype, f"seed={seed}"
        for i in range(b):
            for r in range(w):
                got, j = out.select(d - 1, i).select(d - 1, r).cpu(), int(kc[i, r])
                want = torch.zeros_like(got) if j < 0 else x.select(d - 1, i).select(d - 1, j)
                assert torch.equal(got, want), f"seed={seed}: sample {i} slot {r} of a {tuple(x.shape)} tensor"


@pytest.mark.parametrize(
    ("mods", "kwargs", "message"),
    [
        ([Mod(1, [8, 4], 3)], {}, r"modalities\[0\].count must be an integer or a sequence of B=3"),
        ([Mod(1, 8, [3, 3, 9])], {}, r"modalities\[0\].keep must be in \[0, 8\] \(its count\) in sample 2, got 9"),
        ([Mod(1, [8, 4, 8], [3, 5, 3])], {}, r"keep must be in \[0, 4\] \(its count\) in sample 1, got 5"),
        ([Mod(1, 8, 3)], {"padding": [0, 6]}, r"padding must be an integer or a sequence of B=3"),
        ([Mod(1, 8, 3)], {"padding": [0, 6, -1]}, r"padding\[2\] must be a non-negative integer"),
        ([Mod(1, 8, 3)], {"padding": [0, 27, 0]}, "plus its padding must add up to at most N=30"),
        ([Mod(1, 8, 3)], {"padding": [0, 5, 0]}, "padding says sample 1 holds 5 tokens of label -1, but labels hold 6"),
        ([Mod(1, [8, 8, 7], 3)], {"padding": [0, 6, 0]}, r"modalities\[0\].count says sample 2 holds 7 tokens"),
    ],
)
def test_per_sample_errors_name_the_parameter(mods, kwargs, message, seed):
    q, k, labels, _, positions, _ = padded_batch(seed, [30, 24, 30], [{1: 8, 2: 6}] * 3)
    with pytest.raises(ValueError, match=message):
        select_stage(q, k, labels, mods, query_positions=positions, **kwargs)


def test_a_query_row_on_padding_is_refused(seed):
    q, k, labels, _, positions, _ = padded_batch(seed, [30, 24, 30], [{1: 8, 2: 6}] * 3)
    with pytest.raises(ValueError, match="query_positions must point at tokens, not at padding"):
        modality_scores(q, k, labels, positions - torch.tensor([[0], [27], [0]]))


def test_default_query_rows_on_padding_are_refused(seed):
    """Without query_positions the last Lq rows are the query rows: right padding would put them on padding."""
    q, k, labels, _, _, pads = padded_batch(seed, [30, 24, 30], [{1: 8, 2: 6}] * 3)
    with pytest.raises(ValueError, match=r"the default query rows \(the last Lq positions\) must point at tokens"):
        select_stage(q, k, labels.flip(1), [Mod(1, 8, 3), Mod(2, 6, 2)], padding=pads)
    with pytest.raises(ValueError, match=r"the default query rows \(the last Lq positions\) must point at tokens"):
        modality_scores(q, k, labels.flip(1))


def test_batched_compaction_of_an_empty_sequence(backend):
    """N = 0 with an all -1 keep: zero rows, nothing read."""
    _, device = backend
    out = compact_many([torch.zeros(2, 0, 3, device=device), torch.zeros(3, 2, 0, dtype=torch.long, device=device)],
                       torch.full((2, 4), -1, device=device), [1, 2])
    assert out[0].shape == (2, 4, 3) and out[1].shape == (3, 2, 4)
    assert all(bool((o.cpu() == 0).all()) for o in out)
