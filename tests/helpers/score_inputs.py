"""Random inputs and the error metric shared by the modality_scores tests of every backend."""

from __future__ import annotations

import torch


def score_inputs(b, hq, hkv, lq, n, d, *, labels=3, dtype=torch.float32, device="cpu", seed=None, layout="bhnd",
                 q_scale=1.0):
    """query ``[B,Hq,Lq,D]``, key ``[B,Hkv,N,D]`` and modality labels ``[B,N]`` in ``0..labels-1``, drawn from
    ``seed``, or without one from torch's global generator, which conftest seeds with the test's seed (named in a
    failure report, ``--seed`` reruns it). ``layout="bnhd"`` gives a FlashAttention/vLLM cache ``[B,N,Hkv,D]`` seen
    as ``[B,Hkv,N,D]`` without a copy."""
    g = torch.Generator().manual_seed(seed if seed is not None else int(torch.randint(2**31, (1,))))
    query = (q_scale * torch.randn(b, hq, lq, d, generator=g)).to(dtype).to(device)
    if layout == "bhnd":
        key = torch.randn(b, hkv, n, d, generator=g).to(dtype).to(device)
    else:
        key = torch.randn(b, n, hkv, d, generator=g).to(dtype).to(device).transpose(1, 2)
    modality = torch.randint(0, labels, (b, n), generator=g).to(device)
    return query, key, modality


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``||out - ref|| / ||ref||`` in float64 (``ref`` on the CPU)."""
    return ((out.cpu().double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def stage_inputs(seed, b, n, counts, *, hq=4, hkv=2, lq=3, d=32, dtype=torch.float32, device="cpu", layout="bhnd",
                 chunks=4, dup_label=None):
    """query, key, labels, chunk_ids for a stage: each sample holds exactly ``counts[label]`` tokens of each label
    (at random places), label 0 elsewhere. ``dup_label``: the keys of that label's tokens repeat a few vectors, so
    their scores tie exactly (identical logits in every implementation)."""
    g = torch.Generator().manual_seed(seed)
    query = torch.randn(b, hq, lq, d, generator=g)
    key = torch.randn(b, n, hkv, d, generator=g)
    labels = torch.zeros(b, n, dtype=torch.long)
    for i in range(b):
        row = torch.cat([torch.full((c,), label) for label, c in counts.items()] +
                        [torch.zeros(n - sum(counts.values()), dtype=torch.long)])
        labels[i] = row[torch.randperm(n, generator=g)]
        if dup_label is not None:
            where = (labels[i] == dup_label).nonzero().flatten()
            pick = torch.randint(0, 3, (len(where),), generator=g)
            key[i, where] = key[i, where[:3]][pick] if len(where) >= 3 else key[i, where]
    chunk_ids = torch.randint(0, chunks, (b, n), generator=g)
    key = key.to(dtype).to(device)
    key = key.transpose(1, 2) if layout == "bnhd" else key.transpose(1, 2).contiguous()
    return query.to(dtype).to(device), key, labels.to(device), chunk_ids.to(device)
