"""`torchplace run [--gpus N | --gpus 0,2 | --gpus auto | --gpus none] [--wait 10m] -- CMD ...`.

Picks and leases GPUs, sets CUDA_VISIBLE_DEVICES (UUIDs) and CUDA_DEVICE_ORDER=PCI_BUS_ID, then
becomes CMD (one process) or torchrun (one process per GPU). See torchplace.distributed.run.
"""

from __future__ import annotations

import argparse
import shlex
import sys

from .options import add_json, add_snapshot, print_json

WAIT_FOREVER_S = 7 * 86400  # `--wait` without a value


def _wait(text: str) -> float:
    from .args import duration

    return duration(text)


def _size(text: str) -> int:
    from .args import size

    value = size(text)
    if value < 1:  # '0.5' is 0 bytes: say what was written, not "memory=0"
        raise argparse.ArgumentTypeError(f"{text!r} is {value} bytes and reserves nothing; write e.g. 20GiB, or leave "
                                         "--memory out for whole GPUs.")
    return value


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "run", help="lease GPUs and run a command on them (through torchrun for several)",
        description="Pick and lease GPUs, set CUDA_VISIBLE_DEVICES before anything starts CUDA, and "
                    "run CMD: itself for one GPU, through torchrun with one process per GPU for "
                    "several. The job replaces this process, so signals reach it directly, its exit "
                    "code is returned, and the leases end with it.",
        usage="torchplace run [options] -- CMD [ARG ...]")
    p.add_argument("--gpus", default="1", metavar="SPEC",
                   help="N (a count, default 1), physical indices or UUIDs with commas (0,2 or 3, for "
                        "GPU 3 alone), auto (every free GPU), or none (CPU processes)")
    p.add_argument("--nproc", type=int, metavar="N", help="processes per node with --gpus none (default 1)")
    p.add_argument("--once", action="store_true",
                   help="run CMD once even with several GPUs "
                        "(DataParallel, or a program that spawns its own processes)")
    p.add_argument("--wait", metavar="SECONDS", nargs="?", const=str(WAIT_FOREVER_S), type=_wait,
                   help="wait in the GPU queue of the lease directory (FIFO within a user, round robin across "
                        "users) this long, e.g. 600 or 10m; --wait alone: up to a week (default: no wait)")
    p.add_argument("--memory", metavar="SIZE", type=_size,
                   help="reserve SIZE on each GPU (e.g. 20GiB) instead of taking it whole: jobs share a GPU "
                        "while their reservations fit; setup() limits the job to it")
    p.add_argument("--min-free-memory", metavar="SIZE", help="only GPUs with this much free memory, e.g. 20GiB")
    p.add_argument("--max-utilization", type=int, metavar="PCT", help="only GPUs at most PCT percent busy")
    add_snapshot(p, "pick from a captured snapshot (for trying things out)")
    p.add_argument("--flight-recorder", metavar="DIR",
                   help="record every rank's collectives (torch's flight recorder); on a timeout each rank dumps "
                        "into DIR and the failure names the rank that never entered the collective")
    p.add_argument("--dry-run", action="store_true", help="print what would run and exit (holds no lease)")
    add_json(p, "with --dry-run: print the plan as JSON")
    group = p.add_argument_group("torchrun options passed through (several nodes: --nnodes, --rdzv-*)")
    for name in ("nnodes", "node-rank", "rdzv-backend", "rdzv-endpoint", "rdzv-id", "rdzv-conf",
                 "master-addr", "master-port", "max-restarts", "monitor-interval", "log-dir",
                 "redirects", "tee", "local-addr", "local-ranks-filter"):
        group.add_argument(f"--{name}", dest=f"tr_{name.replace('-', '_')}", metavar="VALUE",
                           help=argparse.SUPPRESS if name in ("redirects", "tee", "local-addr",
                                                              "local-ranks-filter", "monitor-interval")
                           else f"torchrun --{name}")
    p.add_argument("cmd", nargs=argparse.REMAINDER, help="the command, after --")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import argparse as _argparse

    from ..distributed import run as runner
    from ..errors import TorchplaceError
    from .args import UsageError, command

    try:
        cmd = command(args.cmd)
    except _argparse.ArgumentTypeError as exc:
        raise UsageError(f"torchplace: error: {exc} See `torchplace run --help`.") from None
    if args.json and not args.dry_run:  # the command's own output goes to stdout: no JSON can follow it
        raise UsageError("torchplace: error: --json prints the plan, which only --dry-run reports; a "
                         "run prints the command's own output. Fix: `torchplace run --dry-run --json ... -- CMD`, "
                         "or drop --json.")
    torchrun = {k[3:]: v for k, v in vars(args).items() if k.startswith("tr_") and v is not None}
    plan = runner.plan(cmd, gpus=args.gpus, nproc=args.nproc, once=args.once, wait=args.wait,
                       min_free_memory=args.min_free_memory, max_utilization=args.max_utilization,
                       snapshot=args.snapshot, torchrun=torchrun, lease=not args.dry_run,
                       flight_recorder=args.flight_recorder, memory=args.memory)
    if args.dry_run:
        if args.json:
            print_json(plan.to_dict())
        else:
            for key, value in plan.env_changes.items():  # quoted as a shell reads them: the lines can be pasted
                print(f"{key}={shlex.quote(value) if value else ''}")
            print(shlex.join(plan.argv))
        return 0
    try:
        runner.execute(plan)
    except TorchplaceError as exc:
        print(f"torchplace: error: {exc}", file=sys.stderr)
        return 127
