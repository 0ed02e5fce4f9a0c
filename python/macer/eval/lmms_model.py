"""``--model macer_qwen2_5_omni``: Qwen2.5-Omni's thinker under any ``macer`` policy, as an lmms-eval model.

Imported by lmms-eval only (through the ``lmms_eval.models`` entry point, ``macer.eval.registry``); importing it
imports lmms_eval. See ``docs/evaluation.md`` for the commands and the meaning of every model argument.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from lmms_eval.api.instance import Instance
from lmms_eval.api.model import lmms
from loguru import logger

from macer.eval.media import VIDEO_FRONTENDS, build_processor, read_clip
from macer.eval.policy import describe_policy, resolve_policy
from macer.tools.batching import batch_inputs

__all__ = ["PAPER_FRAME_DEFAULTS", "MacerQwen2_5Omni", "parse_batch_size"]

PAPER_FRAME_DEFAULTS = {"num_frames": 12, "max_pixels": 336 * 336}
"""The paper's model-side video sampling (Appendix A.2): 12 frames uniformly over the clip, each resized to at most
336 x 336 pixels (24 x 24 patches of 14 px, 144 LLM tokens per 2-frame group), so a square clip gives
``n_v = 6 * 144 = 864`` video tokens; audio is the whole track of the file (about 25 tokens per second)."""

SYSTEM_PROMPT = ("You are Qwen, a virtual human developed by the Qwen Team, Alibaba Group, capable of perceiving "
                 "auditory and visual inputs, as well as generating text and speech.")
"""Qwen2.5-Omni's default system prompt (the one its model card requires for audio-visual input)."""

def parse_batch_size(value: int | str) -> int:
    """lmms-eval's ``--batch_size`` (an int, or the command line's string) -> an integer >= 1.

    ``auto`` / ``auto:N`` (lmms-eval's search for the largest batch that fits in memory) are refused: a prompt's
    memory here depends on its clip (audio length, frame size), so a size found on the first batch does not hold for
    the next; pick N by hand."""
    text = str(value).strip()
    if isinstance(value, bool) or not (isinstance(value, int) or (text.isascii() and text.isdigit())) or int(text) < 1:
        raise ValueError(f"macer_qwen2_5_omni: batch_size must be an integer >= 1, got {value!r}"
                         + (" (lmms-eval's 'auto' / 'auto:N' are not supported: give --batch_size N)"
                            if text.startswith("auto") else ""))
    return int(text)


class MacerQwen2_5Omni(lmms):
    """Qwen2.5-Omni thinker + ``macer.compress(model, policy)`` around every ``generate``.

    Model arguments (``--model_args k=v,...``): ``pretrained`` (checkpoint folder or hub id), ``policy`` (a name of
    ``macer.POLICY_NAMES``, default ``macer``), ``device`` (default ``cuda`` when available), ``dtype`` (``auto``:
    bfloat16 on CUDA, float32 on CPU), ``attn_implementation`` (default ``sdpa``), ``num_frames`` and
    ``max_pixels`` (``PAPER_FRAME_DEFAULTS``), ``video_frontend`` (``auto``/``hf``/``torch``, see
    ``macer.eval.media``), ``system_prompt``, ``sample_log`` (JSONL file, one line per sample with the policy's
    budget and kept counts, and the policy object that ran: ``policy_class``, ``policy_fields``; default
    ``macer_samples.jsonl``). Every other argument is a field of the policy (``keep_ratio``, ``audio_share``,
    ``audio_layer``, ``video_layer``, ``coverage_weight``, ``layer``, ``seed``, ...:
    ``macer.eval.policy.policy_fields``); one the policy does not take is refused by name.
    ``batch_size`` (lmms-eval's ``--batch_size``): up to that many consecutive requests with equal generation
    arguments run as one left-padded ``generate`` (each prompt pruned as if alone, so greedy answers and kept counts
    equal batch size 1); an integer >= 1, lmms-eval's ``auto`` forms are refused.

    The video's audio track is always used (``load_audio_from_video=True``, ``use_audio_in_video=True``); a clip
    without an audio track is refused. A failing generation raises: no sample is ever answered with an empty string
    because of an error.
    """

    is_simple = True

    def __init__(
        self,
        pretrained: str,
        policy: str = "macer",
        device: str | None = None,
        dtype: str = "auto",
        attn_implementation: str = "sdpa",
        num_frames: int = PAPER_FRAME_DEFAULTS["num_frames"],
        max_pixels: int = PAPER_FRAME_DEFAULTS["max_pixels"],
        video_frontend: str = "auto",
        system_prompt: str = SYSTEM_PROMPT,
        sample_log: str = "macer_samples.jsonl",
        batch_size: int | str = 1,
        max_batch_size: int | None = None,
        **policy_params: Any,
    ) -> None:
        super().__init__()
        from transformers import Qwen2_5OmniThinkerForConditionalGeneration

        self._batch_size = parse_batch_size(batch_size)
        if max_batch_size is not None:
            raise ValueError(f"macer_qwen2_5_omni: max_batch_size={max_batch_size!r} bounds lmms-eval's "
                             "--batch_size auto, which this model does not support; give --batch_size N only")
        if video_frontend not in VIDEO_FRONTENDS:
            raise ValueError(f"video_frontend must be one of {VIDEO_FRONTENDS}, got {video_frontend!r}")
        if not isinstance(max_pixels, int) or max_pixels < 56 * 56:
            raise ValueError(f"max_pixels must be an integer >= {56 * 56}, got {max_pixels!r}")
        self._device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        torch_dtype = {"auto": torch.bfloat16 if self._device.type == "cuda" else torch.float32,
                       "bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}.get(dtype)
        if torch_dtype is None:
            raise ValueError(f"dtype must be one of auto, bfloat16, float16, float32, got {dtype!r}")
        self.processor = build_processor(pretrained, video_frontend, max_pixels=max_pixels)
        # The thinker alone: on transformers 5.23 the full model's generate() cannot return text only, and
        # lmms-eval's own wrapper then answers "" for every sample.
        self.model = Qwen2_5OmniThinkerForConditionalGeneration.from_pretrained(
            pretrained, dtype=torch_dtype, attn_implementation=attn_implementation).to(self._device).eval()
        tokenizer = self.processor.tokenizer
        im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
        if not isinstance(im_end, int) or im_end == getattr(tokenizer, "unk_token_id", None):
            raise ValueError(f"{pretrained}: the tokenizer has no <|im_end|> token; cannot find the question span")
        self.im_end = im_end
        self.policy_name = policy
        self.policy = resolve_policy(policy, self.model, im_end=im_end, **policy_params)
        self.num_frames, self.max_pixels = num_frames, max_pixels
        self.system_prompt = system_prompt
        self.sample_log = Path(sample_log)
        self.sample_log.parent.mkdir(parents=True, exist_ok=True)
        logger.info(f"macer_qwen2_5_omni: {self.policy} on {pretrained} ({self._device}, {torch_dtype}, "
                    f"{self.processor.frontend} video frontend); per-sample budgets -> {self.sample_log}")

    # ------------------------------------------------------------------------------------------ lmms interface
    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def batch_size(self) -> int:
        return self._batch_size

    def loglikelihood(self, requests: list[Instance]) -> list[tuple[float, bool]]:
        raise NotImplementedError("macer_qwen2_5_omni implements generate_until only")

    def generate_until_multi_round(self, requests: list[Instance]) -> list[str]:
        raise NotImplementedError("macer_qwen2_5_omni implements generate_until only")

    def generate_until(self, requests: list[Instance]) -> list[str]:
        answers = []
        for group in self._batches(requests):
            questions = []
            for request in group:
                context, _, doc_to_visual, doc_id, task, split = request.args
                questions.append((context, doc_to_visual(self.task_dict[task][split][doc_id])))
            results = self.answer_batch(questions, dict(group[0].args[1]))
            for request, (answer, record) in zip(group, results):
                context, gen_kwargs, _, doc_id, task, _ = request.args
                self._log_sample(task, doc_id, record, answer)
                self.cache_hook.add_partial("generate_until", (context, gen_kwargs), answer)
                answers.append(answer)
        return answers

    def _batches(self, requests: Sequence[Instance]) -> Iterator[list[Instance]]:
        """Runs of consecutive requests with equal generation arguments, at most ``batch_size`` long, in lmms-eval's
        order (so the answers come back in the order of ``requests`` without re-sorting)."""
        group: list[Instance] = []
        for request in requests:
            if group and (len(group) == self._batch_size or request.args[1] != group[0].args[1]):
                yield group
                group = []
            group.append(request)
        if group:
            yield group

    # ------------------------------------------------------------------------------------------ one sample
    def inputs_for(self, context: str, video_path: str) -> dict[str, Any]:
        """The thinker's inputs for one question about one video file (its audio track included)."""
        clip = read_clip(video_path, self.num_frames)
        if clip.audio is None or clip.audio.size == 0:
            raise ValueError(f"{video_path}: no audio track; macer_qwen2_5_omni evaluates audio-visual clips "
                             "(the audio of the video is part of every prompt)")
        # Qwen2.5-Omni's chat template for [system text, user (video, text)], written out so that both video
        # frontends build the same prompt.
        text = (f"<|im_start|>system\n{self.system_prompt}<|im_end|>\n<|im_start|>user\n"
                f"<|vision_bos|><|VIDEO|><|vision_eos|>{context}<|im_end|>\n<|im_start|>assistant\n")
        inputs = self.processor(
            text=text, videos=[clip.frames], audio=[clip.audio], load_audio_from_video=True,
            audio_from_video_indices=[0], return_tensors="pt",
            videos_kwargs={"fps": clip.fps, "do_sample_frames": False,
                           "size": {"shortest_edge": 56 * 56, "longest_edge": self.max_pixels}})
        dtype = self.model.dtype
        inputs = {k: (v.to(self._device, dtype) if v.is_floating_point() else v.to(self._device))
                  if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
        inputs["use_audio_in_video"] = True
        return inputs

    def answer(self, context: str, visuals: Any, gen_kwargs: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        """Generate the answer to one request; returns it with the sample's budget record."""
        return self.answer_batch([(context, visuals)], gen_kwargs)[0]

    def answer_batch(self, questions: Sequence[tuple[str, Any]],
                     gen_kwargs: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
        """Answer several ``(context, visuals)`` requests that share ``gen_kwargs`` with one batched ``generate``;
        returns ``(answer, record)`` per request, in order. Each prompt is built as alone (``inputs_for``), the
        prompts are left-padded into one batch (``macer.batching.batch_inputs``) and ``macer.compress`` prunes each
        as if it ran alone (``trace.samples[b]`` is its record)."""
        import macer

        if not questions:
            raise ValueError("macer_qwen2_5_omni: answer_batch needs at least one question")
        videos = []
        for _, visuals in questions:
            found = list(visuals) if isinstance(visuals, (list, tuple)) else [visuals]
            if len(found) != 1 or not isinstance(found[0], str):
                raise ValueError(f"macer_qwen2_5_omni takes exactly one video file per question, got {visuals!r}")
            videos.append(found[0])
        samples = [self.inputs_for(context, video) for (context, _), video in zip(questions, videos)]
        # Every prompt of this model is interleaved (inputs_for sets use_audio_in_video=True), so a batch never mixes
        # layouts that need different flags: transformers reads one use_audio_in_video per generate call.
        inputs = samples[0] if len(samples) == 1 else batch_inputs(
            samples, pad_token_id=self.processor.tokenizer.pad_token_id, padding_side="left")
        until, generate = self._generation(dict(gen_kwargs))
        width = inputs["input_ids"].shape[1]
        start = time.perf_counter()
        with torch.no_grad(), macer.compress(self.model, self.policy) as trace:
            out = self.model.generate(**inputs, **generate)
        seconds = time.perf_counter() - start
        if len(trace.samples) != len(samples):
            raise RuntimeError(f"macer.compress recorded {len(trace.samples)} prompts for a batch of {len(samples)}: "
                               "the policy did not run on every sample")
        results = []
        for video, sample, record, row in zip(videos, samples, trace.samples, out[:, width:].tolist()):
            # A row that ended before the batch did is filled with padding after its <|im_end|>: its own new tokens
            # run up to and including that <|im_end|>, as generate would have stopped there alone.
            new_tokens = row.index(self.im_end) + 1 if self.im_end in row else len(row)
            text = self.processor.tokenizer.decode(row[:new_tokens], skip_special_tokens=True)
            for stop in until:
                if stop and stop in text:
                    text = text.split(stop, 1)[0]
            budget = record.budget
            results.append((text, {
                "video": video, "prompt_tokens": int(sample["input_ids"].shape[1]), "new_tokens": new_tokens,
                "seconds": round(seconds, 3), "batch_size": len(samples),
                "n_audio": record.n_audio, "n_video": record.n_video,
                "budget_total": None if budget is None else budget.total,
                "budget_audio": None if budget is None else budget.audio,
                "budget_video": None if budget is None else budget.video,
                "audio_kept": len(record.audio_kept), "video_kept": len(record.video_kept),
            }))
        return results

    def _generation(self, gen_kwargs: dict[str, Any]) -> tuple[list[str], dict[str, Any]]:
        """lmms-eval's generation arguments -> (stop strings, ``generate`` keyword arguments). Sampling follows
        ``temperature > 0`` (or ``do_sample: true``); an argument this model cannot honour is refused, not ignored."""
        until = gen_kwargs.pop("until", None) or []
        until = [until] if isinstance(until, str) else list(until)
        temperature = float(gen_kwargs.pop("temperature", 0) or 0)
        top_p = float(gen_kwargs.pop("top_p", 1.0) or 1.0)
        do_sample = temperature > 0 or bool(gen_kwargs.pop("do_sample", False))
        num_beams = gen_kwargs.pop("num_beams", None)
        num_beams = 1 if num_beams is None else num_beams
        if isinstance(num_beams, bool) or not isinstance(num_beams, int) or num_beams < 1:
            raise ValueError(f"macer_qwen2_5_omni: num_beams must be an integer >= 1, got {num_beams!r}")
        max_new_tokens = int(gen_kwargs.pop("max_new_tokens", 128))
        unknown = sorted(k for k, v in gen_kwargs.items() if v is not None)
        if unknown:
            raise ValueError(f"macer_qwen2_5_omni: generation arguments {unknown} are not supported (supported: "
                             "until, max_new_tokens, temperature, top_p, do_sample, num_beams)")
        generate = {"max_new_tokens": max_new_tokens, "do_sample": do_sample,
                    "num_beams": num_beams, "eos_token_id": self.im_end,
                    "pad_token_id": self.processor.tokenizer.pad_token_id}
        if do_sample:
            generate["temperature"] = temperature if temperature > 0 else 1.0
            generate["top_p"] = top_p
        return until, generate

    def _log_sample(self, task: str, doc_id: int, record: dict[str, Any], answer: str) -> None:
        # The policy object that ran (class and fields), not only the name asked for: an ablation resolved to
        # another policy, or a field that did not arrive, shows in the log.
        ran = describe_policy(self.policy)
        line = {"task": task, "doc_id": doc_id, "policy": self.policy_name, "policy_class": ran["class"],
                "policy_fields": ran["fields"], "keep_ratio": getattr(self.policy, "keep_ratio", None), **record,
                "answer": answer}
        with self.sample_log.open("a", encoding="utf-8") as f:
            f.write(json.dumps(line) + "\n")
        logger.info(f"macer sample {task}/{doc_id}: audio {record['audio_kept']}/{record['n_audio']}, "
                    f"video {record['video_kept']}/{record['n_video']}, budget {record['budget_total']}")
