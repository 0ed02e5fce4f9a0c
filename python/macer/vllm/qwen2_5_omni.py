"""``MacerQwen2_5OmniThinkerForConditionalGeneration``: vLLM's Qwen2.5-Omni thinker (encoders, processor, M-RoPE
unchanged) with MACER's stages inside its language model. Loaded by ``macer.vllm.model`` on first use: vLLM's thinker
module imports torchvision, which does not import beside the CPU torch build the CPU tests use.

Rows are labelled from the thinker config's audio / video / image token ids, and the question closes at the
family's end-of-turn id, exactly as the transformers adapter does (``macer.vllm.prompt.omni_prompt_labels`` over
``macer.core.families``); the temporal position of a row is its M-RoPE temporal row (``StagedDecoder`` reads
``positions[0]``), as the adapter's ``position_ids[-3]``. The labels come from the prompt ids the runner holds for
each request (``runner.requests``), so the runner need not pass the step's token ids beside the merged embeddings
(``requires_raw_input_tokens`` stays vLLM's default, off).
"""

from __future__ import annotations

import torch
from vllm.config import VllmConfig
from vllm.model_executor.models.qwen2_5_omni_thinker import Qwen2_5OmniThinkerForConditionalGeneration
from vllm.sequence import IntermediateTensors

from macer.vllm.checks import check_engine, no_pipeline
from macer.vllm.prompt import engine_prompt_labels
from macer.vllm.settings import policy_from_config
from macer.vllm.staged import StagedDecoder

__all__ = ["MacerQwen2_5OmniThinkerForConditionalGeneration"]


class MacerQwen2_5OmniThinkerForConditionalGeneration(Qwen2_5OmniThinkerForConditionalGeneration):
    """vLLM's Qwen2.5-Omni thinker with MACER's stages inside its language model."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        check_engine(vllm_config)
        policy, labels = policy_from_config(vllm_config)
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        self.macer = StagedDecoder(self.language_model.model, policy, engine_prompt_labels(vllm_config, labels),
                                   vllm_config)

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                intermediate_tensors: IntermediateTensors | None = None, inputs_embeds: torch.Tensor | None = None,
                **kwargs: object) -> torch.Tensor:
        no_pipeline(intermediate_tensors)
        return self.macer.forward(input_ids, positions, inputs_embeds)
