"""A worker whose process group another library made; torchplace adopts it.

Usage: adopt_worker.py torch|fabric OUTDIR. Writes OUTDIR/rank<N>.json per rank: what torchplace.dist.init()
and setup() saw, an all_reduce on the adopted group, and a health check run on it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

import torchplace
from torchplace import dist as tpdist


def main(maker: str, outdir: Path) -> None:
    if maker == "fabric":
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
                      "health_world": report.world_size}))
    tpdist.teardown()
    assert dist.is_initialized(), "teardown destroyed a group torchplace did not make"
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
