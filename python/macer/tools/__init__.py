"""The tools: what a person runs MACER with, above both engines. ``docs/architecture.md`` draws the map.

``cli`` (the ``macer`` command line: parsing and dispatch; ``_cli_args`` its flags, ranges and up-front estimates),
``demo`` (``macer demo``: full prefill vs MACER on a random thinker or a local checkpoint), ``plots`` (the demo's and
the diagnostics' figures), ``diagnostics`` (the paper's attention diagnostics, ``macer diagnose``), ``cost`` (the
paper's cost model and exact run accounting), ``batching`` (left-padded batches of single-prompt inputs),
``synthetic/`` (random-weight Qwen-Omni thinkers, synthetic clips and tiny checkpoints).

The tools import the rooms (``macer.core``, ``macer.hf``, ``macer.vllm``) by their public names; no room imports a
tool, and the vLLM plugin never loads one. Their public names keep the names they had before this room:
``macer.cli``, ``macer.cost``, ``macer.batching``, ``macer.diagnostics``, ``macer.testing``, ``macer.testing_qwen3``
and ``macer.testing_omni`` re-export them (the same objects).
"""
