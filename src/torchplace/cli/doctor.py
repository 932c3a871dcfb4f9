"""`torchplace doctor`: versions, GPUs (physical and logical ids), interconnect, findings."""

from __future__ import annotations

import argparse
import json


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("doctor", help="check this machine's GPU/CPU set-up and explain what is wrong")
    p.add_argument("--json", action="store_true", help="print a JSON report (also a valid --snapshot file)")
    p.add_argument("--snapshot", metavar="FILE", help="diagnose a captured snapshot instead of this machine")
    p.add_argument("--check-driver", action="store_true",
                   help="also ask the CUDA driver (in a child process) and compare its device list")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..doctor.diagnose import diagnose

    report = diagnose(args.snapshot, check_driver=args.check_driver)
    if args.json:
        print(json.dumps(report.to_dict(), indent=1))
    else:
        from .render import render_report

        render_report(report)
    return report.exit_code
