"""`torchplace leases`: who holds which GPU, from the shared lease directory."""

from __future__ import annotations

import argparse

from .options import add_json, add_snapshot, print_json


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("leases", help="list the GPUs leased by torchplace processes and their holders")
    p.add_argument("--all", action="store_true", help="also list lease files nobody holds now")
    p.add_argument("--dir", metavar="DIR",
                   help="lease directory (default $TORCHPLACE_LEASE_DIR or /tmp/torchplace-leases)")
    add_snapshot(p, "name GPUs from a captured snapshot instead of this machine")
    p.add_argument("--no-gpu-names", action="store_true", help="do not ask NVML for GPU indices and names")
    add_json(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..distributed.leases import LeaseDir

    leases = LeaseDir(args.dir)
    rows = [s for s in leases.list() if args.all or s.held]
    gpus = {}
    if not args.no_gpu_names:
        from ..hardware.topology import load_topology

        gpus = {g.uuid: g for g in load_topology(args.snapshot, links=False, details=False).gpus}
    records = []
    for status in rows:
        gpu = gpus.get(status.uuid)
        records.append({**status.to_dict(), "physical_index": gpu.physical_index if gpu else None,
                        "name": gpu.name if gpu else None})
    if args.json:
        print_json({"lease_dir": str(leases.path), "leases": records})
        return 0
    from .render import console, show_table

    if not records:
        console.print(f"No GPU is leased ({leases.path}).")
        return 0
    headers = ["GPU", "UUID", *(["held"] if args.all else []), "pid", "user", "since", "command"]
    rows = []
    for rec in records:
        holder = rec["holder"] or {}
        gpu = "?" if rec["physical_index"] is None else str(rec["physical_index"])
        held = ["yes" if rec["held"] else "no"] if args.all else []
        since = (holder.get("since") or "").replace("T", " ")[:19]
        rows.append([gpu, rec["uuid"], *held, str(holder.get("pid") or ""), holder.get("user") or "", since,
                     holder.get("command") or ""])
    show_table(f"GPU leases in {leases.path}", headers, rows, ids=["UUID", "pid", "since"], right=["GPU"])
    return 0
