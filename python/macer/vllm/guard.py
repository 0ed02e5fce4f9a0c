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
from macer.vllm.request_settings import remembered_engines, request_overrides, request_policy

__all__ = ["MacerRequestGuard", "check_request_settings"]


def check_request_settings(sampling_params: Any) -> None:
    """``ValueError`` for a request MACER cannot serve as asked (module docstring). With the engine's settings known
    in this process (the config hook ran here), the request's policy is resolved in full (e.g. a policy whose
    fields the engine's settings do not give); otherwise names, types and ranges are checked. The check does not know
    which engine a request goes to: in a process that built several MACER engines, a request is refused only when
    none of them could serve it as asked (the model then serves it unpruned with a WARNING record if its own engine
    cannot), with the newest engine's reason."""
    check_request(sampling_params)
    extra_args = getattr(sampling_params, "extra_args", None)
    engines = remembered_engines()
    if not engines:
        request_overrides(extra_args, "macer")
        return
    refusal: ValueError | None = None
    for settings, hf_config, architecture in reversed(engines):
        default = settings.get("policy", "macer") if isinstance(settings, dict) else "macer"
        try:
            overrides = request_overrides(extra_args, default)
            if overrides:
                request_policy(settings, overrides, hf_config, architecture)
            return
        except ValueError as error:
            refusal = refusal or error
    assert refusal is not None  # the loop returned unless every engine refused
    raise refusal


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
