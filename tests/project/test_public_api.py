"""What a user calls, pinned: the public modules' names, the console script and ``python -m`` commands.

A move inside the package (a module into a room, a file renamed) must leave every name here where a user finds it:
the literal lists below are the public surface as the README and docs/ name it, so a rename that drops or adds a public
name fails here and has to be decided, not slipped in.
"""

from __future__ import annotations

import importlib
import subprocess
import sys
from importlib.metadata import entry_points

import pytest

PUBLIC = {
    "macer": [
        "ABLATIONS", "AUDIO", "BatchLabelledAdapter", "FastVConfig", "FullConfig", "LabelledAdapter",
        "MODEL_TYPE_TO_ADAPTER", "MacerConfig", "PAPER_DEFAULTS", "POLICY_NAMES", "Policy", "PrefillRecord",
        "RandomConfig", "SUPPORTED_ATTENTION", "Stage", "TEXT", "Trace", "VISUAL", "compress", "label_rows",
        "make_policy", "paper_defaults", "supported_model_types",
    ],
    "macer.cost": [
        "CostConstants", "DecoderFlops", "DecoderShape", "FASTV_PRUNE_LAYER", "METHOD_PRUNE_STYLE", "PAPER_CONSTANTS",
        "RunCost", "attention_share", "decoder_flops", "input_prune_flops_ratio", "kv_cache_bytes",
        "paper_flops_ratio", "policy_flops_ratio", "policy_layer_tokens", "policy_token_layer_proxy",
        "probe_prune_flops_ratio", "run_cost", "staged_layer_tokens", "token_layer_proxy", "trace_cost",
    ],
    "macer.batching": ["BATCHED_KEYS", "batch_inputs"],
    "macer.testing": [
        "SYNTHETIC_TOKENS", "SyntheticTokens", "TEXT_SHAPES", "batch_inputs", "build_omni_model", "build_thinker",
        "clip_inputs", "decoder_parts", "macer_config_for", "seeded_thinker", "thinker_config",
    ],
    "macer.testing_qwen3": [
        "audio_token_count", "build_qwen3_omni_model", "build_qwen3_thinker", "qwen3_clip_inputs",
        "qwen3_thinker_config",
    ],
    "macer.testing_omni": [
        "CHAT_TEMPLATE", "PATCH_SIZE", "QWEN25_OMNI_TOKENS", "QWEN3_OMNI_TOKENS", "SAMPLE_RATE", "chat_template",
        "check_head_size", "main", "omni_processor", "omni_tokenizer", "quiet_transformers", "qwen3_omni_processor",
        "save_checkpoint", "write_qwen25_omni", "write_qwen3_omni",
    ],
    "macer.diagnostics": ["DiagnosticReport", "default_policies", "diagnose", "gini"],
    "macer.cli": ["main"],
    "macer.eval": ["describe_policy", "policy_fields", "resolve_policy"],
    "macer.vllm": ["ARCHITECTURES", "register"],
    "macer_kernels": [
        "Budget", "MAX_MODALITIES", "PAD_LABEL", "StageModality", "available_backends", "backend_status",
        "check_count", "check_real", "compact", "compact_many", "coverage_select", "current_backend",
        "decimal_fraction", "modality_scores", "select_stage", "set_validation", "split_budget", "temporal_chunks",
        "topk_indices", "use_backend", "validation", "validation_enabled",
    ],
}
"""Public module -> its ``__all__`` (sorted)."""


MOVED = {
    "macer.cli": "macer.tools.cli",
    "macer.cost": "macer.tools.cost",
    "macer.batching": "macer.tools.batching",
    "macer.diagnostics": "macer.tools.diagnostics",
    "macer.testing": "macer.tools.synthetic.qwen2_5_omni",
    "macer.testing_qwen3": "macer.tools.synthetic.qwen3_omni",
    "macer.testing_omni": "macer.tools.synthetic.checkpoints",
}
"""The tools' old public names -> their home in the tools room (docs/architecture.md)."""


@pytest.mark.parametrize("name", sorted(PUBLIC))
def test_a_public_module_keeps_its_names(name):
    module = importlib.import_module(name)
    assert sorted(module.__all__) == PUBLIC[name]
    missing = [attr for attr in PUBLIC[name] if not hasattr(module, attr)]
    assert missing == []


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_name_gives_the_same_objects_as_its_home(old):
    """``from macer.cost import run_cost`` is ``macer.tools.cost.run_cost``, and so for every public name of every
    moved module; ``macer.cost`` after a plain ``import macer`` is the module ``import macer.cost`` gives."""
    import macer

    module, home = importlib.import_module(old), importlib.import_module(MOVED[old])
    assert module.__all__ == home.__all__
    assert [name for name in home.__all__ if getattr(module, name) is not getattr(home, name)] == []
    attribute = old.removeprefix("macer.")
    if attribute in macer._LAZY_SUBMODULES:
        assert getattr(macer, attribute) is module


def test_the_console_script_and_the_entry_points():
    """``macer`` on the command line runs ``macer.cli.main``; vLLM's plugin and lmms-eval's model keep their names."""
    import macer.cli

    groups = {group: {ep.name: ep for ep in entry_points(group=group) if ep.dist.name == "macer-kernels"}
              for group in ("console_scripts", "vllm.general_plugins", "lmms_eval.models")}
    assert groups["console_scripts"]["macer"].load() is macer.cli.main
    assert groups["vllm.general_plugins"]["macer"].value == "macer.vllm:register"
    assert groups["lmms_eval.models"]["macer_qwen2_5_omni"].value == "macer.eval.registry:manifests"


@pytest.mark.parametrize("command", [["-m", "macer", "--help"], ["-m", "macer.testing_omni", "--help"]],
                         ids=["macer", "testing_omni"])
def test_python_dash_m_commands(command):
    """``python -m macer`` (the console script) and ``python -m macer.testing_omni`` (docs/serving.md's tiny
    checkpoints) still start and print their help."""
    done = subprocess.run([sys.executable, *command], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "usage:" in done.stdout
