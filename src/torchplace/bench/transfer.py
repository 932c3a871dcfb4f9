"""`torchplace bench transfer`: a nested batch of many small tensors, moved to the device each step.

One run, same data, interleaved rounds: the naive dict comprehension from pageable memory,
pinned + non_blocking on one stream, accelerate's `send_to_device` (as users call it),
`to_device`, and `DeviceLoader`, first copies only (the host cost of each way), then in a step
with compute (what a loader is for), against the ideal max(compute, copy), where the copy is
the same bytes pre-packed in one pinned buffer and copied once. Bulk bandwidth is measured too.

Issue 21's variants, from `packed.py`: batches packed in DataLoader workers (`packed_collate`),
made ahead and through a real DataLoader with worker processes, each with the training process's
CPU time per step beside the wall time; and a recommender batch (26 sparse features as values +
offsets, 13 dense) beside the synthetic one (`--structure`).

The step loop (`Variant`, `measure`) is in `steps.py`, shared with `bench loader`.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable, Iterator
from typing import Any

from .common import BenchResult, Row, Target, time_host
from .steps import Compute, Env, Variant, accelerate_send, add_loop_arguments, gbps, measure, paired_ratio

_ACCELERATE = "accelerate send_to_device, pinned"
_TO_DEVICE = "torchplace to_device, pinned"
_LOADER = "torchplace DeviceLoader, pinned"
_LOADER_UNPACKED = "torchplace DeviceLoader, pinned, pack=False"
_PACKED = "one pre-packed pinned copy"
_IN_WORKERS = "torchplace packed_collate + DeviceLoader, pinned"
_NO_SLOTS = "packed_collate(slots=0)"  # the whole way as before the slots: the pin-memory step copies each batch
_RECSYS = " [recsys]"  # the recommender batch's rows: the same names with this tag


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default=None, help="where to move batches (default: the GPU if any, else cpu)")
    parser.add_argument("--tensors", type=int, default=64, help="tensors in the nested batch")
    parser.add_argument("--shape", default="256x64", help="shape of each fp32 tensor, e.g. 256x64 (64 KiB)")
    add_loop_arguments(parser, steps=200, rounds=9)
    parser.add_argument("--compute-ms", type=float, default=None,
                        help="device work per step (default 1, a small model's step; 0: copies only)")
    parser.add_argument("--bulk-mib", type=int, default=None,
                        help="size of the one-tensor bandwidth check (default 1024; 0 skips it)")
    parser.add_argument("--structure", choices=("synthetic", "recsys", "both"), default="both",
                        help="the batch: --tensors fp32 tensors, a recommender's (26 sparse features as values "
                        "+ offsets, 13 dense), or both (default)")
    parser.add_argument("--workers", type=int, default=None,
                        help="DataLoader worker processes for the whole-way variants (default 4; 0 skips them)")
    parser.add_argument("--quick", action="store_true", help="few steps and a small bulk copy (CPU, CI)")


def run(args: argparse.Namespace) -> BenchResult:
    import torch

    from ..placement import _hostcopy
    from ..placement.loader import DeviceLoader
    from ..placement.transfer import pin, to_device
    from ..policy.devices import device as resolve_device
    from . import packed as pk

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
    workers = args.workers if args.workers is not None else (2 if args.quick else 4)
    synthetic = args.structure in ("synthetic", "both")
    recsys = args.structure in ("recsys", "both")
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
    with_compute = f", {compute.ms:.2f} ms compute"
    loaders: dict[str, list[Any]] = {}  # DataLoaders with persistent workers, stopped at the end
    plain_send = send or (lambda b, d, non_blocking: to_device(b, d))
    send_name = "send_to_device" if send else "to_device"

    premades: dict[str, list] = {}  # per batch structure: batches as packed_collate hands them over

    def packed_ways(tag: str, source: list, stepped: bool) -> list[Variant]:
        """Packed in workers (batches made ahead), and both whole ways from a DataLoader with workers."""
        premade = premades.setdefault(tag, pk.premade_packed(source, env.can_pin))
        ways = [Variant(_IN_WORKERS + tag, lambda: iter(DeviceLoader([premade[i % len(premade)]
                                                                       for i in range(steps)], dev)))]
        if workers:
            if tag not in loaders:  # one set per batch structure, shared by the rows with and without compute
                loaders[tag] = [pk.dataloader(source, steps, workers, env.can_pin, packed=p, slots=n)
                                for p, n in ((False, None), (True, None), (True, 0))]
            plain, packed, copied = loaders[tag]
            ways += [Variant(f"DataLoader, {workers} workers, + {send_name}{tag}",
                             lambda: (plain_send(b, dev, non_blocking=True) for b in plain)),
                     Variant(f"DataLoader, {workers} workers, packed_collate + torchplace DeviceLoader{tag}",
                             lambda: iter(DeviceLoader(packed, dev))),
                     Variant(f"DataLoader, {workers} workers, {_NO_SLOTS} + torchplace DeviceLoader{tag}",
                             lambda: iter(DeviceLoader(copied, dev)))]
        if stepped:
            for v in ways:
                v.name += with_compute
                v.step = compute
        return ways

    # Copies only: the host cost of each way of moving the batch, nothing to hide it behind.
    variants: list[Variant] = []
    if synthetic:
        variants += [
            Variant("naive .to(), pageable", mapped(pageable, lambda b: _dict_to(b, dev, False))),
            Variant("pinned + non_blocking", mapped(pinned, lambda b: _dict_to(b, dev, True))),
            *([Variant(_ACCELERATE, mapped(pinned, lambda b: send(b, dev, non_blocking=True)))] if send else []),
            Variant(_TO_DEVICE, mapped(pinned, lambda b: to_device(b, dev))),
            Variant(_LOADER, lambda: iter(loader)),
            Variant(_LOADER_UNPACKED, lambda: iter(unpacked)),
            *packed_ways("", pageable, False),
            Variant(_PACKED, cycle([packed_src]), move=lambda t: t.to(dev, non_blocking=True)),
        ]
        # A step with compute: what a loader is for, hiding the copies behind the device's work.
        if compute.ms:
            stepped = [*([(_ACCELERATE, mapped(pinned, lambda b: send(b, dev, non_blocking=True)))] if send else []),
                       (_TO_DEVICE, mapped(pinned, lambda b: to_device(b, dev))),
                       (_LOADER, lambda: iter(loader))]
            variants += [Variant(name + with_compute, batches, step=compute) for name, batches in stepped]
            variants += packed_ways("", pageable, True)
            variants.append(Variant("compute only, batch on device" + with_compute, cycle([to_device(pinned[0], dev)]),
                                    step=compute))
    if recsys:
        r_pageable = [pk.recsys_batch(i) for i in range(8)]
        r_pinned = [pin(b) for b in r_pageable] if env.can_pin else r_pageable
        r_loader = DeviceLoader([r_pinned[i % len(r_pinned)] for i in range(steps)], dev)
        r_src = torch.cat([t.reshape(-1).view(torch.uint8) for t in _tensors(r_pinned[0])])
        r_src = r_src.pin_memory() if env.can_pin else r_src
        t = _RECSYS
        variants += [
            *([Variant(_ACCELERATE + t, mapped(r_pinned, lambda b: send(b, dev, non_blocking=True)))] if send else []),
            Variant(_TO_DEVICE + t, mapped(r_pinned, lambda b: to_device(b, dev))),
            Variant(_LOADER + t, lambda: iter(r_loader)),
            *packed_ways(t, r_pageable, False),
            Variant(_PACKED + t, cycle([r_src]), move=lambda x: x.to(dev, non_blocking=True)),
        ]
        if compute.ms:
            stepped = [*([(_ACCELERATE, mapped(r_pinned, lambda b: send(b, dev, non_blocking=True)))] if send else []),
                       (_LOADER, lambda: iter(r_loader))]
            variants += [Variant(name + t + with_compute, batches, step=compute) for name, batches in stepped]
            variants += packed_ways(t, r_pageable, True)
            variants.append(Variant("compute only, batch on device" + t + with_compute,
                                    cycle([to_device(r_pinned[0], dev)]), step=compute))
    for v in variants:
        pk.cpu_clock(v, steps)
    try:
        ms = measure(variants, rounds, env.sync, title=f"transfer to {dev}")
    finally:
        pk.close([dl for pair in loaders.values() for dl in pair])
    r_bytes = sum(t.nbytes for t in _tensors(pk.recsys_batch(0))) if recsys else 0
    rows = []
    for v in variants:
        size = r_bytes if _RECSYS in v.name else nbytes
        cpu = pk.cpu_ms(v)
        rows.append(Row(v.name, ms[v.name] * 1e3, "µs/step",
                        extra={"GB/s": gbps(size, ms[v.name]), "cpu µs/step": cpu * 1e3 if cpu is not None else None}))
        if compute.ms and v.name.startswith("compute only"):
            tag = _RECSYS if _RECSYS in v.name else ""
            rows.append(Row(f"ideal max(compute, copy){tag}{with_compute}",
                            max(ms[_PACKED + tag], ms[v.name]) * 1e3, "µs/step"))
    cpu_of = {v.name: pk.cpu_ms(v) for v in variants}
    paired: dict[str, float] = {}  # per batch structure: packed in workers / send_to_device, CPU, alternated
    if send is not None and env.can_pin:
        sources = {"": pinned, _RECSYS: r_pinned} if recsys else {"": pinned}
        for tag, premade in premades.items():
            src = sources[tag]
            paired[tag] = pk.paired_cpu(
                lambda p=premade: iter(DeviceLoader([p[i % len(p)] for i in range(steps)], dev)),
                lambda b: send(b, dev, non_blocking=True), [src[i % len(src)] for i in range(steps)], rounds, env.sync)
    result = BenchResult(name="transfer", rows=rows, baseline=variants[0].name, notes=notes,
                         params={"device": str(dev), "tensors": args.tensors, "shape": list(shape),
                                 "batch_bytes": nbytes, "steps": steps, "rounds": rounds,
                                 "compute_ms": compute.ms, "compute": compute.what,
                                 "copy_threads": _hostcopy.threads(), "structure": args.structure,
                                 "workers": workers, "recsys_batch_bytes": r_bytes,
                                 "recsys_batch": f"{pk.RECSYS_BATCH} samples, {pk.RECSYS_SPARSE} sparse features "
                                                 f"(values + offsets), {pk.RECSYS_DENSE} dense"})
    for tag in ([""] if synthetic else []) + ([_RECSYS] if recsys else []):
        _packed_ratios(result, ms, cpu_of, tag, workers, send_name, env.can_pin and send is not None, paired.get(tag))
    if not synthetic:
        return _bulk(result, args, dev, env)
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
    return _bulk(result, args, dev, env)


def _packed_ratios(result: BenchResult, ms: dict[str, float], cpu: dict[str, float | None], tag: str, workers: int,
                   send_name: str, targets: bool, paired: float | None) -> None:
    """Host time and training-process CPU per batch of the packed ways, as ratios (issue 21's targets).
    PAIRED: the copies-only CPU ratio measured in alternating blocks (`packed.paired_cpu`), the target's
    value when there is one; the ratio of the rows, measured apart, is kept beside it."""
    what = "recommender batch" if tag else "synthetic batch"
    ratios = {"host_vs_one_packed_copy": ms[_IN_WORKERS + tag] / ms[_PACKED + tag]}
    base = (_ACCELERATE if send_name == "send_to_device" else _TO_DEVICE) + tag
    ours, theirs = cpu.get(_IN_WORKERS + tag), cpu.get(base)
    if ours is not None and theirs:
        ratios[f"cpu_vs_{send_name}" + ("_rows" if paired is not None else "")] = ours / theirs
    if paired is not None:
        ratios[f"cpu_vs_{send_name}"] = paired
    whole_ours = cpu.get(f"DataLoader, {workers} workers, packed_collate + torchplace DeviceLoader{tag}")
    whole_before = cpu.get(f"DataLoader, {workers} workers, {_NO_SLOTS} + torchplace DeviceLoader{tag}")
    whole_theirs = cpu.get(f"DataLoader, {workers} workers, + {send_name}{tag}")
    if workers and whole_ours is not None and whole_theirs:
        ratios[f"dataloader_cpu_vs_{send_name}"] = whole_ours / whole_theirs
        ratios["dataloader_host_vs_one_packed_copy"] = (
            ms[f"DataLoader, {workers} workers, packed_collate + torchplace DeviceLoader{tag}"] / ms[_PACKED + tag])
        if whole_before:
            ratios[f"dataloader_cpu_slots_0_vs_{send_name}"] = whole_before / whole_theirs
            ratios["dataloader_cpu_slots_vs_slots_0"] = whole_ours / whole_before
    result.params["packed_recsys" if tag else "packed"] = ratios
    result.notes.append(f"packed_collate, {what}, copies only: " + ", ".join(f"{k} {v:.3g}" for k, v in ratios.items()))
    if not targets:
        return
    if not tag:  # issue 21's host target is for the 64 tensors; the recommender batch's copy (13 µs for
        # 588 KB) is too short to be the yardstick: its ratio measures making 53 views, and stays a note
        result.targets.append(Target(f"packed_collate + DeviceLoader / one pre-packed pinned copy, {what}, host "
                                     "time per batch, copies only", ratios["host_vs_one_packed_copy"], 2.0, "<="))
    if f"cpu_vs_{send_name}" in ratios:
        how = ", blocks of 20 batches alternated" if paired is not None else ""
        result.targets.append(Target(f"packed_collate + DeviceLoader / {send_name}, {what}, training-process CPU "
                                     f"per batch, copies only{how}", ratios[f"cpu_vs_{send_name}"], 0.25, "<="))
    if f"dataloader_cpu_vs_{send_name}" in ratios:
        result.targets.append(Target(f"DataLoader {workers} workers: packed_collate + DeviceLoader / {send_name}, "
                                     f"{what}, training-process CPU per batch",
                                     ratios[f"dataloader_cpu_vs_{send_name}"], 0.25, "<="))


def _bulk(result: BenchResult, args: argparse.Namespace, dev: Any, env: Env) -> BenchResult:
    """The one-tensor bandwidth check (--bulk-mib), added to RESULT."""
    bulk_mib = args.bulk_mib if args.bulk_mib is not None else (8 if args.quick else 1024)
    if bulk_mib and not env.can_pin:
        result.notes.append(f"bulk bandwidth skipped: {dev.type} has no host-to-device copy to measure")
    elif bulk_mib:
        result.params["bulk_GBps"] = bulk = bulk_bandwidth(dev, bulk_mib, env)
        result.notes.append(f"one {bulk_mib} MiB tensor, GB/s: " + ", ".join(f"{k} {v:.1f}" for k, v in bulk.items()))
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
    from ..shared.tree import map_tensors

    found: list = []
    map_tensors(batch, lambda t: found.append(t) or t)
    return found


def _dict_to(batch: dict, dev: Any, non_blocking: bool) -> dict:
    """What users write by hand: a comprehension per level of their own batch layout."""
    return {"inputs": {k: v.to(dev, non_blocking=non_blocking) for k, v in batch["inputs"].items()},
            "targets": [t.to(dev, non_blocking=non_blocking) for t in batch["targets"]], "meta": batch["meta"]}
