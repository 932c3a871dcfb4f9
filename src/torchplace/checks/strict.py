"""`torchplace.strict(...)`: report device mistakes as they happen, as warnings or errors.

    with torchplace.strict():                # or TORCHPLACE_STRICT=1 for a whole program
        train(model, loader)

checks, each "error" (default), "warn", or off:
- placement: `.cuda()` without an index, `.to("cuda")`, `.to(torch.device("cuda"))`: where
  they land depends on the thread's current device (implicit_device.py);
- factories (off by default: it runs a per-op mode, for debugging runs): factory calls that
  omit the device, or give one without an index (implicit_device.py);
- mismatch: an op mixing devices raises DeviceMismatchError naming the op, each tensor (device,
  dtype, shape, parameter/buffer/batch key) and the module path (mismatch.py); always on;
- leaks: a function that changes the current (or default) device and returns without
  restoring it, named with file and line (device_leaks.py);
- autocast: `torch.autocast` for a device type none of the wrapped tensors are on (autocast.py);
- syncs (off by default): host-device synchronizations inside the block, through torch's own
  CUDA sync debug mode (so mark the hot loop: `with torchplace.strict(syncs=True): ...`).

Cost: nothing per op (except factories=True). While on, the checks are wrappers around a few
torch functions and one-shot module hooks; a device mismatch is diagnosed only after PyTorch
has raised it. Off, torch's own functions are in place: zero cost (`torchplace bench strict`
measures both).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Mapping
from contextlib import ContextDecorator
from types import TracebackType
from typing import Any

import torch

from ..errors import TorchplaceError
from ..shared import setters, strict_switch
from ..shared.strict_switch import ACTIONS, Action, StrictConfig
from . import autocast as autocast_check
from . import boundary, deferred, device_leaks, implicit_device
from .watch import Watch

ENV = "TORCHPLACE_STRICT"
Check = bool | str | None

# torch's attributes swapped for checking wrappers while at least one strict user needs them: installed on
# the first `acquire()`, restored on the last `release()`, so when strict mode is off torch's own functions
# are in place and "off" costs exactly nothing
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


_PATCHES = PatchSet(lambda: implicit_device.patches() + autocast_check.patches())
_BOUNDARY = PatchSet(boundary.patches)


class Strict(ContextDecorator):
    """The context `strict(...)` returns. Per thread; nests; also works as a decorator."""

    def __init__(self, config: StrictConfig) -> None:
        self.config = config
        self._entry: dict[str, Any] = {}
        self._seq = 0
        self._sync_mode: int | None = None
        self._factories: implicit_device.FactoryCheck | None = None

    def _recreate_cm(self) -> Strict:  # a decorated function gets a fresh context per call
        return Strict(self.config)

    def __enter__(self) -> Strict:
        strict_switch.push(self.config)
        _PATCHES.acquire()
        setters.watch(device_leaks.on_set)
        if self.config.leaks:
            self._entry, self._seq = device_leaks.snapshot(), device_leaks.next_seq()
        self._sync_mode = _set_sync_mode(self.config.syncs)
        if self.config.factories:
            self._factories = implicit_device.FactoryCheck(self.config.placement, self.config.factories)
            self._factories.__enter__()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> bool:
        try:
            if self._factories is not None:
                self._factories.__exit__(exc_type, exc, tb)
            if self._sync_mode is not None:
                torch.cuda.set_sync_debug_mode(self._sync_mode)  # cuda-only: sync debug mode is CUDA's alone
            if self.config.leaks:  # while an error is already propagating, a leak is only a warning
                device_leaks.check_block(self._entry, self._seq, self.config.leaks if exc is None else "warn")
        finally:
            strict_switch.pop(self.config)
            _PATCHES.release()
            setters.unwatch(device_leaks.on_set)
            if strict_switch.active() is None:
                deferred.cancel_all()  # an autocast block that never reached a module: no one to check now
        return Watch(self.config.model).__exit__(exc_type, exc, tb)  # a mismatch named as watch() names it


def strict(action: Action = "error", *, model: torch.nn.Module | None = None, placement: Check = True,
           leaks: Check = True, autocast: Check = True, factories: Check = False,
           syncs: Check = False) -> Strict:
    """Turn on torchplace's device checks for the block (see the module docstring).

    Checks: `placement` (`.cuda()` or `.to("cuda")` without an index), `leaks` (a function that
    changes the current device and does not restore it), `autocast` (an autocast for a device type
    none of the tensors are on), `factories` (factory calls without a device; off by default: it
    costs a little per op), `syncs` (host-device synchronizations; off by default). A device
    mismatch always raises `DeviceMismatchError` naming the module, tensor and parameter.
    `TORCHPLACE_STRICT=1` turns the same on for a whole program.

    Args:
        action: "error" (raise) or "warn" (warn and go on), for every check given as True.
        model: the root module that mismatch reports name paths from.
        placement: True (follow `action`), "error", "warn", or False (off).
        leaks: as `placement`.
        autocast: as `placement`.
        factories: as `placement`; default off.
        syncs: as `placement`; default off.

    Returns:
        A `Strict` context manager (per thread, nests, also a decorator).

    Raises:
        ValueError: an `action` or check value other than those above.
        TypeError: `model` is not an `nn.Module`.
        DeviceMismatchError: inside the block, an op mixed devices.
        StrictWarning: (a warning) or a `TorchplaceError` inside the block, from a check that found
            a mistake.

    Example:
        ```python
        import torch
        import torchplace as tp

        model = torch.nn.Linear(4, 2)
        with tp.strict(model=model):
            model(torch.randn(3, 4))  # fine; `.to("cuda")` here would be reported
        ```
    """
    return Strict(make_config(action, model=model, placement=placement, leaks=leaks, autocast=autocast,
                              factories=factories, syncs=syncs))


def make_config(action: str, model: torch.nn.Module | None = None, *, placement: Check = True,
                leaks: Check = True, autocast: Check = True, factories: Check = False,
                syncs: Check = False) -> StrictConfig:
    """A validated StrictConfig from strict()'s arguments."""
    checks = {"placement": placement, "leaks": leaks, "autocast": autocast, "factories": factories, "syncs": syncs}
    if action not in ACTIONS:
        raise ValueError(f"strict(action={action!r}): use 'error' (raise) or 'warn' (warn and go on); "
                         "as a decorator, write @torchplace.strict() with the parentheses.")
    if model is not None and not isinstance(model, torch.nn.Module):
        raise TypeError(f"strict(model=...) takes an nn.Module, got {type(model).__name__}.")
    resolved: dict[str, Any] = {}
    for name, value in checks.items():
        if value is True:
            resolved[name] = action
        elif value in (False, None):
            resolved[name] = None
        elif value in ACTIONS:
            resolved[name] = value
        else:
            raise ValueError(f"strict({name}={value!r}): use True (follow action={action!r}), 'error', 'warn' "
                             "or False.")
    return StrictConfig(model=model, **resolved)


def config_from_env(value: str | None) -> StrictConfig | None:
    """Parse TORCHPLACE_STRICT: "1"/"error" or "warn", plus "factories", "syncs" (comma-separated)."""
    words = [w.strip().lower() for w in (value or "").split(",") if w.strip()]
    if not words or words[0] in ("0", "off", "false", "no"):
        return None
    action, extra = "error", {}
    for word in words:
        if word in ("1", "on", "true", "yes", "error"):
            action = "error"
        elif word == "warn":
            action = "warn"
        elif word in ("factories", "syncs"):
            extra[word] = True
        else:
            raise TorchplaceError(
                f"{ENV}={value!r}: {word!r} is not understood. Accepted: '1' or 'error' (raise), 'warn', and the "
                f"optional checks 'factories' and 'syncs', comma-separated. Fix: e.g. {ENV}=warn,factories, or "
                f"unset {ENV} to turn strict mode off.")
    return make_config(action, **extra)


def enable_from_env(environ: Mapping[str, str] | None = None) -> StrictConfig | None:
    """Turn strict mode on for the whole process when TORCHPLACE_STRICT asks for it."""
    config = config_from_env((os.environ if environ is None else environ).get(ENV))
    if config is not None:
        enable(config)
    return config


def enable(config: StrictConfig) -> None:
    """Strict mode for every thread without a strict() block of its own, until disable()."""
    if strict_switch._process is not None:
        disable()
    strict_switch.set_process(config)
    _PATCHES.acquire()
    setters.watch(device_leaks.on_set)
    _BOUNDARY.acquire()
    _set_sync_mode(config.syncs)


def disable() -> None:
    """Undo enable()."""
    config = strict_switch._process
    if config is None:
        return
    strict_switch.set_process(None)
    if config.syncs and torch.cuda.is_available():  # cuda-only: sync debug mode exists for CUDA alone in torch
        torch.cuda.set_sync_debug_mode(0)  # cuda-only: sync debug mode exists for CUDA alone in torch
    _BOUNDARY.release()
    setters.unwatch(device_leaks.on_set)
    _PATCHES.release()


def is_enabled() -> bool:
    """True when strict mode is on for this thread (a block or the environment switch)."""
    return strict_switch.active() is not None


def _set_sync_mode(action: str | None) -> int | None:
    """Torch's CUDA sync debug mode for `action`; returns the previous mode (None: untouched)."""
    if not action or not torch.cuda.is_available():  # cuda-only: sync debug mode exists for CUDA alone in torch
        return None
    previous = torch.cuda.get_sync_debug_mode()  # cuda-only: sync debug mode exists for CUDA alone in torch
    torch.cuda.set_sync_debug_mode("warn" if action == "warn" else "error")  # cuda-only: CUDA's alone in torch
    return previous
