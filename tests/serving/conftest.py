"""The serving room's fixtures: the session's shared engines, the tiny checkpoint and its transformers twin
(``vllm_cases``, which imports vLLM only inside them: ``make test`` collects this room and skips it)."""

import pytest
from vllm_cases import hf_model, not_freeing_engine, shared_engine, tiny_checkpoint  # noqa: F401


@pytest.fixture(scope="module")
def want(tiny_checkpoint, hf_model):  # noqa: F811  (fixtures name the fixtures they take)
    """The parallel layouts' reference (``parallel_cases.reference``: each request of ``parallel_cases.requests()``
    alone on the TP=1 engine and through ``macer.compress``), once per test module, before its engines start."""
    from parallel_cases import reference

    return reference(tiny_checkpoint, hf_model)
