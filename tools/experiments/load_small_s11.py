"""Issue 34, session 11: where a small model-shaped load's time goes, and what the page cache gives threads.

GPT-2 (148 tensors, 237 MiB) loads onto cuda:0 at ~11 GB/s in `bench checkpoint` against a 30 GB/s target.
1. Each phase of torchplace.load (as the bench calls it, results dropped, no empty_cache between), by
   wrapping torchplace's own functions: read_header, allocate, read_data, read_chunks_to_cuda, host_buffer,
   codec.decode; then a cProfile of 20 loads by own time.
2. Floors for the same file: 12 threads pread the data region into one pinned block then one H2D copy; the
   same reads without the copy.
3. 10 GiB in the page cache read by 16 threads three ways: pread into a pinned ring; memcpy from an mmap of
   the file (torch copy_ of a frombuffer view, GIL released); the same after MADV_POPULATE_READ.
Run: python3 tools/experiments/load_small_s11.py --dir /var/tmp/ls11 (about 60 s).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import mmap
import os
import pstats
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

import torchplace
from torchplace.bench.checkpoint import LAYOUTS, _state
from torchplace.checkpoint import codec, fileio, stream

DEV = torch.device("cuda:0")
MiB, GiB = 2**20, 2**30


def say(*parts: Any) -> None:
    print(*parts, flush=True)


def sync() -> None:
    torch.cuda.synchronize(DEV)


def med(v: list[float]) -> str:
    q = statistics.quantiles(v, n=4) if len(v) > 1 else [v[0]] * 3
    return f"{statistics.median(v) * 1e3:8.3f} ms [{q[0] * 1e3:.3f}..{q[2] * 1e3:.3f}]"


def phases(path: str, nbytes: int, rounds: int = 20) -> None:
    times: dict[str, list[float]] = {}

    def timed(owner: Any, name: str) -> Any:
        fn = getattr(owner, name)

        def wrapper(*a: Any, **k: Any) -> Any:
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                times.setdefault(name, []).append(time.perf_counter() - t)
        setattr(owner, name, wrapper)
        return fn

    originals = [(o, n, timed(o, n)) for o, n in ((fileio, "read_header"), (fileio, "allocate"),
                                                  (fileio, "read_data"), (stream, "read_chunks_to_cuda"),
                                                  (stream, "host_buffer"), (codec, "decode"))]
    total = []
    for _ in range(rounds + 3):
        sync()
        t = time.perf_counter()
        torchplace.load(path, device=DEV, restore_rng=False)
        sync()
        total.append(time.perf_counter() - t)
    for o, n, fn in originals:
        setattr(o, n, fn)
    say(f"  load total          {med(total[3:])}  = {nbytes / statistics.median(total[3:]) / 1e9:.1f} GB/s")
    for k, v in times.items():
        say(f"  {k:20s}{med(v[3:])}")
    prof = cProfile.Profile()
    for _ in range(rounds):
        sync()
        prof.enable()
        torchplace.load(path, device=DEV, restore_rng=False)
        sync()
        prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(22)
    say(f"  profile of {rounds} loads, by own time:\n{out.getvalue()}")


def floors(path: str, rounds: int = 20, threads: int = 12) -> None:
    header = fileio.read_header(path)
    base, size = header.data_offset, header.data_bytes
    buf = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(size, dtype=torch.uint8, device=DEV)
    pool = ThreadPoolExecutor(threads)
    piece = 8 * MiB
    fd = os.open(path, os.O_RDONLY)

    def one(at: int) -> None:
        os.preadv(fd, [memoryview(buf[at:at + min(piece, size - at)].numpy())], base + at)

    for label, copy in (("12-thread pread into pinned, then one H2D copy", True),
                        ("12-thread pread into pinned (no copy)", False)):
        secs = []
        for _ in range(rounds + 2):
            sync()
            t = time.perf_counter()
            list(pool.map(one, range(0, size, piece)))
            if copy:
                dst.copy_(buf, non_blocking=True)
                sync()
            secs.append(time.perf_counter() - t)
        say(f"  {label:50s}{med(secs[2:])}  = {size / statistics.median(secs[2:]) / 1e9:.1f} GB/s")
    os.close(fd)


def page_cache(root: str, rounds: int = 5, threads: int = 16) -> None:
    path = os.path.join(root, "pc10.bin")
    size = 10 * GiB
    block = torch.randint(0, 255, (256 * MiB,), dtype=torch.uint8)
    with open(path, "wb") as fh:
        for _ in range(size // block.numel()):
            fh.write(block.numpy().tobytes())
    with open(path, "rb") as fh:  # in the page cache
        while fh.read(256 * MiB):
            pass
    ring = 256 * MiB
    buf = torch.empty(ring, dtype=torch.uint8, pin_memory=True)
    piece = 8 * MiB
    pool = ThreadPoolExecutor(threads)
    fd = os.open(path, os.O_RDONLY)
    mm = mmap.mmap(fd, size, prot=mmap.PROT_READ)
    src = torch.frombuffer(mm, dtype=torch.uint8)  # type: ignore[call-overload]
    torch.set_num_threads(1)  # each copy_ on its own reader thread

    def pread(at: int) -> None:
        os.preadv(fd, [memoryview(buf[at % ring:at % ring + piece].numpy())], at)

    def memcpy(at: int) -> None:
        buf[at % ring:at % ring + piece].copy_(src[at:at + piece])

    def populate() -> None:
        advice = getattr(mmap, "MADV_POPULATE_READ", 22)
        list(pool.map(lambda at: mm.madvise(advice, at, 64 * MiB), range(0, size, 64 * MiB)))

    variants = {"pread into pinned ring": lambda: list(pool.map(pread, range(0, size, piece))),
                "memcpy from mmap": lambda: list(pool.map(memcpy, range(0, size, piece)))}
    secs: dict[str, list[float]] = {k: [] for k in variants}
    pop: list[float] = []
    for r in range(rounds + 1):
        for k, fn in variants.items():
            t = time.perf_counter()
            fn()
            if r:
                secs[k].append(time.perf_counter() - t)
    t = time.perf_counter()
    populate()
    pop.append(time.perf_counter() - t)
    secs["memcpy from mmap after MADV_POPULATE_READ"] = []
    for _ in range(rounds):
        t = time.perf_counter()
        variants["memcpy from mmap"]()
        secs["memcpy from mmap after MADV_POPULATE_READ"].append(time.perf_counter() - t)
    say(f"  MADV_POPULATE_READ of 10 GiB: {pop[0] * 1e3:.0f} ms")
    for k, v in secs.items():
        rates = sorted(size / s / 1e9 for s in v)
        say(f"  {k:45s} {statistics.median(rates):5.1f} GB/s [{rates[0]:.1f}..{rates[-1]:.1f}]")
    os.close(fd)  # the mapping stays until the process exits (the tensor still views it)
    os.unlink(path)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default="/var/tmp/ls11")
    args = ap.parse_args()
    os.makedirs(args.dir, exist_ok=True)
    torch.cuda.init()
    say(f"# load small s11, {torch.cuda.get_device_name(DEV)}, torch {torch.__version__}, "
        f"{len(os.sched_getaffinity(0))} cpus, crc {stream.crc32.__module__}.{stream.crc32.__name__}")
    for name in ("gpt2", "llama"):
        state = _state(LAYOUTS[name][1](False), DEV)
        nbytes = sum(t.numel() * t.element_size() for t in state.values())
        path = os.path.join(args.dir, f"{name}.safetensors")
        torchplace.save(path, model=state, rng_state=False)
        del state
        say(f"\n[{name}] {nbytes / MiB:.1f} MiB")
        phases(path, nbytes, rounds=20 if name == "gpt2" else 6)
        floors(path, rounds=20 if name == "gpt2" else 6)
        os.unlink(path)
        torch.cuda.empty_cache()
    say("\n[page cache, 10 GiB, 16 threads, 8 MiB pieces]")
    page_cache(args.dir)


if __name__ == "__main__":
    main()
