"""The one gateway to NVML: starts it on first use and turns every refusal into a reason.

No caller handles NVML errors itself: `call` returns a `Reading` whose value is None and whose
reason says why (no library, no driver, not supported, no permission, ...). NVML never
initializes CUDA, so everything built on this module is fork-safe.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

_lock = threading.Lock()
_state: dict[str, Any] = {"started": False, "error": None, "module": None}


@dataclass(frozen=True)
class Reading:
    """A value read from NVML, or None with the reason it could not be read."""

    value: Any = None
    reason: str | None = None

    @property
    def ok(self) -> bool:
        return self.reason is None


def _describe(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    return text.strip()


def start() -> Reading:
    """Initialize NVML once per process; the Reading's value is the pynvml module."""
    with _lock:
        if _state["started"]:
            return Reading(_state["module"]) if _state["error"] is None else Reading(None, _state["error"])
        _state["started"] = True
        try:
            import pynvml  # nvidia-ml-py
        except ImportError as exc:  # pragma: no cover - depends on the install
            _state["error"] = f"nvidia-ml-py is not installed ({exc}); pip install nvidia-ml-py"
            return Reading(None, _state["error"])
        try:
            pynvml.nvmlInit()
        except Exception as exc:  # NVMLError_LibraryNotFound, DriverNotLoaded, ...
            _state["error"] = f"NVML unavailable: {_describe(exc)}"
            return Reading(None, _state["error"])
        _state["module"] = pynvml
        return Reading(pynvml)


def call(fn: Callable[..., Any] | str, *args: Any) -> Reading:
    """Call an NVML function (a pynvml callable or its name); never raises."""
    started = start()
    if not started.ok:
        return started
    module = started.value
    func = getattr(module, fn, None) if isinstance(fn, str) else fn
    if func is None:
        return Reading(None, f"{fn} is not in this nvidia-ml-py version")
    try:
        return Reading(func(*args))
    except Exception as exc:
        return Reading(None, _describe(exc))


def constant(name: str, default: Any = None) -> Any:
    """An NVML constant by name, or `default` when NVML or the name is missing."""
    started = start()
    return getattr(started.value, name, default) if started.ok else default


def text(value: Any) -> Any:
    """NVML returns bytes in old bindings and str in new ones; make it str."""
    return value.decode() if isinstance(value, bytes) else value
