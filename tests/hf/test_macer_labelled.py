"""The labelled path: ``macer.compress(model, config, adapter=macer.LabelledAdapter(labels, ...))`` on decoders that a
model calls with ``inputs_embeds`` (tiny random ``LlamaForCausalLM`` and ``Qwen2ForCausalLM``), and on a stand-in for
OmniVinci (VILA-style: media embeddings spliced into the text embeddings at a placeholder token, then
``llm.generate(inputs_embeds=...)``).

Kept sets are compared with the independent staged forward of ``staged_reference``; the pruned prefill's logits with
the reference's logits of the rows it kept.
"""

from __future__ import annotations

import macer
import pytest
import torch
from staged_reference import AUDIO, VISUAL, staged_kept
from torch import nn

import macer_kernels

VOCAB, HIDDEN, EOT, NEWLINE = 256, 64, 2, 10


def build_decoder(family: str, *, attn: str = "eager", seed: int = 0, num_layers: int = 4):
    """A tiny random ``LlamaForCausalLM`` or ``Qwen2ForCausalLM``."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    config_cls, model_cls = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}[family]
    config = config_cls(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
                        num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
                        max_position_embeddings=4096,
                        eos_token_id=EOT, pad_token_id=0, bos_token_id=1)
    config._attn_implementation = attn
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(config)
    model.generation_config.pad_token_id = 0
    return model.eval()


def media_prompt(model, *, seed: int = 0, frames: int = 6, per_frame: int = 10, audio_per_segment: int = 12,
                 question: int = 8):
    """``inputs_embeds`` of a chat prompt around a VILA-style interleaved clip (per segment: a frame's rows, "\\n",
    the audio rows of that segment, "\\n"), with its labels, the frame index of every row and the end-of-turn row."""
    g = torch.Generator().manual_seed(seed)
    embed = model.get_input_embeddings()

    def ids(n):
        return torch.randint(16, VOCAB, (n,), generator=g)

    rows, labels, times = [embed(ids(6))], [torch.zeros(6)], [torch.zeros(6)]
    newline = embed(torch.tensor([NEWLINE]))
    for f in range(frames):
        rows += [torch.randn(per_frame, HIDDEN, generator=g) * 0.05, newline,
                 torch.randn(audio_per_segment, HIDDEN, generator=g) * 0.05, newline]
        labels += [torch.full((per_frame,), VISUAL), torch.zeros(1), torch.full((audio_per_segment,), AUDIO),
                   torch.zeros(1)]
        times += [torch.full((per_frame + audio_per_segment + 2,), float(f))]
    tail = [*ids(question).tolist(), EOT, NEWLINE, 3, 4, NEWLINE]
    rows.append(embed(torch.tensor(tail)))
    labels.append(torch.zeros(len(tail)))
    times.append(torch.full((len(tail),), float(frames)))
    with torch.no_grad():
        embeds = torch.cat(rows)[None]
    labels = torch.cat(labels).long()
    question_end = embeds.shape[1] - 5  # the EOT row
    return embeds, labels, torch.cat(times), question_end


def left_padded(prompts):
    """``media_prompt`` outputs as one left-padded batch: ``(embeds, mask, adapter, pads)``, the adapter a
    ``BatchLabelledAdapter`` with each prompt's labels, temporal positions and question end in the padded rows."""
    width = max(p[0].shape[1] for p in prompts)
    pads = [width - p[0].shape[1] for p in prompts]

    def left(t, pad):
        return torch.nn.functional.pad(t, (0, 0, pad, 0) if t.dim() == 3 else (pad, 0))

    embeds = torch.cat([left(p[0], pad) for p, pad in zip(prompts, pads, strict=True)])
    mask = torch.stack([torch.cat([torch.zeros(pad), torch.ones(p[0].shape[1])]).long()
                        for p, pad in zip(prompts, pads, strict=True)])
    adapter = macer.BatchLabelledAdapter(torch.stack([left(p[1], pad) for p, pad in zip(prompts, pads, strict=True)]),
                                         torch.stack([left(p[2], pad) for p, pad in zip(prompts, pads, strict=True)]),
                                         [p[3] + pad for p, pad in zip(prompts, pads, strict=True)])
    return embeds, mask, adapter, pads


def reference(model, embeds, labels, temporal, question_end, config):
    decoder = model.model
    n = labels.numel()
    position_ids = torch.arange(n)[None]
    question = torch.arange(question_end - config.query_tokens, question_end)
    return staged_kept(decoder.layers, decoder.rotary_emb, embeds, position_ids, labels,
                       torch.arange(n) if temporal is None else temporal, question, config)


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def family(request):
    return request.param


@pytest.fixture(scope="module")
def eager_model(family):
    return build_decoder(family, attn="eager", seed=4)


def _config(**kw):
    return macer.MacerConfig(**{"keep_ratio": 0.3, "audio_layer": 1, "video_layer": 2, "coverage_weight": 0.05, **kw})


@pytest.mark.parametrize(
    ("layers", "with_times", "attn"),
    [
        pytest.param((1, 2), True, "eager", id="audio-first-frame-times-eager"),
        pytest.param((2, 1), False, "sdpa", id="video-first-row-order-sdpa"),
        pytest.param((2, 2), True, "sdpa", id="same-layer-frame-times-sdpa"),
    ],
)
def test_kept_sets_and_logits_match_independent_reference(family, eager_model, layers, with_times, attn):
    embeds, labels, times, question_end = media_prompt(eager_model, seed=1)
    temporal = times if with_times else None
    config = _config(audio_layer=layers[0], video_layer=layers[1])
    want_audio, want_video, hidden = reference(eager_model, embeds, labels, temporal, question_end, config)
    model = eager_model if attn == "eager" else build_decoder(family, attn="sdpa", seed=4)
    adapter = macer.LabelledAdapter(labels, temporal_positions=temporal, question_end=question_end)
    with torch.no_grad(), macer.compress(model, config, adapter=adapter) as trace:
        logits = model(inputs_embeds=embeds).logits
    n_a, n_v = int((labels == AUDIO).sum()), int((labels == VISUAL).sum())
    assert len(trace.audio_kept) + len(trace.video_kept) < n_a + n_v  # something was dropped
    assert trace.audio_kept == want_audio
    assert trace.video_kept == want_video
    kept = sorted((labels == 0).nonzero().reshape(-1).tolist() + want_audio + want_video)
    assert logits.shape[1] == len(kept)
    with torch.no_grad():
        want = model.lm_head(model.model.norm(hidden))
    torch.testing.assert_close(logits, want, rtol=0, atol=1e-5)


def test_generate_from_inputs_embeds_and_exactness(family, eager_model):
    """generate() prunes the prefill and decodes on the compacted caches; keep ratio 1 is bit-identical to the
    unpatched model; leaving the block restores the model bit for bit."""
    embeds, labels, times, question_end = media_prompt(eager_model, seed=2)
    mask = torch.ones(1, embeds.shape[1], dtype=torch.long)
    with torch.no_grad():
        before = eager_model(inputs_embeds=embeds).logits
        full = eager_model.generate(inputs_embeds=embeds, attention_mask=mask, max_new_tokens=4, do_sample=False)
    adapter = macer.LabelledAdapter(labels, temporal_positions=times, question_end=question_end)
    with torch.no_grad(), macer.compress(eager_model, _config(), adapter=adapter) as trace:
        out = eager_model.generate(inputs_embeds=embeds, attention_mask=mask, max_new_tokens=4, do_sample=False)
    record = trace.history[0]
    n_text = int((labels == 0).sum())
    assert out.shape == (1, 4)
    assert record.cache_lengths[-1] == n_text + len(record.audio_kept) + len(record.video_kept)  # after prefill
    with torch.no_grad(), macer.compress(eager_model, _config(keep_ratio=1.0), adapter=adapter):
        same = eager_model(inputs_embeds=embeds).logits
        same_out = eager_model.generate(inputs_embeds=embeds, attention_mask=mask, max_new_tokens=4, do_sample=False)
    assert torch.equal(same, before)
    assert torch.equal(same_out, full)
    with torch.no_grad():
        after = eager_model(inputs_embeds=embeds).logits
    assert torch.equal(after, before)


def test_bad_labels_are_refused(eager_model):
    embeds, labels, _, question_end = media_prompt(eager_model, seed=3)
    with pytest.raises(ValueError, match="labels must be 0"):
        macer.LabelledAdapter(labels + 3)
    with pytest.raises(ValueError, match="temporal_positions has"):
        macer.LabelledAdapter(labels, temporal_positions=torch.arange(3))
    with pytest.raises(ValueError, match="question_end"):
        macer.LabelledAdapter(labels, question_end=labels.numel() + 1)
    # Without question_end, no token ids to search for an end-of-turn token: the error names the ways out, and not
    # end_of_turn_token_id, which cannot work without token ids (issue 21.9: it used to suggest it), even when given.
    for config in (_config(), _config(end_of_turn_token_id=EOT)):
        with torch.no_grad(), macer.compress(eager_model, config, adapter=macer.LabelledAdapter(labels)), \
                pytest.raises(ValueError, match="question_span='prompt_end'") as error:
            eager_model(inputs_embeds=embeds)
        assert r"LabelledAdapter(question_end=...)" in str(error.value)
        assert "pass end_of_turn_token_id" not in str(error.value)
    adapter = macer.LabelledAdapter(labels[:-1], question_end=question_end)
    with torch.no_grad(), macer.compress(eager_model, _config(), adapter=adapter), \
            pytest.raises(ValueError, match="labels for"):
        eager_model(inputs_embeds=embeds)


def test_question_end_as_numpy_integer_or_0d_tensor(family, eager_model):
    """Guards issue 21.9: ``question_end`` as a numpy integer or a 0-d (or one-element) integer tensor was refused;
    it is the same position as the int (the same kept sets). Floats, bools and longer tensors are still refused."""
    np = pytest.importorskip("numpy")
    embeds, labels, times, question_end = media_prompt(eager_model, seed=1)
    config = _config()
    kept = []
    for end in (question_end, np.int64(question_end), np.int32(question_end), torch.tensor(question_end),
                torch.tensor([question_end], dtype=torch.int32)):
        adapter = macer.LabelledAdapter(labels, temporal_positions=times, question_end=end)
        got = adapter.question_end(labels.numel())
        assert got == question_end and type(got) is int
        with torch.no_grad(), macer.compress(eager_model, config, adapter=adapter) as trace:
            eager_model(inputs_embeds=embeds)
        kept.append((trace.audio_kept, trace.video_kept))
    assert all(k == kept[0] for k in kept[1:])
    for bad in (float(question_end), True, torch.tensor(float(question_end)), torch.tensor([1, 2]), np.float64(3.0),
                torch.tensor(labels.numel() + 1)):
        with pytest.raises(ValueError, match=r"LabelledAdapter: question_end must be an integer position in \[0, "):
            macer.LabelledAdapter(labels, question_end=bad)


def test_float_times_from_a_python_list_stay_float64(family, eager_model):
    """Guards issue 21.9: ``temporal_positions`` given as a Python list of floats became float32, so epoch-second
    times (1.7e9: a float32 spacing of 128 s) collapsed to one value, every video row fell in chunk 0 and the coverage
    term silently became plain top-k. A list of floats is kept in float64: the chunk ids are those of the frame
    indices, and the kept sets match the reference run with the frame indices as times."""
    embeds, labels, times, question_end = media_prompt(eager_model, seed=1)
    epoch = [1.7e9 + t for t in times.tolist()]  # one frame a second, on a capture clock (epoch seconds)
    adapter = macer.LabelledAdapter(labels, temporal_positions=epoch, question_end=question_end)
    temporal = adapter.temporal_positions({}, labels.numel())[0]
    assert temporal.dtype == torch.float64 and temporal.tolist() == epoch
    visual = labels == VISUAL
    want_chunks = macer_kernels.temporal_chunks(times[visual], 8)
    assert want_chunks.unique().numel() > 1  # the frames span several chunks
    assert torch.equal(macer_kernels.temporal_chunks(temporal[visual], 8), want_chunks)
    config = _config()
    want_audio, want_video, _ = reference(eager_model, embeds, labels, times, question_end, config)
    with torch.no_grad(), macer.compress(eager_model, config, adapter=adapter) as trace:
        eager_model(inputs_embeds=embeds)
    assert (trace.audio_kept, trace.video_kept) == (want_audio, want_video)
    batch = macer.BatchLabelledAdapter(labels[None].repeat(2, 1), temporal_positions=[epoch, epoch],
                                       question_ends=torch.tensor([question_end, question_end]))
    assert batch._batch_temporal.dtype == torch.float64 and batch._batch_temporal[1].tolist() == epoch
    assert batch.question_ends(2, labels.numel()) == [question_end, question_end]


def test_config_eps_reaches_the_stages_alone_and_in_a_batch(family):
    """Guards issue 22.9 (eps checked by one kernel test per backend, and never at model level): every model test ran
    the default eps, which moves no selection, so a runtime passing the default instead of ``config.eps`` passed them
    all. On a decoder with sharp attention (q_proj scaled by 30: per-row modality masses differ, so eps changes the
    ANMS ranking), eps = 5 keeps other tokens than the default in each prompt, and the prompt alone
    (``LabelledAdapter``) and both prompts in a left-padded batch (``BatchLabelledAdapter``: the batched stage) keep
    exactly what the staged reference keeps with eps = 5."""
    model = build_decoder(family, attn="eager", seed=4)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(30.0)
    prompts = [media_prompt(model, seed=1), media_prompt(model, seed=2, frames=4, question=6)]
    config = _config(eps=5.0)
    wants = [reference(model, *prompt, config)[:2] for prompt in prompts]
    assert all(want != reference(model, *prompt, _config())[:2] for want, prompt in zip(wants, prompts, strict=True))
    embeds, labels, times, question_end = prompts[0]
    adapter = macer.LabelledAdapter(labels, temporal_positions=times, question_end=question_end)
    with torch.no_grad(), macer.compress(model, config, adapter=adapter) as trace:
        model(inputs_embeds=embeds)
    assert (trace.audio_kept, trace.video_kept) == wants[0]
    width = max(p[0].shape[1] for p in prompts)
    pads = [width - p[0].shape[1] for p in prompts]
    batch = torch.cat([torch.nn.functional.pad(p[0], (0, 0, pad, 0)) for p, pad in zip(prompts, pads, strict=True)])
    mask = torch.stack([torch.cat([torch.zeros(pad), torch.ones(p[0].shape[1])]).long()
                        for p, pad in zip(prompts, pads, strict=True)])
    adapter = macer.BatchLabelledAdapter(
        torch.stack([torch.nn.functional.pad(p[1], (pad, 0)) for p, pad in zip(prompts, pads, strict=True)]),
        torch.stack([torch.nn.functional.pad(p[2], (pad, 0)) for p, pad in zip(prompts, pads, strict=True)]),
        [p[3] + pad for p, pad in zip(prompts, pads, strict=True)])
    with torch.no_grad(), macer.compress(model, config, adapter=adapter) as trace:
        model(inputs_embeds=batch, attention_mask=mask)
    for b, (want, pad) in enumerate(zip(wants, pads, strict=True)):
        got = (trace.samples[b].audio_kept, trace.samples[b].video_kept)
        assert got == ([i + pad for i in want[0]], [i + pad for i in want[1]]), f"sample {b}"


def test_label_rows_by_provenance():
    g = torch.Generator().manual_seed(0)
    audio, visual = torch.randn(5, 8, generator=g).bfloat16(), torch.randn(2, 3, 8, generator=g).bfloat16()
    text = torch.randn(4, 8, generator=g).bfloat16()
    flat = visual.reshape(-1, 8)
    embeds = torch.cat([text[:2], flat[:4], audio[1:4], text[2:], flat[4:]])
    want = [0, 0, 2, 2, 2, 2, 1, 1, 1, 0, 0, 2, 2]
    assert macer.label_rows(embeds[None], audio=audio, visual=[visual]).tolist() == want
    with pytest.raises(ValueError, match="dtype"):
        macer.label_rows(embeds, audio=audio.float())


class VilaStandIn(nn.Module):
    """What OmniVinci's remote code does around its Qwen2 decoder, in miniature: encoders and projectors produce
    media rows, ``_embed`` replaces the ``<video>`` placeholder of ``input_ids`` with the clip's rows (per segment: a
    frame's projected patches, the "\\n" embedding, the segment's projected audio, "\\n"), and ``generate`` calls
    ``self.llm.generate(inputs_embeds=...)``."""

    VIDEO_TOKEN = 5

    def __init__(self, llm: nn.Module, seed: int = 0):
        super().__init__()
        self.llm = llm
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.mm_projector = nn.Linear(12, HIDDEN)
            self.sound_mm_projector = nn.Linear(8, HIDDEN)

    def _embed(self, input_ids: torch.Tensor, frames: torch.Tensor, sound: torch.Tensor) -> torch.Tensor:
        embed = self.llm.get_input_embeddings()
        text = embed(input_ids[0])
        video = self.mm_projector(frames)  # [F, P, D]
        audio = self.sound_mm_projector(sound).chunk(frames.shape[0])  # one audio piece per frame segment
        newline = embed(torch.tensor([NEWLINE]))
        clip = torch.cat([piece for f in range(frames.shape[0]) for piece in (video[f], newline, audio[f], newline)])
        at = int((input_ids[0] == self.VIDEO_TOKEN).nonzero()[0])
        return torch.cat([text[:at], clip, text[at + 1:]])[None]

    @torch.no_grad()
    def generate(self, input_ids, frames, sound, **kwargs):
        embeds = self._embed(input_ids, frames, sound)
        mask = torch.ones(embeds.shape[:2], dtype=torch.long)
        return self.llm.generate(inputs_embeds=embeds, attention_mask=mask, **kwargs)


def stand_in_labels(input_ids: torch.Tensor, frames: torch.Tensor, sound: torch.Tensor) -> torch.Tensor:
    """The caller's labels for the stand-in's splice, from the same segment lengths its ``_embed`` uses (what a user
    of OmniVinci computes from the media it passes: frames' token counts and each segment's audio rows)."""
    at = int((input_ids[0] == VilaStandIn.VIDEO_TOKEN).nonzero()[0])
    per_frame = frames.shape[1]
    audio_pieces = [piece.shape[0] for piece in sound.chunk(frames.shape[0])]
    clip = []
    for n_audio in audio_pieces:
        clip += [VISUAL] * per_frame + [0] + [AUDIO] * n_audio + [0]
    return torch.tensor([0] * at + clip + [0] * (input_ids.shape[1] - at - 1))


def test_vila_style_stand_in():
    """The OmniVinci recipe of docs/integration.md on its Qwen2 decoder: labels for the spliced prompt, compress the
    inner decoder, call the wrapper's own generate. Kept sets equal the reference on the spliced embeddings."""
    llm = build_decoder("qwen2", attn="eager", seed=6)
    model = VilaStandIn(llm, seed=1)
    g = torch.Generator().manual_seed(5)
    question = torch.randint(16, VOCAB, (8,), generator=g).tolist()
    input_ids = torch.tensor([[1, 11, NEWLINE, VilaStandIn.VIDEO_TOKEN, *question, EOT, NEWLINE, 3, 4, NEWLINE]])
    frames, sound = torch.randn(6, 10, 12, generator=g), torch.randn(6 * 9, 8, generator=g)
    labels = stand_in_labels(input_ids, frames, sound)
    question_end = labels.numel() - 5
    config = _config(audio_layer=2, video_layer=1)
    # The same labels by provenance: the projectors' output rows, captured while the model splices.
    captured = {"audio": [], "visual": []}
    hooks = [model.mm_projector.register_forward_hook(lambda m, a, out: captured["visual"].append(out)),
             model.sound_mm_projector.register_forward_hook(lambda m, a, out: captured["audio"].append(out))]
    with torch.no_grad():
        embeds = model._embed(input_ids, frames, sound)
    for hook in hooks:
        hook.remove()
    assert embeds.shape[1] == labels.numel()
    assert torch.equal(macer.label_rows(embeds, **captured), labels)
    want_audio, want_video, _ = reference(llm, embeds, labels, None, question_end, config)
    adapter = macer.LabelledAdapter(labels, question_end=question_end)
    with macer.compress(model.llm, config, adapter=adapter) as trace:
        out = model.generate(input_ids, frames, sound, max_new_tokens=3, do_sample=False)
    assert out.shape == (1, 3)
    assert (trace.audio_kept, trace.video_kept) == (want_audio, want_video)
    assert len(want_audio) + len(want_video) == trace.budget.total < int((labels != 0).sum())


def test_hybrid_mamba_decoder_is_refused():
    """nemotron_h (the decoder of nemotron_h_omni): single-mixer Mamba/attention/MLP blocks without RoPE tables are
    not the layer convention the labelled path needs (docs/integration.md says what support would take)."""
    from transformers import NemotronHConfig, NemotronHForCausalLM

    config = NemotronHConfig(vocab_size=64, hidden_size=32, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                             layers_block_type=["linear_attention", "full_attention", "mlp", "linear_attention"],
                             mamba_num_heads=4, mamba_head_dim=8, ssm_state_size=8, n_groups=1, intermediate_size=64)
    model = NemotronHForCausalLM(config).eval()
    adapter = macer.LabelledAdapter(torch.zeros(5, dtype=torch.long))
    with pytest.raises(ValueError, match=r"cannot find a decoder in NemotronHForCausalLM"), \
            macer.compress(model, _config(), adapter=adapter):
        pass


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("tokens", [2, 3])
def test_a_decode_step_of_several_tokens_equals_one_token_steps(attn, tokens):
    """A step of several tokens on a pruned prompt's cache (a second chat turn, assisted generation): SDPA then
    builds a 4-D mask over layer 0's rows, which the compacted layers did not get cut to their own rows (a size
    mismatch error, found in review). Its logits equal the same tokens fed one step at a time (on a second prefill
    of the same prompt: the session knows each cache it pruned, not a copy of one). Two tokens are the smallest step
    that is not a one-token step."""
    model = build_decoder("qwen2", attn=attn)
    embeds, labels, times, question_end = media_prompt(model, seed=2)
    n = embeds.shape[1]
    adapter = macer.LabelledAdapter(labels, temporal_positions=times, question_end=question_end)
    new = torch.tensor([[20, 21, 22][:tokens]])
    with torch.no_grad(), macer.compress(model, _config(), adapter=adapter) as trace:
        cache = model(inputs_embeds=embeds, use_cache=True).past_key_values
        assert len(set(trace.last.cache_lengths)) > 1  # the layers hold different rows
        together = model(input_ids=new, past_key_values=cache,
                         attention_mask=torch.ones(1, n + tokens, dtype=torch.long), use_cache=True).logits
        single = model(inputs_embeds=embeds, use_cache=True).past_key_values
        steps = [model(input_ids=new[:, i:i + 1], past_key_values=single,
                       attention_mask=torch.ones(1, n + i + 1, dtype=torch.long), use_cache=True).logits
                 for i in range(tokens)]
    torch.testing.assert_close(together, torch.cat(steps, dim=1), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize(("tokens", "trim"), [(2, False), (3, False), (2, True)])
def test_a_decode_step_of_several_tokens_on_a_padded_batch_equals_one_token_steps(attn, tokens, trim):
    """The same on a left-padded, pruned batch (``BatchLabelledAdapter``): the step's per-layer masks follow each
    layer's re-packed layout for every query row. Positions come from the 2-D mask, as ``generate`` makes them."""
    model = build_decoder("qwen2", attn=attn, seed=4)
    prompts = [media_prompt(model, seed=1, frames=3, question=6), media_prompt(model, seed=2, frames=5, question=9)]
    width = max(p[0].shape[1] for p in prompts)
    pads = [width - p[0].shape[1] for p in prompts]
    embeds = torch.cat([nn.functional.pad(p[0], (0, 0, pad, 0)) for p, pad in zip(prompts, pads, strict=True)])
    mask = torch.stack([torch.cat([torch.zeros(pad), torch.ones(p[0].shape[1])]).long()
                        for p, pad in zip(prompts, pads, strict=True)])
    adapter = macer.BatchLabelledAdapter(
        torch.stack([nn.functional.pad(p[1], (pad, 0)) for p, pad in zip(prompts, pads, strict=True)]),
        torch.stack([nn.functional.pad(p[2], (pad, 0)) for p, pad in zip(prompts, pads, strict=True)]),
        [p[3] + pad for p, pad in zip(prompts, pads, strict=True)])
    new = torch.tensor([[20, 21, 22][:tokens], [30, 31, 32][:tokens]])

    def step(cache, ids, columns):
        full = torch.cat([mask, torch.ones(2, columns, dtype=torch.long)], dim=1)
        positions = (full.cumsum(-1) - 1)[:, -ids.shape[1]:]
        return model(input_ids=ids, past_key_values=cache, attention_mask=full, position_ids=positions,
                     use_cache=True).logits

    with torch.no_grad(), macer.compress(model, _config(trim_early_cache=trim), adapter=adapter) as trace:
        cache = model(inputs_embeds=embeds, attention_mask=mask, use_cache=True).past_key_values
        assert all(sample.pruned for sample in trace.samples)
        assert len({n for sample in trace.samples for n in sample.layer_tokens}) > 2  # re-packed at two stages
        together = step(cache, new, tokens)
        single = model(inputs_embeds=embeds, attention_mask=mask, use_cache=True).past_key_values
        steps = [step(single, new[:, i:i + 1], i + 1) for i in range(tokens)]
    torch.testing.assert_close(together, torch.cat(steps, dim=1), rtol=1e-4, atol=1e-4)
