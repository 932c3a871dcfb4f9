"""One-shot checks that run at the next module call of the thread that asked for them.

Some checks can only judge later: an autocast block is entered before the tensors it wraps
exist; a helper that called `set_device` has to return before its change can be said to leak.
They ask for a deferred check; a global forward pre-hook is registered only while one is pending,
so a steady training step (nothing pending) runs without any hook.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

# a callback gets (module, args) and returns True when it is done
Callback = Callable[[torch.nn.Module, tuple[Any, ...]], bool]

_lock = threading.Lock()
_pending: dict[int, dict[Any, Callback]] = {}  # thread -> key (the callback's own id without one) -> callback
_handle: Any = None


def request(callback: Callback, key: Any = None) -> None:
    """Run `callback` at this thread's next module calls until it returns True.

    With a `key`, a callback already pending under that key is replaced, so a loop that asks
    again and again (autocast entered every step) never piles callbacks up.
    """
    global _handle
    with _lock:
        callbacks = _pending.setdefault(threading.get_ident(), {})
        key = id(callback) if key is None else key
        callbacks.pop(key, None)  # the new one runs last, as the latest request
        callbacks[key] = callback
        if _handle is None:
            _handle = torch.nn.modules.module.register_module_forward_pre_hook(_hook)


def cancel(callback: Callback) -> None:
    with _lock:
        callbacks = _pending.get(threading.get_ident(), {})
        for key in [k for k, cb in callbacks.items() if cb is callback]:
            del callbacks[key]
        _drop_empty()


def cancel_all() -> None:
    """Drop every check pending for this thread (strict mode ended for it)."""
    with _lock:
        _pending.pop(threading.get_ident(), None)
        _drop_empty()


def pending() -> int:
    """How many checks wait for this thread's next module call."""
    return len(_pending.get(threading.get_ident(), ()))


def _hook(module: torch.nn.Module, args: tuple[Any, ...]) -> None:
    callbacks = _pending.get(threading.get_ident())
    if not callbacks:
        return
    for callback in list(callbacks.values()):
        try:
            done = callback(module, args)
        except BaseException:
            cancel(callback)
            raise
        if done:
            cancel(callback)


def _drop_empty() -> None:
    global _handle
    for tid in [t for t, cbs in _pending.items() if not cbs]:
        del _pending[tid]
    if not _pending and _handle is not None:
        _handle.remove()
        _handle = None
