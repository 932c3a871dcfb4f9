"""When does DeviceLoader's side-stream pool take one more 256 MiB block, and does the order of
the consumer's events change it?  (question of #3: memory_reserved() grew by one batch, once,
in two of four bench runs.)

Three orders of the consumer's hand-over, each on a fresh loader (own side stream), many epochs
of the bench loader's memory check (pageable 256 MiB batches, 4 per epoch, prefetch 2, matmul
compute per step), counting the side stream's segments after each epoch:
  A  as built: record `started`, then wait for `ready`, then tell the worker
  B  wait for `ready` first, then record `started` (the token also means the copy is done)
  C  as B, and the token of batch i reaches the worker only when batch i+1 is taken, after the
     consumer has dropped batch i-1 on the host
"""

from __future__ import annotations

import sys
import time

import torch

from torchplace.bench.transfer import Compute, Env
from torchplace.placement import loader as L
from torchplace.placement._stage import Staged


def _take(self):
    """Orders B and C share this: hand out the next batch, its copy waited for, then `started` recorded."""
    if self._done:
        raise StopIteration
    item = self._queue.get()
    if type(item) is not Staged:
        self.close()
        if item is L._END:
            raise StopIteration
        raise item.error
    stream = self._mod.current_stream(self._device)
    stream.wait_event(item.ready)
    item.started.record(stream)
    return item


def next_b(self):
    item = _take(self)
    self._handed.put((item.started, item.ready))
    return item.batch


def next_c(self):
    item = _take(self)
    pending = getattr(self, "_pending", None)
    if pending is not None:
        self._handed.put(pending)
    self._pending = (item.started, item.ready)
    return item.batch


def segments(stream) -> int:
    handle = stream.cuda_stream
    return sum(1 for s in torch.cuda.memory_snapshot() if s["stream"] == handle and s["total_size"] >= 2**28)


def run(name: str, nxt, compute, epochs: int, batches: list, dev) -> None:
    original = L._BackgroundIter.__next__
    if nxt is not None:
        L._BackgroundIter.__next__ = nxt
    try:
        loader = L.DeviceLoader(batches, dev, prefetch=2)
        series = []
        start = time.perf_counter()
        for _ in range(epochs):
            for batch in loader:
                compute(batch)
            torch.cuda.synchronize(dev)
            series.append(segments(loader.stream))
        ms = (time.perf_counter() - start) * 1e3 / (epochs * len(batches))
    finally:
        L._BackgroundIter.__next__ = original
    grew = [i + 1 for i in range(1, epochs) if series[i] > series[i - 1]]
    print(f"{name:3s} compute {compute.ms:5.2f} ms: 256 MiB blocks after epoch 1: {series[0]}, at the end: {series[-1]}, "
          f"grew at epochs {grew or 'never'}; {ms:.2f} ms/step", flush=True)


def main() -> None:
    dev = torch.device("cuda:0")
    env = Env.for_device(dev)
    epochs = int(sys.argv[1]) if len(sys.argv) > 1 else 100
    numel = 256 * 2**18
    batches = [{"x": torch.empty(numel).fill_(float(i)), "y": torch.arange(256) + i} for i in range(4)]
    for ms in (9.65, 2.0):
        compute = Compute.calibrated(dev, ms, env)
        for rep in range(2):
            for name, nxt in (("A", None), ("B", next_b), ("C", next_c)):
                run(name, nxt, compute, epochs, batches, dev)


if __name__ == "__main__":
    main()
