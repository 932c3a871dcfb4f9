"""`torchplace doctor`: versions, GPUs (physical and logical ids), interconnect, findings."""

from __future__ import annotations

import argparse

from .options import add_json, add_snapshot, print_json


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("doctor", help="check this machine's GPU/CPU set-up and explain what is wrong")
    add_json(p, "print a JSON report (also a valid --snapshot file)")
    add_snapshot(p, "diagnose a captured snapshot instead of this machine")
    p.add_argument("--check-driver", action="store_true",
                   help="also ask the CUDA driver (in a child process) and compare its device list")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..doctor.diagnose import diagnose

    report = diagnose(args.snapshot, check_driver=args.check_driver)
    if args.json:
        print_json(report.to_dict())
    else:
        from .render import render_report

        render_report(report)
    return report.exit_code
