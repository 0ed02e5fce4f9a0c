"""``MacerQwen3OmniMoeThinkerForConditionalGeneration``: vLLM's Qwen3-Omni (MoE) thinker (encoders, processor,
interleaved M-RoPE, sparse-MoE language model unchanged) with MACER's stages inside its language model. Loaded
by ``macer.vllm.model`` on first use, as the Qwen2.5-Omni thinker is (vLLM's thinker module imports torchvision).

Rows are labelled from the thinker config's audio / video / image token ids and the question closes at the family's
end-of-turn id, as the transformers adapter does (``macer.vllm.prompt.omni_prompt_labels`` over
``macer.core.families.QWEN3_OMNI``); the temporal position of a row is its M-RoPE temporal row. The policy's layers
are the user's, or the ones ``MacerConfig.for_model`` derives for Qwen3-Omni-30B-A3B (not in the paper: a
``UserWarning`` says so when the engine loads).

Deepstack. vLLM's thinker carries the vision encoder's deepstack features as dense per-row tensors, one per level:
``embed_input_ids`` writes them into a buffer of the model (``[T, hidden]`` per level, zero on every row that is not
an image or video row), ``forward`` hands ``deepstack_input_embeds_<i>`` to the language model, which adds level
``i`` to the hidden states after ``layers[i]``, and clears the buffer after the step. Here the staged layer loop
(``macer.vllm.staged.StagedDecoder``) calls ``_add_deepstack`` after each layer with the rows that layer held: before
any stage all of them (the same addition as vLLM's, so keep ratio 1 is bit-identical), after a stage the kept rows,
which get exactly their own rows of each level (and text or audio rows their zeros), as the transformers adapter's
deepstack remapping does (``macer.hf.adapters.qwen3_omni``).

The labels come from the prompt ids the runner holds for each request (``runner.requests``), so the runner need not
pass the step's token ids beside the merged embeddings (``requires_raw_input_tokens`` stays vLLM's default, off).
"""

from __future__ import annotations

import torch
from vllm.config import VllmConfig
from vllm.model_executor.models.qwen3_omni_moe_thinker import Qwen3OmniMoeThinkerForConditionalGeneration
from vllm.sequence import IntermediateTensors

from macer.vllm.checks import check_engine, no_pipeline
from macer.vllm.prompt import engine_prompt_labels
from macer.vllm.settings import policy_from_config
from macer.vllm.staged import StagedDecoder

__all__ = ["MacerQwen3OmniMoeThinkerForConditionalGeneration"]


class MacerQwen3OmniMoeThinkerForConditionalGeneration(Qwen3OmniMoeThinkerForConditionalGeneration):
    """vLLM's Qwen3-Omni thinker with MACER's stages inside its language model (deepstack: module docstring)."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        check_engine(vllm_config)
        policy, labels = policy_from_config(vllm_config)
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        self._deepstack: IntermediateTensors | None = None  # this step's levels, during forward only
        self.macer = StagedDecoder(self.language_model.model, policy, engine_prompt_labels(vllm_config, labels),
                                   vllm_config, after_layer=self._add_deepstack)

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                intermediate_tensors: IntermediateTensors | None = None, inputs_embeds: torch.Tensor | None = None,
                **kwargs: object) -> torch.Tensor:
        no_pipeline(intermediate_tensors)
        if inputs_embeds is None:
            return self.macer.forward(input_ids, positions, None)
        # As vLLM's forward: this step's rows of the buffer embed_input_ids filled (zeros on a step without images or
        # videos), cleared after the step; vLLM's own forward of the language model adds them when no stage runs.
        rows = inputs_embeds.size(0)
        self._deepstack = self._get_deepstack_input_embeds(rows)
        try:
            hidden = self.macer.forward(input_ids, positions, inputs_embeds, deepstack_input_embeds=self._deepstack)
        finally:
            self._deepstack = None
        self._clear_deepstack_input_embeds(rows)
        return hidden

    def _add_deepstack(self, index: int, hidden: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
        """``StagedDecoder``'s ``after_layer``: level ``index``'s features of the rows ``layers[index]`` held."""
        levels = self._deepstack
        if levels is None or index >= len(levels):
            return hidden
        level = levels[f"deepstack_input_embeds_{index}"]
        return hidden + (level if rows is None else level.index_select(0, rows))
