"""Move tensor bytes between memory and a file fast, checksumming every chunk on the way.

The data region is cut into fixed chunks (``format.CHUNK_BYTES``). A pool of threads handles
chunks independently: each one copies its slice off the device (through its own pinned staging
buffer and CUDA stream), computes the chunk's CRC-32 and writes it at its offset (the file sink
starts the disk write-out of those bytes at once, so the final fsync has little left to do);
loading runs the same steps backwards (onto CUDA devices through pinned windows: reader threads
fill them, one thread queues the copies; see `read_chunks_to_cuda`), checksumming each piece as it is read; a
chunk whose CRC fails raises before anything loaded is returned.
pread/pwrite, CRC-32 (ISA-L's) and CUDA copies all release the GIL, so copies, checksums and
disk I/O overlap across threads, and nothing is ever pickled. CPU tensors are written from and
read into their own memory directly.
"""

from __future__ import annotations

import bisect
import os
import sys
import threading
import zlib
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Executor, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Protocol

import torch

from ..errors import CheckpointError
from ..hardware.accelerator import device_module
from ..progress import advance
from ..shared.staging import SideStreams, ThreadStaging, accelerators, done_events, host_buffer
from ..shared.threads import helper_threads, kept_pool
from .format import CHUNK_BYTES, DAMAGED_FIX, Header, TensorEntry

# CRC-32 of the chunks: zlib's value (what every torchplace file records), computed by ISA-L (the `isal`
# package, a dependency) about 6x faster than the system zlib (28 vs 4.3 GB/s a core, measured 2026-12-01),
# which decides how fast a verified load can go; zlib's where `isal` is missing (a platform without its wheel).
crc32: Callable[..., int] = zlib.crc32  # crc32(data, value): the CRC-32 of DATA (any buffer), from VALUE (0)
# crc32_combine(crc1, crc2, len2): the CRC-32 of two pieces back to back from theirs (ISA-L's alone:
# Python's zlib has none), so that one chunk can be read and checksummed by several threads
crc32_combine: Callable[[int, int, int], int] | None = None
try:
    from isal.isal_zlib import crc32, crc32_combine
except ImportError:  # pragma: no cover - isal is a dependency; kept for platforms without its wheel
    pass


class Sink(Protocol):
    """Where the writer puts bytes: a file in normal use, a fault injector in tests."""

    def pwrite(self, data: Any, offset: int) -> None: ...


PARALLEL_MIN_BYTES = 32 * 2**20  # below this, starting threads costs more than it saves


SAVE_MAX_WORKERS = 8  # a save is bound by the disk's write speed: more threads only take CPU
LOAD_MAX_WORKERS = 12  # a load: threads reading the page cache; 12 measured best of 8, 12 and 16 on an H200 host
READ_BYTES = 8 * 2**20  # a load reads and checksums in pieces this size (measured best of 2 and 8 MiB)


def default_workers(data_bytes: int) -> int:
    """Threads for one save: enough to overlap I/O, checksums and copies, at most SAVE_MAX_WORKERS."""
    return helper_threads(data_bytes, SAVE_MAX_WORKERS, least_bytes=PARALLEL_MIN_BYTES)


def lower_priority(nice: int) -> int | None:
    """Lower the calling thread's CPU priority by NICE (capped at 19); threads it starts inherit it.
    Linux only, best effort: returns the thread's nice value now, or None where it cannot be read."""
    if not sys.platform.startswith("linux") or not hasattr(os, "setpriority"):
        return None
    tid = threading.get_native_id()  # on Linux, PRIO_PROCESS with a thread id sets that thread's nice alone
    try:
        now = os.getpriority(os.PRIO_PROCESS, tid)
        if nice > 0 and now < 19:
            os.setpriority(os.PRIO_PROCESS, tid, min(19, now + nice))
        return os.getpriority(os.PRIO_PROCESS, tid)
    except OSError:  # not permitted (a seccomp profile): write at the priority we have
        return None


def load_workers(data_bytes: int) -> int:
    """Threads for one load or verification: one per core, at most LOAD_MAX_WORKERS."""
    return helper_threads(data_bytes, LOAD_MAX_WORKERS, least_bytes=PARALLEL_MIN_BYTES)


Chunk = tuple[int, int, int, list["_Piece"]]  # (index, start, end, pieces) of one chunk of the data region


@dataclass
class _Piece:
    entry: TensorEntry
    lo: int  # byte range inside the tensor
    hi: int
    at: int  # byte offset inside the chunk


def _chunks(entries: Sequence[TensorEntry], data_bytes: int, chunk: int) -> Iterator[Chunk]:
    """Yield (index, start, end, pieces) for each chunk of the data region."""
    i, n = 0, len(entries)
    for k, c0 in enumerate(range(0, data_bytes, chunk)):
        c1 = min(c0 + chunk, data_bytes)
        while i < n and entries[i].end <= c0:
            i += 1
        pieces, j = [], i
        while j < n and entries[j].start < c1:
            e = entries[j]
            lo, hi = max(c0, e.start), min(c1, e.end)
            if hi > lo:
                pieces.append(_Piece(e, lo - e.start, hi - e.start, lo - c0))
            j += 1
        yield k, c0, c1, pieces


def byte_view(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes as a flat uint8 tensor on its device (a view; a copy only if not contiguous)."""
    return t.contiguous().view(-1).view(torch.uint8)


def _run(tasks: Sequence[Callable[[], Any]], workers: int, *, keep: bool = False) -> list[Any]:
    """Run TASKS on a thread pool (KEEP: the process's kept pool, as loads do; saves start their own, whose
    threads inherit the saving thread's lowered priority); on the first failure, skip the rest and re-raise
    it once every task has returned.

    Each finished task is reported to the progress callback current on this thread, if any."""
    if workers <= 1 or len(tasks) <= 1:
        results = []
        for t in tasks:
            results.append(t())
            advance(total=len(tasks))
        return results
    failed = threading.Event()

    def guarded(task: Callable[[], Any]) -> Any:
        if failed.is_set():
            return None
        try:
            return task()
        except BaseException:
            failed.set()
            raise

    pool: Executor = kept_pool(workers, "torchplace-load") if keep else \
        ThreadPoolExecutor(max_workers=workers, thread_name_prefix="torchplace-ckpt")
    with pool:  # (a kept pool is not shut down)
        futures = [pool.submit(guarded, t) for t in tasks]
        errors = []
        for f in futures:  # waits for every task, so that nothing runs on once this returns
            errors.append(f.exception())
            advance(total=len(tasks))
    first = next((e for e in errors if e is not None), None)
    if first is not None:
        raise first
    return [f.result() for f in futures]


def _copy_pieces(pieces: list[_Piece], flat: dict[str, torch.Tensor], buf: torch.Tensor, staging: ThreadStaging, *,
                 into_buffer: bool) -> set[Any]:
    """Copy each piece between its tensor slice and its place in the staging BUF (INTO_BUFFER: tensor
    -> buffer, else buffer -> tensor); CUDA pieces go on this thread's stream for their device,
    asynchronously. Returns the streams used: the caller synchronizes them before reusing BUF."""
    used: set[Any] = set()
    for p in pieces:
        tensor, place = flat[p.entry.key][p.lo:p.hi], buf[p.at:p.at + p.hi - p.lo]
        dst, src = (place, tensor) if into_buffer else (tensor, place)
        # cuda-only: chunk copies overlapped on side streams were measured on CUDA; other back ends copy synchronously
        if tensor.device.type == "cuda":
            s = staging.stream(tensor.device)
            used.add(s)
            with torch.cuda.stream(s):  # cuda-only: the side streams are made for CUDA pieces only (above)
                dst.copy_(src, non_blocking=True)
        else:
            dst.copy_(src)
    return used


def _settle(devices: set[torch.device], chunk: int) -> ThreadStaging | None:
    """Wait for every device's queued work, and make the staging buffers (pinned where CUDA copies from them)."""
    for dev in devices:
        device_module(dev.type).synchronize(dev)
    return ThreadStaging(chunk, pinned=any(d.type == "cuda" for d in devices)) if devices else None


def write_data(sink: Sink, data_offset: int, entries: Sequence[TensorEntry], tensors: dict[str, torch.Tensor],
               data_bytes: int, chunk: int, *, workers: int | None = None) -> list[str]:
    """Write every tensor's bytes at DATA_OFFSET + its offset; return each chunk's CRC-32 as hex."""
    flat = {e.key: byte_view(tensors[e.key]) for e in entries if e.nbytes}
    # producers of these tensors have finished before any side stream reads them
    staging = _settle(accelerators(flat.values()), chunk)

    def task(c0: int, c1: int, pieces: list[_Piece]) -> str:
        if staging is None:  # all on the CPU: write straight from the tensors' memory
            crc = 0
            for p in pieces:
                view = flat[p.entry.key][p.lo:p.hi].numpy()
                crc = crc32(view, crc)
                sink.pwrite(view, data_offset + c0 + p.at)
            return f"{crc:08x}"
        buf = staging.buffer()
        for s in _copy_pieces(pieces, flat, buf, staging, into_buffer=True):
            s.synchronize()
        view = buf[:c1 - c0].numpy()
        sink.pwrite(view, data_offset + c0)
        return f"{crc32(view):08x}"

    tasks = [partial(task, c0, c1, p) for _, c0, c1, p in _chunks(entries, data_bytes, chunk)]
    return _run(tasks, workers or default_workers(data_bytes))


def write_region(sink: Sink, data_offset: int, slabs: Sequence[torch.Tensor], data_bytes: int, chunk: int, *,
                 workers: int | None = None) -> list[str]:
    """Write a data region already laid out in host memory (SLABS: equal-sized uint8 buffers, back to
    back; one slab, or slabs whose size is a multiple of CHUNK so that no chunk spans two) at DATA_OFFSET;
    return each chunk's CRC-32 as hex. What a background save writes from its staging copy."""
    size = slabs[0].numel() if slabs else 1
    if len(slabs) > 1 and size % chunk:
        raise ValueError(f"staging slabs of {size} bytes are not a multiple of the {chunk}-byte chunk")

    def task(c0: int, c1: int) -> str:
        slab, at = slabs[c0 // size], c0 % size
        view = slab[at:at + c1 - c0].numpy()
        sink.pwrite(view, data_offset + c0)
        return f"{crc32(view):08x}"

    tasks = [partial(task, c0, min(c0 + chunk, data_bytes)) for c0 in range(0, data_bytes, chunk)]
    return _run(tasks, workers or default_workers(data_bytes))


def _pread_into(fd: int, view: Any, offset: int, path: Path, crc: int = 0) -> int:
    """Fill VIEW from the file at OFFSET, in pieces of at most READ_BYTES, each checksummed right after
    it is read; return the CRC-32 of VIEW continued from CRC."""
    mv = memoryview(view).cast("B")
    for lo in range(0, len(mv), READ_BYTES):
        piece = mv[lo:lo + READ_BYTES]
        done = 0
        while done < len(piece):
            n = os.preadv(fd, [piece[done:]], offset + lo + done)
            if n == 0:
                raise CheckpointError(f"{path} ended early while reading (at byte {offset + lo + done}): the file "
                                      f"was truncated while it was being read. {DAMAGED_FIX}")
            done += n
        crc = crc32(piece, crc)
    return crc


def _check(path: Path, crcs: list[str] | None, k: int, c0: int, c1: int, crc: int, pieces: list[_Piece]) -> None:
    if crcs is None or crcs[k] == f"{crc:08x}":
        return
    keys = sorted({p.entry.key for p in pieces})
    named = ", ".join(keys[:5]) + (f" and {len(keys) - 5} more" if len(keys) > 5 else "")
    raise CheckpointError(f"{path} is damaged: data bytes {c0}-{c1} fail their checksum (recorded {crcs[k]}, "
                          f"computed {crc:08x}); they hold tensor(s) {named}. {DAMAGED_FIX}")


def _checksums(header: Header) -> tuple[list[str] | None, int]:
    """(the CRC list or None, the chunk size) of a validated header. A chunk never exceeds the data,
    so staging buffers stay within the file's size whatever chunk size the header declares."""
    meta = header.meta or {}
    chunk = meta.get("chunk_bytes") or CHUNK_BYTES
    return meta.get("crc32"), max(1, min(chunk, header.data_bytes))


def allocate(header: Header, devices: dict[str, torch.device]) -> dict[str, torch.Tensor]:
    """Empty tensors for every entry, each on its target device."""
    cpu = torch.device("cpu")
    return {e.key: torch.empty(e.shape, dtype=e.dtype, device=devices.get(e.key, cpu)) for e in header.entries}


def read_data(fd: int, header: Header, out: dict[str, torch.Tensor], *, workers: int | None = None) -> None:
    """Fill OUT (freshly made by `allocate`) from the file, checking every chunk's CRC (when the file
    has them, as torchplace's do); a chunk that fails raises CheckpointError and OUT must then be
    dropped (the callers do: nothing of a damaged file is returned).

    CUDA targets go through `read_chunks_to_cuda` (reader threads fill pinned windows, the calling thread
    checks each chunk and queues the copies); other accelerators copy synchronously from a pinned staging chunk; CPU
    targets are read straight into their memory."""
    crcs, chunk = _checksums(header)
    flat = {e.key: byte_view(out[e.key]) for e in header.entries if e.nbytes}
    # memory handed out for OUT may still be in use by queued kernels of any stream
    devices = accelerators(flat.values())
    staging = _settle(devices, chunk)  # its buffers are made only when a thread first asks for one
    path, base = header.path, header.data_offset

    def task(k: int, c0: int, c1: int, pieces: list[_Piece]) -> None:
        if all(flat[p.entry.key].device.type == "cpu" for p in pieces):  # straight into the tensors' memory
            crc = 0
            for p in pieces:
                crc = _pread_into(fd, flat[p.entry.key][p.lo:p.hi].numpy(), base + c0 + p.at, path, crc)
            _check(path, crcs, k, c0, c1, crc, pieces)
            return
        assert staging is not None  # an accelerator other than CUDA: through a pinned chunk, copied synchronously
        buf = staging.buffer()
        crc = _pread_into(fd, buf[:c1 - c0].numpy(), base + c0, path)
        _check(path, crcs, k, c0, c1, crc, pieces)
        for s in _copy_pieces(pieces, flat, buf, staging, into_buffer=False):
            s.synchronize()

    def read_piece(at: int, view: Any) -> int:
        return _pread_into(fd, view, base + at, path)

    def check(c: Chunk, crc: int) -> None:
        _check(path, crcs, c[0], c[1], c[2], crc, c[3])

    chunks = list(_chunks(header.entries, header.data_bytes, chunk))
    n = workers or load_workers(header.data_bytes)
    if devices and all(d.type == "cuda" for d in devices):
        read_chunks_to_cuda(flat, header.entries, chunks, chunk, n, read_piece, check)
    else:
        _run([partial(task, *c) for c in chunks], n, keep=True)


# -- loads onto CUDA devices at memory speed: reader threads fill pinned windows, one thread copies --
# Reading a file into pinned memory and checksumming it scale with threads (on an H200 host, 16
# threads read the page cache at 74 GB/s with CRC-32). What does not scale is Python handing out
# work: with a copy and an event per 8 MiB piece queued by one thread while 8-16 readers ran, that
# thread waited for the GIL 150-300 us per piece, and a 10 GiB load ran at 21-33 GB/s (measured
# 2026-12-01, docs/results/experiments). So the data region is read in windows, a ring of them in
# RING_BYTES of pinned memory: threads fill the next windows (one task per piece of at most
# TASK_BYTES; a chunk's CRC-32 is put together from its pieces') while the calling thread checks the
# chunks of the window read first and queues its copies, one per tensor overlapping it, on one stream
# per device. A load smaller than the ring is cut in at least MIN_WINDOWS windows, so that its first
# read and last copy are short and every reader has work. Against the earlier ring (two 128 MiB
# windows, one task per 16 MiB chunk), in the same run on an H200 host (2026-12-02,
# docs/results/experiments/load-engine-h200x1-2026-12-02-s7.txt), this one read 10 GiB onto the GPU at
# 34.0 GB/s against 25.4, the Llama-style layout (3.3 GiB) at 27.9 against 22.7, 1 GiB at 25.6 against
# 21.7 (medians); 4 MiB tasks were no faster than 8, 16 MiB ones slower, 128 MiB windows, 512 MiB rings
# and 16 threads slower.
# Registering the file's own page-cache pages for DMA instead (cudaHostRegister, read-only: no CPU
# copy) was measured and left out: registration ran at 26-43 GB/s alone whatever the threads, and at 17
# GB/s beside a running DMA, so a load through registered pages (CRC beside it) ran at 14-18 GB/s.

WINDOW_BYTES = 64 * 2**20  # the largest window
RING_BYTES = 256 * 2**20  # the ring's pinned memory (at least two windows are made)
MIN_WINDOWS = 8  # a load smaller than the ring is cut in at least this many windows (of whole chunks)
TASK_BYTES = 8 * 2**20  # one reader task: read and checksum this much (within one chunk)


def _ring(data_bytes: int, chunk_bytes: int) -> tuple[int, int]:
    """(chunks a window, windows in the ring) for a load of DATA_BYTES in chunks of CHUNK_BYTES."""
    window = min(WINDOW_BYTES, -(-data_bytes // MIN_WINDOWS))
    per_window = max(1, window // chunk_bytes)
    return per_window, max(2, RING_BYTES // (per_window * chunk_bytes))


def task_bytes(chunk_bytes: int) -> int:
    """The bytes one reader task reads: a whole chunk where the CRC-32 of pieces cannot be combined
    (zlib's crc32 without ISA-L's crc32_combine), else at most TASK_BYTES."""
    return chunk_bytes if crc32_combine is None else max(1, min(chunk_bytes, TASK_BYTES))


def read_chunks_to_cuda(flat: dict[str, torch.Tensor], entries: Sequence[TensorEntry], chunks: Sequence[Chunk],
                        chunk_bytes: int, workers: int, read_piece: Callable[[int, Any], int],
                        check: Callable[[Chunk, int], None]) -> None:
    """Fill FLAT's tensors (byte views of CUDA or CPU tensors, keyed like ENTRIES) from the data region
    cut into CHUNKS. READ_PIECE(at, view) reads the bytes at data offset AT into VIEW and returns their
    CRC-32; CHECK(chunk, crc) raises when a chunk's CRC-32 is not the recorded one. Every chunk is
    checked before its bytes are copied. Returns once every copy has completed (the last window's
    copies are waited for: about 2 ms); on the first failure it cancels the reads not yet started, waits
    for those running (their buffers are not given back under them) and raises that error."""
    per_window, nbuf = _ring(chunks[-1][2] if chunks else 0, chunk_bytes)
    windows = [chunks[i:i + per_window] for i in range(0, len(chunks), per_window)]
    size = max(w[-1][2] - w[0][1] for w in windows)
    pin = any(t.device.type == "cuda" for t in flat.values())  # (tests run the windows with CPU tensors)
    nbuf = min(nbuf, len(windows))
    arena = host_buffer(size * nbuf, pin)  # one block: the pinned-memory cache keeps one size
    bufs = [arena[i * size:(i + 1) * size] for i in range(nbuf)]
    done: list[list[Any]] = [[] for _ in bufs]  # events marking each buffer's copies done
    streams = SideStreams()  # the caller synchronized the devices, so new streams need no ordering
    order = sorted((e for e in entries if e.nbytes), key=lambda e: e.start)
    ends = [e.end for e in order]  # sorted too: entries do not overlap
    step = task_bytes(chunk_bytes)

    submitted: list[Future[int]] = []  # every read queued: on a failure, none may run on once this returns

    def fill(w: int) -> list[list[Future[int]]]:
        """Queue the reads of window W into its buffer: for each chunk, the futures of its pieces' CRCs."""
        buf, w0 = bufs[w % nbuf], windows[w][0][1]
        for event in done[w % nbuf]:  # the buffer's previous copies must be done before it is overwritten
            event.synchronize()
        done[w % nbuf] = []
        reads = []
        for _, c0, c1, _ in windows[w]:
            reads.append([pool.submit(read_piece, at, buf[at - w0:min(at + step, c1) - w0].numpy())
                          for at in range(c0, c1, step)])
            submitted.extend(reads[-1])
        return reads

    pool = kept_pool(workers, "torchplace-load")  # threads kept between loads (starting 12 costs ~1.3 ms)
    failed = False
    try:
        # windows being read but not yet copied, in order: up to NBUF - 1 ahead of the one copied
        queued: list[list[list[Future[int]]]] = [fill(w) for w in range(nbuf - 1)]
        for w in range(len(windows)):
            if w + nbuf - 1 < len(windows):  # queued before waiting, so that the readers never run dry
                queued.append(fill(w + nbuf - 1))  # (into the buffer copied last round, once copied)
            for c, pieces in zip(windows[w], queued.pop(0)):
                check(c, _combined([f.result() for f in pieces], c[2] - c[1], step))
            done[w % nbuf] = _copy_window(bufs[w % nbuf], windows[w][0][1], windows[w][-1][2], order, ends,
                                          flat, streams)
            advance(len(windows[w]), total=len(chunks))
    except BaseException:
        failed = True
        # reads not started are cancelled; those running finish before their buffers go back
        wait([f for f in submitted if not f.cancel()])
        raise
    finally:
        for e in (e for events in done for e in events):  # the copies complete before the buffers go back
            try:
                e.synchronize()
            except Exception:
                if not failed:  # while another error propagates, it is the one to report
                    raise


def _combined(crcs: list[int], nbytes: int, step: int) -> int:
    """The CRC-32 of NBYTES read in pieces of STEP bytes (the last one shorter) whose CRCs are CRCS."""
    crc = crcs[0]
    for i, piece in enumerate(crcs[1:], 1):
        assert crc32_combine is not None  # pieces shorter than a chunk only where CRCs combine (task_bytes)
        crc = crc32_combine(crc, piece, min(step, nbytes - i * step))
    return crc


def _copy_window(buf: torch.Tensor, w0: int, w1: int, order: Sequence[TensorEntry], ends: list[int],
                 flat: dict[str, torch.Tensor], streams: SideStreams) -> list[Any]:
    """Queue one copy per tensor overlapping the data range [W0, W1) held in BUF (ORDER: the entries
    sorted by start, ENDS their ends); return the events that mark the copies done (CPU tensors are
    copied at once)."""
    copies: dict[torch.device, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    for e in order[bisect.bisect_right(ends, w0):]:
        if e.start >= w1:
            break
        lo, hi = max(e.start, w0), min(e.end, w1)
        tensor, src = flat[e.key][lo - e.start:hi - e.start], buf[lo - w0:hi - w0]
        if tensor.device.type != "cuda":
            tensor.copy_(src)
        else:
            copies.setdefault(tensor.device, []).append((tensor, src))
    used = []
    for device, pairs in copies.items():  # the stream entered once a device, not once a tensor (~20 us each)
        s = streams(device)
        with torch.cuda.stream(s):  # cuda-only: the copies queue on the CUDA stream made above
            for tensor, src in pairs:
                tensor.copy_(src, non_blocking=True)
        used.append(s)
    return done_events(used)


def verify_data(fd: int, header: Header, *, workers: int | None = None) -> None:
    """Check every chunk's CRC without keeping the data (for `torchplace ckpt inspect --verify`)."""
    crcs, chunk = _checksums(header)
    if not crcs:
        return
    local = threading.local()

    def task(k: int, c0: int, c1: int, pieces: list[_Piece]) -> None:
        buf = getattr(local, "buf", None)
        if buf is None:
            buf = local.buf = bytearray(chunk)
        crc = _pread_into(fd, memoryview(buf)[:c1 - c0], header.data_offset + c0, header.path)
        _check(header.path, crcs, k, c0, c1, crc, pieces)

    _run([partial(task, k, c0, c1, p) for k, c0, c1, p in _chunks(header.entries, header.data_bytes, chunk)],
         workers or load_workers(header.data_bytes), keep=True)

