"""Thread policy from recorded host facts (affinity, cgroup quota, SMT, NUMA), and applying it."""

from __future__ import annotations

import os

import pytest
import torch

from torchplace import configure_threads
from torchplace.errors import DeviceError
from torchplace.hardware.host import HostFacts, cgroup_cpu_limit, cpu_cores, numa_nodes, parse_cpulist
from torchplace.policy.threads import (
    ThreadPlan,
    apply_plan,
    cpu_span,
    env_local_world_size,
    oversubscription,
    plan_threads,
)

# a 2-socket host as Linux numbers it: 2 x 16 cores x 2 hardware threads; CPU n and n+32 are SMT
# siblings (same (package, core)); NUMA node 0 = CPUs 0-15 and 32-47, node 1 = the rest
SMT_CORES = {cpu: (cpu // 16 % 2, cpu % 16) for cpu in range(64)}
TWO_NODES = {0: list(range(0, 16)) + list(range(32, 48)), 1: list(range(16, 32)) + list(range(48, 64))}


def host(cpus=64, affinity=None, quota=None) -> HostFacts:
    return HostFacts(cpu_count=cpus, affinity=list(range(cpus)) if affinity is None else affinity,
                     cgroup_cpu_limit=quota)


def test_cgroup_quota_below_affinity_sets_the_thread_count():
    plan = plan_threads(host(64, quota=16.0))
    assert plan.intra_op == 16 and plan.inter_op == 1 and plan.usable_cpus == 16
    assert plan.env == {"OMP_NUM_THREADS": "16", "MKL_NUM_THREADS": "16"}
    assert "cgroup CPU quota (16 CPUs)" in plan.notes[0]


def test_fractional_quota_and_affinity():
    assert plan_threads(host(64, quota=2.5)).intra_op == 3  # the quota rounds up, as host.usable_cpus does
    assert plan_threads(host(64, affinity=[4, 5, 6, 7])).intra_op == 4
    assert plan_threads(host(64, affinity=[4, 5, 6, 7], quota=2.0)).intra_op == 2


def test_local_ranks_share_the_cpus():
    assert plan_threads(host(64, quota=16.0), local_world_size=4).intra_op == 4
    assert plan_threads(host(64), local_world_size=8).intra_op == 8
    crowded = plan_threads(host(4), local_world_size=8)
    assert crowded.intra_op == 1 and "8 processes share 4 CPU(s)" in crowded.notes[-1]


def test_smt_siblings_count_once():
    plan = plan_threads(host(64), cores=SMT_CORES)
    assert plan.physical_cores == 32 and plan.intra_op == 32
    assert "64 usable CPUs are 32 physical cores" in plan.notes[0]
    assert plan_threads(host(64, affinity=list(range(16)) + list(range(32, 48))), cores=SMT_CORES).intra_op == 16


def test_explicit_counts_are_respected_with_a_note():
    plan = plan_threads(host(8), intra_op=32, inter_op=2)
    assert (plan.intra_op, plan.inter_op) == (32, 2)
    assert "intra_op=32 was requested; 8 is this process's share" in plan.notes[0]
    with pytest.raises(ValueError, match="local_world_size=0"):
        plan_threads(host(8), local_world_size=0)


def test_numa_report_and_binding_near_a_gpu():
    gpu_cpus = TWO_NODES[1]
    plan = plan_threads(host(64), numa=TWO_NODES, cores=SMT_CORES, gpu_cpus=gpu_cpus, bind=True, local_world_size=2)
    assert plan.gpu_numa_node == 1 and plan.bind_cpus == sorted(gpu_cpus)
    assert plan.intra_op == 8  # 16 cores on the node / 2 ranks
    assert plan.process_numa_nodes == [1]
    unbound = plan_threads(host(64), numa=TWO_NODES, gpu_cpus=gpu_cpus)
    assert unbound.bind_cpus is None and unbound.process_numa_nodes == [0, 1] and unbound.gpu_numa_node == 1


def test_binding_impossible_is_explained():
    plan = plan_threads(host(64, affinity=list(range(16))), numa=TWO_NODES, gpu_cpus=TWO_NODES[1], bind=True)
    assert plan.bind_cpus is None
    assert "none of the GPU's CPUs (16-31,48-63) are in this process's affinity (0-15)" in plan.notes[-1]
    assert "GPU's CPU affinity is unknown" in plan_threads(host(8), bind=True).notes[-1]


def test_local_world_size_and_oversubscription_helpers():
    assert env_local_world_size({"LOCAL_WORLD_SIZE": "4"}) == 4
    assert env_local_world_size({"SLURM_NTASKS_PER_NODE": "2"}) == 2
    assert env_local_world_size({"LOCAL_WORLD_SIZE": "x"}) == 1
    assert oversubscription(8, 2, 16) is None
    assert "4 process(es) x 16 thread(s) = 64 threads on 16 usable CPU(s)" in oversubscription(16, 4, 16)
    assert cpu_span([0, 1, 2, 3, 8, 10, 11]) == "0-3,8,10-11"


def test_sysfs_readers_on_a_recorded_tree(tmp_path):
    for node, cpus in {0: "0-3,8-11", 1: "4-7,12-15"}.items():
        (tmp_path / "node" / f"node{node}").mkdir(parents=True)
        (tmp_path / "node" / f"node{node}" / "cpulist").write_text(cpus + "\n")
    for cpu in range(4):
        topo = tmp_path / "cpu" / f"cpu{cpu}" / "topology"
        topo.mkdir(parents=True)
        (topo / "core_id").write_text(str(cpu % 2))
        (topo / "physical_package_id").write_text("0")
    assert numa_nodes(tmp_path / "node") == {0: [0, 1, 2, 3, 8, 9, 10, 11], 1: [4, 5, 6, 7, 12, 13, 14, 15]}
    assert cpu_cores(tmp_path / "cpu") == {0: (0, 0), 1: (0, 1), 2: (0, 0), 3: (0, 1)}
    assert numa_nodes(tmp_path / "missing") is None
    assert parse_cpulist("0-2,x") == []
    cg = tmp_path / "cg"
    cg.mkdir()
    (cg / "cpu.max").write_text("150000 100000\n")
    (tmp_path / "self_cgroup").write_text("0::/\n")
    assert cgroup_cpu_limit(cg, tmp_path / "self_cgroup") == 1.5


def test_configure_threads_applies_the_plan(restore_threads):
    plan = configure_threads(intra_op=1, local_world_size=1)
    assert torch.get_num_threads() == 1 and plan.applied["intra_op"] == 1
    assert os.environ["OMP_NUM_THREADS"] == "1" == os.environ["MKL_NUM_THREADS"]
    assert plan.applied["inter_op"] == torch.get_num_interop_threads()
    if torch.get_num_interop_threads() != plan.inter_op:  # torch sizes the pool only once per process
        assert any("inter-op threads left at" in note for note in plan.notes)
    assert plan.usable_cpus == len(os.sched_getaffinity(0)) or plan.usable_cpus < len(os.sched_getaffinity(0))


def test_binding_moves_every_thread(restore_threads):
    torch.ones(64, 64) @ torch.ones(64, 64)  # make sure torch's worker threads exist
    original = os.sched_getaffinity(0)
    target = [min(original)]
    plan = ThreadPlan(usable_cpus=1, physical_cores=None, local_world_size=1, intra_op=1, inter_op=1,
                      env={}, bind_cpus=target)
    tids = os.listdir("/proc/self/task")
    try:
        apply_plan(plan, set_env=False)
        assert plan.applied["bound_threads"] >= 1
        assert all(os.sched_getaffinity(int(t)) == set(target) for t in tids if os.path.exists(f"/proc/self/task/{t}"))
    finally:
        for t in os.listdir("/proc/self/task"):
            try:
                os.sched_setaffinity(int(t), original)
            except OSError:
                pass


def test_a_gpu_that_is_not_visible_is_explained():
    with pytest.raises(DeviceError, match=r"names cuda:99, but .*Fix: pass one of the visible devices"):
        configure_threads(gpu="cuda:99", set_env=False)
    with pytest.raises(DeviceError, match="a CUDA device is needed"):
        configure_threads(gpu="cpu", set_env=False)
