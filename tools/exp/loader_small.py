"""Experiment (issue 3): where DeviceLoader's time goes for a batch of 64 small pinned tensors.

Run on a GPU machine: PYTHONPATH=src python3 tools/exp/loader_small.py. Prints a table; no file.
"""
import cProfile
import io
import os
import pstats
import statistics
import sys
import time

import torch

from torchplace.placement import _hostcopy, _pack
from torchplace.placement._stage import Stager
from torchplace.placement.loader import DeviceLoader
from torchplace.placement.transfer import pin, to_device

dev = torch.device("cuda:0")
N, SHAPE, STEPS = 64, (256, 64), 300


def batch(seed):
    g = torch.Generator().manual_seed(seed)
    return {"inputs": {f"t{i}": torch.randn(SHAPE, generator=g) for i in range(N - 1)},
            "targets": [torch.randn(SHAPE, generator=g)], "meta": {"step": seed, "tag": "train"}}


pinned = [pin(batch(i)) for i in range(8)]
flat = [[t for t in list(b["inputs"].values()) + b["targets"]] for b in pinned]


def per_step(fn, steps=STEPS, reps=5):
    out = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn(steps)
        torch.cuda.synchronize()
        out.append((time.perf_counter() - t0) / steps * 1e6)
    return statistics.median(out)


def send(steps):
    from accelerate.utils import send_to_device
    for i in range(steps):
        send_to_device(pinned[i % 8], dev, non_blocking=True)


def todev(steps):
    for i in range(steps):
        to_device(pinned[i % 8], dev)


def loader(steps, **kw):
    for b in DeviceLoader([pinned[i % 8] for i in range(steps)], dev, **kw):
        pass


side = torch.cuda.Stream(dev)
stager = Stager(dev, torch.cuda, side, torch.cuda.current_stream(dev), None, True)


def stage_only(steps):
    with stager.on_worker():
        for i in range(steps):
            s = stager(pinned[i % 8])
            stager._events += (s.ready, s.started)


def foreach_views(steps):
    with torch.cuda.stream(side):
        for i in range(steps):
            src = flat[i % 8]
            plan = _pack.layout(src)
            buf = torch.empty(plan.total, dtype=torch.uint8, device=dev)
            torch._foreach_copy_(_pack.views(buf, plan), src, non_blocking=True)


def pack_only(steps):
    for i in range(steps):
        src = flat[i % 8]
        plan = _pack.layout(src)
        staging = torch.empty(plan.total, dtype=torch.uint8, pin_memory=True)
        _hostcopy.start(_pack.views(staging, plan), src, plan.nbytes)()


def cat_pack(steps):
    for i in range(steps):
        src = flat[i % 8]
        staging = torch.empty(sum(t.numel() for t in src), dtype=torch.float32, pin_memory=True)
        torch.cat([t.view(-1) for t in src], out=staging)


rows = [("accelerate send_to_device", send), ("to_device", todev), ("DeviceLoader", loader),
        ("DeviceLoader pack=False", lambda s: loader(s, pack=False)),
        ("Stager alone (main thread)", stage_only), ("foreach_copy_ into views of 1 buffer", foreach_views),
        ("pack alone (host memcpy via helpers)", pack_only), ("torch.cat into pinned", cat_pack)]
print(f"copy threads: {_hostcopy.threads()}  cpus: {os.cpu_count()}  switchinterval {sys.getswitchinterval()}")
for name, fn in rows:
    fn(20)
    print(f"{name:45s} {per_step(fn):8.1f} us/step", flush=True)
sys.setswitchinterval(0.0002)
print(f"{'DeviceLoader, switchinterval 0.2 ms':45s} {per_step(loader):8.1f} us/step")
sys.setswitchinterval(0.005)

pr = cProfile.Profile()
pr.enable()
stage_only(300)
torch.cuda.synchronize()
pr.disable()
s = io.StringIO()
pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(18)
print(s.getvalue()[-4000:])
