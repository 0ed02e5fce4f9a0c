"""The layout of one request: how many prompt rows enter each decoder layer, from the prompt's labels and the policy
alone (``plan_layout``). Torch (host) only, no engine.

A serving engine needs this before the request's forward and without the device: the vLLM plugin builds every
compacted layer's attention metadata for a whole step from these host integers (``macer.core.steps``), and a KV cache
manager that frees the dropped tokens' pages (issue 29) sizes a request from them when it arrives. ``plan_prefill``
(``macer.core.policy``) starts from the same function, so the two agree by construction; it adds what the stages need
on the device (question rows, random picks, temporal chunks).

``plan_layout`` refuses (``ValueError``, the same messages in both engines) a prompt the policy cannot prune:

* the question rows are not after every audio/video row (``macer.core.policy.question_rows``);
* the prompt's last row is an audio/video row and the policy drops audio/video rows. The next token is predicted
  from the last row: a selection that may drop it (FastV's joint top-k, the random rule: neither reads question rows)
  would predict from another row (transformers) or from a zero row (vLLM). Text rows are never dropped, so a prompt
  ending in text (every chat template's assistant header) is safe; MACER's question rows already come after every
  media row.
"""

from __future__ import annotations

from dataclasses import dataclass

from macer.core.policy import AUDIO, VISUAL, Policy, PromptFacts, check_prunable, policy_layout
from macer_kernels import Budget

__all__ = ["RequestLayout", "plan_layout", "unpruned_layout"]


@dataclass(frozen=True)
class RequestLayout:
    """Prompt rows entering each decoder layer of one request, on the host.

    Attributes:
        prompt_len: N, the prompt's length.
        layer_tokens: prompt rows entering each decoder layer (``N`` everywhere for an unpruned request).
        budget: the retained budget, or None (no audio/video, or served unpruned).
        note: why the request is served unpruned (a refusal), else None.
    """

    prompt_len: int
    layer_tokens: tuple[int, ...]
    budget: Budget | None = None
    note: str | None = None

    @property
    def pruned(self) -> bool:
        return any(tokens != self.prompt_len for tokens in self.layer_tokens)

    def drop(self, layer: int) -> int:
        """D: prompt rows the stages dropped before decoder layer index ``layer``."""
        return self.prompt_len - self.layer_tokens[layer]


def unpruned_layout(prompt_len: int, num_layers: int, note: str | None = None) -> RequestLayout:
    """Every layer sees the whole prompt (text only, a refused plan, keep ratio 1)."""
    return RequestLayout(prompt_len, (prompt_len,) * num_layers, None, note)


def plan_layout(policy: Policy, facts: PromptFacts) -> RequestLayout:
    """The request's layout (``facts.temporal`` is not read). Raises ``ValueError`` for a prompt the policy cannot
    prune (see the module docstring); an engine that cannot fail one request serves it with ``unpruned_layout``."""
    n, n_audio, n_video = facts.length, facts.count(AUDIO), facts.count(VISUAL)
    layout = policy_layout(policy, n - n_audio - n_video, n_audio, n_video, facts.num_layers)
    if not n_audio + n_video:
        return RequestLayout(n, layout.layer_tokens)
    check_prunable(policy, facts, layout.specs, layout.layer_tokens)
    return RequestLayout(n, layout.layer_tokens, layout.budget)
