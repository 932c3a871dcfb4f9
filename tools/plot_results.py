"""Draw each benchmark run kept in docs/results/*.json as a PNG beside it (bench-NAME-....png).

    python tools/plot_results.py            # draw the missing plots
    python tools/plot_results.py --all      # redraw every plot
    python tools/plot_results.py FILE.json  # draw (or redraw) these

The plot is the one `torchplace bench NAME --plot FILE` draws (torchplace.bench.plot: one panel
per unit, a log axis where a panel's values span 100x or more, torchplace's variants in green),
made from the committed JSON, so a recorded run and a new one look alike. Needs matplotlib
(pip install 'torchplace[bench]'). `python tools/summarize_results.py --write` then links each
plot from docs/results/README.md.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "docs" / "results"
sys.path.insert(0, str(ROOT / "src"))

from torchplace.bench.plot import MISSING, available, draw  # noqa: E402


def plot_one(path: Path) -> Path:
    """Draw PATH's run into PATH with .png; return the PNG's path."""
    data = json.loads(path.read_text())
    out = path.with_suffix(".png")
    machine = data.get("machine") or {}
    when = str(machine.get("date", ""))[:10]
    gpus = machine.get("gpus") or []
    where = f"{len(gpus)}x {gpus[0]}" if gpus else "no GPU"
    device = (data.get("params") or {}).get("device")
    title = f"torchplace bench {data.get('name')}: {path.stem.removeprefix('bench-')}\n" \
            f"{where}{f', {device}' if device else ''}, {when}"
    draw(data, str(out), title=title)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="*", type=Path, help="result files (default: docs/results/bench-*.json)")
    parser.add_argument("--all", action="store_true", help="redraw plots that exist too")
    args = parser.parse_args(argv)
    if not available():
        print(f"tools/plot_results.py: {MISSING}", file=sys.stderr)
        return 2
    files = args.files or sorted(RESULTS.glob("bench-*.json"))
    for path in files:
        if args.files or args.all or not path.with_suffix(".png").exists():
            print(f"wrote {plot_one(path.resolve())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
