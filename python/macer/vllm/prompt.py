"""What the engine knows about a prompt's rows, per architecture: their modality labels and the end-of-turn id
(``PromptLabels``: from the settings' token-id sets, or from a Qwen-Omni thinker's config through
``macer.core.families``), and the temporal position of each row (``temporal_row``, from vLLM's positions).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from macer.core.families import QWEN2_5_OMNI, QwenOmni

__all__ = ["PromptLabels", "engine_prompt_labels", "omni_prompt_labels", "temporal_row"]


@dataclass(frozen=True)
class PromptLabels:
    """What the engine knows about a prompt's rows, per architecture.

    Attributes:
        labels: host ``[N]`` token ids -> host ``[N]`` int64 modality labels (``macer.AUDIO`` / ``macer.VISUAL``).
        end_of_turn_token_id: the id closing the user's question when the policy names none (None: unknown).
    """

    labels: Callable[[torch.Tensor], torch.Tensor]
    end_of_turn_token_id: int | None = None


def omni_prompt_labels(thinker_config: Any, family: QwenOmni = QWEN2_5_OMNI) -> PromptLabels:
    """A Qwen-Omni thinker's rows, read from its config as the family's transformers adapter reads them
    (``macer.core.families``: ``QWEN2_5_OMNI``, ``QWEN3_OMNI``): audio = the config's audio token id, visual = its
    video or image token id; the question ends at the family's end-of-turn id (``<|im_end|>``)."""

    def labels(ids: torch.Tensor) -> torch.Tensor:
        return family.labels(thinker_config, ids)

    return PromptLabels(labels, family.end_of_turn_token_id(thinker_config))


def engine_prompt_labels(vllm_config: Any, labels: Any) -> PromptLabels:
    """The labels of an engine's architecture from its config alone: a thinker's from its config's token ids, the
    labelled architecture's from the settings' token-id sets (``labels``, the ``LabelSpec`` of
    ``macer.vllm.settings.policy_from_config``; None on a thinker). Every MACER model class builds its labels with
    it, and so does the scheduler of an engine that frees KV memory, which plans each request's layout in a process
    that holds no model: one function, so the two label every prompt alike."""
    from macer.vllm.settings import thinker_family

    model_config = vllm_config.model_config
    family = thinker_family(model_config.architecture)
    if family is not None:
        return omni_prompt_labels(model_config.hf_config.thinker_config, family)
    return PromptLabels(labels.labels)


def temporal_row(positions: torch.Tensor) -> torch.Tensor:
    """Temporal position of each row from vLLM's positions: ``[T]`` (RoPE) as is, ``[3, T]`` (M-RoPE) its first,
    temporal row (the adapter's ``position_ids[-3]`` in transformers' ``[3, B, N]``)."""
    if positions.ndim == 1:
        return positions
    if positions.ndim == 2 and positions.shape[0] == 3:
        return positions[0]
    raise ValueError(f"macer: positions must be [T] or [3, T] (M-RoPE), got shape {tuple(positions.shape)}")
