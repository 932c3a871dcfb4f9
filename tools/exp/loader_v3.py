"""Experiment (issue 3), third round: ways to stage 64 small pinned tensors, and the loader as built."""
import statistics
import time

import torch
from accelerate.utils import send_to_device

from torchplace.placement import _hostcopy, _pack
from torchplace.placement._stage import Stager
from torchplace.placement.loader import DeviceLoader
from torchplace.placement.transfer import pin, to_device

dev = torch.device("cuda:0")
N, SHAPE, STEPS = 64, (256, 64), 300
g = torch.Generator().manual_seed(0)


def make():
    return {"inputs": {f"t{i}": torch.randn(SHAPE, generator=g) for i in range(N - 1)},
            "targets": [torch.randn(SHAPE, generator=g)], "meta": {"step": 0, "tag": "train"}}


pageable = [make() for _ in range(8)]
pinned = [pin(b) for b in pageable]
flat = [list(b["inputs"].values()) + b["targets"] for b in pinned]
plan = _pack.layout(flat[0])
side = torch.cuda.Stream(dev)


def per_step(fn, reps=5):
    fn(20)
    out = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn(STEPS)
        torch.cuda.synchronize()
        out.append((time.perf_counter() - t) / STEPS * 1e6)
    return statistics.median(out)


def gather(s):
    for i in range(s):
        dst = torch.empty(plan.total, dtype=torch.uint8, device=dev)
        _pack.copy(_pack.views(dst, plan), flat[i % 8], non_blocking=True)


def pack_with(helpers):
    def fn(s):
        for i in range(s):
            staging = torch.empty(plan.total, dtype=torch.uint8, pin_memory=True)
            if helpers:
                _hostcopy.start(_pack.views(staging, plan), flat[i % 8], plan.nbytes)()
            else:
                _pack.copy(_pack.views(staging, plan), flat[i % 8])
            torch.empty(plan.total, dtype=torch.uint8, device=dev).copy_(staging, non_blocking=True)
    return fn


def empty_pinned(s):
    for i in range(s):
        torch.empty(plan.total, dtype=torch.uint8, pin_memory=True)


stager = Stager(dev, torch.cuda, side, torch.cuda.current_stream(dev), None, True)


def stage(src):
    def fn(s):
        with stager.on_worker():
            for i in range(s):
                st = stager(src[i % 8])
                if st.source_read is not None:
                    stager.source_done(st.source_read)
                stager._events += (st.ready, st.started)
    return fn


def loop(fn, src):
    def run(s):
        for i in range(s):
            fn(src[i % 8])
    return run


def loader(src):
    return lambda s: [None for _ in DeviceLoader([src[i % 8] for i in range(s)], dev)]


rows = {
    "gather: foreach H2D into views": gather,
    "pack, 1 thread, + 1 H2D": pack_with(False),
    "pack, helpers, + 1 H2D": pack_with(True),
    "torch.empty pinned alone": empty_pinned,
    "pinned send_to_device": loop(lambda b: send_to_device(b, dev, non_blocking=True), pinned),
    "pinned to_device": loop(lambda b: to_device(b, dev), pinned),
    "pinned Stager alone": stage(pinned),
    "pinned DeviceLoader": loader(pinned),
    "pageable send_to_device": loop(lambda b: send_to_device(b, dev, non_blocking=True), pageable),
    "pageable Stager alone": stage(pageable),
    "pageable DeviceLoader": loader(pageable),
}
print(f"copy threads {_hostcopy.threads()}")
for name, fn in rows.items():
    print(f"{name:34s} {per_step(fn):7.1f} us/step", flush=True)
