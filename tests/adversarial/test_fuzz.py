"""Hypothesis fuzzing of every reader: generated headers, byte mutations and snapshot JSON.

A checkpoint reader may succeed or raise CheckpointError; a snapshot reader may succeed or raise
SnapshotError. Generated headers carry recomputed checksums, so the fuzzing reaches the checks
behind them (a CRC only catches accidents).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import torchplace
from torchplace.checkpoint import inspect
from torchplace.doctor.diagnose import diagnose
from torchplace.errors import CheckpointError, SnapshotError
from torchplace.hardware.facts import read_facts

from . import crafting

pytestmark = [pytest.mark.timeout(120), pytest.mark.filterwarnings("ignore::RuntimeWarning")]
FUZZ = settings(max_examples=int(os.environ.get("TORCHPLACE_FUZZ_EXAMPLES", "60")), deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

scalars = st.one_of(st.none(), st.booleans(), st.integers(min_value=-2**70, max_value=2**70),
                    st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=8))
json_values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                            st.dictionaries(st.text(max_size=4), inner, max_size=4)),
                           max_leaves=12)
tags = st.sampled_from(["dict", "tuple", "tensor", "ndarray", "float", "size", "dtype", "device", "bytes", "ref",
                        "pickle", "bogus"])
tagged = st.recursive(json_values, lambda inner: st.one_of(
    st.builds(lambda t, v: {"t": t, "v": v}, tags, inner), st.builds(lambda t, k: {"t": t, "k": k}, tags, inner),
    st.builds(lambda pairs: {"t": "dict", "v": pairs}, st.lists(st.lists(inner, min_size=0, max_size=3), max_size=3)),
    st.lists(inner, max_size=3)), max_leaves=16)


class Parts(tuple):  # type: ignore[type-arg]
    """(index, meta, data) of a genuine file, with a short repr for hypothesis' reports."""

    def __repr__(self) -> str:
        return "<genuine checkpoint parts>"


@pytest.fixture(scope="module")
def genuine(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any, bytes]:
    return Parts(crafting.parts(crafting.genuine(tmp_path_factory.mktemp("genuine"))))


def _every_reader(path: Path) -> None:
    for read in (lambda: torchplace.load(path), lambda: inspect(path, verify=True),
                 lambda: torchplace.load(path, model=torch.nn.Linear(4, 3))):
        try:
            read()
        except CheckpointError:
            pass


@FUZZ
@given(field=st.sampled_from(["state", "chunk_bytes", "crc32", "data_bytes", "format_version", "pickled", "devices",
                              "raw_dtypes", "module_versions", "world_size", "primary_device"]),
       value=st.one_of(json_values, tagged))
def test_a_metadata_field_of_any_json_value(tmp_path: Path, genuine: tuple[Any, Any, bytes], field: str,
                                            value: Any) -> None:
    index, meta, data = json.loads(json.dumps(genuine[0])), dict(genuine[1]), genuine[2]
    meta[field] = value
    _every_reader(crafting.write(tmp_path / "m.pt", index, meta, data))


@FUZZ
@given(field=st.sampled_from(["dtype", "shape", "data_offsets"]), value=json_values)
def test_a_tensor_entry_of_any_json_value(tmp_path: Path, genuine: tuple[Any, Any, bytes], field: str,
                                          value: Any) -> None:
    index, meta, data = json.loads(json.dumps(genuine[0])), dict(genuine[1]), genuine[2]
    index[next(iter(index))][field] = value
    _every_reader(crafting.write(tmp_path / "e.pt", index, meta, data))


@FUZZ
@given(st.data())
def test_byte_mutations_of_a_genuine_file(tmp_path: Path, genuine: tuple[Any, Any, bytes], data: st.DataObject) -> None:
    path = crafting.write(tmp_path / "g.pt", *genuine)
    raw = bytearray(path.read_bytes())
    for _ in range(data.draw(st.integers(1, 4))):
        at = data.draw(st.integers(0, len(raw) - 1))
        raw[at] = data.draw(st.integers(0, 255))
    if data.draw(st.booleans()):
        raw = raw[:data.draw(st.integers(0, len(raw)))]
    path.write_bytes(bytes(raw))
    _every_reader(path)


snapshot_values = st.one_of(json_values, st.fixed_dictionaries({"gpus": st.lists(st.one_of(
    json_values, st.fixed_dictionaries(
    {"index": json_values, "uuid": json_values}, optional={"mig": json_values, "processes": json_values,
                                                          "compute_capability": json_values,
                                                          "memory_total": json_values})), max_size=3)},
    optional={"links": json_values, "host": json_values, "versions": json_values, "schema": json_values,
              "hostname": json_values}))


@FUZZ
@given(snapshot_values)
def test_a_snapshot_of_any_json_value(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, value: Any) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    path = tmp_path / "snap.json"
    path.write_text(json.dumps(value))
    try:
        report = diagnose(str(path))  # reads the facts and runs every doctor check on them
    except SnapshotError:
        return
    report.facts.to_dict()


@FUZZ
@given(st.binary(max_size=256))
def test_a_snapshot_of_any_bytes(tmp_path: Path, blob: bytes) -> None:
    path = tmp_path / "snap.json"
    path.write_bytes(blob)
    try:
        read_facts(path)
    except SnapshotError:
        pass


@pytest.mark.timeout(120)
@pytest.mark.parametrize("what", ["fifo", "urandom", "deep", "huge", "directory"])
def test_a_hostile_snapshot_file_is_refused_at_once(tmp_path: Path, what: str) -> None:
    path = tmp_path / "snap.json"
    if what == "fifo":
        os.mkfifo(path)
    elif what == "urandom":
        path = Path("/dev/urandom")
    elif what == "deep":
        path.write_text("[" * 100_000 + "]" * 100_000)
    elif what == "huge":
        with open(path, "wb") as fh:
            fh.truncate(64 * 2**20)  # sparse: costs no disk
    else:
        path.mkdir()
    with pytest.raises(SnapshotError, match=str(path)):
        read_facts(path)
