"""`torchplace bench loader`: a training-like step, device compute plus a large batch from the host.

One run, same data, interleaved rounds: the naive `.to(device)` from pageable memory, pinned +
non_blocking on one stream, accelerate's `send_to_device`, a hand-written side-stream prefetch
(what experts write), and `DeviceLoader` from pageable and from pinned memory, against the
ideal step max(compute, copy), both measured here. Then DeviceLoader's copy throughput against
a raw pinned copy, and `memory_reserved()` over many epochs.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterator
from typing import Any

from .common import BenchResult, Row, Target
from .steps import Compute, Env, Variant, accelerate_send, add_loop_arguments, gbps, measure

_NAIVE = "naive .to(), pageable"
_LOADER_PAGEABLE = "torchplace DeviceLoader, pageable"
_LOADER_PINNED = "torchplace DeviceLoader, pinned"
_COMPUTE = "compute only, batch on device"
_RAW_COPY = "copy only: raw pinned .to(non_blocking)"
_LOADER_COPY = "copy only: DeviceLoader, pinned"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default=None, help="where to train (default: the GPU if any, else cpu)")
    parser.add_argument("--size-mib", type=int, default=None, help="host batch size in MiB (default 256)")
    parser.add_argument("--compute-ms", type=float, default=None,
                        help="device work per step, in ms of matmuls (default 9.65, as measured on an H200)")
    add_loop_arguments(parser, steps=40, rounds=5)
    parser.add_argument("--batches", type=int, default=4, help="distinct host batches, cycled (default 4)")
    parser.add_argument("--epochs", type=int, default=None, help="epochs of the memory check (default 20)")
    parser.add_argument("--prefetch", type=int, default=2, help="DeviceLoader's prefetch depth (default 2)")
    parser.add_argument("--quick", action="store_true", help="small batches and few steps (CPU, CI)")


def run(args: argparse.Namespace) -> BenchResult:
    import torch

    from ..placement.loader import DeviceLoader
    from ..placement.transfer import pin
    from ..policy.devices import device as resolve_device

    dev = resolve_device(args.device or "auto")
    quick = args.quick
    size_mib = args.size_mib or (4 if quick else 256)
    steps = args.steps or (8 if quick else 40)
    rounds = args.rounds or (1 if quick else 5)  # the median of 5: single rounds swing on a VM host
    epochs = args.epochs or (3 if quick else 20)
    env = Env.for_device(dev)
    notes: list[str] = []
    if not env.can_pin:
        notes.append(f"{dev.type}: no pinned memory or copies here; the variants show only their overhead")

    numel = size_mib * 2**18
    pageable = [{"x": torch.empty(numel).fill_(float(i)), "y": torch.arange(256) + i} for i in range(args.batches)]
    pinned = [pin(b) for b in pageable] if env.can_pin else pageable
    nbytes = pageable[0]["x"].nbytes + pageable[0]["y"].nbytes
    compute = Compute.calibrated(dev, args.compute_ms if args.compute_ms is not None else (2.0 if quick else 9.65), env)
    step = compute

    def mapped(source: list, fn: Callable[[Any], Any]) -> Callable[[], Iterator[Any]]:
        return lambda: (fn(source[i % len(source)]) for i in range(steps))

    def listed(source: list) -> list:
        return [source[i % len(source)] for i in range(steps)]

    loader_pageable = DeviceLoader(listed(pageable), dev, prefetch=args.prefetch)
    loader_pinned = DeviceLoader(listed(pinned), dev, prefetch=args.prefetch)
    resident = {k: v.to(dev) for k, v in pinned[0].items()}
    variants = [
        Variant(_NAIVE, mapped(pageable, lambda b: {k: v.to(dev) for k, v in b.items()}), step=step),
        Variant("pinned + non_blocking, one stream",
                mapped(pinned, lambda b: {k: v.to(dev, non_blocking=True) for k, v in b.items()}), step=step),
    ]
    send = accelerate_send()
    if send is not None:
        variants.append(Variant("accelerate send_to_device, pinned",
                                mapped(pinned, lambda b: send(b, dev, non_blocking=True)), step=step))
    else:
        notes.append("accelerate is not installed: its variant was skipped (pip install 'torchplace[bench]')")
    if env.streams:
        variants.append(Variant("hand-written side-stream prefetch, pinned",
                                lambda: _side_stream_prefetch(listed(pinned), dev), step=step))
    else:
        notes.append(f"{dev.type} has no streams: the hand-written side-stream prefetch was skipped")
    variants += [
        Variant(_LOADER_PAGEABLE, lambda: iter(loader_pageable), step=step),
        Variant(_LOADER_PINNED, lambda: iter(loader_pinned), step=step),
        Variant(_COMPUTE, lambda: (resident for _ in range(steps)), step=step),
        Variant(_RAW_COPY, mapped(pinned, lambda b: {k: v.to(dev, non_blocking=True) for k, v in b.items()})),
        Variant(_LOADER_COPY, lambda: iter(loader_pinned)),
    ]
    ms = measure(variants, rounds, env.sync, title=f"loader on {dev}")
    ideal = max(ms[_COMPUTE], ms[_RAW_COPY])
    rows = [Row(v.name, ms[v.name], "ms/step", extra={"vs ideal": ms[v.name] / ideal}) for v in variants]
    rows.append(Row("ideal max(compute, copy)", ideal, "ms/step"))
    raw_gbps, loader_gbps = gbps(nbytes, ms[_RAW_COPY]), gbps(nbytes, ms[_LOADER_COPY])
    for row in rows:
        if row.variant in (_RAW_COPY, _LOADER_COPY):
            row.extra["GB/s"] = gbps(nbytes, row.value)
    result = BenchResult(
        name="loader", rows=rows, baseline=_NAIVE, notes=notes,
        params={"device": str(dev), "batch_mib": size_mib, "batch_bytes": nbytes, "compute_ms": compute.ms,
                "compute": compute.what, "steps": steps, "rounds": rounds, "host_batches": args.batches,
                "prefetch": args.prefetch, "copy_GBps": raw_gbps, "loader_copy_GBps": loader_gbps})
    if env.can_pin:  # the targets are about host-to-device copies; on the CPU they mean nothing
        result.targets += [
            Target("DeviceLoader (pageable source) / ideal step", ms[_LOADER_PAGEABLE] / ideal, 1.02, "<="),
            Target("DeviceLoader (pinned source) / ideal step", ms[_LOADER_PINNED] / ideal, 1.02, "<="),
            Target("DeviceLoader copy throughput / raw pinned copy", loader_gbps / raw_gbps, 0.95, ">="),
        ]
    reserved = _reserved_per_epoch_mib(DeviceLoader(pageable, dev, prefetch=args.prefetch), step, epochs, env)
    if reserved is None:
        result.notes.append(f"{dev.type}: no caching allocator to watch; memory check skipped")
    else:
        growth = reserved[-1] - reserved[0]
        result.params["reserved_growth_mib"] = growth
        result.params["reserved_mib_per_epoch"] = reserved  # [after warm-up, epoch 1, ...]: a leak climbs every epoch
        result.targets.append(Target(f"memory_reserved() growth over {epochs} epochs (MiB)", growth, 0.0, "<="))
        if growth:
            result.notes.append("memory_reserved() after the warm-up epoch, then after each epoch (MiB): "
                                + ", ".join(f"{r:g}" for r in reserved))
    return result


def _side_stream_prefetch(source: list, dev: Any) -> Iterator[dict]:
    """The expert's loop: copy batch i+1 on a side stream while batch i computes (record_stream)."""
    import torch

    mod = torch.get_device_module(dev.type)
    side = mod.Stream(device=dev)

    def load(batch: dict) -> dict:
        with mod.stream(side):
            return {k: v.to(dev, non_blocking=True) for k, v in batch.items()}

    it = iter(source)
    try:
        ahead = load(next(it))
    except StopIteration:
        return
    while ahead is not None:
        current = mod.current_stream(dev)
        current.wait_stream(side)
        for t in ahead.values():
            t.record_stream(current)
        batch, ahead = ahead, None
        nxt = next(it, None)
        if nxt is not None:
            ahead = load(nxt)
        yield batch


def _reserved_per_epoch_mib(loader: Any, step: Callable[[Any], Any], epochs: int, env: Env) -> list[float] | None:
    """`memory_reserved()` in MiB after a warm-up epoch, then at the end of each of EPOCHS epochs
    (None without a caching allocator).

    The loader keeps up to prefetch + 1 batches on the device (the one in use and PREFETCH
    ahead), but reaches that depth only once its worker gets fully ahead of the steps. Pinning
    this bench's pageable batch takes most of a step, so that came late and at random: at epoch
    2, 4, 12 or 19 in the H200 runs where reserved memory grew by one batch, the allocator's
    trace showing the loader's third buffer taken while the other two were in use
    (docs/results/experiments/, round 6). So the warm-up epoch waits after each step until
    the worker had time to get there; from then on the pool has its working set, and growth
    would be a leak.
    """
    import time

    import torch

    if env.device.type != "cuda":
        return None
    batch = None
    for batch in loader:  # warm-up: give the worker time to stage PREFETCH batches ahead
        step(batch)
        env.sync()
        time.sleep(0.05)
    batch = None  # dropped, as the loop below drops its last batch when the next epoch starts
    reserved = [torch.cuda.memory_reserved(env.device) / 2**20]
    for _ in range(epochs):
        for batch in loader:
            step(batch)
        env.sync()
        reserved.append(torch.cuda.memory_reserved(env.device) / 2**20)
    return reserved
