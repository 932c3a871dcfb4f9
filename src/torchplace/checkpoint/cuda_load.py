"""Loads onto CUDA devices at memory speed: reader threads fill pinned windows, one thread copies.

Reading a file into pinned memory and checksumming it scale with threads (on an H200 host, 16
threads read the page cache at 74 GB/s with CRC-32). What does not scale is Python handing out
work: with a copy and an event per 8 MiB piece queued by one thread while 8-16 readers ran, that
thread waited for the GIL 150-300 us per piece, and a 10 GiB load ran at 21-33 GB/s (measured
2026-12-01, docs/results/experiments). So the data region is read in windows of WINDOW_BYTES, a
ring of BUFFERS of them: threads fill the next windows (one task per checksum chunk) while the
calling thread queues the copies of the window read first, one per tensor overlapping it, on one
stream per device. Two buffers: rings of 3-8 windows of 32-256 MiB with 8-16 threads loaded
10 GiB at 17-31 GB/s, no faster, and pin more memory (H200 host, 2026-12-01, docs/results/experiments).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from ..progress import advance
from .format import TensorEntry
from .stream import Chunk

WINDOW_BYTES = 128 * 2**20  # one pinned buffer; BUFFERS of them: windows being copied and being read
BUFFERS = 2


def read_chunks_to_cuda(flat: dict[str, torch.Tensor], entries: Sequence[TensorEntry], chunks: Sequence[Chunk],
                        chunk_bytes: int, workers: int,
                        read_chunk: Callable[[Chunk, Any], None]) -> None:
    """Fill FLAT's tensors (byte views of CUDA or CPU tensors, keyed like ENTRIES) from the data region
    cut into CHUNKS. READ_CHUNK(chunk, view) reads one chunk's bytes into VIEW and checks its CRC.
    Returns once every copy has completed (the last window's copies are waited for: about 2 ms); on the
    first failed read it cancels the reads not yet started and raises that error."""
    per_window = max(1, WINDOW_BYTES // chunk_bytes)
    windows = [chunks[i:i + per_window] for i in range(0, len(chunks), per_window)]
    size = max(w[-1][2] - w[0][1] for w in windows)
    pin = any(t.device.type == "cuda" for t in flat.values())  # (tests run the windows with CPU tensors)
    nbuf = min(BUFFERS, len(windows))
    bufs = [torch.empty(size, dtype=torch.uint8, pin_memory=pin) for _ in range(nbuf)]
    done: list[list[Any]] = [[] for _ in bufs]  # events marking each buffer's copies done
    streams: dict[torch.device, Any] = {}
    order = sorted((e for e in entries if e.nbytes), key=lambda e: e.start)
    ends = [e.end for e in order]  # sorted too: entries do not overlap

    def fill(w: int, pool: ThreadPoolExecutor) -> list[Future[None]]:
        buf, w0 = bufs[w % nbuf], windows[w][0][1]
        for event in done[w % nbuf]:  # the buffer's previous copies must be done before it is overwritten
            event.synchronize()
        done[w % nbuf] = []
        return [pool.submit(read_chunk, c, buf[c[1] - w0:c[2] - w0].numpy()) for c in windows[w]]

    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="torchplace-load") as pool:
        # windows being read but not yet copied, in order: up to NBUF - 1 ahead of the one copied
        queued: list[list[Future[None]]] = [fill(w, pool) for w in range(nbuf - 1)]
        failed = False
        try:
            for w in range(len(windows)):
                if w + nbuf - 1 < len(windows):  # queued before waiting, so that the readers never run dry
                    queued.append(fill(w + nbuf - 1, pool))  # (into the buffer copied last round, once copied)
                for f in queued.pop(0):
                    f.result()
                done[w % nbuf] = _copy_window(bufs[w % nbuf], windows[w][0][1], windows[w][-1][2], order, ends,
                                              flat, streams)
                advance(len(windows[w]), total=len(chunks))
        except BaseException:
            failed = True
            for f in (f for futures in queued for f in futures):  # reads not started yet are not started
                f.cancel()
            raise
        finally:
            for e in (e for events in done for e in events):  # the copies complete before the buffers go back
                try:
                    e.synchronize()
                except Exception:
                    if not failed:  # while another error propagates, it is the one to report
                        raise


def _copy_window(buf: torch.Tensor, w0: int, w1: int, order: Sequence[TensorEntry], ends: list[int],
                 flat: dict[str, torch.Tensor], streams: dict[torch.device, Any]) -> list[Any]:
    """Queue one copy per tensor overlapping the data range [W0, W1) held in BUF (ORDER: the entries
    sorted by start, ENDS their ends); return the events that mark the copies done (CPU tensors are
    copied at once)."""
    used = set()
    for e in order[bisect.bisect_right(ends, w0):]:
        if e.start >= w1:
            break
        lo, hi = max(e.start, w0), min(e.end, w1)
        tensor, src = flat[e.key][lo - e.start:hi - e.start], buf[lo - w0:hi - w0]
        if tensor.device.type != "cuda":
            tensor.copy_(src)
            continue
        s = streams.get(tensor.device)
        if s is None:  # the caller synchronized the device, so a new stream needs no ordering
            s = streams[tensor.device] = torch.cuda.Stream(device=tensor.device)  # cuda-only: CUDA tensors only
        with torch.cuda.stream(s):  # cuda-only: the copy queues on the CUDA stream made above
            tensor.copy_(src, non_blocking=True)
        used.add(s)
    events = [torch.cuda.Event() for _ in used]  # cuda-only: events of the CUDA streams used above
    for event, s in zip(events, used):
        event.record(s)
    return events
