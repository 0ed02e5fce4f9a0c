"""A tiny random ``Qwen2ForCausalLM`` checkpoint and synthetic audio/video prompts, built in code, for the vLLM tests
and the serving benchmark (no download, no tokenizer files).

* ``write_checkpoint(directory, ...)``: config + safetensors of a random Qwen2 decoder whose ``architectures`` names
  ``MacerQwen2ForCausalLM`` (the plugin's labelled architecture); the same directory loads in transformers as a plain
  ``Qwen2ForCausalLM``. Head size 32 by default: vLLM's CPU attention supports {32, 64, 80, ...} only.
* ``clip_prompt(...)``: prompt token ids laid out as a chat turn about a clip: a system line, an audio block and a
  video block of distinct ids drawn from ``AUDIO_IDS`` / ``VIDEO_IDS``, the question, ``<|im_end|>`` and the
  assistant header. The same ids label the rows on both sides: ``label_ids`` gives the labels the engine computes
  from the token-id sets, for ``macer.LabelledAdapter`` on the transformers side.
* ``MACER_SETTINGS``: the ``additional_config["macer"]`` entries that name these ids for the engine.

Distinct ids per row (not one placeholder id repeated) give every audio/video row its own embedding, so scores have
no exact ties and the engine and transformers pick the same rows whatever their rounding.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from macer.core.policy import AUDIO, TEXT, VISUAL

__all__ = [
    "ARCHITECTURE",
    "AUDIO_IDS",
    "END_OF_TURN",
    "MACER_SETTINGS",
    "VIDEO_IDS",
    "clip_prompt",
    "label_ids",
    "write_checkpoint",
]

ARCHITECTURE = "MacerQwen2ForCausalLM"
END_OF_TURN = 2
"""The synthetic ``<|im_end|>``: closes the user's question (``end_of_turn_token_id``)."""
AUDIO_IDS = range(100, 228)
"""Token ids that stand for audio rows (one per audio frame of the synthetic clip)."""
VIDEO_IDS = range(228, 484)
"""Token ids that stand for video rows."""
_TEXT_IDS = range(16, 100)
_IM_START, _NEWLINE, _SYSTEM, _USER, _ASSISTANT = 1, 10, 11, 12, 13

MACER_SETTINGS: dict[str, Any] = {
    "audio_token_ids": list(AUDIO_IDS),
    "video_token_ids": list(VIDEO_IDS),
    "end_of_turn_token_id": END_OF_TURN,
}
"""``additional_config["macer"]`` entries naming the synthetic ids (add ``policy``, ``keep_ratio``, layers)."""


def write_checkpoint(directory: str | Path, *, num_layers: int = 6, hidden_size: int = 128, num_heads: int = 4,
                     num_kv_heads: int = 2, intermediate_size: int = 256, vocab_size: int = 512, seed: int = 0,
                     init_std: float = 0.08, architecture: str = ARCHITECTURE) -> Path:
    """Write a random Qwen2 decoder (fp32 safetensors + ``config.json``) to ``directory``; returns its path.

    ``init_std`` is larger than transformers' 0.02 so that the random model's attention is peaked rather than
    uniform: near-uniform attention makes near-equal scores, and the test compares selections exactly.
    """
    from transformers import Qwen2Config, Qwen2ForCausalLM

    if hidden_size % num_heads or (hidden_size // num_heads) not in (32, 64, 80, 96, 112, 128):
        raise ValueError(f"write_checkpoint: hidden_size / num_heads must be a head size vLLM's CPU attention "
                         f"supports (32, 64, 80, 96, 112, 128), got {hidden_size} / {num_heads}")
    if vocab_size <= max(VIDEO_IDS):
        raise ValueError(f"write_checkpoint: vocab_size must exceed the synthetic video ids (> {max(VIDEO_IDS)}), "
                         f"got {vocab_size}")
    config = Qwen2Config(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
                         num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
                         max_position_embeddings=4096, initializer_range=init_std, tie_word_embeddings=False,
                         eos_token_id=END_OF_TURN, bos_token_id=_IM_START, pad_token_id=0, torch_dtype="float32")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config).eval()
    path = Path(directory)
    model.save_pretrained(path, safe_serialization=True)
    config_file = path / "config.json"
    saved = json.loads(config_file.read_text())
    saved["architectures"] = [architecture]
    config_file.write_text(json.dumps(saved, indent=2))
    return path


def clip_prompt(*, n_audio: int = 24, n_video: int = 64, question: int = 8, seed: int = 0) -> list[int]:
    """Prompt ids of one chat turn about a clip: ``<|im_start|>system\\n`` + 4 text ids, ``<|im_end|>\\n
    <|im_start|>user\\n``, ``n_audio`` audio ids, ``n_video`` video ids, ``question`` text ids, ``<|im_end|>\\n
    <|im_start|>assistant\\n``. Audio and video ids are distinct within the prompt (drawn from ``seed``)."""
    if not 0 <= n_audio <= len(AUDIO_IDS) or not 0 <= n_video <= len(VIDEO_IDS):
        raise ValueError(f"clip_prompt: n_audio must be in [0, {len(AUDIO_IDS)}] and n_video in [0, "
                         f"{len(VIDEO_IDS)}], got {n_audio} and {n_video}")
    if question < 1:
        raise ValueError(f"clip_prompt: question must be >= 1 token, got {question}")
    generator = torch.Generator().manual_seed(seed)

    def draw(ids: range, count: int) -> list[int]:
        return [ids[int(i)] for i in torch.randperm(len(ids), generator=generator)[:count]]

    def text(count: int) -> list[int]:
        return [_TEXT_IDS[int(i)] for i in torch.randint(len(_TEXT_IDS), (count,), generator=generator)]

    head = [_IM_START, _SYSTEM, _NEWLINE, *text(4), END_OF_TURN, _NEWLINE, _IM_START, _USER, _NEWLINE]
    tail = [END_OF_TURN, _NEWLINE, _IM_START, _ASSISTANT, _NEWLINE]
    return head + draw(AUDIO_IDS, n_audio) + draw(VIDEO_IDS, n_video) + text(question) + tail


def label_ids(ids: list[int] | torch.Tensor) -> torch.Tensor:
    """``[N]`` int64 modality labels of prompt ids (``AUDIO`` for ``AUDIO_IDS``, ``VISUAL`` for ``VIDEO_IDS``)."""
    ids = torch.as_tensor(ids, dtype=torch.long)
    labels = torch.full_like(ids, TEXT)
    labels[(ids >= AUDIO_IDS.start) & (ids < AUDIO_IDS.stop)] = AUDIO
    labels[(ids >= VIDEO_IDS.start) & (ids < VIDEO_IDS.stop)] = VISUAL
    return labels
