"""Experiment (issue 5): where a 10 GiB torchplace.save loses time against a plain write + fsync.

Run on a GPU machine: PYTHONPATH=src python3 tools/exp/ckpt_write.py [GiB] [dir].
"""
import ctypes
import os
import shutil
import subprocess
import sys
import tempfile
import time

import torch

from torchplace.checkpoint import save
from torchplace.checkpoint import stream as st
from torchplace.checkpoint.atomic import FileSink
from torchplace.checkpoint.format import CHUNK_BYTES, plan_layout

gib = float(sys.argv[1]) if len(sys.argv) > 1 else 10
root = tempfile.mkdtemp(dir=sys.argv[2] if len(sys.argv) > 2 else "/tmp")
size = int(gib * 2**30)
print(subprocess.run(["df", "-hT", root], capture_output=True, text=True).stdout)
for k in ("dirty_ratio", "dirty_background_ratio", "dirty_bytes", "dirty_background_bytes", "dirty_expire_centisecs"):
    print(k, open(f"/proc/sys/vm/{k}").read().strip())
print([l for l in open("/proc/meminfo") if l.startswith(("MemTotal", "MemAvailable", "Dirty"))])

libc = ctypes.CDLL(None, use_errno=True)
libc.sync_file_range.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
WRITE = 2

state = {f"l{i}": torch.randn(16 * 2**20, device="cuda:0") for i in range(size // (64 * 2**20))}
torch.cuda.synchronize()
host = torch.empty(size, dtype=torch.uint8)
at = 0
for t in state.values():
    host[at:at + t.nbytes].copy_(t.view(-1).view(torch.uint8)); at += t.nbytes
entries = plan_layout(state)


def plain(path, hint=False):
    view = memoryview(host.numpy())
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    t0 = time.perf_counter()
    done = 0
    while done < size:
        n = os.write(fd, view[done:min(size, done + 256 * 2**20)])
        if hint:
            libc.sync_file_range(fd, done, n, WRITE)
        done += n
    t1 = time.perf_counter()
    os.fsync(fd); os.close(fd)
    return t1 - t0, time.perf_counter() - t1


class HintSink(FileSink):
    def pwrite(self, data, offset):
        super().pwrite(data, offset)
        libc.sync_file_range(self.fd, offset, memoryview(data).nbytes, WRITE)


def tp(path, workers=None, chunk=CHUNK_BYTES, sink=FileSink):
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    t0 = time.perf_counter()
    st.write_data(sink(fd), 4096, entries, state, size, chunk, workers=workers)
    t1 = time.perf_counter()
    os.fsync(fd); os.close(fd)
    return t1 - t0, time.perf_counter() - t1


def full(path):
    t0 = time.perf_counter()
    save(path, model=state, rng_state=False)
    return time.perf_counter() - t0, 0.0


variants = {"plain": plain, "plain+sync_file_range": lambda p: plain(p, True),
            "tp write_data (8 thr, 16MiB)": tp, "tp 4 workers": lambda p: tp(p, 4),
            "tp 64MiB chunks": lambda p: tp(p, chunk=64 * 2**20),
            "tp + sync_file_range": lambda p: tp(p, sink=HintSink), "torchplace.save": full}
res = {k: [] for k in variants}
for rnd in range(2):
    for name, fn in variants.items():
        path = os.path.join(root, "f")
        w, f = fn(path)
        res[name].append((w, f))
        os.unlink(path)
        print(f"round {rnd} {name:32s} write {w:6.2f}s fsync {f:6.2f}s total {w + f:6.2f}s "
              f"{size / (w + f) / 1e9:5.2f} GB/s", flush=True)
print("\nsummary (best of 2)")
for name, r in res.items():
    best = min(w + f for w, f in r)
    print(f"{name:32s} {size / best / 1e9:5.2f} GB/s")
shutil.rmtree(root)
