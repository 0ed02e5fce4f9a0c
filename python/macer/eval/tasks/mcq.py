"""Prompt, visual and scoring functions of the multiple-choice audio-visual tasks (``dailyomni``, ``avutbench``).

The task YAMLs beside this file read JSONL files written by ``macer.eval.prepare`` with one question per line:
``{"id", "video" (absolute path), "question", "options" (["A. ...", "B. ...", ...]), "answer" ("A".."Z"),
"category"}``. The prompt is Daily-Omni's published evaluation prompt (its ``test_model/Qwen2.5-Omni/testmodel.py``);
the score is the share of answers whose first standalone option letter is the gold letter, in percent.
"""

from __future__ import annotations

import re
import string
from typing import Any

__all__ = ["doc_to_target", "doc_to_text", "doc_to_visual", "parse_letter", "process_results"]


def doc_to_visual(doc: dict[str, Any]) -> list[str]:
    """The question's video file (its audio track is read by the model)."""
    return [doc["video"]]


def doc_to_text(doc: dict[str, Any], lmms_eval_specific_kwargs: dict[str, Any] | None = None) -> str:
    letters = ", ".join(string.ascii_uppercase[: len(doc["options"])])
    return ("Your task is to accurately answer multiple-choice questions based on the given video.\n"
            "Select the single most accurate answer from the given choices.\n"
            f"Question: {doc['question']}\n"
            f"Choices: {doc['options']}\n"
            f"Your answer should be a capital letter representing your choice: {letters}. "
            "Don't generate any other text.")


def doc_to_target(doc: dict[str, Any]) -> str:
    return doc["answer"]


def parse_letter(response: str, num_options: int) -> str | None:
    """The first option letter that stands alone in ``response`` (``"B"``, ``"(B)"``, ``"B. text"``), or None."""
    letters = string.ascii_uppercase[:num_options]
    match = re.search(rf"(?<![A-Za-z])([{letters}])(?![A-Za-z])", response.strip())
    return match.group(1) if match else None


def process_results(doc: dict[str, Any], results: list[str]) -> dict[str, float]:
    predicted = parse_letter(results[0], len(doc["options"]))
    return {"accuracy": 100.0 * (predicted == doc["answer"])}
