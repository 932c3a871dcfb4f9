"""The step loop shared by `bench transfer` and `bench loader`: variants and timing.

A `Variant` is one way of getting batches onto the device; `measure` times them in interleaved
rounds (median kept), `paired_ratio` compares two calls alternated item by item, and `Compute` is
calibrated device work per step (bench/plot.py draws results).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from ..progress import advance, begin
from .common import time_host


def add_loop_arguments(parser: argparse.ArgumentParser, *, steps: int, rounds: int) -> None:
    """--steps and --rounds, with the defaults of the benchmark that adds them."""
    parser.add_argument("--steps", type=int, default=None, help=f"steps per variant and round (default {steps})")
    parser.add_argument("--rounds", type=int, default=None,
                        help=f"interleaved rounds; the median is kept (default {rounds})")


@dataclass
class Env:
    """What the device offers the benchmark: synchronizing, pinning, streams."""

    device: Any
    can_pin: bool
    streams: bool

    @classmethod
    def for_device(cls, dev: Any) -> Env:
        import torch

        accel = dev.type not in ("cpu", "meta")
        streams = dev.type in ("cuda", "xpu")
        return cls(dev, accel and torch.accelerator.is_available(), streams)

    def sync(self) -> None:
        import torch

        if self.device.type not in ("cpu", "meta"):
            torch.get_device_module(self.device.type).synchronize(self.device)


@dataclass
class Compute:
    """Fixed device work per step (matmuls), calibrated to last about `ms` milliseconds."""

    ms: float
    what: str
    fn: Callable[[], Any] | None = None

    @classmethod
    def calibrated(cls, dev: Any, target_ms: float, env: Env) -> Compute:
        import torch

        if not target_ms:
            return cls(0.0, "none")
        n = 4096 if dev.type != "cpu" else 256
        dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
        a = torch.randn(n, n, device=dev, dtype=dtype)
        b = torch.randn(n, n, device=dev, dtype=dtype)
        one = statistics.median(time_host(lambda: a @ b, warmup=1, iters=10, sync=env.sync))
        reps = max(1, round(target_ms / max(one, 1e-6)))

        def fn() -> Any:
            for _ in range(reps):
                out = a @ b
            return out

        def sustained() -> float:  # ms per step over steps run back to back, as the benchmarks run them
            fn()
            env.sync()
            start = time.perf_counter()
            for _ in range(10):
                fn()
            env.sync()
            return (time.perf_counter() - start) * 100

        # One matmul timed alone includes a launch and a sync, and a matmul's time is not constant
        # (asked for 9.65 ms, an H200 gave 8.2 ms from the first count and 10.9 ms after one
        # correction timed in short runs): so the count is corrected, up to twice, from steps run
        # back to back, as the benchmarks run them.
        measured = sustained()
        for _ in range(2):
            better = max(1, round(reps * target_ms / measured))
            if better == reps:
                break
            reps = better
            measured = sustained()
        return cls(measured, f"{reps} x {n}x{n} {str(dtype).split('.')[-1]} matmul", fn)

    def __call__(self, batch: Any) -> None:
        if self.fn is not None:
            touch(batch)
            self.fn()


def touch(batch: Any) -> Any:
    """Read the batch's first tensor on the consumer's stream, so the step's work depends on its copy."""
    t = _first_tensor(batch)
    return t.sum() if t is not None else None


def _first_tensor(x: Any) -> Any:
    import torch

    if isinstance(x, torch.Tensor):
        return x
    if isinstance(x, dict):
        x = list(x.values())
    if isinstance(x, (list, tuple)):
        for item in x:
            found = _first_tensor(item)
            if found is not None:
                return found
    return None


@dataclass
class Variant:
    """One way of getting batches onto the device: a fresh iterator of device batches per round."""

    name: str
    batches: Callable[[], Iterator[Any]]
    move: Callable[[Any], Any] | None = None  # applied to each item (for raw copies)
    step: Callable[[Any], Any] = field(default=lambda batch: None)
    extra: dict[str, Any] = field(default_factory=dict)

    def per_step_ms(self, sync: Callable[[], None]) -> float:
        """Milliseconds per step in steady state: the first step (pipeline fill) is not timed."""
        it = self.batches()
        try:
            first = next(it)
        except StopIteration:
            return float("nan")
        self.step(self.move(first) if self.move else first)
        del first
        sync()
        start, n = time.perf_counter(), 0
        for batch in it:
            self.step(self.move(batch) if self.move else batch)
            n += 1
        sync()
        elapsed = time.perf_counter() - start
        close = getattr(it, "close", None)
        if close:
            close()
        return elapsed * 1e3 / max(n, 1)


def measure(variants: list[Variant], rounds: int, sync: Callable[[], None], *, title: str) -> dict[str, float]:
    """Median milliseconds per step of each variant over ROUNDS interleaved rounds (told to torchplace.progress).

    An untimed round comes first, so allocator caches, pinned pools and kernels are warm for all.
    Each timed round starts at another variant, so none always runs after the same neighbours.
    """
    samples: dict[str, list[float]] = {v.name: [] for v in variants}
    begin(title, (rounds + 1) * len(variants))
    for r in range(rounds + 1):
        start = (r - 1) * len(variants) // rounds if r else 0
        for v in variants[start:] + variants[:start]:
            ms = v.per_step_ms(sync)
            if r:
                samples[v.name].append(ms)
            advance()
    return {name: statistics.median(values) for name, values in samples.items()}


def paired_ratio(a: Callable[[Any], Any], b: Callable[[Any], Any], items: list, rounds: int,
                 sync: Callable[[], None]) -> float:
    """Median over ROUNDS (after one untimed) of A's host time / B's, called alternately on ITEMS.

    Two variants measured one after the other may see different machine states (memory the
    first one freed, a host's speed drifting); alternating call by call, and which of the two
    goes first, gives both the same. For calls that only enqueue work.
    """
    clock = time.perf_counter
    ratios = []
    for r in range(rounds + 1):
        spent = {a: 0.0, b: 0.0}
        for i, item in enumerate(items):
            first, second = (a, b) if i % 2 == 0 else (b, a)
            t0 = clock()
            x = first(item)
            t1 = clock()
            y = second(item)
            t2 = clock()
            del x, y  # freed outside the timed calls
            spent[first] += t1 - t0
            spent[second] += t2 - t1
        sync()
        if r:
            ratios.append(spent[a] / spent[b])
    return statistics.median(ratios)


def plot(result: Any, path: str) -> None:
    """Draw RESULT into PATH with bench/plot.py (the old name, for a bench module that still calls it)."""
    from .plot import draw

    draw(result, path)


def gbps(nbytes: int, ms: float) -> float:
    """Gigabytes per second of NBYTES moved in MS milliseconds (nan for no time or nan)."""
    return nbytes / (ms * 1e-3) / 1e9 if ms and ms == ms else float("nan")


def accelerate_send() -> Callable[..., Any] | None:
    """accelerate's `send_to_device` (the call users make), or None when accelerate is not installed."""
    try:
        from accelerate.utils import send_to_device
    except ImportError:
        return None
    return send_to_device
