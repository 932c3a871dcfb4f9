"""A rank of a test job (started by torchrun through `torchplace run`, or by hand).

argv[1] is the scenario:
  ok [EXIT_RANK EXIT_CODE]  init, all-reduce, health check, stragglers; one rank may then exit non-zero
  sleep RANK                init, then RANK sleeps forever while the others run a 4 s health check
  init                      only init (with a 3 s join timeout), for bad-environment cases
Each rank prints one JSON line.
"""

import json
import os
import sys
import time

import torch
import torch.distributed as dist

import torchplace
from torchplace.doctor.diagnose import diagnose  # what `torchplace doctor` reports inside the job


def say(record: dict) -> None:
    """One JSON line in one write(), so lines of ranks sharing a pipe never interleave."""
    os.write(1, (json.dumps(record) + "\n").encode())


scenario = sys.argv[1]
try:
    # a rank that waits for others that never come gives up after JOIN_S (argv[2] of "init"); else a hang detector
    info = torchplace.dist.init(join_timeout=float(sys.argv[2]) if scenario == "init" else 120)
except torchplace.DistributedError as exc:
    say({"rank": os.environ.get("RANK"), "error": str(exc)})
    sys.exit(4)
record = {"rank": info.rank, "world_size": info.world_size, "local_rank": info.local_rank,
          "node_rank": info.node_rank, "device": str(info.device), "backend": info.backend,
          "launcher": info.launcher, "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
          "nccl_nvls_enable": os.environ.get("NCCL_NVLS_ENABLE")}
if info.device.type == "cuda":  # the physical GPU behind this rank's device, as CUDA sees it
    record["gpu_uuid"] = f"GPU-{torch.cuda.get_device_properties(info.device).uuid}"
    record["current_device"] = torch.cuda.current_device()
if scenario == "init":
    say(record)
    sys.exit(0)
if scenario == "sleep":
    say({**record, "phase": "joined"})
    if info.rank == int(sys.argv[2]):
        time.sleep(3600)
    try:
        torchplace.dist.health_check(timeout=4)
    except torchplace.DistributedError as exc:
        say({"rank": info.rank, "error": str(exc)})
        sys.exit(3)
    sys.exit(0)
value = torch.tensor([float(info.rank + 1)], device=info.device)
dist.all_reduce(value)
record["all_reduce"] = value.item()
record["health_world"] = torchplace.dist.health_check(timeout=120).world_size
report = torchplace.dist.stragglers([0.1, 0.1] if info.rank != 1 else [0.3, 0.5])
record["slow_ranks"] = report.slow_ranks
record["step_times"] = report.step_times_s
record["attempt"], record["restarted"] = info.attempt, info.restarted
record["doctor"] = [f.to_dict() for f in diagnose().findings if f.id.startswith("launch.")]
say(record)
torchplace.dist.teardown()
if len(sys.argv) > 3 and info.rank == int(sys.argv[2]):
    sys.exit(int(sys.argv[3]))
