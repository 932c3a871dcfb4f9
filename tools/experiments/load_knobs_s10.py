"""Issue #34, session 10: what bounds a torchplace load onto cuda:0 from the page cache, and where a GPT-2
save_async stall spends its time. One-off measurement (run on the GPU machine; prints a report):

    python tools/experiments/load_knobs_s10.py --dir /var/tmp/lk10 [--layouts 10GiB,llama,1GiB] [--rounds 5]

Loads: per layout, one torchplace file and its safetensors twin (for instanttensor, buffered), loaded warm from
the page cache onto cuda:0 by torchplace.load with the load engine's module constants set per variant (threads,
ring, window, read piece; and with the CRC-32 left out, to see what checking costs), and by raw reads of the
same file into a pinned ring by 16 threads (no CRC, no copies: the read ceiling). Variants take turns within
each round (the order rotating) so that drift falls on all alike; the first round is a warm-up.
Stall: GPT-2's 148 tensors on cuda:0, save_async as a training loop calls it, the time of each phase of the call.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

import torchplace
from torchplace.bench.checkpoint import LAYOUTS, _state
from torchplace.bench.checkpoint_async import _instanttensor_load
from torchplace.checkpoint import background, stream
from torchplace.checkpoint.staging import HostStaging

DEV = torch.device("cuda:0")
GiB, MiB = 2**30, 2**20
DEFAULTS = {k: getattr(stream, k) for k in ("LOAD_MAX_WORKERS", "RING_BYTES", "WINDOW_BYTES", "READ_BYTES",
                                             "TASK_BYTES", "MIN_WINDOWS")}
REAL = {"crc32": stream.crc32, "_check": stream._check}


def say(*parts: Any) -> None:
    print(*parts, flush=True)


def sync() -> None:
    torch.cuda.synchronize(DEV)


def fmt(nbytes: int, secs: list[float]) -> str:
    gbs = sorted(nbytes / s / 1e9 for s in secs)
    q = statistics.quantiles(gbs, n=4, method="inclusive") if len(gbs) > 1 else gbs * 3
    return f"{statistics.median(gbs):5.1f} GB/s [{q[0]:.1f}..{q[2]:.1f}]  ({' '.join(f'{g:.1f}' for g in gbs)})"


def knobs(no_crc: bool = False, **over: int) -> None:
    for k, v in {**DEFAULTS, **over}.items():
        setattr(stream, k, v)
    stream.crc32 = (lambda data, value=0: 0) if no_crc else REAL["crc32"]
    stream._check = (lambda *a, **k: None) if no_crc else REAL["_check"]


VARIANTS: dict[str, dict[str, Any]] = {
    "default (12 thr, 4x64 MiB ring, 8 MiB reads)": {},
    "16 threads": {"LOAD_MAX_WORKERS": 16},
    "2 MiB reads (CRC from L2)": {"READ_BYTES": 2 * MiB},
    "16 threads, 2 MiB reads": {"LOAD_MAX_WORKERS": 16, "READ_BYTES": 2 * MiB},
    "ring 512 MiB (8x64)": {"RING_BYTES": 512 * MiB},
    "16 thr, ring 1 GiB (8x128)": {"LOAD_MAX_WORKERS": 16, "RING_BYTES": GiB, "WINDOW_BYTES": 128 * MiB},
    "no CRC": {"no_crc": True},
    "no CRC, 16 threads": {"no_crc": True, "LOAD_MAX_WORKERS": 16},
}


def raw_reads(path: str, threads: int = 16, piece: int = 8 * MiB, ring: int = 256 * MiB) -> Any:
    size = os.path.getsize(path)
    buf = torch.empty(ring, dtype=torch.uint8, pin_memory=True)
    pool = ThreadPoolExecutor(threads)

    def one(at: int) -> None:
        n = min(piece, size - at)
        view = memoryview(buf[(at % ring):(at % ring) + n].numpy())
        fd = os.open(path, os.O_RDONLY)
        try:
            os.preadv(fd, [view], at)
        finally:
            os.close(fd)

    def run() -> None:
        list(pool.map(one, range(0, size, piece)))

    return run, size


def run_layout(root: str, name: str, rounds: int) -> None:
    if name.endswith("GiB"):
        n = int(float(name[:-3]) * GiB) // (64 * MiB)
        shapes = {f"t{i}": (32 * MiB,) for i in range(n)}
    else:
        shapes = LAYOUTS[name][1](False)
    state = _state(shapes, DEV)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    path = os.path.join(root, f"{name}.safetensors")
    twin = os.path.join(root, f"{name}-st.safetensors")
    torchplace.save(path, model=state, rng_state=False)
    from safetensors.torch import save_file
    save_file({k: v.contiguous() for k, v in state.items()}, twin)
    del state
    torch.cuda.empty_cache()
    say(f"\n[{name}] {len(shapes)} tensors, {nbytes / GiB:.2f} GiB")
    fns: dict[str, Any] = {}
    for label, over in VARIANTS.items():
        def load(over: dict[str, Any] = over) -> None:
            knobs(**over)
            try:
                ck = torchplace.load(path, device=DEV)
                sync()
                del ck
            finally:
                knobs()
        fns[label] = (load, nbytes)
    it = _instanttensor_load(twin, DEV, buffered=True)
    if callable(it):
        fns["instanttensor (buffered)"] = (it, nbytes)
    else:
        say(it)
    raw, size = raw_reads(path)
    fns["raw: 16 threads pread into pinned ring (no CRC, no copy)"] = (raw, size)
    secs: dict[str, list[float]] = {k: [] for k in fns}
    labels = list(fns)
    for r in range(rounds + 1):
        order = labels[r % len(labels):] + labels[:r % len(labels)]
        for label in order:
            fn, _ = fns[label]
            sync()
            t = time.perf_counter()
            fn()
            dt = time.perf_counter() - t
            if r:
                secs[label].append(dt)
            torch.cuda.empty_cache()
    for label in labels:
        say(f"  {label:58s} {fmt(fns[label][1], secs[label])}")
    for p in (path, twin):
        os.unlink(p)


def stall_phases(root: str, rounds: int = 30) -> None:
    state = _state(LAYOUTS["gpt2"][1](False), DEV)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    path = os.path.join(root, "gpt2-stall.safetensors")
    times: dict[str, list[float]] = {}

    def timed(owner: Any, name: str, key: str) -> None:
        fn = getattr(owner, name)

        def wrapper(*a: Any, **k: Any) -> Any:
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                times.setdefault(key, []).append(time.perf_counter() - t)
        setattr(owner, name, wrapper)

    for owner, name in ((background, "capture_rng"), (background, "collect_state"), (background, "plan_file"),
                        (background, "_stage_file"), (background, "_raise_earlier_failure"),
                        (HostStaging, "start_repeat"), (background.BackgroundSaver, "submit"),
                        (background.BackgroundSaver, "acquire"), (background, "check_request")):
        timed(owner, name, name)

    def bare() -> float:
        sync()
        t = time.perf_counter()
        at = 0
        for v in state.values():
            n = v.numel() * v.element_size()
            pinned[at:at + n].copy_(v.reshape(-1).view(torch.uint8), non_blocking=True)
            at += n
        sync()
        return time.perf_counter() - t

    stalls, copies, reps = [], [], []
    for _ in range(rounds + 3):
        copies.append(bare())
        sync()
        t = time.perf_counter()
        fut = torchplace.save_async(path, model=state)
        stalls.append(time.perf_counter() - t)
        fut.result()
        reps.append(fut.repeated)
    skip = 3
    say(f"\n[gpt2 stall] {len(state)} tensors, {nbytes / MiB:.1f} MiB; repeated {sum(reps[skip:])}/{rounds}")
    say(f"  bare copy      median {statistics.median(copies[skip:]) * 1e3:7.3f} ms")
    say(f"  save_async     median {statistics.median(stalls[skip:]) * 1e3:7.3f} ms "
        f"(ratio {statistics.median(s / c for s, c in zip(stalls[skip:], copies[skip:])):.3f})")
    for key, v in times.items():
        say(f"  {key:24s} median {statistics.median(v[skip:]) * 1e3:7.3f} ms")
    os.unlink(path)


def profile_stall(root: str, calls: int = 30) -> None:
    import cProfile
    import io
    import pstats

    state = _state(LAYOUTS["gpt2"][1](False), DEV)
    path = os.path.join(root, "gpt2-prof.safetensors")
    for _ in range(3):
        torchplace.save_async(path, model=state).result()
    prof = cProfile.Profile()
    for _ in range(calls):
        sync()
        prof.enable()
        fut = torchplace.save_async(path, model=state)
        prof.disable()
        fut.result()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(30)
    say(f"\n[gpt2 save_async profile, {calls} calls, by own time]\n{out.getvalue()}")
    os.unlink(path)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default="/var/tmp/lk10")
    ap.add_argument("--layouts", default="10GiB,llama,1GiB")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--stall-only", action="store_true", help="the GPT-2 stall phases, then a profile of 30 calls")
    args = ap.parse_args()
    os.makedirs(args.dir, exist_ok=True)
    torch.cuda.init()
    say(f"# load knobs s10, {torch.cuda.get_device_name(DEV)}, torch {torch.__version__}, "
        f"{len(os.sched_getaffinity(0))} cpus, crc {stream.crc32}")
    src = torch.empty(GiB, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(GiB, dtype=torch.uint8, device=DEV)
    secs = []
    for _ in range(6):
        sync()
        t = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        sync()
        secs.append(time.perf_counter() - t)
    say(f"pinned H2D 1 GiB: {fmt(GiB, secs[1:])}")
    del src, dst
    stall_phases(args.dir)
    if args.stall_only:
        profile_stall(args.dir)
        return
    for name in args.layouts.split(","):
        run_layout(args.dir, name, args.rounds)


if __name__ == "__main__":
    main()
