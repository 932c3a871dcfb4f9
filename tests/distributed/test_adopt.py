"""torchplace.dist.init() and setup() adopt a process group another library made.

Lightning Fabric and Accelerate make the default group themselves; init() used to refuse with
"a default process group already exists". It now takes the group on (`info.adopted`), runs its
health check on it, and leaves it to its maker at teardown.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest
import torch.distributed as dist

from torchplace import dist as tpdist


def _ranks(outdir) -> list[dict]:
    return sorted((json.loads(p.read_text()) for p in outdir.glob("rank*.json")), key=lambda r: r["rank"])


def test_a_group_of_one_made_by_torch_is_adopted_and_left_to_its_maker(tmp_path):
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        info = tpdist.init()
        assert (info.adopted, info.rank, info.world_size, info.backend, str(info.device)) == (True, 0, 1, "gloo", "cpu")
        assert tpdist.init() is info  # a second call returns the same record
        assert tpdist.health_check(timeout=120).world_size == 1
        tpdist.teardown()
        assert dist.is_initialized()  # not ours to destroy
    finally:
        tpdist.teardown()
        dist.destroy_process_group()


@pytest.mark.slow
def test_a_group_made_with_init_process_group_under_torchrun(run_cli, scripts, child_env, tmp_path):
    out = run_cli(["run", "--gpus", "none", "--nproc", "2", "--", sys.executable,
                   str(scripts / "adopt_worker.py"), "torch", str(tmp_path)], env=child_env())
    ranks = _ranks(tmp_path)
    assert [r["rank"] for r in ranks] == [0, 1], out.stderr[-2000:]
    for r in ranks:
        assert r["adopted"] and r["world_size"] == 2 and r["backend"] == "gloo" and r["device"] == "cpu"
        assert r["setup_rank"] == r["rank"] and r["all_reduce"] == 3.0 and r["health_world"] == 2
    assert out.returncode == 0, out.stderr[-2000:]


@pytest.mark.slow
def test_init_inside_a_fabric_launched_two_process_cpu_job(scripts, child_env, tmp_path):
    if importlib.util.find_spec("lightning") is None:  # not imported here: it sets environment variables
        pytest.skip("Lightning is not installed (pip install lightning)")
    out = subprocess.run([sys.executable, str(scripts / "adopt_worker.py"), "fabric", str(tmp_path)],
                         capture_output=True, text=True, env=child_env(), cwd=tmp_path, timeout=180)
    ranks = _ranks(tmp_path)
    assert [r["rank"] for r in ranks] == [0, 1], out.stderr[-3000:]
    for r in ranks:
        assert r["adopted"] and r["world_size"] == 2 and r["device"] == "cpu" and r["setup_device"] == "cpu"
        assert r["all_reduce"] == 3.0 and r["health_world"] == 2
    assert out.returncode == 0, out.stderr[-2000:]


def test_ranks_started_by_mp_spawn_are_counted_on_their_host(scripts, child_env, tmp_path):
    """imagenet's mp.spawn + init_process_group sets no LOCAL_* variables: setup() planned threads for 1 local
    process (2 intra-op threads each on a 2-CPU machine) and said local rank None."""
    from ports import free_port

    env = {k: v for k, v in child_env().items() if k != "OMP_NUM_THREADS"}  # torchplace plans the threads
    out = subprocess.run([sys.executable, str(scripts / "adopt_worker.py"), "spawn", str(tmp_path), str(free_port())],
                         capture_output=True, text=True, env=env, cwd=tmp_path, timeout=180)
    ranks = _ranks(tmp_path)
    assert [r["rank"] for r in ranks] == [0, 1], out.stderr[-3000:]
    for r in ranks:
        assert r["adopted"] and r["local"] == [r["rank"], 2] and r["all_reduce"] == 3.0
        assert "over 2 local process(es)" in r["threads"], r["threads"]
    assert out.returncode == 0, out.stderr[-2000:]
