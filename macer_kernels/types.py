"""Small value types shared by the ops."""

from __future__ import annotations

from typing import NamedTuple


class Budget(NamedTuple):
    """Retained-token budget of one prefill: ``total = audio + video`` (Sec. 4, ``eq:capacity_split``)."""

    total: int
    audio: int
    video: int
