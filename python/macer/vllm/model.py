"""The plugin's architectures: vLLM's own Qwen2 decoder, Qwen2.5-Omni thinker and Qwen3-Omni thinker with MACER's stages
in the language model's forward (``macer.vllm.staged.StagedDecoder``). Registered lazily by ``macer.vllm.register``,
all three as ``macer.vllm.model:<class>``; the two thinkers live in ``qwen2_5_omni`` / ``qwen3_omni`` and are loaded
from here on first use (``THINKERS``).

* ``MacerQwen2ForCausalLM``: a Qwen2 decoder whose audio/video rows are named by token-id sets in the settings
  (``additional_config["macer"]["audio_token_ids"]`` / ``["video_token_ids"]``): the labelled path inside the engine.
* ``MacerQwen2_5OmniThinkerForConditionalGeneration``: vLLM's Qwen2.5-Omni thinker (encoders, processor, M-RoPE
  unchanged), rows labelled from its config's audio/video/image token ids (``macer.core.families``),
  temporal positions from the M-RoPE temporal row. Selected on a checkpoint with
  ``--hf-overrides '{"architectures": ["MacerQwen2_5OmniThinkerForConditionalGeneration"]}'``.
* ``MacerQwen3OmniMoeThinkerForConditionalGeneration``: the same for vLLM's Qwen3-Omni (MoE) thinker.

All check the engine's settings when they load (``macer.vllm.checks.check_engine``) and build their policy from
``additional_config["macer"]`` (``macer.vllm.settings.policy_from_config``).
"""

from __future__ import annotations

import importlib
import traceback
from typing import Any

import torch
from vllm.config import VllmConfig
from vllm.model_executor.models.qwen2 import Qwen2ForCausalLM
from vllm.sequence import IntermediateTensors

from macer.vllm.checks import check_engine
from macer.vllm.parallel import with_rows
from macer.vllm.prompt import engine_prompt_labels
from macer.vllm.settings import policy_from_config
from macer.vllm.staged import StagedDecoder

# MacerQwen2_5OmniThinkerForConditionalGeneration is an attribute too, loaded on first access (``__getattr__``).
__all__ = ["MacerQwen2ForCausalLM"]


class MacerQwen2ForCausalLM(Qwen2ForCausalLM):
    """vLLM's ``Qwen2ForCausalLM`` with MACER's stages; rows labelled by the settings' token-id sets."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        check_engine(vllm_config)
        policy, labels = policy_from_config(vllm_config)
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        self.macer = StagedDecoder(self.model, policy, engine_prompt_labels(vllm_config, labels), vllm_config)
        # Pipeline parallel: a later rank also receives which of the step's rows it holds (macer.vllm.parallel).
        self.make_empty_intermediate_tensors = with_rows(self.make_empty_intermediate_tensors)

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                intermediate_tensors: IntermediateTensors | None = None, inputs_embeds: torch.Tensor | None = None,
                **kwargs: Any) -> torch.Tensor | IntermediateTensors:
        return self.macer.forward(input_ids, positions, inputs_embeds, intermediate_tensors)


THINKERS = {
    "MacerQwen2_5OmniThinkerForConditionalGeneration": ("macer.vllm.qwen2_5_omni", "Qwen2.5-Omni"),
    "MacerQwen3OmniMoeThinkerForConditionalGeneration": ("macer.vllm.qwen3_omni", "Qwen3-Omni"),
}
"""The Omni thinkers this module loads on first use: class name -> (module, family)."""


def __getattr__(name: str) -> Any:
    # vLLM's Omni thinker modules import torchvision (through transformers' image processors), which the CPU
    # environment may lack: a thinker class is loaded only when vLLM asks for it, and a failed import says what is
    # missing (macer.vllm.registry logs it where vLLM would only say "failed to be inspected"). Both thinkers load
    # this one way.
    if name in THINKERS:
        module, family = THINKERS[name]
        try:
            loaded = importlib.import_module(module)
        except Exception as error:  # torchvision's own failures are RuntimeErrors as often as ImportErrors
            raise ImportError(omni_import_problem(error, name, family)) from error
        return getattr(loaded, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def omni_import_problem(error: BaseException, architecture: str = "MacerQwen2_5OmniThinkerForConditionalGeneration",
                        family: str = "Qwen2.5-Omni") -> str:
    """One line naming what the thinker class ``architecture`` could not import (``error``: what importing it
    raised)."""
    head = (f"macer: {architecture} cannot be loaded: vLLM's {family} thinker module imports torchvision (through "
            "transformers' image processors), and ")
    fix = f"install the torchvision release built for torch {torch.__version__}"
    if isinstance(error, ModuleNotFoundError) and (error.name or "").split(".")[0] == "torchvision":
        return f"{head}torchvision is not installed: {fix}"
    frames = traceback.extract_tb(error.__traceback__)
    said = " ".join(str(error).split())  # one line
    if "torchvision" in said or any("torchvision" in frame.filename for frame in frames):
        return f"{head}torchvision does not import ({type(error).__name__}: {said}): {fix}"
    return (f"macer: {architecture} cannot be loaded: importing vLLM's {family} thinker module failed "
            f"({type(error).__name__}: {said})")
