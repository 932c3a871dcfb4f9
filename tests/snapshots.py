"""Paths and loaders for the snapshots captured on real H200 machines: the reference snapshots that ship
with torchplace (torchplace/hardware/snapshots/, `--snapshot h200x2`)."""

from __future__ import annotations

import json
from pathlib import Path

from torchplace.hardware.snapshot import SNAPSHOT_DIR as SNAPSHOTS


def snapshot_path(name: str) -> Path:
    """Path of a committed snapshot fixture, e.g. snapshot_path('h200x2')."""
    return SNAPSHOTS / f"{name}.json"


def load_snapshot_dict(name: str) -> dict:
    return json.loads(snapshot_path(name).read_text())
