"""`torchplace bench transfer`: a nested batch of many small tensors, moved to the device each step.

One run, same data, interleaved rounds: the naive dict comprehension from pageable memory,
pinned + non_blocking on one stream, accelerate's `send_to_device` (as users call it),
`to_device`, and `DeviceLoader`, first copies only (the host cost of each way), then in a step
with compute (what a loader is for), against the ideal max(compute, copy), where the copy is
the same bytes pre-packed in one pinned buffer and copied once. Bulk bandwidth is measured too.

The step-loop helpers here (`Variant`, `measure`, `plot`) also serve `bench loader`.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from .common import BenchResult, Row, Target

_ACCELERATE = "accelerate send_to_device, pinned"
_TO_DEVICE = "torchplace to_device, pinned"
_LOADER = "torchplace DeviceLoader, pinned"
_LOADER_UNPACKED = "torchplace DeviceLoader, pinned, pack=False"
_PACKED = "one pre-packed pinned copy"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default=None, help="where to move batches (default: the GPU if any, else cpu)")
    parser.add_argument("--tensors", type=int, default=64, help="tensors in the nested batch")
    parser.add_argument("--shape", default="256x64", help="shape of each fp32 tensor, e.g. 256x64 (64 KiB)")
    parser.add_argument("--steps", type=int, default=None, help="steps per variant and round (default 200)")
    parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds; the median is kept (default 9)")
    parser.add_argument("--compute-ms", type=float, default=None,
                        help="device work per step (default 1, a small model's step; 0: copies only)")
    parser.add_argument("--bulk-mib", type=int, default=None,
                        help="size of the one-tensor bandwidth check (default 1024; 0 skips it)")
    parser.add_argument("--quick", action="store_true", help="few steps and a small bulk copy (CPU, CI)")
    parser.add_argument("--plot", metavar="FILE", help="draw step time per variant into FILE (needs matplotlib)")


def run(args: argparse.Namespace) -> BenchResult:
    import torch

    from ..placement import _hostcopy
    from ..placement.loader import DeviceLoader
    from ..placement.resolve import device as resolve_device
    from ..placement.transfer import pin, to_device

    dev = resolve_device(args.device or "auto")
    steps = args.steps or (20 if args.quick else 200)
    rounds = args.rounds or (2 if args.quick else 9)  # the median of 9: single rounds swing on a VM host
    shape = tuple(int(s) for s in args.shape.lower().split("x"))
    env = Env.for_device(dev)
    notes: list[str] = []
    if not env.can_pin:
        notes.append(f"{dev.type}: no pinned memory here, so 'pinned' variants use pageable memory")

    def batch(seed: int) -> dict[str, Any]:  # --tensors fp32 tensors, two levels deep, plus plain values
        g = torch.Generator().manual_seed(seed)
        return {"inputs": {f"t{i}": torch.randn(shape, generator=g) for i in range(args.tensors - 1)},
                "targets": [torch.randn(shape, generator=g)], "meta": {"step": seed, "tag": "train"}}

    pageable = [batch(i) for i in range(8)]
    pinned = [pin(b) for b in pageable] if env.can_pin else pageable
    nbytes = sum(t.nbytes for t in _tensors(pageable[0]))
    compute = Compute.calibrated(dev, 1.0 if args.compute_ms is None else args.compute_ms, env)

    def cycle(source: list) -> Callable[[], Iterator[Any]]:
        return lambda: (source[i % len(source)] for i in range(steps))

    def mapped(source: list, fn: Callable[[Any], Any]) -> Callable[[], Iterator[Any]]:
        return lambda: (fn(source[i % len(source)]) for i in range(steps))

    loader = DeviceLoader([pinned[i % len(pinned)] for i in range(steps)], dev)
    unpacked = DeviceLoader([pinned[i % len(pinned)] for i in range(steps)], dev, pack=False)
    packed_src = torch.cat([t.reshape(-1).view(torch.uint8) for t in _tensors(pinned[0])])
    packed_src = packed_src.pin_memory() if env.can_pin else packed_src
    send = _accelerate_send()
    if send is None:
        notes.append("accelerate is not installed: its variants were skipped (pip install 'torchplace[bench]')")
    # Copies only: the host cost of each way of moving the batch, nothing to hide it behind.
    variants = [
        Variant("naive .to(), pageable", mapped(pageable, lambda b: _dict_to(b, dev, False))),
        Variant("pinned + non_blocking", mapped(pinned, lambda b: _dict_to(b, dev, True))),
        *([Variant(_ACCELERATE, mapped(pinned, lambda b: send(b, dev, non_blocking=True)))] if send else []),
        Variant(_TO_DEVICE, mapped(pinned, lambda b: to_device(b, dev))),
        Variant(_LOADER, lambda: iter(loader)),
        Variant(_LOADER_UNPACKED, lambda: iter(unpacked)),
        Variant(_PACKED, cycle([packed_src]), move=lambda t: t.to(dev, non_blocking=True)),
    ]
    # A step with compute: what a loader is for, hiding the copies behind the device's work.
    with_compute = f", {compute.ms:.2f} ms compute"
    if compute.ms:
        stepped = [*([(_ACCELERATE, mapped(pinned, lambda b: send(b, dev, non_blocking=True)))] if send else []),
                   (_TO_DEVICE, mapped(pinned, lambda b: to_device(b, dev))),
                   (_LOADER, lambda: iter(loader)),
                   ("compute only, batch on device", cycle([to_device(pinned[0], dev)]))]
        variants += [Variant(name + with_compute, batches, step=compute) for name, batches in stepped]
    ms = measure(variants, rounds, env.sync, title=f"transfer to {dev}")
    rows = [Row(v.name, ms[v.name] * 1e3, "µs/step", extra={"GB/s": _gbps(nbytes, ms[v.name])}) for v in variants]
    if compute.ms:
        ideal_ms = max(ms[_PACKED], ms[variants[-1].name])
        rows.append(Row(f"ideal max(compute, copy){with_compute}", ideal_ms * 1e3, "µs/step"))
    result = BenchResult(name="transfer", rows=rows, baseline=variants[0].name, notes=notes,
                         params={"device": str(dev), "tensors": args.tensors, "shape": list(shape),
                                 "batch_bytes": nbytes, "steps": steps, "rounds": rounds,
                                 "compute_ms": compute.ms, "compute": compute.what,
                                 "copy_threads": _hostcopy.threads()})
    if send is not None and env.can_pin:  # on the CPU nothing is copied: the targets would mean nothing
        items = [pinned[i % len(pinned)] for i in range(steps)]
        paired = paired_ratio(lambda b: to_device(b, dev), lambda b: send(b, dev, non_blocking=True),
                              items, rounds, env.sync)
        result.params["to_device_vs_send_to_device_paired"] = paired
        result.targets.append(Target(f"to_device / send_to_device, {args.tensors} small tensors, host time per "
                                     "batch, calls alternated", paired, 1.0, "<="))
        result.notes.append(f"to_device / send_to_device per step, copies only, one variant after the other: "
                            f"{ms[_TO_DEVICE] / ms[_ACCELERATE]:.3g}")
        if compute.ms:
            result.targets.append(Target(f"DeviceLoader / send_to_device per step{with_compute}",
                                         ms[_LOADER + with_compute] / ms[_ACCELERATE + with_compute], 1.0, "<="))
        result.notes.append(
            f"copies only, DeviceLoader / send_to_device: {ms[_LOADER] / ms[_ACCELERATE]:.3g}. With no compute to "
            "hide the copies behind, a step is the host work of staging a batch, done on the loader's thread "
            "and contending with yours for the GIL; for a loop that only moves tensors, to_device is the "
            "steadier call.")
    bulk_mib = args.bulk_mib if args.bulk_mib is not None else (8 if args.quick else 1024)
    if bulk_mib and not env.can_pin:
        result.notes.append(f"bulk bandwidth skipped: {dev.type} has no host-to-device copy to measure")
    elif bulk_mib:
        result.params["bulk_GBps"] = bulk = bulk_bandwidth(dev, bulk_mib, env)
        result.notes.append(f"one {bulk_mib} MiB tensor, GB/s: " + ", ".join(f"{k} {v:.1f}" for k, v in bulk.items()))
    if args.plot:
        plot(result, args.plot)
    return result


# ------------------------------------------------------------------------------------------------
# shared with bench loader


@dataclass
class Env:
    """What the device offers the benchmark: synchronizing, pinning, streams."""

    device: Any
    can_pin: bool
    streams: bool

    @classmethod
    def for_device(cls, dev: Any) -> "Env":
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
    def calibrated(cls, dev: Any, target_ms: float, env: Env) -> "Compute":
        import torch

        if not target_ms:
            return cls(0.0, "none")
        n = 4096 if dev.type != "cpu" else 256
        dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
        a = torch.randn(n, n, device=dev, dtype=dtype)
        b = torch.randn(n, n, device=dev, dtype=dtype)
        one = statistics.median(_timed(lambda: a @ b, env.sync, 10))
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
    """Median milliseconds per step of each variant over ROUNDS interleaved rounds, with a progress bar.

    An untimed round comes first, so allocator caches, pinned pools and kernels are warm for all.
    Each timed round starts at another variant, so none always runs after the same neighbours.
    """
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    samples: dict[str, list[float]] = {v.name: [] for v in variants}
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=Console(stderr=True), transient=True) as progress:
        task = progress.add_task(title, total=(rounds + 1) * len(variants))
        for r in range(rounds + 1):
            start = (r - 1) * len(variants) // rounds if r else 0
            for v in variants[start:] + variants[:start]:
                what = f"round {r}/{rounds}" if r else "warm-up"
                progress.update(task, description=f"{title}: {what}, {v.name}")
                ms = v.per_step_ms(sync)
                if r:
                    samples[v.name].append(ms)
                progress.advance(task)
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


def plot(result: BenchResult, path: str) -> None:
    """Draw step time per variant as horizontal bars into PATH; a note instead if matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        result.notes.append(f"--plot {path}: matplotlib is not installed (pip install matplotlib); no plot drawn")
        return
    rows = [r for r in result.rows if r.unit == result.rows[0].unit]
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(rows) + 1.5))
    names = [r.variant for r in rows][::-1]
    values = [r.value for r in rows][::-1]
    colors = ["tab:green" if n.startswith(("torchplace", "ideal")) else "tab:gray" for n in names]
    ax.barh(names, values, color=colors)
    for y, value in enumerate(values):
        ax.text(value, y, f" {value:.4g}", va="center", fontsize=8)
    ax.set_xlabel(rows[0].unit)
    ax.set_title(f"torchplace bench {result.name} ({result.params.get('device', '')})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    result.notes.append(f"plot written to {path}")


def bulk_bandwidth(dev: Any, mib: int, env: Env) -> dict[str, float]:
    """GB/s of one large host->device copy: pageable, pinned non_blocking, and to_device of each."""
    import torch

    from ..placement.transfer import to_device

    src = torch.ones(mib * 2**18)
    pinned = src.pin_memory() if env.can_pin else src
    nbytes = src.nbytes
    ways = {"pageable .to()": lambda: src.to(dev),
            "pinned .to(non_blocking)": lambda: pinned.to(dev, non_blocking=True),
            "to_device(pageable)": lambda: to_device(src, dev),
            "to_device(pinned)": lambda: to_device(pinned, dev)}
    iters = 3 if mib >= 512 else 10
    return {name: _gbps(nbytes, statistics.median(_timed(fn, env.sync, iters))) for name, fn in ways.items()}


def _timed(fn: Callable[[], Any], sync: Callable[[], None], iters: int) -> list[float]:
    fn()
    sync()
    out = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        sync()
        out.append((time.perf_counter() - start) * 1e3)
    return out


def _gbps(nbytes: int, ms: float) -> float:
    return nbytes / (ms * 1e-3) / 1e9 if ms and ms == ms else float("nan")


def _tensors(batch: Any) -> list:
    from ..placement.traverse import map_tensors

    found: list = []
    map_tensors(batch, lambda t: found.append(t) or t)
    return found


def _dict_to(batch: dict, dev: Any, non_blocking: bool) -> dict:
    """What users write by hand: a comprehension per level of their own batch layout."""
    return {"inputs": {k: v.to(dev, non_blocking=non_blocking) for k, v in batch["inputs"].items()},
            "targets": [t.to(dev, non_blocking=non_blocking) for t in batch["targets"]], "meta": batch["meta"]}


def _accelerate_send() -> Callable[..., Any] | None:
    try:
        from accelerate.utils import send_to_device
    except ImportError:
        return None
    return send_to_device
