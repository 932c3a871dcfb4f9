"""The one recorder of torch's device setters: who changes the current or the default device.

`guard` and strict's leak check both need to know who called torch's setters. Every public API
(`torch.cuda.set_device`, `torch.accelerator.set_device_index`, ...) goes through one of torch's
lowest-level setters (`torch._C._cuda_setDevice`, `_accelerator_setDeviceIndex`, looked up at call
time), and `torch.set_default_device` sets the factories' device. While at least one watcher
listens they are wrapped, once, for all watchers; after the last stops they are torch's own again,
so watching off costs nothing.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

CUDA = "cuda"  # torch._C._cuda_setDevice
ACCELERATOR = "accelerator"  # torch._C._accelerator_setDeviceIndex: whichever accelerator this torch drives
DEFAULT = "default"  # torch.set_default_device: the device of factory calls without one
_LOWEST = (("_cuda_setDevice", CUDA), ("_accelerator_setDeviceIndex", ACCELERATOR))

# called before a setter runs, with the setter's kind; what it returns (if anything) is called after
Watcher = Callable[[str], Callable[[], None] | None]

_watchers: dict[Watcher, int] = {}  # each watcher with how many times it was added
_saved: list[tuple[Any, str, Any, Any]] = []  # (owner, name, torch's function, our wrapper)
_lock = threading.Lock()
_local = threading.local()


def _targets() -> list[tuple[Any, str, str]]:
    """(owner, attribute, kind) of the setters this torch has."""
    low = [(torch._C, name, kind) for name, kind in _LOWEST if hasattr(torch._C, name)]
    return [*low, (torch, "set_default_device", DEFAULT)]


def watch(watcher: Watcher) -> None:
    """Call WATCHER on every setter call from now on (until as many `unwatch` calls)."""
    with _lock:
        _watchers[watcher] = _watchers.get(watcher, 0) + 1
        if _saved:
            return
        for owner, name, kind in _targets():
            original = getattr(owner, name)
            wrapper = _wrap(original, kind)
            setattr(owner, name, wrapper)
            _saved.append((owner, name, original, wrapper))


def unwatch(watcher: Watcher) -> None:
    """Undo one `watch(WATCHER)`; torch's own setters are back after the last watcher leaves."""
    with _lock:
        count = _watchers.pop(watcher, 0) - 1
        if count > 0:
            _watchers[watcher] = count
        if _watchers:
            return
        for owner, name, original, wrapper in reversed(_saved):
            if getattr(owner, name, None) is wrapper:  # someone patched over us: leave theirs in place
                setattr(owner, name, original)
        _saved.clear()


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Setter calls of this thread inside the block are not reported: torchplace's own scopes and
    restores, which put back what they change."""
    _local.depth = getattr(_local, "depth", 0) + 1
    try:
        yield
    finally:
        _local.depth -= 1


def _wrap(original: Callable[..., Any], kind: str) -> Callable[..., Any]:
    @functools.wraps(original)
    def setter(*args: Any, **kwargs: Any) -> Any:
        if getattr(_local, "depth", 0):
            return original(*args, **kwargs)
        after = [done for watcher in tuple(_watchers) if (done := watcher(kind)) is not None]
        result = original(*args, **kwargs)
        for done in after:
            done()
        return result

    return setter


def leak_message(what: str, before: int | None, after: int, sites: list[str], device_type: str = "cuda") -> str:
    """The sentence a leaked current-device change produces: who, from what to what, where, and the fix."""
    start = f"{device_type}:{before if before is not None else 0}"
    where = f"; the change was made at {sites[-1]}" if sites else ""
    return (f"{what} changed the current device from {start} to {device_type}:{after} and did not restore it"
            f"{where}; torchplace restored {start}.\nFix: scope the change with `with torchplace.on(...)` or "
            f"`with torch.{device_type}.device(...)`, or pass the device explicitly instead of setting it.")
