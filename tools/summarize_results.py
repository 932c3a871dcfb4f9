"""Index the benchmark runs kept in docs/results/*.json as one Markdown table, one row per run.

    python tools/summarize_results.py            # print the index
    python tools/summarize_results.py --write    # also replace the index in docs/results/README.md
    python tools/summarize_results.py --check    # exit 1 if the README is out of date or a run is superseded

Reads the JSON files that `torchplace bench NAME --out DIR` writes (name, rows with variant /
value / unit / ratio, targets, machine), kept as `bench-NAME[-CONFIG]-<machine>-<date>[-runN].json`.
docs/results keeps one run per benchmark and machine (older runs stay in git history), so two files
with the same NAME[-CONFIG] and machine are an error that names the older one. The headline of a
run is its first target (the goal from the feature's issue), or its best ratio when it has none.
Only the standard library is used, so it runs anywhere.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "docs" / "results"
README = RESULTS / "README.md"
START, END = "<!-- results-table:start -->", "<!-- results-table:end -->"
FILE_NAME = re.compile(r"^bench-(?P<bench>.+)-(?P<machine>[^-]+)-(?P<date>\d{4}-\d{2}-\d{2})(?:-(?P<run>.+))?$")


def _num(x: float) -> str:
    """4 significant digits, without scientific notation for the sizes that occur here."""
    if x == 0:
        return "0"
    if not math.isfinite(x):
        return str(x)
    if abs(x) >= 1e4:
        return f"{x:,.0f}"
    return f"{x:.4g}"


def _machine(m: dict) -> str:
    gpus = m.get("gpus") or []
    if gpus:
        names = sorted(set(gpus))
        label = " + ".join(f"{gpus.count(n)}x {n.removeprefix('NVIDIA ')}" for n in names)
    else:
        label = "no GPU"
    return f"{label}, {m.get('cpus', '?')} CPUs"


def _parts(path: Path) -> tuple[str, str]:
    """(benchmark with its configuration, machine tag) from a result file's name."""
    found = FILE_NAME.match(path.stem)
    if not found:
        raise SystemExit(f"{path.name}: expected bench-NAME[-CONFIG]-<machine>-<date>[-runN].json")
    return found["bench"], found["machine"]


def _headline(data: dict) -> str:
    """The run's first target as 'NAME: MEASURED OP LIMIT', else its best ratio against the baseline."""
    targets = data.get("targets") or []
    if targets:
        t = targets[0]
        return f"{t['name']}: {_num(float(t['measured']))} {t['op']} {_num(t['limit'])}"
    rows = [r for r in data.get("rows") or [] if r.get("ratio")]
    if not rows:
        return ""
    best = max(rows, key=lambda r: float(r["ratio"]))
    return f"{best['variant']}: {float(best['ratio']):.2f}x vs {data.get('baseline') or 'baseline'}"


def _verdicts(data: dict) -> str:
    """'N/N met', or how many of them were missed."""
    targets = [t for t in data.get("targets") or [] if t.get("met") is not None]  # None: not judged on that run
    missed = sum(1 for t in targets if not t["met"])
    if not targets:
        return "none"
    return f"{len(targets)}/{len(targets)} met" if not missed else f"**{missed} of {len(targets)} missed**"


def index_row(path: Path) -> list[str]:
    """One index row for one result file: benchmark (linked to its printed table, with the PNG that
    tools/plot_results.py drew beside it, if any), machine, date, headline, targets. Five short columns,
    so the table fits the docs site's column (tools/check_site.py)."""
    data = json.loads(path.read_text())
    machine = data.get("machine") or {}
    bench, _ = _parts(path)
    shown = path.with_suffix(".txt") if path.with_suffix(".txt").exists() else path
    config = bench.removeprefix(data["name"]).strip("-")
    label = f"{data['name']} ({config})" if config else data["name"]
    plot = path.with_suffix(".png")
    linked = f"[{label}]({shown.name})" + (f" ([plot]({plot.name}))" if plot.exists() else "")
    return [linked, _machine(machine), str(machine.get("date", "?"))[:10], _headline(data), _verdicts(data)]


def superseded(results: Path = RESULTS) -> list[str]:
    """One line per result file that a newer run of the same benchmark on the same machine replaces."""
    newest: dict[tuple[str, str], tuple[str, Path]] = {}
    lines = []
    for path in sorted(results.glob("*.json")):
        when = str((json.loads(path.read_text()).get("machine") or {}).get("date", ""))
        key = _parts(path)
        if key in newest:
            other_when, other = newest[key]
            old, new = (path, other) if when < other_when else (other, path)
            lines.append(f"{old.name} is superseded by {new.name}: delete it (git keeps it).")
            if new is path:
                newest[key] = (when, path)
        else:
            newest[key] = (when, path)
    return lines


def table(results: Path = RESULTS) -> str:
    header = ["benchmark", "machine", "date", "headline", "targets"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for path in sorted(results.glob("*.json")):
        lines.append("| " + " | ".join(cell.replace("|", "\\|") for cell in index_row(path)) + " |")
    lines.append("")
    lines.append("Generated by `python tools/summarize_results.py --write`; plots by `python tools/plot_results.py`.")
    return "\n".join(lines)


def replaced(text: str, new_table: str) -> str:
    if START not in text or END not in text:
        raise SystemExit(f"{README} has no {START} ... {END} markers to replace.")
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{START}\n{new_table}\n{END}{tail}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="replace the index in docs/results/README.md")
    parser.add_argument("--check", action="store_true",
                        help="exit 1 if docs/results/README.md is out of date or a run is superseded")
    args = parser.parse_args(argv)
    new = table()
    if args.check:
        problems = superseded()
        if replaced(README.read_text(), new) != README.read_text():
            problems.append(f"{README} is out of date: run python tools/summarize_results.py --write")
        print("\n".join(problems), file=sys.stderr)
        return 1 if problems else 0
    if args.write:
        README.write_text(replaced(README.read_text(), new))
    print(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
