"""The packed-in-workers variants of `bench transfer` (issue 21), and the process CPU they cost.

`packed_collate` moves the per-tensor work of a batch of many small tensors out of the training
process into the DataLoader's workers. Two ways of measuring it sit beside `bench transfer`'s
other variants:

- "packed in workers": batches as `DataLoader(collate_fn=packed_collate(), pin_memory=True)`
  hands them over (one pinned buffer each), through DeviceLoader; made ahead, like the other
  variants' pinned batches, so the rows compare the same thing: the training process's work from
  a pinned batch to a batch on the device.
- "DataLoader, N workers": the whole way, from a real DataLoader with worker processes and
  pin_memory, plain (then `send_to_device`, as users write it) or packed (then DeviceLoader):
  what the training process pays for receiving, pinning and copying each batch. Packed twice:
  as packed_collate works by default (workers pack into slots the training process pinned in
  place, so pinning copies nothing) and with `slots=0` (a fresh shared buffer per batch, copied
  into pinned memory by the pin-memory step: the way before the slots).

`cpu_clock` adds the training process's CPU time per step (all its threads: the loader's worker
thread, the pin-memory thread, the copy helpers) to a variant, beside the wall time `measure` keeps.
The recommender batch is DLRM's shape on Criteo: 13 dense features and 26 sparse ones, each as
values (variable length) and offsets.
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

from .steps import Variant

RECSYS_BATCH = 1024  # samples per recommender batch
RECSYS_SPARSE = 26
RECSYS_DENSE = 13


def recsys_batch(seed: int, batch_size: int = RECSYS_BATCH) -> dict[str, Any]:
    """A recommender batch: dense features, 26 sparse features (values + offsets, 0-3 ids per sample), labels."""
    import torch

    g = torch.Generator().manual_seed(seed)
    sparse = {}
    for f in range(RECSYS_SPARSE):
        lengths = torch.randint(0, 4, (batch_size,), generator=g)
        offsets = torch.zeros(batch_size + 1, dtype=torch.int64)
        offsets[1:] = lengths.cumsum(0)
        sparse[f"cat_{f}"] = {"values": torch.randint(0, 1 << 20, (int(offsets[-1]),), generator=g),
                              "offsets": offsets}
    return {"dense": torch.randn(batch_size, RECSYS_DENSE, generator=g), "sparse": sparse,
            "labels": torch.randint(0, 2, (batch_size,), generator=g).float()}


class BatchSource:
    """A map-style dataset of whole batches (`batch_size=None`): fresh copies of a few stored ones.

    Each item is a new set of tensors, as a real pipeline makes, so a plain DataLoader sends new
    shared memory with every batch instead of re-sending blocks it shared once.
    """

    def __init__(self, batches: list[Any], length: int) -> None:
        self.batches, self.length = batches, length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> Any:
        from ..shared.tree import map_tensors

        return map_tensors(self.batches[i % len(self.batches)], lambda t: t.clone())


def dataloader(batches: list[Any], steps: int, workers: int, pin: bool, packed: bool, slots: int | None = None) -> Any:
    """A DataLoader of STEPS whole batches from WORKERS persistent worker processes (SLOTS: packed_collate's)."""
    from torch.utils.data import DataLoader, default_convert

    from ..placement.collate import packed_collate

    gc.collect()  # CUDA objects in garbage cycles must not be freed in the forked workers (CUDA cannot run there)
    return DataLoader(BatchSource(batches, steps), batch_size=None, num_workers=workers, pin_memory=pin,
                      persistent_workers=True, prefetch_factor=4,
                      collate_fn=packed_collate(default_convert, slots=slots) if packed else default_convert)


def premade_packed(pageable: list[Any], pin: bool) -> list[Any]:
    """The batches as a packing DataLoader hands them over: packed, and pinned by its pin-memory step."""
    from ..placement.collate import pack

    packed = [pack(b) for b in pageable]
    return [p.pin_memory() for p in packed] if pin else packed


def cpu_clock(variant: Variant, steps: int) -> Variant:
    """VARIANT, also recording this process's CPU milliseconds per step (all threads) in extra['cpu_ms'].

    A round's CPU time includes its untimed first step (the pipeline fill), spread over STEPS.
    """
    samples: list[float] = variant.extra.setdefault("cpu_ms", [])
    wall = variant.per_step_ms

    def per_step_ms(sync: Callable[[], None]) -> float:
        start = time.process_time()
        ms = wall(sync)
        samples.append((time.process_time() - start) * 1e3 / max(steps, 1))
        return ms

    variant.per_step_ms = per_step_ms  # type: ignore[method-assign]
    return variant


def paired_cpu(ours: Callable[[], Iterator[Any]], theirs: Callable[[Any], Any], items: list, rounds: int,
               sync: Callable[[], None], block: int = 20) -> float:
    """Median over ROUNDS (after one untimed) of this process's CPU time for OURS's batches / THEIRS's on
    ITEMS, in alternating blocks of BLOCK batches (which of the two goes first alternates too).

    Measured one variant after the other, the two CPU times came from different moments of the host:
    send_to_device's CPU per batch measured 481 and 652 µs in two runs of the same code on one H200
    VM. In alternating blocks both see the same moments. OURS() is a fresh iterator of len(ITEMS)
    batches (its pipeline fill untimed); THEIRS(item) moves one batch.
    """
    ratios = []
    for r in range(rounds + 1):
        it = ours()
        spent = [0.0, 0.0]
        for k in range(0, len(items), block):
            part = items[k:k + block]
            for who in ((0, 1) if (k // block) % 2 == 0 else (1, 0)):
                start = time.process_time()
                if who == 0:
                    for _ in part:
                        next(it)
                else:
                    for item in part:
                        theirs(item)
                spent[who] += time.process_time() - start
        for _ in it:  # whatever the pipeline holds beyond ITEMS: untimed
            pass
        sync()
        if r and spent[1] > 0:
            ratios.append(spent[0] / spent[1])
    return statistics.median(ratios) if ratios else float("nan")


def cpu_ms(variant: Variant) -> float | None:
    """Median CPU milliseconds per step over the timed rounds (the first, warm-up, round left out)."""
    samples = variant.extra.get("cpu_ms") or []
    return statistics.median(samples[1:]) if len(samples) > 1 else None


def iterate(loader: Any) -> Callable[[], Iterator[Any]]:
    return lambda: iter(loader)


def close(loaders: list[Any]) -> None:
    """Stop the persistent workers of LOADERS now (their iterators shut them down when collected)."""
    for loader in loaders:
        it = getattr(loader, "_iterator", None)
        shutdown = getattr(it, "_shutdown_workers", None)
        if callable(shutdown):
            shutdown()
    loaders.clear()
    gc.collect()
