"""Tiny random Qwen-Omni thinker checkpoints and real multimodal inputs, built in code (no download), for the vLLM
tests of the real thinker architectures (``test_omni_baseline.py``).

* ``write_qwen25_omni(directory, ...)``: a full ``Qwen2_5OmniConfig`` checkpoint as the published ones are laid out
  (``config.json`` with the thinker's config, the talker off; ``model.safetensors`` with the thinker's weights under
  ``thinker.``; the processor's files: ``tokenizer.json``, ``tokenizer_config.json``, ``processor_config.json``, the
  chat template). The thinker has the real architecture (audio encoder, vision encoder, Qwen2 language model
  with M-RoPE) at tiny sizes, and the real vocabulary size and special token ids (``QWEN25_OMNI_TOKENS``), so vLLM's
  own processor for the model expands the placeholders as it does for Qwen2.5-Omni-7B.
* ``omni_tokenizer()``: the tokenizer of that checkpoint: byte-level BPE whose 256 byte tokens have Qwen2's ids
  (``"\\n"`` is 198), filler entries up to 151642, and the real special tokens at their real ids. No merges: text is
  one token per byte.
* ``waveform(...)``, ``video_frames(...)``: a 16 kHz mono ``float32`` waveform and ``uint8`` RGB frames, what a user
  decodes from a file; ``wav_data_url(...)``, ``video_data_url(...)`` (optionally with the waveform as its sound
  track): the same as ``data:`` URLs for the chat API's ``audio_url`` / ``video_url`` parts, lossless but for the
  WAV's rounding to 16 bits (``pcm16``).
* ``chat_prompt(processor, content)``: the prompt text of one user turn (the checkpoint's chat template), with the
  generation prompt.
* ``load_hf_thinker(path)``: transformers' thinker with the checkpoint's weights.
* ``check_head_size``, ``save_checkpoint``, ``quiet_transformers``: what ``write_qwen25_omni`` and
  ``qwen3_omni_checkpoints.write_qwen3_omni`` share (the head-size check, seeded weights and the files written,
  transformers' warnings silenced).
* ``vllm_interleaved_positions`` / ``vllm_positions``: vLLM 0.32.0's M-RoPE positions of a Qwen2.5-Omni prompt with
  interleaved audio (one token off against transformers'), and transformers' thinker run with them.

vLLM's CPU attention takes head sizes 32, 64, 80, 96, 112, 128 only (the language model's head size is 32 by default).
"""

from __future__ import annotations

import base64
import contextlib
import io
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
import torch

__all__ = [
    "CHAT_TEMPLATE",
    "QWEN25_OMNI_TOKENS",
    "SAMPLE_RATE",
    "chat_prompt",
    "chat_template",
    "check_head_size",
    "load_hf_thinker",
    "omni_processor",
    "omni_tokenizer",
    "pcm16",
    "quiet_transformers",
    "save_checkpoint",
    "video_data_url",
    "video_frames",
    "vllm_interleaved_positions",
    "vllm_positions",
    "wav_data_url",
    "waveform",
    "write_qwen25_omni",
]

SAMPLE_RATE = 16_000
"""The Whisper feature extractor's sampling rate (Qwen2.5-Omni's audio input)."""


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
    from macer.testing import thinker_config
    from transformers import Qwen2_5OmniConfig

    tok = QWEN25_OMNI_TOKENS
    thinker = thinker_config(num_layers=num_layers, hidden_size=hidden_size, num_heads=num_heads,
                             num_kv_heads=num_kv_heads, vocab_size=tok.vocab_size,
                             encoder_hidden_size=encoder_hidden_size).to_dict()
    # The real token ids (macer.testing's thinker remaps them into a small vocabulary).
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


def load_hf_thinker(path: str | Path, *, attn_implementation: str = "sdpa"):
    """transformers' ``Qwen2_5OmniThinkerForConditionalGeneration`` with the checkpoint's ``thinker.`` weights, fp32,
    in eval mode (every key must match both ways). ``Qwen2_5OmniForConditionalGeneration.from_pretrained`` would
    also want the talker's speaker file, ``spk_dict.pt``, which a thinker-only checkpoint has no use for."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, Qwen2_5OmniThinkerForConditionalGeneration

    with quiet_transformers():  # the unused talker config's default token ids lie outside its vocabulary
        config = AutoConfig.from_pretrained(path).thinker_config
    config._attn_implementation = attn_implementation
    for sub in (config.text_config, config.audio_config, config.vision_config):
        sub._attn_implementation = attn_implementation
    model = Qwen2_5OmniThinkerForConditionalGeneration(config)  # not on "meta": its rotary buffers are not saved
    prefix = "thinker."
    weights = {key[len(prefix):]: value for key, value in load_file(Path(path) / "model.safetensors").items()
               if key.startswith(prefix)}
    model.load_state_dict(weights, strict=True)
    return model.float().eval()


def waveform(seconds: float, *, seed: int = 0) -> np.ndarray:
    """A 16 kHz mono ``float32`` waveform of ``seconds`` seconds in [-1, 1]: a few tones and noise, distinct per
    ``seed`` (so two clips give two different encodings)."""
    rng = np.random.default_rng(seed)
    t = np.arange(round(seconds * SAMPLE_RATE)) / SAMPLE_RATE
    tones = sum(rng.uniform(0.1, 0.3) * np.sin(2 * np.pi * rng.uniform(100, 4000) * t) for _ in range(3))
    return np.clip(tones + 0.05 * rng.standard_normal(t.shape), -1, 1).astype(np.float32)


def video_frames(num_frames: int, *, height: int = 112, width: int = 112, seed: int = 0) -> np.ndarray:
    """``[num_frames, height, width, 3]`` ``uint8`` RGB frames: a smooth random image drifting over time plus
    noise, distinct per ``seed``."""
    rng = np.random.default_rng(seed)
    base = rng.uniform(0, 255, size=(height // 8 + 2, width // 8 + 2, 3))
    frames = []
    for index in range(num_frames):
        shifted = np.roll(base, index, axis=1)
        big = np.kron(shifted, np.ones((8, 8, 1)))[:height, :width]
        frames.append(np.clip(big + rng.normal(0, 8, big.shape), 0, 255))
    return np.stack(frames).astype(np.uint8)


def wav_data_url(samples: np.ndarray) -> str:
    """``samples`` (16 kHz mono float) as a ``data:audio/wav;base64,...`` URL of 16-bit PCM WAV."""
    import wave

    pcm = _pcm16_ints(samples)
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(SAMPLE_RATE)
        out.writeframes(pcm.tobytes())
    return "data:audio/wav;base64," + base64.b64encode(buffer.getvalue()).decode()


def video_data_url(frames: np.ndarray, *, fps: float = 2.0, audio: np.ndarray | None = None) -> str:
    """``frames`` (``[T, H, W, 3]`` uint8 RGB) at ``fps`` frames per second, with ``audio`` (a 16 kHz mono waveform)
    as its sound track if given, as a ``data:video/x-matroska;base64,...`` URL. Lossless: FFV1 video (RGB) and 32-bit
    float PCM audio, so vLLM decodes back exactly ``frames`` (OpenCV) and ``audio`` as ``float32`` (PyAV). Written
    with PyAV (``av``, the audio decoder of vLLM's ``audio`` extra).

    Not 16-bit PCM: vLLM 0.32.0's ``load_audio_pyav`` (``vllm/multimodal/media/audio.py``) returns a sound track it
    does not resample as ``frame.to_ndarray().astype(float32)``, which for integer sample formats is the raw integers
    (16-bit PCM decodes to values up to 32767, not [-1, 1]); float formats (``flt``, ``fltp``: AAC, MP3, Opus, float
    PCM) come back as they are."""
    import av

    if frames.ndim != 4 or frames.shape[-1] != 3 or frames.dtype != np.uint8:
        raise ValueError(f"video_data_url: frames must be [T, H, W, 3] uint8, got {frames.shape} {frames.dtype}")
    buffer = io.BytesIO()
    with av.open(buffer, "w", format="matroska") as container:
        video = container.add_stream("ffv1", rate=Fraction(fps).limit_denominator(1000))
        video.width, video.height, video.pix_fmt = frames.shape[2], frames.shape[1], "bgr0"
        sound = None
        if audio is not None:
            sound = container.add_stream("pcm_f32le", rate=SAMPLE_RATE)
            sound.layout = "mono"
        for frame in frames:
            container.mux(video.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(video.encode())
        if sound is not None:
            samples = av.AudioFrame.from_ndarray(np.asarray(audio, dtype=np.float32)[None, :], format="flt",
                                                 layout="mono")
            samples.sample_rate = SAMPLE_RATE
            container.mux(sound.encode(samples))
            container.mux(sound.encode())
    return "data:video/x-matroska;base64," + base64.b64encode(buffer.getvalue()).decode()


def _pcm16_ints(samples: np.ndarray) -> np.ndarray:
    # x * 32768, the inverse of the decoders' int / 32768, so that pcm16 of pcm16 samples changes nothing.
    return np.clip(np.round(np.asarray(samples, dtype=np.float64) * 32768), -32768, 32767).astype("<i2")


def pcm16(samples: np.ndarray) -> np.ndarray:
    """``samples`` as a decoder gives them back from 16-bit PCM (``wav_data_url``): ``float32`` multiples of
    1/32768."""
    return _pcm16_ints(samples).astype(np.float32) / 32768


def vllm_interleaved_positions(positions: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """The M-RoPE positions vLLM 0.32.0 gives a Qwen2.5-Omni prompt, from transformers' ``get_rope_index`` positions
    ``[3, N]`` of the same ``input_ids`` ``[N]``: they differ in every video whose audio is interleaved
    (``use_audio_in_video=True``), the span ``<|vision_bos|><|audio_bos|> X_1 .. X_K <|audio_eos|><|vision_eos|>``.

    transformers (the Qwen reference) gives ``<|vision_bos|>`` and ``<|audio_bos|>`` one position ``p``, the K
    interleaved media tokens their time-aligned positions ``m_1 .. m_K`` (built from ``p + 1``), and
    ``<|audio_eos|>``, ``<|vision_eos|>`` one position ``q = max + 1``. vLLM's ``get_mrope_input_positions``
    (``vllm/model_executor/models/qwen2_5_omni_thinker.py``) starts the video item's positions at its placeholder
    offset, which is ``<|audio_bos|>`` (the prompt update is ``[<|audio_bos|>, X.., <|audio_eos|>]``), but
    ``_compute_interleaved_positions`` returns positions for the K media tokens only: ``<|audio_bos|>`` gets ``m_1``,
    ``X_i`` gets ``m_(i+1)``, and from ``X_K`` on the tokens count as text: ``X_K`` gets ``q``, ``<|audio_eos|>``
    ``q + 1``, ``<|vision_eos|>`` ``q + 2``, and every later token two more than in transformers (per such video).
    Without an interleaved video the two agree (tested).
    """
    tok = QWEN25_OMNI_TOKENS
    ids = input_ids.tolist()
    result = positions.clone()
    shift = 0  # what vLLM adds, after the spans seen so far, to transformers' positions
    for start in (k for k in range(1, len(ids)) if ids[k] == tok.audio_start and ids[k - 1] == tok.vision_start):
        end = ids.index(tok.audio_end, start)  # <|audio_eos|>
        media = end - start - 1
        result[:, start:start + media] = positions[:, start + 1:end] + shift
        text_from = int(result[:, :start + media].max()) + 1
        result[:, start + media:end + 2] = text_from + torch.arange(3)  # X_K, <|audio_eos|>, <|vision_eos|>
        shift = text_from + 3 - (int(positions[0, end]) + 1)
        result[:, end + 2:] = positions[:, end + 2:] + shift
    return result


@contextlib.contextmanager
def vllm_positions(thinker: Any):
    """Within the block, transformers' ``thinker`` computes its M-RoPE positions as vLLM 0.32.0 does
    (``vllm_interleaved_positions``) for prefills and, through its ``rope_deltas``, decode steps; the rest of its
    forward is untouched. Batch size 1."""
    original = thinker.get_rope_index

    def get_rope_index(input_ids: torch.Tensor, *args: Any, **kwargs: Any):
        positions, deltas = original(input_ids, *args, **kwargs)
        if input_ids.shape[0] != 1:
            raise ValueError("vllm_positions: batch size 1 only")
        shifted = vllm_interleaved_positions(positions[:, 0], input_ids[0])[:, None]
        return shifted, torch.full_like(deltas, int(shifted.max()) + 1 - input_ids.shape[1])

    thinker.get_rope_index = get_rope_index
    try:
        yield thinker
    finally:
        del thinker.get_rope_index


def chat_prompt(processor: Any, content: list[dict[str, Any]] | str) -> str:
    """The prompt text of one user turn with ``content`` (chat parts or a string), from the checkpoint's chat
    template, ending with the assistant header."""
    return processor.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                         add_generation_prompt=True)
