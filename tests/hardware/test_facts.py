"""Facts and snapshots: live reading degrades without NVML; snapshots round-trip."""

from __future__ import annotations

import json

import pytest
from snapshots import load_snapshot_dict, snapshot_path

from torchplace import Facts, read_facts
from torchplace.errors import SnapshotError
from torchplace.hardware.host import cgroup_cpu_limit, parse_cfs, parse_cpu_max, usable_cpus
from torchplace.hardware.snapshot import snapshot_names
from torchplace.hardware.topology import Topology
from torchplace.hardware.versions import read_versions


@pytest.mark.parametrize("name", ["h200x1", "h200x2"])
def test_snapshot_round_trip(name):
    path = snapshot_path(name)
    if not path.exists():
        pytest.skip(f"{name} not captured yet")
    data = load_snapshot_dict(name)
    facts = Facts.from_dict(data, env={})
    again = Facts.from_dict(json.loads(json.dumps(facts.to_dict())), env={})
    assert again.topology.gpus == facts.topology.gpus
    assert again.topology.links == facts.topology.links
    assert all(g.uuid.startswith("GPU-") and g.compute_capability == [9, 0] for g in facts.topology.gpus)


def test_minimum_schema_from_the_issue_is_a_snapshot():
    data = {"gpus": [{"index": 0, "uuid": "GPU-abc", "name": "X", "pci_bus_id": "0:1", "compute_capability": [8, 0],
                      "memory_total": 1, "memory_used": 0, "utilization": None, "mig": []}]}
    facts = Facts.from_dict(data, env={"CUDA_VISIBLE_DEVICES": "0"})
    assert facts.visible.count == 1 and facts.topology.gpus[0].utilization is None


def test_unknown_schema_is_refused():
    with pytest.raises(SnapshotError, match="schema 99 is not supported"):
        Topology.from_dict({"schema": 99, "gpus": []})
    with pytest.raises(SnapshotError, match="needs a top-level object"):
        Topology.from_dict([])


def test_live_facts_on_this_machine_never_raise():
    facts = read_facts()
    assert facts.host.usable_cpus >= 1
    if not facts.topology.nvml_available:
        assert facts.topology.gpus == [] and facts.topology.nvml_error


def test_versions_without_importing_torch():
    v = read_versions()
    assert v.torch and v.python


@pytest.mark.parametrize("text,cpus", [("max 100000", None), ("200000 100000", 2.0), ("150000 100000", 1.5),
                                       ("", None), ("junk", None)])
def test_cgroup_v2_quota(text, cpus):
    assert parse_cpu_max(text) == cpus


def test_cgroup_v1_quota_and_usable_cpus():
    assert parse_cfs("-1", "100000") is None and parse_cfs("400000", "100000") == 4.0
    assert usable_cpus(64, list(range(16)), 4.0) == 4
    assert usable_cpus(64, list(range(16)), None) == 16
    assert usable_cpus(64, None, 1.5) == 2


def test_cgroup_limit_read_from_files(tmp_path):
    (tmp_path / "job").mkdir()
    (tmp_path / "job" / "cpu.max").write_text("300000 100000\n")
    proc = tmp_path / "cgroup"
    proc.write_text("0::/job\n")
    assert cgroup_cpu_limit(tmp_path, proc) == 3.0
    assert cgroup_cpu_limit(tmp_path / "missing", tmp_path / "missing") is None


def test_nvlink_is_read_from_the_h200_pair():
    """Captured by `torchplace doctor --json` on 2 x H200 (nvidia-smi topo -m shows NV18 there)."""
    facts = Facts.from_dict(load_snapshot_dict("h200x2-nvlink"), env={})
    link = facts.topology.link(0, 1)
    assert link.nvlinks == 18 and link.label() == "NV18"
    assert facts.versions.torch_cuda == "13.0" and facts.host.usable_cpus == 32


def test_snapshots_with_the_keys_before_units_still_load_and_are_written_with_both():
    """Old snapshots say index / memory_total; new ones say physical_index / memory_total_bytes and
    keep the old keys."""
    old = {"gpus": [{"index": 3, "uuid": "GPU-abc", "memory_total": 80, "memory_used": 1, "memory_free": 79,
                     "mig": [{"uuid": "MIG-1", "memory_total": 10}], "processes": [{"pid": 7, "used_memory": 2}]}],
           "host": {"memory_total": 64, "shm_total": 8, "shm_free": 4, "memlock_soft": None, "memlock_hard": 5}}
    facts = Facts.from_dict(old, env={})
    gpu = facts.topology.gpus[0]
    assert (gpu.physical_index, gpu.memory_total_bytes, gpu.memory_used_bytes, gpu.memory_free_bytes) == (3, 80, 1, 79)
    assert gpu.mig[0].memory_total_bytes == 10 and gpu.processes[0].used_memory_bytes == 2
    assert (facts.host.memory_total_bytes, facts.host.shm_free_bytes, facts.host.memlock_hard_bytes) == (64, 4, 5)
    assert gpu.index == 3 and gpu.memory_free == 79 and facts.host.shm_total == 8  # the old names still read
    written = facts.to_dict()
    assert written["gpus"][0]["physical_index"] == written["gpus"][0]["index"] == 3
    assert written["gpus"][0]["memory_free_bytes"] == written["gpus"][0]["memory_free"] == 79
    assert written["gpus"][0]["processes"][0]["used_memory_bytes"] == 2
    assert written["host"]["shm_total_bytes"] == written["host"]["shm_total"] == 8
    assert Facts.from_dict(written, env={}).to_dict() == written


def test_the_reference_snapshots_are_read_by_name_from_any_folder(tmp_path, monkeypatch):
    """A pip user has no tests/fixtures: `--snapshot h200x2` reads the copy shipped in the package."""
    monkeypatch.chdir(tmp_path)
    assert snapshot_names() == ["h200x1", "h200x2", "h200x2-nvlink"]
    facts = read_facts("h200x2")
    assert [g.name for g in facts.topology.gpus] == ["NVIDIA H200"] * 2 and facts.topology.source == "h200x2"
    assert len(read_facts("h200x2-nvlink").topology.gpus) == 2


def test_a_file_of_that_name_wins_and_a_path_stays_a_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "h200x2").write_text(json.dumps({"gpus": []}))
    assert read_facts("h200x2").topology.gpus == []
    with pytest.raises(SnapshotError, match="does not exist"):
        read_facts("sub/h200x1")


def test_an_unknown_name_lists_the_names_that_exist(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SnapshotError, match=r"No snapshot named 'h200x9'.*\(h200x1, h200x2, h200x2-nvlink\)"):
        read_facts("h200x9")
