"""Check a device corpus file with plain torch only (no torchplace diagnosis runs), as its author does once.

On meta vs cpu, each mistake must raise torch's device error with its innermost frame in the corpus file on the
line marked `# case: NAME`, and each legal pattern must run. A case listed for GPU pairs only is run on meta vs cpu
and on cpu vs cpu and reported, not judged: there it should not fail at its line (why it is GPU-only) and its code
should run when nothing is misplaced. Usage: python tools/corpus_plain_check.py tests/checks/corpus_FILE.py
"""

from __future__ import annotations

import importlib.util
import sys
import traceback
import warnings
from pathlib import Path

import torch


def _line(exc: BaseException, path: Path) -> int | None:
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if Path(f.filename).resolve() == path]
    return frames[-1].lineno if frames else None


def _run(case, dev: str, other: str) -> BaseException | None:
    try:
        case.build(torch.device(dev), torch.device(other)).run()
    except Exception as exc:  # a case's failure is what is reported
        return exc
    return None


def main(file: str) -> int:
    warnings.filterwarnings("ignore")
    path = Path(file).resolve()
    sys.path.insert(0, str(path.parent))
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    bad = 0
    for case in module.CASES:
        tag = f"{case.kind:7} {case.name:45}"
        if "cpu-meta" not in case.pairs:
            notes = []
            for dev, other in (("meta", "cpu"), ("cpu", "cpu")):
                exc = _run(case, dev, other)
                notes.append(f"{dev}/{other}: " + (f"{type(exc).__name__} at {_line(exc, path)}" if exc else "ran"))
            print(f"GPU  {tag} " + " | ".join(notes))
            continue
        exc = _run(case, "meta", "cpu")
        if case.kind == "legal":
            ok = exc is None
        else:
            ok = isinstance(exc, RuntimeError) and "device" in str(exc) and _line(exc, path) == case.line
        bad += not ok
        what = f"{type(exc).__name__} at line {_line(exc, path)} (case line {case.line})" if exc else "ran"
        print(f"{'OK ' if ok else 'BAD'}  {tag} {what}")
    print(f"{bad} bad")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
