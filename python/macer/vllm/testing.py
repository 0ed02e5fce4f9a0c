"""A tiny random ``Qwen2ForCausalLM`` checkpoint, a word-level tokenizer and synthetic audio/video prompts, built in
code, for the vLLM tests, the serving benchmark and the CPU recipe of docs/serving.md (no download).

* ``write_checkpoint(directory, ...)``: config + safetensors of a random Qwen2 decoder whose ``architectures`` names
  ``MacerQwen2ForCausalLM`` (the plugin's labelled architecture); the same directory loads in transformers as a plain
  ``Qwen2ForCausalLM``. Head size 32 by default: vLLM's CPU attention supports {32, 64, 80, ...} only.
* ``write_tokenizer(directory, vocab_size)``: a word-level tokenizer (one word per token id, ``word(i)``) with a chat
  template that lays a conversation out as ``clip_prompt`` does, so that chat requests work on the server.
* ``clip_prompt(...)``: prompt token ids laid out as a chat turn about a clip: a system line, an audio block and a
  video block of distinct ids drawn from ``AUDIO_IDS`` / ``VIDEO_IDS``, the question, ``<|im_end|>`` and the
  assistant header. The same ids label the rows on both sides: ``label_ids`` gives the labels the engine computes
  from the token-id sets, for ``macer.LabelledAdapter`` on the transformers side.
* ``drawn_clip_prompt(...)``: the same layout with audio/video ids drawn with replacement (a clip of any length,
  for memory and throughput measurements: ids may repeat, so scores may tie).
* ``admission(llm, prompts, params)``: every prompt submitted at once to an in-process engine; the most requests it
  ran at once before its first preemption, and its throughput (the KV-memory test and ``benchmarks/bench_vllm.py
  --admission``).
* ``MACER_SETTINGS``: the ``additional_config["macer"]`` entries that name these ids for the engine.
* ``python -m macer.vllm.testing DIR``: all of it in ``DIR`` (``write_demo``): ``checkpoint/``, ``tokenizer/``,
  ``additional_config.json`` and a chat request ``chat.json`` (docs/serving.md, "Try it on a CPU").

Distinct ids per row (not one placeholder id repeated) give every audio/video row its own embedding, so scores have
no exact ties and the engine and transformers pick the same rows whatever their rounding.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

from macer.core.policy import AUDIO, TEXT, VISUAL

__all__ = [
    "ARCHITECTURE",
    "AUDIO_IDS",
    "END_OF_TURN",
    "MACER_SETTINGS",
    "TOKENIZER_CONFIG",
    "VIDEO_IDS",
    "admission",
    "clip_prompt",
    "drawn_clip_prompt",
    "label_ids",
    "main",
    "word",
    "write_checkpoint",
    "write_demo",
    "write_tokenizer",
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

_SPECIAL = {0: "<pad>", _IM_START: "<|im_start|>", END_OF_TURN: "<|im_end|>", _NEWLINE: "<nl>", _SYSTEM: "system",
            _USER: "user", _ASSISTANT: "assistant"}
_WORDS = ("the a an and or but if so then when where what who how why this that these those it he she they we you "
          "dog cat bird car train rain sun moon river road house door window music voice song drum bell crowd "
          "man woman child speaks sings runs walks plays laughs opens closes falls rises red blue green loud quiet "
          "fast slow near far up down in on at before after while because yes no one two three many some is "
          "are").split()
assert len(set(_WORDS)) == len(_WORDS) >= len(_TEXT_IDS)  # one distinct word per text id

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
                         eos_token_id=END_OF_TURN, bos_token_id=_IM_START, pad_token_id=0, dtype="float32")
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


def drawn_clip_prompt(*, n_audio: int, n_video: int, question: int, seed: int = 0) -> list[int]:
    """``clip_prompt``'s layout with the audio/video ids drawn with replacement, so the blocks may be of any length."""
    if min(n_audio, n_video) < 0 or question < 1:
        raise ValueError(f"drawn_clip_prompt: n_audio and n_video must be >= 0 and question >= 1, got {n_audio}, "
                         f"{n_video}, {question}")
    generator = torch.Generator().manual_seed(seed)

    def draw(ids: range, count: int) -> list[int]:
        return [ids.start + int(i) for i in torch.randint(len(ids), (count,), generator=generator)]

    head = [_IM_START, _SYSTEM, _NEWLINE, *draw(_TEXT_IDS, 4), END_OF_TURN, _NEWLINE, _IM_START, _USER, _NEWLINE]
    tail = [END_OF_TURN, _NEWLINE, _IM_START, _ASSISTANT, _NEWLINE]
    return head + draw(AUDIO_IDS, n_audio) + draw(VIDEO_IDS, n_video) + draw(_TEXT_IDS, question) + tail


def admission(llm: Any, prompts: list[list[int]], params: Any, *, stop_at_preemption: bool = False) -> dict[str, Any]:
    """Submit every prompt at once to ``llm`` (a ``vllm.LLM`` whose engine core runs in this process:
    ``VLLM_ENABLE_V1_MULTIPROCESSING=0``) with sampling ``params`` and step the engine until every request finished
    (with ``stop_at_preemption``: until vLLM first preempts one; the rest are then aborted). Returns:

    * ``admitted``: the most requests running at once (after a ``schedule()``) before the first preemption;
    * ``preempted``: how many preemptions there were; ``num_blocks``: the engine's KV cache blocks;
    * ``finished``, ``output_tokens``, ``steps``, ``wall_s``: what completed, and how long it took.

    It reads the engine core's scheduler (``llm.llm_engine.engine_core.engine_core.scheduler``, vLLM 0.32's
    in-process engine) and counts its ``_preempt_request`` calls (private)."""
    engine = llm.llm_engine
    scheduler = engine.engine_core.engine_core.scheduler
    preempted: list[str] = []
    peak = [0]
    preempt, schedule = scheduler._preempt_request, scheduler.schedule

    def counted(request: Any, *args: Any, **kwargs: Any) -> Any:
        preempted.append(request.request_id)
        return preempt(request, *args, **kwargs)

    def watched(*args: Any, **kwargs: Any) -> Any:
        out = schedule(*args, **kwargs)
        if not preempted:
            peak[0] = max(peak[0], len(scheduler.running))
        return out

    scheduler._preempt_request, scheduler.schedule = counted, watched
    names = [f"admission-{i}" for i in range(len(prompts))]
    finished = tokens = steps = 0
    start = time.perf_counter()
    try:
        for name, prompt in zip(names, prompts, strict=True):
            engine.add_request(name, {"prompt_token_ids": prompt}, params)
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    finished += 1
                    tokens += len(out.outputs[0].token_ids)
            steps += 1
            if preempted and stop_at_preemption:
                engine.abort_request(names)
                break
    finally:
        del scheduler._preempt_request, scheduler.schedule  # the class's methods again
    return {"admitted": peak[0], "preempted": len(preempted),
            "num_blocks": scheduler.kv_cache_manager.block_pool.num_gpu_blocks, "finished": finished,
            "output_tokens": tokens, "steps": steps, "wall_s": time.perf_counter() - start}


def label_ids(ids: list[int] | torch.Tensor) -> torch.Tensor:
    """``[N]`` int64 modality labels of prompt ids (``AUDIO`` for ``AUDIO_IDS``, ``VISUAL`` for ``VIDEO_IDS``)."""
    ids = torch.as_tensor(ids, dtype=torch.long)
    labels = torch.full_like(ids, TEXT)
    labels[(ids >= AUDIO_IDS.start) & (ids < AUDIO_IDS.stop)] = AUDIO
    labels[(ids >= VIDEO_IDS.start) & (ids < VIDEO_IDS.stop)] = VISUAL
    return labels


def word(token_id: int) -> str:
    """The word of ``token_id`` in ``write_tokenizer``'s vocabulary: the chat markers, English words for the text ids,
    ``<audio_k>`` / ``<video_k>`` for the audio and video ids, ``<unused_i>`` for the rest."""
    if token_id in _SPECIAL:
        return _SPECIAL[token_id]
    if token_id in _TEXT_IDS:
        return _WORDS[token_id - _TEXT_IDS.start]
    if token_id in AUDIO_IDS:
        return f"<audio_{token_id - AUDIO_IDS.start}>"
    if token_id in VIDEO_IDS:
        return f"<video_{token_id - VIDEO_IDS.start}>"
    return f"<unused_{token_id}>"


CHAT_TEMPLATE = ("{% for message in messages %}<|im_start|> {{ message['role'] }} <nl> {{ message['content'] }} "
                 "<|im_end|> <nl> {% endfor %}{% if add_generation_prompt %}<|im_start|> assistant <nl>{% endif %}")
"""Renders a conversation as ``clip_prompt`` lays it out (words separated by spaces)."""


TOKENIZER_CONFIG = {"model_type": "llama"}
"""The tokenizer folder's ``config.json``. vLLM parses a config in the folder given as ``--tokenizer`` (without one it
logs 4 ERROR lines and retries for seconds); transformers registers no tokenizer class for ``llama`` (in 5.x), so
``AutoTokenizer`` takes ``tokenizer_config.json``'s. A Qwen2 config there would make it a Qwen2 tokenizer."""


def write_tokenizer(directory: str | Path, vocab_size: int) -> Path:
    """A word-level tokenizer (``tokenizer.json`` + ``tokenizer_config.json`` with ``CHAT_TEMPLATE``, and
    ``TOKENIZER_CONFIG`` as ``config.json``) whose token ``i`` is ``word(i)``, split on whitespace; written to
    ``directory`` (keep it apart from the checkpoint: beside a Qwen2 ``config.json`` transformers would load it as a
    Qwen2 tokenizer). Needs the ``tokenizers`` package."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(models.WordLevel({word(i): i for i in range(vocab_size)}, unk_token="<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "pad_token": "<pad>",
        "bos_token": None, "unk_token": "<pad>", "model_max_length": 4096, "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE}, indent=2))
    (path / "config.json").write_text(json.dumps(TOKENIZER_CONFIG))
    return path


DEMO_SETTINGS: dict[str, Any] = {"policy": "macer", "keep_ratio": 0.25, "audio_layer": 2, "video_layer": 3}
"""The demo's policy (``write_demo``): MACER keeping a quarter of the audio/video tokens of a 4-layer model."""


def write_demo(directory: str | Path, *, max_tokens: int = 8, seed: int = 2) -> dict[str, Path]:
    """Everything the CPU recipe of docs/serving.md serves, in ``directory``: a 4-layer ``checkpoint/``, its
    ``tokenizer/``, ``additional_config.json`` (``{"macer": DEMO_SETTINGS + MACER_SETTINGS}``) and ``chat.json``, a
    greedy chat request about a clip of 24 audio and 64 video tokens whose prompt is ``clip_prompt(seed=seed)``.
    Returns the paths by name."""
    root = Path(directory)
    checkpoint = write_checkpoint(root / "checkpoint", num_layers=4)
    vocab_size = json.loads((checkpoint / "config.json").read_text())["vocab_size"]
    tokenizer = write_tokenizer(root / "tokenizer", vocab_size)
    settings = root / "additional_config.json"
    settings.write_text(json.dumps({"macer": {**DEMO_SETTINGS, **MACER_SETTINGS}}))
    ids = clip_prompt(n_audio=24, n_video=64, question=8, seed=seed)
    # clip_prompt's layout: 3 ids of system header, 4 of system text, then <|im_end|> <nl> <|im_start|> user <nl>;
    # the user's content runs to the 5-id tail (<|im_end|> <nl> <|im_start|> assistant <nl>).
    messages = [{"role": "system", "content": " ".join(word(i) for i in ids[3:7])},
                {"role": "user", "content": " ".join(word(i) for i in ids[12:-5])}]
    chat = root / "chat.json"
    chat.write_text(json.dumps({"model": "tiny", "messages": messages, "max_tokens": max_tokens, "temperature": 0.0},
                               indent=2))
    return {"checkpoint": checkpoint, "tokenizer": tokenizer, "additional_config": settings, "chat": chat}


def main(argv: list[str] | None = None) -> int:
    """``python -m macer.vllm.testing DIR``: ``write_demo(DIR)``, then say what was written."""
    parser = argparse.ArgumentParser(prog="python -m macer.vllm.testing", description=(
        "Write a tiny random Qwen2 checkpoint (MacerQwen2ForCausalLM), a word-level tokenizer with a chat template, "
        "the MACER settings naming its audio/video token ids, and a chat request about a synthetic clip: what the "
        "CPU recipe of docs/serving.md serves."))
    parser.add_argument("directory", type=Path, help="where to write them (created if missing)")
    args = parser.parse_args(argv)
    paths = write_demo(args.directory)
    for name, path in paths.items():
        print(f"{name + ':':19} {path}")
    print("next: start the server and send chat.json (docs/serving.md, 'Try it on a CPU')")
    return 0


if __name__ == "__main__":
    sys.exit(main())
