"""Picking rules on the real H200 snapshots (and an 8-GPU topology derived from them)."""

from __future__ import annotations

import dataclasses
import random
import subprocess
import sys
import threading

import pytest
from snapshots import load_snapshot_dict

from torchplace.distributed.leases import LeaseDir
from torchplace.distributed.pick import pick
from torchplace.errors import LeaseError
from torchplace.hardware.topology import GpuProcess, Topology
from torchplace.policy.ranking import rank_gpus

GIB = 2**30


def changed(topo: Topology, index: int, **fields) -> Topology:
    """A copy of `topo` with GPU `index`'s readings replaced (the others stay as captured)."""
    gpus = [dataclasses.replace(g, **fields) if g.physical_index == index else g for g in topo.gpus]
    return dataclasses.replace(topo, gpus=gpus)


def test_idle_pair_picks_by_uuid_in_bus_order(h200x2, lease_dir):
    with pick(2, topology=h200x2) as picked:
        assert picked.physical_indices == [0, 1]
        assert picked.cuda_visible_devices == ",".join(g.uuid for g in h200x2.gpus)
        assert picked.env() == {"CUDA_VISIBLE_DEVICES": picked.cuda_visible_devices,
                                "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
        assert picked.to_dict()["leased"] and not picked.rejected


def test_min_free_memory_skips_a_full_gpu(h200x2, lease_dir):
    topo = changed(h200x2, 0, memory_free_bytes=10 * GIB)
    ordered, rejected = rank_gpus(topo, min_free_memory=20 * GIB, environ={})
    assert [g.physical_index for g in ordered] == [1]
    assert rejected[0].physical_index == 0
    assert rejected[0].reason == "10.0 GiB free < 20.0 GiB required"
    assert pick(1, topology=topo, min_free_memory="20GiB").physical_indices == [1]


def test_max_utilization_skips_a_busy_gpu(h200x2):
    _, rejected = rank_gpus(changed(h200x2, 1, utilization=95), max_utilization=30, environ={})
    assert [(r.physical_index, r.reason) for r in rejected] == [(1, "95% utilization > 30% allowed")]


def test_unknown_readings_fail_an_explicit_threshold(h200x2):
    topo = changed(h200x2, 0, memory_free_bytes=None, unknown={"memory": "Not Supported"})
    _, rejected = rank_gpus(topo, min_free_memory=GIB, environ={})
    assert rejected[0].reason == "free memory is unknown (Not Supported)"


def test_other_users_processes_rank_a_gpu_last(h200x2):
    busy = changed(h200x2, 0, processes=[GpuProcess(pid=4242, used_memory_bytes=GIB, user="someone-else")])
    for seed in range(20):
        ordered, _ = rank_gpus(busy, user="me", rng=random.Random(seed), environ={})
        assert [g.physical_index for g in ordered] == [1, 0]


def test_more_free_memory_ranks_first(h200x2):
    topo = changed(h200x2, 0, memory_free_bytes=50 * GIB)
    ordered, _ = rank_gpus(topo, environ={})
    assert [g.physical_index for g in ordered] == [1, 0]


def test_mig_enabled_gpu_is_not_handed_out(h200x2):
    _, rejected = rank_gpus(changed(h200x2, 1, mig_mode="enabled"), environ={})
    assert rejected[0].physical_index == 1 and "MIG mode is enabled" in rejected[0].reason


def test_ties_do_not_pile_onto_gpu_0(h200x8, lease_dir):
    firsts = [pick(1, topology=h200x8, lease=False, seed=seed).physical_indices[0] for seed in range(40)]
    assert len(set(firsts)) >= 4  # a "least used" picker would answer 0 forty times
    assert firsts.count(0) < 20


def test_concurrent_picks_in_one_process_get_different_gpus(h200x2, lease_dir):
    first = pick(1, topology=h200x2)
    second = pick(1, topology=h200x2)
    assert {first.uuids[0], second.uuids[0]} == {g.uuid for g in h200x2.gpus}
    with pytest.raises(LeaseError, match=r"Cannot pick 1 GPU in h200x2.json: .*leased by this process"):
        pick(1, topology=h200x2)
    first.release()
    assert pick(1, topology=h200x2).uuids == first.uuids


def test_more_gpus_than_the_machine_has(h200x2, lease_dir):
    with pytest.raises(LeaseError, match=r"3 GPUs were requested, but h200x2.json has 2: GPU 0 \(NVIDIA H200"):
        pick(3, topology=h200x2)


def test_explicit_gpus_by_index_and_uuid_prefix(h200x2, lease_dir):
    uuid1 = h200x2.gpus[1].uuid
    with pick(gpus=[uuid1[:12]], topology=h200x2) as picked:
        assert picked.uuids == [uuid1]
    with pick(gpus=["0"], topology=h200x2) as picked:
        assert picked.physical_indices == [0]
    with pytest.raises(LeaseError, match=r"GPU 5 was requested, but this machine has GPU 0 .*GPU 1 "):
        pick(gpus=[5], topology=h200x2)
    with pytest.raises(LeaseError, match="requested twice"):
        pick(gpus=[0, h200x2.gpus[0].uuid], topology=h200x2)
    with pytest.raises(LeaseError, match="'GPU-zzz' matches no GPU"):
        pick(gpus=["GPU-zzz"], topology=h200x2)


def test_existing_cuda_visible_devices_allocation_is_respected(h200x2, lease_dir, monkeypatch):
    allowed = h200x2.gpus[1].uuid
    _, rejected = rank_gpus(h200x2, environ={"CUDA_VISIBLE_DEVICES": allowed})
    assert rejected[0].physical_index == 0 and "hidden by CUDA_VISIBLE_DEVICES" in rejected[0].reason
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    monkeypatch.setenv("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    assert pick(1, topology=h200x2).uuids == [allowed]


def test_wait_times_out_and_says_what_it_waits_for(h200x2, lease_dir):
    held = LeaseDir().try_acquire(h200x2.gpus[0].uuid)
    notices: list[str] = []
    with pytest.raises(LeaseError, match=r"after waiting 0 s .*GPU 0 \(GPU-7fbb.*\): leased by this process"):
        pick(gpus=[0], topology=h200x2, wait=0.3, on_wait=notices.append)
    assert notices and notices[0].startswith("waiting up to 0 s for GPUs GPU-7fbb")
    assert "leased by this process" in notices[0]
    held.release()


def test_wait_succeeds_when_the_holder_dies(h200x2, lease_dir, scripts, child_env):
    uuid = h200x2.gpus[0].uuid
    holder = subprocess.Popen([sys.executable, str(scripts / "hold_lease.py"), uuid], stdout=subprocess.PIPE,
                              text=True, env=child_env(TORCHPLACE_LEASE_DIR=str(lease_dir)))
    assert holder.stdout.readline().strip() == "HELD"
    notices: list[str] = []
    killer = threading.Timer(0.5, holder.kill)
    killer.start()
    try:
        picked = pick(gpus=[0], topology=h200x2, wait=60, on_wait=notices.append)
    finally:
        killer.cancel()
        holder.kill()
        holder.wait()
    assert picked.uuids == [uuid]
    assert f"leased by pid {holder.pid}" in notices[0] and "hold_lease.py test holder" in notices[0]


def test_auto_takes_every_free_gpu(h200x8, lease_dir):
    held = [LeaseDir().try_acquire(h200x8.gpus[i].uuid) for i in (0, 3, 5)]
    picked = pick("auto", topology=h200x8)
    assert picked.physical_indices == [1, 2, 4, 6, 7]
    for lease in held:
        lease.release()


def test_no_gpus_says_why(lease_dir):
    empty = Topology(nvml_error="NVML unavailable: Driver Not Loaded", source="live")
    with pytest.raises(LeaseError,
                       match=r"No GPUs to pick from on this machine \(NVML unavailable: Driver Not Loaded\)"):
        pick(1, topology=empty)


@pytest.mark.parametrize("count", [0, -1, "two"])
def test_bad_count(count, h200x2):
    with pytest.raises(LeaseError, match="must be a whole number >= 1 or 'auto'"):
        pick(count, topology=h200x2)


def test_apply_sets_both_variables(h200x2, lease_dir):
    env: dict[str, str] = {}
    with pick(1, topology=h200x2) as picked:
        picked.apply(env)
    assert env == picked.env()


def test_child_inherits_a_lease_held_by_its_parent(h200x2, h200x2_file, lease_dir, child_env):
    uuid = h200x2.gpus[0].uuid
    held = LeaseDir().try_acquire(uuid)  # this test process is the child's parent
    code = ("from torchplace.distributed.pick import pick\n"
            f"p = pick(gpus=[0], snapshot={str(h200x2_file)!r})\n"
            "print(p.uuids[0], p.gpus[0].inherited)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env=child_env(TORCHPLACE_LEASE_DIR=str(lease_dir), CUDA_VISIBLE_DEVICES=uuid))
    # without the hand-over (CUDA_VISIBLE_DEVICES naming the GPU), the parent's lease is not ours
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                           env=child_env(TORCHPLACE_LEASE_DIR=str(lease_dir)))
    held.release()
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [uuid, "True"]
    assert other.returncode != 0 and "leased by pid" in other.stderr


def test_one_gpu_machine(lease_dir):
    one = Topology.from_dict(load_snapshot_dict("h200x1"), source="h200x1.json")
    with pick(1, topology=one) as picked:
        assert picked.uuids == [one.gpus[0].uuid]
        with pytest.raises(LeaseError, match=r"Cannot pick 1 GPU in h200x1.json: GPU 0 .*leased by this process"):
            pick(1, topology=one)
    with pytest.raises(LeaseError, match=r"2 GPUs were requested, but h200x1.json has 1: GPU 0 \(NVIDIA H200"):
        pick(2, topology=one)
