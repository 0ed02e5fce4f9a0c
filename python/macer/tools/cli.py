"""Command line of MACER: parses and checks the arguments, then runs the command (``macer bench`` says where it moved).

``macer demo`` (``macer.tools.demo``) builds a Qwen2.5-Omni thinker with random weights in code (no download), a
synthetic clip at the paper's token counts (12 frames -> 864 video tokens, 1460 audio tokens, interleaved), and runs
full prefill vs MACER with the 7B defaults at keep ratio 0.25, then a short ``generate``. ``macer demo --model PATH
--video FILE --question TEXT`` runs a real local checkpoint through its processor instead (see
``docs/integration.md``). ``macer diagnose`` (``macer.tools.diagnostics``): the paper's attention diagnostics. The
flags, their ranges and the up-front time and memory estimates are in ``macer.tools._cli_args``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import torch

from macer.tools import _cli_args as flags
from macer.tools import demo

__all__ = ["main"]

DEMO_SHAPE = {"num_layers": 8, "hidden_size": 512, "num_heads": 8, "num_kv_heads": 2}
"""Default random thinker of the demo: deep enough for the 7B readout layers (3, 5) and wide enough that the
decoder, not the tiny encoders, dominates prefill time on a 2-core CPU (about 1 s per full prefill when idle)."""
DIAGNOSE_SHAPE = {"num_layers": 8, "hidden_size": 256, "num_heads": 8, "num_kv_heads": 2}
"""Default random thinker of ``macer diagnose`` (narrower: it runs six forwards with every layer tapped)."""

DESCRIPTION = ("MACER: training-free pruning of audio and video tokens inside a Qwen2.5-Omni thinker. "
               "`macer <command> --help` describes each command.")

DEMO_DESCRIPTION = """Full prefill vs MACER on one prompt, then a short generate.

Without --model: a Qwen2.5-Omni thinker with random weights built in code (no download) and a synthetic clip at the
paper's token counts (12 frames -> 864 video tokens, 1460 audio tokens, interleaved), MACER with the 7B defaults.
It prints the budget, the tokens per layer, the KV caches and the times, and draws the kept tokens on the clip's
timeline (macer_kept_tokens.png in --out). With --model, --video and --question: a local checkpoint through its
processor (docs/integration.md)."""

DIAGNOSE_DESCRIPTION = """The paper's attention diagnostics (Sec. 3) of one prompt, as diagnostics.json and PNG figures
in --out: per decoder layer the log ratio of the attention per audio and per video token of the question rows, the
cosines of the question query with the modality key centroids, the readout-layer sweep, and the temporal Gini of the
tokens each policy keeps (docs/diagnostics.md).

Without --model: a Qwen2.5-Omni thinker with random weights built in code (no download) and a synthetic clip with
audio and video. With --model, --video and --question: a local checkpoint through its processor."""


def _build_parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The ``macer`` argument parser and its subcommands' parsers (``bench`` only points to the benchmark)."""
    parser = flags.Parser(prog="macer", description=DESCRIPTION, formatter_class=flags.HelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="{demo,diagnose,bench}")
    commands: dict[str, argparse.ArgumentParser] = {}

    demo = sub.add_parser("demo", help="full prefill vs MACER on a random thinker (default) or a local checkpoint",
                          description=DEMO_DESCRIPTION, formatter_class=flags.HelpFormatter)
    flags.add_macer_flags(demo, keep_ratio_help="rho in (0, 1], the share of audio+video tokens kept")
    flags.add_random_model_flags(demo, shape=DEMO_SHAPE)
    demo.add_argument("--blocks", action="store_true", help="video block then audio block (use_audio_in_video=False)")
    demo.add_argument("--attn", default="sdpa", choices=["sdpa", "eager"], help="attention implementation")
    demo.add_argument("--new-tokens", type=flags.int_in(*flags.RANGES["new_tokens"]), default=8,
                      help=f"tokens to generate, in {list(flags.RANGES['new_tokens'])}")
    demo.add_argument("--repeats", type=flags.int_in(*flags.RANGES["repeats"]), default=5,
                      help=f"timed prefills of each kind after one warm-up of each, in {list(flags.RANGES['repeats'])}")
    demo.add_argument("--out", type=flags.out_dir, default="out", help="folder of the PNG of kept tokens")
    flags.add_checkpoint_flags(demo)
    commands["demo"] = demo

    diagnose = sub.add_parser("diagnose", help="the paper's attention diagnostics of one prompt: JSON + PNG figures",
                              description=DIAGNOSE_DESCRIPTION, formatter_class=flags.HelpFormatter)
    flags.add_macer_flags(diagnose, keep_ratio_help="rho in (0, 1] of the compared policies and of the readout "
                                                    "sweep's budget")
    flags.add_random_model_flags(diagnose, shape=DIAGNOSE_SHAPE)
    diagnose.add_argument("--seed", type=flags.int_in(*flags.RANGES["seed"]), default=0,
                          help=f"seed of the random model and clip, in {list(flags.RANGES['seed'])}")
    diagnose.add_argument("--out", type=flags.out_dir, default="out/diagnose",
                          help="folder of diagnostics.json and the PNG figures")
    diagnose.add_argument("--no-plot", action="store_true", help="write the JSON only")
    flags.add_checkpoint_flags(diagnose)
    commands["diagnose"] = diagnose

    sub.add_parser("bench", add_help=False, help="moved: python -m benchmarks.bench_e2e (from a clone)")
    return parser, commands


BENCH_MOVED = ("macer bench: the end-to-end benchmark is no longer part of the installed package; from a clone of the "
               "repository run `python -m benchmarks.bench_e2e` (results in out/bench/; --record writes the committed "
               "benchmarks/results/)")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``macer`` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:  # whatever its arguments were (they belonged to the moved harness)
        print(BENCH_MOVED, file=sys.stderr)
        return 2
    parser, commands = _build_parser()
    args, unknown = parser.parse_known_args(argv)
    command = commands[args.command]
    if unknown:  # argparse would name the top-level parser ("macer: error") for a flag the command does not take
        (command if argv.index(args.command) < argv.index(unknown[0]) else parser).error(
            f"unrecognized arguments: {' '.join(unknown)}")
    checkpoint = flags.uses_checkpoint(command, args)
    if not checkpoint:
        # The full-length prefills each command runs, at least: the demo's warm-up, timed and generate prefills (a
        # MACER prefill runs its layers before the first stage at full length); diagnose's tapped forward and the
        # first layers of its MACER, no-coverage and shared top-K forwards.
        first = min(flags.readout_layers(args).values())
        video = flags.readout_layers(args)["video_layer"]
        threads = torch.get_num_threads()
        if args.command == "demo":
            seconds = flags.check_random_model(command, args, both_modalities=False, attn=args.attn, threads=threads,
                                               forwards=(args.repeats + 2) * (1 + first / args.layers))
        else:
            seconds = flags.check_random_model(command, args, both_modalities=True, threads=threads,
                                               forwards=1 + (2 * first + video) / args.layers)
        notice = flags.long_run_notice(command.prog, seconds)
        if notice:
            print(notice, file=sys.stderr, flush=True)
    if args.command == "diagnose":
        from macer.tools.diagnostics import command as diagnose_command

        try:
            return diagnose_command(args, checkpoint)
        except flags.CommandError as exc:
            print(f"{command.prog}: error: {exc}", file=sys.stderr)
            return 2
    return demo.run_checkpoint(args) if checkpoint else demo.run_random(args)


if __name__ == "__main__":
    raise SystemExit(main())
