"""`place`: put submodules on named devices and move their inputs there on the way in.

A model split across GPUs (model parallelism) then runs without hand-written `.to()` calls.
Each tensor is moved once, straight to its device (a child placed apart from its parent is
never copied through the parent's device), and tied weights that would have to live on two
devices are refused before anything moves.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..errors import DeviceError
from ..policy.devices import DeviceSpec
from ..shared.tree import map_tensors
from .transfer import target_device, to_device


@dataclass
class Placement:
    """What `place` did: the device of each named submodule, and where the output lands."""

    module: nn.Module
    devices: dict[str, torch.device]
    output: torch.device | None = None  # the device outputs are moved to, if one was asked for
    last_output_devices: tuple[torch.device, ...] = ()  # where the last forward's output tensors were
    _handles: list[Any] = field(default_factory=list, repr=False)

    @property
    def output_device(self) -> torch.device | None:
        """Where the output lands: the `output` asked for, else where the last forward left it
        (None before the first forward, or when its tensors were on several devices)."""
        if self.output is not None:
            return self.output
        return self.last_output_devices[0] if len(self.last_output_devices) == 1 else None

    def remove(self) -> None:
        """Remove the input-moving hooks; the submodules stay on their devices."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def __str__(self) -> str:
        parts = ", ".join(f"{name or '<root>'} -> {dev}" for name, dev in self.devices.items())
        where = self.output_device
        lands = f"output on {where}" if where else "output where the last submodule leaves it"
        return f"{type(self.module).__name__}: {parts}; {lands}"


def place(module: nn.Module, devices: Mapping[str, DeviceSpec], *, output: DeviceSpec | None = None) -> Placement:
    """Move each named submodule to its device, with its inputs moved there on every call.

    Each named submodule (dotted names; "" is the whole module) gets a forward pre-hook that moves
    its positional and keyword inputs to its device (tensors already there are not touched). The
    deepest name wins: with `{"": "cuda:0", "decoder": "cuda:1"}` everything is on cuda:0 except
    the decoder. The output lands where the last submodule computed it, or on `output` when given.

    Args:
        module: the model to split.
        devices: submodule name -> `torchplace.device` spec.
        output: where to move the model's output (default: where it was computed).

    Returns:
        A `Placement`: `devices` (name -> torch.device), `output_device` after a forward, and
        `remove()` to take the hooks off.

    Raises:
        DeviceError: an unknown submodule name, a device that does not exist, tied weights that
            would have to be on two devices, or a model accelerate already dispatched (its hooks
            would move inputs and weights back to its own devices); raised before anything moves.

    Example:
        ```python
        import torch
        from torch import nn
        import torchplace as tp

        net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        plan = tp.place(net, {"": "cpu", "2": "cpu"}, output="cpu")  # e.g. {"2": "cuda:1"} on two GPUs
        print(net(torch.randn(3, 4)).shape, plan.devices)
        ```
    """
    targets = {name: target_device(spec) for name, spec in _checked(module, devices).items()}
    out_dev = target_device(output) if output is not None else None
    owners = dict(module.named_modules(remove_duplicate=False))
    _check_accelerate(module, owners)
    _check_shared(module, targets)
    _check_empty(owners, targets)
    for name, sub in owners.items():
        dev = _effective(name, targets)
        if dev is not None:
            sub._apply(lambda t, dev=dev: t.to(dev), recurse=False)  # its own tensors only
    placement = Placement(module, dict(sorted(targets.items(), key=lambda kv: kv[0].count("."))), out_dev)
    for name, dev in _hooked(owners, targets).items():
        placement._handles.append(owners[name].register_forward_pre_hook(_mover(dev), with_kwargs=True))
    placement._handles.append(module.register_forward_hook(_output_hook(placement)))
    return placement


def _checked(module: nn.Module, devices: Mapping[str, DeviceSpec]) -> Mapping[str, DeviceSpec]:
    """DEVICES, after refusing any name that is not a submodule of MODULE (listing the names).

    A `torch.compile`d model wraps the original as `_orig_mod`: the original's names are taken too."""
    if not isinstance(devices, Mapping):  # transformers' device_map="auto", or one device as for .to()
        one = devices if isinstance(devices, (str, int)) else str(devices)
        raise DeviceError(
            f"place() takes a map of submodule names to devices (a device_map), not {devices!r:.60} "
            f"({type(devices).__name__}). Fix: {{'': {one!r:.40}}} puts the whole model on one device "
            "(as does model.to(tp.device(...))); for a plan like device_map='auto', pass the dict accelerate's "
            "infer_auto_device_map(model) returns.")
    names = {name for name, _ in module.named_modules(remove_duplicate=False)}
    wrapped = "_orig_mod" in names and isinstance(getattr(module, "_orig_mod", None), nn.Module)
    checked: dict[str, DeviceSpec] = {}
    for name, spec in devices.items():
        if wrapped and isinstance(name, str) and name not in names and f"_orig_mod.{name}" in names:
            name = f"_orig_mod.{name}"
        if not isinstance(name, str) or name not in names:
            raise DeviceError(_unknown(module, name, names))
        checked[name] = spec
    return checked


def _hooked(owners: Mapping[str, nn.Module], targets: Mapping[str, torch.device]) -> dict[str, torch.device]:
    """The modules whose inputs are moved: each named one, and each child of a split module that only
    inherits its device (with `{"": "cuda:0", "decoder": "cuda:1"}`, the head after the decoder gets
    the decoder's output on cuda:1 and needs it on cuda:0), outermost first."""
    split = {name.rpartition(".")[0] if "." in name else "" for name in targets if name}
    while True:  # every ancestor of a named module has a child on a device of its own
        more = {p.rpartition(".")[0] if "." in p else "" for p in split if p} - split
        if not more:
            break
        split |= more
    hooked = dict(targets)
    for name in owners:
        parent = name.rpartition(".")[0] if "." in name else ""
        if name and parent in split and name not in hooked:
            dev = _effective(name, targets)
            if dev is not None:
                hooked[name] = dev
    return dict(sorted(hooked.items(), key=lambda kv: kv[0].count(".") if kv[0] else -1))


def _check_empty(owners: Mapping[str, nn.Module], targets: Mapping[str, torch.device]) -> None:
    """Refuse, before anything moves, a meta tensor (no data) that would have to move to a real device:
    the weights of a model made on meta, or offloaded by accelerate (cpu_offload, a device_map with
    "cpu"/"disk" entries) whose hooks load them only for each forward."""
    for owner, sub in owners.items():
        dev = _effective(owner, targets)
        if dev is None or dev.type == "meta":
            continue
        for local, t in [*sub._parameters.items(), *sub._buffers.items()]:
            if t is not None and t.is_meta:
                full = f"{owner}.{local}" if owner else local
                raise DeviceError(
                    f"place(): {full!r} is a meta tensor (shape {tuple(t.shape)}, no data) and would have to move to "
                    f"{dev}; there is nothing to copy. Nothing was moved. Fix: load the weights first (e.g. "
                    "from_pretrained without device_map), or use module.to_empty(device=...) and initialize.")


def _check_accelerate(module: nn.Module, owners: Mapping[str, nn.Module]) -> None:
    """Refuse a model accelerate dispatched (dispatch_model, cpu_offload, from_pretrained with a
    device_map): its hooks move every input, and load offloaded weights, to their own execution
    devices inside each forward, after place()'s hooks ran, so the two would fight on every call."""
    hooked = {name: hooks for name, sub in owners.items() if (hooks := _device_hooks(getattr(sub, "_hf_hook", None)))}
    if not hooked:
        return
    listed = [f"{name or '<root>'!r} -> {_hook_text(hooks)}" for name, hooks in list(hooked.items())[:4]]
    more = f", ... ({len(hooked)} in all)" if len(hooked) > 4 else ""
    device_map = getattr(module, "hf_device_map", None)
    mapped = f" Its hf_device_map: {dict(device_map)}." if isinstance(device_map, Mapping) else ""
    raise DeviceError(
        f"place(): {type(module).__name__} is already dispatched by accelerate; nothing was moved.\n"
        "Fix: keep accelerate's placement (its device_map already splits the model): drop the place() call.\n"
        "Or: accelerate.hooks.remove_hook_from_submodules(model) first (offloaded weights come back to where they "
        "were loaded), then place().\n"
        f"Why: {len(hooked)} module(s) carry accelerate device hooks (AlignDevicesHook/CpuOffload) that move inputs "
        f"and weights to their own devices on every forward: {'; '.join(listed)}{more}.{mapped} place() would move "
        "the weights and the hooks would move the inputs back.")


def _device_hooks(hook: Any) -> list[Any]:
    """The accelerate hooks in HOOK (a SequentialHook holds several) that move tensors between devices."""
    if hook is None:
        return []
    if isinstance(getattr(hook, "hooks", None), (list, tuple)):
        return [h for inner in hook.hooks for h in _device_hooks(inner)]
    return [hook] if hasattr(hook, "execution_device") else []


def _hook_text(hooks: list[Any]) -> str:
    parts = []
    for hook in hooks:
        dev = hook.execution_device
        where = " (outputs back to the input's device)" if dev is None else f" on {dev}"
        offload = ", weights offloaded (meta until forward)" if getattr(hook, "offload", False) else ""
        parts.append(f"{type(hook).__name__}{where}{offload}")
    return ", ".join(parts)


def _unknown(module: nn.Module, name: Any, names: set[str]) -> str:
    parent = name.rpartition(".")[0] if isinstance(name, str) else ""
    while parent and parent not in names:
        parent = parent.rpartition(".")[0]
    level = [n for n in sorted(names) if n and n.rpartition(".")[0] == parent]
    where = f"submodule {parent!r}" if parent else type(module).__name__
    close = difflib.get_close_matches(str(name), sorted(n for n in names if n), n=3)
    hint = f" Did you mean {', '.join(map(repr, close))}?" if close else ""
    shown = ", ".join(map(repr, level[:40])) + (f", ... ({len(level)} in all)" if len(level) > 40 else "")
    return (f"place(): {name!r} is not a submodule of {type(module).__name__}. Names in {where}: "
            f"{shown or '(none)'}.{hint} Fix: use dotted names as in module.named_modules(), "
            "e.g. 'encoder.layers.0', or '' for the whole module.")


def _effective(name: str, targets: Mapping[str, torch.device]) -> torch.device | None:
    """The device of the deepest placed name that is NAME or one of its parents."""
    probe = name
    while True:
        if probe in targets:
            return targets[probe]
        if not probe:
            return None
        probe = probe.rpartition(".")[0]


def _check_shared(module: nn.Module, targets: Mapping[str, torch.device]) -> None:
    """Refuse a tensor or submodule shared by names that would put it on different devices."""
    tensors: dict[int, list[tuple[str, torch.device]]] = {}
    modules: dict[int, list[tuple[str, torch.device]]] = {}
    for owner, sub in module.named_modules(remove_duplicate=False):
        dev = _effective(owner, targets)
        if dev is not None:
            modules.setdefault(id(sub), []).append((owner or "<root>", dev))
        for local, t in [*sub._parameters.items(), *sub._buffers.items()]:
            if t is not None:  # unplaced owners keep the tensor where it is
                full = f"{owner}.{local}" if owner else local
                tensors.setdefault(id(t), []).append((full, dev if dev is not None else t.device))
    for what, claims_by_id in (("tensor", tensors), ("submodule", modules)):
        for claims in claims_by_id.values():
            if len({dev for _, dev in claims}) > 1:
                listed = "; ".join(f"{name!r} -> {dev}" for name, dev in claims)
                raise DeviceError(
                    f"place(): one {what} is shared (tied) by {len(claims)} names that would put it on "
                    f"different devices: {listed}. It can live on one device only. Fix: place the modules that "
                    "share it on the same device, or untie them (e.g. clone the weight) before placing.")


def _mover(dev: torch.device) -> Any:
    def hook(mod: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return to_device(args, dev), to_device(kwargs, dev)

    return hook


def _output_hook(placement: Placement) -> Any:
    def hook(mod: nn.Module, args: tuple, result: Any) -> Any:
        if placement.output is not None:
            result = to_device(result, placement.output)
        seen: dict[torch.device, None] = {}

        def note(t: torch.Tensor) -> torch.Tensor:
            seen[t.device] = None
            return t

        map_tensors(result, note)
        placement.last_output_devices = tuple(seen)
        return result

    return hook
