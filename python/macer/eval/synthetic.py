"""A tiny random Qwen2.5-Omni checkpoint and a tiny Daily-Omni-format release, made in code (no download).

For smoke-testing the whole evaluation path (``macer.eval.prepare`` -> lmms-eval -> ``macer_qwen2_5_omni``) on a
machine without weights or data; the tests use them, and ``docs/evaluation.md`` shows the command. The answers of a
random model are random: these exercise the plumbing, not accuracy.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np

__all__ = ["QWEN2_VL_PREPROCESSOR", "build_tokenizer", "write_checkpoint", "write_clip", "write_dailyomni_release"]

_SPECIAL = ("endoftext", "im_start", "im_end", "audio", "audio_start", "audio_end", "vision_start", "vision_end",
            "image", "video")
_SPECIAL_TEXT = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|AUDIO|>", "<|audio_bos|>", "<|audio_eos|>",
                 "<|vision_bos|>", "<|vision_eos|>", "<|IMAGE|>", "<|VIDEO|>")


def build_tokenizer():
    """A byte-level tokenizer whose special tokens have the ids of ``macer.testing.SYNTHETIC_TOKENS`` and whose
    256 byte symbols follow from ``first_ordinary`` (a vocabulary of 272 ids), with the Qwen2.5-Omni processor's
    named special tokens (``video_token``, ``audio_bos_token``, ...)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from macer.tools.synthetic.qwen2_5_omni import SYNTHETIC_TOKENS

    ids = {"endoftext": 0, **{name: getattr(SYNTHETIC_TOKENS, name) for name in _SPECIAL[1:]}}
    vocab = {text: ids[name] for name, text in zip(_SPECIAL, _SPECIAL_TEXT)}
    for i, symbol in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet())):
        vocab[symbol] = SYNTHETIC_TOKENS.first_ordinary + i
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in _SPECIAL_TEXT])
    names = ("image_token", "audio_token", "video_token", "vision_bos_token", "vision_eos_token", "audio_bos_token",
             "audio_eos_token")
    texts = ("<|IMAGE|>", "<|AUDIO|>", "<|VIDEO|>", "<|vision_bos|>", "<|vision_eos|>", "<|audio_bos|>",
             "<|audio_eos|>")
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   extra_special_tokens=dict(zip(names, texts)))


QWEN2_VL_PREPROCESSOR = {
    "image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen2_5OmniProcessor",
    "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711],
    "min_pixels": 56 * 56, "max_pixels": 28 * 28 * 16384, "patch_size": 14, "temporal_patch_size": 2, "merge_size": 2,
}
"""The image/video keys of Qwen2.5-Omni's ``preprocessor_config.json`` (beside the Whisper keys): transformers reads
the checkpoint's image and video processors from them (``video_frontend="hf"``)."""


def write_checkpoint(path: str | Path, *, num_layers: int = 4, seed: int = 0) -> Path:
    """Save a random ``macer.testing.build_thinker`` (vocabulary 272), the tokenizer, a Whisper feature extractor
    (128 mel bins) and the Qwen2-VL image/video settings (``QWEN2_VL_PREPROCESSOR``) to ``path``: a folder that
    ``Qwen2_5OmniThinkerForConditionalGeneration.from_pretrained`` and ``macer.eval.media.build_processor`` load
    with either video frontend, as a real checkpoint (``hf`` needs torchvision)."""
    from transformers import WhisperFeatureExtractor

    from macer.tools.synthetic.qwen2_5_omni import build_thinker

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    build_thinker(num_layers=num_layers, vocab_size=272, seed=seed).save_pretrained(path)
    build_tokenizer().save_pretrained(path)
    WhisperFeatureExtractor(feature_size=128).save_pretrained(path)
    # One preprocessor_config.json with the audio and the vision keys, the layout of the released checkpoints:
    # without the vision keys, transformers cannot tell which image processor the folder has (video_frontend=hf).
    config = path / "preprocessor_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), **QWEN2_VL_PREPROCESSOR}, indent=2) + "\n")
    return path


def write_clip(path: str | Path, *, seconds: float = 2.0, fps: int = 8, size: tuple[int, int] = (64, 48),
               audio: bool = True, seed: int = 0) -> Path:
    """An MP4 (MPEG-4 video, AAC audio at 16 kHz mono) of moving random blocks and a tone with noise (PyAV)."""
    import av

    rng = np.random.default_rng(seed)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    width, height = size
    with av.open(str(path), mode="w") as container:
        video = container.add_stream("mpeg4", rate=fps)
        video.width, video.height, video.pix_fmt = width, height, "yuv420p"
        sound = container.add_stream("aac", rate=16000, layout="mono") if audio else None
        base = rng.integers(0, 255, (height, width, 3), dtype=np.uint8)
        for i in range(int(seconds * fps)):
            frame = np.roll(base, 3 * i, axis=1)
            for packet in video.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in video.encode():
            container.mux(packet)
        if sound is not None:
            t = np.arange(int(seconds * 16000)) / 16000
            wave = (0.3 * np.sin(2 * np.pi * (220 + 110 * seed) * t) + 0.05 * rng.standard_normal(t.size))
            samples = wave.astype(np.float32).reshape(1, -1)
            step = 1024
            for start in range(0, samples.shape[1], step):
                frame = av.AudioFrame.from_ndarray(samples[:, start:start + step].copy(), format="flt",
                                                   layout="mono")
                frame.sample_rate = 16000
                frame.pts = start
                for packet in sound.encode(frame):
                    container.mux(packet)
            for packet in sound.encode():
                container.mux(packet)
    return path


def write_dailyomni_release(root: str | Path, *, questions: int = 3, seconds: float | Sequence[float] = 2.0) -> Path:
    """A Daily-Omni-shaped release under ``root``: ``qa.json`` and ``Videos/<id>/<id>_video.mp4`` (one clip per
    question, each with an audio track). ``seconds``: every clip's length, or one length per question (clips of
    different lengths give prompts of different lengths, as a batch test needs)."""
    root = Path(root)
    lengths = [float(seconds)] * questions if isinstance(seconds, (int, float)) else [float(s) for s in seconds]
    if len(lengths) != questions:
        raise ValueError(f"write_dailyomni_release: seconds must be one length or {questions} lengths (one per "
                         f"question), got {len(lengths)}")
    entries = []
    for i, length in enumerate(lengths):
        video_id = f"clip{i:03d}"
        write_clip(root / "Videos" / video_id / f"{video_id}_video.mp4", seconds=length, seed=i)
        entries.append({"Question": f"What sound is heard in clip {i}?",
                        "Choice": ["A. a tone", "B. speech", "C. music", "D. silence"],
                        "Answer": "ABCD"[i % 4], "video_id": video_id, "Type": "Event Sequence",
                        "video_category": "synthetic", "video_duration": "30s"})
    (root / "qa.json").write_text(json.dumps(entries, indent=1), encoding="utf-8")
    return root
