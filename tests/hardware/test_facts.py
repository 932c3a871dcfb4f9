"""Facts and snapshots: live reading degrades without NVML; snapshots round-trip."""

from __future__ import annotations

import json

import pytest

from torchplace.errors import SnapshotError
from torchplace.hardware.facts import Facts, read_facts
from torchplace.hardware.host import parse_cfs, parse_cpu_max, usable_cpus, cgroup_cpu_limit
from torchplace.hardware.topology import Topology
from torchplace.hardware.versions import read_versions

from snapshots import load_snapshot_dict, snapshot_path


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
