# ruff: noqa  (a one-off experiment, kept in history only: docs/results/experiments/README.md)
"""Experiment (issue 17): the CUDA load's ring of pinned windows (cuda_load.py) at 10 GiB from the
page cache: buffers x window size x reader threads. GPU only."""
import os
import sys
import tempfile
import time

import torch

import torchplace
from torchplace.bench.checkpoint import _local_dir, _state
from torchplace.checkpoint import cuda_load, stream

size = int(float(sys.argv[1]) * 2**30) if len(sys.argv) > 1 else 10 * 2**30
dev = torch.device("cuda:0")
root = tempfile.mkdtemp(dir=_local_dir())
path = os.path.join(root, "ckpt")
state = _state(size, dev)
t = time.perf_counter()
torchplace.save(path, model=state, rng_state=False)
print(f"size {size / 2**30:.1f} GiB, {len(state)} tensors, save {size / (time.perf_counter() - t) / 1e9:.2f} GB/s, "
      f"cpus {os.cpu_count()}, torch {torch.__version__}", flush=True)
del state
torch.cuda.empty_cache()


def load_gbs(reps=3):
    out = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        sd = torchplace.load(path, device=dev, restore_rng=False)
        torch.cuda.synchronize()
        out.append(size / (time.perf_counter() - t) / 1e9)
        del sd
    return out


load_gbs(1)  # warm: page cache, pinned pool, allocator
variants = [(2, 128, 12), (3, 128, 12), (4, 128, 12), (4, 64, 12), (6, 64, 12), (8, 32, 12), (4, 128, 16),
            (6, 64, 16), (3, 256, 12), (4, 128, 8), (2, 128, 12)]
for nbuf, mib, workers in variants:
    cuda_load.BUFFERS, cuda_load.WINDOW_BYTES, stream.LOAD_MAX_WORKERS = nbuf, mib * 2**20, workers
    r = load_gbs()
    print(f"buffers {nbuf} window {mib:4d} MiB workers {workers:2d}: " + " ".join(f"{g:5.1f}" for g in r)
          + f" GB/s (best {max(r):.1f})", flush=True)
for read_mib in (4, 16):
    cuda_load.BUFFERS, cuda_load.WINDOW_BYTES, stream.LOAD_MAX_WORKERS = 4, 128 * 2**20, 12
    stream.READ_BYTES = read_mib * 2**20
    r = load_gbs()
    print(f"buffers 4 window 128 MiB workers 12 read {read_mib} MiB: " + " ".join(f"{g:5.1f}" for g in r), flush=True)
stream.READ_BYTES = 8 * 2**20
os.remove(path)
