"""Host memcpy for packing, spread over a few helper threads.

Packing 4 MiB of small tensors is a memcpy that one core does at 10-25 GB/s (160-400 µs),
as long as a whole step of many small copies. torch releases the GIL while it copies, so a
few helper threads copy in parallel while the DeviceLoader's worker thread does its Python
work (device views, rebuilding the batch) at the same time. Small packs are copied inline.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from concurrent.futures import Future

import torch

from ..errors import PackingError
from ..shared.threads import cores, kept_pool
from . import _pack

PARALLEL_BYTES = 1 << 20  # below this, handing the copy to helpers costs more than it saves
CHUNK_BYTES = 256 << 10  # the least each helper gets


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

    NBYTES are the sizes of the copies, used to share the work out evenly. The copies run in the
    process's kept helper threads (shared/threads.py: a forked child gets its own) when they are
    large enough and helpers exist, else here and now.
    """
    total = sum(nbytes)
    helpers = threads() if total >= PARALLEL_BYTES else 0
    parts = min(helpers, total // CHUNK_BYTES)
    if parts < 1:
        _pack.copy(dst, src)
        return _nothing
    pool = kept_pool(helpers, "torchplace-copy")
    copies: list[Future[None]] = []
    begin, acc, last = 0, 0, len(nbytes) - 1
    for i, size in enumerate(nbytes):
        acc += size
        if len(copies) + 1 < parts and i < last and acc >= total * (len(copies) + 1) / parts:
            copies.append(pool.submit(_pack.copy, dst[begin:i + 1], src[begin:i + 1]))
            begin = i + 1
    copies.append(pool.submit(_pack.copy, dst[begin:], src[begin:]))

    def wait() -> None:
        errors = [copy.exception() for copy in copies]  # every copy ends before the buffers may be reused
        error = next((e for e in errors if e is not None), None)
        if error is not None:
            raise error

    return wait


def _nothing() -> None:
    return None
