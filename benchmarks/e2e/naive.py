"""The naive way of reading MACER's scores, for the gpu mode: eager attention with ``output_attentions=True`` (as
FastV-style code does) against sdpa plus ``macer_kernels.modality_scores``, time and memory, out-of-memory recorded."""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable, Sequence

import torch
from macer import cost
from macer.hf.adapters import get_adapter

from benchmarks.e2e.measure import thinker_of

_MIB = 2.0**20

def _scores_from_output_attentions(text_model: torch.nn.Module, embeds: torch.Tensor, modality: torch.Tensor,
                                   readout_layer: int, query_tokens: int) -> torch.Tensor:
    """ANMS (``eq:macer_score``) from the probabilities an eager forward returns with ``output_attentions=True``."""
    out = text_model(inputs_embeds=embeds, use_cache=False, output_attentions=True)
    probs = out.attentions[readout_layer - 1][:, :, -query_tokens:].float()  # [1, Hq, Lq, N]
    labels = modality[:, None, None, :]
    scores = torch.zeros(modality.shape, device=embeds.device)
    for m in (1, 2):
        in_m = labels == m
        mass = (probs * in_m).sum(-1, keepdim=True)
        scores += (probs / (mass + 1e-6) * in_m).sum(dim=(1, 2)) / (query_tokens * probs.shape[1])
    return scores


def _scores_from_cache(text_model: torch.nn.Module, embeds: torch.Tensor, query: torch.Tensor,
                       modality: torch.Tensor, readout_layer: int) -> torch.Tensor:
    """ANMS from an sdpa prefill's cached keys at the readout layer and the question rows' queries."""
    import macer_kernels

    out = text_model(inputs_embeds=embeds, use_cache=True)
    key = out.past_key_values.layers[readout_layer - 1].keys
    return macer_kernels.modality_scores(query, key, modality)


def naive_scores_rows(model: torch.nn.Module, label: str, lengths: Sequence[int], readout_layer: int,
                      query_tokens: int = 4, log: Callable[[str], None] = print) -> list[dict]:
    """Time and memory of getting ANMS scores at the readout layer of an N-token prefill, two ways:

    * ``eager+output_attentions``: the decoder with eager attention and ``output_attentions=True`` (every layer's
      ``[Hq, N, N]`` probabilities are materialised and returned), scores then computed from the readout layer's
      question rows, as FastV-style code does;
    * ``sdpa+modality_scores``: the decoder with sdpa (no probabilities) plus ``macer_kernels.modality_scores`` on
      the question rows' queries and the layer's keys.

    Out of memory is recorded (``oom=True``) instead of raised. Random hidden states stand in for a prompt and
    random question-row queries for the model's own (the cost is the same).
    """
    thinker = thinker_of(model)
    text_model = get_adapter(model).parts(model).decoder
    device = next(thinker.parameters()).device
    dtype = next(thinker.parameters()).dtype
    shape = cost.DecoderShape.from_config(model)
    rows = []
    previous = thinker.config.text_config._attn_implementation
    try:
        for n in lengths:
            generator = torch.Generator(device=device).manual_seed(n)
            embeds = torch.randn(1, n, shape.hidden_size, generator=generator, device=device, dtype=dtype)
            modality = torch.randint(0, 3, (1, n), generator=generator, device=device)
            query = torch.randn(1, shape.num_heads, query_tokens, shape.head_dim, generator=generator, device=device,
                                dtype=dtype)
            for method in ("eager+output_attentions", "sdpa+modality_scores"):
                thinker.set_attn_implementation({"text_config": "eager" if method.startswith("eager") else "sdpa"})

                if method.startswith("eager"):
                    fn = functools.partial(_scores_from_output_attentions, text_model, embeds, modality, readout_layer,
                                           query_tokens)
                else:
                    fn = functools.partial(_scores_from_cache, text_model, embeds, query, modality, readout_layer)
                row = {"model": label, "method": method, "tokens": n, "readout_layer": readout_layer, "oom": False,
                       "time_ms": None, "peak_mib": None}
                try:
                    with torch.no_grad():
                        fn()  # warm-up
                        torch.cuda.synchronize(device)
                        torch.cuda.reset_peak_memory_stats(device)
                        base = torch.cuda.memory_allocated(device)
                        times = []
                        for _ in range(3):
                            start = time.perf_counter()
                            fn()
                            torch.cuda.synchronize(device)
                            times.append(time.perf_counter() - start)
                    row["time_ms"] = 1e3 * statistics.median(times)
                    row["peak_mib"] = (torch.cuda.max_memory_allocated(device) - base) / _MIB
                except torch.cuda.OutOfMemoryError:
                    row["oom"] = True
                torch.cuda.empty_cache()
                rows.append(row)
                log(f"[{label}] naive scores N={n} {method}: "
                     + ("OOM" if row["oom"] else f"{row['time_ms']:.1f} ms, {row['peak_mib']:.0f} MiB above weights"))
    finally:
        thinker.set_attn_implementation({"text_config": previous})
    return rows

