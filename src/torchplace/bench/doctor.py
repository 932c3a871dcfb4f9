"""`torchplace bench doctor`: doctor's wall time against collect_env and a naive torch query."""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

from ..progress import advance, begin
from .common import BenchResult, Row, Target, median

NAIVE = ("import torch; n = torch.cuda.device_count(); "
         "print([torch.cuda.get_device_properties(i) for i in range(n)], torch.version.cuda)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--repeat", type=int, default=3, help="runs of each command (median is reported)")


def _wall(cmd: list[str], repeat: int) -> tuple[float, int]:
    times, rc = [], 0
    for _ in range(repeat):
        start = time.perf_counter()
        rc = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode
        times.append(time.perf_counter() - start)
    return median(times), rc


def _cuda_initialized_after_doctor() -> bool:
    code = ("import torch; from torchplace.doctor.diagnose import diagnose; diagnose(check_driver=False); "
            "print(torch.cuda.is_initialized())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    return out.stdout.strip().endswith("True")


def run(args: argparse.Namespace) -> BenchResult:
    variants = {
        "python -m torch.utils.collect_env": [sys.executable, "-m", "torch.utils.collect_env"],
        "naive: import torch + get_device_properties": [sys.executable, "-c", NAIVE],
        "torchplace doctor --json": [sys.executable, "-m", "torchplace", "doctor", "--json"],
    }
    rows = []
    begin("timing commands", len(variants))
    for name, cmd in variants.items():
        seconds, rc = _wall(cmd, args.repeat)
        rows.append(Row(name, seconds, "s", extra={"exit_code": rc}))
        advance()
    doctor = rows[-1].value
    initialized = _cuda_initialized_after_doctor()
    result = BenchResult("doctor", rows, baseline="python -m torch.utils.collect_env",
                         targets=[Target("doctor wall time (s)", doctor, 1.0, "<="),
                                  Target("doctor / collect_env", doctor / rows[0].value, 1.0, "<=")],
                         params={"repeat": args.repeat})
    result.notes.append(f"torch.cuda.is_initialized() after doctor in-process: {initialized}")
    return result
