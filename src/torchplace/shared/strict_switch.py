"""The strict-mode switch: which strict checks are on for the running thread, and how each reports.

checks/ turns it (`torchplace.strict`, `setup(strict=...)`, TORCHPLACE_STRICT); memory's leak
tracker and amp's precision policy read `should_raise` from it, so it lives below them all.

A `strict()` block pushes its config on a per-thread stack; `TORCHPLACE_STRICT` sets a
process-wide config that threads without a block of their own use. The wrappers that run on
hot paths ask `active()` (one thread-local read) and do nothing more when it says None.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Literal

Action = Literal["warn", "error"]
ACTIONS = ("warn", "error")


@dataclass(frozen=True)
class StrictConfig:
    """One strict block's choices: for each check, "warn", "error", or None (off)."""

    placement: Action | None = "error"
    leaks: Action | None = "error"
    autocast: Action | None = "error"
    factories: Action | None = None
    syncs: Action | None = None
    model: Any = None  # names the root of module paths in mismatch reports


_local = threading.local()
_process: StrictConfig | None = None


def active() -> StrictConfig | None:
    """The innermost strict config of this thread, else the process-wide one, else None."""
    stack = getattr(_local, "stack", None)
    return stack[-1] if stack else _process


def push(config: StrictConfig) -> None:
    stack = _local.__dict__.setdefault("stack", [])
    stack.append(config)


def pop(config: StrictConfig) -> None:
    stack = _local.__dict__.get("stack", [])
    if stack and stack[-1] is config:
        stack.pop()
    elif config in stack:  # exited out of order (generators, threads): drop it anyway
        stack.remove(config)


def set_process(config: StrictConfig | None) -> None:
    global _process
    _process = config


def should_raise(explicit: bool | None = None) -> bool:
    """Should a problem found outside a strict check (a precision policy, a memory leak) raise?

    An explicit answer wins; else strict mode decides (`torchplace.strict`, `setup(strict=...)` or
    TORCHPLACE_STRICT): raise when its action is "error", warn otherwise.
    """
    if explicit is not None:
        return explicit
    config = active()
    return config is not None and config.autocast == "error"
