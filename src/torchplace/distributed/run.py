"""`torchplace run`: pick and lease GPUs, fix CUDA_VISIBLE_DEVICES, then become the job.

The job gets CUDA_VISIBLE_DEVICES (GPU UUIDs) and CUDA_DEVICE_ORDER=PCI_BUS_ID in its
environment from its first instruction, so nothing in it can start CUDA on the wrong GPUs.
One process (one GPU, `--once`, or `--gpus none`) runs CMD itself; several run through
torchrun (torch.distributed.run), one process per GPU, single-node (`--standalone`) unless
torchrun's rendezvous options are given for several nodes.

`execute` replaces this process with the job (exec) instead of starting a child. So the job
has this process's pid, receives every signal sent to it directly (nothing to forward or
lose), its exit code is the exit code, and the lease descriptors, kept open across exec, live
exactly as long as the job: the leases vanish when it ends, however it ends. Under torchrun the
job is this module's `torchrun_main`, which runs torch.distributed.run in-process and exits
with the code of the first rank that failed rather than torchrun's generic 1.
Every other environment variable (NCCL_NVLS_ENABLE included) passes through unchanged, with one
addition for jobs over several nodes: TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (unless set already).

Why. With the c10d rendezvous torchrun's agents share one TCP store with their workers by
default (torch >= 2.5): the agent of node rank 0 starts it once and every agent caches its
address after the first round. An agent that is started again after its node died has no cache:
it waits in the new round for rank 0 to publish the store's address, which rank 0, holding its
cache, never does; the restarted node blocks in `RendezvousStoreInfo.build` until the store's read
timeout ("Connection was likely closed"), the surviving agent times out on the role information
of the round, and both exit 1 (seen with torch 2.13 in every try, tests/distributed/
test_node_restart.py). Unshared, the agent of rank 0 picks a fresh port each round and its rank 0
worker hosts the store there, so every round starts on empty keys and the restarted node joins.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NoReturn

from ..errors import DistributedError, TorchplaceError
from ..hardware.launch import torchrun_options_from_slurm
from ..policy.ranking import PickRequest
from .pick import Picked, pick_request

#: torchrun options `torchplace run` passes through unchanged (all exist in torch >= 2.6).
TORCHRUN_OPTIONS = ("nnodes", "node_rank", "rdzv_backend", "rdzv_endpoint", "rdzv_id", "rdzv_conf",
                    "master_addr", "master_port", "max_restarts", "monitor_interval", "log_dir",
                    "redirects", "tee", "local_addr", "local_ranks_filter")
#: torch's switch that gives each rendezvous round its own store (the module docstring says why)
_UNSHARED_STORE = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
#: what `torchplace run` tells a job of several nodes about its rendezvous (torchrun tells workers only the store's
#: address): "backend=etcd-v2 endpoint=host:2379 id=job nnodes=1:2", for `torchplace doctor` inside the job
RDZV_ENV = "TORCHPLACE_RDZV"
_MULTINODE_OPTIONS = ("nnodes", "rdzv_backend", "rdzv_endpoint", "rdzv_id", "master_addr", "master_port")
#: programs that start one process per GPU themselves: run under torchrun, they would nest launchers
_LAUNCHERS = {"torchrun": "torchrun", "deepspeed": "deepspeed", "accelerate": "accelerate launch",
              "accelerate-launch": "accelerate launch"}
_LAUNCHER_MODULES = {"torch.distributed.run": "torchrun", "torch.distributed.launch": "torchrun",
                     "accelerate.commands.launch": "accelerate launch", "deepspeed.launcher.runner": "deepspeed"}


def launcher_in(cmd: Sequence[str]) -> str | None:
    """The launcher CMD starts, or None.

    Launchers: torchrun, `accelerate launch`, deepspeed, `python -m torch.distributed.run`.
    """
    if not cmd:
        return None
    program = os.path.basename(cmd[0])
    if program == "accelerate":
        return _LAUNCHERS[program] if len(cmd) > 1 and cmd[1] == "launch" else None
    if program in _LAUNCHERS:
        return _LAUNCHERS[program]
    if program.startswith("python") and "-m" in cmd[1:]:
        at = cmd.index("-m", 1)
        return _LAUNCHER_MODULES.get(cmd[at + 1]) if at + 1 < len(cmd) else None
    return None


@dataclass(frozen=True)
class GpuRequest:
    """What `--gpus` asked for: a count, named GPUs, "auto" (every free one) or "none" (CPU)."""

    count: int | None = None
    named: tuple[str, ...] = ()
    auto: bool = False
    none: bool = False

    @classmethod
    def parse(cls, text: str | int) -> GpuRequest:
        """``2`` = two GPUs; ``0,2`` or ``3,`` or ``GPU-5e3f...`` = those GPUs (physical index
        or UUID); ``auto`` = every GPU that is free now; ``none`` = no GPU (CPU processes)."""
        raw = str(text).strip()
        low = raw.lower()
        if low == "auto":
            return cls(auto=True)
        if low in ("none", "cpu"):
            return cls(none=True)
        if raw.isascii() and raw.isdigit():  # str.isdigit alone takes '\u00b2' and '\u0661'
            if len(raw) > 6:
                raise DistributedError(f"--gpus {raw[:20]!r}{'...' if len(raw) > 20 else ''} asks for more GPUs "
                                       "than any machine has. Fix: give a count such as 2, or auto.")
            if int(raw) == 0:
                raise DistributedError("--gpus 0 asks for zero GPUs. Fix: --gpus none for CPU "
                                       "processes, or --gpus 0, (with a comma) for physical GPU 0.")
            return cls(count=int(raw))
        items = tuple(item.strip() for item in raw.split(",") if item.strip())
        if not items or not all((item.isascii() and item.isdigit()) or item.startswith("GPU-") for item in items):
            raise DistributedError(
                f"--gpus {raw!r} is not understood. Write a count (2), physical indices or UUIDs "
                "separated by commas (0,2 or 3, for GPU 3 alone, or GPU-5e3f...), auto, or none.")
        return cls(named=items)


@dataclass
class RunPlan:
    """Everything `execute` will do: the argv, the environment changes, the leased GPUs."""

    argv: list[str]
    env_changes: dict[str, str]
    nproc: int
    launcher: str  # "direct" (CMD itself) or "torchrun"
    picked: Picked | None = None
    notes: list[str] = field(default_factory=list)

    def environ(self, base: Any = None) -> dict[str, str]:
        env = dict(os.environ if base is None else base)
        env.update(self.env_changes)
        return env

    def to_dict(self) -> dict[str, Any]:
        return {"argv": self.argv, "env": self.env_changes, "nproc_per_node": self.nproc,
                "launcher": self.launcher, "picked": self.picked.to_dict() if self.picked else None,
                "notes": self.notes}


def plan(cmd: Sequence[str], *, gpus: str | int | GpuRequest = 1, nproc: int | None = None,
         once: bool = False, wait: float | str | None = None, min_free_memory: int | str | None = None,
         max_utilization: int | None = None, snapshot: str | None = None,
         torchrun: dict[str, Any] | None = None, lease: bool = True,
         flight_recorder: str | os.PathLike[str] | None = None, memory: int | str | None = None) -> RunPlan:
    """Pick and lease the GPUs and build the command and environment for the job.

    `torchrun` holds pass-through options by name (see TORCHRUN_OPTIONS), e.g.
    ``{"nnodes": "2", "rdzv_endpoint": "node0:29400", "rdzv_backend": "c10d"}``. `flight_recorder`: a
    folder; torch's flight recorder is turned on and every rank dumps there when a collective times
    out, and the job's failure message says which rank never entered which collective.
    """
    cmd = list(cmd)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        raise DistributedError("No command to run. Fix: put it after --, e.g. "
                               "`torchplace run --gpus 2 -- python train.py`.")
    request = gpus if isinstance(gpus, GpuRequest) else GpuRequest.parse(gpus)
    notes: list[str] = []
    if re.fullmatch(r"python(\d+(\.\d+)?)?", cmd[0]) and sys.executable:  # as accelerate launch does
        notes.append(f"{cmd[0]} is the interpreter torchplace runs under ({sys.executable}), not the one on PATH")
        cmd = [sys.executable, *cmd[1:]]
    torchrun = {k: v for k, v in (torchrun or {}).items() if v is not None}
    unknown = sorted(set(torchrun) - set(TORCHRUN_OPTIONS))
    if unknown:
        raise DistributedError(f"Unknown torchrun options {unknown}; torchplace run passes "
                               f"through {', '.join(TORCHRUN_OPTIONS)}.")
    changes: dict[str, str] = {}
    picked = None
    if flight_recorder is not None:
        from .flight_recorder import recorder_env

        os.makedirs(flight_recorder, exist_ok=True)
        changes.update({k: v for k, v in recorder_env(os.path.abspath(flight_recorder)).items()
                        if k not in os.environ or k.endswith("_FILE")})
        notes.append(f"flight recorder on: every rank dumps into {flight_recorder} when a collective times out")
    if not once and not any(k in torchrun for k in _MULTINODE_OPTIONS):
        slurm, sources = torchrun_options_from_slurm()
        if slurm:  # srun started this launcher once per node: make them one job
            torchrun.update(slurm)
            notes.append("SLURM job over several nodes: " + ", ".join(
                f"--{k.replace('_', '-')} {v} ({sources[k]})" for k, v in slurm.items()))
    if request.none:
        changes["CUDA_VISIBLE_DEVICES"] = ""
        count = nproc or 1
        notes.append("--gpus none: CUDA_VISIBLE_DEVICES is empty, so the job sees no GPU.")
    else:
        picked = pick_request(PickRequest.build(
            "auto" if request.auto else request.count or 1, gpus=list(request.named) if request.named else None,
            wait=wait, min_free_memory=min_free_memory, max_utilization=max_utilization, snapshot=snapshot,
            lease=lease, command=" ".join(cmd), memory=memory))
        changes.update(picked.env())
        changes["TORCHPLACE_LEASE_DIR"] = picked.lease_dir or ""
        count = len(picked.gpus)
        if nproc is not None and nproc != count and not once:
            picked.release()
            raise DistributedError(
                f"--nproc {nproc} does not match the {count} GPU(s) picked ({picked.cuda_visible_devices}); "
                "torchplace run starts one process per GPU. Fix: drop --nproc, or use --once for a "
                "program that starts its own processes.")
    multinode = any(k in torchrun for k in _MULTINODE_OPTIONS) and str(torchrun.get("nnodes", "2")) != "1"
    launcher = launcher_in(cmd)
    if launcher is not None:
        if not once and (count > 1 or multinode):
            if picked is not None:
                picked.release()
            raise DistributedError(
                f"The command starts {launcher}, which launches its own processes, and torchplace run "
                f"would start it once per GPU ({count} times), nesting launchers. Fix: add --once so "
                f"{launcher} runs once on the leased GPUs (`torchplace run --gpus {count} --once -- "
                f"{' '.join(cmd)}`), or drop {launcher} and let torchplace run start the processes.")
        notes.append(f"CMD is a launcher ({launcher}): it runs once and starts its own processes on the "
                     "GPUs in CUDA_VISIBLE_DEVICES.")
    if once or (count == 1 and not multinode):
        if torchrun:
            raise DistributedError(f"torchrun options {sorted(torchrun)} need several processes, but "
                                   "this run starts one. Fix: drop them, or drop --once.")
        return RunPlan(argv=cmd, env_changes=changes, nproc=1, launcher="direct", picked=picked, notes=notes)
    argv = [sys.executable, "-m", "torchplace.distributed.run"]
    if not multinode:
        argv.append("--standalone")
    elif _UNSHARED_STORE not in os.environ:
        changes[_UNSHARED_STORE] = "1"
        notes.append(f"several nodes: {_UNSHARED_STORE}=1, so a node that dies and is started again can "
                     "rejoin the job (torch's shared rendezvous store would keep it out)")
    if multinode:
        changes[RDZV_ENV] = " ".join(f"{key}={torchrun[name]}" for key, name in (
            ("backend", "rdzv_backend"), ("endpoint", "rdzv_endpoint"), ("id", "rdzv_id"), ("nnodes", "nnodes"))
            if name in torchrun)
    for name in TORCHRUN_OPTIONS:
        if name in torchrun:
            argv += [f"--{name.replace('_', '-')}", str(torchrun[name])]
    # "--" keeps torchrun's parser away from CMD's options (it would take "--nproc" for its own)
    argv += ["--nproc-per-node", str(count), "--no-python", "--", *cmd]
    return RunPlan(argv=argv, env_changes=changes, nproc=count, launcher="torchrun", picked=picked, notes=notes)


def execute(run: RunPlan) -> NoReturn:
    """Become the job: exec its argv with the new environment, handing over the leases."""
    if run.picked is not None:
        for lease in run.picked.leases:
            lease.keep_across_exec()
    program = run.argv[0]
    env = run.environ()
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execvpe(program, run.argv, env)
    except OSError as exc:  # exec returned: nothing ran, so give the GPUs back and say why
        if run.picked is not None:
            run.picked.release()
        shown = _shown(program)
        if isinstance(exc, FileNotFoundError) and "/" not in program:
            where = ""
            if os.path.isfile(program):  # a program here that PATH does not reach (a folder is no program)
                where = (f" (a file of that name is in this directory; write ./{shown[1:-1]})"
                         if os.access(program, os.X_OK) else
                         f" (a file of that name in this directory is not executable; `-- python3 {shown[1:-1]}` "
                         "runs it through Python)")
            raise TorchplaceError(f"Command {shown} was not found on PATH{where}. Fix: check its "
                                  "spelling, or give its path (for Python: `-- python3 train.py`).") from None
        if os.path.isdir(program):
            raise TorchplaceError(f"Cannot run {shown}: it is a directory. Fix: name the program in it to run, e.g. "
                                  f"`-- python3 {shown[1:-1]}/train.py`.") from None
        raise TorchplaceError(f"Cannot run {shown}: {exc.strerror}. Fix: make it executable (chmod +x) or run "
                              f"it through its interpreter, e.g. `-- python3 {shown[1:-1]}`.") from None


def _shown(name: str) -> str:
    """NAME quoted as the terminal should show it: bytes that are not UTF-8 (which Python keeps as
    surrogates, '\\udcff') written as the \\xff the user typed."""
    return repr(os.fsencode(name).decode("utf-8", "backslashreplace")).replace("\\\\x", "\\x")


# --------------------------------------------------------------------------- torchrun side


def _exit_code(code: int | None) -> int:
    if code is None:
        return 1
    return 128 - code if code < 0 else code  # killed by signal N: 128 + N, as shells report


def _print_flight_record(since: float) -> None:
    """After a failure: the flight recorder's verdict, when the job dumped one (TORCH_FR_DUMP_TEMP_FILE)."""
    prefix = os.environ.get("TORCH_FR_DUMP_TEMP_FILE") or os.environ.get("TORCH_NCCL_DEBUG_INFO_TEMP_FILE")
    if not prefix:
        return
    from .flight_recorder import read_traces, summarize

    folder, name = os.path.split(prefix)
    try:
        fresh = [t for t in read_traces(folder or ".", name) if t.path.stat().st_mtime >= since - 1]
    except (OSError, TorchplaceError) as exc:
        print(f"torchplace run: the flight recorder dumps in {folder} could not be read: {exc}", file=sys.stderr)
        return
    if fresh:
        print(f"torchplace run: flight recorder ({len(fresh)} dump(s) in {folder}): {summarize(fresh).describe()}",
              file=sys.stderr)


class RendezvousWatch(logging.Handler):
    """What torch's dynamic rendezvous (c10d, etcd-v2) logs about the nodes, kept so that a rendezvous that
    times out can name the node that was lost: this node's rank in each round it joined, and the nodes
    whose heartbeats stopped. torch keeps the participants only in its private rendezvous state and says
    them only in its log lines (the dead ones at debug level), so the log is read; other wording: no names."""

    LOGGER = "torch.distributed.elastic.rendezvous.dynamic_rendezvous"
    _JOINED = re.compile(r"The node '(?P<node>[^']+)' has joined round \d+ of the rendezvous '.*' as rank "
                         r"(?P<rank>\d+) in a world of size (?P<world>\d+)")
    _DEAD = re.compile(r"Detected dead node '(?P<node>[^']+)'")

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.this: tuple[str, int, int | None] | None = None
        self.world: int | None = None
        self.lost: list[tuple[str, int, int | None]] = []
        self._logger = logging.getLogger(self.LOGGER)
        self._shown = self._logger.getEffectiveLevel()  # what the user saw before: still passed on

    @staticmethod
    def _parse(node: str) -> tuple[str, int]:
        addr, pid, _ = node.rsplit("_", 2)  # torch's _NodeDesc: ADDR_PID_LOCALID
        return addr, int(pid)

    def __enter__(self) -> RendezvousWatch:
        self._saved = self._logger.level, self._logger.propagate
        self._logger.setLevel(logging.DEBUG)
        self._logger.propagate = False  # debug lines come here only; the rest go on in emit()
        self._logger.addHandler(self)
        return self

    def __exit__(self, *exc: object) -> None:
        self._logger.removeHandler(self)
        self._logger.level, self._logger.propagate = self._saved

    def emit(self, record: logging.LogRecord) -> None:
        with contextlib.suppress(Exception):  # a line of another shape names nobody; it never breaks the job
            text = record.getMessage()
            if m := self._JOINED.search(text):
                self.this, self.world = (*self._parse(m["node"]), int(m["rank"])), int(m["world"])
            elif (m := self._DEAD.search(text)) and self.this is not None:
                addr, pid = self._parse(m["node"])
                # its rank in the last round it was in: known when the two of a 2-node job are it and this node
                rank = 1 - self.this[2] if self.world == 2 and self.this[2] is not None else None
                if (addr, pid) != self.this[:2] and (addr, pid) not in [n[:2] for n in self.lost]:
                    self.lost.append((addr, pid, rank))
        if record.levelno >= self._shown and self._logger.parent is not None:
            self._logger.parent.handle(record)


def _rdzv_conf(conf: str, key: str, default: float) -> float:
    for item in (conf or "").split(","):
        name, _, value = item.partition("=")
        if name.strip() == key:
            with contextlib.suppress(ValueError):
                return float(value)
    return default


def torchrun_main(argv: Sequence[str]) -> int:
    """Run torch.distributed.run in this process; return the first failed rank's exit code."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousTimeoutError
    from torch.distributed.run import parse_args, run

    from .failures import rendezvous_timed_out

    started = time.time()
    args = parse_args(list(argv))
    watch = RendezvousWatch()
    try:
        with watch:
            run(args)
    except RendezvousTimeoutError:
        error = rendezvous_timed_out(nnodes=str(args.nnodes), timeout_s=_rdzv_conf(args.rdzv_conf, "join_timeout", 600),
                                     endpoint=args.rdzv_endpoint or None, this=watch.this, lost=watch.lost)
        print(f"torchplace run: {error}", file=sys.stderr)
        return 1
    except ChildFailedError as exc:
        _print_flight_record(started)
        rank, failure = exc.get_first_failure()
        code = _exit_code(failure.exitcode)
        others = sorted(set(exc.failures) - {rank})
        print(f"torchplace run: rank {rank} (local rank {failure.local_rank}, pid {failure.pid}) failed "
              f"first, with exit code {code}"
              + (f"; ranks {others} failed after it" if others else "")
              + ". Its error is above; torchrun stopped the other ranks.", file=sys.stderr)
        return code
    except SignalException as exc:
        return 128 + int(exc.sigval)
    return 0


if __name__ == "__main__":
    sys.exit(torchrun_main(sys.argv[1:]))
