"""``macer demo``: full prefill vs MACER on one prompt, then a short ``generate``, with the arguments
``macer.tools.cli`` parsed and checked.

``run_random``: a Qwen2.5-Omni thinker with random weights built in code (``macer.tools.synthetic``) and a synthetic
clip; it prints the budget, the tokens per layer, the KV caches and the times (with their spread, the machine's load
and the decoder-FLOPs ideal), and draws the kept tokens on the clip's timeline (``macer.tools.plots``).
``run_checkpoint``: a local Qwen2.5-Omni checkpoint through its processor.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from macer.tools import _cli_args as flags
from macer.tools import plots

__all__ = ["run_checkpoint", "run_random"]

REAL_SYSTEM_PROMPT = ("You are Qwen, a virtual human developed by the Qwen Team, Alibaba Group, capable of perceiving "
                      "auditory and visual inputs, as well as generating text and speech.")


CACHE_SLACK = 1.25
"""How far above the decoder-FLOPs ideal a measured speedup may be before the demo calls it timing noise."""
ROUNDING_SLACK = 1.05
"""A measured speedup within 5 % of the ideal is the ideal, as far as a few timed runs can tell: nothing is said."""


# ------------------------------------------------------------------------------------------------ random model
def _timed(fn) -> tuple[float, Any]:
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def run_random(args: argparse.Namespace) -> int:
    """``macer demo`` on a Qwen2.5-Omni thinker with random weights built in code and a synthetic clip."""
    from macer.hf.adapters import get_adapter
    from macer.hf.cache import output_cache
    from macer.hf.compress import compress
    from macer.tools.cost import run_cost
    from macer.tools.synthetic.qwen2_5_omni import build_thinker, clip_inputs, macer_config_for

    load_before = _load_average()  # before this process adds its own load
    torch.manual_seed(0)
    shape = {"num_layers": args.layers, "hidden_size": args.hidden, "num_heads": args.heads,
             "num_kv_heads": args.kv_heads, "intermediate_size": 3 * args.hidden}
    model = build_thinker(attn_implementation=args.attn, **shape)
    inputs = clip_inputs(model, frames=args.frames, audio_tokens=args.audio_tokens,
                         use_audio_in_video=not args.blocks and args.frames > 0 and args.audio_tokens > 0)
    # The paper's 7B readout layers and shares unless given; the vocabulary is synthetic, hence its own <|im_end|> id.
    config = macer_config_for(model, keep_ratio=args.keep_ratio, **flags.readout_layers(args))
    ids = inputs["input_ids"][0]
    n = ids.numel()
    print(f"Qwen2.5-Omni thinker, random weights: {args.layers} layers, hidden {args.hidden}, {args.heads}/"
          f"{args.kv_heads} heads, attention {args.attn}, {torch.get_num_threads()} CPU threads")
    config_text = ", ".join(f"{k}={getattr(config, k)}" for k in
                            ("keep_ratio", "audio_layer", "video_layer", "audio_share", "coverage_weight",
                             "num_chunks", "query_tokens"))
    print(f"MACER config: {config_text}")
    if args.frames and args.audio_tokens:
        layout = "interleaved 2-s chunks" if inputs["use_audio_in_video"] else "blocks"
    else:
        layout = "audio only" if args.audio_tokens else "video only"
    print(f"prompt: {n} tokens ({args.frames} frames, {layout})")

    with torch.no_grad():
        llm = _LLMTimer(get_adapter(model).parts(model).decoder)

        def full_prefill():
            return model(**inputs, use_cache=True)

        def macer_prefill():
            with compress(model, config, profile=True) as trace:
                out = model(**inputs, use_cache=True)
            return out, trace.last

        # One untimed run of each first: the first calls pay for lazy initialisation and cold caches (on a fresh
        # install the first two runs looked no faster with MACER).
        full_prefill()
        macer_prefill()
        times: dict[str, list[float]] = {"full": [], "MACER": [], "full decoder": [], "MACER decoder": []}
        for round_ in range(args.repeats):  # alternate the order so that machine noise hits both alike
            for kind in (("full", "MACER") if round_ % 2 == 0 else ("MACER", "full")):
                seconds, result = _timed(full_prefill if kind == "full" else macer_prefill)
                times[kind].append(seconds)
                times[f"{kind} decoder"].append(llm.seconds)
                if kind == "full":
                    full = result
                else:
                    pruned, record = result
        llm.remove()
        print(f"tokens: text {n - record.n_audio - record.n_video}, audio {record.n_audio}, video {record.n_video}")
        budget = record.budget
        print(f"budget (split_budget): K_mm={budget.total}  K_a={budget.audio}  K_v={budget.video}")
        _print_stages(record)
        print(f"tokens per layer (1..{len(record.layer_tokens)}): {record.layer_tokens}")
        _print_caches(output_cache(full), output_cache(pruned))
        flops_ratio = run_cost(record.layer_tokens, model, record.n_audio + record.n_video, n).flops_ratio
        _print_times(times, record, n, load_before, flops_ratio)

        new = args.new_tokens
        seconds_full, out_full = _timed(lambda: model.generate(**inputs, max_new_tokens=new, do_sample=False))
        with compress(model, config):
            seconds_macer, out_macer = _timed(lambda: model.generate(**inputs, max_new_tokens=new, do_sample=False))
        answer_full, answer_macer = out_full[0, n:].tolist(), out_macer[0, n:].tolist()
        print(f"generate {new} tokens (one run each): full {seconds_full:.2f} s -> {answer_full}")
        print(f"                  MACER {seconds_macer:.2f} s -> {answer_macer} (random weights: ids, not words)")

    path = plots.save_kept_tokens(Path(args.out), model, inputs, record, config)
    print(f"kept tokens along the timeline: {path}")
    return 0


def _load_average() -> float | None:
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):  # not on Windows
        return None


def _print_times(times: dict[str, list[float]], record, n: int, load_before: float | None,
                 flops_ratio: float) -> None:
    """Wall times with their spread, and whether the machine was busy: a reader judges the ratio from both.

    ``flops_ratio``: MACER's decoder prefill FLOPs over the full model's (``macer.cost.run_cost``). Its inverse is
    the ideal speedup: pruning removes work, so a measured speedup above it is timing noise, and is said to be."""
    def spread(name: str) -> str:
        values = times[name]
        return f"{min(values):.2f} / {statistics.median(values):.2f} / {max(values):.2f}"

    runs = len(times["full"])
    f_all, m_all = statistics.median(times["full"]), statistics.median(times["MACER"])
    f_llm, m_llm = statistics.median(times["full decoder"]), statistics.median(times["MACER decoder"])
    proxy = sum(record.layer_tokens) / (n * len(record.layer_tokens))
    print(f"prefill time, {runs} run{'s' if runs > 1 else ''} of each after a warm-up, min / median / max: "
          f"full {spread('full')} s, MACER {spread('MACER')} s (median x{f_all / m_all:.2f})")
    print(f"decoder only, min / median / max: full {spread('full decoder')} s, MACER {spread('MACER decoder')} s "
          f"(median x{f_llm / m_llm:.2f}); ideal x{1 / flops_ratio:.2f} (decoder FLOPs ratio {flops_ratio:.3f}, "
          f"token-layer proxy {proxy:.3f}); MACER's own work {record.overhead_s:.3f} s")
    worst = max(max(v) / min(v) - 1 for v in times.values())
    cores = os.cpu_count() or 1
    load = "unknown" if load_before is None else f"{load_before:.1f}"
    busy = load_before is not None and load_before >= 0.5 * cores
    noisy = worst > 0.15
    if busy or noisy:
        reasons = []
        if busy:
            reasons.append(f"load average {load} on {cores} cores before the demo started: other processes share "
                           "the CPUs")
        if noisy:
            reasons.append(f"repeated runs differ by up to {100 * worst:.0f}%")
        print(f"machine busy: {'; '.join(reasons)}. The times are slower and noisier than on an idle machine; "
              "the counts above are exact either way")
    else:
        print(f"machine quiet: load average {load} on {cores} cores before the demo started, runs within "
              f"{100 * worst:.0f}% of each other")
    # Fewer FLOPs bound the speedup; a shorter sequence can also run faster per FLOP (it fits the CPU's caches:
    # x1.61 against an ideal of x1.38 on an idle 2-core VM, video only), so up to CACHE_SLACK above is not called noise.
    ratios = (("prefill", f_all / m_all), ("decoder", f_llm / m_llm))
    noise = [f"x{ratio:.2f} ({what})" for what, ratio in ratios if ratio * flops_ratio > CACHE_SLACK]
    above = [f"x{ratio:.2f} ({what})" for what, ratio in ratios
             if ROUNDING_SLACK < ratio * flops_ratio <= CACHE_SLACK]
    ideal = f"the ideal x{1 / flops_ratio:.2f}"
    if noise:
        print(f"timing noise: the measured speedup {' and '.join(noise)} is more than {CACHE_SLACK - 1:.0%} above "
              f"{ideal}, which pruning cannot give; rerun on a quiet machine or with more --repeats")
    if above:
        print(f"above the FLOPs ideal: the measured speedup {' and '.join(above)} exceeds {ideal} by "
              f"{ROUNDING_SLACK - 1:.0%} to {CACHE_SLACK - 1:.0%}: a shorter sequence can run faster per FLOP "
              "(caches), or it is noise")


class _LLMTimer:
    """Wall time of the decoder (text model) forward, to separate it from the encoders."""

    def __init__(self, decoder: torch.nn.Module):
        self.seconds = 0.0
        self._start = 0.0
        self._handles = [decoder.register_forward_pre_hook(self._pre), decoder.register_forward_hook(self._post)]

    def _pre(self, module, args):
        self._start = time.perf_counter()

    def _post(self, module, args, output):
        self.seconds = time.perf_counter() - self._start

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def _print_stages(record) -> None:
    """One line per stage; a modality whose budget holds all its tokens is said to be kept whole, not pruned."""
    left = {"audio": record.n_audio, "video": record.n_video}
    total = dict(left)
    for stage in record.stages:
        done = []
        for name in stage.modalities:
            left[name] = len(record.audio_kept if name == "audio" else record.video_kept)
            done.append(f"{name} pruned" if left[name] < total[name] else
                        f"{name} kept whole: its budget holds all {total[name]} tokens")
        print(f"after layer {stage.layer} ({', '.join(done)}): audio {left['audio']}/{total['audio']}, "
              f"video {left['video']}/{total['video']}, sequence {stage.tokens_before} -> {stage.tokens_after}")


def _print_caches(full_cache, pruned_cache) -> None:
    def sizes(cache):
        lengths = [layer.get_seq_length() for layer in cache.layers]
        nbytes = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
        return lengths, nbytes

    full_len, full_bytes = sizes(full_cache)
    macer_len, macer_bytes = sizes(pruned_cache)
    print(f"KV cache per layer, full:  {full_len} ({full_bytes / 2**20:.1f} MiB)")
    print(f"KV cache per layer, MACER: {macer_len} ({macer_bytes / 2**20:.1f} MiB, "
          f"{100 * macer_bytes / full_bytes:.0f}% of full)")


# ------------------------------------------------------------------------------------------------ real checkpoint
def run_checkpoint(args: argparse.Namespace) -> int:
    """A local Qwen2.5-Omni checkpoint through its processor (``macer.tools.checkpoint``)."""
    from macer.hf.compress import compress
    from macer.tools.checkpoint import load_checkpoint

    try:
        case = load_checkpoint(args, system_prompt=REAL_SYSTEM_PROMPT)
    except flags.CommandError as exc:
        print(f"macer demo: error: {exc}", file=sys.stderr)
        return 2
    model, inputs, config = case.model, case.inputs, case.config
    n = inputs["input_ids"].shape[1]
    with torch.no_grad():
        seconds_full, full = _timed(lambda: model.generate(**inputs, max_new_tokens=args.new_tokens, do_sample=False))
        with compress(model, config) as trace:
            seconds_macer, pruned = _timed(
                lambda: model.generate(**inputs, max_new_tokens=args.new_tokens, do_sample=False))
    record = trace.last
    assert record is not None  # the generate above ran one prefill inside compress
    print(f"{config}\nprompt {n} tokens: audio {record.n_audio}, video {record.n_video}; budget {record.budget}")
    _print_stages(record)
    print(f"tokens per layer: {record.layer_tokens}")
    print(f"KV cache per layer after prefill: {record.cache_lengths}")
    decode = case.processor.batch_decode
    print(f"full  ({seconds_full:.1f} s): {decode(full[:, n:], skip_special_tokens=True)[0]}")
    print(f"MACER ({seconds_macer:.1f} s): {decode(pruned[:, n:], skip_special_tokens=True)[0]}")
    if record.budget is None:  # the processor produced no audio or video tokens: nothing was pruned, nothing to draw
        print("the prompt has no audio or video tokens: MACER kept it whole")
        return 0
    print(f"kept tokens along the timeline: {plots.save_kept_tokens(Path(args.out), model, inputs, record, config)}")
    return 0
