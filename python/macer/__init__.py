"""macer: staged token selection inside a decoder's prefill (the model layer over ``macer_kernels``).

```python
import macer
config = macer.MacerConfig.for_model(model, keep_ratio=0.25)   # the paper's defaults for this model
with macer.compress(model, config) as trace:                    # or any policy: macer.make_policy("fastv", ...)
    out = model.generate(**inputs, max_new_tokens=64)
trace.budget, trace.audio_kept, trace.video_kept, trace.layer_tokens, trace.cache_lengths
```
Layout: ``policy`` (the policy interface and the host plan), ``config`` (``MacerConfig``), ``policies`` (FastV,
Random, full, the ablations, ``make_policy``), ``runtime`` (hooks, compaction, caches), ``adapters`` (one file per
model family), ``trace``, ``cost``, ``batching`` (left-padded batches of single-prompt inputs), ``testing``.
See ``docs/integration.md``.
"""

import importlib
from types import ModuleType

from macer.core.config import PAPER_DEFAULTS, MacerConfig, paper_defaults
from macer.core.policies import ABLATIONS, POLICY_NAMES, FastVConfig, FullConfig, RandomConfig, make_policy
from macer.core.policy import Policy
from macer.diagnostics import DiagnosticReport, diagnose  # noqa: F401  (re-exported: macer.diagnose)
from macer.hf.adapters import (
    AUDIO,
    MODEL_TYPE_TO_ADAPTER,
    TEXT,
    VISUAL,
    BatchLabelledAdapter,
    LabelledAdapter,
    label_rows,
    supported_model_types,
)
from macer.hf.compress import SUPPORTED_ATTENTION, compress
from macer.hf.trace import PrefillRecord, Stage, Trace

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

# Submodules that the docs and error messages cite as ``macer.<name>.<attr>`` after a plain ``import macer``. Imported
# on first use (PEP 562), so ``import macer`` stays what it was: none of them is loaded until it is named.
_LAZY_SUBMODULES = ("batching", "cost", "testing", "testing_qwen3")


def __getattr__(name: str) -> ModuleType:
    if name in _LAZY_SUBMODULES:
        return importlib.import_module(f"macer.{name}")
    raise AttributeError(f"module 'macer' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY_SUBMODULES})
