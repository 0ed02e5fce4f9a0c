"""The adapter interface: everything the model-independent runtime (``macer.hf.session``) needs to know about one model
family. ``docs/integration.md`` ("Adapters") documents it for authors of new adapters.

An adapter answers, for a model of its family:

* where the pieces are (``parts``): the module that receives ``input_ids``, the module that runs the decoder layers,
  the layer list, the config whose ``_attn_implementation`` the attention modules read;
* what each prompt token is (``labels``, ``temporal_positions``): modality labels from the token ids and the temporal
  position of every token, batched ``[B, N]`` (a left-padded batch when ``batch_ready``);
* the end-of-turn token that closes the user's question (``end_of_turn_token_id``) and the family's config facts
  (``family``: labels, end-of-turn id and paper defaults from the config alone, ``macer.core.families``);
* per-token state of its own that a stage must shorten (``on_prefill`` / ``on_stage``, with ``guards`` to wrap a
  method that uses state the decoder keeps in locals of its forward, e.g. Qwen3-Omni's deepstack visual features);
* where the question ends when no token ids say it (``question_end``, the labelled path).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from macer.core.families import Family
from macer.core.policy import AUDIO, TEXT, VISUAL

__all__ = ["AUDIO", "TEXT", "VISUAL", "Adapter", "DecoderParts"]


@dataclass
class DecoderParts:
    """Where the pieces of one model are.

    Attributes:
        root: the module whose ``forward`` receives ``input_ids`` (a forward pre-hook captures the prompt there).
        decoder: the module whose ``forward`` runs the decoder layers in a loop (pre/post hooks bracket one pass).
        layers: the decoder layers, in order.
        attn_config: the config object whose ``_attn_implementation`` the decoder's attention modules read.
        outer: modules whose forward must not receive ``labels`` during a pruned prefill (logits are shorter).
    """

    root: nn.Module
    decoder: nn.Module
    layers: nn.ModuleList
    attn_config: Any
    outer: tuple[nn.Module, ...] = ()


class Adapter(ABC):
    """Base adapter, with the decoder-layer calling convention shared by transformers' decoder-only models:
    ``layer(hidden_states, attention_mask=..., position_ids=..., position_embeddings=(cos, sin), ...)``.

    Subclasses implement ``parts``, ``labels`` and ``temporal_positions``; the other methods have defaults.
    """

    #: keyword arguments of a decoder layer call that carry one entry per token, with their sequence dimension
    layer_token_kwargs: ClassVar[dict[str, int]] = {"position_ids": -1}
    #: keyword argument holding the ``(cos, sin)`` RoPE tables, each ``[B, N, D]``
    position_embeddings_kwarg: ClassVar[str] = "position_embeddings"
    #: whether ``compress`` may run a batch of ``B > 1`` prompts on this family: the runtime re-packs the batch after
    #: every stage (``macer.hf.batch``), so an adapter with per-token state of its own (``on_stage``, a guard that
    #: remaps tokens) must say it handles a re-packed batch before it is allowed
    batch_ready: ClassVar[bool] = False
    #: what the family's config says without a module (labels, end-of-turn id, paper defaults), shared with the vLLM
    #: plugin; ``register_adapter`` registers it for ``MacerConfig.for_model`` (None for the labelled path)
    family: ClassVar[Family | None] = None

    @abstractmethod
    def parts(self, model: nn.Module) -> DecoderParts:
        """Locate root, decoder and layers of ``model``."""

    @abstractmethod
    def labels(self, model: nn.Module, input_ids: torch.Tensor | None) -> torch.Tensor:
        """``[B, N]`` int64 modality label of each prompt token (``TEXT``, ``AUDIO``, ``VISUAL``), on the device of
        ``input_ids`` (the runtime passes host tensors). ``input_ids`` is None when the prompt came as
        ``inputs_embeds``: an adapter that takes labels from elsewhere (e.g. given by the caller) may accept that."""

    @abstractmethod
    def temporal_positions(self, decoder_kwargs: dict[str, Any], length: int) -> torch.Tensor | None:
        """``[B, N]`` temporal position of each prompt token from the decoder call's keyword arguments (any device,
        integer or floating), or None when the decoder uses ``0..N-1`` itself."""

    def end_of_turn_token_id(self, model: nn.Module) -> int | None:
        """The id of the token that closes the user's turn (``<|im_end|>`` for Qwen chat templates), or None if this
        family cannot tell; ``MacerConfig.end_of_turn_token_id=None`` takes this value."""
        return None

    def guards(self, model: nn.Module) -> list[tuple[Any, str, Any]]:
        """``(object, attribute, value)`` triples shadowed on instances while ``compress`` is active (restored exactly
        on exit): e.g. a ``generate`` that cannot work on a pruned prefill and says what to call instead, or a
        submodule method wrapped to remap per-token state (Qwen3-Omni's ``_deepstack_process``). None by default."""
        return []

    def check_batch(self, model: nn.Module, input_ids: torch.Tensor | None, root_kwargs: dict[str, Any]) -> None:
        """Refuse (``ValueError``) a batch of ``B > 1`` prompts this family cannot run correctly, e.g. prompt layouts
        that need different values of a flag the model reads once per call. ``input_ids`` is the padded ``[B, N]``
        batch on the host; ``root_kwargs`` the root's call arguments. Accepts everything by default."""
        return None

    def question_end(self, length: int) -> int | None:
        """The position of the token that closes the user's turn in a prompt of ``length`` rows, when the adapter
        knows it without searching token ids (the labelled path: given by the caller), else None. It takes
        precedence over the end-of-turn search (``question_span``)."""
        return None

    def question_ends(self, batch: int, length: int) -> list[int | None]:
        """``question_end`` for each row of a batch of ``batch`` left-padded rows of ``length`` (positions in the
        padded row; the runtime subtracts each row's padding). Default: ``question_end(length)`` for every row."""
        return [self.question_end(length)] * batch

    def on_prefill(self, decoder_kwargs: dict[str, Any]) -> None:
        """Called at the start of every prefill (empty cache), before any stage, with the decoder call's keyword
        arguments: forget the rows of an earlier prefill and note this one's per-token state (nothing by default)."""
        return None

    def on_stage(self, decoder_kwargs: dict[str, Any], keep: torch.Tensor, layer: int) -> None:
        """Called once per applied stage, right before ``layers[layer]`` runs on the shorter sequence, with the kept
        rows ``keep`` (on the model's device) and the layer's keyword arguments: shorten any per-token state of the
        family's own here (nothing by default). One prompt: ``keep`` is ``[k]``, indices into the sequence that
        entered the stage, sorted. A batch (``B > 1``, re-packed): ``keep`` is ``[B, W]``, row b holds sample b's
        kept rows of the sequence that entered the stage (its padded row), ascending and right-aligned after
        ``-1``s (the new left padding)."""
        return None
