"""`torchplace.device(spec)`: turn any device spec into an indexed torch.device, validated now.

`torch.device("cuda:3")` is accepted anywhere and fails at the first kernel; this fails at once
with a message that lists what exists. Resolution is a pure function of a `Machine` (device
counts, the visible map, LOCAL_RANK), so tests run it on snapshots of real machines.
"""

from __future__ import annotations

import contextvars
import numbers
import os
import re
import sys
import unicodedata
from dataclasses import dataclass, field
from typing import Any, TypeAlias

import torch

from ..errors import DeviceError
from ..hardware import launch
from ..hardware.accelerator import accelerator
from ..hardware.facts import Facts
from ..hardware.topology import Topology
from ..hardware.visible import VisibleMap, map_visible

_SETTLED: dict[tuple[int, str | None, str | None], tuple[VisibleMap, int, list[str]]] = {}  # Machine.live's

DeviceSpec: TypeAlias = str | int | torch.device | None

_FORMS = ('"auto", "cpu", "meta", "cuda", "cuda:N", an int N, a torch.device, "physical:N", '
          'a GPU UUID or unique prefix ("GPU-..."), or another accelerator ("mps", "xpu:0", ...)')
_TYPED = re.compile(r"^([a-z_][a-z0-9_]*)(?::(-?[0-9]+))?$")  # ASCII digits only, as torch.device


@dataclass
class Machine:
    """What resolution needs to know; `live()` reads it without creating a CUDA context."""

    cuda_count: int
    visible: VisibleMap
    torch_has_cuda: bool = True
    local_rank: int | None = None
    accelerator: str | None = None  # torch.accelerator's current type when not cuda
    accelerator_count: int = 0
    current_cuda: int | None = None  # only when CUDA is already initialized
    notes: list[str] = field(default_factory=list)

    @classmethod
    def live(cls) -> Machine:
        has_cuda = torch.backends.cuda.is_built() if hasattr(torch.backends, "cuda") else False
        # once CUDA runs in this process, which GPUs it sees is settled: read NVML (~2 ms) once per environment
        key = (os.getpid(), os.environ.get("CUDA_VISIBLE_DEVICES"), os.environ.get("CUDA_DEVICE_ORDER"))
        started = has_cuda and torch.cuda.is_initialized()  # cuda-only: CUDA_VISIBLE_DEVICES is read at CUDA's start
        settled = _SETTLED.get(key) if started else None
        if settled is None:
            visible, notes = map_visible(), list[str]()
            count = cuda_device_count(visible, notes) if has_cuda else 0
            if started:
                _SETTLED[key] = visible, count, notes
        else:
            visible, count, notes = settled[0], settled[1], list(settled[2])
        accel, accel_count = accelerator()
        if accel == "cuda":
            accel, accel_count = None, 0
        initialized = count and torch.cuda.is_initialized()  # cuda-only: maps onto CUDA_VISIBLE_DEVICES
        current = torch.cuda.current_device() if initialized else None  # cuda-only: maps onto CUDA_VISIBLE_DEVICES
        return cls(count, visible, has_cuda, launch.local_rank(), accel, accel_count, current, notes)

    @classmethod
    def from_topology(cls, topology: Topology, cuda_visible_devices: str | None = None,
                      cuda_device_order: str | None = None, local_rank: int | None = None) -> Machine:
        """A machine as a snapshot describes it, under the given environment values."""
        visible = map_visible(cuda_visible_devices, topology, cuda_device_order)
        return cls(visible.count, visible, True, local_rank)

    @classmethod
    def from_facts(cls, facts: Facts) -> Machine:
        """A machine as `read_facts()` describes it (this one or a snapshot), under the environment it holds."""
        has_cuda = facts.versions.torch_cuda is not None or facts.versions.torch is None  # unrecorded: assume CUDA
        local = facts.env.get("LOCAL_RANK", "")
        return cls(facts.visible.count if has_cuda else 0, facts.visible, has_cuda,
                   int(local) if local.isascii() and local.isdigit() else None)


def cuda_device_count(visible: VisibleMap, notes: list[str], count: Any = None) -> int:
    """torch.cuda.device_count(), or the driver's count where torch's own parser fails.

    torch reads CUDA_VISIBLE_DEVICES with a parser of its own, which raises ValueError on values
    such as '-', '+', a Unicode digit or a number of more than 4,300 digits; the driver reads them
    (see hardware/visible.py), so its reading is used instead and a note says why.
    """
    try:
        return int((count or torch.cuda.device_count)())  # cuda-only: maps onto CUDA_VISIBLE_DEVICES
    except ValueError as exc:
        notes.append(f"torch.cuda.device_count() failed on CUDA_VISIBLE_DEVICES="
                     f"{_short(visible.cuda_visible_devices)} ({exc}); using the driver's reading: "
                     f"{visible.count} GPU(s). Fix: set CUDA_VISIBLE_DEVICES to ASCII ordinals or UUIDs.")
        return visible.count


def _short(value: str | None) -> str:
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:40]}... ({len(value or '')} characters)"


def device(spec: DeviceSpec = "auto", *, machine: Machine | Facts | None = None) -> torch.device:
    """Resolve a device spec to an indexed `torch.device` that exists here.

    Accepted specs: "auto" (`LOCAL_RANK`'s GPU under torchrun, else `cuda:0`, else another
    accelerator such as mps or xpu, else cpu), "cpu", "meta", "cuda" / "cuda:N" (logical, as
    torch numbers them), "physical:N" (the GPU nvidia-smi calls N, whatever
    `CUDA_VISIBLE_DEVICES` did to the numbering), a GPU UUID, an int, or a `torch.device`. Reading
    which GPUs exist does not start CUDA.

    Args:
        spec: the device to resolve (default "auto").
        machine: resolve against these facts instead of this machine's (tests, planning): a
            `tp.read_facts()` record, e.g. of a snapshot.

    Returns:
        An indexed `torch.device` ("cuda:0", never a bare "cuda").

    Raises:
        DeviceError: the device does not exist or cannot be used here; the message lists what is
            visible (logical and physical ids) and the fix.

    Example:
        ```python
        import torchplace as tp

        dev = tp.device("auto")       # cuda:LOCAL_RANK, cuda:0, another accelerator, or cpu
        cpu = tp.device("cpu")
        # tp.device("physical:1")     # the GPU nvidia-smi calls 1, as the cuda:N torch uses
        print(dev, cpu)
        ```
    """
    if isinstance(machine, Facts):
        machine = Machine.from_facts(machine)
    return resolve(spec, machine or ASSUMED.get() or Machine.live())


# the machine device() resolves against in place of this one, where one is set (checks' fake_cuda(): a cuda:0)
ASSUMED: contextvars.ContextVar[Machine | None] = contextvars.ContextVar("torchplace_machine", default=None)


def resolve(spec: DeviceSpec, m: Machine) -> torch.device:
    """The pure core of `device`: resolve against a given Machine."""
    if spec is None or (isinstance(spec, str) and spec.strip().lower() == "auto"):
        return _auto(m)
    if isinstance(spec, (bool, numpy_bool())):
        raise DeviceError(f"{spec!r} is not a device. Accepted: {_FORMS}.")
    if isinstance(spec, numbers.Integral) and not isinstance(spec, torch.Tensor):
        spec = int(spec)  # numpy integers (a device_map read with numpy), as torch.device takes them
    if isinstance(spec, int):
        if m.cuda_count or not m.accelerator:
            return _cuda(spec, m, asked=str(spec))
        return _accelerator(m.accelerator, spec, m, asked=str(spec))
    if isinstance(spec, torch.device):
        text = str(spec)
    elif isinstance(spec, str):
        text = spec.strip()
    else:
        raise DeviceError(f"{spec!r} ({type(spec).__name__}) is not a device spec. Accepted: {_FORMS}.")
    _refuse_unicode_digits(text)
    low = text.lower()
    if low.startswith("physical:"):
        return _physical(text.split(":", 1)[1].strip(), m, asked=text)
    if text.startswith(("GPU-", "MIG-")):
        return _uuid(text, m)
    match = _TYPED.match(low)
    if not match:
        raise DeviceError(f"{text!r} is not a device spec.{_did_you_mean(low)} Accepted: {_FORMS}.")
    kind, index = match.group(1), match.group(2)
    idx = _index(index, text) if index is not None else None
    if kind in ("cpu", "meta"):
        if idx not in (None, 0):
            raise DeviceError(f"{text!r} requested, but {kind} has a single device. Fix: use {kind!r}.")
        return torch.device(kind)
    if kind == "cuda":
        if idx is None:
            idx = m.local_rank if m.local_rank is not None else (m.current_cuda or 0)
        return _cuda(idx, m, asked=text)
    if kind == "physical":
        return _physical(index or "", m, asked=text)
    try:
        torch.device(kind)
    except RuntimeError:
        raise DeviceError(f"{text!r} names no device type PyTorch knows.{_did_you_mean(low)} "
                          f"Accepted: {_FORMS}.") from None
    return _accelerator(kind, idx if idx is not None else 0, m, asked=text)


def _did_you_mean(low: str) -> str:
    """' Did you mean ...?' for the spellings other tools use: 'gpu', 'cuda0', '0' and '-1' as text."""
    if re.fullmatch(r"-?[0-9]+", low):
        if low.startswith("-"):
            return " (-1 means the CPU to transformers' pipeline.) Did you mean 'cpu'?"
        return f" Did you mean 'cuda:{int(low)}' (or the int {int(low)})?"
    found = re.fullmatch(r"(gpu|cuda|nvidia|mps|xpu|npu)\s*[:_-]?\s*([0-9]*)", low)
    if not found:
        return ""
    kind = "cuda" if found.group(1) in ("gpu", "nvidia") else found.group(1)
    return f" Did you mean {kind + (':' + found.group(2) if found.group(2) else '')!r}?"


def numpy_bool() -> type:
    """numpy's bool type when numpy is loaded (it is not an Integral, but says nothing of a device either)."""
    np = sys.modules.get("numpy")
    return np.bool_ if np is not None else bool


def _auto(m: Machine) -> torch.device:
    if m.local_rank is not None and (m.cuda_count or m.accelerator):
        if m.cuda_count:
            return _cuda(m.local_rank, m, asked=f"auto (LOCAL_RANK={m.local_rank})")
        return _accelerator(m.accelerator or "", m.local_rank, m, asked=f"auto (LOCAL_RANK={m.local_rank})")
    if m.cuda_count:
        return torch.device("cuda", 0)
    if m.accelerator and m.accelerator_count:
        return torch.device(m.accelerator, 0)
    return torch.device("cpu")


def _cuda(idx: int, m: Machine, asked: str) -> torch.device:
    if 0 <= idx < m.cuda_count:
        return torch.device("cuda", idx)
    raise DeviceError(_cuda_message(asked, m))


def _cuda_message(asked: str, m: Machine) -> str:
    rank = f" (LOCAL_RANK={m.local_rank})" if m.local_rank is not None and "LOCAL_RANK" not in asked else ""
    if not m.torch_has_cuda:
        gpus = f" although {m.visible.count} GPU(s) are present" if m.visible.count else ""
        return (f"{asked} requested{rank}, but this torch is a CPU-only build{gpus}. "
                "Fix: install a CUDA build of torch (https://pytorch.org/get-started/locally/) or ask for 'cpu'.")
    if m.cuda_count == 0:
        why = m.visible.summary() if m.visible.cuda_visible_devices is not None else "no CUDA GPU is visible"
        return (f"{asked} requested{rank}, but {why}. "
                "Fix: ask for 'cpu' or 'auto', or run where a GPU is visible (torchplace doctor explains why not).")
    if m.visible.count == m.cuda_count and m.visible.visible:
        what = m.visible.summary()
    else:
        what = f"{m.cuda_count} GPU(s) are visible: cuda:0..cuda:{m.cuda_count - 1}"
    return (f"{asked} requested{rank}, but {what}. Fix: use cuda:0..cuda:{m.cuda_count - 1}, or set "
            "CUDA_VISIBLE_DEVICES before the process starts (`torchplace map` shows the table).")


def _refuse_unicode_digits(text: str) -> None:
    """torch.device and the CUDA driver read ASCII digits only; say so and give the ASCII spelling."""
    odd = next((ch for ch in text if not ch.isascii() and ch.isnumeric()), None)
    if odd is None:
        return
    fixed = "".join(str(unicodedata.digit(ch)) if not ch.isascii() and unicodedata.digit(ch, None) is not None
                    else ch for ch in text)
    raise DeviceError(f"{text!r} uses the non-ASCII digit {odd!r} ({unicodedata.name(odd, 'unnamed')}); "
                      f"torch.device and the CUDA driver read ASCII digits 0-9 only. Fix: write {fixed!r}.")


def _index(digits: str, asked: str) -> int:
    """A device index as torch.device reads it: ASCII digits, no leading zero ('cuda:01' is refused)."""
    bare = digits.lstrip("-")
    if len(bare) > 1 and bare.startswith("0"):
        fixed = asked[:len(asked) - len(digits)] + digits.replace(bare, bare.lstrip("0") or "0")
        raise DeviceError(f"{asked!r} has a leading zero in its index, which torch.device refuses "
                          f"(\"Invalid device string\"). Fix: write {fixed!r}.")
    return int(digits)


def _physical(text: str, m: Machine, asked: str) -> torch.device:
    if not re.fullmatch(r"[0-9]+", text):
        raise DeviceError(f"{asked!r}: 'physical:' needs a GPU index as nvidia-smi shows it, e.g. 'physical:2'.")
    physical = _index(text, asked)
    logical = m.visible.logical_of(physical)
    if logical is None:
        unset = m.visible.cuda_visible_devices is None
        if not m.torch_has_cuda or (unset and not m.visible.visible):  # a CPU-only torch, or no GPU here at all
            raise DeviceError(_cuda_message(asked, m))
        if unset:  # every GPU is visible already
            raise DeviceError(f"{asked} requested, but this machine has no physical GPU {physical}; "
                              f"{m.visible.summary()}. Fix: pick one of those (`torchplace map` lists them).")
        raise DeviceError(f"{asked} requested, but physical GPU {physical} is not visible to this process; "
                          f"{m.visible.summary()}. Fix: include it in CUDA_VISIBLE_DEVICES, or pick a visible one.")
    return _cuda(logical, m, asked)


def _uuid(text: str, m: Machine) -> torch.device:
    # the driver reads UUID hex digits in either case (hardware/visible.py)
    hits = [d for d in m.visible.visible if (d.mig_uuid or d.uuid).lower().startswith(text.lower())]
    if len(hits) == 1:
        return _cuda(hits[0].logical, m, asked=text)
    why = "matches no visible GPU" if not hits else f"matches {len(hits)} visible GPUs"
    raise DeviceError(f"{text} {why}; {m.visible.summary()}. Fix: give a longer or different UUID "
                      "(`torchplace map` lists them).")


def _accelerator(kind: str, idx: int, m: Machine, asked: str) -> torch.device:
    if kind == m.accelerator:
        count = m.accelerator_count
    else:
        mod = getattr(torch, kind, None)
        count_fn = getattr(mod, "device_count", None)
        try:
            count = int(count_fn()) if count_fn else 0
        except Exception:
            count = 0
    if 0 <= idx < count:
        return torch.device(kind, idx)
    have = f"{count} {kind} device(s) exist" if count else f"no {kind} device is available"
    others = ["cpu"] + ([f"cuda:0..cuda:{m.cuda_count - 1}"] if m.cuda_count else []) + (
        [f"{m.accelerator}:0..{m.accelerator}:{m.accelerator_count - 1}"] if m.accelerator_count else [])
    where = " (mps is Apple silicon's GPU, on macOS only)" if kind == "mps" and sys.platform != "darwin" else ""
    return _raise(f"{asked} requested, but {have}{where}. Available: {', '.join(others)}. Fix: ask for one of "
                  "those, or 'auto' (the best device here).")


def _raise(message: str) -> Any:
    raise DeviceError(message)
