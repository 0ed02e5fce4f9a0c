"""The engine-independent core of macer: torch and ``macer_kernels`` only (no transformers, no vLLM).

``policy`` (the policy interface and the host plan of one prefill), ``stage`` (the device work of one stage),
``prefill`` (the state of one prefill as its stages run), ``transfer`` (the prefill's host/device copies), ``config``
(``MacerConfig``), ``policies`` (FastV, Random, full, the ablations, ``make_policy``), ``families`` (what a model
family's config says: row labels, end-of-turn id, the paper's defaults), ``checks`` (argument checks). Both engines,
``macer.hf`` (transformers) and ``macer.vllm``, are built on these modules; ``docs/architecture.md`` draws the map.
"""
