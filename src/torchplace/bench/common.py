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

    @property
    def met(self) -> bool:
        return self.measured <= self.limit if self.op == "<=" else self.measured >= self.limit


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
