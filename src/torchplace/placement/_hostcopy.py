"""Host memcpy for packing, spread over a few helper threads.

Packing 4 MiB of small tensors is a memcpy that one core does at 10-25 GB/s (160-400 µs),
as long as a whole step of many small copies. torch releases the GIL while it copies, so a
few helper threads copy in parallel while the DeviceLoader's worker thread does its Python
work (device views, rebuilding the batch) at the same time. Small packs are copied inline.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable, Sequence

import torch

from ..errors import PackingError
from ..shared.threads import cores
from . import _pack

PARALLEL_BYTES = 1 << 20  # below this, handing the copy to helpers costs more than it saves
CHUNK_BYTES = 256 << 10  # the least each helper gets
_lock = threading.Lock()
_jobs: queue.SimpleQueue | None = None
_helpers = 0
_pid = 0  # the process that started the helpers (a forked child has none and starts its own)


MAX_THREADS = 64  # a forced count above this would only start threads that wait for the same cores


def threads() -> int:
    """Helper threads to use: a quarter of this process's cores, at most 3 (0 on small machines).

    TORCHPLACE_COPY_THREADS=N overrides it (0: pack on the loader's worker thread alone; at most
    MAX_THREADS); a value that is no such number raises PackingError naming it.
    """
    forced = os.environ.get("TORCHPLACE_COPY_THREADS", "").strip()
    if forced:
        if not (forced.isascii() and forced.isdigit()) or int(forced) > MAX_THREADS:
            raise PackingError(f"TORCHPLACE_COPY_THREADS={forced[:40]!r}: the number of helper threads that copy a "
                               f"batch's small tensors must be a whole number from 0 to {MAX_THREADS}. Fix: set it "
                               "to such a number (0 copies on the loader's thread alone), or unset it for the "
                               "default (a quarter of the cores, at most 3).")
        return int(forced)
    return min(3, cores() // 4)


def start(dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor], nbytes: Sequence[int]) -> Callable[[], None]:
    """Begin dst[i].copy_(src[i]) for all i (host tensors); return the function that waits for it.

    NBYTES are the sizes of the copies, used to share the work out evenly. The copies run in
    helper threads when they are large enough and helpers exist, else here and now.
    """
    total = sum(nbytes)
    parts = min(_pool(), total // CHUNK_BYTES) if total >= PARALLEL_BYTES else 0
    if parts < 1:
        _pack.copy(dst, src)
        return _nothing
    done: queue.SimpleQueue = queue.SimpleQueue()
    jobs = _jobs
    assert jobs is not None
    begin, acc, k, last = 0, 0, 1, len(nbytes) - 1
    for i, size in enumerate(nbytes):
        acc += size
        if k < parts and i < last and acc >= total * k / parts:
            jobs.put((dst[begin:i + 1], src[begin:i + 1], done))
            begin, k = i + 1, k + 1
    jobs.put((dst[begin:], src[begin:], done))

    def wait() -> None:
        error = None
        for _ in range(k):
            result = done.get()
            if result is not None and error is None:
                error = result
        if error is not None:
            raise error

    return wait


def _nothing() -> None:
    return None


def _pool() -> int:
    """Start the helper threads once per process (daemons: they never hold up exit)."""
    global _jobs, _helpers, _pid
    if _pid != os.getpid():
        with _lock:
            if _pid != os.getpid():
                jobs: queue.SimpleQueue = queue.SimpleQueue()
                n = threads()
                for i in range(n):
                    threading.Thread(target=_helper, args=(jobs,), name=f"torchplace-copy-{i}", daemon=True).start()
                _helpers, _jobs, _pid = n, jobs, os.getpid()
    return _helpers


def _helper(jobs: queue.SimpleQueue) -> None:
    """Copy the jobs handed in until a None arrives (the process's pool never gets one)."""
    while True:
        job = jobs.get()
        if job is None:
            return
        dst, src, done = job
        result = None
        try:
            _pack.copy(dst, src)
        except BaseException as exc:  # handed to the waiting worker, raised there
            result = exc
        del dst, src  # before answering: the staging buffer is only ever freed by the worker
        done.put(result)
        del done, result
