"""Current-device changes that leak out of the function that made them, under strict mode.

Two kinds of "current device" decide where implicit placement lands, both per thread: the
backend's current device (`torch.cuda.set_device`, `torch.accelerator.set_device_index`) and
torch's default device for factories (`torch.set_default_device`). While strict mode watches
leaks, the functions that change them record who called (the frame, file and line). A change is
judged at the next module call (a deferred check, see deferred.py) and when the strict block
ends: if the function that made it has returned and the device was not put back, the change
leaked; the previous device is restored and the leak reported (DeviceLeakError or a warning),
naming the function, file and line. Left alone, as deliberate: a change made by a function
that is still running (a program's `main`), the first choice of a CUDA device in a process
that had not started CUDA yet (a DDP `setup(rank)`, accelerate), and torchplace's own scopes.

torchplace.guard (placement/scope.py) watches one block; this adds the function-level view
strict mode needs. Both hear the setters through shared/setters.py and share its message.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from types import FrameType
from typing import Any

import torch

from ..errors import DeviceLeakError, DeviceLeakWarning
from ..hardware.accelerator import accelerator_type, current_index, device_module
from ..shared import setters
from ..shared.setters import DEFAULT, leak_message
from ..shared.strict_switch import active
from . import deferred
from . import frames as fr
from .warn_or_raise import warn_or_raise


@dataclass
class Change:
    """One recorded change of a current device."""

    kind: str  # "cuda", another accelerator type, or DEFAULT
    before: Any  # index (None: backend not started yet) or torch.device (None: no default set)
    after: Any
    frame: FrameType | None  # the function that made it
    lineno: int
    action: str
    seq: int = 0
    deliberate: bool = False  # its function was still running at a deferred check: kept only to name it later

    @property
    def site(self) -> str:
        if self.frame is None:
            return "an unknown location"
        return str(fr.Site(self.frame.f_code.co_filename, self.lineno, self.frame.f_code.co_name))

    @property
    def function(self) -> str:
        return f"{self.frame.f_code.co_name}()" if self.frame is not None else "some code"


_local = threading.local()


def _changes() -> list[Change]:
    return _local.__dict__.setdefault("changes", [])


def on_set(kind: str) -> Callable[[], None] | None:
    """setters' watcher for strict: a change of a current device, read around the setter's call."""
    config = active()
    if config is None or not config.leaks:
        return None
    if kind != DEFAULT:
        kind = "cuda" if kind == setters.CUDA else accelerator_type() or "cuda"
    before, action = current(kind), config.leaks

    def after() -> None:
        now = current(kind)
        if not _same(kind, now, before):
            _record(kind, before, now, action)

    return after


def current(kind: str) -> Any:
    """The thread's current device of this kind, read without starting a backend."""
    if kind == DEFAULT:
        context = getattr(getattr(torch, "_GLOBAL_DEVICE_CONTEXT", None), "device_context", None)
        return getattr(context, "device", None)
    return current_index(kind)


def snapshot() -> dict[str, Any]:
    """Every kind's current value, taken when a strict block starts."""
    return {kind: current(kind) for kind in _kinds()}


def check_returned() -> None:
    """Judge this thread's changes whose function has returned (a deferred check)."""
    changes = _changes()
    live = _stack_ids()
    for change in [c for c in changes if not c.deliberate]:
        if change.frame is not None and id(change.frame) in live:
            change.deliberate = True  # made by a function that is still running
            continue
        changes.remove(change)
        if _same(change.kind, change.after, change.before) or not _same(change.kind, current(change.kind),
                                                                         change.after):
            continue  # put back in time, or changed again since (that change has its own record)
        _restore(change.kind, change.before)
        _report(change, change.function)


def check_block(entry: dict[str, Any], since: int, action: str) -> None:
    """At a strict block's end: anything the block left changed, named by who changed it last."""
    changes = _changes()
    made = [c for c in changes if c.seq >= since]
    for change in made:
        changes.remove(change)
    if all(c.deliberate for c in changes):
        deferred.cancel(_at_module_call)
    live = _stack_ids()
    first: BaseException | None = None
    for kind, before in entry.items():
        now = current(kind)
        if _same(kind, now, before):
            continue
        last = next((c for c in reversed(made) if c.kind == kind), None)
        _restore(kind, before)
        if last is None or (last.frame is not None and id(last.frame) in live):
            what = "code inside torchplace.strict()"  # the block's own frame changed it
        else:
            what = last.function
        change = Change(kind, before, now, last.frame if last else None, last.lineno if last else 0, action)
        try:
            _report(change, what)
        except BaseException as exc:  # restore every kind before raising
            first = first or exc
    if first is not None:
        raise first


def next_seq() -> int:
    """A marker: changes recorded from now on have seq >= this."""
    return _local.__dict__.get("seq", 0)


def _kinds() -> list[str]:
    kinds = [DEFAULT, "cuda"]
    accel = accelerator_type()
    if accel and accel not in kinds:
        kinds.append(accel)
    return kinds


def _same(kind: str, now: Any, before: Any) -> bool:
    if kind == DEFAULT:
        return now == before or (now is None and before == torch.device("cpu")) or \
            (before is None and now == torch.device("cpu"))
    return now is None or before is None or now == before  # None before: the process's first choice


def _stack_ids() -> set[int]:
    out = set()
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        out.add(id(frame))
        frame = frame.f_back
    return out


def _restore(kind: str, value: Any) -> None:
    with setters.quiet():
        if kind == DEFAULT:
            torch.set_default_device(value)
        else:  # the back end's device module (torch.accelerator's setter is a no-op on a Python back end)
            device_module(kind).set_device(value or 0)


def _record(kind: str, before: Any, after: Any, action: str) -> None:
    frame = fr.caller_frame()  # torchplace.on and guard set under setters.quiet(): they restore what they change
    changes = _changes()
    for change in changes:  # a function that changes it again: keep the first "before"
        if change.kind == kind and change.frame is frame:
            change.after, change.lineno = after, frame.f_lineno if frame is not None else 0
            if _same(kind, after, change.before):
                changes.remove(change)  # it put the device back itself
            else:
                change.deliberate = False  # judge it again
                deferred.request(_at_module_call, key="leaks")
            return
    seq = _local.__dict__.get("seq", 0)
    _local.seq = seq + 1
    changes.append(Change(kind, before, after, frame, frame.f_lineno if frame is not None else 0, action, seq))
    deferred.request(_at_module_call, key="leaks")


def _at_module_call(module: torch.nn.Module, args: tuple[Any, ...]) -> bool:
    check_returned()
    return all(c.deliberate for c in _changes())


def _report(change: Change, what: str) -> None:
    if change.kind == DEFAULT:
        before = change.before if change.before is not None else "cpu"
        message = (f"{what} changed the default device from {before} to {change.after} with "
                   f"torch.set_default_device() and did not restore it; the change was made at {change.site}.\n"
                   "Fix: scope it with `with torch.device(...)`, or pass device= explicitly.\n"
                   f"Why: every later factory call without a device (torch.zeros(3)) in this thread would land on "
                   f"{change.after}. torchplace restored {before}.")
    else:
        message = leak_message(what, change.before, change.after, [change.site] if change.frame else [],
                               change.kind)
    warn_or_raise(change.action, message, DeviceLeakError, change.frame, change.lineno, category=DeviceLeakWarning)
