"""GPU twins of test_run/test_group (run on the 2 x H200 machine: pytest -m gpu tests/distributed).

`torchplace run --gpus 2` with NCCL: each rank on its own leased GPU, cuda:LOCAL_RANK, the
backend "cpu:gloo,cuda:nccl", a health check over NCCL, and NCCL_NVLS_ENABLE passed through.
"""

from __future__ import annotations

import json
import os
import sys

import pytest

pytestmark = [pytest.mark.gpu]


def jsonl(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


@pytest.mark.multigpu
def test_two_ranks_with_nccl_each_on_its_own_gpu(run_cli, scripts, child_env, lease_dir):
    env = child_env(TORCHPLACE_LEASE_DIR=str(lease_dir))
    out = run_cli(["run", "--gpus", "2", "--", sys.executable, str(scripts / "dist_worker.py"), "ok"],
                  env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    ranks = sorted(jsonl(out.stdout), key=lambda r: r["rank"])
    assert [r["rank"] for r in ranks] == [0, 1]
    visible = ranks[0]["cuda_visible_devices"].split(",")
    assert len(visible) == 2 and all(u.startswith("GPU-") for u in visible)
    for r in ranks:
        assert r["cuda_visible_devices"] == ",".join(visible)
        assert r["device"] == f"cuda:{r['local_rank']}" and r["current_device"] == r["local_rank"]
        assert r["backend"] == "cpu:gloo,cuda:nccl" and r["launcher"] == "torchrun"
        assert r["gpu_uuid"] == visible[r["local_rank"]]  # rank k runs on the k-th leased GPU
        assert r["all_reduce"] == 3.0 and r["health_world"] == 2 and r["slow_ranks"] == [1]
        assert r["nccl_nvls_enable"] == os.environ.get("NCCL_NVLS_ENABLE")
    assert ranks[0]["gpu_uuid"] != ranks[1]["gpu_uuid"]


def test_one_gpu_job_sees_exactly_its_leased_gpu(run_cli, child_env, lease_dir):
    job = ("import json, os, torch\n"
           "p = torch.cuda.get_device_properties(0)\n"
           "print(json.dumps({'count': torch.cuda.device_count(), 'uuid': f'GPU-{p.uuid}',"
           " 'cvd': os.environ['CUDA_VISIBLE_DEVICES']}))\n")
    out = run_cli(["run", "--gpus", "1", "--", sys.executable, "-c", job],
                  env=child_env(TORCHPLACE_LEASE_DIR=str(lease_dir)), timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    [seen] = jsonl(out.stdout)
    assert seen["count"] == 1 and seen["uuid"] == seen["cvd"]


@pytest.mark.multigpu
def test_live_pick_names_real_gpus_without_starting_cuda(child_env, lease_dir):
    import subprocess

    from torchplace.hardware.topology import read_topology

    code = ("import contextlib, io, json, sys\n"
            "from torchplace.cli import main\n"
            "out = io.StringIO()\n"
            "with contextlib.redirect_stdout(out):\n"
            "    main(['pick', '--count', '2', '--json'])\n"
            "maps = open('/proc/self/maps').read()\n"
            "print(json.dumps({'picked': json.loads(out.getvalue()), 'torch': 'torch' in sys.modules,"
            " 'libcuda': 'libcuda.so' in maps}))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env=child_env(TORCHPLACE_LEASE_DIR=str(lease_dir)))
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout)
    # NVML only: torch never imported, so no CUDA context. (NVML itself maps libcuda.so on
    # driver 580 — seen on the 2 x H200 run of 2026-11-29 — without initializing CUDA.)
    assert not seen["torch"]
    assert {g["uuid"] for g in seen["picked"]["gpus"]} <= {g.uuid for g in read_topology().gpus}
    assert seen["picked"]["source"] == "live" and len(seen["picked"]["gpus"]) == 2


def test_local_rank_beyond_the_visible_gpus_is_named():
    import torch

    from torchplace import dist as tdist
    from torchplace.errors import DistributedError

    count = torch.cuda.device_count()
    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": str(count)}
    with pytest.raises(DistributedError, match=rf"LOCAL_RANK={count} selects cuda:{count}, but only {count} cuda"):
        tdist.init(env=env)
    env = {"RANK": "0", "WORLD_SIZE": str(count + 2), "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": str(count + 2),
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999"}
    with pytest.raises(DistributedError, match=rf"LOCAL_WORLD_SIZE={count + 2} processes run on this node but only"):
        tdist.init(env=env)
    assert not torch.distributed.is_initialized()
