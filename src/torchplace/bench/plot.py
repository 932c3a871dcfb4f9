"""Draw a benchmark result as bars: what `torchplace bench NAME --plot FILE` and tools/plot_results.py write.

One panel per unit (a result can hold ms/step rows beside GB/s rows), one bar per variant, its
value and its ratio against the baseline written beside it; torchplace's own variants (and the
ideal) in green, the others grey. A panel whose values span a factor of `LOG_SPAN` or more gets a
log axis, so a 50 µs row and a 5,000 µs row are both readable. Takes the result as a `BenchResult`
or as its JSON form (`to_dict()`, the files under docs/results/). matplotlib comes with the
`bench` extra; `available()` says whether it is installed, `MISSING` what to do when it is not.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

#: values spanning at least this factor are drawn on a log axis
LOG_SPAN = 100.0
MISSING = "--plot needs matplotlib, which is not installed. Fix: pip install 'torchplace[bench]'"
OURS = ("torchplace", "ideal")


def available() -> bool:
    """True when matplotlib can be imported (the `bench` extra installs it)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def wants_log(values: Sequence[float]) -> bool:
    """True when the positive finite VALUES span LOG_SPAN or more (a linear axis would hide the small ones)."""
    positive = [v for v in values if v > 0 and math.isfinite(v)]
    return len(positive) > 1 and max(positive) / min(positive) >= LOG_SPAN


def _panels(rows: Sequence[Mapping[str, Any]]) -> dict[str, list[Mapping[str, Any]]]:
    """Rows grouped by unit, in the order the units first appear."""
    panels: dict[str, list[Mapping[str, Any]]] = {}
    for row in rows:
        value = row.get("value")
        if isinstance(value, (int, float)) and math.isfinite(value):
            panels.setdefault(str(row.get("unit", "")), []).append(row)
    return panels


def draw(result: Any, path: str, *, title: str | None = None) -> str:
    """Draw RESULT (a BenchResult or its dict) into PATH (.png, .svg, .pdf ...); return PATH.

    Raises ImportError with `MISSING` when matplotlib is not installed."""
    data = result if isinstance(result, Mapping) else result.to_dict()
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ImportError(MISSING) from None
    panels = _panels(data.get("rows") or [])
    if not panels:
        raise ValueError(f"bench {data.get('name')}: no finite values to plot")
    heights = [0.32 * len(rows) + 0.9 for rows in panels.values()]
    fig, axes = plt.subplots(len(panels), 1, figsize=(10, sum(heights) + 0.8), squeeze=False,
                             gridspec_kw={"height_ratios": heights})
    lower = data.get("lower_is_better", True)
    for ax, (unit, rows) in zip(axes[:, 0], panels.items()):
        names = [str(r["variant"]) for r in rows][::-1]
        values = [float(r["value"]) for r in rows][::-1]
        ratios = [r.get("ratio") for r in rows][::-1]
        colors = ["tab:green" if name.startswith(OURS) or "torchplace" in name else "tab:gray" for name in names]
        log = wants_log(values)
        positive = [v for v in values if v > 0]
        if log:  # bars start a little left of the smallest value; room on the right for the labels
            left, right = min(positive) / 3, max(positive) * 12
            ax.set_xscale("log")
            ax.barh(range(len(names)), [v - left if v > left else 0 for v in values], left=left, color=colors)
            ax.set_xlim(left, right)
        else:
            ax.barh(range(len(names)), values, color=colors)
            ax.set_xlim(0, (max(positive) if positive else 1) * 1.3)
        ax.set_yticks(range(len(names)), [n if len(n) <= 60 else n[:57] + "..." for n in names], fontsize=8)
        for y, (value, ratio) in enumerate(zip(values, ratios)):
            label = f" {value:.4g}" + (f" ({ratio:.2f}x)" if isinstance(ratio, (int, float)) else "")
            ax.text(max(value, left) if log else value, y, label, va="center", fontsize=7)
        hint = [("lower is better" if lower else "higher is better")] if len(panels) == 1 else []
        ax.set_xlabel(f"{unit} ({', '.join(hint + (['log scale'] if log else []))})" if hint or log else unit,
                      fontsize=8)
    params = data.get("params") or {}
    machine = data.get("machine") or {}
    where = params.get("device") or ", ".join(machine.get("gpus") or []) or "cpu"
    baseline = f"; ratios vs {data['baseline']}" if data.get("baseline") else ""
    fig.suptitle(title or f"torchplace bench {data.get('name')} ({where}{baseline})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
