# ruff: noqa  (a one-off experiment, kept in history only: docs/results/experiments/README.md)
"""Experiment (issue 17): what bounds the CUDA load at 10 GiB from the page cache: the window ring
(cuda_load.py) with its CRC or its copies taken out, beside raw reads. Earlier draft: per-thread pipelines: each reader thread takes the next chunk, reads and checksums it into one of
its own two pinned buffers and queues its copy on its own stream (no hand-off, no window barrier). GPU only."""
import bisect
import itertools
import os
import sys
import tempfile
import threading
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
      f"cpus {os.cpu_count()}, torch {torch.__version__}, crc {stream.crc32}", flush=True)
del state
torch.cuda.empty_cache()
ring = cuda_load.read_chunks_to_cuda


def per_thread(flat, entries, chunks, chunk_bytes, workers, read_chunk):
    order = sorted((e for e in entries if e.nbytes), key=lambda e: e.start)
    ends = [e.end for e in order]
    counter = itertools.count()
    failed = []

    def run():
        bufs = [torch.empty(chunk_bytes, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
        done = [[], []]
        streams = {}
        k = 0
        try:
            while not failed:
                i = next(counter)
                if i >= len(chunks):
                    break
                c = chunks[i]
                slot = k & 1
                k += 1
                for e in done[slot]:
                    e.synchronize()
                buf = bufs[slot]
                read_chunk(c, buf[:c[2] - c[1]].numpy())
                done[slot] = cuda_load._copy_window(buf, c[1], c[2], order, ends, flat, streams)
        except BaseException as e:
            failed.append(e)
        finally:
            for es in done:
                for e in es:
                    e.synchronize()

    threads = [threading.Thread(target=run) for _ in range(workers - 1)]
    for th in threads:
        th.start()
    run()
    for th in threads:
        th.join()
    if failed:
        raise failed[0]


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


load_gbs(1)
import zlib
from concurrent.futures import ThreadPoolExecutor
real_crc, real_check, real_copy = stream.crc32, stream._check, cuda_load._copy_window
for rnd in range(2):
    for name, crc, check, copy in [("ring as is", real_crc, real_check, real_copy),
                                   ("ring, no CRC", lambda d, v=0: 0, lambda *a: None, real_copy),
                                   ("ring, no copies", real_crc, real_check, lambda *a: []),
                                   ("ring, no CRC no copies", lambda d, v=0: 0, lambda *a: None, lambda *a: [])]:
        stream.crc32, stream._check, cuda_load._copy_window = crc, check, copy
        r = load_gbs()
        print(f"round {rnd} {name:24s}: " + " ".join(f"{g:5.1f}" for g in r) + f" GB/s (best {max(r):.1f})", flush=True)
stream.crc32, stream._check, cuda_load._copy_window = real_crc, real_check, real_copy
fd = os.open(path, os.O_RDONLY)
n = os.fstat(fd).st_size
for workers in (8, 12, 16):
    for piece in (8 * 2**20, 16 * 2**20):
        bufs = [torch.empty(piece, dtype=torch.uint8, pin_memory=True).numpy() for _ in range(workers)]
        per = -(-n // workers)
        def job(w, crc):
            b, lo, hi, c = bufs[w], w * per, min(n, (w + 1) * per), 0
            while lo < hi:
                k = os.preadv(fd, [b[:min(piece, hi - lo)]], lo)
                if crc:
                    c = real_crc(b[:k], c)
                lo += k
        for crc in (False, True):
            with ThreadPoolExecutor(workers) as pool:
                t = time.perf_counter()
                list(pool.map(lambda w: job(w, crc), range(workers)))
                dt = time.perf_counter() - t
            print(f"raw preadv {piece >> 20} MiB pieces, {workers} threads{', +CRC' if crc else ''}: {n / dt / 1e9:.1f} GB/s", flush=True)
os.close(fd)
os.remove(path)
