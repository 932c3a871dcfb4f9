"""The background half of `torchplace bench checkpoint` (issues 17, 34), on the same state as the rest:

- stall: how long training stops for one checkpoint: torchplace.save_async called as a training loop
  calls it (the default RNG state; the same state every time) against the floor, a bare copy of the
  same bytes into already pinned host memory (a plain memcpy on the CPU); with the full set also
  torch.save + fsync (all of it) and dcp.async_save (until it returns). The first save of a case is
  timed apart (its staging buffers freed first, so it allocates them, as a process's first save does);
  the rounds time the saves after it, and record whether each took the repeated path (SaveFuture.repeated:
  copies started into the previous layout before encoding), which a training loop's saves should;
- step time (full set): a fixed compute step (matmuls on the benchmark device) while a save_async
  writes in the background, against steps run back to back for as long, before and after the save;
- loads to the device from the page cache: ours against safetensors `load_file(device=...)`,
  `torch.load(mmap=True)` + `.to(device)`, fastsafetensors without GDS and instanttensor (buffered
  reads) where they import and run; cold loads (the file's pages dropped with posix_fadvise first)
  against a raw O_DIRECT read of the same file by as many threads and instanttensor's direct reads.
Every figure: interleaved rounds (common.timed_rounds), lists of seconds, rows with the spread.
"""

from __future__ import annotations

import os
import shutil
import time
import warnings
from collections.abc import Callable
from typing import Any

from ..units import format_bytes
from .common import Row, Target, gbs, judged, median, plain, ratios, row, timed_rounds

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


def measure_stalls(state: dict[str, Any], size: int, dev: Any, root: str, repeats: int, *, full: bool = True,
                   label: str = "", keep: str | None = None) -> dict[str, list[float]]:
    """Seconds each way of checkpointing STATE stops the caller, per round (and save_async's, dcp's total).
    KEEP: where to leave the file save_async wrote last (the loads read it: one write of the state fewer)."""
    import torch
    import torch.distributed.checkpoint as dcp

    from ..checkpoint.background import default_saver, save_async

    sync = _sync(dev)
    pinned = torch.empty(size, dtype=torch.uint8, pin_memory=dev.type == "cuda")
    paths = {k: os.path.join(root, f"stall-{k}") for k in ("torch", "dcp", "tp")}
    totals: dict[str, list[float]] = {"dcp_total": [], "async_total": [], "repeated": []}
    held: dict[str, Any] = {}

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

    def start_dcp() -> None:
        held["start"] = time.perf_counter()
        held["pending"] = dcp.async_save(state, storage_writer=dcp.FileSystemWriter(paths["dcp"]))

    def end_dcp() -> None:
        held.pop("pending").result()
        totals["dcp_total"].append(time.perf_counter() - held["start"])
        shutil.rmtree(paths["dcp"], ignore_errors=True)

    def start_async() -> None:
        held["start"] = time.perf_counter()
        held["pending"] = save_async(paths["tp"], model=state)

    def end_async() -> None:
        fut = held.pop("pending")
        fut.result()
        totals["async_total"].append(time.perf_counter() - held["start"])
        totals["repeated"].append(float(fut.repeated))

    variants = {"copy": (sync, bare_copy, _nothing), "async": (sync, start_async, end_async)}
    if full:
        variants.update({"tsave": (sync, torch_save, lambda: os.unlink(paths["torch"])),
                         "dcp": (sync, start_dcp, end_dcp)})
    try:
        default_saver().drop_buffers()  # the first save allocates its buffers (from the OS: torch's pinned cache
        empty_host_cache = getattr(torch.accelerator, "empty_host_cache", None)  # emptied where this torch can)
        if dev.type == "cuda" and empty_host_cache is not None:
            empty_host_cache()
        sync()
        start_async()
        totals["first"] = [time.perf_counter() - held["start"]]
        first = held.pop("pending")
        first.result()
        totals["first_allocated"], totals["first_repeated"] = [float(first.allocated_bytes)], [float(first.repeated)]
        bare_copy()  # untimed: the first touch of the pinned pages
        with warnings.catch_warnings():  # dcp's "assuming the intent is to save in a single process" (it is),
            warnings.filterwarnings("ignore", "torch.distributed is disabled")  # from its threads too
            out = timed_rounds(variants, repeats, f"{label}: stalls")
    finally:
        if os.path.exists(paths["tp"]):
            if keep:
                os.replace(paths["tp"], keep)
            else:
                os.unlink(paths["tp"])
        pinned = torch.empty(0)  # gives the pinned buffer back before the timings that follow
    return {**out, **{k: v for k, v in totals.items() if v}}


def _nothing() -> None:
    pass


def stall_rows(label: str, dev: Any, stalls: dict[str, list[float]], extra: dict[str, Any], *, full: bool
               ) -> tuple[list[Row], list[Target]]:
    """Stall rows (ms, against the bare copy) and targets, judged on the per-round ratios."""
    ms = [1e3]
    floor = stalls["copy"]

    def in_ms(key: str) -> list[float]:
        return [t * ms[0] for t in stalls[key]]

    def total(key: str) -> dict[str, Any]:
        return {**extra, "total_ms": median(stalls[key]) * 1e3} if key in stalls else extra

    rows = [row(f"{label} stall: bare copy into pinned host memory", in_ms("copy"), "ms", 1.0, extra)]
    if full:
        rows += [row(f"{label} stall: torch.save+fsync", in_ms("tsave"), "ms", median(ratios(stalls["tsave"], floor)),
                     extra),
                 row(f"{label} stall: dcp.async_save", in_ms("dcp"), "ms", median(ratios(stalls["dcp"], floor)),
                     total("dcp_total"))]
    repeated = {"repeated": [bool(r) for r in stalls.get("repeated", [])]}
    rows.append(row(f"{label} stall: torchplace.save_async", in_ms("async"), "ms",
                    median(ratios(stalls["async"], floor)), {**total("async_total"), **repeated}))
    if "first" in stalls:
        rows.append(row(f"{label} stall: torchplace.save_async, first save", in_ms("first"), "ms",
                        stalls["first"][0] / median(floor),
                        {**extra, "allocated_bytes": int(stalls["first_allocated"][0]),
                         "repeated": [bool(stalls["first_repeated"][0])]}))
    gpu_only = None if dev.type == "cuda" else "set for a GPU (a device->pinned copy)"
    targets = [judged(f"{label} save_async stall vs bare pinned copy", ratios(stalls["async"], floor), 1.2, "<=",
                      gpu_only)]
    if full:
        targets.append(judged(f"{label} save_async stall vs dcp.async_save stall",
                              ratios(stalls["async"], stalls["dcp"]), 0.25, "<="))
    return rows, targets


def stall_note(label: str, stalls: dict[str, list[float]]) -> str:
    """What the save_async rows measured: the first save (its allocation) apart, and how many of the saves after
    it took the repeated path."""
    done, n = int(sum(stalls["repeated"])), len(stalls["repeated"])
    return (f"{label}: save_async stall: the first save ({format_bytes(int(stalls['first_allocated'][0]))} of staging "
            f"buffers allocated) is its own row; {done} of the {n} saves after it took the repeated path "
            f"(copies into the previous layout){'' if done == n else ': a training loop should take it every time'}")


def _steps_for(step: Callable[[], None], seconds: float) -> list[float]:
    """Run STEP back to back for about SECONDS; each step's seconds."""
    times: list[float] = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end or len(times) < 3:
        times.append(_best(step, 1))
    return times


def measure_steps(state: dict[str, Any], dev: Any, root: str) -> dict[str, list[float]]:
    """Median step seconds while a save_async of STATE writes in the background, and without a save:
    steps run back to back for as long as a save takes, before it and after it. Both sides run under
    the same sustained load: a GPU computing flat out for seconds runs slower than in its first
    milliseconds (power and clocks), so a short burst of steps is no baseline for seconds of them."""
    from ..checkpoint.background import save_async

    step = _step_fn(dev)
    path = os.path.join(root, "steps-tp")
    start = time.perf_counter()
    save_async(path, model=state).result()  # untimed: staging buffers made (already, by the stall rounds)
    seconds = min(max(time.perf_counter() - start, 1.0), 20.0)
    before = _steps_for(step, seconds)
    during: list[float] = []
    pending = save_async(path, model=state)
    while not pending.done() or len(during) < 3:
        during.append(_best(step, 1))
    pending.result()
    after = _steps_for(step, seconds)
    os.unlink(path)
    return {"alone": before + after, "during": during, "before": before, "after": after,
            "repeated": [float(pending.repeated)]}


def step_rows(label: str, dev: Any, steps: dict[str, list[float]], extra: dict[str, Any]
              ) -> tuple[list[Row], list[Target]]:
    """The step alone and while save_async writes (ms), and the target on each step during against the median alone."""
    alone = median(steps["alone"])
    during = [t / alone for t in steps["during"]]
    gpu_only = None if dev.type == "cuda" else "set for a GPU (a GPU step beside the writer)"
    rows = [row(f"{label} step alone", [t * 1e3 for t in steps["alone"]], "ms", 1.0,
                {**extra, "before_ms": median(steps["before"]) * 1e3, "after_ms": median(steps["after"]) * 1e3}),
            row(f"{label} step while save_async writes", [t * 1e3 for t in steps["during"]], "ms", median(during),
                {**extra, "steps": len(steps["during"]), "repeated": [bool(r) for r in steps.get("repeated", [])]})]
    return rows, [judged(f"{label} step while writing vs alone", during, 1.05, "<=", gpu_only)]


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


def _fastsafetensors_load(path: str, dev: Any) -> Callable[[], None] | str:
    """fastsafetensors' loader without GDS (pread into a bounce buffer, then copies), or why it is left out."""
    try:
        from fastsafetensors import fastsafe_open
    except ImportError:
        return "fastsafetensors left out: not installed (bash tools/fetch_gpu_wheels.sh fetches its wheel)"

    def load() -> None:
        with fastsafe_open(filenames=[path], nogds=True, device=str(dev)) as f:
            {k: f.get_tensor(k) for k in f.keys()}
        _sync(dev)()

    return _tried("fastsafetensors", load)


def _instanttensor_load(path: str, dev: Any, *, buffered: bool) -> Callable[[], None] | str:
    """instanttensor's safe_open into DEV (buffered reads for the page cache, else its default direct reads),
    or why it is left out: it loads to CUDA or ROCm GPUs only."""
    if dev.type != "cuda":
        return f"instanttensor left out: it loads to GPUs only, not {dev}"
    try:
        from instanttensor import BackendPolicy, safe_open
    except ImportError:
        return "instanttensor left out: not installed (bash tools/fetch_gpu_wheels.sh fetches its wheel)"
    options = {"backend": BackendPolicy.BUFFERED} if buffered else {}

    def load() -> None:
        with safe_open(path, framework="pt", device=dev.index or 0, **options) as f:
            {name: t for name, t in f.tensors()}
        _sync(dev)()

    return _tried("instanttensor", load)


def _tried(name: str, load: Callable[[], None]) -> Callable[[], None] | str:
    """LOAD if a first call runs here, else the reason it is left out (a peer's failure is a note, not the bench's).
    The first call's seconds are kept on LOAD (.trial_s): it is the variant's warm-up."""
    try:
        start = time.perf_counter()
        load()
        load.trial_s = time.perf_counter() - start  # type: ignore[attr-defined]
    except Exception as exc:  # noqa: BLE001 - a peer that fails to run here is left out, and the notes say so
        return f"{name} left out: it failed here: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    return load


def measure_loads(state: dict[str, Any], dev: Any, root: str, repeats: int, *, cold: bool = True,
                  slow_s: float | None = None, label: str = "", slow_peers: bool = True, saved: str | None = None
                  ) -> tuple[dict[str, list[float]], list[str]]:
    """Seconds per round to load STATE onto DEV from the page cache with safetensors, instanttensor (where it
    runs) and ours, and with SLOW_PEERS torch.load(mmap) + .to and fastsafetensors (where it runs); with COLD
    also cold (pages dropped first) with ours, instanttensor's direct reads and a raw O_DIRECT read of the same
    file. SAVED: a torchplace file of STATE already written (moved here and read; else saved first). Also
    the notes on peers left out."""
    import torch
    from safetensors.torch import load_file, save_file

    from ..checkpoint import load, save

    sync = _sync(dev)
    paths = {k: os.path.join(root, f"load-{k}") for k in ("st", "torch", "tp") if slow_peers or k != "torch"}
    notes: list[str] = []
    save_file(state, paths["st"])
    if slow_peers:
        torch.save(state, paths["torch"])
    if saved and os.path.exists(saved):
        os.replace(saved, paths["tp"])
    else:
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

    def dropping(path: str) -> Callable[[], None]:
        return lambda: _drop_cache(path)

    try:
        warm = {"st": plain(st_load), **({"mmap": plain(mmap_load)} if slow_peers else {}), "tp": plain(tp_load)}
        trials: dict[str, float] = {}
        peers = ([("fst", _fastsafetensors_load(paths["st"], dev))] if slow_peers else []) + \
            [("it", _instanttensor_load(paths["st"], dev, buffered=True))]
        for key, peer in peers:
            if isinstance(peer, str):
                notes.append(peer)
            else:
                warm[key] = plain(peer)
                trials[key] = peer.trial_s  # type: ignore[attr-defined]
        out = timed_rounds(warm, repeats, f"{label}: loads", slow_s=slow_s, warmed=trials)
        slow = [k for k, v in out.items() if len(v) < repeats]
        if slow:
            notes.append(f"timed once (the first load took over {slow_s} s): {', '.join(slow)}")
        if cold:
            cold_variants = {"tp_cold": (dropping(paths["tp"]), tp_load, _nothing),
                             "direct_cold": (dropping(paths["tp"]), lambda: _direct_read(paths["tp"]), _nothing)}
            it_direct = _instanttensor_load(paths["st"], dev, buffered=False)
            if isinstance(it_direct, str):
                notes.append(f"cold: {it_direct}")
            else:
                cold_variants["it_cold"] = (dropping(paths["st"]), it_direct, _nothing)
            out.update(timed_rounds(cold_variants, repeats, f"{label}: cold loads"))
        return out, notes
    finally:
        for p in paths.values():
            os.unlink(p)


PEERS = (("mmap", "torch.load(mmap)+.to"), ("fst", "fastsafetensors (no GDS)"), ("it", "instanttensor (buffered)"))


def load_rows(label: str, size: int, dev: Any, loads: dict[str, list[float]], extra: dict[str, Any], *,
              layout: bool) -> tuple[list[Row], list[Target]]:
    """Load rows (GB/s; ratio: times faster than safetensors) and targets, judged on the per-round figures."""
    st = loads["st"]
    rows = [row(f"{label} load -> {dev}: safetensors load_file", gbs(size, st), "GB/s", 1.0, extra)]
    for key, name in PEERS + (("tp", "torchplace.load"),):
        if key in loads:
            rows.append(row(f"{label} load -> {dev}: {name}", gbs(size, loads[key]), "GB/s",
                            median(ratios(st, loads[key])), extra))
    if "tp_cold" in loads:
        direct = loads["direct_cold"]
        rows.append(row(f"{label} cold: raw O_DIRECT read of the file", gbs(size, direct), "GB/s", 1.0, extra))
        if "it_cold" in loads:
            rows.append(row(f"{label} cold: instanttensor (direct) -> {dev}", gbs(size, loads["it_cold"]), "GB/s",
                            median(ratios(direct, loads["it_cold"])), extra))
        rows.append(row(f"{label} cold: torchplace.load -> {dev}", gbs(size, loads["tp_cold"]), "GB/s",
                        median(ratios(direct, loads["tp_cold"])), extra))
    targets: list[Target] = []
    if dev.type == "cuda":
        floor = 30.0 if layout else 40.0 if size >= 10 * 2**30 else 35.0
        targets.append(judged(f"{label} load to {dev} from the page cache (GB/s)", gbs(size, loads["tp"]), floor,
                              ">="))
        if "it" in loads:
            targets.append(judged(f"{label} load vs instanttensor", ratios(loads["it"], loads["tp"]), 1.15, ">="))
        if "fst" in loads:
            targets.append(judged(f"{label} load vs fastsafetensors (no GDS)", ratios(loads["fst"], loads["tp"]), 1.5,
                                  ">="))
        if "tp_cold" in loads:
            targets.append(judged(f"{label} cold load vs raw O_DIRECT read",
                                  ratios(loads["direct_cold"], loads["tp_cold"]), 0.9, ">="))
    return rows, targets
