"""Hostile inputs stay within memory bounds and never block: measured in a child process.

Goal (issue 14): any input costs at most max(2x its real size, 256 MiB) of memory over the
baseline of a process that has imported torch and torchplace. The child reports its peak resident
size (ru_maxrss) before and after running every reader on the cases that once took gigabytes,
under an address-space cap, so a regression fails instead of taking the machine down.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from .crafting import CASES, MEMORY_CASES

pytestmark = pytest.mark.timeout(300)

BUDGET_FLOOR = 256 * 2**20

CHILD = textwrap.dedent('''
    import json, os, resource, sys, time
    import torch, torchplace
    from torchplace.checkpoint import convert, inspect
    from torchplace.errors import CheckpointError

    def peak():
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux

    base = peak()
    # a runaway allocation fails here (MemoryError) instead of taking the machine down
    resource.setrlimit(resource.RLIMIT_AS, (int(sys.argv[2]), int(sys.argv[2])))
    out = {}
    for name, path in json.loads(sys.argv[1]).items():
        start, before, errors = time.monotonic(), peak(), []
        for read in (lambda: torchplace.load(path), lambda: inspect(path, verify=True),
                     lambda: convert(path, path + ".converted")):
            try:
                read()
            except CheckpointError:
                pass
            except BaseException as exc:
                errors.append(f"{type(exc).__name__}: {exc}"[:200])
        out[name] = {"grew": peak() - base, "seconds": time.monotonic() - start, "errors": errors}
    print(json.dumps(out))
''')


def test_hostile_inputs_stay_within_memory_bounds(tmp_path: Path) -> None:
    paths = {}
    for name in MEMORY_CASES:
        folder = tmp_path / name
        folder.mkdir()
        paths[name] = str(CASES[name](folder))
    # the cap leaves room for torch's own address space (several GiB of mappings) but not for 8 GiB reads
    cap = 6 * 2**30
    run = subprocess.run([sys.executable, "-c", CHILD, json.dumps(paths), str(cap)], capture_output=True,
                         text=True, timeout=240)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(run.stdout.splitlines()[-1])
    for name, got in report.items():
        path = Path(paths[name])
        size = path.stat().st_size if path.is_file() and not path.is_char_device() else 0
        budget = max(2 * size, BUDGET_FLOOR)
        assert not got["errors"], f"{name}: {got['errors']}"
        assert got["grew"] <= budget, \
            f"{name}: peak grew {got['grew'] / 2**20:.0f} MiB (budget {budget / 2**20:.0f} MiB)"
        assert got["seconds"] < 20, f"{name} took {got['seconds']:.1f} s"
