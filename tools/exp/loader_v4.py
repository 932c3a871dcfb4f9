"""Experiment (issue 3), round 4: why the worker's staging is slower inside DeviceLoader than alone."""
import sys
import time
from collections import defaultdict

import torch

from torchplace.placement import _pack, _stage
from torchplace.placement.loader import DeviceLoader
from torchplace.placement.transfer import pin

dev = torch.device("cuda:0")
N, SHAPE, STEPS = 64, (256, 64), 1500
g = torch.Generator().manual_seed(0)
pinned = [pin({"inputs": {f"t{i}": torch.randn(SHAPE, generator=g) for i in range(N - 1)},
               "targets": [torch.randn(SHAPE, generator=g)], "meta": {"step": 0, "tag": "train"}}) for _ in range(8)]
spent = defaultdict(float)


def timed(name, fn):
    def wrapper(*a, **k):
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            spent[name] += time.perf_counter() - t
    return wrapper


_stage.Stager.__call__ = timed("stage", _stage.Stager.__call__)
_stage.Stager.source_done = timed("source_done", _stage.Stager.source_done)
_stage.Stager.handed = timed("handed", _stage.Stager.handed)
_stage.Stager._collect = timed("collect", _stage.Stager._collect)
_pack.copy = timed("foreach H2D", _pack.copy)
_pack.views = timed("views", _pack.views)


def report(label, fn):
    fn(50)
    spent.clear()
    torch.cuda.synchronize()
    t = time.perf_counter()
    fn(STEPS)
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t) / STEPS * 1e6
    print(f"{label:40s} {wall:6.1f} us/step | " + ", ".join(f"{k} {v / STEPS * 1e6:.1f}" for k, v in spent.items()),
          flush=True)


stager = _stage.Stager(dev, torch.cuda, torch.cuda.Stream(dev), torch.cuda.current_stream(dev), None, True)


def alone(s):
    with stager.on_worker():
        for i in range(s):
            st = stager(pinned[i % 8])
            stager.source_done(st.source_read)
            stager._events += (st.ready, st.started)


def loader(s):
    for _ in DeviceLoader([pinned[i % 8] for i in range(s)], dev):
        pass


def loader_prefetch(n):
    return lambda s: [None for _ in DeviceLoader([pinned[i % 8] for i in range(s)], dev, prefetch=n)]


report("Stager alone", alone)
report("DeviceLoader", loader)
report("DeviceLoader prefetch=8", loader_prefetch(8))
sys.setswitchinterval(0.0001)
report("DeviceLoader, switch interval 0.1 ms", loader)
sys.setswitchinterval(0.05)
report("DeviceLoader, switch interval 50 ms", loader)
sys.setswitchinterval(0.005)
