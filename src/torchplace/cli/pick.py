"""`torchplace pick`: print the CUDA_VISIBLE_DEVICES value for free GPUs (NVML only, no torch).

The process ends right after printing, so it holds no lease; it does skip GPUs that others
have leased. To hold GPUs for a command, use `torchplace run`.
"""

from __future__ import annotations

import argparse
import os
import sys

from ..units import format_bytes
from .options import add_json, add_snapshot, print_json


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("pick", help="choose free GPUs (NVML facts only; CUDA never starts)",
                       description="Choose free GPUs by free memory, utilization and other users' "
                                   "processes, skipping GPUs leased by torchplace processes. Prints "
                                   "the CUDA_VISIBLE_DEVICES value (UUIDs). Holds no lease: use "
                                   "`torchplace run` to keep GPUs for a command.")
    p.add_argument("--count", "-n", default="1", metavar="N",
                   help="how many GPUs, or 'auto' for all free ones (default 1)")
    p.add_argument("--min-free-memory", metavar="SIZE", help="skip GPUs with less free memory, e.g. 20GiB")
    p.add_argument("--max-utilization", type=int, metavar="PCT", help="skip GPUs busier than PCT percent")
    p.add_argument("--wait", metavar="DURATION",
                   help="wait this long for GPUs to become free, e.g. 10m (default: no wait)")
    add_snapshot(p, "decide on a captured snapshot instead of this machine")
    add_json(p, "print the choice and the reasons as JSON")
    p.add_argument("--format", choices=("uuid", "index"), default="uuid",
                   help="uuid (default): GPU UUIDs, right whatever CUDA_DEVICE_ORDER says; index: the "
                        "indices nvidia-smi shows, which CUDA reads the same way only with "
                        "CUDA_DEVICE_ORDER=PCI_BUS_ID")
    p.add_argument("--explain", action="store_true", help="also print why each GPU was or was not chosen (stderr)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..distributed.pick import pick_request
    from ..policy.ranking import PickRequest

    # every value was checked when parsed (cli.args): count is a whole number >= 1 or "auto"
    request = PickRequest.build(args.count, min_free_memory=args.min_free_memory,
                                max_utilization=args.max_utilization, wait=args.wait, snapshot=args.snapshot,
                                lease=False)
    picked = pick_request(request)
    if args.json:
        print_json(picked.to_dict())
    elif args.format == "index":
        print(",".join(map(str, picked.physical_indices)))
        if os.environ.get("CUDA_DEVICE_ORDER") != "PCI_BUS_ID":
            print("note: these are nvidia-smi's indices; CUDA numbers GPUs the same way only with "
                  "CUDA_DEVICE_ORDER=PCI_BUS_ID (export it too, or use the default --format uuid)",
                  file=sys.stderr)
    else:
        print(picked.cuda_visible_devices)
    if args.explain:
        for gpu in picked.gpus:
            print(f"picked GPU {gpu.physical_index} ({gpu.uuid}): {format_bytes(gpu.memory_free, 'GiB')} free, "
                  f"{gpu.utilization if gpu.utilization is not None else '?'}% utilization, "
                  f"{gpu.other_users_processes if gpu.other_users_processes is not None else '?'} "
                  "processes of other users", file=sys.stderr)
        for rejection in picked.rejected:
            print(f"skipped {rejection.describe()}", file=sys.stderr)
    return 0
