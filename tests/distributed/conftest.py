"""Fixtures for the distributed tests: topologies from the real H200 snapshots and the worker
scripts (a private lease directory and the CLI in a subprocess are in tests/conftest.py)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
from snapshots import load_snapshot_dict, snapshot_path  # tests/snapshots.py (pythonpath = tests)

from torchplace.hardware.topology import Topology

SCRIPTS = Path(__file__).parent / "scripts"


def snapshot_dict(name: str) -> dict:
    if not snapshot_path(name).exists():
        pytest.skip(f"snapshot fixture {snapshot_path(name)} is not captured yet")
    return load_snapshot_dict(name)


def derive_8gpu(base: dict) -> dict:
    """An 8-GPU topology DERIVED from the real 2 x H200 snapshot: GPU 0's record copied eight
    times with new indices, UUIDs and PCI bus ids (the readings stay the captured ones)."""
    data = copy.deepcopy(base)
    template = data["gpus"][0]
    gpus = []
    for i in range(8):
        gpu = copy.deepcopy(template)
        gpu["index"] = i
        gpu["uuid"] = f"GPU-d371ed00-0000-4000-8000-00000000000{i}"
        gpu["pci_bus_id"] = f"00000000:{0x10 + i:02X}:00.0"
        gpu["processes"] = []
        gpus.append(gpu)
    data["gpus"] = gpus
    data["links"] = []
    data["hostname"] = "derived-8x-h200"
    return data


@pytest.fixture(autouse=True)
def _hardware_independent(request, monkeypatch):
    """Hardware-free tests decide on snapshots, not on this shell's GPU allocation: drop
    CUDA_VISIBLE_DEVICES / CUDA_DEVICE_ORDER for them (GPU twins keep the real environment)."""
    if request.node.get_closest_marker("gpu") is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
        monkeypatch.delenv("CUDA_DEVICE_ORDER", raising=False)


@pytest.fixture
def h200x2() -> Topology:
    return Topology.from_dict(snapshot_dict("h200x2"), source="h200x2.json")


@pytest.fixture
def h200x2_file() -> Path:
    snapshot_dict("h200x2")  # skips when not captured
    return snapshot_path("h200x2")


@pytest.fixture
def h200x8_dict() -> dict:
    return derive_8gpu(snapshot_dict("h200x2"))


@pytest.fixture
def h200x8(h200x8_dict) -> Topology:
    return Topology.from_dict(h200x8_dict, source="derived-8x-h200")


@pytest.fixture
def h200x8_file(tmp_path, h200x8_dict) -> Path:
    path = tmp_path / "h200x8-derived.json"
    path.write_text(json.dumps(h200x8_dict))
    return path


@pytest.fixture(name="scripts")
def _scripts_fixture() -> Path:
    """Directory of the worker scripts the multi-process tests start."""
    return SCRIPTS
