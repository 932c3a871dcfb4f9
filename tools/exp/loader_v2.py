"""Experiment (issue 3), second round: the DeviceLoader worker's time per batch, part by part."""
import statistics
import time
from collections import defaultdict

import torch
from accelerate.utils import send_to_device

from torchplace.placement import _stage
from torchplace.placement.loader import DeviceLoader
from torchplace.placement.transfer import pin, to_device

dev = torch.device("cuda:0")
N, SHAPE, STEPS = 64, (256, 64), 300
g = torch.Generator().manual_seed(0)
pinned = [pin({"inputs": {f"t{i}": torch.randn(SHAPE, generator=g) for i in range(N - 1)},
               "targets": [torch.randn(SHAPE, generator=g)], "meta": {"step": s, "tag": "train"}}) for s in range(8)]
pageable = [{"inputs": {f"t{i}": torch.randn(SHAPE, generator=g) for i in range(N - 1)},
             "targets": [torch.randn(SHAPE, generator=g)], "meta": {"step": s, "tag": "train"}} for s in range(8)]
spent = defaultdict(float)


def timed(name, fn):
    def wrapper(*a, **k):
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            spent[name] += time.perf_counter() - t
    return wrapper


def per_step(fn, reps=5):
    out = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn(STEPS)
        torch.cuda.synchronize()
        out.append((time.perf_counter() - t) / STEPS * 1e6)
    return statistics.median(out)


def rows(src):
    return {"send_to_device": lambda s: [send_to_device(src[i % 8], dev, non_blocking=True) for i in range(s)],
            "to_device": lambda s: [to_device(src[i % 8], dev) for i in range(s)],
            "DeviceLoader": lambda s: [None for _ in DeviceLoader([src[i % 8] for i in range(s)], dev)]}


t = time.perf_counter()
leaves = list(pinned[0]["inputs"].values())
for _ in range(100):
    [x.is_pinned() for x in leaves]
print(f"is_pinned x63: {(time.perf_counter() - t) / 100 * 1e6:.1f} us")
for label, src in (("pinned", pinned), ("pageable", pageable)):
    for name, fn in rows(src).items():
        fn(20)
        print(f"{label:9s} {name:16s} {per_step(fn):7.1f} us/step", flush=True)
for name in ("__call__", "handed", "source_done"):
    setattr(_stage.Stager, name, timed(name, getattr(_stage.Stager, name)))
spent.clear()
t = time.perf_counter()
for _ in DeviceLoader([pinned[i % 8] for i in range(STEPS * 5)], dev):
    pass
torch.cuda.synchronize()
wall = time.perf_counter() - t
print(f"instrumented DeviceLoader (pinned): {wall / STEPS / 5 * 1e6:.1f} us/step; worker parts per batch: "
      + ", ".join(f"{k} {v / STEPS / 5 * 1e6:.1f} us" for k, v in spent.items()))
