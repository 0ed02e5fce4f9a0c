"""``MacerRequestGuard``: a logits processor that changes no logits and refuses, when a request arrives, the request
settings MACER cannot honour: ``prompt_logprobs`` (``macer.vllm.checks.check_request``) and bad per-request MACER
settings (``macer.vllm.request_settings``: ``macer_keep_ratio``, ``macer_policy``). ``MacerEngineHook`` adds it to
the engines of the MACER architectures only; vLLM calls ``validate_params`` at admission, in the frontend, so a
refused request fails alone (``VLLMValidationError``; HTTP 400 from the server) and the engine serves on."""

from __future__ import annotations

from typing import Any

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor

from macer.vllm.checks import check_request
from macer.vllm.request_settings import remembered_engine, request_overrides, request_policy

__all__ = ["MacerRequestGuard", "check_request_settings"]


def check_request_settings(sampling_params: Any) -> None:
    """``ValueError`` for a request MACER cannot serve as asked (module docstring). With the engine's settings known
    in this process (the config hook ran here), the request's policy is resolved in full (e.g. a policy whose
    fields the engine's settings do not give); otherwise names, types and ranges are checked."""
    check_request(sampling_params)
    extra_args = getattr(sampling_params, "extra_args", None)
    engine = remembered_engine()
    default = "macer"
    if engine is not None and isinstance(engine[0], dict):
        default = engine[0].get("policy", "macer")
    overrides = request_overrides(extra_args, default)
    if overrides and engine is not None:
        request_policy(engine[0], overrides, engine[1], engine[2])


class MacerRequestGuard(LogitsProcessor):
    """Refuses requests at admission (``validate_params``); the identity on logits (and skipped by greedy sampling)."""

    @classmethod
    def validate_params(cls, sampling_params: Any) -> None:
        check_request_settings(sampling_params)

    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        del vllm_config, device, is_pin_memory  # nothing to keep: the guard acts at admission only

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        return logits

    def is_argmax_invariant(self) -> bool:
        return True

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        return None
