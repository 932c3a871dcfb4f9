"""Experiment (issue 6): where `torchplace pick` spends its time on a GPU machine (in-process)."""
import time

t0 = time.perf_counter()
import pynvml  # noqa: E402

t1 = time.perf_counter()
pynvml.nvmlInit()
t2 = time.perf_counter()
from torchplace.distributed.pick import load_topology, pick  # noqa: E402

t3 = time.perf_counter()
topo = load_topology()
t4 = time.perf_counter()
p = pick(1, lease=False)
t5 = time.perf_counter()
p2 = pick(1, lease=True)
t6 = time.perf_counter()
print(f"import pynvml {1e3 * (t1 - t0):.1f} ms, nvmlInit {1e3 * (t2 - t1):.1f} ms, import pick {1e3 * (t3 - t2):.1f} ms, "
      f"topology {1e3 * (t4 - t3):.1f} ms, pick(lease=False) {1e3 * (t5 - t4):.1f} ms, pick(lease=True) {1e3 * (t6 - t5):.1f} ms")
print("pynvml", pynvml.__file__, getattr(pynvml, "__cached__", None))
