"""`torchplace queue`: who waits for which GPUs, since when, and in which position."""

from __future__ import annotations

import argparse
import time

from .options import add_json, print_json


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("queue", help="list the jobs waiting for GPUs (`torchplace run --wait`), in the order served",
                       description="The jobs waiting in the lease directory's queue, in the order they will be "
                                   "served: first come first served within a user, round robin across users.")
    p.add_argument("--dir", metavar="DIR",
                   help="lease directory (default $TORCHPLACE_LEASE_DIR or /tmp/torchplace-leases)")
    add_json(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..distributed.leases import LeaseDir
    from ..distributed.queue import last_served, waiters
    from ..policy.fairness import serve_order

    folder = LeaseDir(args.dir)
    waiting = {w.name: w for w in waiters(folder)}
    order = [waiting[a.key] for a in serve_order([w.ask() for w in waiting.values()], last_served(folder))]
    now = time.time_ns()
    records = [{"position": i + 1, **w.to_dict(), "asks": w.ask().describe(),
                "waited_s": round(max(0, now - w.since_ns) / 1e9, 1)} for i, w in enumerate(order)]
    if args.json:
        print_json({"lease_dir": str(folder.path), "queue": records})
        return 0
    from .render import console, show_table

    if not records:
        console.print(f"No job waits for GPUs ({folder.path}).")
        return 0
    rows = [[str(r["position"]), r["user"], str(r["pid"]), r["asks"], r["since"].replace("T", " ")[:19],
             f"{r['waited_s']:.0f} s", f"{r['wait_s']:.0f} s", r["command"]] for r in records]
    show_table(f"GPU queue in {folder.path}", ["#", "user", "pid", "asks for", "since", "waited", "waits up to",
                                               "command"], rows, ids=["pid", "since"], right=["#"])
    return 0
