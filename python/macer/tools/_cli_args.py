"""The flags ``macer demo`` and ``macer diagnose`` share, defined once: the random thinker and its synthetic clip, the
readout layers, the keep ratio, the local checkpoint, ``--out``; their ranges, the checks between them and an
up-front memory estimate. Errors are argparse's one line, ``macer demo: error: argument --layers: ...``, exit 2.
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

MEMORY_LIMIT_GIB = 16.0
"""What the random model and clip of one command may need, estimated before anything is built (``memory_estimate``):
room for the OS and other processes on a 24 GiB machine."""

PAPER_LAYERS = {"audio_layer": 3, "video_layer": 5}
"""The paper's Qwen2.5-Omni-7B readout layers, the random model's defaults."""

RANGES = {
    "layers": (2, 256), "hidden": (2, 8192), "heads": (1, 256), "kv_heads": (1, 256), "frames": (0, 1000),
    "audio_tokens": (0, 50_000), "new_tokens": (1, 1024), "repeats": (1, 100), "seed": (0, 2**32 - 1),
}
"""Each integer flag's own range (the memory estimate bounds their combination)."""

VIDEO_TOKENS_PER_GROUP = 144
"""LLM tokens per 2-frame group of the synthetic clip (``clip_inputs``' default 24x24 patches, 2x2 merged)."""
PIXELS_PER_GROUP = 576 * 1176
"""``pixel_values_videos`` values per 2-frame group: 24x24 patches of 3 x 2 x 14 x 14."""
TEXT_TOKENS = 64
"""The synthetic prompt's system text, question, chat template and media markers (at most)."""
VOCAB = 512
"""``macer.testing``'s synthetic vocabulary."""
RUNTIME_GIB = 0.75
"""Python, torch and transformers with an empty model (about 0.5 GiB measured), and slack."""
TIME_LIMIT_MINUTES = 10.0
"""The longest run a command starts (``time_estimate``, a lower bound): a 122k-token clip passed every other check
and then printed nothing for hours."""
FLOPS_PER_THREAD = 1.0e11
"""An optimistic float32 rate of one CPU thread in the random thinker's decoder, so that ``time_estimate`` is a lower
bound: the demo's default full prefill (1.6e11 decoder FLOPs) took 1.15 s on an idle 2-core x86 VM, about 70 GFLOP/s
per thread (README), and 20-45 GFLOP/s per thread on the same VM under load."""
NOTICE_SECONDS = 60.0
"""A run estimated above this says so before it starts (it prints nothing until its first result)."""


class CommandError(Exception):
    """A problem with what a command was given that shows only once it runs (a folder that holds no checkpoint, a
    video the processor cannot read): ``macer.cli`` prints ``macer <command>: error: <message>`` and exits 2, as
    for a bad flag, instead of a traceback."""


def unloadable(path: str, exc: BaseException) -> str:
    """The error for a ``--model`` folder that transformers cannot load: its reason's first line."""
    reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return f"--model {path}: not a loadable Qwen2.5-Omni checkpoint directory ({reason})"


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors: ``macer demo: error: <what, naming the flag and the allowed range>``, exit 2
    (argparse's default prints the whole usage block first, which buries the reason)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the descriptions' line breaks and appends each flag's default where it has one (not for switches or
    flags without a value)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if default is None or default is False or default == argparse.SUPPRESS or not action.option_strings:
            return text
        return f"{text} (default: %(default)s)"


def int_in(lo: int, hi: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer in [{lo}, {hi}], got {text!r}") from None
        if not lo <= value <= hi:
            raise argparse.ArgumentTypeError(f"must be an integer in [{lo}, {hi}], got {value}")
        return value

    return parse


def even_frames(text: str) -> int:
    lo, hi = RANGES["frames"]
    try:
        value = int_in(lo, hi)(text)
    except argparse.ArgumentTypeError:
        value = None
    if value is None or value % 2:
        raise argparse.ArgumentTypeError(f"must be an even integer in [{lo}, {hi}], got "
                                         f"{text if value is None else value} (Qwen2.5-Omni groups 2 frames)")
    return value


def float_in(lo: float, hi: float, *, lo_open: bool) -> Callable[[str], float]:
    interval = f"{'(' if lo_open else '['}{lo:g}, {hi:g}]"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a number in {interval}, got {text!r}") from None
        if not math.isfinite(value) or not (lo < value if lo_open else lo <= value) or not value <= hi:
            raise argparse.ArgumentTypeError(f"must be a number in {interval}, got {text}")
        return value

    return parse


def out_dir(text: str) -> str:
    """A folder to write to, checked at parse time (before the run): it is a folder or can be created as one."""
    path = Path(text)
    existing = next((p for p in (path, *path.parents) if p.exists()), Path("."))
    if not existing.is_dir():
        where = "is an existing file" if existing == path else f"lies under {existing}, an existing file"
        raise argparse.ArgumentTypeError(f"{text} {where}; --out names a folder (created if missing)")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"{text}: the folder {existing} is not writable")
    return text


def _range_help(name: str) -> str:
    lo, hi = RANGES[name]
    return f"in [{lo}, {hi}]"


def add_macer_flags(parser: argparse.ArgumentParser, *, keep_ratio_help: str) -> None:
    """``--keep-ratio``, ``--audio-layer``, ``--video-layer``."""
    parser.add_argument("--keep-ratio", type=float_in(0, 1, lo_open=True), default=0.25, help=keep_ratio_help)
    parser.add_argument("--audio-layer", type=int_in(1, RANGES["layers"][1] - 1), default=None,
                        help="l_a: audio is scored inside this layer (counted from 1) and pruned after it; in "
                             "[1, layers - 1]; default the paper's 7B value 3 (--model: the checkpoint's scale)")
    parser.add_argument("--video-layer", type=int_in(1, RANGES["layers"][1] - 1), default=None,
                        help="l_v, the same for video; default the paper's 7B value 5")


def add_random_model_flags(parser: argparse.ArgumentParser, *, shape: dict[str, int]) -> None:
    """The random thinker (``shape``: this command's defaults) and its synthetic clip."""
    group = parser.add_argument_group("random model and synthetic clip (without --model)")
    group.add_argument("--layers", type=int_in(*RANGES["layers"]), default=shape["num_layers"],
                       help=f"decoder layers, {_range_help('layers')}")
    group.add_argument("--hidden", type=int_in(*RANGES["hidden"]), default=shape["hidden_size"],
                       help=f"hidden size, {_range_help('hidden')}; the head size hidden / heads must be an even "
                            "integer (rotary embeddings turn pairs of dimensions); MLP width 3 x hidden")
    group.add_argument("--heads", type=int_in(*RANGES["heads"]), default=shape["num_heads"],
                       help=f"attention heads, {_range_help('heads')}")
    group.add_argument("--kv-heads", type=int_in(*RANGES["kv_heads"]), default=shape["num_kv_heads"],
                       help=f"KV heads, {_range_help('kv_heads')}, a divisor of --heads")
    group.add_argument("--frames", type=even_frames, default=12,
                       help=f"video frames, even, {_range_help('frames')} (2 per group of 144 tokens; 0 = no video)")
    group.add_argument("--audio-tokens", type=int_in(*RANGES["audio_tokens"]), default=1460,
                       help=f"audio tokens (25 per second), {_range_help('audio_tokens')} (0 = no audio)")


def add_checkpoint_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("a local checkpoint instead (all three together)")
    group.add_argument("--model", help="path of a local Qwen2.5-Omni (thinker) checkpoint directory (no download)")
    group.add_argument("--video", help="video file (its audio track is used)")
    group.add_argument("--question", help="question about the video")
    group.add_argument("--fps", type=float_in(0, 60, lo_open=True), default=2.0,
                       help="video sampling fps, in (0, 60]")


def uses_checkpoint(parser: argparse.ArgumentParser, args: argparse.Namespace) -> bool:
    """Whether ``--model`` is given; checks that ``--model``, ``--video`` and ``--question`` come together and
    name existing paths."""
    if not (args.model or args.video or args.question):
        return False
    if not (args.model and args.video and args.question):
        parser.error("--model, --video and --question go together")
    if not Path(args.model).is_dir():
        what = "is not a directory" if Path(args.model).exists() else "does not exist"
        parser.error(f"--model {args.model}: the local path {what} (macer reads a checkpoint directory from disk; "
                     "it does not download)")
    if not Path(args.video).is_file():
        what = "is not a file" if Path(args.video).exists() else "does not exist"
        parser.error(f"--video {args.video}: the file {what}")
    return True


def readout_layers(args: argparse.Namespace) -> dict[str, int]:
    """``--audio-layer`` / ``--video-layer`` of the random model, the paper's 7B layers where not given."""
    return {name: default if getattr(args, name) is None else getattr(args, name)
            for name, default in PAPER_LAYERS.items()}


def check_random_model(parser: argparse.ArgumentParser, args: argparse.Namespace, *, both_modalities: bool,
                       attn: str = "sdpa", kv_caches: int = 3, forwards: float = 1.0, threads: int = 1) -> float:
    """The checks between the random model's flags (each flag's own range is checked by its ``type=``), then the
    memory and time estimates. ``both_modalities``: the command needs audio and video tokens (else at least one).
    ``forwards``: the command's prefills counted in full-length decoder forwards (at least); ``threads``: torch's CPU
    threads. Returns the estimated seconds (``time_estimate``)."""
    hidden, heads, kv_heads = args.hidden, args.heads, args.kv_heads
    rope = ("the head size --hidden / --heads must be an even integer (rotary position embeddings turn pairs of "
            "dimensions)")
    if hidden % 2:
        parser.error(f"--hidden {hidden} is odd: {rope}, so --hidden must be even")
    if hidden % heads:
        parser.error(f"--hidden {hidden} is not a multiple of --heads {heads}: {rope}; e.g. --heads "
                     f"{_head_hint(hidden, heads)}")
    if (hidden // heads) % 2:
        parser.error(f"--hidden {hidden} / --heads {heads} = head size {hidden // heads}, odd: {rope}; e.g. --heads "
                     f"{_head_hint(hidden, heads)}")
    if heads % kv_heads:
        kv = [k for k in range(1, heads + 1) if heads % k == 0]
        parser.error(f"--kv-heads {kv_heads} must divide --heads {heads} (each KV head serves heads / kv-heads "
                     f"query heads): one of {', '.join(map(str, kv))}")
    given = {"audio_layer": args.audio_layer, "video_layer": args.video_layer}
    bad = [f"--{name.replace('_', '-')} {value}" if given[name] is not None
           else f"--{name.replace('_', '-')} (default {value}, the paper's 7B layer)"
           for name, value in readout_layers(args).items() if value > args.layers - 1]
    if bad:
        parser.error(f"{' and '.join(bad)} must be in [1, {args.layers - 1}] for --layers {args.layers} (layers "
                     "count from 1; the pruned sequence needs a later layer)")
    if both_modalities and not (args.frames and args.audio_tokens):
        missing = " and ".join(f for f, v in (("--frames 0", args.frames), ("--audio-tokens 0", args.audio_tokens))
                               if not v)
        parser.error(f"{missing}: {parser.prog} compares audio with video, so the clip needs both: --frames "
                     "(even, >= 2) and --audio-tokens (>= 1)")
    if not (args.frames or args.audio_tokens):
        parser.error("--frames 0 with --audio-tokens 0 leaves no audio or video tokens, so MACER has nothing to "
                     "prune: give --frames (even, > 0) or --audio-tokens (> 0)")
    need = memory_estimate(layers=args.layers, hidden=hidden, heads=heads, kv_heads=kv_heads, frames=args.frames,
                           audio_tokens=args.audio_tokens, attn=attn, kv_caches=kv_caches)
    total = sum(need.values())
    if total > MEMORY_LIMIT_GIB:
        parts = ", ".join(f"{name} {gib:.1f}" for name, gib in need.items() if gib >= 0.05)
        lower = "--layers, --hidden, --frames or --audio-tokens" + (" (or --attn sdpa)" if attn == "eager" else "")
        parser.error(f"the random model and clip need about {total:.1f} GiB ({parts}), more than the "
                     f"{MEMORY_LIMIT_GIB:g} GiB {parser.prog} allows (sized for a 24 GiB machine): lower {lower}")
    n = prompt_length(args.frames, args.audio_tokens)
    seconds = time_estimate(layers=args.layers, hidden=hidden, kv_heads=kv_heads, heads=heads, tokens=n,
                            forwards=forwards, threads=threads)
    if seconds > 60 * TIME_LIMIT_MINUTES:
        repeats = " (or --repeats)" if hasattr(args, "repeats") else ""
        parser.error(f"the run takes at least about {_duration(seconds)} on {threads} CPU thread"
                     f"{'s' if threads > 1 else ''}: {forwards:.1f} full-length prefills' worth of decoder FLOPs on a "
                     f"{n}-token prompt at an optimistic {FLOPS_PER_THREAD / 1e9:g} GFLOP/s per thread, more than the "
                     f"{TIME_LIMIT_MINUTES:g} minutes {parser.prog} starts: lower --frames or --audio-tokens "
                     f"(attention grows with the square of the prompt length), --layers or --hidden{repeats}")
    return seconds


def time_estimate(*, layers: int, hidden: int, heads: int, kv_heads: int, tokens: int, forwards: float,
                  threads: int) -> float:
    """A lower bound of the seconds ``forwards`` full prefills of ``tokens`` tokens take: the decoder's FLOPs (its
    projections and MLP, 2 N params per layer, and causal attention, 2 N (N + 1) hidden per layer: ``macer.cost``'s
    count) at ``FLOPS_PER_THREAD`` per thread; the encoders, MACER's shorter prefills and the decode steps are not
    counted."""
    kv = kv_heads * (hidden // heads)
    params = hidden * (hidden + 2 * kv) + hidden * hidden + 3 * hidden * 3 * hidden
    flops = layers * (2 * tokens * params + 2 * tokens * (tokens + 1) * hidden)
    return forwards * flops / (FLOPS_PER_THREAD * max(threads, 1))


def _duration(seconds: float) -> str:
    return f"{seconds / 3600:.1f} hours" if seconds >= 5400 else f"{seconds / 60:.0f} minutes"


def long_run_notice(prog: str, seconds: float) -> str | None:
    """The line a command prints before a run estimated above ``NOTICE_SECONDS`` (None below)."""
    if seconds <= NOTICE_SECONDS:
        return None
    return (f"{prog}: this run takes at least about {_duration(seconds) if seconds >= 90 else '1 minute'} before "
            "its results print (an optimistic estimate; a busy machine takes longer)")


def _head_hint(hidden: int, heads: int) -> str:
    """Up to four head counts nearest to ``heads`` that give an even head size (``hidden`` is even: 1 always does)."""
    good = [h for h in range(1, RANGES["heads"][1] + 1) if hidden % h == 0 and (hidden // h) % 2 == 0]
    return ", ".join(map(str, sorted(sorted(good, key=lambda h: (abs(h - heads), h))[:4])))


def prompt_length(frames: int, audio_tokens: int) -> int:
    """An upper bound of the synthetic prompt's length (``clip_inputs`` with its default sizes)."""
    return TEXT_TOKENS + frames // 2 * VIDEO_TOKENS_PER_GROUP + audio_tokens


def memory_estimate(*, layers: int, hidden: int, heads: int, kv_heads: int, frames: int, audio_tokens: int,
                    attn: str, kv_caches: int) -> dict[str, float]:
    """GiB the random thinker (float32, MLP width 3 x hidden) and its synthetic clip need at their peak, by part.

    A deliberate over-estimate: the weights exactly; ``kv_caches`` full-length KV caches alive at once (the demo
    holds the full and the pruned prefill's and generates); one layer's per-token activations and the logits; eager
    attention's ``[heads, N, N]`` float32 scores, three times (scores, softmax, a copy); the video pixels (1.5 copies)
    and the audio features (2 copies). Peak resident memory of one forward (2 layers, hidden 64 unless said) on a
    2-core x86 VM against this estimate: hidden 4096, 32 heads, N = 235: 2.07 / 2.3 GiB; eager, 8 heads, 100 frames
    (N = 8721): 5.5 / 7.8 GiB; 1000 frames (N = 72091): 2.2 / 3.4 GiB; 50000 audio tokens: 1.0 / 1.5 GiB."""
    intermediate = 3 * hidden
    head_dim = hidden // heads
    kv = kv_heads * head_dim
    n = prompt_length(frames, audio_tokens)
    params = layers * (hidden * (hidden + 2 * kv) + hidden * hidden + 3 * hidden * intermediate) + 2 * VOCAB * hidden
    gib = 2.0**30
    return {
        "weights": 4 * params / gib,
        "KV caches": kv_caches * layers * n * 2 * kv * 4 / gib,
        "activations": 4 * n * (16 * hidden + 4 * intermediate + VOCAB) / gib,
        "attention scores": (3 * heads * n * n * 4 if attn == "eager" else 0) / gib,
        "video frames": 1.5 * (frames // 2) * PIXELS_PER_GROUP * 4 / gib,
        "audio features": 2 * 4 * audio_tokens * 128 * 4 / gib,
        "runtime": RUNTIME_GIB,
    }
