"""Paths and loaders for the snapshots captured on real H200 machines (tests/fixtures/snapshots/)."""

from __future__ import annotations

import json
from pathlib import Path

SNAPSHOTS = Path(__file__).parent / "fixtures" / "snapshots"


def snapshot_path(name: str) -> Path:
    """Path of a committed snapshot fixture, e.g. snapshot_path('h200x2')."""
    return SNAPSHOTS / f"{name}.json"


def load_snapshot_dict(name: str) -> dict:
    return json.loads(snapshot_path(name).read_text())
