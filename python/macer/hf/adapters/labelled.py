"""The labelled path: any transformers decoder, with the prompt's modality labels given by the caller.

Models that splice media embeddings themselves and call a plain language model with ``inputs_embeds`` (VILA-style
remote code such as OmniVinci, LLaVA-style wrappers, one's own research model) have no token ids from which an adapter
could read modalities. ``LabelledAdapter`` takes them from the caller instead::

    adapter = macer.LabelledAdapter(labels, temporal_positions=None, question_end=q_end)
    with macer.compress(llm, config, adapter=adapter) as trace:
        llm.generate(inputs_embeds=inputs_embeds, attention_mask=mask, max_new_tokens=64)

* ``labels``: ``[N]`` (or ``[1, N]``) modality of each row of ``inputs_embeds``: 0 text, 1 audio (``macer.AUDIO``),
  2 image/video (``macer.VISUAL``).
* ``temporal_positions``: optional ``[N]`` time of each row (any unit, integer or float; Python floats are kept in
  float64); only the visual rows' values
  are used (they form the video's temporal chunks for coverage). Default: the row index, which orders frames as the
  prompt does.
* ``question_end``: the position of the token that closes the user's turn (e.g. ``<|im_end|>``); the question rows
  are the ``query_tokens`` rows before it. Without it the config's ``question_span`` decides: ``"prompt_end"`` reads
  the prompt's last rows (the prompt should then end with the question, not an assistant header); the default
  ``"end_of_turn"`` needs token ids and raises.

The decoder is found as ``model.get_decoder()`` (``model.model`` for ``*ForCausalLM``) or ``model`` itself, and must
use transformers' decoder-layer convention: ``layer(hidden_states, attention_mask=..., position_ids=...,
position_embeddings=(cos, sin), ...)`` with full attention in every layer (Llama, Qwen2/2.5/3, Mistral, Gemma without
sliding windows, ...). Labels describe one prompt: use one adapter (one ``compress`` block) per prompt; a prefill of
another length is refused.
"""

from __future__ import annotations

import numbers
from typing import Any

import torch
from torch import nn

from macer.hf.adapters.base import AUDIO, TEXT, VISUAL, Adapter, DecoderParts

__all__ = ["LabelledAdapter", "find_decoder", "label_rows"]


def find_decoder(model: nn.Module) -> nn.Module:
    """The module of ``model`` that runs its decoder layers: ``model`` itself if it has ``layers``, else
    ``model.get_decoder()`` / ``model.model``; ``ValueError`` if none has the layer convention macer needs."""
    hf_model: Any = model  # get_decoder is a transformers method, not a submodule lookup
    candidates: list[Any] = [model]
    if hasattr(model, "get_decoder"):
        try:
            candidates.append(hf_model.get_decoder())
        except (AttributeError, NotImplementedError):
            pass
    candidates.append(getattr(model, "model", None))
    for module in candidates:
        layers = getattr(module, "layers", None)
        if isinstance(layers, nn.ModuleList) and len(layers) and hasattr(module, "rotary_emb"):
            if all(hasattr(getattr(layer, "self_attn", None), "layer_idx") for layer in layers):
                return module
    raise ValueError(f"macer.compress: cannot find a decoder in {type(model).__name__} (expected a module with "
                     "`layers` (each with `self_attn.layer_idx`) and `rotary_emb`, at the model, model.get_decoder() "
                     "or model.model); the labelled path supports transformers' decoder-only language models")


def label_rows(inputs_embeds: torch.Tensor, *, audio: Any = (), visual: Any = ()) -> torch.Tensor:
    """Modality labels of the rows of ``inputs_embeds`` by provenance: a row that equals (bit for bit) a row of one of
    the ``audio`` tensors is ``AUDIO``, of a ``visual`` tensor ``VISUAL``, any other row text (0).

    For models that splice encoder outputs into the text embeddings by copying rows (VILA / OmniVinci, LLaVA-style
    code): capture the projectors' outputs with forward hooks while the model builds ``inputs_embeds``, then label.
    Runs on the host (one copy of each tensor); a preprocessing step, not for a hot path.

    Args:
        inputs_embeds: ``[N, D]`` or ``[1, N, D]``.
        audio, visual: a tensor or a sequence of tensors whose last dimension is ``D`` (any leading shape).

    Returns:
        ``[N]`` int64 labels on the CPU.
    """
    embeds = inputs_embeds.detach()
    if embeds.ndim == 3 and embeds.shape[0] == 1:
        embeds = embeds[0]
    if embeds.ndim != 2:
        raise ValueError(f"label_rows: inputs_embeds must be [N, D] or [1, N, D], got {tuple(inputs_embeds.shape)}")
    width = embeds.shape[-1]

    def keys(x: torch.Tensor) -> list[bytes]:
        # Exact bit patterns of each row (the same bytes for a copied row, whatever the dtype).
        rows = x.detach().to("cpu").contiguous().reshape(-1, width)
        return [r.tobytes() for r in rows.view(torch.uint8).numpy()]

    owner: dict[bytes, int] = {}
    for label, sources in ((AUDIO, audio), (VISUAL, visual)):
        for source in [sources] if isinstance(sources, torch.Tensor) else sources:
            if not isinstance(source, torch.Tensor):
                raise TypeError(f"label_rows: audio and visual must be tensors or sequences of tensors, got an "
                                f"element of type {type(source).__name__}")
            if source.shape[-1] != width or source.dtype != embeds.dtype:
                raise ValueError(f"label_rows: every audio/visual tensor must have last dimension {width} and dtype "
                                 f"{embeds.dtype} (as inputs_embeds), got {tuple(source.shape)} {source.dtype}")
            for key in keys(source):
                owner[key] = label
    return torch.tensor([owner.get(key, TEXT) for key in keys(embeds)], dtype=torch.long)


def _as_position(name: str, value: Any, length: int) -> int | None:
    """``value`` (None, a Python or numpy integer, or a 0-d / one-element integer tensor) as an int in
    ``[0, length]``."""
    if value is None:
        return None
    if isinstance(value, torch.Tensor) and value.numel() == 1 and value.ndim <= 1 and not (
            value.is_floating_point() or value.is_complex() or value.dtype == torch.bool):
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not 0 <= int(value) <= length:
        raise ValueError(f"{name} must be an integer position in [0, {length}] (the token closing the user's turn), "
                         f"got {value!r}")
    return int(value)


def as_tensor(value: Any) -> torch.Tensor:
    """``torch.as_tensor``, except that Python floats stay float64: torch's default float32 would merge large times
    (epoch seconds: 1.7e9 has a float32 spacing of 128 s) into one value, and the coverage chunks with them. Tensors
    and numpy arrays keep their dtype."""
    if isinstance(value, torch.Tensor):
        return value
    converted = torch.as_tensor(value)
    if converted.is_floating_point() and not hasattr(value, "dtype"):
        converted = torch.as_tensor(value, dtype=torch.float64)
    return converted


def _as_vector(name: str, value: Any) -> torch.Tensor:
    value = as_tensor(value)
    if value.ndim == 2 and value.shape[0] == 1:
        value = value[0]
    if value.ndim != 1 or value.numel() == 0:
        raise ValueError(f"LabelledAdapter: {name} must be a non-empty [N] or [1, N] tensor, got shape "
                         f"{tuple(value.shape)}")
    return value.detach().cpu()


class LabelledAdapter(Adapter):
    """Adapter for any transformers decoder whose prompt's modality labels the caller gives (see module docstring).

    Args:
        labels: ``[N]`` or ``[1, N]`` integers in {0 text, 1 audio, 2 visual}, one per prompt row.
        temporal_positions: optional ``[N]`` finite integer or floating times (used for the visual rows); a Python
            list of floats is kept in float64 (a tensor or numpy array keeps its dtype).
        question_end: optional position in ``[0, N]`` (an int, a numpy integer or a 0-d integer tensor) of the
            token closing the user's turn; the question rows are the ``query_tokens`` rows before it (without it
            the config's ``question_span`` decides).
    """

    def __init__(self, labels: Any, temporal_positions: Any = None, question_end: int | None = None):
        labels = _as_vector("labels", labels)
        if labels.is_floating_point() or labels.is_complex() or labels.dtype == torch.bool:
            raise ValueError(f"LabelledAdapter: labels must be integers (0 text, 1 audio, 2 visual), got "
                             f"{labels.dtype}")
        bad = (labels < TEXT) | (labels > VISUAL)
        if bool(bad.any()):
            raise ValueError(f"LabelledAdapter: labels must be 0 (text), 1 (audio) or 2 (visual); got "
                             f"{labels[bad].unique().tolist()} at positions {bad.nonzero().reshape(-1)[:8].tolist()}")
        self._labels = labels.long()
        self.length = labels.numel()
        self._temporal = None
        if temporal_positions is not None:
            temporal = _as_vector("temporal_positions", temporal_positions)
            if temporal.numel() != self.length:
                raise ValueError(f"LabelledAdapter: temporal_positions has {temporal.numel()} entries, labels "
                                 f"{self.length}; give one per prompt row")
            if temporal.is_complex() or temporal.dtype == torch.bool:
                raise ValueError(f"LabelledAdapter: temporal_positions must be integer or floating, got "
                                 f"{temporal.dtype}")
            if temporal.is_floating_point() and not bool(torch.isfinite(temporal).all()):
                raise ValueError("LabelledAdapter: temporal_positions must be finite")
            self._temporal = temporal
        self._question_end = _as_position("LabelledAdapter: question_end", question_end, self.length)

    def parts(self, model: nn.Module) -> DecoderParts:
        decoder: Any = find_decoder(model)
        outer = (model,) if model is not decoder else ()
        return DecoderParts(root=decoder, decoder=decoder, layers=decoder.layers, attn_config=decoder.config,
                            outer=outer)

    def _check_length(self, length: int) -> None:
        if length != self.length:
            raise ValueError(f"macer.compress: the prefill has {length} rows but LabelledAdapter was given labels for "
                             f"{self.length}; give one label per row of the prompt's inputs_embeds (one adapter per "
                             "prompt)")

    def labels(self, model: nn.Module, input_ids: torch.Tensor | None) -> torch.Tensor:
        if input_ids is not None:
            self._check_length(input_ids.shape[-1])
        return self._labels[None]

    def temporal_positions(self, decoder_kwargs: dict[str, Any], length: int) -> torch.Tensor | None:
        self._check_length(length)
        return None if self._temporal is None else self._temporal[None]

    def question_end(self, length: int) -> int | None:
        self._check_length(length)
        return self._question_end
