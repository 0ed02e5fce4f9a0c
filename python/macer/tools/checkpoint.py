"""A local Qwen2.5-Omni checkpoint for ``macer demo --model`` and ``macer diagnose --model``: the thinker with its
processor, one chat-templated question about a video, and the ``MacerConfig`` of its scale.

Needs transformers with Qwen2.5-Omni, torchvision (video decoding), torchcodec >= 0.17 (the audio track of the video
file) and the weights on disk. What the folder or the video cannot give is a ``CommandError``: one line, which the
command line prints as ``macer <command>: error: <message>``.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

import torch

from macer.core.config import MacerConfig
from macer.tools._cli_args import CommandError, unloadable

__all__ = ["Checkpoint", "load_checkpoint"]


@dataclass
class Checkpoint:
    """What both commands run: the thinker (eval mode, on the GPU in bfloat16 where there is one, else on the CPU in
    float32), its processor, the prompt's inputs on the thinker's device, and the config for the thinker's scale."""

    model: Any
    processor: Any
    inputs: dict[str, Any]
    config: MacerConfig


def load_checkpoint(args: argparse.Namespace, *, system_prompt: str | None = None) -> Checkpoint:
    """``args.model``'s thinker and processor; the inputs of ``args.question`` about ``args.video`` sampled at
    ``args.fps`` (its audio track interleaved, after an optional system turn); ``MacerConfig.for_model`` at
    ``args.keep_ratio`` with the readout layers the flags give, and the end-of-turn id of the checkpoint's own
    tokenizer."""
    try:
        from transformers import Qwen2_5OmniProcessor, Qwen2_5OmniThinkerForConditionalGeneration
    except ImportError as exc:
        raise CommandError(f"--model needs transformers with Qwen2.5-Omni (pip install 'macer-kernels[models]'): "
                           f"{exc}") from None
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    try:
        processor: Any = Qwen2_5OmniProcessor.from_pretrained(args.model)
        # The thinker alone: on transformers 5.23 the full model's generate() cannot return text only.
        thinker: Any = Qwen2_5OmniThinkerForConditionalGeneration
        model = thinker.from_pretrained(args.model, dtype=dtype).to(device).eval()
    except (OSError, ValueError) as exc:  # transformers' errors for a folder without the checkpoint's files
        raise CommandError(unloadable(args.model, exc)) from None
    user = {"role": "user", "content": [{"type": "video", "video": args.video}, {"type": "audio"},
                                        {"type": "text", "text": args.question}]}
    system = [{"role": "system", "content": [{"type": "text", "text": system_prompt}]}] if system_prompt else []
    try:
        inputs = processor.apply_chat_template(
            [*system, user], load_audio_from_video=True, add_generation_prompt=True, tokenize=True, return_dict=True,
            return_tensors="pt", processor_kwargs={"videos_kwargs": {"fps": args.fps}})
    except (ImportError, RuntimeError, ValueError) as exc:
        raise CommandError(f"the processor could not read {args.video}: {exc} (video decoding needs torchvision, the "
                           "audio track torchcodec >= 0.17)") from None
    inputs = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    inputs["use_audio_in_video"] = True
    layers = {name: getattr(args, name) for name in ("audio_layer", "video_layer")}
    overrides: dict[str, Any] = {name: layer for name, layer in layers.items() if layer is not None}
    im_end = _end_of_turn_id(processor)
    if im_end is not None:
        overrides["end_of_turn_token_id"] = im_end
    try:
        config = MacerConfig.for_model(model, keep_ratio=args.keep_ratio, **overrides)
    except ValueError as exc:  # e.g. a depth without the paper's defaults: the flags to pass are named
        raise CommandError(f"{exc} (--audio-layer / --video-layer set them)") from None
    return Checkpoint(model, processor, inputs, config)


def _end_of_turn_id(processor: Any) -> int | None:
    """The question span ends at the last ``<|im_end|>``: its id in this checkpoint's tokenizer (151645 for the
    released Qwen2.5-Omni vocabulary), so that another vocabulary cannot silently move the span to the prompt's end;
    None where the tokenizer has no such token (the model family's default then applies)."""
    tokenizer = getattr(processor, "tokenizer", None)
    if tokenizer is None:
        return None
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    return im_end if isinstance(im_end, int) and im_end != getattr(tokenizer, "unk_token_id", None) else None
