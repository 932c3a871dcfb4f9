"""`torchplace map`: the physical <-> logical GPU table for the current environment."""

from __future__ import annotations

import argparse

from .options import add_json, add_snapshot, print_json


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("map", help="show which physical GPU each cuda:N is, under CUDA_VISIBLE_DEVICES")
    add_json(p)
    add_snapshot(p, "map against a captured snapshot instead of this machine")
    p.add_argument("--check-driver", action="store_true", help="compare with what the CUDA driver enumerates")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..doctor.diagnose import driver_check
    from ..hardware.facts import read_facts

    facts = read_facts(args.snapshot)
    vis = facts.visible
    notes = list(vis.notes)
    if facts.host.container:
        notes.append(f"in a {facts.host.container} container: physical numbers are the container's; UUID and "
                     "bus id mean the same on the host (`torchplace doctor` says which host GPUs it was given)")
    if facts.topology.nvml_error:
        notes.append(f"GPU facts unavailable: {facts.topology.nvml_error}")
    checks = driver_check(facts) if args.check_driver and not args.snapshot else []
    notes += [f"{f.title}: {f.detail}" for f in checks]
    if args.json:
        print_json({
            "visible": [{"logical": d.logical, "physical_index": d.physical_index, "uuid": d.uuid,
                         "name": d.name, "mig_uuid": d.mig_uuid} for d in vis.visible],
            "hidden": [g.physical_index for g in facts.topology.gpus if vis.logical_of(g.physical_index) is None],
            "cuda_visible_devices": vis.cuda_visible_devices, "cuda_device_order": vis.cuda_device_order,
            "order": vis.order, "notes": notes, "source": facts.source})
    else:
        from .render import render_map

        render_map(facts, notes)
    return 1 if any(f.severity == "error" for f in checks) else 0
