"""`torchplace leases`: who holds which GPU, from the shared lease directory."""

from __future__ import annotations

import argparse

from ..units import format_bytes
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
    from ..distributed.leases import LeaseDir, unleased_processes

    leases = LeaseDir(args.dir)
    every = leases.list()
    rows = [s for s in every if args.all or s.held]
    gpus = {}
    unleased = []
    if not args.no_gpu_names:
        from ..hardware.topology import load_topology

        topo = load_topology(args.snapshot, links=False, details=False)
        gpus = {g.uuid: g for g in topo.gpus}
        unleased = [{"physical_index": g.physical_index, "uuid": g.uuid, "pid": p.pid, "user": p.user,
                     "used_memory_bytes": p.used_memory_bytes, "name": p.name}
                    for g, p in unleased_processes(topo, statuses={s.uuid: s for s in every})]
    records = []
    for status in rows:
        gpu = gpus.get(status.uuid)
        records.append({**status.to_dict(), "physical_index": gpu.physical_index if gpu else None,
                        "name": gpu.name if gpu else None})
    if args.json:
        print_json({"lease_dir": str(leases.path), "leases": records, "unleased": unleased})
        return 0
    from .render import console, show_table

    if unleased:
        show_table("GPUs used without a lease (NVML's processes that no lease of their GPU covers)",
                   ["GPU", "pid", "user", "memory", "process"],
                   [[str(u["physical_index"]), str(u["pid"]), u["user"] or "?",
                     format_bytes(u["used_memory_bytes"], "GiB"), u["name"] or ""] for u in unleased],
                   ids=["pid"], right=["GPU", "memory"])
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
        if not rec.get("reservations"):
            rows.append([gpu, rec["uuid"], *held, str(holder.get("pid") or ""), holder.get("user") or "", since,
                         holder.get("command") or ""])
        for res in rec.get("reservations") or []:  # a GPU shared by memory reservations: one row each
            rows.append([gpu, rec["uuid"], *held, str(res.get("pid") or ""), res.get("user") or "",
                         (res.get("since") or "").replace("T", " ")[:19],
                         f"[{format_bytes(res.get('memory_bytes'), 'GiB')} reserved] {res.get('command') or ''}"])
    show_table(f"GPU leases in {leases.path}", headers, rows, ids=["UUID", "pid", "since"], right=["GPU"])
    return 0
