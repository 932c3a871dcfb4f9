"""The background half of `torchplace bench checkpoint` (issue 17), on the same state as the rest:

- stall: how long training stops for one checkpoint: torch.save + fsync (all of it),
  dcp.async_save (until it returns), torchplace.save_async (until it returns, staging buffers
  already made by an untimed first call), and the floor: a bare copy of the same bytes into
  already pinned host memory (a plain memcpy on the CPU);
- step time: a fixed compute step (matmuls on the benchmark device), median of the steps run
  while a save_async writes in the background, against the median of steps run back to back for
  as long, before and after the save (the same sustained load on the device);
- loads to the device from the page cache, against safetensors `load_file(device=...)`,
  `torch.load(mmap=True)` + `.to(device)` and fastsafetensors without GDS where it imports (the
  plain torch.load row is the other module's); cold loads (the file's pages dropped with
  posix_fadvise first) against a raw O_DIRECT read of the same file by as many threads.
"""

from __future__ import annotations

import os
import shutil
import time
import warnings
from collections.abc import Callable
from typing import Any

from .common import Row, Target, median

STEP_MATMULS = 8


def _sync(dev: Any) -> Callable[[], None]:
    import torch

    return (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)


def _best(fn: Callable[[], Any], repeats: int) -> float:
    """Median seconds of REPEATS calls of FN."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return median(times)


def _step_fn(dev: Any) -> Callable[[], None]:
    """One 'training step': STEP_MATMULS matmuls, synchronized (about 1-20 ms on a GPU or CPU)."""
    import torch

    n = 4096 if dev.type == "cuda" else 384
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    a = torch.randn(n, n, device=dev, dtype=dtype)
    b = torch.randn(n, n, device=dev, dtype=dtype)
    sync = _sync(dev)

    def step() -> None:
        x = a
        for _ in range(STEP_MATMULS):
            x = torch.tanh(x @ b)
        sync()

    return step


def measure_stalls(state: dict[str, Any], size: int, dev: Any, root: str, repeats: int) -> dict[str, float]:
    """Seconds each way of checkpointing STATE stops the caller, and save_async's total time."""
    import torch
    import torch.distributed.checkpoint as dcp

    from ..checkpoint.background import save_async

    sync = _sync(dev)
    pinned = torch.empty(size, dtype=torch.uint8, pin_memory=dev.type == "cuda")
    paths = {k: os.path.join(root, f"stall-{k}") for k in ("torch", "dcp", "tp")}

    def bare_copy() -> None:
        at = 0
        for t in state.values():
            n = t.numel() * t.element_size()
            pinned[at:at + n].copy_(t.reshape(-1).view(torch.uint8), non_blocking=True)
            at += n
        sync()

    def torch_save() -> None:
        with open(paths["torch"], "wb") as fh:
            torch.save(state, fh)
            fh.flush()
            os.fsync(fh.fileno())

    out: dict[str, list[float]] = {"copy": [], "tsave": [], "dcp": [], "dcp_total": [], "async": [],
                                   "async_total": []}
    save_async(paths["tp"], model=state, rng_state=False).result()  # untimed: makes the staging buffers
    for _ in range(repeats):
        out["copy"].append(_best(bare_copy, 1))
        out["tsave"].append(_best(torch_save, 1))
        os.unlink(paths["torch"])
        sync()
        start = time.perf_counter()
        with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
            warnings.simplefilter("ignore", UserWarning)
            fut = dcp.async_save(state, storage_writer=dcp.FileSystemWriter(paths["dcp"]))
        out["dcp"].append(time.perf_counter() - start)
        fut.result()
        out["dcp_total"].append(time.perf_counter() - start)
        shutil.rmtree(paths["dcp"], ignore_errors=True)
        sync()
        start = time.perf_counter()
        pending = save_async(paths["tp"], model=state, rng_state=False)
        out["async"].append(time.perf_counter() - start)
        pending.result()
        out["async_total"].append(time.perf_counter() - start)
    os.unlink(paths["tp"])
    pinned = torch.empty(0)  # gives the pinned buffer back before the timings that follow
    return {k: median(v) for k, v in out.items()}


def _steps_for(step: Callable[[], None], seconds: float) -> list[float]:
    """Run STEP back to back for about SECONDS; each step's seconds."""
    times: list[float] = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end or len(times) < 3:
        times.append(_best(step, 1))
    return times


def measure_steps(state: dict[str, Any], dev: Any, root: str) -> dict[str, float]:
    """Median step seconds while a save_async of STATE writes in the background, and without a save:
    steps run back to back for as long as a save takes, before it and after it. Both sides run under
    the same sustained load: a GPU computing flat out for seconds runs slower than in its first
    milliseconds (power and clocks), so a short burst of steps is no baseline for seconds of them."""
    from ..checkpoint.background import save_async

    step = _step_fn(dev)
    path = os.path.join(root, "steps-tp")
    start = time.perf_counter()
    save_async(path, model=state, rng_state=False).result()  # untimed: staging buffers made
    seconds = min(max(time.perf_counter() - start, 1.0), 20.0)
    before = _steps_for(step, seconds)
    during: list[float] = []
    pending = save_async(path, model=state, rng_state=False)
    while not pending.done() or len(during) < 3:
        during.append(_best(step, 1))
    pending.result()
    after = _steps_for(step, seconds)
    os.unlink(path)
    return {"alone": median(before + after), "during": median(during), "during_steps": float(len(during)),
            "before": median(before), "after": median(after)}


def _drop_cache(path: str) -> None:
    """Evict PATH's pages from the page cache (the file is fsynced, so they are clean): its next read is cold."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _direct_read(path: str) -> None:
    """Read PATH whole with O_DIRECT (no page cache), one thread per core in 16 MiB blocks: what the disk
    gives a reader that does nothing else (the floor for a cold load)."""
    import mmap
    from concurrent.futures import ThreadPoolExecutor

    from ..checkpoint.stream import load_workers

    block = 16 * 2**20
    size = os.path.getsize(path)
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
    try:
        def read(offsets: range) -> None:
            buf = mmap.mmap(-1, block)  # page-aligned, as O_DIRECT wants
            try:
                for at in offsets:
                    os.preadv(fd, [buf], at)
            finally:
                buf.close()

        n = load_workers(size)
        starts = range(0, size, block)
        with ThreadPoolExecutor(n) as pool:
            list(pool.map(read, [starts[i::n] for i in range(n)]))
    finally:
        os.close(fd)


def _fastsafetensors_load(path: str, dev: Any) -> Callable[[], None] | None:
    """fastsafetensors' loader without GDS (pread into a bounce buffer, then copies), or None where it
    does not import or run here."""
    try:
        from fastsafetensors import fastsafe_open
    except ImportError:
        return None

    def load() -> None:
        with fastsafe_open(filenames=[path], nogds=True, device=str(dev)) as f:
            {k: f.get_tensor(k) for k in f.keys()}
        _sync(dev)()

    try:
        load()
    except Exception:  # noqa: BLE001 - a peer that fails to run here is left out, and the notes say so
        return None
    return load


def measure_loads(state: dict[str, Any], dev: Any, root: str, repeats: int) -> dict[str, float]:
    """Seconds to load STATE's bytes onto DEV: from the page cache with safetensors, torch.load(mmap) +
    .to, fastsafetensors (where it runs) and ours; cold (pages dropped first) with ours and with a raw
    O_DIRECT read of the same file."""
    import torch
    from safetensors.torch import load_file, save_file

    from ..checkpoint import load, save

    sync = _sync(dev)
    paths = {k: os.path.join(root, f"load-{k}") for k in ("st", "torch", "tp")}
    save_file(state, paths["st"])
    torch.save(state, paths["torch"])
    save(paths["tp"], model=state, rng_state=False)

    def st_load() -> None:
        load_file(paths["st"], device=str(dev))
        sync()

    def mmap_load() -> None:
        loaded = torch.load(paths["torch"], mmap=True, weights_only=True)
        {k: v.to(dev) for k, v in loaded.items()}
        sync()

    def tp_load() -> None:
        load(paths["tp"], device=dev, restore_rng=False)
        sync()

    def cold(fn: Callable[[], None], path: str) -> float:
        times = []
        for _ in range(repeats):
            _drop_cache(path)
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return median(times)

    try:
        for fn in (st_load, mmap_load, tp_load):  # untimed: every file in the page cache
            fn()
        out = {"st": _best(st_load, repeats), "mmap": _best(mmap_load, repeats), "tp": _best(tp_load, repeats)}
        fst = _fastsafetensors_load(paths["st"], dev)
        if fst is not None:
            out["fst"] = _best(fst, repeats)
        out["tp_cold"] = cold(tp_load, paths["tp"])
        out["direct_cold"] = cold(lambda: _direct_read(paths["tp"]), paths["tp"])
        return out
    finally:
        for p in paths.values():
            os.unlink(p)


def rows_for(label: str, size: int, dev: Any, stalls: dict[str, float], steps: dict[str, float],
             loads: dict[str, float], extra: dict[str, Any]) -> tuple[list[Row], list[Target]]:
    """Rows (stalls against the bare copy, steps against the step alone, loads against safetensors) and targets."""
    floor = stalls["copy"]
    ms = 1e3
    rows = [
        Row(f"{label} stall: bare copy into pinned host memory", floor * ms, "ms", 1.0, extra),
        Row(f"{label} stall: torch.save+fsync", stalls["tsave"] * ms, "ms", stalls["tsave"] / floor, extra),
        Row(f"{label} stall: dcp.async_save", stalls["dcp"] * ms, "ms", stalls["dcp"] / floor,
            {**extra, "total_ms": stalls["dcp_total"] * ms}),
        Row(f"{label} stall: torchplace.save_async", stalls["async"] * ms, "ms", stalls["async"] / floor,
            {**extra, "total_ms": stalls["async_total"] * ms}),
        Row(f"{label} step alone", steps["alone"] * ms, "ms", 1.0,
            {**extra, "before_ms": steps["before"] * ms, "after_ms": steps["after"] * ms}),
        Row(f"{label} step while save_async writes", steps["during"] * ms, "ms", steps["during"] / steps["alone"],
            {**extra, "steps": int(steps["during_steps"])}),
        Row(f"{label} load -> {dev}: safetensors load_file", size / loads["st"] / 1e9, "GB/s", 1.0, extra),
        Row(f"{label} load -> {dev}: torch.load(mmap)+.to", size / loads["mmap"] / 1e9, "GB/s",
            loads["st"] / loads["mmap"], extra),
        Row(f"{label} load -> {dev}: torchplace.load", size / loads["tp"] / 1e9, "GB/s", loads["st"] / loads["tp"],
            extra),
        Row(f"{label} cold: raw O_DIRECT read of the file", size / loads["direct_cold"] / 1e9, "GB/s", 1.0, extra),
        Row(f"{label} cold: torchplace.load -> {dev}", size / loads["tp_cold"] / 1e9, "GB/s",
            loads["direct_cold"] / loads["tp_cold"], extra),
    ]
    if "fst" in loads:
        rows.insert(-2, Row(f"{label} load -> {dev}: fastsafetensors (no GDS)", size / loads["fst"] / 1e9, "GB/s",
                            loads["st"] / loads["fst"], extra))
    gpu_only = None if dev.type == "cuda" else "set for a GPU (a device->pinned copy; a GPU step beside the writer)"
    targets = [
        Target(f"{label} save_async stall vs bare pinned copy", stalls["async"] / floor, 1.2, "<=", gpu_only),
        Target(f"{label} save_async stall vs dcp.async_save stall", stalls["async"] / stalls["dcp"], 0.25, "<="),
        Target(f"{label} step while writing vs alone", steps["during"] / steps["alone"], 1.05, "<=", gpu_only),
    ]
    if dev.type == "cuda":
        targets.append(Target(f"{label} load to {dev} from the page cache (GB/s)", size / loads["tp"] / 1e9, 35.0,
                              ">="))
        if "fst" in loads:
            targets.append(Target(f"{label} load vs fastsafetensors (no GDS)", loads["fst"] / loads["tp"], 1.5, ">="))
        targets.append(Target(f"{label} cold load vs raw O_DIRECT read", loads["direct_cold"] / loads["tp_cold"], 0.9,
                              ">="))
    return rows, targets
