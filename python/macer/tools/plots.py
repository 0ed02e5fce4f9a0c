"""The tools' figures (matplotlib, imported when a figure is drawn): the kept tokens on a clip's timeline
(``macer demo``) and the attention diagnostics' curves and panels (``macer diagnose``)."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

import torch

__all__ = ["diagnostics_figures", "kept_tokens_figure", "save_kept_tokens"]


def save_kept_tokens(out_dir: Path, model, inputs: dict[str, Any], record, config) -> Path:
    """``macer_kept_tokens.png`` in ``out_dir`` (``kept_tokens_figure``)."""
    import matplotlib.pyplot as plt

    fig = kept_tokens_figure(model, inputs, record, config)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "macer_kept_tokens.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def kept_tokens_figure(model, inputs: dict[str, Any], record, config):
    """The kept and dropped audio/video tokens at their clip time, readable without the README.

    Times come from the temporal M-RoPE row (``position_id_per_seconds`` units per second, 25 in Qwen2.5-Omni): an
    audio token is one tick at its 40 ms step; a video token stands for one patch of a 2-frame group and is drawn as a
    bar over the seconds its group covers, at row = its patch index in the group (row-major), so each group is a
    column whose kept share can be read off. The coverage greedy's C temporal chunks are shaded behind the groups
    they hold: a group's chunk is ``temporal_chunks`` of its start (the one temporal position all its tokens share),
    so a chunk is drawn from its first group's start to its last group's end, and chunks no group starts in are named
    as empty.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from macer_kernels import temporal_chunks

    thinker_config = model.config
    ids = inputs["input_ids"][0].cpu()
    feature_mask = inputs.get("feature_attention_mask")
    rope, _ = model.get_rope_index(
        inputs["input_ids"], None, inputs.get("video_grid_thw"), inputs["attention_mask"], inputs["use_audio_in_video"],
        feature_mask.sum(-1) if feature_mask is not None else None, inputs.get("video_second_per_grid"))
    rope = rope[:, 0].cpu().double()
    per_second = float(thinker_config.position_id_per_seconds)
    is_audio, is_video = ids == thinker_config.audio_token_id, ids == thinker_config.video_token_id
    # Each stream from its own first token: interleaved, both start at the same position; in the block layout the
    # audio positions continue after the video block's, which is prompt order, not clip time.
    seconds = torch.zeros(ids.numel(), dtype=torch.float64)
    for stream in (is_audio, is_video):
        if stream.any():
            seconds[stream] = (rope[0][stream] - rope[0][stream].min()) / per_second
    kept = torch.zeros(ids.numel(), dtype=torch.bool)
    kept[list(record.audio_kept) + list(record.video_kept)] = True

    fig, (ax_a, ax_v) = plt.subplots(2, 1, figsize=(12, 6.5), sharex=True, height_ratios=(1, 3))
    audio_pos = is_audio.nonzero().reshape(-1)
    if audio_pos.numel():
        for row, mask, color, name in ((1, kept, "tab:red", "kept"), (0, ~kept, "lightgray", "dropped")):
            chosen = audio_pos[mask[audio_pos]]
            ax_a.eventplot(seconds[chosen].numpy(), lineoffsets=row, linelengths=0.8, linewidths=0.6, colors=color)
            ax_a.text(1.005, row, f"{name} {chosen.numel()}", transform=ax_a.get_yaxis_transform(), va="center",
                      fontsize=8)
        ax_a.set_yticks([0, 1], ["dropped", "kept"])
    else:
        ax_a.set_yticks([])
        ax_a.text(0.5, 0.5, "no audio tokens in this prompt", transform=ax_a.transAxes, ha="center", va="center")
    ax_a.set_ylim(-0.6, 1.6)
    ax_a.set_ylabel(f"audio tokens\n(one tick = {1000 / per_second:.0f} ms)")

    video_pos = is_video.nonzero().reshape(-1)
    if video_pos.numel():
        h, w = rope[1][video_pos], rope[2][video_pos]
        patch = (h - h.min()) * (w.max() - w.min() + 1) + (w - w.min())
        group_starts = seconds[video_pos].unique()
        group_s = float(group_starts.diff().min()) if group_starts.numel() > 1 else 2.0
        if inputs.get("video_second_per_grid") is not None:
            group_s = float(inputs["video_second_per_grid"].reshape(-1)[0])
        x0 = seconds[video_pos]
        chunk = temporal_chunks(rope[0][video_pos].long(), config.num_chunks)
        top = float(patch.max())
        for drawn, c in enumerate(chunk.unique().tolist()):  # alternate the shade so that neighbours stand apart
            members = chunk == c
            left, right = float(x0[members].min()), float(x0[members].max()) + group_s
            span = ax_v.axvspan(left, right, color="tab:green", alpha=0.07 if drawn % 2 else 0.16, lw=0,
                                label=None if drawn else "coverage chunk (shaded)")
            span.set_gid(f"chunk {c}")
            ax_v.text((left + right) / 2, top * 1.03 + 1, f"c{c}", ha="center", va="bottom", fontsize=7,
                      color="tab:green")
        for mask, color, name in ((~kept[video_pos], "lightgray", "dropped"), (kept[video_pos], "tab:blue", "kept")):
            ax_v.hlines(patch[mask], x0[mask], x0[mask] + group_s, colors=color, linewidth=1.2,
                        label=f"{name} ({int(mask.sum())})")
        # A thin gap between consecutive groups, so that each group reads as one column.
        for start in group_starts.tolist()[1:]:
            ax_v.axvline(start, color="white", linewidth=1.5)
        empty = [f"c{c}" for c in range(config.num_chunks) if not (chunk == c).any()]
        if empty:
            ax_v.text(1.005, 0.02, "empty chunks\n(no group\nstarts in them):\n" + textwrap.fill(", ".join(empty), 20),
                      transform=ax_v.transAxes, fontsize=7, color="tab:green", va="bottom")
        ax_v.set_ylim(-1, top * 1.15 + 3)
        ax_v.legend(loc="upper left", bbox_to_anchor=(1.005, 1), fontsize=7, frameon=False)
        ax_v.set_ylabel(f"video patch index in its 2-frame\ngroup of {group_s:.1f} s (row-major)")
    else:
        ax_v.set_yticks([])
        ax_v.text(0.5, 0.5, "no video tokens in this prompt", transform=ax_v.transAxes, ha="center", va="center")
    ax_v.set_xlabel(f"clip time (s) = temporal M-RoPE position / {per_second:g}, from each stream's first token; "
                    "a video bar spans its frame group, whose chunk is read at its start")
    budget = record.budget
    ax_a.set_title(
        f"MACER kept tokens: keep ratio {config.keep_ratio:g} of {record.n_audio + record.n_video} audio+video tokens "
        f"-> K_mm={budget.total}\n{_stage_title(record, 'audio', budget.audio)}    "
        f"{_stage_title(record, 'video', budget.video)}"
        + (f", coverage over C={config.num_chunks} chunks (lambda_c={config.coverage_weight:g})"
           if record.n_video else ""), fontsize=9)
    fig.tight_layout()
    return fig


def _stage_title(record, name: str, budget: int) -> str:
    """What happened to one modality: absent, kept whole by its budget, or pruned to ``kept/n`` after a layer."""
    n = record.n_audio if name == "audio" else record.n_video
    if not n:
        return f"{name}: none in the prompt (no {name} stage)"
    symbol = "K_a" if name == "audio" else "K_v"
    kept = len(record.audio_kept if name == "audio" else record.video_kept)
    layer = next((stage.layer for stage in record.stages if name in stage.modalities), None)
    if kept == n:
        return f"{name}: {symbol}={budget}, all {n} kept (the budget holds them all)"
    return f"{name}: {symbol}={budget}, kept {kept}/{n} after layer {layer}"


def diagnostics_figures(report: Any, out: Path) -> list[Path]:
    """``log_mass_ratio.png`` (the teaser's log-ratio-by-layer curve, per policy) and ``diagnostics.png`` (centroid
    cosines, readout sweep, temporal Gini) of a ``macer.tools.diagnostics.DiagnosticReport``, in ``out``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layers = list(range(1, report.num_layers + 1))
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, curve in report.policy_log_mass_ratio.items():
        points = [(layer, value) for layer, value in zip(layers, curve) if value is not None]
        ax.plot([p[0] for p in points], [p[1] for p in points], "o-" if name == "full" else ".--", label=name)
    ax.axhline(0.0, color="k", lw=0.8)
    ax.set_xlabel("decoder layer")
    ax.set_ylabel("log(mass_a / n_a) - log(mass_v / n_v)")
    ax.set_title(f"Attention per token, audio vs video, of the question rows ({report.n_audio} audio, "
                 f"{report.n_video} video tokens)\n> 0: audio is favoured; policies: over the tokens each layer holds",
                 fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    curve_path = out / "log_mass_ratio.png"
    fig.savefig(curve_path, dpi=110)
    plt.close(fig)

    fig, axes = plt.subplots(1, 3, figsize=(16, 4))
    axes[0].plot(layers, [c[0] for c in report.q_centroid_cosine], "o-", label="cos(q, c_a)")
    axes[0].plot(layers, [c[1] for c in report.q_centroid_cosine], "s-", label="cos(q, c_v)")
    axes[0].set_xlabel("decoder layer")
    axes[0].set_ylabel("cosine similarity (mean over heads)")
    axes[0].set_title("question query vs modality key centroids", fontsize=9)
    axes[0].legend(fontsize=8)
    for name, marker in (("audio", "o-"), ("video", "s-")):
        sweep = report.readout_sweep[name]
        points = [(layer, v) for layer, v in zip(layers, sweep["overlap"]) if v is not None]
        axes[1].plot([p[0] for p in points], [p[1] for p in points], marker,
                     label=f"{name} (chosen layer {sweep['chosen_layer']}, budget {sweep['budget']})")
    axes[1].set_xlabel("readout layer")
    axes[1].set_ylabel("overlap with the chosen layer's selection")
    axes[1].set_title("readout-layer sweep (unpruned forward)", fontsize=9)
    axes[1].legend(fontsize=8)
    names = list(report.temporal_gini)
    for offset, modality in ((-0.2, "audio"), (0.2, "video")):
        values = [report.temporal_gini[name][modality] for name in names]
        axes[2].bar([i + offset for i in range(len(names))], [v if v is not None else 0.0 for v in values],
                    width=0.4, label=modality)
    axes[2].set_xticks(range(len(names)), names, fontsize=8, rotation=15)
    axes[2].set_ylabel("Gini over 2-second blocks (0 = even)")
    axes[2].set_title("temporal concentration of kept tokens", fontsize=9)
    axes[2].legend(fontsize=8)
    fig.tight_layout()
    panel_path = out / "diagnostics.png"
    fig.savefig(panel_path, dpi=110)
    plt.close(fig)
    return [curve_path, panel_path]
