"""Health checks and straggler reports for a group made by torchplace.dist.init().

Both collect from every rank through the rendezvous store, whose waits have deadlines, so a
stuck or dead rank is named instead of hanging the others (a gloo monitored barrier alone
hangs its non-zero ranks when rank 0 is the one stuck: measured with torch 2.13).
"""

from __future__ import annotations

import datetime as _dt
import json
import re
import socket
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..errors import DistributedError
from .failures import explain
from .group_state import STATE, require, seconds


@dataclass(frozen=True)
class HealthReport:
    """A passed health check: every rank answered and an all-reduce on `device` was right.

    Attributes:
        world_size: the ranks that answered (all of them).
        device: the device the all-reduce ran on.
        backend: the backend that carried it.
        elapsed_s: seconds the whole check took.

    Example:
        ```python
        import torchplace as tp

        with tp.dist.session():
            report = tp.dist.health_check(timeout=30)
            print(report.world_size, report.device, f"{report.elapsed_s:.3f} s")
        ```
    """

    world_size: int
    device: str
    backend: str
    elapsed_s: float


@dataclass(frozen=True)
class StragglerReport:
    """Every rank's step time and the ranks slower than `threshold` x the median.

    Attributes:
        step_times_s: one step time per rank, in seconds, by rank.
        median_s: their median.
        slow_ranks: the ranks whose time exceeds `threshold` x the median.
        threshold: the factor used.
        hosts: each rank's host name, by rank.

    `imbalance` is the slowest time over the median (1.0: perfectly balanced).

    Example:
        ```python
        import torchplace as tp

        with tp.dist.session():
            report = tp.dist.stragglers(0.25)
            print(report.slow_ranks, report.imbalance)
        ```
    """

    step_times_s: list[float]
    median_s: float
    slow_ranks: list[int]
    threshold: float
    hosts: list[str] = field(default_factory=list)

    @property
    def imbalance(self) -> float:
        """Slowest / median step time (1.0 = perfectly balanced)."""
        return max(self.step_times_s) / self.median_s if self.median_s > 0 else float("nan")

    def describe(self) -> str:
        """One sentence for a log: the spread, or the slow ranks and what to do about them."""
        if not self.slow_ranks and len(self.step_times_s) == 1:
            return f"No straggler: one rank, step time {self.step_times_s[0]:.4g} s (nothing to compare with)."
        if not self.slow_ranks:
            return (f"No straggler: step times {min(self.step_times_s):.4g}-{max(self.step_times_s):.4g} s "
                    f"across {len(self.step_times_s)} ranks (median {self.median_s:.4g} s).")
        slow = ", ".join(f"rank {r} ({self.step_times_s[r]:.4g} s"
                         + (f" on {self.hosts[r]}" if self.hosts else "") + ")" for r in self.slow_ranks)
        return (f"{len(self.slow_ranks)} straggler(s) slower than {self.threshold:g}x the median "
                f"{self.median_s:.4g} s: {slow}. The others wait for them at every synchronization; "
                "give them less work, or look for a slow GPU, data loader or host.")


def _gather_on_store(tag: str, payload: str, timeout_s: float, rank0_share: float = 1.0
                     ) -> tuple[list[str] | None, list[int]]:
    """Every rank posts `payload`; rank 0 collects them and publishes the list (or who is missing).

    Returns (payloads by rank, []) or (None, missing ranks). Store operations have timeouts, so
    this never hangs: rank 0 waits `rank0_share` x `timeout_s` for the others, the others wait
    `timeout_s` for rank 0's answer and name rank 0 when it gives none.
    """
    me = require()
    store = STATE.store
    prefix = f"{tag}/"
    try:
        store.set(f"{prefix}in/{me.rank}", payload)
    except RuntimeError:  # the store went away: torchrun's agent or rank 0 is gone
        return None, [0]
    keys = [f"{prefix}in/{r}" for r in range(me.world_size)]
    if me.rank == 0:
        try:
            store.wait(keys, _dt.timedelta(seconds=timeout_s * rank0_share))
        except RuntimeError:
            missing = [r for r in range(me.world_size) if not store.check([keys[r]])]
            store.set(f"{prefix}out", json.dumps({"missing": missing}))
            return None, missing
        values = [v.decode() for v in store.multi_get(keys)]
        store.set(f"{prefix}out", json.dumps({"values": values}))
        return values, []
    try:
        store.wait([f"{prefix}out"], _dt.timedelta(seconds=timeout_s))
        answer = json.loads(store.get(f"{prefix}out"))
    except RuntimeError:  # rank 0 never answered (or its store is gone with it)
        return None, [0]
    if "missing" in answer:
        return None, answer["missing"]
    return answer["values"], []


def gather_text(tag: str, text: str, timeout: float = 60.0) -> list[str]:
    """Every rank's TEXT, by rank, on every rank (call it on every rank, in the same order).

    Through the rendezvous store, off the device streams, with a deadline: a rank that does not
    post within `timeout` is named in the DistributedError. For small facts (a file name, a host),
    not for data.
    """
    me = require()
    STATE.checks += 1
    rows, missing = _gather_on_store(f"{tag}/{STATE.checks}", text, timeout)
    if rows is None:
        raise DistributedError(
            f"rank {me.rank}: {', '.join(f'rank {r}' for r in missing)} did not post {tag!r} within "
            f"{timeout:.0f} s. Fix: run the same steps on every rank; if one is stuck, health_check() names it.")
    return rows


def health_check(timeout: float | _dt.timedelta = 60.0) -> HealthReport:
    """Check that every rank answers and that an all-reduce on the device gives the right sum.

    Call it on every rank. Ranks that do not arrive within `timeout` (stuck, dead, or busy in
    another collective) are named, and every rank that did arrive raises `DistributedError` with
    those names within `timeout` instead of hanging. Arrival is checked through the rendezvous
    store (whose waits have deadlines even when rank 0 is the one stuck), then by a gloo monitored
    barrier, then an all-reduce on this rank's device (NCCL on GPUs) must sum to WORLD_SIZE in the
    time left.

    Args:
        timeout: seconds (or a timedelta) for the whole check.

    Returns:
        A `HealthReport`.

    Raises:
        DistributedError: a rank did not answer in time (named), the all-reduce gave a wrong sum,
            or `init()` has not run.

    Example:
        ```python
        import torchplace as tp

        tp.dist.init()
        print(tp.dist.health_check(timeout=60))
        tp.dist.teardown()
        ```
    """
    me = require()
    total = seconds(timeout, 60.0)
    started = time.monotonic()
    STATE.checks += 1
    _, missing = _gather_on_store(f"health/{STATE.checks}", "1", total, rank0_share=0.8)
    if missing:
        STATE.broken = True
        who = ", ".join(f"rank {r}" for r in missing)
        raise DistributedError(
            f"Health check failed on rank {me.rank}: {who} did not answer within {total:.0f} s "
            f"(of WORLD_SIZE={me.world_size}). It is stuck (a hang, a deadlock, an endless data loader), "
            "dead, or waiting in another collective. Fix: look at that rank's log and stack "
            "(py-spy dump --pid ...); this rank stops here instead of hanging.")

    def left() -> float:
        return max(total - (time.monotonic() - started), 1.0)

    try:
        dist.monitored_barrier(group=STATE.gloo, timeout=_dt.timedelta(seconds=left()), wait_all_ranks=True)
    except RuntimeError as exc:
        STATE.broken = True
        m = re.search(r"Ranks? ([\d,\s]+) failed to pass monitoredBarrier", str(exc))
        who = f"rank(s) {m.group(1).strip()}" if m else "a rank"
        raise DistributedError(
            f"Health check failed on rank {me.rank}: every rank reached the check, but {who} did not pass "
            f"the gloo barrier within {total:.0f} s; the gloo transport between ranks is broken "
            f"({str(exc).splitlines()[0][:200]}). Fix: check the network interface (GLOO_SOCKET_IFNAME) "
            "and firewalls between the hosts.") from None
    value = torch.ones(1, device=me.device)
    budget = left()
    try:
        work = dist.all_reduce(value, async_op=True)
        work.wait(timeout=_dt.timedelta(seconds=budget))
    except RuntimeError as exc:
        STATE.broken = True
        better = explain(exc, STATE.launch, timeout_s=budget)
        raise (better or DistributedError(
            f"The all-reduce on {me.device} ({me.backend}) failed on rank {me.rank} after every rank passed "
            f"the gloo barrier: {str(exc).splitlines()[0][:300]}. Fix: rerun with NCCL_DEBUG=INFO.")) from exc
    got = value.item()
    if got != me.world_size:
        raise DistributedError(
            f"The all-reduce on {me.device} summed ones from {me.world_size} ranks to {got:g} on rank "
            f"{me.rank}: the {me.backend} transport corrupts data. Fix: rerun with NCCL_DEBUG=INFO; try "
            "NCCL_P2P_DISABLE=1 to rule out peer-to-peer copies.")
    return HealthReport(world_size=me.world_size, device=str(me.device), backend=me.backend,
                        elapsed_s=time.monotonic() - started)


# --------------------------------------------------------------------------- stragglers


def stragglers(step_time_s: float | Sequence[float], *, threshold: float = 1.2,
               timeout: float | _dt.timedelta = 60.0) -> StragglerReport:
    """Gather every rank's step time and name the slow ones.

    Call it on every rank; all get the same report. A rank is slow when its time exceeds
    `threshold` x the median. The numbers travel through the rendezvous store, off the GPU
    streams, with a deadline.

    Args:
        step_time_s: this rank's step time in seconds, or a list whose mean is taken.
        threshold: how many times the median makes a rank slow (default 1.2).
        timeout: seconds (or a timedelta) to wait for every rank's number.

    Returns:
        A `StragglerReport`, the same on every rank.

    Raises:
        DistributedError: a rank did not report within `timeout` (named), an empty list of
            times, a `threshold` not above 1.0, or `init()` has not run.

    Example:
        ```python
        import time
        import torchplace as tp

        with tp.dist.session():
            start = time.perf_counter()
            sum(range(10_000))  # one training step
            report = tp.dist.stragglers(time.perf_counter() - start, threshold=1.5)
            print(report.slow_ranks or "no stragglers")
        ```
    """
    me = require()
    if isinstance(step_time_s, (int, float)):
        mine = float(step_time_s)
    else:
        values = [float(v) for v in step_time_s]
        if not values:
            raise DistributedError("stragglers() got an empty list of step times. Fix: pass at least one.")
        mine = statistics.fmean(values)
    if threshold <= 1.0:
        raise DistributedError(f"threshold={threshold} must be above 1.0 (a multiple of the median).")
    STATE.checks += 1
    limit_s = seconds(timeout, 60.0)
    rows, missing = _gather_on_store(f"stragglers/{STATE.checks}",
                                     json.dumps([mine, socket.gethostname()]), limit_s)
    if rows is None:
        raise DistributedError(
            f"stragglers() on rank {me.rank}: {', '.join(f'rank {r}' for r in missing)} did not report a "
            f"step time within {limit_s:.0f} s. Fix: call stragglers() on every rank at the same point; "
            "if one is stuck, health_check() names it.")
    parsed = [json.loads(r) for r in rows]
    times = [float(p[0]) for p in parsed]
    hosts = [str(p[1]) for p in parsed]
    median = statistics.median(times)
    slow = [i for i, t in enumerate(times) if median > 0 and t > threshold * median]
    return StragglerReport(step_times_s=times, median_s=median, slow_ranks=slow, threshold=threshold, hosts=hosts)
