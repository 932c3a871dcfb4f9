"""Shared timing, result and machine-description helpers for the benchmarks."""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class Row:
    """One measured variant. `ratio` is filled against the result's baseline."""

    variant: str
    value: float
    unit: str
    ratio: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class Target:
    """A goal from an issue, checked against what this run measured."""

    name: str
    measured: float
    limit: float
    op: str = "<="  # measured op limit
    not_here: str | None = None  # why this run cannot judge it ("set for a GPU"): shown, never counted as missed
    spread: tuple[float, float] | None = None  # (low, high) quartiles of the repeats; judged at the worse end

    @property
    def worst(self) -> float:
        """The figure the target is judged on: the worse end of the spread where there is one."""
        if self.spread is None:
            return self.measured
        return self.spread[1] if self.op == "<=" else self.spread[0]

    @property
    def met(self) -> bool:
        return self.worst <= self.limit if self.op == "<=" else self.worst >= self.limit

    def describe(self) -> str:
        """'1.02 [0.99..1.07] <= 1.2, judged at 1.07': median, spread, limit and the figure judged."""
        if self.spread is None:
            return f"{self.measured:.4g} {self.op} {self.limit:.4g}"
        low, high = self.spread
        return f"{self.measured:.4g} [{low:.4g}..{high:.4g}] {self.op} {self.limit:.4g}, judged at {self.worst:.4g}"


@dataclass
class BenchResult:
    """What one benchmark run measured, ready to print as a table or JSON."""

    name: str
    rows: list[Row]
    baseline: str | None = None
    lower_is_better: bool = True
    targets: list[Target] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    params: dict[str, Any] = field(default_factory=dict)
    machine: dict[str, Any] = field(default_factory=dict)

    def fill_ratios(self) -> None:
        """Ratios are baseline/value when lower is better (so >1 means faster), else value/baseline."""
        base = next((r for r in self.rows if r.variant == self.baseline), None)
        if base is None or not base.value:
            return
        for row in self.rows:
            if row.value:
                row.ratio = base.value / row.value if self.lower_is_better else row.value / base.value

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        for target, raw in zip(self.targets, data["targets"]):
            raw["met"] = target.met if target.not_here is None else None
            raw["worst"] = target.worst
        return data


def machine_info() -> dict[str, Any]:
    """Where a result was measured: date, host, Python, torch, GPU names (no CUDA start needed)."""
    from ..hardware.topology import read_topology

    info: dict[str, Any] = {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "hostname": platform.node(),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
    }
    try:
        import torch

        info["torch"] = torch.__version__
        info["torch_cuda"] = torch.version.cuda
    except ImportError:  # pragma: no cover
        pass
    topo = read_topology(links=False)
    info["gpus"] = [g.name for g in topo.gpus]
    info["driver"] = topo.driver_version
    return info


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def spread(values: list[float]) -> dict[str, float]:
    """Median, quartiles (q1, q3: the spread targets are judged on), min, max and count of VALUES."""
    if not values:
        nan = float("nan")
        return {"median": nan, "q1": nan, "q3": nan, "min": nan, "max": nan, "n": 0}
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive") if len(values) > 1 else values * 3
    return {"median": statistics.median(values), "q1": q1, "q3": q3, "min": min(values), "max": max(values),
            "n": len(values)}


def judged(name: str, values: list[float], limit: float, op: str = "<=", not_here: str | None = None) -> Target:
    """A target on repeated measurements: the median is shown, the worse quartile is judged."""
    s = spread(values)
    return Target(name, s["median"], limit, op, not_here, (s["q1"], s["q3"]))


def row(variant: str, values: list[float], unit: str, ratio: float | None, extra: dict[str, Any]) -> Row:
    """A row of repeated VALUES: the median shown, the spread (quartiles, min, max, count) in extra."""
    s = spread(values)
    return Row(variant, s["median"], unit, ratio, {**extra, **{k: s[k] for k in ("q1", "q3", "min", "max", "n")}})


def gbs(size: int, seconds: list[float]) -> list[float]:
    """GB/s of moving SIZE bytes in each of SECONDS."""
    return [size / t / 1e9 for t in seconds]


def ratios(num: list[float], den: list[float]) -> list[float]:
    """Per-round NUM/DEN where both ran every round (interleaved, so drift cancels), else every pair."""
    if len(num) == len(den):
        return [a / b for a, b in zip(num, den)]
    return [a / b for a in num for b in den]


Variant = tuple[Callable[[], None], Callable[[], Any], Callable[[], None]]


def _nothing() -> None:
    pass


def plain(fn: Callable[[], Any]) -> Variant:
    """A variant with no set-up or clean-up."""
    return (_nothing, fn, _nothing)


def timed_rounds(variants: dict[str, Variant], rounds: int, what: str = "timing", slow_s: float | None = None,
                 warmed: dict[str, float] | None = None) -> dict[str, list[float]]:
    """Seconds of each variant's run in each of ROUNDS interleaved rounds: variants take turns within a
    round, the order rotating from round to round, so drift hits all alike. Each variant is (set-up,
    timed run, clean-up). With SLOW_S, each runs once untimed first (a warm-up), and one whose warm-up
    took longer than SLOW_S is timed in the first round only (a slow peer would eat the run's time);
    WARMED names variants already run once (a trial) and the seconds that took: they are not warmed again."""
    from ..progress import advance, begin, silenced

    times: dict[str, list[float]] = {name: [] for name in variants}
    slow: set[str] = set()
    names = list(variants)

    def once(name: str) -> float:
        before, fn, after = variants[name]
        before()
        with silenced():  # torchplace's own progress reports are not this bench's steps
            start = time.perf_counter()
            fn()
            took = time.perf_counter() - start
        after()
        return took

    warmed = warmed or {}
    to_warm = [name for name in names if name not in warmed] if slow_s is not None else []
    begin(what, rounds * len(variants) + len(to_warm))
    if slow_s is not None:
        slow.update(name for name, took in warmed.items() if took > slow_s)
        for name in to_warm:
            if once(name) > slow_s:
                slow.add(name)
            advance()
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            if not (r and name in slow):
                times[name].append(once(name))
            advance()
    return times


def time_host(fn: Callable[[], Any], *, warmup: int = 3, iters: int = 20,
              sync: Callable[[], None] | None = None) -> list[float]:
    """Wall-clock milliseconds per call, synchronizing (if given) before each clock read."""
    for _ in range(warmup):
        fn()
    if sync:
        sync()
    out = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        if sync:
            sync()
        out.append((time.perf_counter() - start) * 1e3)
    return out


def time_device(fn: Callable[[], Any], device: Any, *, warmup: int = 3, iters: int = 20) -> list[float]:
    """Milliseconds per call measured with device events (falls back to host timing on CPU)."""
    import torch

    device = torch.device(device)
    if device.type == "cpu":
        return time_host(fn, warmup=warmup, iters=iters)
    mod = getattr(torch, device.type)
    for _ in range(warmup):
        fn()
    mod.synchronize(device)
    out = []
    for _ in range(iters):
        start, end = mod.Event(enable_timing=True), mod.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        out.append(start.elapsed_time(end))
    return out


def write_result(result: BenchResult, out_dir: str | None) -> str | None:
    """Write RESULT as JSON under out_dir (named after the benchmark and date); return the path."""
    if not out_dir:
        return None
    os.makedirs(out_dir, exist_ok=True)
    stamp = result.machine.get("date", "")[:10]
    path = os.path.join(out_dir, f"bench-{result.name}-{stamp}.json")
    with open(path, "w") as fh:
        json.dump(result.to_dict(), fh, indent=1)
    return path
