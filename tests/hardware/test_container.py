"""Containers, on constructed file trees and environments: what doctor and map say inside one (issue 33)."""

from __future__ import annotations

import copy

import pytest
from snapshots import load_snapshot_dict

from torchplace import Facts
from torchplace.cli import main
from torchplace.doctor.diagnose import run_checks
from torchplace.hardware.container import container_kind

X2 = load_snapshot_dict("h200x2")


@pytest.mark.parametrize(("files", "environ", "kind"), [
    ({".dockerenv": ""}, {}, "docker"),
    ({"run/.containerenv": ""}, {}, "podman"),
    ({"proc/1/cgroup": "0::/kubepods/burstable/pod1/abc\n"}, {}, "kubernetes"),
    ({"proc/1/cgroup": "0::/init.scope\n"}, {"container": "systemd-nspawn"}, "systemd-nspawn"),
    ({"proc/1/cgroup": "0::/init.scope\n"}, {}, None),
    ({}, {}, None),
])
def test_the_container_is_read_from_its_marks(tmp_path, files, environ, kind):
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert container_kind(tmp_path, environ) == kind


def _facts(*, container: str | None = "docker", gpus: bool = True, **env: str) -> Facts:
    data = copy.deepcopy(X2)
    if not gpus:
        data["gpus"], data["links"], data["nvml_error"] = [], [], "NVML Shared Library Not Found"
    data["host"] = {"cpu_count": 8, "usable_cpus": 8, "container": container}
    return Facts.from_dict(data, env=env)


def _found(facts: Facts) -> dict[str, object]:
    return {f.id: f for f in run_checks(facts)}


def test_inside_a_container_doctor_names_the_host_gpus_it_was_given_by_uuid_and_bus_id():
    found = _found(_facts(NVIDIA_VISIBLE_DEVICES="2,3"))["container.gpus"]
    assert "a docker container" in found.title and "NVIDIA_VISIBLE_DEVICES='2,3' chose them on the host" in found.detail
    for gpu in X2["gpus"]:
        assert gpu["uuid"] in found.detail and gpu["pci_bus_id"] in found.detail
    assert "container.gpus" not in _found(_facts(container=None))  # not in a container: nothing said


def test_a_container_given_no_gpu_says_how_to_give_it_one():
    found = _found(_facts(gpus=False))["container.no_gpu"]
    assert "--gpus all" in found.fix and "NVIDIA Container Toolkit" in found.fix
    found = _found(_facts(gpus=False, container=None, NVIDIA_VISIBLE_DEVICES="none"))["container.no_gpu"]
    assert "NVIDIA_VISIBLE_DEVICES='none'" in found.detail
    found = _found(_facts(gpus=False, NVIDIA_VISIBLE_DEVICES="0"))["container.no_gpu"]  # `docker run -e`, no --gpus
    assert "only the NVIDIA Container Toolkit reads it" in found.detail and "--gpus all" in found.fix


def test_a_cuda_visible_devices_written_for_the_host_is_named_inside():
    found = _found(_facts(CUDA_VISIBLE_DEVICES="3", NVIDIA_VISIBLE_DEVICES="2,3"))
    assert "0..1" in found["container.host_cvd"].detail and "NVIDIA_VISIBLE_DEVICES" in found["container.host_cvd"].fix
    assert "container.host_cvd" not in _found(_facts(CUDA_VISIBLE_DEVICES="1"))
    assert "container.host_cvd" not in _found(_facts(container=None, CUDA_VISIBLE_DEVICES="3"))


def test_map_says_it_runs_in_a_container(tmp_path, capsys):
    import json

    snap = tmp_path / "in-docker.json"
    data = copy.deepcopy(X2)
    data["host"] = {"container": "docker"}
    snap.write_text(json.dumps(data))
    assert main(["map", "--snapshot", str(snap)]) == 0
    assert "in a docker container: physical numbers are the container's" in capsys.readouterr().out


def test_a_gpu_less_container_with_a_cpu_only_torch_is_only_told():
    """CI and CPU inference run in GPU-less containers on purpose: a warning only where torch wants a GPU."""
    cpu = _facts(gpus=False)
    cpu.versions.torch, cpu.versions.torch_cuda = "2.13.0+cpu", None
    assert _found(cpu)["container.no_gpu"].severity == "info"
    cuda = _facts(gpus=False)
    cuda.versions.torch, cuda.versions.torch_cuda = "2.13.0", "13.0"
    assert _found(cuda)["container.no_gpu"].severity == "warning"
