"""Experiment (issue 6): time of each NVML call that `pick` makes (read_topology(links=False))."""
import time
from collections import defaultdict

from torchplace.hardware import nvml, topology

spent, calls = defaultdict(float), defaultdict(int)
real = nvml.call


def timed(fn, *args):
    t = time.perf_counter()
    try:
        return real(fn, *args)
    finally:
        name = fn if isinstance(fn, str) else fn.__name__
        spent[name] += time.perf_counter() - t
        calls[name] += 1


nvml.call = timed
t = time.perf_counter()
nvml.start()
t1 = time.perf_counter()
topology.read_topology(links=False)
t2 = time.perf_counter()
topology.read_topology(links=False)
t3 = time.perf_counter()
print(f"start {1e3 * (t1 - t):.1f} ms, read 1: {1e3 * (t2 - t1):.1f} ms, read 2: {1e3 * (t3 - t2):.1f} ms")
for name, s in sorted(spent.items(), key=lambda kv: -kv[1]):
    print(f"  {name:45s} {calls[name]:3d} calls {1e3 * s:7.2f} ms")
