"""``MacerRequestGuard``: a logits processor that changes no logits and refuses, when a request arrives, the request
settings MACER cannot honour (``macer.vllm.checks.check_request``). ``MacerEngineHook`` adds it to the engines of
the MACER architectures only; vLLM calls ``validate_params`` at admission, so the server answers HTTP 400."""

from __future__ import annotations

from typing import Any

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor

from macer.vllm.checks import check_request

__all__ = ["MacerRequestGuard"]


class MacerRequestGuard(LogitsProcessor):
    """Refuses ``prompt_logprobs`` (``validate_params``); the identity on logits (and skipped by greedy sampling)."""

    @classmethod
    def validate_params(cls, sampling_params: Any) -> None:
        check_request(sampling_params)

    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        del vllm_config, device, is_pin_memory  # nothing to keep: the guard acts at admission only

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        return logits

    def is_argmax_invariant(self) -> bool:
        return True

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        return None
