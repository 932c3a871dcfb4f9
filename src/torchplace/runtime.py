"""`torchplace.setup()`: make every device decision once, at the program's entry.

It resolves the device (per rank under torchrun, with the process group made), the precision
policy, CPU threads, strict mode and seeds, prints one short summary of what it chose and why,
and returns a `Runtime` whose helpers are bound to those choices.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeVar

import torch

from .errors import CheckpointError
from .hardware.launch import LaunchEnv, read_launch_env

if TYPE_CHECKING:
    from .amp import PolicyAutocast, PrecisionPolicy
    from .checkpoint.background import SaveFuture
    from .checkpoint.loading import Checkpoint
    from .checks.explain import Explanation
    from .distributed.group_state import DistInfo
    from .placement.loader import DeviceLoader
    from .policy.devices import DeviceSpec
    from .policy.threads import ThreadPlan

T = TypeVar("T")
_THREADS_AT_IMPORT = torch.get_num_threads()  # a different count at setup(): the program set its own


@dataclass
class Runtime:
    """What `setup()` decided, with helpers bound to it.

    Attributes:
        device: this process's device.
        precision: the `PrecisionPolicy` (dtype, GradScaler or not, and why).
        threads: the `ThreadPlan`, or None when torch's thread defaults were left alone.
        dist: this rank's `DistInfo`, or None for a single process without a process group.
        seed: the seed used, or None.
        strict: "warn" or "error" when strict mode is on, else None.
        decisions: one line per decision, with its reason.
        checkpoint_dir: the folder the run saves its checkpoints into, or None.
        resume_from: the checkpoint `setup()` decided to continue from (None: from the start).

    Methods `to`, `loader`, `autocast`, `grad_scaler`, `save`, `save_async`, `load` and `explain`
    call the library's functions with this runtime's device and precision; `resume(model=...,
    optimizer=...)` loads `resume_from`; `rank`, `world_size` and `is_main` describe the process;
    `close()` tears down a process group that `setup()` made.

    Example:
        ```python
        import torch
        import torchplace as tp
        from torch.utils.data import DataLoader, TensorDataset

        rt = tp.setup("cpu", verbose=False)
        model = torch.nn.Linear(4, 1).to(rt.device)
        data = DataLoader(TensorDataset(torch.randn(8, 4)), batch_size=4)
        for (x,) in rt.loader(data):
            with rt.autocast():
                model(x).sum().backward()
        rt.save("rt-ckpt.safetensors", model=model)
        print(rt.is_main, rt.world_size, rt.decisions[0])
        ```
    """

    device: torch.device
    precision: PrecisionPolicy
    threads: ThreadPlan | None = None  # None: torch's thread defaults were left alone
    dist: DistInfo | None = None  # None: a single process, no process group
    seed: int | None = None
    strict: Literal["warn", "error"] | None = None
    decisions: list[str] = field(default_factory=list)
    checkpoint_dir: Path | None = None  # where the run's checkpoints go (setup's checkpoint_dir)
    resume_from: Path | None = None  # the checkpoint setup() decided to continue from (None: from the start)
    _loader: DeviceLoader | None = field(default=None, repr=False)  # the newest rt.loader: its position is saved
    _loader_saved: dict[str, Any] | None = field(default=None, repr=False)  # a resumed position for the next rt.loader
    _verbose: bool = field(default=True, repr=False)

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
        """Wrap a DataLoader so batches arrive on the device, copies overlapped with compute. Its position
        in the epoch goes into every checkpoint `rt.save`/`rt.save_async` write, and after `rt.resume()` the
        loader made next starts at the batch after the checkpoint's (skipped by index, not loaded)."""
        from .placement.loader import DeviceLoader

        made = DeviceLoader(loader, self.device, **kwargs)
        self._loader = made
        if self._loader_saved is not None:
            self._give_position(made, self._loader_saved)
            self._loader_saved = None
        return made

    def _give_position(self, made: DeviceLoader[Any], saved: dict[str, Any]) -> None:
        from .placement.loader_state import pick

        state, skip, note = pick(saved, self.rank, self.world_size)
        made._position.load_state_dict(state, skip, note)
        if note and f"resume: {note}" not in self.decisions:  # setup() said it already, from the file's header
            self._say(f"resume: {note}")

    def _with_position(self, path: str | os.PathLike[str], state: dict[str, Any]) -> dict[str, Any]:
        """STATE with the newest rt.loader's position under 'loader' (every rank's with all_ranks=True)."""
        if self._loader is None or "loader" in state:
            return state
        mine = {**self._loader.state_dict(), "world_size": self.world_size, "rank": self.rank}
        if state.get("all_ranks") and self.world_size > 1:
            import torch.distributed as dist

            from .checkpoint.sharded import join_ranks

            join_ranks(Path(path), "rt.save(all_ranks=True) gathering every rank's loader position")  # no hang
            every: list[Any] | None = [None] * self.world_size if self.rank == 0 else None
            dist.gather_object(mine, every, dst=0)
            return {**state, "loader": {"per_rank": every} if every is not None else mine}
        return {**state, "loader": mine}

    def _say(self, line: str) -> None:
        self.decisions.append(line)
        if self.is_main and self._verbose:
            _report(f"torchplace: {line}")

    def autocast(self, **kwargs: Any) -> PolicyAutocast:
        """Autocast for the chosen precision (a no-op context for fp32), checked on the first step."""
        return self.precision.autocast(**kwargs)

    def grad_scaler(self, **kwargs: Any) -> torch.amp.GradScaler:
        """A GradScaler, enabled only when the precision needs one (fp16)."""
        return self.precision.make_grad_scaler(**kwargs)

    def save(self, path: Any, f: str | os.PathLike[str] | None = None, /, **state: Any) -> Path:
        """`torchplace.save` (atomic; only rank 0 writes under torchrun)."""
        from .checkpoint.saving import save

        return save(path, f, **self._with_position(path if f is None else f, state))

    def save_async(self, path: Any, f: str | os.PathLike[str] | None = None, /, **state: Any) -> SaveFuture:
        """`torchplace.save_async`: returns once the state is copied; the file is written in the background."""
        from .checkpoint.background import save_async

        return save_async(path, f, **self._with_position(path if f is None else f, state))

    def load(self, path: str | os.PathLike[str], **kwargs: Any) -> Checkpoint:
        """`torchplace.load` onto this runtime's device."""
        from .checkpoint.loading import load

        kwargs.setdefault("device", self.device)
        return load(path, **kwargs)

    def resume(self, model: torch.nn.Module | None = None, **objects: Any) -> Checkpoint | None:
        """Load the checkpoint setup() chose to continue from (`resume_from`) onto this runtime's
        device and into MODEL and the objects given (optimizer=, scheduler=, scaler=, ...); None
        when the run starts from the beginning. Every rank calls it and loads the same file."""
        if self.resume_from is None:
            return None
        ck = self.load(self.resume_from, model=model, **objects)
        from .placement.loader_state import is_position

        saved = ck.state.get("loader")
        if "loader" not in objects and is_position(saved):
            if self._loader is not None and not self._loader._position.started:
                self._give_position(self._loader, saved)
            else:
                self._loader_saved = saved
        for note in ck.notes:
            if f"resume: {note}" not in self.decisions:
                self._say(f"resume: {note}")
        return ck

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


def _decide_resume(resume: bool | Literal["auto"], checkpoint_dir: str | os.PathLike[str] | None,
                   info: DistInfo | None, launch: LaunchEnv, decisions: list[str]) -> Path | None:
    """What every rank agreed to continue from: each reads the folder, rank 0's view wins, and
    views that differ (folders not shared between nodes) are refused. Rank 0 then records the job's
    run id in the folder, so a restart torchrun does not count still continues (policy/resume.py)."""
    from .checkpoint.rotation import mark_started, newest_name
    from .policy.resume import decide_resume, job_id, started_here

    looks = resume is not False and checkpoint_dir is not None
    job = job_id(launch.run_id) if looks else None
    mine = newest_name(checkpoint_dir) if looks else None
    found, hosts, seen = [mine], [], started_here(checkpoint_dir, job)
    if info is not None and info.world_size > 1 and looks:
        import json

        from .distributed.health import gather_text

        rows = [json.loads(r) for r in gather_text("resume", json.dumps([mine, info.hostname, seen]))]
        found, hosts, seen = [r[0] for r in rows], [r[1] for r in rows], rows[0][2]
    restarted = launch.restart_count > 0 or (info is not None and info.restarted)
    decision = decide_resume(resume, checkpoint_dir, restarted, found, hosts, same_job=job if seen else None)
    if decision.reason:
        decisions.append(f"resume: {decision.reason}")
    if job is not None and checkpoint_dir is not None and not seen and (info is None or info.rank == 0):
        try:
            mark_started(checkpoint_dir, job)
        except (OSError, CheckpointError) as exc:  # a read-only folder can still be resumed from
            decisions.append(f"resume: could not record job {job!r} in {checkpoint_dir} ({exc}); a restart "
                             "torchrun does not count will start from the beginning")
    return decision.path


def describe_resume(path: Path, world_size: int) -> list[str]:
    """What continuing from PATH will restore, read from its header (no tensor is loaded): the step and epoch
    the program saved in extra=, the loader's position in its epoch, and, when the file was saved by another
    number of ranks than WORLD_SIZE, what loads as it was, what is resharded and what cannot be."""
    from .checkpoint import codec
    from .checkpoint.format import SIDE_FILE, read_header
    from .placement.loader_state import is_position, pick

    sharded = path.is_dir()
    try:
        header = read_header(path / SIDE_FILE if sharded else path)
        tree = codec.decode(header.meta["state"], codec.TensorRef) if header.meta else {}
    except (CheckpointError, ValueError, KeyError, OSError) as exc:
        return [f"{path}: its header could not be read for the summary ({exc}); rt.resume() says what it loads"]
    meta = header.meta or {}
    saved_world = int(meta.get("world_size") or 1)
    extra = tree.get("extra") if isinstance(tree.get("extra"), dict) else {}
    where = ", ".join(f"{k} {extra[k]}" for k in ("step", "epoch") if isinstance(extra.get(k), int))
    lines = []
    position = tree.get("loader")
    if is_position(position):
        state, skip, note = pick(position, 0, world_size)
        length = state.get("length")
        epoch = state.get("sampler", {}).get("epoch")
        at = (f"batch {skip + 1}{f' of {length}' if length and saved_world == world_size else ''} of its epoch"
              + (f" (sampler epoch {epoch})" if epoch is not None else "")
              + f": the {skip} batch(es) before are skipped by index, not loaded"
              if skip else "the start of an epoch (the checkpoint was saved between epochs)")
        lines.append(f"{path.name}: {where + '; ' if where else ''}the loader continues at {at}")
        if note:
            lines.append(note)
    elif where:
        lines.append(f"{path.name}: {where}; no loader position saved (rt.save without an rt.loader): "
                     "the loop decides where its epoch starts")
    if saved_world != world_size:
        rng = (tree.get("rng") or {})
        per_rank = isinstance(rng, dict) and "per_rank" in rng
        lines.append(
            f"saved by {saved_world} rank(s), this run has {world_size}: "
            + ("the model and optimizer shards are resharded by torch.distributed.checkpoint" if sharded else
               "the model and optimizer (one unsharded copy) load whole on every rank")
            + "; per-rank RNG cannot be resharded: "
            + ("every rank restores rank 0's generators" if per_rank else
               "the file holds rank 0's generators only: rank 0 restores them, the others keep their own"
               if isinstance(meta.get("rng_rank"), int) else "every rank restores the one process's generators")
            + " (random draws such as dropout differ from an unbroken run from here on)")
    return lines


def setup(device: DeviceSpec = "auto", precision: str | torch.dtype | None = "auto",
          threads: int | Literal["auto"] | None = "auto", strict: bool | Literal["error", "warn"] = False,
          seed: int | None = None, *, distributed: bool | Literal["auto"] = "auto",
          checkpoint_dir: str | os.PathLike[str] | None = None, resume: bool | Literal["auto"] = "auto",
          verbose: bool = True) -> Runtime:
    """Decide device, precision, threads, strictness and seeds once; return the Runtime.

    One call at the entry of a program. Every decision is recorded with its reason
    (`Runtime.decisions`) and reported once, on rank 0 (the `torchplace` logger).

    Args:
        device: any `torchplace.device` spec; under torchrun (or SLURM) "auto" is this rank's GPU
            and the process group is initialized.
        precision: "auto" (from the device's real capability), "bf16", "fp16", "fp32" or a dtype.
        threads: "auto" (from affinity, cgroup quota and local world size, unless the program set
            its own count first: OMP_NUM_THREADS, or torch.set_num_threads, is kept and the decision
            line says whose), an int (intra-op threads), or None to leave torch's defaults.
        strict: False, True/"error" or "warn": strict mode for the whole program.
        seed: seeds Python, NumPy, torch and every device (`torchplace.seed_everything`).
        distributed: "auto" (a process group when launched with several processes, or adopt one
            another library made), True (always), False (never).
        checkpoint_dir: the folder the run saves its checkpoints into (`rt.checkpoint_dir`).
        resume: where the run starts, for `rt.resume(model=..., optimizer=...)`: "auto" continues
            from the newest complete checkpoint in checkpoint_dir when the launcher restarted the
            job (torchrun's `--max-restarts`, on any node, or a node started again: the job's
            run id, which rank 0 records in checkpoint_dir, is found there) and starts from the
            beginning otherwise; True continues from it now (one must exist); False always starts
            from the beginning. Every rank continues from the file rank 0 found; a rank that sees
            another folder is refused.
        verbose: report the decisions (rank 0) through the `torchplace` logger at INFO; where
            logging is not configured, on stderr.

    Returns:
        The `Runtime`.

    Raises:
        DeviceError: the device does not exist here.
        DistributedError: the launch environment is inconsistent or ranks do not join.
        PrecisionError: a precision the device cannot run, under strict mode.

    Example:
        ```python
        import torch
        import torchplace as tp

        rt = tp.setup("cpu", seed=0, verbose=False)
        model = torch.nn.Linear(4, 2).to(rt.device)
        with rt.autocast():
            loss = model(rt.to(torch.randn(3, 4))).sum()
        print(rt.summary())
        ```
    """
    from .amp import precision_for
    from .policy.devices import device as resolve_device

    decisions: list[str] = []
    launch = read_launch_env()
    info = None
    existing = torch.distributed.is_available() and torch.distributed.is_initialized()  # Fabric, Accelerate
    lightning = launch.launcher == "lightning" and not existing  # Lightning's launcher: its fit makes the group
    if distributed is True or (distributed == "auto" and not lightning
                               and (existing or launch.launched and (launch.world_size or 1) > 1)):
        from .distributed.group import init

        # variables set by hand (no launcher started the other ranks): they may never come, so wait 60 s, not 300
        info = init(device=None if device == "auto" else device,
                    join_timeout=SETUP_JOIN_BY_HAND_S if launch.launcher == "env" else 300.0)
        dev = info.device
        made = "adopted (made by another library)" if info.adopted else f"launched by {info.launcher or 'hand'}"
        decisions.append(f"process group: {info.backend}, rank {info.rank} of {info.world_size} "
                         f"(local rank {info.local_rank}), {made}"
                         + (f", start {info.attempt + 1} of the group (the launcher restarted the workers)"
                            if info.restarted else ""))
    else:
        dev = resolve_device(device)
        if lightning and distributed == "auto":
            decisions.append(f"process group: none yet; Lightning's launcher started this process (local rank "
                             f"{launch.local_rank} of WORLD_SIZE={launch.world_size}) and its Trainer.fit / "
                             "Fabric.launch makes the group (torchplace.dist.init() afterwards adopts it)")
    decisions.insert(0, _describe_device(dev) + (" (auto)" if device == "auto" else ""))
    _apply_reservation(dev, decisions)

    plan = None
    from .policy.threads import configure_threads, users_thread_count

    local_world = launch.local_world_size or (info.local_world_size if info is not None else None)  # mp.spawn: counted
    kept = users_thread_count(os.environ, torch.get_num_threads(), _THREADS_AT_IMPORT, launch.launcher,
                              local_world or 1) if threads == "auto" else None
    if kept:
        decisions.append(f"threads: {torch.get_num_threads()} intra-op, kept: {kept}; threads=N sets another count")
    elif threads not in (None, False):
        plan = configure_threads(intra_op=threads if isinstance(threads, int) else None, local_world_size=local_world)
        decisions.append(f"threads: {plan.intra_op} intra-op, {plan.inter_op} inter-op of "
                         f"{plan.usable_cpus} usable CPU(s) over {plan.local_world_size} local process(es)"
                         + (" (threads= given)" if isinstance(threads, int) else " (torchplace's plan)"))

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

    resume_from = _decide_resume(resume, checkpoint_dir, info, launch, decisions)
    if resume_from is not None:
        decisions.extend(f"resume: {line}" for line in describe_resume(resume_from, info.world_size if info else 1))
    runtime = Runtime(dev, policy, plan, info, seed, mode, decisions,
                      Path(checkpoint_dir) if checkpoint_dir is not None else None, resume_from, _verbose=verbose)
    if verbose and runtime.is_main:
        _report(runtime.summary())
    return runtime


def _apply_reservation(dev: torch.device, decisions: list[str]) -> None:
    """Limit this process to the memory `torchplace run --memory` reserved for it on its GPU
    (torch.cuda.set_per_process_memory_fraction), and say so; on another device, say it is not applied."""
    from .distributed.leases import MEMORY_ENV

    text = os.environ.get(MEMORY_ENV, "").strip()
    if not text:
        return
    if not text.isascii() or not text.isdigit() or int(text) < 1:
        decisions.append(f"memory reservation: {MEMORY_ENV}={text[:40]!r} is not a number of bytes, so no limit "
                         "is set (torchplace run writes it; do not set it by hand)")
        return
    nbytes = int(text)
    if dev.type != "cuda":
        decisions.append(f"memory reservation: {nbytes / 2**30:.1f} GiB reserved by torchplace run, not applied: "
                         f"the device is {dev}, not a GPU")
        return
    index = dev.index if dev.index is not None else torch.cuda.current_device()  # cuda-only: the reserved GPU
    total = torch.cuda.get_device_properties(index).total_memory  # cuda-only: the fraction's denominator
    fraction = min(1.0, nbytes / total)
    torch.cuda.set_per_process_memory_fraction(fraction, index)  # cuda-only: the limit torch's allocator keeps
    decisions.append(f"memory reservation: this process may allocate {nbytes / 2**30:.1f} GiB of cuda:{index}'s "
                     f"{total / 2**30:.1f} GiB (set_per_process_memory_fraction({fraction:.4f}), from "
                     f"`torchplace run --memory`); more raises torch.OutOfMemoryError")


LOG = logging.getLogger("torchplace")
SETUP_JOIN_BY_HAND_S = 60.0  # setup()'s wait for ranks when RANK/WORLD_SIZE were set without a launcher


def _report(text: str) -> None:
    """setup()'s report, through the `torchplace` logger at INFO, for the user to route or silence
    (`logging.getLogger("torchplace").setLevel(logging.WARNING)`); where logging is not configured
    at all (no handler on the way), it goes to stderr, as a program's first lines should."""
    if LOG.hasHandlers():
        LOG.info(text)
    elif LOG.isEnabledFor(logging.INFO) or LOG.level == logging.NOTSET:
        print(text, file=sys.stderr)
