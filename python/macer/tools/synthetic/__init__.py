"""Random-weight Qwen-Omni models and synthetic prompts, built in code (no processor, no download): what ``macer demo``,
``macer diagnose``, the tests and the benchmarks run on. Not test code: a tool.

``qwen2_5_omni`` (public as ``macer.testing``: ``build_thinker``, ``clip_inputs``, ...), ``qwen3_omni`` (public as
``macer.testing_qwen3``), ``base`` (what both families share: the synthetic vocabulary, config fields, the seeded build,
the clip skeleton), ``checkpoints`` (tiny checkpoints on disk with the real vocabulary and processor files, for vLLM;
public as ``macer.testing_omni``).
"""
