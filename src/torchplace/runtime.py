"""`torchplace.setup()`: make every device decision once, at the program's entry.

It resolves the device (per rank under torchrun, with the process group made), the precision
policy, CPU threads, strict mode and seeds, prints one short summary of what it chose and why,
and returns a `Runtime` whose helpers are bound to those choices.
"""

from __future__ import annotations

import os
import sys
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Literal, TypeVar

import torch

from .hardware.launch_env import read_launch_env

if TYPE_CHECKING:
    from .checkpoint.background import SaveFuture
    from .checkpoint.loading import Checkpoint
    from .checks.explain import Explanation
    from .distributed.group_state import DistInfo
    from .placement.loader import DeviceLoader
    from .placement.resolve import DeviceSpec
    from .amp import PrecisionPolicy
    from .policy.threads import ThreadPlan

T = TypeVar("T")


@dataclass
class Runtime:
    """What setup() decided, with helpers bound to it."""

    device: torch.device
    precision: PrecisionPolicy
    threads: ThreadPlan | None = None  # None: torch's thread defaults were left alone
    dist: DistInfo | None = None  # None: a single process, no process group
    seed: int | None = None
    strict: Literal["warn", "error"] | None = None
    decisions: list[str] = field(default_factory=list)

    @property
    def rank(self) -> int:
        return self.dist.rank if self.dist else 0

    @property
    def world_size(self) -> int:
        return self.dist.world_size if self.dist else 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def to(self, obj: T, **kwargs: Any) -> T:
        """Move any nested batch to this runtime's device (`torchplace.to_device`)."""
        from .placement.transfer import to_device

        return to_device(obj, self.device, **kwargs)

    def loader(self, loader: Iterable[T], **kwargs: Any) -> DeviceLoader[T]:
        """Wrap a DataLoader so batches arrive on the device, copies overlapped with compute."""
        from .placement.loader import DeviceLoader

        return DeviceLoader(loader, self.device, **kwargs)

    def autocast(self, **kwargs: Any) -> AbstractContextManager[None]:
        """Autocast for the chosen precision (a no-op context for fp32), checked on the first step."""
        return self.precision.autocast(**kwargs)

    def grad_scaler(self, **kwargs: Any) -> torch.amp.GradScaler:
        """A GradScaler, enabled only when the precision needs one (fp16)."""
        return self.precision.make_grad_scaler(**kwargs)

    def save(self, path: str | os.PathLike[str], **state: Any) -> Path:
        """`torchplace.save` (atomic; only rank 0 writes under torchrun)."""
        from .checkpoint.saving import save

        return save(path, **state)

    def save_async(self, path: str | os.PathLike[str], **state: Any) -> SaveFuture:
        """`torchplace.save_async`: returns once the state is copied; the file is written in the background."""
        from .checkpoint.background import save_async

        return save_async(path, **state)

    def load(self, path: str | os.PathLike[str], **kwargs: Any) -> Checkpoint:
        """`torchplace.load` onto this runtime's device."""
        from .checkpoint.loading import load

        kwargs.setdefault("device", self.device)
        return load(path, **kwargs)

    def explain(self, model: torch.nn.Module, *inputs: Any, **kwargs: Any) -> Explanation:
        """`torchplace.explain`: which tensor or module sits on the wrong device, and where."""
        from .checks.explain import explain

        return explain(model, *inputs, **kwargs)

    def summary(self) -> str:
        head = f"torchplace: rank {self.rank}/{self.world_size} on {self.device}" if self.dist else \
            f"torchplace: {self.device}"
        return "\n".join([head] + [f"  {line}" for line in self.decisions])

    def close(self) -> None:
        """Tear down the process group, if setup() made one."""
        if self.dist is not None:
            from .distributed.group import teardown

            teardown()


def _describe_device(dev: torch.device) -> str:
    if dev.type != "cuda":
        return f"device {dev}"
    from .hardware.visible import map_visible

    visible = map_visible().physical(dev.index or 0)
    return f"device {visible.describe()}" if visible else f"device {dev}"


def setup(device: DeviceSpec = "auto", precision: str | torch.dtype | None = "auto",
          threads: int | Literal["auto"] | None = "auto", strict: bool | Literal["error", "warn"] = False,
          seed: int | None = None, *, distributed: bool | Literal["auto"] = "auto",
          verbose: bool = True) -> Runtime:
    """Decide device, precision, threads, strictness and seeds once; return the Runtime.

    device: any `torchplace.device` spec; under torchrun (or SLURM) "auto" is this rank's GPU and
        the process group is initialized (`distributed=False` skips that).
    precision: "auto" (from the device's real capability), "bf16", "fp16" or "fp32".
    threads: "auto" (from affinity, cgroup quota and local world size), an int (intra-op
        threads), or None to leave torch's defaults.
    strict: False, True/"error" or "warn": strict mode for the whole program.
    seed: seeds Python, NumPy, torch and every device (`torchplace.seed_everything`).
    """
    from .placement.resolve import device as resolve_device
    from .amp import precision_for

    decisions: list[str] = []
    launch = read_launch_env()
    info = None
    existing = torch.distributed.is_available() and torch.distributed.is_initialized()  # Fabric, Accelerate
    if distributed is True or (distributed == "auto" and (existing or launch.launched and (launch.world_size or 1) > 1)):
        from .distributed.group import init

        info = init(device=None if device == "auto" else device)
        dev = info.device
        made = "adopted (made by another library)" if info.adopted else f"launched by {info.launcher or 'hand'}"
        decisions.append(f"process group: {info.backend}, rank {info.rank} of {info.world_size} "
                         f"(local rank {info.local_rank}), {made}")
    else:
        dev = resolve_device(device)
    decisions.insert(0, _describe_device(dev) + (" (auto)" if device == "auto" else ""))

    plan = None
    if threads not in (None, False):
        from .policy.threads import configure_threads

        plan = configure_threads(intra_op=threads if isinstance(threads, int) else None)
        decisions.append(f"threads: {plan.intra_op} intra-op, {plan.inter_op} inter-op of "
                         f"{plan.usable_cpus} usable CPU(s) over {plan.local_world_size} local process(es)")

    policy = precision_for(dev, None if precision in (None, "auto") else precision)
    policy.apply_tf32()
    decisions.append(f"precision: {str(policy.dtype).removeprefix('torch.')}"
                     f"{' + GradScaler' if policy.grad_scaler else ''}, TF32 {'on' if policy.tf32 else 'off'}"
                     f" ({policy.reason})")

    if seed is not None:
        from .policy.determinism import seed_everything

        seed_everything(seed)
        decisions.append(f"seed: {seed} (python, numpy, torch, every device)")

    mode: Literal["warn", "error"] | None = None
    if strict:
        from .checks.strict import enable, make_config

        mode = "warn" if strict == "warn" else "error"
        enable(make_config(mode))
        decisions.append(f"strict mode: {mode}s on device mistakes")

    runtime = Runtime(dev, policy, plan, info, seed, mode, decisions)
    if verbose and runtime.is_main:
        print(runtime.summary(), file=sys.stderr)
    return runtime
