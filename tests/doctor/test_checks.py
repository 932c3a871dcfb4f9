"""One test per doctor check, on facts built from the real H200 snapshot."""

from __future__ import annotations

import copy

import pytest
from snapshots import load_snapshot_dict

from torchplace import Facts
from torchplace.doctor.diagnose import run_checks
from torchplace.doctor.registry import CHECKS, Finding, check
from torchplace.hardware.topology import GpuProcess, MigInstance

BASE = load_snapshot_dict("h200x2")


def facts(env=None, **host) -> Facts:
    data = copy.deepcopy(BASE)
    data["host"] = {"cpu_count": 32, "affinity": list(range(32)), "usable_cpus": 32, "shm_total": 64 << 30,
                    "memlock_soft": None, **host}
    data["versions"] = {"torch": "2.11.0+cu130", "torch_cuda": "13.0"}
    return Facts.from_dict(data, env=env or {})


def ids(f: Facts) -> set[str]:
    return {x.id for x in run_checks(f)}


def test_clean_machine_has_no_warnings():
    found = [x for x in run_checks(facts()) if x.severity != "info"]
    assert found == []


@pytest.mark.parametrize("cvd,finding", [("0,0", "cvd.duplicate"), ("0,5", "cvd.truncated"),
                                         ("abc", "cvd.truncated"), ("", "cvd.empty")])
def test_visible_devices_findings(cvd, finding):
    found = {x.id: x for x in run_checks(facts({"CUDA_VISIBLE_DEVICES": cvd}))}
    assert finding in found
    assert repr(cvd) in found[finding].detail


def test_duplicate_fix_lists_each_gpu_once():
    found = {x.id: x for x in run_checks(facts({"CUDA_VISIBLE_DEVICES": "1,0,1"}))}
    assert found["cvd.duplicate"].severity == "error"
    assert "CUDA_VISIBLE_DEVICES=1,0" in found["cvd.duplicate"].fix


def test_order_warning_only_on_mixed_gpus_with_integer_lists():
    f = facts({"CUDA_VISIBLE_DEVICES": "0"})
    assert "cvd.order" not in ids(f)
    f.topology.gpus[0].name, f.topology.gpus[0].cores = "NVIDIA A100-SXM4-80GB", 6912
    assert "cvd.order" in ids(f)
    f2 = facts({"CUDA_VISIBLE_DEVICES": "0", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"})
    f2.topology.gpus[0].name = "NVIDIA A100-SXM4-80GB"
    assert "cvd.order" not in ids(f2)


def test_busy_gpu_names_the_process():
    f = facts()
    f.topology.gpus[1].processes = [GpuProcess(pid=999999, used_memory_bytes=40 << 30, user="alice")]
    busy = [x for x in run_checks(f) if x.id == "gpu.busy"]
    assert len(busy) == 1 and "pid 999999 (alice) 40.0 GiB" in busy[0].detail and "cuda:1" in busy[0].title


def test_mig_is_reported():
    f = facts()
    f.topology.gpus[0].mig_mode = "enabled"
    f.topology.gpus[0].mig = [MigInstance(uuid="MIG-1234")]
    assert any(x.id == "gpu.mig" and "MIG-1234" in x.detail for x in run_checks(f))


def test_cpu_torch_on_gpu_machine_is_an_error():
    f = facts()
    f.versions.torch_cuda = None
    assert any(x.id == "torch.cpu_build" and x.severity == "error" for x in run_checks(f))


def test_small_shm_and_low_memlock():
    found = ids(facts(shm_total=64 << 20, memlock_soft=8 << 20))
    assert {"host.shm_small", "host.memlock_low"} <= found


def test_omp_threads_above_usable_cpus():
    found = {x.id: x for x in run_checks(facts({"OMP_NUM_THREADS": "64"}, usable_cpus=16))}
    assert "OMP_NUM_THREADS=64 but only 16 CPU(s)" in found["host.omp_oversubscribed"].detail
    assert "host.omp_oversubscribed" not in ids(facts({"OMP_NUM_THREADS": "8"}, usable_cpus=16))


@pytest.mark.parametrize(("cvd", "repeats"), [("0,0", ["0"]), ("1, 01,2", [" 01"]), ("GPU-abc,gpu-ABC", ["gpu-ABC"]),
                                              ("0,abc,0", []), ("0,1", [])])
def test_a_repeated_device_is_found_without_nvml_as_a_fault_of_the_value(cvd, repeats):
    """CUDA_VISIBLE_DEVICES=0,0 was reported only where NVML listed GPUs; it is a syntax check."""
    data = {"gpus": [], "nvml_error": "NVML Shared Library Not Found", "versions": {"torch": "2.13.0+cpu"}}
    found = {x.id: x for x in run_checks(Facts.from_dict(data, env={"CUDA_VISIBLE_DEVICES": cvd}))}
    if repeats:
        assert found["cvd.duplicate"].severity == "error" and repr(repeats[0]) in found["cvd.duplicate"].detail
    else:
        assert "cvd.duplicate" not in found


def test_nvml_missing_is_reported_not_raised():
    data = {"gpus": [], "nvml_error": "NVML Shared Library Not Found", "versions": {"torch": "2.13.0+cpu"}}
    found = {x.id: x for x in run_checks(Facts.from_dict(data, env={}))}
    assert found["nvml.unavailable"].severity == "info"


def test_unknown_fields_are_listed():
    assert any(x.id == "nvml.unknown_fields" and "numa_node" in x.detail for x in run_checks(facts()))


def test_an_unknown_field_carries_its_own_cost_and_fix():
    """numa_node is Not Supported on every H200 VM: it had the fix about container PID namespaces."""
    found = {x.id: x for x in run_checks(facts())}["nvml.unknown_fields"]
    assert "single-socket host or a VM" in found.detail and "PID namespace" not in found.fix + found.detail
    assert found.fix == "Nothing to do."
    data = load_snapshot_dict("h200x2")
    data["gpus"][1]["unknown"]["processes"] = "Insufficient Permissions"
    found = {x.id: x for x in run_checks(Facts.from_dict(data))}["nvml.unknown_fields"]
    assert "processes: Insufficient Permissions (GPU 1): the processes on the GPU are hidden" in found.detail
    assert "PID namespaces" in found.fix and "Nothing to do" not in found.fix


def test_a_crashing_check_becomes_a_finding():
    @check
    def check_broken(_facts) -> list[Finding]:
        raise RuntimeError("kaput")

    try:
        found = [x for x in run_checks(facts()) if x.id == "internal.check_broken"]
        assert found and "kaput" in found[0].detail
    finally:
        CHECKS.remove(check_broken)


@pytest.mark.parametrize("mode,procs,finding,severity", [
    ("prohibited", [], "gpu.compute_prohibited", "error"),
    ("exclusive_process", [GpuProcess(pid=999999)], "gpu.exclusive_busy", "error"),
    ("exclusive_process", [], "gpu.exclusive", "info"),
])
def test_compute_modes(mode, procs, finding, severity):
    f = facts()
    f.topology.gpus[0].compute_mode, f.topology.gpus[0].processes = mode, procs
    found = {x.id: x for x in run_checks(f)}
    assert found[finding].severity == severity and "cuda:0 (physical 0)" in found[finding].title
