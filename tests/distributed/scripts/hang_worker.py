"""A rank of a job where one rank never enters a collective (started by `torchplace run`).

argv[1]: "nccl" (the GPU case: the watchdog times out after argv[2] seconds and torch dumps every
rank's flight record) or "gloo" (the CPU case: no watchdog dump, so each rank dumps its own record
with torchplace's dump_here before the lagging rank waits). argv[3]: "health" to have the others
name the stuck rank with health_check first. Every rank prints its pid as a JSON line.
"""

import json
import os
import sys
import time

import torch
import torch.distributed as dist

import torchplace
from torchplace.distributed.flight_recorder import dump_here

backend, timeout_s, mode = sys.argv[1], float(sys.argv[2]), sys.argv[3] if len(sys.argv) > 3 else ""
info = torchplace.dist.init(timeout=timeout_s, join_timeout=120)
os.write(1, (json.dumps({"rank": info.rank, "pid": os.getpid(), "device": str(info.device)}) + "\n").encode())
value = torch.ones(1024, device=info.device)
for _ in range(3):
    dist.all_reduce(value)
if info.device.type == "cuda":
    torch.cuda.synchronize()
folder = os.path.dirname(os.environ["TORCH_FR_DUMP_TEMP_FILE"])
if info.rank == 1:  # the rank that never enters the next collective
    if backend == "gloo":
        time.sleep(0.5)
        dump_here(folder, info.rank)
    time.sleep(3600)
if mode == "health":
    try:
        torchplace.dist.health_check(timeout=timeout_s)
    except torchplace.DistributedError as exc:
        os.write(1, (json.dumps({"rank": info.rank, "error": str(exc)}) + "\n").encode())
        sys.exit(3)
work = dist.all_reduce(value, async_op=True)  # rank 1 never enters this one (#4)
if backend == "gloo":
    time.sleep(1.0)
    dump_here(folder, info.rank)
    sys.exit(3)
work.wait()  # NCCL: the watchdog times out, every rank dumps, this process is torn down
if info.device.type == "cuda":
    torch.cuda.synchronize()
sys.exit(5)  # not reached when the watchdog works
