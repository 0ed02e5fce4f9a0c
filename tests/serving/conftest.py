"""The serving room's fixtures: the session's shared engines, the tiny checkpoint and its transformers twin
(``vllm_cases``, which imports vLLM only inside them: ``make test`` collects this room and skips it)."""

from vllm_cases import hf_model, not_freeing_engine, shared_engine, tiny_checkpoint  # noqa: F401
