"""On a GPU machine: configure_threads finds the GPU's CPUs from NVML, binds to them, and never
starts CUDA doing so."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from torchplace.hardware.topology import read_topology
from torchplace.hardware.visible import map_visible

pytestmark = pytest.mark.gpu

CHILD = """
import json, os, torch
from torchplace import configure_threads
plan = configure_threads(gpu="cuda:0", bind=True)
print(json.dumps({"bind": plan.bind_cpus, "affinity": sorted(os.sched_getaffinity(0)), "intra": plan.intra_op,
                  "threads": torch.get_num_threads(), "omp": os.environ["OMP_NUM_THREADS"],
                  "cuda_started": torch.cuda.is_initialized(), "notes": plan.notes}))
"""


def test_binds_to_the_gpus_cpus_without_starting_cuda():
    topology = read_topology()
    physical = map_visible(topology=topology).physical(0).physical_index
    near = next(g for g in topology.gpus if g.physical_index == physical).cpu_affinity
    if not near:
        pytest.skip("NVML reports no CPU affinity for this GPU")
    proc = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    expected = sorted(set(near) & os.sched_getaffinity(0))
    assert out["bind"] == expected and out["affinity"] == expected
    assert out["threads"] == out["intra"] == int(out["omp"]) <= len(expected)
    assert out["cuda_started"] is False
