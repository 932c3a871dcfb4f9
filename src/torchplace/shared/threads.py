"""How many helper threads a job starts: the core count and the rule the checkpoint streams and the
loader's packing copies share (each caps it by what its job measured best); and the pools kept
between loads so that a load does not pay for starting its threads."""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any


def cores() -> int:
    """The CPUs this process may run on (its affinity mask; the machine's count where there is none)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def helper_threads(nbytes: int, most: int, *, least_bytes: int) -> int:
    """Threads for a job of NBYTES: one below LEAST_BYTES (starting threads would cost more than they
    save), else one a core, at most MOST."""
    return 1 if nbytes < least_bytes else max(1, min(most, cores()))


class KeptPool(Executor):
    """A pool of daemon threads kept between jobs (a load's readers): starting 12 threads costs about
    1.3 ms, a kept pool runs 12 tasks in 0.25-0.6 ms (an H200 host, 2026-12-02). Its threads start on
    first use, never block the interpreter's exit (daemon: an idle one waits on its queue) and hold
    nothing between tasks; a forked child gets new pools (`kept_pool`), never its parent's threads."""

    def __init__(self, workers: int, name: str) -> None:
        self._workers, self._name = workers, name
        self._queue: queue.SimpleQueue[tuple[Future[Any], Callable[..., Any], tuple[Any, ...], dict[str, Any]]] = \
            queue.SimpleQueue()
        self._started = 0
        self._lock = threading.Lock()

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        future: Future[Any] = Future()
        if self._started < self._workers:
            with self._lock:
                while self._started < self._workers:
                    self._started += 1
                    threading.Thread(target=self._work, name=f"{self._name}-{self._started}", daemon=True).start()
        self._queue.put((future, fn, args, kwargs))
        return future

    def _work(self) -> None:
        while True:
            future, fn, args, kwargs = self._queue.get()
            result = error = None
            if future.set_running_or_notify_cancel():
                try:
                    result = fn(*args, **kwargs)
                except BaseException as exc:  # noqa: BLE001 - handed to the waiting caller, as an executor does
                    error = exc
            # Let go of the job before answering: what the caller handed in (a pinned staging
            # buffer) is then freed by the caller's thread, never by this one after the answer.
            del fn, args, kwargs
            if error is not None:
                future.set_exception(error)
            elif future.running():
                future.set_result(result)
            del future, result, error  # hold nothing of a finished job while idle

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Kept pools are not shut down: `with kept_pool(n) as pool:` leaves the threads for the next job."""


_kept: dict[tuple[str, int], KeptPool] = {}
_kept_lock = threading.Lock()


def kept_pool(workers: int, name: str) -> KeptPool:
    """The process's kept pool of WORKERS threads named NAME (made on first use)."""
    pool = _kept.get((name, workers))
    if pool is None:
        with _kept_lock:
            pool = _kept.setdefault((name, workers), KeptPool(workers, name))
    return pool


def _forget_pools_after_fork() -> None:
    """In a forked child: the parent's pool threads are not here; its locks may have been held at the fork."""
    global _kept_lock
    _kept.clear()
    _kept_lock = threading.Lock()


if hasattr(os, "register_at_fork"):  # POSIX
    os.register_at_fork(after_in_child=_forget_pools_after_fork)
