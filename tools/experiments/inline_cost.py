# ruff: noqa  (a one-off experiment, kept in history only: docs/results/experiments/README.md)
"""Experiment (issue 21): training-process CPU per batch of DeviceLoader over packed batches vs
accelerate's send_to_device, copies only, in a fresh process and then in a bench-like one
(accelerate imported, DataLoaders with persistent workers alive). GPU only. Run once per source tree."""
import gc
import statistics
import sys
import threading
import time

import torch

from torchplace.bench import packed as pk
from torchplace.placement._stage import Stager
from torchplace.placement.loader import DeviceLoader
from accelerate.utils import send_to_device

dev = torch.device("cuda:0")
label = sys.argv[1] if len(sys.argv) > 1 else "?"


def batch(seed):
    g = torch.Generator().manual_seed(seed)
    return {f"t{i}": torch.randn((256, 64), generator=g) for i in range(64)}


pageable = [batch(i) for i in range(8)]
pinned = [{k: v.pin_memory() for k, v in b.items()} for b in pageable]
premade = pk.premade_packed(pageable, True)
side = torch.cuda.Stream(dev)
stager = Stager(dev, torch.cuda, side, torch.cuda.current_stream(dev), None, True)
print(label, "native switch:", getattr(stager, "_native", "n/a"), flush=True)


def per_batch(make, steps=200, rounds=7):
    wall, cpu = [], []
    for r in range(rounds + 1):
        torch.cuda.synchronize()
        t, c = time.perf_counter(), time.process_time()
        for _ in make(steps):
            pass
        torch.cuda.synchronize()
        if r:
            wall.append((time.perf_counter() - t) / steps * 1e6)
            cpu.append((time.process_time() - c) / steps * 1e6)
    return statistics.median(wall), statistics.median(cpu)


def ours(steps):
    return DeviceLoader([premade[i % 8] for i in range(steps)], dev)


def theirs(steps):
    return (send_to_device(pinned[i % 8], dev, non_blocking=True) for i in range(steps))


def views(steps):
    b = premade[0]
    buf = b.buffer.to(dev)
    return (b.rebuild(buf, lambda t: t, lambda x: x) for _ in range(steps))


def report(where):
    for k in range(2):
        o, s, v = per_batch(ours), per_batch(theirs), per_batch(views)
        print(f"{label} {where} pass {k}: ours wall {o[0]:6.1f} cpu {o[1]:6.1f} | send_to_device wall {s[0]:6.1f} "
              f"cpu {s[1]:6.1f} | cpu ratio {o[1] / s[1]:.3f} | rebuild alone cpu {v[1]:5.1f} us | threads "
              f"{threading.active_count()}", flush=True)


def ctx_cost(n=5000):
    c = time.process_time()
    for _ in range(n):
        with stager.on_side():
            pass
    return (time.process_time() - c) / n * 1e6


print(f"{label} with on_side(): pass {ctx_cost():.1f} us", flush=True)
report("fresh")
loaders = [pk.dataloader(pageable, 200, 4, True, packed=p) for p in (False, True, True)]
for dl in loaders:
    for _ in dl:
        pass
report("bench-like")
gc.freeze()
report("bench-like, gc.freeze")
pk.close(loaders)
