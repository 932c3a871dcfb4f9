"""Where a torchplace load onto CUDA from the page cache spends its time now, and which shape of the load
engine (stream.read_chunks_to_cuda) moves the bytes fastest. One-off measurement for issue #34, session 8
(run on the GPU machine; prints a report):

    python tools/experiments/load_engine_s8.py --dir /tmp/le8 [--layouts 10GiB,llama,1GiB,gpt2] [--rounds 7]

Per layout, one file made with torchplace.save on the GPU (and a safetensors twin for instanttensor), loaded warm
from the page cache onto cuda:0. Every variant runs once per round, the rounds interleaved, so that the machine's
drift falls on all of them alike; a first round is a warm-up and not counted. Variants:
- "s7": the engine of session 7 (the ring of 64 MiB windows, each window's copies queued after waiting for the
  window before it), kept here verbatim for the comparison;
- "v2 ...": stream.py's engine (copies queued before that wait; chunks copied as soon as read), with its knobs
  (window and ring sizes, task and read-piece sizes, threads, copy streams) set per variant, and with its CRC,
  its copies or its reads left out (where the time goes);
- "per-thread": each reader copies its own piece out of its own pinned slots (2 a thread) on its own stream;
- instanttensor (buffered) and torchplace.load end to end.
Then where the calling thread of the v2 engine waits: for reads (the readers are behind) or for copies.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, wait
from contextlib import ExitStack, contextmanager
from typing import Any

import torch

import torchplace
from torchplace.checkpoint import stream
from torchplace.checkpoint.format import open_for_read, read_header
from torchplace.progress import advance
from torchplace.shared.staging import SideStreams, done_events, host_buffer
from torchplace.shared.threads import kept_pool

DEV = torch.device("cuda:0")
GiB, MiB = 2**30, 2**20


def say(*parts: Any) -> None:
    print(*parts, flush=True)


def sync() -> None:
    torch.cuda.synchronize(DEV)


def fmt(nbytes: int, secs: list[float]) -> str:
    gbs = sorted(nbytes / s / 1e9 for s in secs)
    q = statistics.quantiles(gbs, n=4, method="inclusive") if len(gbs) > 1 else gbs * 3
    ms = statistics.median(secs) * 1e3
    return f"median {statistics.median(gbs):5.1f} GB/s [q1 {q[0]:.1f} .. q3 {q[2]:.1f}] ({ms:7.2f} ms; " \
           f"{' '.join(f'{g:.1f}' for g in gbs)})"


@contextmanager
def patched(obj: Any, name: str, value: Any):
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)


# ---------------------------------------------------------------- session 7's engine, verbatim (for comparison)

def s7_read_chunks_to_cuda(flat: dict[str, torch.Tensor], entries: Sequence[Any], chunks: Sequence[Any],
                           chunk_bytes: int, workers: int, read_piece: Callable[[int, Any], int],
                           check: Callable[[Any, int], None]) -> None:
    per_window, nbuf = stream._ring(chunks[-1][2] if chunks else 0, chunk_bytes)
    windows = [chunks[i:i + per_window] for i in range(0, len(chunks), per_window)]
    size = max(w[-1][2] - w[0][1] for w in windows)
    pin = any(t.device.type == "cuda" for t in flat.values())
    nbuf = min(nbuf, len(windows))
    arena = host_buffer(size * nbuf, pin)
    bufs = [arena[i * size:(i + 1) * size] for i in range(nbuf)]
    done: list[list[Any]] = [[] for _ in bufs]
    streams = SideStreams()
    order = sorted((e for e in entries if e.nbytes), key=lambda e: e.start)
    ends = [e.end for e in order]
    step = stream.task_bytes(chunk_bytes)
    submitted: list[Future[int]] = []

    def fill(w: int) -> list[list[Future[int]]]:
        buf, w0 = bufs[w % nbuf], windows[w][0][1]
        for event in done[w % nbuf]:
            event.synchronize()
        done[w % nbuf] = []
        reads = []
        for _, c0, c1, _ in windows[w]:
            reads.append([pool.submit(read_piece, at, buf[at - w0:min(at + step, c1) - w0].numpy())
                          for at in range(c0, c1, step)])
            submitted.extend(reads[-1])
        return reads

    pool = kept_pool(workers, "torchplace-load")
    failed = False
    try:
        queued = [fill(w) for w in range(nbuf - 1)]
        for w in range(len(windows)):
            if w + nbuf - 1 < len(windows):
                queued.append(fill(w + nbuf - 1))
            for c, pieces in zip(windows[w], queued.pop(0)):
                check(c, stream._combined([f.result() for f in pieces], c[2] - c[1], step))
            w0, w1 = windows[w][0][1], windows[w][-1][2]
            done[w % nbuf] = done_events(stream._copy_range(bufs[w % nbuf], w0, w0, w1, order, ends, flat, streams))
            advance(len(windows[w]), total=len(chunks))
    except BaseException:
        failed = True
        wait([f for f in submitted if not f.cancel()])
        raise
    finally:
        for e in (e for events in done for e in events):
            try:
                e.synchronize()
            except Exception:
                if not failed:
                    raise


# ---------------------------------------------------------------- per-thread candidate: readers copy their own pieces

_local = threading.local()


def per_thread_read_chunks_to_cuda(flat: dict[str, torch.Tensor], entries: Sequence[Any], chunks: Sequence[Any],
                                   chunk_bytes: int, workers: int, read_piece: Callable[[int, Any], int],
                                   check: Callable[[Any, int], None], slots: int = 2) -> None:
    order = sorted((e for e in entries if e.nbytes), key=lambda e: e.start)
    ends = [e.end for e in order]
    step = stream.task_bytes(chunk_bytes)

    def task(at: int, n: int) -> int:
        st = getattr(_local, "st", None)
        if st is None or st[0][0].numel() < step:
            st = _local.st = [host_buffer(step, True) for _ in range(slots)], [None] * slots, [0], \
                torch.cuda.Stream(DEV)
        bufs, events, nxt, s = st
        i = nxt[0]
        nxt[0] = (i + 1) % slots
        if events[i] is not None:
            events[i].synchronize()
        buf = bufs[i]
        crc = read_piece(at, buf[:n].numpy())
        stream._copy_range(buf, at, at, at + n, order, ends, flat, lambda d: s)
        e = torch.cuda.Event()
        e.record(s)
        events[i] = e
        return crc

    pool = kept_pool(workers, "torchplace-load")
    futures = [[pool.submit(task, at, min(at + step, c1) - at) for at in range(c0, c1, step)]
               for _, c0, c1, _ in chunks]
    try:
        for c, fs in zip(chunks, futures):
            check(c, stream._combined([f.result() for f in fs], c[2] - c[1], step))
    except BaseException:
        wait([f for fs in futures for f in fs if not f.cancel()])
        raise
    finally:
        sync()


# ---------------------------------------------------------------- variants

KNOBS = ("WINDOW_BYTES", "RING_BYTES", "MIN_WINDOWS", "TASK_BYTES", "READ_BYTES", "COPY_EARLY", "COPY_STREAMS")


def no_crc() -> list[tuple[Any, str, Any]]:
    return [(stream, "crc32", lambda data, value=0: 0), (stream, "_check", lambda *a: None)]


def no_copies() -> list[tuple[Any, str, Any]]:
    return [(stream, "_copy_range", lambda *a: set())]


def no_reads() -> list[tuple[Any, str, Any]]:
    return [(stream, "_pread_into", lambda fd, view, offset, path, crc=0: 0), (stream, "_check", lambda *a: None)]


def variants() -> dict[str, tuple[int | None, dict[str, Any], list[tuple[Any, str, Any]]]]:
    """name -> (workers or None, knob values (MiB for sizes), patches)."""
    e = lambda **k: k  # noqa: E731
    return {
        "s7 engine": (None, e(COPY_EARLY=True), [(stream, "read_chunks_to_cuda", s7_read_chunks_to_cuda)]),
        "v2 default (64x4, task 8, read 8, 12 thr)": (None, {}, []),
        "v2 whole-window copies": (None, e(COPY_EARLY=False), []),
        "v2 2 copy streams": (None, e(COPY_STREAMS=2), []),
        "v2 14 threads": (14, {}, []),
        "v2 16 threads": (16, {}, []),
        "v2 read pieces 1 MiB": (None, e(READ_BYTES=1), []),
        "v2 read pieces 2 MiB": (None, e(READ_BYTES=2), []),
        "v2 tasks 4 MiB": (None, e(TASK_BYTES=4, READ_BYTES=4), []),
        "v2 tasks 16, read 2": (None, e(TASK_BYTES=16, READ_BYTES=2), []),
        "v2 32x8 (256)": (None, e(WINDOW_BYTES=32), []),
        "v2 32x4 (128)": (None, e(WINDOW_BYTES=32, RING_BYTES=128), []),
        "v2 16x4 (64)": (None, e(WINDOW_BYTES=16, RING_BYTES=64), []),
        "v2 64x8 (512)": (None, e(RING_BYTES=512), []),
        "v2 128x4 (512)": (None, e(WINDOW_BYTES=128, RING_BYTES=512), []),
        "v2 16 thr, read 2": (16, e(READ_BYTES=2), []),
        "v2 16 thr, 32x8": (16, e(WINDOW_BYTES=32), []),
        "v2 no CRC": (None, {}, no_crc()),
        "v2 no copies (reads+CRC only)": (None, {}, no_copies()),
        "v2 no CRC, no copies (reads only)": (None, {}, no_crc() + no_copies()),
        "v2 no reads (copies only)": (None, {}, no_reads()),
        "v2 16 thr, no copies": (16, {}, no_copies()),
        "per-thread 2 slots x 8 MiB": (None, {}, [(stream, "read_chunks_to_cuda", per_thread_read_chunks_to_cuda)]),
        "per-thread 16 thr": (16, {}, [(stream, "read_chunks_to_cuda", per_thread_read_chunks_to_cuda)]),
    }


@contextmanager
def setting(knobs: dict[str, Any], patches: list[tuple[Any, str, Any]]):
    with ExitStack() as stack:
        for k, v in knobs.items():
            stack.enter_context(patched(stream, k, v * MiB if k.endswith("_BYTES") else v))
        for obj, name, value in patches:
            stack.enter_context(patched(obj, name, value))
        yield


def instanttensor_load(st_path: str) -> Callable[[], None] | None:
    try:
        from instanttensor import BackendPolicy, safe_open
    except ImportError as exc:
        say(f"  instanttensor: not importable ({exc})")
        return None

    def load() -> None:
        with safe_open(st_path, framework="pt", device=0, backend=BackendPolicy.BUFFERED) as f:
            {name: t for name, t in f.tensors()}
        sync()

    try:
        load()
    except Exception as exc:  # noqa: BLE001
        say(f"  instanttensor failed: {exc}")
        return None
    return load


def layout_shapes(name: str) -> dict[str, tuple[int, ...]]:
    from torchplace.bench.checkpoint import TENSOR_BYTES, gpt2_shapes, llama_shapes
    if name == "gpt2":
        return gpt2_shapes()
    if name == "llama":
        return llama_shapes()
    size = int(name.removesuffix("GiB")) * GiB
    return {f"t{i}": (TENSOR_BYTES // 2,) for i in range(size // TENSOR_BYTES)}


def run_layout(root: str, name: str, rounds: int, only: set[str] | None) -> None:
    t0 = time.perf_counter()
    shapes = layout_shapes(name)
    state = {k: torch.randn(s, device=DEV, dtype=torch.bfloat16) for k, s in shapes.items()}
    path = os.path.join(root, f"{name}.tp")
    torchplace.save(path, model=state, rng_state=False)
    nbytes = sum(v.numel() * 2 for v in state.values())
    st_path = path + ".safetensors"
    try:
        from safetensors.torch import save_file
        save_file(state, st_path)
    except Exception as exc:  # noqa: BLE001
        say(f"  safetensors save failed: {exc}")
        st_path = None  # type: ignore[assignment]
    say(f"[{name}] {len(state)} tensors, {nbytes / MiB:.1f} MiB, files made in {time.perf_counter() - t0:.1f} s")
    fd = open_for_read(path)
    try:
        h = read_header(path, fd)
        out = stream.allocate(h, {e.key: DEV for e in h.entries})
        vs = {k: v for k, v in variants().items() if only is None or k in only}
        runs: dict[str, Callable[[], None]] = {}
        for vname, (workers, knobs, patches) in vs.items():
            def rd(workers: int | None = workers, knobs: dict[str, Any] = knobs,
                   patches: list[tuple[Any, str, Any]] = patches) -> None:
                with setting(knobs, patches):
                    stream.read_data(fd, h, out, workers=workers)
                sync()
            runs[vname] = rd

        def tp() -> None:
            torchplace.load(path, device=DEV, restore_rng=False)
            sync()

        runs["torchplace.load (v2 default)"] = tp
        it = instanttensor_load(st_path) if st_path else None
        if it is not None:
            runs["instanttensor (buffered)"] = it
        # the results equal what was saved, for the engines that move bytes
        for vname in ("v2 default (64x4, task 8, read 8, 12 thr)", "v2 16 thr, 32x8", "per-thread 2 slots x 8 MiB",
                      "s7 engine"):
            if vname in runs:
                for t in out.values():
                    t.zero_()
                runs[vname]()
                named = {k: next(o for o in out if o == k or o.endswith("." + k) or o.endswith("/" + k)) for k in state}
                bad = [k for k in state if not torch.equal(out[named[k]], state[k])]
                say(f"  {vname}: every tensor equal: {not bad}" + (f" (differ: {bad[:3]})" if bad else ""))
        del state
        secs: dict[str, list[float]] = {k: [] for k in runs}
        for r in range(rounds + 1):
            for vname, fn in runs.items():
                sync()
                t = time.perf_counter()
                fn()
                if r:
                    secs[vname].append(time.perf_counter() - t)
        for vname, v in secs.items():
            say(f"  {vname:44s} {fmt(nbytes, v)}")
        where_the_caller_waits(fd, h, out, nbytes)
    finally:
        os.close(fd)
        out = None  # type: ignore[assignment]
        torch.cuda.empty_cache()
        for p in (path, st_path):
            if p and os.path.exists(p):
                os.unlink(p)
    say(f"[{name}] done in {time.perf_counter() - t0:.1f} s")


def where_the_caller_waits(fd: int, h: Any, out: dict[str, torch.Tensor], nbytes: int) -> None:
    """The v2 engine's calling thread: ms blocked on reads (_crc_of), on copies (_wait_copies), the rest."""
    for workers, label in ((None, "12 thr"), (16, "16 thr")):
        acc = {"reads": 0.0, "copies": 0.0}
        crc_of, wait_copies = stream._crc_of, stream._wait_copies

        def timed_crc(*a: Any, acc: dict[str, float] = acc, crc_of: Any = crc_of) -> int:
            t = time.perf_counter()
            try:
                return crc_of(*a)
            finally:
                acc["reads"] += time.perf_counter() - t

        def timed_wait(*a: Any, acc: dict[str, float] = acc, wait_copies: Any = wait_copies) -> None:
            t = time.perf_counter()
            try:
                wait_copies(*a)
            finally:
                acc["copies"] += time.perf_counter() - t

        totals = []
        with patched(stream, "_crc_of", timed_crc), patched(stream, "_wait_copies", timed_wait):
            for _ in range(4):
                sync()
                t = time.perf_counter()
                stream.read_data(fd, h, out, workers=workers)
                sync()
                totals.append(time.perf_counter() - t)
        tot = sum(totals) / 4
        rd, cp = acc["reads"] / 4, acc["copies"] / 4
        say(f"  v2 caller ({label}): {nbytes / tot / 1e9:.1f} GB/s, {tot * 1e3:.1f} ms a load: waits on reads "
            f"{rd * 1e3:.1f} ms, on copies {cp * 1e3:.1f} ms, the rest {(tot - rd - cp) * 1e3:.1f} ms")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default="/tmp/le8")
    ap.add_argument("--layouts", default="10GiB,llama,1GiB,gpt2")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--only", default="", help="variant names, ;-separated (default: all)")
    args = ap.parse_args()
    os.makedirs(args.dir, exist_ok=True)
    torch.cuda.init()
    say(f"# load engine s8, {torch.cuda.get_device_name(DEV)}, torch {torch.__version__}, Python "
        f"{platform.python_version()}, {len(os.sched_getaffinity(0))} cpus, kernel {platform.release()}, "
        f"crc {stream.crc32}, combine {stream.crc32_combine}")
    os.system(f"df -hT {args.dir} | tail -1; grep -E 'MemTotal|MemAvailable' /proc/meminfo; "
              "lscpu | grep -E 'Model name|L2|L3|NUMA|Socket|Thread'; "
              "nvidia-smi --query-gpu=driver_version,pcie.link.gen.current,pcie.link.width.current --format=csv")
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
    src = dst = None  # type: ignore[assignment]
    only = set(args.only.split(";")) if args.only else None
    for name in args.layouts.split(","):
        try:
            run_layout(args.dir, name, args.rounds, only)
        except Exception as exc:  # noqa: BLE001
            import traceback
            traceback.print_exc()
            say(f"[{name}] failed: {exc}")


if __name__ == "__main__":
    main()
