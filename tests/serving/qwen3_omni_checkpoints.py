"""The Qwen3-Omni (MoE) counterpart of ``omni_checkpoints``, for the vLLM tests of its real thinker.

* ``write_qwen3_omni(directory, ...)``, ``qwen3_omni_processor()``, ``QWEN3_OMNI_TOKENS``, ``PATCH_SIZE``: the
  package's (``macer.testing_omni``), re-exported here.
* ``load_hf_qwen3_thinker(path)``: transformers' ``Qwen3OmniMoeThinkerForConditionalGeneration`` with those weights.
"""

from __future__ import annotations

from pathlib import Path

import torch
from macer.testing_omni import PATCH_SIZE, QWEN3_OMNI_TOKENS, quiet_transformers, qwen3_omni_processor, write_qwen3_omni

__all__ = ["PATCH_SIZE", "QWEN3_OMNI_TOKENS", "load_hf_qwen3_thinker", "qwen3_omni_processor", "write_qwen3_omni"]


def load_hf_qwen3_thinker(path: str | Path, *, attn_implementation: str = "sdpa"):
    """transformers' ``Qwen3OmniMoeThinkerForConditionalGeneration`` with the checkpoint's ``thinker.`` weights, fp32,
    in eval mode (loaded through the full model's ``from_pretrained``, which maps the saved layout back)."""
    from transformers import Qwen3OmniMoeForConditionalGeneration

    with quiet_transformers():
        model, info = Qwen3OmniMoeForConditionalGeneration.from_pretrained(
            path, dtype=torch.float32, attn_implementation=attn_implementation, output_loading_info=True)
    left = {name: keys for name, keys in info.items() if keys}
    if left:
        raise RuntimeError(f"load_hf_qwen3_thinker: the checkpoint did not load exactly: {left}")
    return model.thinker.eval()
