"""The transformers engine of macer: ``macer.compress`` runs a policy's stages inside every prefill of a Hugging Face
decoder, with hooks, an attention tap and compaction of the layers' inputs and caches. Built on ``macer.core``.

``compress`` (the entry point and its checks), ``session`` (the hooks and the prefill bracket of one context),
``plan`` (the host plan of a prefill), ``prefill`` (one prompt's prefill: ``macer.core.prefill.PrefillState`` with a
trace record, compacted layer kwargs and cache trimming), ``batch`` (a left-padded batch, re-packed after every
stage), ``decode`` (decode steps on pruned caches), ``inputs`` (the per-token layer kwargs a stage shortens),
``attention`` (the tapped attention function), ``cache`` (how transformers hands the KV cache around), ``trace``
(what a context did), ``adapters`` (one file per model family). ``docs/architecture.md`` draws the map.
"""
