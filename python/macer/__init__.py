"""macer: staged MACER pruning inside a decoder's prefill (the model layer over ``macer_kernels``).

```python
import macer
config = macer.MacerConfig.for_model(model, keep_ratio=0.25)   # the paper's defaults for the model's scale
with macer.compress(model, config) as trace:
    out = model.generate(**inputs, max_new_tokens=64)
trace.budget, trace.audio_kept, trace.video_kept, trace.layer_tokens, trace.cache_lengths
```
See ``docs/integration.md`` for how it hooks into transformers and what is supported.
"""

from macer.adapters import supported_model_types
from macer.config import PAPER_DEFAULTS, MacerConfig
from macer.diagnostics import DiagnosticReport, diagnose  # noqa: F401  (re-exported: macer.diagnose)
from macer.patch import SUPPORTED_ATTENTION, compress
from macer.trace import PrefillRecord, Stage, Trace

__all__ = [
    "PAPER_DEFAULTS",
    "SUPPORTED_ATTENTION",
    "MacerConfig",
    "PrefillRecord",
    "Stage",
    "Trace",
    "compress",
    "supported_model_types",
]
