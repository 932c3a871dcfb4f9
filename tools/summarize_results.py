"""Summarize every benchmark ratio in docs/results/*.json as one Markdown table.

    python tools/summarize_results.py            # print the table
    python tools/summarize_results.py --write    # also replace the table in docs/results/README.md
    python tools/summarize_results.py --check    # exit 1 if docs/results/README.md is out of date

Reads the JSON files that `torchplace bench NAME --out DIR` writes (name, rows with variant /
value / unit / ratio, optional baseline, targets, machine). One row per measured variant: its
value, its ratio against the run's baseline (the `baseline` variant, else the nearest row above
it with ratio 1.00; every ratio reads "higher is better"), and the targets checked on it. A
target is attached to the row whose ratio, inverse ratio or value it measured; a target that
compares two rows (or counts something) gets a row of its own. Only the standard library is
used, so it runs anywhere.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "docs" / "results"
README = RESULTS / "README.md"
START, END = "<!-- results-table:start -->", "<!-- results-table:end -->"


def _num(x: float) -> str:
    """4 significant digits, without scientific notation for the sizes that occur here."""
    if x == 0:
        return "0"
    if not math.isfinite(x):
        return str(x)
    if abs(x) >= 1e4:
        return f"{x:,.0f}"
    return f"{x:.4g}"


def _same(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-6, abs_tol=0.0)


def _machine(m: dict) -> str:
    gpus = m.get("gpus") or []
    if gpus:
        names = sorted(set(gpus))
        label = " + ".join(f"{gpus.count(n)}x {n.removeprefix('NVIDIA ')}" for n in names)
    else:
        label = "no GPU"
    return f"{label}, {m.get('cpus', '?')} CPUs"


def _short(name: str, context: str, sep: str = " ") -> str:
    """NAME without the leading words (ending in SEP) it shares with CONTEXT.

    ("ResNet-50 (...): bare", "ResNet-50 (...): watch", ": ") -> "bare".
    """
    cut, i = 0, 0
    while True:
        j = name.find(sep, i)
        if j < 0 or not (context == name[:j] or context.startswith(name[:j] + sep)):
            break
        cut = i = j + len(sep)
    return name[cut:].strip() or name


def _target(t: dict, context: str | None = None) -> str:
    """'NAME: MEASURED OP LIMIT, met' (NAME shortened against CONTEXT; left out when CONTEXT is None)."""
    verdict = "met" if t["met"] else "**missed**"
    check = f"{_num(float(t['measured']))} {t['op']} {_num(t['limit'])}, {verdict}"
    return check if context is None else f"{_short(t['name'], context)}: {check}"


def summarize(path: Path) -> list[list[str]]:
    """Table rows for one result file."""
    data = json.loads(path.read_text())
    machine = data.get("machine") or {}
    where = _machine(machine)
    date = str(machine.get("date", "?"))[:10]
    link = f"[{data['name']}]({path.with_suffix('.txt').name if path.with_suffix('.txt').exists() else path.name})"
    rows = data.get("rows") or []
    targets = list(data.get("targets") or [])
    attached: dict[int, list[dict]] = {}
    for t in list(targets):  # attach each target to the row whose number it checked
        measured = float(t["measured"])
        for i, row in enumerate(rows):
            ratio, value = float(row.get("ratio") or 0), float(row.get("value") or 0)
            if ratio == 1.0:  # a baseline row: its ratio 1 would match every "1 = yes" target
                continue
            if _same(measured, ratio) or (ratio and _same(measured, 1 / ratio)) or _same(measured, value):
                attached.setdefault(i, []).append(t)
                targets.remove(t)
                break
    out = []
    baseline = None
    by_name = {r["variant"]: r for r in rows}
    for i, row in enumerate(rows):
        ratio = float(row.get("ratio") or 0)
        if data.get("baseline") in by_name:
            baseline = data["baseline"]
        elif ratio == 1.0:
            baseline = row["variant"]
        vs = "baseline" if row["variant"] == baseline else _short(baseline or "", row["variant"], ": ")
        checks = "; ".join(_target(t, row["variant"]) for t in attached.get(i, []))
        out.append([link, row["variant"], f"{_num(float(row['value']))} {row.get('unit', '')}".strip(),
                    f"{ratio:.2f}x", vs, checks, where, date])
    for t in targets:  # targets that compare two rows or count something
        out.append([link, f"target: {t['name']}", "", "", "", _target(t), where, date])
    return out


def table(results: Path = RESULTS) -> str:
    files = sorted(results.glob("*.json"))
    header = ["benchmark", "variant", "value", "ratio", "vs", "target", "machine", "date"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for path in files:
        for row in summarize(path):
            lines.append("| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |")
    sources = ", ".join(f"`{p.name}`" for p in files)
    lines.append("")
    lines.append(f"Generated by `python tools/summarize_results.py --write` from {sources}.")
    return "\n".join(lines)


def replaced(text: str, new_table: str) -> str:
    if START not in text or END not in text:
        raise SystemExit(f"{README} has no {START} ... {END} markers to replace.")
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{START}\n{new_table}\n{END}{tail}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="replace the table in docs/results/README.md")
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/results/README.md is out of date")
    args = parser.parse_args(argv)
    new = table()
    if args.check:
        current = README.read_text()
        if replaced(current, new) != current:
            print(f"{README} is out of date: run python tools/summarize_results.py --write", file=sys.stderr)
            return 1
        return 0
    if args.write:
        README.write_text(replaced(README.read_text(), new))
    print(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
