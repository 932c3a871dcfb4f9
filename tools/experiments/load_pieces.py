# ruff: noqa  (a one-off experiment, kept in history only: docs/results/experiments/README.md)
"""Experiment (issue 17): the CUDA load at 10 GiB from the page cache with small pinned buffers kept
hot in the CPU's cache: each reader thread takes the next chunk and reads it in pieces of P bytes into
a ring of DEPTH pinned buffers of its own, checksums each piece right after reading it, and queues its
copy on the thread's own stream (no hand-off, no window barrier, each byte read once from DRAM). vs the
window ring (cuda_load.py). GPU only."""
import bisect
import inspect
import itertools
import os
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import torch

import torchplace
from torchplace.bench.checkpoint import _local_dir, _state
from torchplace.checkpoint import cuda_load, stream

size = int(float(sys.argv[1]) * 2**30) if len(sys.argv) > 1 else 10 * 2**30
dev = torch.device("cuda:0")
root = tempfile.mkdtemp(dir=_local_dir())
path = os.path.join(root, "ckpt")
state = _state(size, dev)
torchplace.save(path, model=state, rng_state=False)
print(f"size {size / 2**30:.1f} GiB, {len(state)} tensors, cpus {os.cpu_count()}, torch {torch.__version__}, "
      f"crc {stream.crc32}", flush=True)
del state
torch.cuda.empty_cache()
ring = cuda_load.read_chunks_to_cuda
crc32 = stream.crc32


def pieces(P, depth):
    def load(flat, entries, chunks, chunk_bytes, workers, read_chunk):
        cv = inspect.getclosurevars(read_chunk).nonlocals
        fd, base, crcs = cv["fd"], cv["base"], cv["crcs"]
        order = sorted((e for e in entries if e.nbytes), key=lambda e: e.start)
        ends = [e.end for e in order]
        counter = itertools.count()
        failed = []

        def run():
            prev = torch.cuda.current_stream(dev)
            s = torch.cuda.Stream(device=dev)
            torch.cuda.set_stream(s)
            bufs = [torch.empty(P, dtype=torch.uint8, pin_memory=True) for _ in range(depth)]
            views = [memoryview(b.numpy()) for b in bufs]
            events = [torch.cuda.Event() for _ in range(depth)]
            used = [False] * depth
            j = 0
            try:
                while not failed:
                    i = next(counter)
                    if i >= len(chunks):
                        break
                    k, c0, c1, _ = chunks[i]
                    crc = 0
                    for p0 in range(c0, c1, P):
                        p1 = min(p0 + P, c1)
                        slot = j % depth
                        j += 1
                        if used[slot]:
                            events[slot].synchronize()
                        v = views[slot][:p1 - p0]
                        got = 0
                        while got < p1 - p0:
                            n = os.preadv(fd, [v[got:]], base + p0 + got)
                            if n == 0:
                                raise EOFError
                            got += n
                        crc = crc32(v, crc)
                        buf = bufs[slot]
                        for e in order[bisect.bisect_right(ends, p0):]:
                            if e.start >= p1:
                                break
                            lo, hi = max(e.start, p0), min(e.end, p1)
                            flat[e.key][lo - e.start:hi - e.start].copy_(buf[lo - p0:hi - p0], non_blocking=True)
                        events[slot].record(s)
                        used[slot] = True
                    if crcs is not None and crcs[k] != f"{crc:08x}":
                        raise RuntimeError(f"chunk {k} CRC")
            except BaseException as e:
                failed.append(e)
            finally:
                for slot in range(depth):
                    if used[slot]:
                        events[slot].synchronize()
                torch.cuda.set_stream(prev)

        threads = [threading.Thread(target=run) for _ in range(workers - 1)]
        for th in threads:
            th.start()
        run()
        for th in threads:
            th.join()
        if failed:
            raise failed[0]
    return load


def load_gbs(reps=3):
    out = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        sd = torchplace.load(path, device=dev, restore_rng=False)
        torch.cuda.synchronize()
        out.append(size / (time.perf_counter() - t) / 1e9)
        if _ == 0 and check is not None:
            m, ref = sd["model"], check["model"]
            assert all(torch.equal(m[k], ref[k]) for k in list(ref)), "wrong bytes"
        del sd
    return out


check = None
load_gbs(1)
check = torchplace.load(path, device=dev, restore_rng=False)  # loaded by the ring: the reference bytes
variants = [("ring (now)", ring, 12)]
for P in (1, 2, 4):
    for depth in (2, 4):
        for workers in (12, 16):
            variants.append((f"pieces {P} MiB x {depth}", pieces(P * 2**20, depth), workers))
variants.append(("pieces 2 MiB x 4", pieces(2 * 2**20, 4), 8))
variants.append(("ring (now)", ring, 12))
for name, fn, workers in variants:
    cuda_load.read_chunks_to_cuda, stream.LOAD_MAX_WORKERS = fn, workers
    r = load_gbs()
    print(f"{name:20s} workers {workers:2d}: " + " ".join(f"{g:5.1f}" for g in r) + f" GB/s (best {max(r):.1f})",
          flush=True)
del check
fd = os.open(path, os.O_RDONLY)
n = os.fstat(fd).st_size
for workers in (12, 16):
    for piece in (1 * 2**20, 2 * 2**20, 4 * 2**20, 8 * 2**20):
        bufs = [torch.empty(piece, dtype=torch.uint8, pin_memory=True).numpy() for _ in range(workers)]
        per = -(-n // workers)

        def job(w):
            b, lo, hi, c = bufs[w], w * per, min(n, (w + 1) * per), 0
            while lo < hi:
                k = os.preadv(fd, [b[:min(piece, hi - lo)]], lo)
                c = crc32(b[:k], c)
                lo += k
        with ThreadPoolExecutor(workers) as pool:
            t = time.perf_counter()
            list(pool.map(job, range(workers)))
            dt = time.perf_counter() - t
        print(f"raw preadv + CRC, one reused buffer a thread, {piece >> 20} MiB pieces, {workers} threads: "
              f"{n / dt / 1e9:.1f} GB/s", flush=True)
os.close(fd)
os.remove(path)
