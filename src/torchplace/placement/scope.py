"""Device scopes: `on(device)` makes a device current for a block; `guard` catches leaks.

A helper that calls `torch.cuda.set_device(1)` and returns silently moves every later
`.cuda()`, `torch.device("cuda")` and NCCL call of that thread. `on` sets and always restores;
`guard` notices a change that was not restored, says who made it (file and line), restores the
previous device, and warns or raises. Both are per thread, like the CUDA runtime's current device.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from collections.abc import Callable
from typing import Any, TypeVar, overload

import torch

from ..errors import DeviceLeakError, DeviceLeakWarning
from ..hardware.accelerator import accelerator_type, current_index, device_module
from ..policy.devices import DeviceSpec
from ..shared import frames as user_code
from ..shared import setters
from ..shared.setters import leak_message

F = TypeVar("F", bound=Callable[..., Any])


def _backend(device_type: str) -> Any:
    """torch's device module of an indexed back end (cuda, xpu, a vendor's npu ...), or None."""
    mod = device_module(device_type)
    return mod if mod is not None and hasattr(mod, "set_device") and hasattr(mod, "current_device") else None


class on(contextlib.ContextDecorator):
    """Make DEVICE current inside the block (or decorated function), restored on exit.

    Unlike `torch.cuda.set_device`, the change cannot leak: the previous current device of this
    thread is restored however the block ends.

    Args:
        device: any `torchplace.device` spec.
        factories: also make factory calls without a device (`torch.zeros(3)`) allocate on it,
            through torch's own `torch.device` context (costs a little on every op).

    A context manager that also works as a decorator.

    Raises:
        DeviceError: the device does not exist here.

    Example:
        ```python
        import torch
        import torchplace as tp

        with tp.on("cpu", factories=True):
            x = torch.zeros(3)  # allocated on the device of the block
        print(x.device)
        ```
    """

    def __init__(self, device: DeviceSpec, *, factories: bool = False) -> None:
        from ..policy.devices import device as resolve_device

        self.device = resolve_device(device)
        self.factories = factories
        self._local = threading.local()

    def _stack(self) -> list[tuple[int | None, Any]]:
        if not hasattr(self._local, "stack"):
            self._local.stack = []
        return self._local.stack

    def __enter__(self) -> torch.device:
        mod = _backend(self.device.type) if self.device.index is not None else None
        previous = None
        if mod is not None:
            previous = int(mod.current_device())
            with setters.quiet():  # put back on exit: not a change for guard or strict to report
                mod.set_device(self.device.index)
        ctx = torch.device(self.device) if self.factories else None
        if ctx is not None:
            ctx.__enter__()
        self._stack().append((previous, ctx))
        return self.device

    def __exit__(self, *exc: Any) -> None:
        previous, ctx = self._stack().pop()
        if ctx is not None:
            ctx.__exit__(*exc)
        if previous is not None:
            with setters.quiet():
                _backend(self.device.type).set_device(previous)


_sites: dict[int, list[str]] = {}  # per thread: where the current device was set while a guard watches


def _record_site(kind: str) -> None:
    """setters' watcher for guard: note 'file:line in function' of the first frame outside torch and torchplace."""
    if kind != setters.DEFAULT:
        _sites.setdefault(threading.get_ident(), []).append(user_code.site(user_code.user_frame()))


class Guard(contextlib.ContextDecorator):
    """The block or function `guard` watches (made by `guard`; see there)."""

    action: str
    device_type: str

    def __init__(self, *, action: str = "warn", device_type: str | None = None) -> None:
        if action not in ("warn", "raise"):
            raise ValueError(f"guard(action={action!r}): use 'warn' or 'raise'.")
        # by default the accelerator this torch drives (cuda, xpu, a vendor's npu ...)
        self.action, self.device_type = action, device_type or accelerator_type() or "cuda"
        self.what = "guarded block"
        self._local = threading.local()

    def __call__(self, fn: F) -> F:
        code = getattr(fn, "__code__", None)
        where = f" ({code.co_filename}:{code.co_firstlineno})" if code else ""
        self.what = f"{getattr(fn, '__qualname__', fn)}{where}"
        return super().__call__(fn)

    def __enter__(self) -> Guard:
        stack = self._local.__dict__.setdefault("stack", [])
        stack.append(current_index(self.device_type))
        setters.watch(_record_site)
        _sites.pop(threading.get_ident(), None)
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        before = self._local.stack.pop()
        sites = _sites.pop(threading.get_ident(), [])
        setters.unwatch(_record_site)
        after = current_index(self.device_type)
        if after is None or after == (before if before is not None else 0):
            return None
        with setters.quiet():
            _backend(self.device_type).set_device(before if before is not None else 0)
        message = leak_message(self.what, before, after, sites, self.device_type)
        if self.action == "raise" and exc_type is None:
            raise DeviceLeakError(message)
        warnings.warn(message, DeviceLeakWarning, stacklevel=2)
        return None


@overload
def guard(fn: F, *, action: str = ..., device_type: str | None = ...) -> F: ...


@overload
def guard(fn: None = None, *, action: str = ..., device_type: str | None = ...) -> Guard: ...


def guard(fn: Callable[..., Any] | None = None, *, action: str = "warn", device_type: str | None = None) -> Any:
    """Detect code that changes the current device without restoring it.

    On a leak the previous device is restored, then a `DeviceLeakWarning` is issued
    (`action="warn"`, the default) or a `DeviceLeakError` raised (`action="raise"`).

    Args:
        fn: the function to guard when used as a bare decorator (`@guard`).
        action: "warn" (restore, then warn) or "raise" (restore, then raise).
        device_type: the device type whose current device is watched (default: the accelerator this
            torch drives, as torch.accelerator names it: "cuda", "xpu", a vendor's "npu" ...).

    Returns:
        The guarded function (as a decorator), or a context manager (`with guard(): ...`).

    Raises:
        DeviceLeakError: with `action="raise"`, when the block left another device current.
        ValueError: `action` is neither "warn" nor "raise".

    Example:
        ```python
        import torchplace as tp

        @tp.guard(action="raise")
        def train_step(batch):
            return batch  # a helper calling torch.cuda.set_device(1) here would be caught

        with tp.guard():
            train_step(1)
        ```
    """
    g = Guard(action=action, device_type=device_type)
    return g(fn) if fn is not None else g
