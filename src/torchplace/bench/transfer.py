"""`torchplace bench transfer`: a nested batch of many small tensors, moved to the device each step.

One run, same data, interleaved rounds: the naive dict comprehension from pageable memory,
pinned + non_blocking on one stream, accelerate's `send_to_device` (as users call it),
`to_device`, and `DeviceLoader`, first copies only (the host cost of each way), then in a step
with compute (what a loader is for), against the ideal max(compute, copy), where the copy is
the same bytes pre-packed in one pinned buffer and copied once. Bulk bandwidth is measured too.

The step loop (`Variant`, `measure`, `plot`) is in `steps.py`, shared with `bench loader`.
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any, Callable, Iterator

from .common import BenchResult, Row, Target, time_host
from .steps import Compute, Env, Variant, accelerate_send, add_loop_arguments, gbps, measure, paired_ratio, plot

_ACCELERATE = "accelerate send_to_device, pinned"
_TO_DEVICE = "torchplace to_device, pinned"
_LOADER = "torchplace DeviceLoader, pinned"
_LOADER_UNPACKED = "torchplace DeviceLoader, pinned, pack=False"
_PACKED = "one pre-packed pinned copy"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default=None, help="where to move batches (default: the GPU if any, else cpu)")
    parser.add_argument("--tensors", type=int, default=64, help="tensors in the nested batch")
    parser.add_argument("--shape", default="256x64", help="shape of each fp32 tensor, e.g. 256x64 (64 KiB)")
    add_loop_arguments(parser, steps=200, rounds=9)
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
    send = accelerate_send()
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
    rows = [Row(v.name, ms[v.name] * 1e3, "µs/step", extra={"GB/s": gbps(nbytes, ms[v.name])}) for v in variants]
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
    return {name: gbps(nbytes, statistics.median(time_host(fn, warmup=1, iters=iters, sync=env.sync)))
            for name, fn in ways.items()}


def _tensors(batch: Any) -> list:
    from ..placement.traverse import map_tensors

    found: list = []
    map_tensors(batch, lambda t: found.append(t) or t)
    return found


def _dict_to(batch: dict, dev: Any, non_blocking: bool) -> dict:
    """What users write by hand: a comprehension per level of their own batch layout."""
    return {"inputs": {k: v.to(dev, non_blocking=non_blocking) for k, v in batch["inputs"].items()},
            "targets": [t.to(dev, non_blocking=non_blocking) for t in batch["targets"]], "meta": batch["meta"]}
