# ruff: noqa  (a one-off experiment, kept in history only: docs/results/experiments/README.md)
"""Experiment (issue 21): where a packed batch's host time goes, and whether staging on the
consumer's thread (no worker-thread hand-off) beats DeviceLoader's worker thread. GPU only."""
import statistics
import sys
import time
from collections import deque

import torch

from torchplace.bench import packed as pk
from torchplace.placement._stage import Stager
from torchplace.placement.loader import DeviceLoader

dev = torch.device("cuda:0")
steps, rounds = 300, 7


def batch(seed):
    g = torch.Generator().manual_seed(seed)
    return {"inputs": {f"t{i}": torch.randn((256, 64), generator=g) for i in range(63)},
            "targets": [torch.randn((256, 64), generator=g)], "meta": {"step": seed, "tag": "train"}}


pageable = [batch(i) for i in range(8)]
premade = pk.premade_packed(pageable, True)
flat = torch.cat([t.reshape(-1).view(torch.uint8) for t in pageable[0]["inputs"].values()]).pin_memory()
cycles = None


def compute():
    torch.cuda._sleep(cycles)


def inline(source, prefetch=2):
    side = torch.cuda.Stream(dev)
    cur = torch.cuda.current_stream(dev)
    stager = Stager(dev, torch.cuda, side, cur, None, True)
    it = iter(source)
    pending, tokens = deque(), deque()
    done = False
    while True:
        while not done and len(pending) < prefetch:
            if len(tokens) >= prefetch:  # the device reached where the consumer took batch j - prefetch
                stager.handed(tokens.popleft())
            try:
                b = next(it)
            except StopIteration:
                done = True
                break
            with stager.on_worker():
                pending.append(stager(b))
        if not pending:
            return
        item = pending.popleft()
        cur.wait_event(item.ready)
        item.started.record(cur)
        tokens.append((item.started, item.ready))
        yield item.batch


def stager_only(source):
    side = torch.cuda.Stream(dev)
    stager = Stager(dev, torch.cuda, side, torch.cuda.current_stream(dev), None, True)
    with stager.on_worker():
        for b in source:
            yield stager(b).batch


def run(name, make, step=None):
    walls, cpus = [], []
    for r in range(rounds + 1):
        src = [premade[i % len(premade)] for i in range(steps)]
        it = make(src)
        first = next(it)
        torch.cuda.synchronize()
        w0, c0 = time.perf_counter(), time.process_time()
        n = 0
        for _b in it:
            if step:
                step()
            n += 1
        torch.cuda.synchronize()
        if r:
            walls.append((time.perf_counter() - w0) / n * 1e6)
            cpus.append((time.process_time() - c0) / n * 1e6)
        del it, first
    print(f"{name:60s} wall {statistics.median(walls):8.1f} us/step  cpu {statistics.median(cpus):8.1f} us/step", flush=True)
    return statistics.median(walls)


def main():
    global cycles
    # calibrate ~1 ms of _sleep
    torch.cuda._sleep(1000); torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record(); torch.cuda._sleep(1_000_000); e1.record(); torch.cuda.synchronize()
    cycles = int(1_000_000 * 1.0 / e0.elapsed_time(e1))
    print("torch", torch.__version__, torch.cuda.get_device_name(), "sleep cycles per ms", cycles)
    for step in (None, compute):
        tag = " + 1 ms compute" if step else ""
        run("one packed copy" + tag, lambda src: (flat.to(dev, non_blocking=True) for _ in src), step)
        run("DeviceLoader (worker thread)" + tag, lambda src: iter(DeviceLoader(src, dev)), step)
        run("inline staging, prefetch 2" + tag, lambda src: inline(src, 2), step)
        run("inline staging, prefetch 3" + tag, lambda src: inline(src, 3), step)
        run("stager alone (no hand-off, no waits)" + tag, stager_only, step)
        if not step:
            import cProfile
            import pstats
            pr = cProfile.Profile()
            src = [premade[i % len(premade)] for i in range(steps)]
            pr.enable()
            for _b in inline(src, 2):
                pass
            torch.cuda.synchronize()
            pr.disable()
            pstats.Stats(pr).sort_stats("tottime").print_stats(14)
    print("switchinterval", sys.getswitchinterval())


main()
