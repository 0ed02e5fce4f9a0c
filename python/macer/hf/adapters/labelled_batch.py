"""The labelled path for a batch: ``LabelledAdapter`` with one row of labels per prompt of a left-padded batch.

    adapter = macer.BatchLabelledAdapter(labels, temporal_positions=None, question_ends=[q0, q1, ...])
    with macer.compress(llm, config, adapter=adapter) as trace:
        llm.generate(inputs_embeds=embeds, attention_mask=mask, max_new_tokens=64)  # [B, N, D], left-padded
    trace.samples[b].video_kept  # rows of embeds[b], padding included

* ``labels``: ``[B, N]``, one row per prompt, aligned with the padded ``inputs_embeds`` (padding rows: 0, text).
* ``temporal_positions``: optional ``[B, N]``; only each prompt's visual rows are read (default: row index).
* ``question_ends``: optional, one position per prompt in its padded row (or None) of the token closing its turn.

Each row is checked as ``LabelledAdapter`` checks one prompt; the runtime strips each row's padding (from the
attention mask) and plans it exactly as that prompt alone (see docs/integration.md, "Batches").
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import torch
from torch import nn

from macer.hf.adapters.labelled import LabelledAdapter, as_tensor

__all__ = ["BatchLabelledAdapter"]


class BatchLabelledAdapter(LabelledAdapter):
    """``LabelledAdapter`` for a left-padded batch of ``B`` prompts (see the module docstring).

    Args:
        labels: ``[B, N]`` integers in {0 text, 1 audio, 2 visual}, one row per prompt of the padded batch.
        temporal_positions: optional ``[B, N]`` finite integer or floating times.
        question_ends: optional sequence of ``B`` positions (in ``[0, N]``, or None; ints, numpy integers or 0-d
            integer tensors; or a 1-D integer tensor / numpy array) of the token closing each prompt's turn, counted
            in its padded row.
    """

    batch_ready = True  # no per-token state of its own: the runtime's re-packing covers everything

    def __init__(self, labels: Any, temporal_positions: Any = None, question_ends: Sequence[int | None] | None = None):
        labels = torch.as_tensor(labels)
        if labels.ndim != 2 or labels.shape[0] == 0 or labels.shape[1] == 0:
            raise ValueError(f"BatchLabelledAdapter: labels must be a non-empty [B, N] tensor, got shape "
                             f"{tuple(labels.shape)}")
        batch, length = labels.shape
        if temporal_positions is not None:
            temporal_positions = as_tensor(temporal_positions)
            if tuple(temporal_positions.shape) != (batch, length):
                raise ValueError(f"BatchLabelledAdapter: temporal_positions must be [B={batch}, N={length}] like "
                                 f"labels, got shape {tuple(temporal_positions.shape)}")
        if question_ends is None:
            question_ends = [None] * batch
        if hasattr(question_ends, "tolist"):
            question_ends = question_ends.tolist()  # a 1-D tensor or numpy array of positions
        if not isinstance(question_ends, Sequence) or isinstance(question_ends, str) or len(question_ends) != batch:
            raise ValueError(f"BatchLabelledAdapter: question_ends must be a sequence of B={batch} positions (or "
                             f"None), got {question_ends!r}")
        # Each row is validated exactly as one prompt of the single-prompt path.
        self.rows = [LabelledAdapter(labels[b], None if temporal_positions is None else temporal_positions[b],
                                     question_ends[b]) for b in range(batch)]
        super().__init__(labels[0], None if temporal_positions is None else temporal_positions[0], question_ends[0])
        self.batch = batch
        self._batch_labels = torch.stack([row._labels for row in self.rows])
        self._batch_temporal = (None if temporal_positions is None
                                else torch.stack([cast(torch.Tensor, row._temporal) for row in self.rows]))
        self._question_ends = [row._question_end for row in self.rows]

    def _check_batch(self, batch: int) -> None:
        if batch != self.batch:
            raise ValueError(f"macer.compress: the prefill has {batch} rows but BatchLabelledAdapter was given "
                             f"labels for {self.batch}; give one row of labels per prompt of the batch (beam search "
                             "and num_return_sequences expand the batch: expand the labels the same way)")

    def check_batch(self, model: nn.Module, input_ids: torch.Tensor | None, root_kwargs: dict[str, Any]) -> None:
        embeds = root_kwargs.get("inputs_embeds")
        rows = input_ids if input_ids is not None else embeds
        if rows is not None:
            self._check_batch(rows.shape[0])

    def labels(self, model: nn.Module, input_ids: torch.Tensor | None) -> torch.Tensor:
        if input_ids is not None:
            self._check_length(input_ids.shape[-1])
            self._check_batch(input_ids.shape[0])
        return self._batch_labels

    def temporal_positions(self, decoder_kwargs: dict[str, Any], length: int) -> torch.Tensor | None:
        self._check_length(length)
        return self._batch_temporal

    def question_ends(self, batch: int, length: int) -> list[int | None]:
        self._check_length(length)
        self._check_batch(batch)
        return list(self._question_ends)
