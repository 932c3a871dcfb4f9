# ruff: noqa  (a one-off experiment, kept in history only: docs/results/experiments/README.md)
"""Experiment (issue 21): where InlineIter's host time per packed batch goes (64 tensors, copies only). GPU only."""
import time

import torch

from torchplace.bench import packed as pk
from torchplace.placement._inline import InlineIter, hand_out
from torchplace.placement._stage import Stager

dev = torch.device("cuda:0")
N = 2000


def batch(seed):
    g = torch.Generator().manual_seed(seed)
    return {"inputs": {f"t{i}": torch.randn((256, 64), generator=g) for i in range(63)},
            "targets": [torch.randn((256, 64), generator=g)], "meta": {"step": seed, "tag": "train"}}


premade = pk.premade_packed([batch(i) for i in range(8)], True)
side = torch.cuda.Stream(dev)
cur = torch.cuda.current_stream(dev)
stager = Stager(dev, torch.cuda, side, cur, None, True)


def timed(name, fn):
    fn(0)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for i in range(N):
        fn(i)
    torch.cuda.synchronize()
    print(f"{name:45s} {(time.perf_counter() - t) / N * 1e6:7.1f} us", flush=True)


src = premade[0].buffer
timed("on_side() enter+exit", lambda i: stager.on_side().__enter__() and None or None)
def ctx(i):
    with stager.on_side():
        pass
timed("with on_side(): pass", ctx)
timed("current_stream", lambda i: torch.cuda.current_stream(dev))
timed("buffer.is_pinned()", lambda i: src.is_pinned())
def copy(i):
    with torch.cuda.stream(side):
        src.to(dev, non_blocking=True)
timed("with stream: buffer.to(dev)", copy)
b = premade[0]
buf = src.to(dev)
timed("rebuild (views)", lambda i: b.rebuild(buf, lambda t: t, lambda x: x))
def stage(i):
    with stager.on_side():
        s = stager(premade[i % 8])
    stager._events += (s.ready, s.started)
timed("with on_side: stager(batch)", stage)
ev = [torch.cuda.Event() for _ in range(2)]
timed("event.record(stream)", lambda i: ev[0].record(side))
def ho(i):
    with stager.on_side():
        s = stager(premade[i % 8])
    tok = hand_out(s, torch.cuda, dev, cur)
    stager.handed(tok)
timed("stage + hand_out + handed", ho)
def full(i):
    pass
src_list = [premade[i % 8] for i in range(N + 1)]
torch.cuda.synchronize()
t = time.perf_counter()
for _x in InlineIter(iter(src_list[1:]), True, stager, 2, src_list[0]):
    pass
torch.cuda.synchronize()
print(f"{'InlineIter loop':45s} {(time.perf_counter() - t) / N * 1e6:7.1f} us")
flat = src
timed("one packed copy", lambda i: flat.to(dev, non_blocking=True))

import gc
import statistics
import sys

from torchplace.placement.loader import DeviceLoader


def rounds(name, steps, n_rounds=7):
    out = []
    for r in range(n_rounds + 1):
        it = iter(DeviceLoader([premade[i % 8] for i in range(steps)], dev))
        next(it)
        torch.cuda.synchronize()
        t = time.perf_counter()
        k = 0
        for _ in it:
            k += 1
        torch.cuda.synchronize()
        if r:
            out.append((time.perf_counter() - t) / k * 1e6)
    print(f"{name:45s} {statistics.median(out):7.1f} us (rounds {[round(x) for x in out]})", flush=True)


rounds("DeviceLoader per round, 200 steps", 200)
rounds("DeviceLoader per round, 2000 steps", 2000, 3)
gc.disable()
rounds("DeviceLoader per round, 200 steps, gc off", 200)
gc.enable()
if len(sys.argv) > 1:  # a bench-like process: accelerate imported, DataLoaders with persistent workers alive
    import accelerate  # noqa: F401
    loaders = [pk.dataloader([batch(i) for i in range(8)], 200, 4, True, packed=p) for p in (False, True, True)]
    for dl in loaders:
        for _ in dl:
            pass
    rounds("DeviceLoader per round, 200 steps, bench-like process", 200)
    pk.close(loaders)
