"""Per-request MACER settings: a request may set its own keep ratio and policy through vLLM's per-request extra
arguments (``SamplingParams(extra_args=...)``; ``vllm_xargs`` in the OpenAI API, which takes flat keys only)::

    SamplingParams(max_tokens=64, extra_args={"macer_keep_ratio": 0.5, "macer_policy": "random"})
    client.completions.create(..., extra_body={"vllm_xargs": {"macer_keep_ratio": 0.5}})

``REQUEST_KEYS`` are the only ``macer_*`` keys (another one is refused, naming them, and so is a nested
``{"macer": {...}}`` object, the shape of the engine's settings); keys without the prefix belong to other extensions
and are left alone. A request's policy is the engine's settings (``additional_config["macer"]``) with
``policy`` and ``keep_ratio`` replaced by the request's (``request_policy``); when the request names another policy,
the engine's fields that policy's class does not have are dropped (a MACER engine's ``audio_layer`` for a
``"random"`` request), and ``"full"`` takes no keep ratio from the engine. Errors are the engine settings' own
messages (``macer.vllm.settings.policy_from_settings``: ``make_policy``'s), prefixed by the request key.

Checked twice: when the request arrives, in the frontend (``MacerRequestGuard.validate_params``: a ``ValueError``
there fails that request alone, HTTP 400 from the server), and when the model first plans the request (the engine's
settings are always there; a value refused only there is served unpruned with a WARNING record, since an error in
the model would stop the engine). The frontend has the engine's settings when the MACER config hook ran in its
process (``LLM(...)``, ``vllm serve``: ``remember_engine``); otherwise it checks names, types and ranges only.

A streaming-input session (``AsyncLLM.generate`` with a ``StreamingInput`` stream: vLLM's ``resumable`` requests)
grows its prompt under the same request id turn by turn, while MACER prunes a whole prompt once, in one step. The
MACER scheduler marks such a request's parameters when each turn arrives (``session_params``: the ``SESSION_KEY`` entry
in ``extra_args``, which the frontend never lets a client set), and its policy is then refused
(``RequestPolicies.for_request`` raises ``SESSION_REASON``): the worker serves the session without pruning from its
first turn, and the request's record says why.

Pure Python over the settings: this module does not import vLLM.
"""

from __future__ import annotations

import copy
import dataclasses
import numbers
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

from macer.core.checks import field_real
from macer.core.policies import ABLATION_FIELDS, POLICY_NAMES, policy_class
from macer.core.policy import Policy
from macer.vllm.settings import LABEL_KEYS, SETTINGS_KEY, WHERE, policy_from_settings

__all__ = ["REQUEST_KEYS", "SESSION_KEY", "SESSION_REASON", "RequestPolicies", "remember_engine", "remembered_engine",
           "remembered_engines", "request_overrides", "request_policy", "session_params"]

REQUEST_KEYS = ("macer_keep_ratio", "macer_policy")
"""The per-request keys of ``SamplingParams.extra_args`` / ``vllm_xargs``."""

SESSION_KEY = "macer_streaming_session"
"""The ``extra_args`` entry the MACER scheduler adds to a streaming-input session's parameters (``session_params``);
a client that sets it is refused like any unknown ``macer_*`` key."""

SESSION_REASON = ("a streaming-input session (a resumable request: AsyncLLM.generate with a StreamingInput stream) "
                  "grows its prompt under one request id turn by turn, and MACER prunes a whole prompt once, in one "
                  "step; the session is served unpruned from its first turn")
"""Why a streaming-input session is served unpruned (its record's note: ``served without pruning: <this>``)."""

_PREFIX = "macer_"
_ENGINE: list[tuple[Any, Any, str]] = []  # (settings, hf_config, architecture) of the MACER engines configured here
_MAX_ENGINES = 8


def _where(key: str) -> str:
    return f'vllm_xargs["{key}"]'


def request_overrides(extra_args: Mapping[str, Any] | None, default_policy: str = "macer") -> dict[str, Any]:
    """``{"policy": ..., "keep_ratio": ...}`` the request sets (empty: the engine's), checked without the engine's
    settings: key names, the policy's name, the keep ratio's type and range (the message of the policy's class:
    the request's policy, else ``default_policy``). ``ValueError`` names the key."""
    if not extra_args:
        return {}
    if SETTINGS_KEY in extra_args:
        raise ValueError(f'{_where(SETTINGS_KEY)}: per-request MACER settings are flat keys, not an object shaped like '
                         f'additional_config["{SETTINGS_KEY}"]: set "macer_keep_ratio" and/or "macer_policy" directly '
                         f'(extra_args={{"macer_keep_ratio": 0.5}}; vllm_xargs in the OpenAI API)')
    unknown = sorted(k for k in extra_args if isinstance(k, str) and k.startswith(_PREFIX) and k not in REQUEST_KEYS)
    if unknown:
        raise ValueError(f"{_where(unknown[0])}: unknown MACER request key(s) {unknown}; a request may set "
                         f"{list(REQUEST_KEYS)} (the engine's other settings come from additional_config"
                         f'["{SETTINGS_KEY}"])')
    out: dict[str, Any] = {}
    if "macer_policy" in extra_args:
        name = extra_args["macer_policy"]
        if not isinstance(name, str) or name not in POLICY_NAMES:
            raise ValueError(f'{_where("macer_policy")}: unknown policy {name!r}; known: {list(POLICY_NAMES)}')
        out["policy"] = name
    if "macer_keep_ratio" in extra_args:
        value = extra_args["macer_keep_ratio"]
        name = out.get("policy", default_policy)
        owner = policy_class(name).__name__
        try:
            if name == "full":
                if isinstance(value, bool) or not isinstance(value, numbers.Real) or value != 1.0:
                    raise ValueError(f"FullConfig.keep_ratio must be 1.0 (a real number: full keeps everything), "
                                     f"got {value!r}")
            else:
                value = field_real(owner, "keep_ratio", value, 0.0, 1.0, lo_open=True)
        except ValueError as error:
            raise ValueError(f'{_where("macer_keep_ratio")}={extra_args["macer_keep_ratio"]!r}: {error}') from None
        out["keep_ratio"] = float(value)
    return out


def request_policy(settings: Any, overrides: Mapping[str, Any], hf_config: Any, architecture: str) -> Policy:
    """The request's policy: the engine's ``settings`` with the request's ``overrides`` (``request_overrides``),
    parsed by ``policy_from_settings``; its ``ValueError``, prefixed by the request keys, for a bad combination."""
    merged = dict(settings) if isinstance(settings, Mapping) else {}
    engine_policy = merged.get("policy", "macer")
    name = overrides.get("policy", engine_policy)
    if name != engine_policy:
        # The engine's fields the request's policy class does not take (another policy's layers, an ablation's own).
        allowed = {f.name for f in dataclasses.fields(policy_class(name)) if f.init}
        allowed -= set(ABLATION_FIELDS.get(name, ()))
        merged = {k: v for k, v in merged.items() if k in allowed or k in LABEL_KEYS}
        if name == "full":
            merged.pop("keep_ratio", None)
    merged["policy"] = name
    if "keep_ratio" in overrides:
        merged["keep_ratio"] = overrides["keep_ratio"]
    try:
        return policy_from_settings(merged, hf_config, architecture)[0]
    except (ValueError, TypeError) as error:
        keys = ", ".join(f'{_where(_PREFIX + key)}={value!r}' for key, value in overrides.items())
        # The engine settings' own messages, said of the request's keys instead of where the engine's were set.
        problems = [str(p).removeprefix(f"{WHERE}: ") for p in getattr(error, "problems", [error])]
        raise ValueError(f"{keys}: {'; '.join(problems)}") from None


class RequestPolicies:
    """The policies of one engine's requests, by their overrides (``request_policy`` once per distinct setting, the
    last ``CACHE_SIZE`` kept).

    Args:
        settings, hf_config, architecture: the engine's ``additional_config["macer"]``, ``hf_config`` and
            architecture.
        default: the engine's policy (``policy_from_config``), served to requests that set nothing.
    """

    CACHE_SIZE = 256
    """The most request policies kept (least recently used out first): a client may send a new keep ratio with every
    request, and a cache keyed by them would grow without bound in the worker and the scheduler."""

    def __init__(self, settings: Any, hf_config: Any, architecture: str, default: Policy):
        self.settings, self.hf_config, self.architecture = settings, hf_config, architecture
        self.default = default
        self._cache: OrderedDict[tuple, Policy] = OrderedDict()

    def use_default(self, policy: Policy) -> None:
        """Serve the requests that set nothing with ``policy`` from now on."""
        self.default = policy
        self._cache.clear()

    def for_request(self, extra_args: Mapping[str, Any] | None) -> Policy:
        """The request's policy; ``ValueError`` (the request keys named) for a setting the engine cannot serve, and
        ``SESSION_REASON`` for a streaming-input session (``session_params``)."""
        if extra_args and SESSION_KEY in extra_args:
            raise ValueError(SESSION_REASON)
        overrides = request_overrides(extra_args, self.default.name or "macer")
        if not overrides:
            return self.default
        key = tuple(sorted(overrides.items()))
        if key in self._cache:
            self._cache.move_to_end(key)
            return self._cache[key]
        policy = self._cache[key] = request_policy(self.settings, overrides, self.hf_config, self.architecture)
        while len(self._cache) > self.CACHE_SIZE:
            self._cache.popitem(last=False)
        return policy


def remember_engine(settings: Any, hf_config: Any, architecture: str) -> None:
    """Keep the engine's settings in this process for the admission check (the config hook calls this). A process
    may build several MACER engines (``LLM(...)`` twice): the last ``_MAX_ENGINES`` are kept, newest last."""
    others = [engine for engine in _ENGINE if engine[0] is not settings][-(_MAX_ENGINES - 1):]
    _ENGINE[:] = [*others, (settings, hf_config, architecture)]


def remembered_engine() -> tuple[Any, Any, str] | None:
    """The last MACER engine configured in this process (``remember_engine``), or None."""
    return _ENGINE[-1] if _ENGINE else None


def remembered_engines() -> list[tuple[Any, Any, str]]:
    """The MACER engines configured in this process (``remember_engine``), newest last."""
    return list(_ENGINE)


def session_params(params: Any) -> Any:
    """A copy of a streaming-input session's ``SamplingParams`` whose ``extra_args`` carry ``SESSION_KEY`` (the MACER
    scheduler, for each turn of a ``resumable`` request: vLLM hands the turn's parameters to the worker with it). A
    copy: the caller's object may be shared with the frontend or reused for other requests."""
    if params is None or SESSION_KEY in (getattr(params, "extra_args", None) or {}):
        return params
    marked = copy.copy(params)
    marked.extra_args = {**(params.extra_args or {}), SESSION_KEY: True}
    return marked
