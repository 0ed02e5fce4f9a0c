"""Tiny random models and prompt sizes shared by the transformers engine's tests (tests/hf): one definition each,
so that the tests that compare engines and layouts build the same model and the same prompt sizes."""

from __future__ import annotations

from typing import Any

from macer.testing import build_thinker, decoder_parts

__all__ = ["SMALL_PROMPT", "decoder_of", "root_of", "tiny_thinker"]

SMALL_PROMPT = {"question_tokens": 6, "system_tokens": 4}
"""A chat prompt's text around its media, kept short (``clip_inputs`` / ``qwen3_clip_inputs`` keywords)."""


def decoder_of(model: Any) -> Any:
    """The model's decoder (its layer stack)."""
    return decoder_parts(model).decoder


def root_of(model: Any) -> Any:
    """The model that owns the decoder (the thinker)."""
    return decoder_parts(model).root


def tiny_thinker(attn: str = "sdpa", *, layers: int = 4, seed: int = 7, **kwargs: Any) -> Any:
    """A random-weight Qwen2.5-Omni thinker, hidden size 64."""
    return build_thinker(num_layers=layers, hidden_size=64, attn_implementation=attn, seed=seed, **kwargs)
