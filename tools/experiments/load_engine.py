"""Where a torchplace load onto CUDA from the page cache spends its time, and what registering the file's
mapped pages for DMA (cudaHostRegister, read-only) gives instead of reading them into pinned windows.

One-off measurement for issue #34 (run on the GPU machine; prints a report):

    python tools/experiments/load_engine.py --dir /tmp/le [--layouts gpt2,llama,1GiB,10GiB] [--repeats 5]

Per layout, files made with torchplace.save on the GPU, loaded warm (page cache):
(a) torchplace.load as is, and read_data with its CRC or its copies left out; setup (open, header, allocate);
(b) fixed costs: a thread pool's start, pinned buffers fresh and cached, per-tensor copies against one copy;
(c) the mapped-file candidate: registration GB/s by window and threads, DMA from registered pages, CRC by
    threads preadv-ing into small per-thread buffers, and the whole pipeline (register window k+1 while
    window k copies, CRC beside it), checked equal to torchplace.load's result.
"""

from __future__ import annotations

import argparse
import bisect
import ctypes
import mmap
import os
import platform
import resource
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

import torchplace
from torchplace.checkpoint import stream
from torchplace.checkpoint.format import open_for_read, read_header

PAGE = mmap.PAGESIZE
DEV = torch.device("cuda:0")
GiB, MiB = 2**30, 2**20


def empty_host() -> None:
    fn = getattr(torch._C, "_host_emptyCache", None)
    if fn is not None:
        fn()


def say(*parts: Any) -> None:
    print(*parts, flush=True)


def sync() -> None:
    torch.cuda.synchronize(DEV)


def timed(fn: Any, repeats: int, *, before: Any = None) -> list[float]:
    out = []
    for _ in range(repeats):
        if before is not None:
            before()
        sync()
        t = time.perf_counter()
        fn()
        sync()
        out.append(time.perf_counter() - t)
    return out


def fmt(nbytes: int, secs: list[float]) -> str:
    gbs = sorted(nbytes / s / 1e9 for s in secs)
    q = statistics.quantiles(gbs, n=4, method="inclusive") if len(gbs) > 1 else gbs * 3
    ms = statistics.median(secs) * 1e3
    return f"median {statistics.median(gbs):6.1f} GB/s [q1 {q[0]:.1f} .. q3 {q[2]:.1f}] ({ms:8.2f} ms; " \
           f"{' '.join(f'{g:.1f}' for g in gbs)})"


def ms(secs: list[float]) -> str:
    return f"median {statistics.median(secs) * 1e3:8.3f} ms (min {min(secs) * 1e3:.3f}, max {max(secs) * 1e3:.3f})"


# ---------------------------------------------------------------- cudart through ctypes (releases the GIL)

def find_cudart() -> str | None:
    with open("/proc/self/maps") as f:
        for line in f:
            if "libcudart" in line:
                return line.split()[-1]
    return None


class Cudart:
    def __init__(self) -> None:
        path = find_cudart()
        if path is None:
            raise RuntimeError("no libcudart in /proc/self/maps")
        self.path = path
        lib = self.lib = ctypes.CDLL(path)
        lib.cudaHostRegister.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
        lib.cudaHostRegister.restype = ctypes.c_int
        lib.cudaHostUnregister.argtypes = [ctypes.c_void_p]
        lib.cudaHostUnregister.restype = ctypes.c_int
        lib.cudaGetLastError.restype = ctypes.c_int
        lib.cudaGetErrorString.argtypes = [ctypes.c_int]
        lib.cudaGetErrorString.restype = ctypes.c_char_p
        lib.cudaMemcpyAsync.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                        ctypes.c_void_p]
        lib.cudaMemcpyAsync.restype = ctypes.c_int
        lib.cudaSetDevice.argtypes = [ctypes.c_int]
        lib.cudaDeviceGetAttribute.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int, ctypes.c_int]

    def register(self, addr: int, n: int, flags: int) -> int:
        rc = self.lib.cudaHostRegister(addr, n, flags)
        if rc:
            self.lib.cudaGetLastError()
        return rc

    def unregister(self, addr: int) -> int:
        rc = self.lib.cudaHostUnregister(addr)
        if rc:
            self.lib.cudaGetLastError()
        return rc

    def err(self, rc: int) -> str:
        return self.lib.cudaGetErrorString(rc).decode()

    def attr(self, attr: int) -> int:
        v = ctypes.c_int()
        self.lib.cudaDeviceGetAttribute(ctypes.byref(v), attr, 0)
        return v.value


RO, PORTABLE = 8, 1


class Mapped:
    """A file mapped read-only; its address (never read by the CPU here)."""

    def __init__(self, fd: int, size: int) -> None:
        self.mm = mmap.mmap(fd, size, prot=mmap.PROT_READ)
        arr = np.frombuffer(self.mm, np.uint8)
        self.addr = arr.ctypes.data
        del arr
        self.size = size

    def close(self) -> None:
        self.mm.close()


libc = ctypes.CDLL(None, use_errno=True)
libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]


def resident(m: Mapped) -> float:
    pages = (m.size + PAGE - 1) // PAGE
    vec = (ctypes.c_ubyte * pages)()
    if libc.mincore(m.addr, m.size, vec) != 0:
        return -1.0
    return float(np.frombuffer(vec, np.uint8).__and__(1).sum()) / pages


def host_view(addr: int, n: int) -> torch.Tensor:
    return torch.frombuffer((ctypes.c_uint8 * n).from_address(addr), dtype=torch.uint8)


# ---------------------------------------------------------------- files

def layout_shapes(name: str) -> dict[str, tuple[int, ...]]:
    from torchplace.bench.checkpoint import TENSOR_BYTES, gpt2_shapes, llama_shapes
    if name == "gpt2":
        return gpt2_shapes()
    if name == "llama":
        return llama_shapes()
    size = int(name.removesuffix("GiB")) * GiB
    per = TENSOR_BYTES // 2
    return {f"t{i}": (per,) for i in range(size // TENSOR_BYTES)}


def make_file(root: str, name: str) -> tuple[str, int, int, dict[str, torch.Tensor] | None]:
    shapes = layout_shapes(name)
    state = {k: torch.randn(s, device=DEV, dtype=torch.bfloat16) for k, s in shapes.items()}
    path = os.path.join(root, f"{name}.safetensors")
    t = time.perf_counter()
    torchplace.save(path, model=state, rng_state=False)
    took = time.perf_counter() - t
    nbytes = sum(v.numel() * 2 for v in state.values())
    say(f"[{name}] {len(state)} tensors, {nbytes / MiB:.1f} MiB, saved in {took:.2f} s")
    st_path = None
    try:
        from safetensors.torch import save_file
        st_path = path + ".st"
        save_file(state, st_path)
    except Exception as exc:  # noqa: BLE001
        say(f"  safetensors save failed: {exc}")
    del state
    torch.cuda.empty_cache()
    return path, nbytes, len(shapes), st_path  # type: ignore[return-value]


# ---------------------------------------------------------------- (a) the current engine

@contextmanager
def patched(obj: Any, name: str, value: Any):
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)


def current_engine(path: str, nbytes: int, repeats: int) -> dict[str, torch.Tensor]:
    def tp() -> None:
        torchplace.load(path, device=DEV, restore_rng=False)

    tp()
    say(f"  (a) torchplace.load                     {fmt(nbytes, timed(tp, repeats))}")

    fd = open_for_read(path)
    try:
        def header() -> Any:
            return read_header(path, fd)

        h = header()
        say(f"      read_header                         {ms(timed(header, repeats))}")
        targets = {e.key: DEV for e in h.entries}

        def alloc() -> None:
            stream.allocate(h, targets)

        say(f"      allocate (caching allocator warm)   {ms(timed(alloc, repeats))}")
        out = stream.allocate(h, targets)

        def rd() -> None:
            stream.read_data(fd, h, out)

        rd()
        say(f"      read_data                           {fmt(nbytes, timed(rd, repeats))}")
        with patched(stream, "crc32", lambda data, value=0: 0), patched(stream, "_check", lambda *a: None):
            say(f"      read_data, no CRC                   {fmt(nbytes, timed(rd, repeats))}")
            with patched(stream, "_copy_window", lambda *a: []):
                say(f"      read_data, no CRC, no copies        {fmt(nbytes, timed(rd, repeats))}")
        with patched(stream, "_copy_window", lambda *a: []):
            say(f"      read_data, no copies                {fmt(nbytes, timed(rd, repeats))}")
        for w in (16, 24):
            def rdw(w: int = w) -> None:
                stream.read_data(fd, h, out, workers=w)
            rdw()
            say(f"      read_data, {w} workers               {fmt(nbytes, timed(rdw, repeats))}")
        for win in (64, 256):
            with patched(stream, "WINDOW_BYTES", win * MiB):
                rd()
                say(f"      read_data, {win} MiB windows         {fmt(nbytes, timed(rd, repeats))}")
        ref = stream.allocate(h, targets)
        stream.read_data(fd, h, ref)
    finally:
        os.close(fd)
    return ref


# ---------------------------------------------------------------- (b) fixed costs

def fixed_costs(path: str, nbytes: int, repeats: int) -> None:
    def pool() -> None:
        with ThreadPoolExecutor(12) as p:
            list(p.map(lambda x: x, range(12)))

    say(f"  (b) thread pool of 12, 12 no-op tasks   {ms(timed(pool, repeats))}")
    kept = ThreadPoolExecutor(12)
    list(kept.map(lambda x: x, range(12)))

    def kept_pool() -> None:
        list(kept.map(lambda x: x, range(12)))

    say(f"      kept pool, 12 no-op tasks           {ms(timed(kept_pool, repeats))}")
    kept.shutdown()

    def fresh_pinned() -> None:
        empty_host()
        torch.empty(128 * MiB, dtype=torch.uint8, pin_memory=True)
        empty_host()

    say(f"      pinned 128 MiB, fresh (cudaHostAlloc+free) {ms(timed(fresh_pinned, repeats))}")
    keep = [torch.empty(128 * MiB, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
    del keep

    def cached_pinned() -> None:
        [torch.empty(128 * MiB, dtype=torch.uint8, pin_memory=True) for _ in range(2)]

    say(f"      pinned 2 x 128 MiB, cached           {ms(timed(cached_pinned, repeats))}")

    h = read_header(path)
    targets = {e.key: DEV for e in h.entries}
    out = stream.allocate(h, targets)
    flat = [stream.byte_view(out[e.key]) for e in h.entries]
    src = torch.empty(h.data_bytes, dtype=torch.uint8, pin_memory=True)
    s = torch.cuda.Stream(DEV)
    entries = h.entries

    def per_tensor() -> None:
        with torch.cuda.stream(s):
            for e, t in zip(entries, flat):
                t.copy_(src[e.start:e.end], non_blocking=True)
        s.synchronize()

    say(f"      {len(entries)} copies from pinned, torch     {fmt(nbytes, timed(per_tensor, repeats))}")
    big = torch.empty(h.data_bytes, dtype=torch.uint8, device=DEV)

    def one_copy() -> None:
        with torch.cuda.stream(s):
            big.copy_(src, non_blocking=True)
        s.synchronize()

    say(f"      one copy from pinned                 {fmt(nbytes, timed(one_copy, repeats))}")
    try:
        cr = Cudart()
        hs = s.cuda_stream
        lib = cr.lib

        def per_tensor_ct() -> None:
            base = src.data_ptr()
            for e, t in zip(entries, flat):
                lib.cudaMemcpyAsync(t.data_ptr(), base + e.start, e.end - e.start, 1, hs)
            s.synchronize()

        say(f"      {len(entries)} copies, ctypes cudaMemcpyAsync {fmt(nbytes, timed(per_tensor_ct, repeats))}")
    except Exception as exc:  # noqa: BLE001
        say(f"      ctypes copies failed: {exc}")


# ---------------------------------------------------------------- (c) registered file pages

def windows_of(addr0: int, n: int, w: int) -> list[tuple[int, int]]:
    """Page-aligned (start address, length) windows covering [addr0, addr0 + n)."""
    lo, hi = addr0 - addr0 % PAGE, addr0 + n
    hi = hi + (-hi) % PAGE
    return [(a, min(a + w, hi) - a) for a in range(lo, hi, w)]


def registration(path: str, nbytes: int, repeats: int, cr: Cudart) -> None:
    fd = open_for_read(path)
    size = os.fstat(fd).st_size
    m = Mapped(fd, size)
    try:
        t = time.perf_counter()
        frac = resident(m)
        say(f"  (c) mincore over {size / MiB:.0f} MiB: resident {frac:.3f} in {(time.perf_counter() - t) * 1e3:.2f} ms")
        for flags in (RO, RO | PORTABLE):
            t = time.perf_counter()
            rc = cr.register(m.addr, size, flags)
            t1 = time.perf_counter()
            if rc:
                say(f"      register whole file flags {flags}: refused rc {rc} {cr.err(rc)}")
                continue
            v = host_view(m.addr, size)
            say(f"      register whole file flags {flags}: {size / (t1 - t) / 1e9:.1f} GB/s ({(t1 - t) * 1e3:.2f} ms)"
                f", torch sees pinned: {v.is_pinned()}")
            big = torch.empty(size, dtype=torch.uint8, device=DEV)
            s = torch.cuda.Stream(DEV)

            def dma(s: Any = s, big: torch.Tensor = big, v: torch.Tensor = v) -> None:
                with torch.cuda.stream(s):
                    big.copy_(v, non_blocking=True)
                s.synchronize()

            dma()
            say(f"      DMA whole file from registered pages  {fmt(size, timed(dma, repeats))}")
            t = time.perf_counter()
            cr.unregister(m.addr)
            say(f"      unregister whole file: {(time.perf_counter() - t) * 1e3:.2f} ms")
        # registration in windows by threads
        for wmib in ((16, 64, 256) if size < 4 * GiB else (64, 256)):
            wins = windows_of(m.addr, size, wmib * MiB)
            for nthr in (1, 2, 4, 8, 16):
                if nthr > len(wins):
                    continue
                regs, unregs = [], []
                for _ in range(max(2, repeats // 2)):
                    with ThreadPoolExecutor(nthr) as p:
                        list(p.map(lambda x: x, range(nthr)))
                        t = time.perf_counter()
                        rcs = list(p.map(lambda w: cr.register(w[0], w[1], RO | PORTABLE), wins))
                        t1 = time.perf_counter()
                        list(p.map(lambda w: cr.unregister(w[0]), wins))
                        t2 = time.perf_counter()
                    if any(rcs):
                        say(f"      windows {wmib} MiB x {nthr} threads: refused {set(rcs)}")
                        break
                    regs.append(t1 - t)
                    unregs.append(t2 - t1)
                else:
                    say(f"      register {wmib:3d} MiB windows, {nthr:2d} threads: {fmt(size, regs)}; "
                        f"unregister {fmt(size, unregs)}")
        # does torch.cuda.cudart().cudaHostRegister release the GIL? count a spinning thread's loops meanwhile
        try:
            torch_rt = torch.cuda.cudart()
        except Exception as exc:  # noqa: BLE001
            say(f"      torch.cuda.cudart() failed: {exc}")
            return
        for name, reg, unreg in (
                ("ctypes", lambda: cr.register(m.addr, size, RO | PORTABLE), lambda: cr.unregister(m.addr)),
                ("torch.cuda.cudart()", lambda: torch_rt.cudaHostRegister(m.addr, size, RO | PORTABLE),
                 lambda: torch_rt.cudaHostUnregister(m.addr))):
            counter = [0]
            stop = threading.Event()

            def spin(stop: threading.Event = stop, counter: list[int] = counter) -> None:
                while not stop.is_set():
                    counter[0] += 1

            th = threading.Thread(target=spin)
            th.start()
            time.sleep(0.05)
            c0 = counter[0]
            t = time.perf_counter()
            rc = reg()
            took = time.perf_counter() - t
            c1 = counter[0]
            stop.set()
            th.join()
            unreg()
            say(f"      GIL during register ({name}): rc {rc}, {took * 1e3:.1f} ms, spinner ran {c1 - c0} loops "
                f"({(c1 - c0) / took / 1e6:.2f} M/s)")
    finally:
        m.close()
        os.close(fd)


def crc_alone(path: str, nbytes: int, repeats: int) -> None:
    h = read_header(path)
    crcs, chunk = stream._checksums(h)
    fd = open_for_read(path)
    try:
        for piece in (2 * MiB, 4 * MiB, 8 * MiB):
            for nthr in (8, 12, 16):
                local = threading.local()

                def task(k: int, c0: int, c1: int, piece: int = piece, local: Any = local) -> None:
                    buf = getattr(local, "buf", None)
                    if buf is None:
                        buf = local.buf = bytearray(piece)
                    crc_chunk(fd, memoryview(buf), h.data_offset + c0, c1 - c0, crcs, k)

                chunks = [(k, c0, min(c0 + chunk, h.data_bytes)) for k, c0 in enumerate(range(0, h.data_bytes, chunk))]
                pool = ThreadPoolExecutor(nthr)

                def run(pool: ThreadPoolExecutor = pool, chunks: list[tuple[int, int, int]] = chunks,
                        task: Any = task) -> None:
                    list(pool.map(lambda c: task(*c), chunks))

                run()
                say(f"      CRC alone, {piece // MiB} MiB pieces, {nthr:2d} threads     "
                    f"{fmt(nbytes, timed(run, repeats))}")
                pool.shutdown()
    finally:
        os.close(fd)


def crc_chunk(fd: int, buf: memoryview, at: int, n: int, crcs: list[str] | None, k: int) -> None:
    crc, done = 0, 0
    while done < n:
        piece = buf[:min(len(buf), n - done)]
        got = os.preadv(fd, [piece], at + done)
        if got == 0:
            raise RuntimeError(f"file ended early at {at + done}")
        crc = stream.crc32(piece[:got], crc)
        done += got
    if crcs is not None and crcs[k] != f"{crc:08x}":
        raise RuntimeError(f"chunk {k} CRC mismatch")


def registered_load(path: str, cr: Cudart, *, win: int, nreg: int, ncrc: int, piece: int, check: bool = True,
                    copy: str = "torch", pools: dict[str, ThreadPoolExecutor] | None = None,
                    times: dict[str, float] | None = None) -> dict[str, torch.Tensor]:
    """The candidate: map the file, register windows (nreg threads), DMA each window's pieces as soon as it is
    registered, CRC every chunk by ncrc threads reading into small buffers, unregister windows once copied."""
    t0 = time.perf_counter()
    fd = open_for_read(path)
    h = read_header(path, fd)
    out = stream.allocate(h, {e.key: DEV for e in h.entries})
    flat = {e.key: stream.byte_view(out[e.key]) for e in h.entries if e.nbytes}
    t1 = time.perf_counter()
    size = os.fstat(fd).st_size
    m = Mapped(fd, size)
    data0 = m.addr + h.data_offset
    wins = windows_of(data0, h.data_bytes, win)
    crcs, chunk = stream._checksums(h)
    own = pools is None
    pools = pools or {"reg": ThreadPoolExecutor(nreg), "crc": ThreadPoolExecutor(ncrc),
                      "unreg": ThreadPoolExecutor(1)}
    local = threading.local()

    def crc_task(k: int, c0: int, c1: int) -> None:
        buf = getattr(local, "buf", None)
        if buf is None:
            buf = local.buf = bytearray(piece)
        crc_chunk(fd, memoryview(buf), h.data_offset + c0, c1 - c0, crcs, k)

    crc_futs = [pools["crc"].submit(crc_task, k, c0, min(c0 + chunk, h.data_bytes))
                for k, c0 in enumerate(range(0, h.data_bytes, chunk))] if check else []
    reg_futs = [pools["reg"].submit(cr.register, a, n, RO | PORTABLE) for a, n in wins]
    t2 = time.perf_counter()
    order = sorted((e for e in h.entries if e.nbytes), key=lambda e: e.start)
    ends = [e.end for e in order]
    s = torch.cuda.Stream(DEV)
    hs = s.cuda_stream
    unreg_futs = []
    first_reg = None

    def unreg_after(ev: Any, a: int) -> int:
        ev.synchronize()
        return cr.unregister(a)

    for (a, n), f in zip(wins, reg_futs):
        rc = f.result()
        if first_reg is None:
            first_reg = time.perf_counter()
        if rc:
            raise RuntimeError(f"register refused: {rc} {cr.err(rc)}")
        w0, w1 = max(0, a - data0), min(h.data_bytes, a + n - data0)  # data offsets the window covers
        src = host_view(data0 + w0, w1 - w0) if copy == "torch" else None
        with torch.cuda.stream(s):
            for e in order[bisect.bisect_right(ends, w0):]:
                if e.start >= w1:
                    break
                lo, hi = max(e.start, w0), min(e.end, w1)
                if copy == "torch":
                    flat[e.key][lo - e.start:hi - e.start].copy_(src[lo - w0:hi - w0], non_blocking=True)
                else:
                    cr.lib.cudaMemcpyAsync(flat[e.key].data_ptr() + lo - e.start, data0 + lo, hi - lo, 1, hs)
        ev = torch.cuda.Event()
        ev.record(s)
        unreg_futs.append(pools["unreg"].submit(unreg_after, ev, a))
    t3 = time.perf_counter()
    s.synchronize()
    t4 = time.perf_counter()
    for f in crc_futs:
        f.result()
    t5 = time.perf_counter()
    for f in unreg_futs:
        f.result()
    t6 = time.perf_counter()
    m.close()
    os.close(fd)
    if own:
        for p in pools.values():
            p.shutdown()
    if times is not None:
        for k, v in (("setup", t1 - t0), ("submit", t2 - t1), ("first_reg", (first_reg or t2) - t2),
                     ("queued", t3 - t2), ("dma_done", t4 - t3), ("crc_wait", t5 - t4), ("unreg_wait", t6 - t5),
                     ("total", t6 - t0)):
            times.setdefault(k, []).append(v)  # type: ignore[attr-defined]
    return out


def candidate(path: str, nbytes: int, repeats: int, cr: Cudart, ref: dict[str, torch.Tensor], big: bool) -> None:
    got = registered_load(path, cr, win=64 * MiB, nreg=4, ncrc=12, piece=4 * MiB)
    same = all(torch.equal(got[k], ref[k]) for k in ref)
    say(f"      candidate equals torchplace.load's tensors: {same}")
    del got
    grid = [(64, 4, 12, 4), (64, 8, 12, 4), (64, 4, 16, 4), (64, 4, 12, 8), (256, 4, 12, 4), (16, 8, 12, 4),
            (32, 4, 12, 4), (64, 2, 14, 4), (128, 4, 12, 8)] if big else \
        [(16, 4, 12, 4), (32, 4, 12, 4), (64, 4, 12, 4), (16, 8, 12, 2), (8, 8, 12, 2), (16, 4, 8, 4)]
    for win, nreg, ncrc, piece in grid:
        for kept in (False, True):
            pools = {"reg": ThreadPoolExecutor(nreg), "crc": ThreadPoolExecutor(ncrc),
                     "unreg": ThreadPoolExecutor(1)} if kept else None
            times: dict[str, Any] = {}

            def run(pools: Any = pools, times: Any = times, win: int = win, nreg: int = nreg, ncrc: int = ncrc,
                    piece: int = piece) -> None:
                registered_load(path, cr, win=win * MiB, nreg=nreg, ncrc=ncrc, piece=piece * MiB, pools=pools,
                                times=times)

            run()
            times.clear()
            secs = timed(run, repeats)
            split = " ".join(f"{k} {statistics.median(v) * 1e3:.1f}" for k, v in times.items())
            say(f"      cand win {win:3d} MiB reg {nreg:2d} crc {ncrc:2d} piece {piece} MiB"
                f"{' kept pools' if kept else '           '} {fmt(nbytes, secs)}\n          ms: {split}")
            if pools:
                for p in pools.values():
                    p.shutdown()
    for label, kw in (("no CRC", {"check": False}), ("cudart copies", {"copy": "cudart"})):
        times = {}

        def run2(kw: Any = kw, times: Any = times) -> None:
            registered_load(path, cr, win=64 * MiB, nreg=4, ncrc=12, piece=4 * MiB, times=times, **kw)

        run2()
        times.clear()
        secs = timed(run2, repeats)
        split = " ".join(f"{k} {statistics.median(v) * 1e3:.1f}" for k, v in times.items())
        say(f"      cand win 64 reg 4 crc 12 piece 4, {label:14s} {fmt(nbytes, secs)}\n          ms: {split}")


ENGINES = {  # (MIN_WINDOWS, TASK_BYTES MiB, WINDOW_BYTES MiB, RING_BYTES MiB, workers or None)
    "old ring (128 MiB x 2, chunk tasks)": (1, 16, 128, 256, None),
    "new default": None,
    "new, 4 MiB tasks": (8, 4, 128, 256, None),
    "new, 16 MiB tasks": (8, 16, 128, 256, None),
    "new, 64 MiB x 4": (8, 8, 64, 256, None),
    "new, ring 512 MiB (128 x 4)": (8, 8, 128, 512, None),
    "new, 16 workers": (8, 8, 128, 256, 16),
    "new, at least 4 windows": (4, 8, 128, 256, None),
    "new, at least 16 windows": (16, 8, 128, 256, None),
}


def engines(path: str, nbytes: int, repeats: int) -> None:
    """read_data and torchplace.load under each engine setting, interleaved round by round."""
    fd = open_for_read(path)
    h = read_header(path, fd)
    out = stream.allocate(h, {e.key: DEV for e in h.entries})
    names = ("MIN_WINDOWS", "TASK_BYTES", "WINDOW_BYTES", "RING_BYTES")
    default = tuple(getattr(stream, n) for n in names)
    secs: dict[str, list[float]] = {name: [] for name in ENGINES}
    whole: dict[str, list[float]] = {name: [] for name in ("old ring (128 MiB x 2, chunk tasks)", "new default")}

    def setting(name: str) -> int | None:
        cfg = ENGINES[name]
        vals = default if cfg is None else (cfg[0], cfg[1] * MiB, cfg[2] * MiB, cfg[3] * MiB)
        for n, v in zip(names, vals):
            setattr(stream, n, v)
        return None if cfg is None else cfg[4]

    try:
        for r in range(repeats + 1):
            for name in ENGINES:
                workers = setting(name)
                sync()
                t = time.perf_counter()
                stream.read_data(fd, h, out, workers=workers)
                sync()
                if r:
                    secs[name].append(time.perf_counter() - t)
            for name in whole:
                setting(name)
                sync()
                t = time.perf_counter()
                torchplace.load(path, device=DEV, restore_rng=False)
                sync()
                if r:
                    whole[name].append(time.perf_counter() - t)
    finally:
        setting("new default")
        os.close(fd)
    for name, v in secs.items():
        say(f"  read_data, {name:38s} {fmt(nbytes, v)}")
    for name, v in whole.items():
        say(f"  torchplace.load, {name:32s} {fmt(nbytes, v)}")


def registration_beside_dma(cr: Cudart) -> None:
    """Does a copy from registered pages slow down while another range is being registered? (1 GiB file)"""
    import tempfile
    n = 512 * MiB
    with tempfile.NamedTemporaryFile(dir="/tmp") as f:
        f.write(bytes(2 * n))
        f.flush()
        m = Mapped(f.fileno(), 2 * n)
        try:
            a, b = m.addr, m.addr + n
            dst = torch.empty(n, dtype=torch.uint8, device=DEV)
            s = torch.cuda.Stream(DEV)
            cr.register(a, n, RO | PORTABLE)
            src = host_view(a, n)
            for label, beside in (("alone", False), ("while registering 512 MiB more", True)):
                sync()
                ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                with torch.cuda.stream(s):
                    ev0.record(s)
                    dst.copy_(src, non_blocking=True)
                    ev1.record(s)
                t = time.perf_counter()
                if beside:
                    rc = cr.register(b, n, RO | PORTABLE)
                    took = time.perf_counter() - t
                    cr.unregister(b)
                s.synchronize()
                dma = ev0.elapsed_time(ev1) / 1e3
                say(f"  DMA 512 MiB from registered pages {label}: {n / dma / 1e9:.1f} GB/s ({dma * 1e3:.2f} ms)"
                    + (f"; the registration beside it: rc {rc}, {took * 1e3:.2f} ms ({n / took / 1e9:.1f} GB/s)"
                       if beside else ""))
            t = time.perf_counter()
            cr.register(b, n, RO | PORTABLE)
            took = time.perf_counter() - t
            cr.unregister(b)
            say(f"  registration of 512 MiB alone: {took * 1e3:.2f} ms ({n / took / 1e9:.1f} GB/s)")
            cr.unregister(a)
        finally:
            m.close()


def instanttensor(st_path: str | None, nbytes: int, repeats: int) -> None:
    if st_path is None:
        return
    try:
        from instanttensor import BackendPolicy, safe_open
    except ImportError as exc:
        say(f"  instanttensor: not importable ({exc})")
        return

    def load() -> None:
        with safe_open(st_path, framework="pt", device=0, backend=BackendPolicy.BUFFERED) as f:
            {name: t for name, t in f.tensors()}

    try:
        load()
    except Exception as exc:  # noqa: BLE001
        say(f"  instanttensor failed: {exc}")
        return
    say(f"  instanttensor buffered                   {fmt(nbytes, timed(load, repeats))}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default="/tmp/le")
    ap.add_argument("--layouts", default="gpt2,llama,1GiB,10GiB")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--parts", default="a,b,c,crc,cand,it")  # also: eng (engine settings), regdma
    args = ap.parse_args()
    parts = set(args.parts.split(","))
    os.makedirs(args.dir, exist_ok=True)
    torch.cuda.init()
    say(f"# load engine, {torch.cuda.get_device_name(DEV)}, torch {torch.__version__}, Python "
        f"{platform.python_version()}, {len(os.sched_getaffinity(0))} cpus, kernel {platform.release()}, uid "
        f"{os.getuid()}, RLIMIT_MEMLOCK {resource.getrlimit(resource.RLIMIT_MEMLOCK)}, crc {stream.crc32}")
    os.system(f"df -hT {args.dir} | tail -1; grep -E 'MemTotal|MemAvailable' /proc/meminfo; "
              "nvidia-smi --query-gpu=driver_version --format=csv,noheader")
    try:
        cr = Cudart()
        say(f"cudart {cr.path}; HostRegisterReadOnlySupported(attr 113) {cr.attr(113)}, "
            f"HostRegisterSupported(attr 104) {cr.attr(104)}, "
            f"PageableMemoryAccessUsesHostPageTables(100) {cr.attr(100)}")
    except Exception as exc:  # noqa: BLE001
        say(f"no cudart via ctypes: {exc}")
        cr = None  # type: ignore[assignment]
    src = torch.empty(GiB, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(GiB, dtype=torch.uint8, device=DEV)
    say(f"pinned H2D 1 GiB: {fmt(GiB, timed(lambda: dst.copy_(src, non_blocking=True), args.repeats))}")
    src = dst = None  # type: ignore[assignment]
    empty_host()
    if cr is not None and "regdma" in parts:
        registration_beside_dma(cr)
    for name in args.layouts.split(","):
        t = time.perf_counter()
        path, nbytes, count, st_path = make_file(args.dir, name)
        big = nbytes >= 2 * GiB
        try:
            ref = current_engine(path, nbytes, args.repeats) if "a" in parts else None
            if "eng" in parts:
                engines(path, nbytes, args.repeats)
            if "b" in parts and nbytes <= 4 * GiB:
                fixed_costs(path, nbytes, args.repeats)
            if cr is not None and "c" in parts:
                registration(path, nbytes, args.repeats, cr)
            if "crc" in parts:
                crc_alone(path, nbytes, args.repeats)
            if cr is not None and "cand" in parts and ref is not None:
                candidate(path, nbytes, args.repeats, cr, ref, big)
            if "it" in parts:
                instanttensor(st_path, nbytes, args.repeats)
        except Exception as exc:  # noqa: BLE001
            import traceback
            traceback.print_exc()
            say(f"[{name}] failed: {exc}")
        finally:
            ref = None
            torch.cuda.empty_cache()
            for p in (path, st_path):
                if p and os.path.exists(p):
                    os.unlink(p)
        say(f"[{name}] done in {time.perf_counter() - t:.1f} s")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
