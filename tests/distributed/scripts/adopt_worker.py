"""A worker whose process group another library made; torchplace adopts it.

Usage: adopt_worker.py torch|fabric|spawn OUTDIR [PORT]. Writes OUTDIR/rank<N>.json per rank: what
torchplace.dist.init() and setup() saw, an all_reduce on the adopted group, and a health check run on it. spawn:
two processes of torch.multiprocessing.spawn joining at 127.0.0.1:PORT (imagenet's --multiprocessing-distributed).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

import torchplace
from torchplace import dist as tpdist


def spawned(index: int, outdir: Path, port: int) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=index, world_size=2)
    main("spawned", outdir)


def main(maker: str, outdir: Path) -> None:
    if maker == "spawn":
        import torch.multiprocessing as mp

        mp.spawn(spawned, nprocs=2, args=(outdir, int(sys.argv[3])))
        return
    if maker == "spawned":
        pass
    elif maker == "fabric":
        from lightning.fabric import Fabric

        fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp")
        fabric.launch()  # starts the second process and makes the gloo group
    else:
        dist.init_process_group("gloo")
    info = tpdist.init()
    again = torchplace.setup(verbose=False)
    value = torch.tensor([float(info.rank + 1)])
    dist.all_reduce(value)
    report = tpdist.health_check(timeout=120)
    (outdir / f"rank{info.rank}.json").write_text(json.dumps({
                      "rank": info.rank, "world_size": info.world_size, "adopted": info.adopted,
                      "backend": info.backend, "device": str(info.device), "setup_rank": again.rank,
                      "setup_device": str(again.device), "all_reduce": value.item(),
                      "health_world": report.world_size, "local": [info.local_rank, info.local_world_size],
                      "threads": next(line for line in again.decisions if line.startswith("threads:"))}))
    tpdist.teardown()
    assert dist.is_initialized(), "teardown destroyed a group torchplace did not make"
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
