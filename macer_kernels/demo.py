"""Ops-only demo: one MACER readout on a realistic Qwen2.5-Omni-7B case, with random post-RoPE queries and keys.

``python -m macer_kernels.demo`` prints the budget split, the retained audio/video composition and the per-chunk
video counts. (``make demo`` runs the model-level demo of ``macer``; this one needs nothing but torch.)
"""

from __future__ import annotations

import argparse
import time

import torch

import macer_kernels as mk

AUDIO, VIDEO = 1, 2


def interleaved_layout(n_audio: int, frames: int, tokens_per_grid: int, audio_per_grid: int) -> torch.Tensor:
    """Modality labels of a prompt ``text V A V A ... text`` as Qwen2.5-Omni lays out a clip (2-second chunks)."""
    grids = frames // 2
    parts = [torch.zeros(14, dtype=torch.long)]
    audio_left = n_audio
    for g in range(grids):
        parts.append(torch.full((tokens_per_grid,), VIDEO))
        take = audio_left if g == grids - 1 else min(audio_per_grid, audio_left)
        parts.append(torch.full((take,), AUDIO))
        audio_left -= take
    parts.append(torch.zeros(24, dtype=torch.long))  # the question, <|im_end|>, assistant header
    return torch.cat(parts)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keep-ratio", type=float, default=0.25)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    torch.manual_seed(args.seed)
    n_audio, frames, hq, hkv, d, lq = 1460, 12, 28, 4, 128, 4
    alpha, coverage_weight, chunks = 0.30, 0.20, 8  # Qwen2.5-Omni-7B defaults (tab:macer_defaults)
    labels = interleaved_layout(n_audio, frames, tokens_per_grid=144, audio_per_grid=250)
    n = labels.numel()
    n_video = int((labels == VIDEO).sum())
    budget = mk.split_budget(n_audio, n_video, args.keep_ratio, alpha)
    print(f"prompt: {n} tokens = {n_audio} audio + {n_video} video + {n - n_audio - n_video} text")
    print(f"budget (rho={args.keep_ratio}, alpha={alpha}): K_mm={budget.total} -> K_a={budget.audio}, "
          f"K_v={budget.video}")
    query = torch.randn(1, hq, lq, d, dtype=torch.bfloat16)
    key = torch.randn(1, n, hkv, d, dtype=torch.bfloat16).transpose(1, 2)  # a [B, N, H, D] cache, no copy
    question = torch.arange(n - 8, n - 4)[None]  # the 4 tokens before <|im_end|> and the assistant header

    t0 = time.perf_counter()
    audio_scores = mk.modality_scores(query, key, torch.where(labels == AUDIO, 1, 0)[None], question)[0]
    audio_idx = (labels == AUDIO).nonzero().squeeze(1)
    audio_kept = audio_idx[mk.topk_indices(audio_scores[audio_idx], budget.audio)]
    video_scores = mk.modality_scores(query, key, torch.where(labels == VIDEO, 1, 0)[None], question)[0]
    video_idx = (labels == VIDEO).nonzero().squeeze(1)
    # Temporal position of a video token: its 2-frame grid (144 tokens each), as the model's M-RoPE row gives.
    grid_of_video = torch.arange(n_video) // 144
    chunk_ids = mk.temporal_chunks(grid_of_video, chunks)
    video_pick = mk.coverage_select(video_scores[video_idx], chunk_ids, budget.video, coverage_weight)
    video_kept = video_idx[video_pick]
    keep = torch.cat([(labels == 0).nonzero().squeeze(1), audio_kept, video_kept]).sort().values
    hidden = mk.compact(torch.randn(1, n, 64), keep)
    elapsed_ms = 1e3 * (time.perf_counter() - t0)

    print(f"retained: {audio_kept.numel()} audio ({audio_kept.numel() / n_audio:.1%} of audio) + "
          f"{video_kept.numel()} video ({video_kept.numel() / n_video:.1%} of video); "
          f"audio share of retained = {audio_kept.numel() / max(1, budget.total):.2f}")
    counts = torch.bincount(chunk_ids[video_pick], minlength=chunks).tolist()
    sizes = torch.bincount(chunk_ids, minlength=chunks).tolist()
    print("video kept per temporal chunk: " + ", ".join(f"c{c}={k}/{s}" for c, (k, s) in enumerate(zip(counts, sizes))))
    empty = [f"c{c}" for c, size in enumerate(sizes) if size == 0]
    if empty:
        groups = int(grid_of_video.max()) + 1
        print(f"  ({', '.join(empty)} hold no tokens: the clip has {groups} temporal groups of 2 frames for {chunks} "
              f"chunks, and each group's 144 tokens share one temporal position, so they land in one chunk)")
    print(f"sequence after both stages: {hidden.shape[1]} tokens (from {n}); readout ops took {elapsed_ms:.1f} ms "
          f"on CPU with backend {mk.current_backend()!r}")


if __name__ == "__main__":
    main()
