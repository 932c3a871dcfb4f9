"""Crafted format_version fields in a checkpoint folder (header checksum recomputed, so only the field is odd).

A format_version that no torchplace writes (a string, a list, a float, true, null, 0, -1) was taken as
"a newer torchplace wrote this": load(DIR) and setup(resume=) refused the whole folder and told the user to
upgrade, an upgrade that could not help; 0 and -1 were read as valid. They are damaged files now (skipped
by load(DIR) like any other), and only a whole number above this torchplace's stops resuming.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import torchplace
from torchplace.checkpoint import format as fmt
from torchplace.errors import CheckpointError, CheckpointFormatError

pytestmark = pytest.mark.timeout(300)


def _craft(path: Path, version_json: str) -> None:
    """Rewrite PATH's format_version as VERSION_JSON (raw JSON text), with a header checksum that matches."""
    header = fmt.read_header(path)
    raw = path.read_bytes()
    data = raw[8 + int.from_bytes(raw[:8], "little"):]
    assert header.meta is not None
    text = fmt.dump_meta(header.meta).replace('"format_version":1', '"format_version":' + version_json, 1)
    text = text[:-10] + fmt._header_crc(header.entries, text, fmt.OTHER_METADATA) + text[-2:]
    path.write_bytes(fmt.encode_header(header.entries, text) + data)


def _folder(tmp_path: Path, version_json: str) -> Path:
    torchplace.save(tmp_path / "step-1.safetensors", model={"w": torch.zeros(2)}, keep_last=3)
    torchplace.save(tmp_path / "step-2.safetensors", model={"w": torch.ones(2)}, keep_last=3)
    _craft(tmp_path / "step-2.safetensors", version_json)
    return tmp_path


@pytest.mark.parametrize("version", ['"2"', '"x"', "[2]", "1.5", "2.0", "true", "null", "{}", "0", "-1"])
def test_a_version_no_torchplace_writes_is_damage_not_newer(tmp_path: Path, version: str) -> None:
    folder = _folder(tmp_path, version)
    with pytest.raises(CheckpointError, match="format_version is .*not a whole number from 1 up") as info:
        fmt.read_header(folder / "step-2.safetensors")
    assert not isinstance(info.value, CheckpointFormatError) and "Fix:" in str(info.value)
    assert torchplace.load(folder)["model"]["w"].sum() == 0  # a damaged header is no complete checkpoint
    rt = torchplace.setup("cpu", threads=None, verbose=False, checkpoint_dir=folder, resume=True)
    assert rt.resume_from == folder / "step-1.safetensors"


@pytest.mark.parametrize("version", ["2", "9" * 30])
def test_a_larger_whole_number_still_stops_resuming(tmp_path: Path, version: str) -> None:
    folder = _folder(tmp_path, version)
    with pytest.raises(CheckpointFormatError, match=r"format 9{0,30}2?.{0,12}; this torchplace reads up to 1.*upgrade"):
        torchplace.load(folder)
    with pytest.raises(CheckpointFormatError, match="newer torchplace wrote"):
        torchplace.setup("cpu", threads=None, verbose=False, checkpoint_dir=folder, resume=True)


def test_a_version_of_5000_digits_is_damage_read_in_bounded_time(tmp_path: Path) -> None:
    """Python refuses to parse ints of more than 4300 digits: the header is damaged JSON, skipped."""
    folder = _folder(tmp_path, "9" * 5000)
    with pytest.raises(CheckpointError, match="not valid JSON"):
        fmt.read_header(folder / "step-2.safetensors")
    assert torchplace.load(folder)["model"]["w"].sum() == 0


@pytest.mark.parametrize("version", ['"x"', "2"])
def test_ckpt_inspect_of_the_file_is_one_error_line(tmp_path: Path, version: str) -> None:
    folder = _folder(tmp_path, version)
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    env.pop("TORCHPLACE_DEBUG", None)
    run = subprocess.run([sys.executable, "-m", "torchplace", "ckpt", "inspect", str(folder / "step-2.safetensors")],
                         capture_output=True, text=True, timeout=120, env=env)
    assert run.returncode != 0 and "Traceback" not in run.stderr, run.stderr[-2000:]
    assert ("upgrade" in run.stderr) == (version == "2") and "Fix:" in run.stderr


def test_ckpt_inspect_of_the_folder_says_load_refuses_it(tmp_path: Path) -> None:
    """It said "the one torchplace.load(folder) loads" of the older file while load(folder) raised."""
    folder = _folder(tmp_path, "2")
    notes = " ".join(torchplace.checkpoint.inspect(folder).notes)
    assert "step-1.safetensors, the newest this torchplace can read, but torchplace.load(" in notes
    assert "holds step-2.safetensors, which a newer torchplace wrote" in notes and "loads;" not in notes
