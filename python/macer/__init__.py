"""macer: staged token selection inside a decoder's prefill (the model layer over ``macer_kernels``).

```python
import macer
config = macer.MacerConfig.for_model(model, keep_ratio=0.25)   # the paper's defaults for this model
with macer.compress(model, config) as trace:                    # or any policy: macer.make_policy("fastv", ...)
    out = model.generate(**inputs, max_new_tokens=64)
trace.budget, trace.audio_kept, trace.video_kept, trace.layer_tokens, trace.cache_lengths
```
Layout (``docs/architecture.md``): ``core`` (engine-independent: the policy interface and host plan, the stage,
the prefill state, ``MacerConfig``, the policies, the model families' config facts), ``hf`` (the transformers engine:
``compress``, its session, adapters, trace), ``vllm`` (the vLLM plugin); above them ``tools`` (the command line and
demo, diagnostics, the cost model, batching, the synthetic models; public as ``macer.cli``, ``macer.diagnostics``,
``macer.cost``, ``macer.batching``, ``macer.testing``, ``macer.testing_qwen3``, ``macer.testing_omni``) and ``eval``
(lmms-eval). See ``docs/integration.md``.
"""

import importlib
from typing import Any

from macer.core.config import PAPER_DEFAULTS, MacerConfig, paper_defaults
from macer.core.policies import ABLATIONS, POLICY_NAMES, FastVConfig, FullConfig, RandomConfig, make_policy
from macer.core.policy import AUDIO, TEXT, VISUAL, Policy

__all__ = [
    "ABLATIONS",
    "AUDIO",
    "MODEL_TYPE_TO_ADAPTER",
    "PAPER_DEFAULTS",
    "POLICY_NAMES",
    "SUPPORTED_ATTENTION",
    "TEXT",
    "VISUAL",
    "BatchLabelledAdapter",
    "FastVConfig",
    "FullConfig",
    "LabelledAdapter",
    "MacerConfig",
    "Policy",
    "PrefillRecord",
    "RandomConfig",
    "Stage",
    "Trace",
    "compress",
    "label_rows",
    "make_policy",
    "paper_defaults",
    "supported_model_types",
]

# The public names of the transformers engine and the tools, by the module that defines them, imported on first use
# (PEP 562): ``import macer.vllm`` imports this package first, and the plugin must load the core and itself only,
# never the transformers engine (``macer.hf``) or the tools.
_LAZY_NAMES = {
    "MODEL_TYPE_TO_ADAPTER": "macer.hf.adapters",
    "BatchLabelledAdapter": "macer.hf.adapters",
    "LabelledAdapter": "macer.hf.adapters",
    "label_rows": "macer.hf.adapters",
    "supported_model_types": "macer.hf.adapters",
    "SUPPORTED_ATTENTION": "macer.hf.compress",
    "compress": "macer.hf.compress",
    "PrefillRecord": "macer.hf.trace",
    "Stage": "macer.hf.trace",
    "Trace": "macer.hf.trace",
    "DiagnosticReport": "macer.tools.diagnostics",
    "diagnose": "macer.tools.diagnostics",
}

# Submodules that the docs and error messages cite as ``macer.<name>.<attr>`` after a plain ``import macer``, imported
# on first use too: none of them is loaded until it is named.
_LAZY_SUBMODULES = ("batching", "cost", "testing", "testing_qwen3")


def __getattr__(name: str) -> Any:
    if name in _LAZY_NAMES:
        value = getattr(importlib.import_module(_LAZY_NAMES[name]), name)
        globals()[name] = value  # found directly from now on
        return value
    if name in _LAZY_SUBMODULES:
        return importlib.import_module(f"macer.{name}")
    raise AttributeError(f"module 'macer' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY_NAMES, *_LAZY_SUBMODULES})
