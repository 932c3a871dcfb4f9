"""Attributes of torch swapped for checking wrappers while at least one strict user needs them.

Installed on the first `acquire()`, restored on the last `release()`: when strict mode is off
torch's own functions are in place, so "off" costs exactly nothing.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

Wrapper = Callable[[Callable[..., Any]], Callable[..., Any]]
_INHERITED = object()


class PatchSet:
    """A reference-counted group of (owner, attribute name, wrapper factory) patches."""

    def __init__(self, patches: Callable[[], list[tuple[Any, str, Wrapper]]]) -> None:
        self._patches = patches  # a function, so optional targets are looked up at install time
        self._saved: list[tuple[Any, str, Any, Any]] = []
        self._count = 0
        self._lock = threading.Lock()

    @property
    def installed(self) -> bool:
        return self._count > 0

    def acquire(self) -> None:
        with self._lock:
            self._count += 1
            if self._count > 1:
                return
            for owner, name, wrap in self._patches():
                # a class may inherit the attribute (Tensor.to lives on TensorBase): then delete on release
                original = vars(owner).get(name, _INHERITED) if isinstance(owner, type) else getattr(owner, name)
                wrapper = wrap(getattr(owner, name))
                setattr(owner, name, wrapper)
                self._saved.append((owner, name, original, wrapper))

    def release(self) -> None:
        with self._lock:
            if self._count == 0:
                return
            self._count -= 1
            if self._count:
                return
            for owner, name, original, wrapper in reversed(self._saved):
                if (vars(owner).get(name) if isinstance(owner, type) else getattr(owner, name, None)) is not wrapper:
                    continue  # someone patched over us: leave theirs in place
                if original is _INHERITED:
                    delattr(owner, name)
                else:
                    setattr(owner, name, original)
            self._saved.clear()
