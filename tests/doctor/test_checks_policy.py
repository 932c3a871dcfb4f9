"""Doctor's policy findings on facts built from the real H200 snapshot, one test per check."""

from __future__ import annotations

import copy

from snapshots import load_snapshot_dict

from torchplace import Facts
from torchplace.doctor.checks_policy import check_bf16_emulated, check_numa_placement, check_thread_oversubscription


def facts(env=None, capability=None, gpu_cpus=None, **host) -> Facts:
    data = copy.deepcopy(load_snapshot_dict("h200x2"))
    for gpu, cc in zip(data["gpus"], capability or []):
        gpu["compute_capability"], gpu["name"] = list(cc), f"GPU cc {cc[0]}.{cc[1]}"
    for gpu, cpus in zip(data["gpus"], gpu_cpus or []):
        gpu["cpu_affinity"] = cpus
    data["host"] = {"cpu_count": 32, "affinity": list(range(32)), "usable_cpus": 32, **host}
    return Facts.from_dict(data, env=env or {})


def test_h200_snapshot_has_no_policy_findings():
    f = facts({"TORCHPLACE_PRECISION": "bf16", "OMP_NUM_THREADS": "8", "LOCAL_WORLD_SIZE": "2"})
    assert check_bf16_emulated(f) + check_thread_oversubscription(f) + check_numa_placement(f) == []


def test_bf16_requested_on_emulating_gpus_warns():
    found = check_bf16_emulated(facts({"TORCHPLACE_PRECISION": "bf16"}, capability=[(7, 5), (9, 0)]))
    assert [x.id for x in found] == ["policy.bf16_emulated"] and found[0].severity == "warning"
    assert "cuda:0 = physical 0 (GPU cc 7.5, compute capability 7.5)" in found[0].detail
    assert "cuda:1" not in found[0].detail and "TORCHPLACE_PRECISION=fp16" in found[0].fix


def test_accelerate_launch_request_is_read_too():
    f = facts(capability=[(7, 0), (7, 0)])
    f.env["ACCELERATE_MIXED_PRECISION"] = "bf16"  # what `accelerate launch --mixed_precision bf16` exports
    found = check_bf16_emulated(f)
    assert [x.id for x in found] == ["policy.bf16_emulated"] and "ACCELERATE_MIXED_PRECISION=fp16" in found[0].fix
    f.env["ACCELERATE_MIXED_PRECISION"] = "no"
    assert [x.id for x in check_bf16_emulated(f)] == ["policy.bf16_emulated_gpus"]


def test_emulating_gpus_without_a_request_are_info():
    found = check_bf16_emulated(facts({"TORCHPLACE_PRECISION": "fp16"}, capability=[(7, 0), (7, 0)]))
    assert [x.id for x in found] == ["policy.bf16_emulated_gpus"] and found[0].severity == "info"
    hidden = facts({"CUDA_VISIBLE_DEVICES": "1", "TORCHPLACE_PRECISION": "bf16"}, capability=[(7, 0), (9, 0)])
    assert check_bf16_emulated(hidden) == []  # only visible GPUs count


def test_threads_unset_under_a_cgroup_quota():
    found = check_thread_oversubscription(facts(usable_cpus=8, cgroup_cpu_limit=8.0))
    assert [x.id for x in found] == ["policy.threads_oversubscribed"]
    assert "one thread per CPU it sees (32), not per CPU the cgroup quota (8) allows" in found[0].detail
    assert "OMP_NUM_THREADS=8" in found[0].fix


def test_threads_times_local_ranks():
    found = check_thread_oversubscription(facts({"OMP_NUM_THREADS": "16", "LOCAL_WORLD_SIZE": "4"}))
    assert "4 process(es) x 16 thread(s) = 64 threads on 32 usable CPU(s)" in found[0].detail
    assert "OMP_NUM_THREADS=8" in found[0].fix
    # above the usable CPUs for one process: host.omp_oversubscribed reports it, not this check
    assert check_thread_oversubscription(facts({"OMP_NUM_THREADS": "64"})) == []


def test_process_far_from_its_gpu():
    gpu_cpus = [list(range(16)), list(range(16, 32))]
    far = facts({"LOCAL_RANK": "1"}, gpu_cpus=gpu_cpus, affinity=list(range(8)))
    found = check_numa_placement(far)
    assert [x.id for x in found] == ["policy.numa_mismatch"]
    assert "CPUs 0-7, none of which are near cuda:1 = physical 1" in found[0].detail
    assert "taskset -c 16-31" in found[0].fix
    unbound = check_numa_placement(facts(gpu_cpus=gpu_cpus))
    assert [x.id for x in unbound] == ["policy.numa_unbound"] and "bind=True" in unbound[0].fix
    assert check_numa_placement(facts({"LOCAL_RANK": "0"}, gpu_cpus=gpu_cpus, affinity=list(range(16)))) == []
