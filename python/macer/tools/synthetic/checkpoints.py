"""Tiny random Qwen-Omni checkpoints with their processor files, built in code (no download): a Qwen2.5-Omni and a
Qwen3-Omni (MoE) model as the published ones are laid out (``config.json`` with the thinker's config and the talker
off, ``model.safetensors`` with the thinker's weights under ``thinker.``, the processor's files: ``tokenizer.json``,
``tokenizer_config.json``, ``processor_config.json``, the chat template), at tiny sizes but with the real vocabulary
size and special token ids, so that vLLM's own processors expand the placeholders as for the published models. The
vLLM tests of the thinkers (``tests/serving``) and the CPU recipe of docs/serving.md ("Try the Qwen-Omni thinkers on a
CPU") serve them::

    python -m macer.testing_omni qwen2_5_omni /tmp/macer-omni/qwen2_5_omni
    python -m macer.testing_omni qwen3_omni /tmp/macer-omni/qwen3_omni

* ``write_qwen25_omni(directory, ...)`` / ``write_qwen3_omni(directory, ...)``: the checkpoints (fp32). Qwen3-Omni:
  a dense layer 0 and sparse-MoE layers after it, ``deepstack_layers`` vision blocks feeding deepstack levels.
* ``omni_tokenizer()``: their tokenizer: byte-level BPE whose 256 byte tokens have Qwen2's ids (``"\\n"`` is 198),
  filler entries up to 151642, and the family's special tokens at their real ids. No merges: text is one token per
  byte. ``omni_processor()`` / ``qwen3_omni_processor()``: the processors around it.
* ``QWEN25_OMNI_TOKENS`` / ``QWEN3_OMNI_TOKENS``: the special token ids.

A random model answers with random tokens: these checkpoints are for seeing the engine run (and for the tests, which
compare it with transformers on the same weights), not for answers. vLLM's CPU attention takes head sizes 32, 64, 80,
96, 112, 128 only (checked). Public as ``macer.testing_omni`` (the same objects), the name the commands above use.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "CHAT_TEMPLATE",
    "PATCH_SIZE",
    "QWEN3_OMNI_TOKENS",
    "QWEN25_OMNI_TOKENS",
    "SAMPLE_RATE",
    "chat_template",
    "check_head_size",
    "main",
    "omni_processor",
    "omni_tokenizer",
    "quiet_transformers",
    "qwen3_omni_processor",
    "save_checkpoint",
    "write_qwen3_omni",
    "write_qwen25_omni",
]

SAMPLE_RATE = 16_000
"""The Whisper feature extractor's sampling rate (the Qwen-Omni audio input)."""


@dataclass(frozen=True)
class OmniTokens:
    """Special token ids of Qwen2.5-Omni's tokenizer (the published ``tokenizer_config.json``)."""

    endoftext: int = 151643
    im_start: int = 151644
    im_end: int = 151645
    audio: int = 151646  # <|AUDIO|>
    audio_start: int = 151647  # <|audio_bos|>
    audio_end: int = 151648  # <|audio_eos|>
    vision_start: int = 151652  # <|vision_bos|>
    vision_end: int = 151653  # <|vision_eos|>
    image: int = 151655  # <|IMAGE|>
    video: int = 151656  # <|VIDEO|>
    vocab_size: int = 152064  # the 7B model's embedding rows (more than the tokenizer's 151657 ids)


QWEN25_OMNI_TOKENS = OmniTokens()

_SPECIAL_TOKENS = {
    "<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645, "<|AUDIO|>": 151646,
    "<|audio_bos|>": 151647, "<|audio_eos|>": 151648,
    # 151649-151651 and 151654 keep Qwen2.5-VL's names; the thinker reads none of them.
    "<|box_end|>": 151649, "<|quad_start|>": 151650, "<|quad_end|>": 151651,
    "<|vision_bos|>": 151652, "<|vision_eos|>": 151653, "<|vision_pad|>": 151654,
    "<|IMAGE|>": 151655, "<|VIDEO|>": 151656,
}
_PROCESSOR_TOKENS = {  # the tokenizer attributes Qwen2_5OmniProcessor reads (tokenizer.image_token, ...)
    "image_token": "<|IMAGE|>", "audio_token": "<|AUDIO|>", "video_token": "<|VIDEO|>",
    "vision_bos_token": "<|vision_bos|>", "vision_eos_token": "<|vision_eos|>",
    "audio_bos_token": "<|audio_bos|>", "audio_eos_token": "<|audio_eos|>",
}

def chat_template(tokens: dict[str, str]) -> str:
    """A Qwen-Omni chat template in short, for the family whose processor tokens are ``tokens``
    (``_PROCESSOR_TOKENS``): a default system turn, ``<audio_bos><audio><audio_eos>`` for an audio part,
    ``<vision_bos><video><vision_eos>`` for a video part (the processor expands the single placeholder)."""
    audio = tokens["audio_bos_token"] + tokens["audio_token"] + tokens["audio_eos_token"]
    image = tokens["vision_bos_token"] + tokens["image_token"] + tokens["vision_eos_token"]
    video = tokens["vision_bos_token"] + tokens["video_token"] + tokens["vision_eos_token"]
    return (
        "{% for message in messages %}"
        "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant."
        "<|im_end|>\n{% endif %}"
        "<|im_start|>{{ message['role'] }}\n"
        "{% if message['content'] is string %}{{ message['content'] }}"
        "{% else %}{% for part in message['content'] %}"
        f"{{% if part['type'] in ('audio', 'audio_url', 'input_audio') %}}{audio}"
        f"{{% elif part['type'] in ('image', 'image_url') %}}{image}"
        f"{{% elif part['type'] in ('video', 'video_url') %}}{video}"
        "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
        "{% endfor %}{% endif %}<|im_end|>\n"
        "{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )


CHAT_TEMPLATE = chat_template(_PROCESSOR_TOKENS)
"""Qwen2.5-Omni's chat template in short (``chat_template``)."""


def omni_tokenizer(special_tokens: dict[str, int] | None = None, processor_tokens: dict[str, str] | None = None):
    """The checkpoint's tokenizer (see the module docstring): Qwen2.5-Omni's special tokens by default
    (``len(tokenizer) == 151657``); another family's with ``special_tokens`` (token -> id, contiguous from 151643) and
    ``processor_tokens`` (the tokenizer attributes its processor reads)."""
    from transformers import Qwen2Tokenizer
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    special_tokens = special_tokens or _SPECIAL_TOKENS
    processor_tokens = processor_tokens or _PROCESSOR_TOKENS
    # Qwen2's first 256 ids are the byte-level characters in this order; ids up to <|endoftext|> are merged words in
    # the real vocabulary, fillers here (no merges reach them). The special tokens sit in the vocabulary at their
    # real ids and are then declared special, which keeps those ids.
    vocab = {char: index for index, char in enumerate(bytes_to_unicode().values())}
    vocab.update({f"<unused{index}>": index for index in range(len(vocab), QWEN25_OMNI_TOKENS.endoftext)})
    vocab.update(special_tokens)
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=[], extra_special_tokens=processor_tokens,
                               model_max_length=32768)
    tokenizer.add_special_tokens({"additional_special_tokens": list(special_tokens)})
    tokenizer.chat_template = chat_template(processor_tokens)
    got = {token: tokenizer.convert_tokens_to_ids(token) for token in special_tokens}
    if got != special_tokens:
        raise RuntimeError(f"omni_tokenizer: special token ids moved: {got}")
    return tokenizer


def omni_processor():
    """A ``Qwen2_5OmniProcessor`` around ``omni_tokenizer()``: Whisper features (128 mel bins, 16 kHz, padded to
    30 s), the Qwen2-VL image and video processors with their defaults. Video frames are resized by the processor's
    own defaults (``Qwen2_5OmniProcessorKwargs``: 128 to 768 patches of 28x28 pixels per frame, whatever the video
    processor's config says): a 112x112 frame becomes 336x336, 144 tokens per 2 frames, as in the published model."""
    from transformers import Qwen2_5OmniProcessor, WhisperFeatureExtractor
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

    return Qwen2_5OmniProcessor(
        image_processor=Qwen2VLImageProcessor(),
        video_processor=Qwen2VLVideoProcessor(),
        feature_extractor=WhisperFeatureExtractor(feature_size=128, sampling_rate=SAMPLE_RATE),
        tokenizer=omni_tokenizer(),
        chat_template=CHAT_TEMPLATE,
    )


@contextlib.contextmanager
def quiet_transformers():
    """transformers' logging at errors only inside the block (the Omni configs' unused talker defaults name token ids
    outside its vocabulary and warn about them)."""
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)


def check_head_size(caller: str, hidden_size: int, num_heads: int) -> None:
    """Refuse a language-model head size vLLM's CPU attention lacks (``caller`` names the writer)."""
    if hidden_size % num_heads or (hidden_size // num_heads) not in (32, 64, 80, 96, 112, 128):
        raise ValueError(f"{caller}: hidden_size / num_heads must be a head size vLLM's CPU attention "
                         f"supports (32, 64, 80, 96, 112, 128), got {hidden_size} / {num_heads}")


def save_checkpoint(directory: str | Path, model_class: type, config: Any, processor: Any, *, seed: int) -> Path:
    """``model_class(config)`` with weights drawn from ``seed`` alone, saved with ``processor``'s files to
    ``directory`` (fp32 safetensors)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_class(config).eval()
    path = Path(directory)
    model.save_pretrained(path, safe_serialization=True)
    processor.save_pretrained(path)
    return path


def _omni_config(*, num_layers: int, hidden_size: int, num_heads: int, num_kv_heads: int, encoder_hidden_size: int,
                 init_std: float):
    from transformers import Qwen2_5OmniConfig

    from macer.tools.synthetic.qwen2_5_omni import thinker_config

    tok = QWEN25_OMNI_TOKENS
    thinker = thinker_config(num_layers=num_layers, hidden_size=hidden_size, num_heads=num_heads,
                             num_kv_heads=num_kv_heads, vocab_size=tok.vocab_size,
                             encoder_hidden_size=encoder_hidden_size).to_dict()
    # The real token ids (``qwen2_5_omni``'s thinker remaps them into a small vocabulary).
    thinker.update(audio_token_index=tok.audio, image_token_index=tok.image, video_token_index=tok.video,
                   audio_start_token_id=tok.audio_start, audio_end_token_id=tok.audio_end,
                   vision_start_token_id=tok.vision_start, vision_end_token_id=tok.vision_end, user_token_id=872,
                   initializer_range=init_std)
    thinker.pop("im_end_token_id", None)  # the published config names none; <|im_end|> is the family default
    thinker["text_config"].update(eos_token_id=tok.im_end, pad_token_id=tok.endoftext, bos_token_id=tok.endoftext,
                                  initializer_range=init_std, tie_word_embeddings=False)
    for encoder in ("audio_config", "vision_config"):
        thinker[encoder]["initializer_range"] = init_std
    with quiet_transformers():  # the default talker config warns about its token ids; it is never built
        return Qwen2_5OmniConfig(thinker_config=thinker, enable_audio_output=False)


def write_qwen25_omni(directory: str | Path, *, num_layers: int = 4, hidden_size: int = 64, num_heads: int = 2,
                      num_kv_heads: int = 1, encoder_hidden_size: int = 32, init_std: float = 0.05,
                      seed: int = 0) -> Path:
    """Write a random Qwen2.5-Omni checkpoint (fp32, talker off) with its processor files to ``directory``.

    Loads in vLLM as ``Qwen2_5OmniThinkerForConditionalGeneration`` (the registry's class for the checkpoint's
    ``Qwen2_5OmniForConditionalGeneration``; ``hf_overrides`` picks the MACER one) and in transformers through
    ``load_hf_thinker``. The weights depend only on ``seed`` and the shape.
    ``init_std`` (transformers' default 0.02) sets the spread of the random weights: larger gives peaked attention.
    """
    from transformers import Qwen2_5OmniForConditionalGeneration

    check_head_size("write_qwen25_omni", hidden_size, num_heads)
    config = _omni_config(num_layers=num_layers, hidden_size=hidden_size, num_heads=num_heads,
                          num_kv_heads=num_kv_heads, encoder_hidden_size=encoder_hidden_size, init_std=init_std)
    return save_checkpoint(directory, Qwen2_5OmniForConditionalGeneration, config, omni_processor(), seed=seed)


@dataclass(frozen=True)
class Qwen3OmniTokens:
    """Special token ids of Qwen3-Omni's tokenizer (Qwen3-Omni-30B-A3B's ``tokenizer_config.json`` / config)."""

    endoftext: int = 151643
    im_start: int = 151644
    im_end: int = 151645
    vision_start: int = 151652  # <|vision_start|>
    vision_end: int = 151653  # <|vision_end|>
    image: int = 151655  # <|image_pad|>
    video: int = 151656  # <|video_pad|>
    audio_start: int = 151669  # <|audio_start|>
    audio_end: int = 151670  # <|audio_end|>
    audio: int = 151675  # <|audio_pad|> (transformers' config default is 151646)
    vocab_size: int = 152064


QWEN3_OMNI_TOKENS = Qwen3OmniTokens()

_QWEN3_NAMES = [  # ids 151643.. in order; the thinker reads only the ones named in Qwen3OmniTokens
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>",
    "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>",
    "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>",
    "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>", "<think>",
    "</think>", "<|audio_start|>", "<|audio_end|>", "<tts_pad>", "<tts_text_bos>", "<tts_text_eod>",
    "<tts_text_bos_single>", "<|audio_pad|>",
]
_QWEN3_SPECIAL_TOKENS = {name: QWEN3_OMNI_TOKENS.endoftext + index for index, name in enumerate(_QWEN3_NAMES)}
_QWEN3_PROCESSOR_TOKENS = {  # the tokenizer attributes Qwen3OmniMoeProcessor reads
    "image_token": "<|image_pad|>", "audio_token": "<|audio_pad|>", "video_token": "<|video_pad|>",
    "vision_bos_token": "<|vision_start|>", "vision_eos_token": "<|vision_end|>",
    "audio_bos_token": "<|audio_start|>", "audio_eos_token": "<|audio_end|>",
}
PATCH_SIZE = 16
"""Qwen3-Omni's vision patch (the processor's and the encoder's): 32x32 pixels per merged token."""


def qwen3_omni_processor():
    """A ``Qwen3OmniMoeProcessor``: Whisper features (128 mel bins, 16 kHz), Qwen2-VL image and video processors with
    16-pixel patches, the tokenizer with Qwen3-Omni's special tokens. Frames are resized by the processor's defaults
    (``Qwen3OmniMoeProcessorKwargs``: 128 to 768 patches of 32x32 pixels), the video sampled at its default 1 fps."""
    from transformers import Qwen3OmniMoeProcessor, WhisperFeatureExtractor
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

    tokenizer = omni_tokenizer(_QWEN3_SPECIAL_TOKENS, _QWEN3_PROCESSOR_TOKENS)
    return Qwen3OmniMoeProcessor(
        image_processor=Qwen2VLImageProcessor(patch_size=PATCH_SIZE),
        video_processor=Qwen2VLVideoProcessor(patch_size=PATCH_SIZE),
        feature_extractor=WhisperFeatureExtractor(feature_size=128, sampling_rate=SAMPLE_RATE),
        tokenizer=tokenizer,
        chat_template=tokenizer.chat_template,
    )


def _qwen3_config(*, num_layers: int, hidden_size: int, num_heads: int, num_kv_heads: int, num_experts: int,
                  deepstack_layers: int, init_std: float):
    from transformers import Qwen3OmniMoeConfig

    from macer.tools.synthetic.qwen3_omni import qwen3_thinker_config

    tok = QWEN3_OMNI_TOKENS
    thinker = qwen3_thinker_config(num_layers=num_layers, hidden_size=hidden_size, num_heads=num_heads,
                                   num_kv_heads=num_kv_heads, num_experts=num_experts,
                                   deepstack_layers=deepstack_layers, vocab_size=tok.vocab_size).to_dict()
    thinker.update(audio_token_id=tok.audio, image_token_id=tok.image, video_token_id=tok.video,
                   audio_start_token_id=tok.audio_start, audio_end_token_id=tok.audio_end,
                   vision_start_token_id=tok.vision_start, vision_end_token_id=tok.vision_end,
                   user_token_id=872, initializer_range=init_std)
    thinker.pop("im_end_token_id", None)
    thinker["text_config"].update(eos_token_id=tok.im_end, pad_token_id=tok.endoftext, initializer_range=init_std,
                                  tie_word_embeddings=False)
    # transformers' Qwen3-Omni always interleaves the M-RoPE sections; vLLM does only when the config says
    # "mrope_interleaved" (as the published config does, beside "interleaved"). Without it vLLM rotates video rows
    # (t, h, w unequal) with the sections in blocks: other logits from the first layer on, same for audio and text.
    thinker["text_config"]["rope_parameters"]["mrope_interleaved"] = True
    # image_size and apply_vit_abs_pos_embed: read by vLLM's vision encoder, not declared by transformers' config.
    # vLLM sizes its position table (image_size / patch_size)^2, transformers num_position_embeddings: the published
    # 768 / 16 = 48 per side, 2304 entries; here sqrt(num_position_embeddings) per side.
    side = math.isqrt(thinker["vision_config"]["num_position_embeddings"])
    thinker["vision_config"].update(patch_size=PATCH_SIZE, initializer_range=init_std, image_size=side * PATCH_SIZE,
                                    apply_vit_abs_pos_embed=True)
    thinker["audio_config"]["initializer_range"] = init_std
    with quiet_transformers():  # the default talker config warns about its token ids; it is never built
        return Qwen3OmniMoeConfig(thinker_config=thinker, enable_audio_output=False, im_start_token_id=tok.im_start,
                                  im_end_token_id=tok.im_end, system_token_id=8948, user_token_id=872,
                                  assistant_token_id=77091)


def write_qwen3_omni(directory: str | Path, *, num_layers: int = 4, hidden_size: int = 128, num_heads: int = 4,
                     num_kv_heads: int = 2, num_experts: int = 4, deepstack_layers: int = 3, init_std: float = 0.05,
                     seed: int = 0) -> Path:
    """Write a random Qwen3-Omni checkpoint (fp32, talker off) with its processor files to ``directory``.

    Loads in vLLM as ``Qwen3OmniMoeThinkerForConditionalGeneration`` and in transformers through
    ``load_hf_qwen3_thinker``. Layer 0 has a dense MLP, the others ``num_experts`` experts (2 per token); the vision
    encoder has ``deepstack_layers`` blocks, each feeding a deepstack level added after decoder layer 0, 1, ....
    """
    from transformers import Qwen3OmniMoeForConditionalGeneration

    check_head_size("write_qwen3_omni", hidden_size, num_heads)
    config = _qwen3_config(num_layers=num_layers, hidden_size=hidden_size, num_heads=num_heads,
                           num_kv_heads=num_kv_heads, num_experts=num_experts, deepstack_layers=deepstack_layers,
                           init_std=init_std)
    return save_checkpoint(directory, Qwen3OmniMoeForConditionalGeneration, config, qwen3_omni_processor(), seed=seed)



WRITERS: dict[str, Callable[..., Path]] = {"qwen2_5_omni": write_qwen25_omni, "qwen3_omni": write_qwen3_omni}
"""The model families ``main`` writes, by the name its first argument takes."""


def main(argv: list[str] | None = None) -> int:
    """``python -m macer.testing_omni FAMILY DIR``: write that family's tiny checkpoint to ``DIR``."""
    parser = argparse.ArgumentParser(prog="python -m macer.testing_omni",
                                     description="Write a tiny random Qwen-Omni checkpoint with its processor files "
                                                 "(no download; random weights: not for answers).")
    parser.add_argument("family", choices=sorted(WRITERS), help="the model family")
    parser.add_argument("directory", type=Path, help="where to write it (created if missing)")
    parser.add_argument("--layers", type=int, default=4, help="decoder layers (default 4)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights (default 0)")
    args = parser.parse_args(argv)
    path = WRITERS[args.family](args.directory, num_layers=args.layers, seed=args.seed)
    print(f"wrote a {args.layers}-layer random {args.family} checkpoint to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
