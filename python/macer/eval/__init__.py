"""Evaluation with lmms-eval: the model ``macer_qwen2_5_omni`` for every policy, the AVUTBench / Daily-Omni task
YAMLs, and the table runner. Install (keeps your torch): ``pip install ".[eval]" && pip install --no-deps
"lmms-eval==0.7.3"``. See ``docs/evaluation.md``.

Modules: ``policy`` (``resolve_policy``: policy by name; ``describe_policy``: the policy that ran, as the sample
log records it), ``media`` (video file -> thinker inputs), ``registry`` (the ``lmms_eval.models`` entry point),
``lmms_model`` (the lmms-eval model; the only module that imports lmms_eval at import time), ``prepare`` (public
releases -> task folders), ``table`` (rows x benchmarks -> markdown), ``synthetic`` (tiny checkpoint and release
for smoke tests).
"""

from macer.eval.policy import describe_policy, policy_fields, resolve_policy

__all__ = ["describe_policy", "policy_fields", "resolve_policy"]
