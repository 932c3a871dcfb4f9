"""Hostile files and environments through the real `torchplace` command: one clear line, no traceback,
no terminal control sequence from a file reaching the terminal, nothing half-written, no hang.

Each case runs the CLI as a subprocess (the traceback check needs the real entry point) with a
generous timeout as a hang guard, never as a performance assertion.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch
from snapshots import snapshot_path  # tests/ is on the path

import torchplace

pytestmark = pytest.mark.timeout(300)
ESC = "\x1b"
HOSTILE_NAME = "\x1b]0;owned\x07\x1b[2J\u202eevil"  # retitle the terminal, clear it, reverse the text


def _cli(*argv: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    full = {**os.environ, "CUDA_VISIBLE_DEVICES": "", **(env or {})}
    full.pop("TORCHPLACE_DEBUG", None)
    return subprocess.run([sys.executable, "-m", "torchplace", *argv], capture_output=True, text=True,
                          timeout=timeout, env=full)


def _clean(run: subprocess.CompletedProcess[str]) -> None:
    assert "Traceback" not in run.stderr, run.stderr[-2000:]
    assert "internal error" not in run.stderr, run.stderr[-2000:]
    assert ESC not in run.stdout + run.stderr and "\u202e" not in run.stdout + run.stderr


def _snapshot(tmp_path: Path, change: dict[str, object] | None = None, gpus: int | None = None) -> Path:
    data = json.loads(snapshot_path("h200x2").read_text())
    if gpus is not None:
        data["gpus"] = [dict(data["gpus"][0], index=i, uuid=f"GPU-{i:08d}-0000-0000-0000-000000000000")
                        for i in range(gpus)]
        data["links"] = []
    data["gpus"][0].update(change or {})
    path = tmp_path / "snap.json"
    path.write_text(json.dumps(data))
    return path


def test_a_snapshot_of_thousands_of_gpus_is_refused_at_once(tmp_path: Path) -> None:
    """3000 GPUs (3 MiB of JSON) once kept doctor drawing an n-by-n link matrix for about ten minutes."""
    snap = _snapshot(tmp_path, gpus=3000)
    for command in ("doctor", "map", "pick"):
        run = _cli(command, "--snapshot", str(snap))
        _clean(run)
        assert run.returncode == 2 and "at most 256 GPUs" in run.stderr, run.stderr


def test_a_snapshot_of_many_gpus_is_described_without_the_matrix(tmp_path: Path) -> None:
    """40 GPUs: doctor describes them and says why the interconnect matrix is not drawn."""
    run = _cli("doctor", "--snapshot", str(_snapshot(tmp_path, gpus=40)))
    _clean(run)
    assert "too many to draw as a matrix" in run.stdout


def test_more_links_than_pairs_of_gpus_is_refused(tmp_path: Path) -> None:
    """Links beyond one per pair only make every lookup slower: 2 GPUs with 50,000 links."""
    data = json.loads(snapshot_path("h200x2").read_text())
    data["links"] = data["links"] * 50_000
    path = tmp_path / "snap.json"
    path.write_text(json.dumps(data))
    run = _cli("map", "--snapshot", str(path))
    _clean(run)
    assert run.returncode == 2 and "one link per pair" in run.stderr


@pytest.mark.parametrize("field", ["name", "uuid", "pci_bus_id"])
@pytest.mark.parametrize("command", ["doctor", "map"])
def test_control_characters_in_a_snapshot_are_shown_not_obeyed(tmp_path: Path, field: str, command: str) -> None:
    """A GPU name holding ESC sequences reached the terminal as they were (retitled and cleared it)."""
    run = _cli(command, "--snapshot", str(_snapshot(tmp_path, {field: HOSTILE_NAME})))
    _clean(run)
    if run.returncode == 0:
        assert "\\x1b]0;owned" in run.stdout


def test_control_characters_in_tensor_keys_are_shown_not_obeyed(tmp_path: Path) -> None:
    """A checkpoint made elsewhere: its keys and extras are printed by `ckpt inspect`."""
    from safetensors.torch import save_file

    path = tmp_path / "c.safetensors"
    save_file({HOSTILE_NAME: torch.ones(2)}, str(path), metadata={HOSTILE_NAME: HOSTILE_NAME})
    run = _cli("ckpt", "inspect", str(path))
    _clean(run)
    assert run.returncode == 0 and "\\x1b[2J" in run.stdout


def test_control_characters_in_an_error_message_are_escaped(tmp_path: Path) -> None:
    """Error lines carry paths and names from files: stderr gets escapes too."""
    run = _cli("ckpt", "inspect", str(tmp_path / HOSTILE_NAME))
    _clean(run)
    assert run.returncode == 2 and "does not exist" in run.stderr


def test_a_crafted_dcp_folder_is_one_line_through_the_cli(tmp_path: Path) -> None:
    """A .metadata whose chunk list is an int once surfaced as an internal error (TypeError)."""
    import torch.distributed.checkpoint as dcp

    from torchplace.checkpoint.dcp_reader import read_dcp_metadata

    folder = tmp_path / "ck"
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(torch.nn.Linear(4, 3).state_dict(), checkpoint_id=str(folder))
    metadata = read_dcp_metadata(folder)
    metadata.state_dict_metadata["weight"].chunks = 5
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))
    for argv in (("ckpt", "inspect", str(folder)), ("ckpt", "convert", str(folder), str(tmp_path / "out.pt"))):
        run = _cli(*argv)
        _clean(run)
        assert run.returncode == 2 and len(run.stderr.strip().splitlines()) == 1, run.stderr
    assert not (tmp_path / "out.pt").exists()


def test_convert_onto_latest_is_refused_through_the_cli(tmp_path: Path) -> None:
    """OUT named `latest` would be taken for the rotation pointer's slot."""
    src = torchplace.save(tmp_path / "src.pt", model=torch.nn.Linear(2, 2))
    run = _cli("ckpt", "convert", str(src), str(tmp_path / "latest"))
    _clean(run)
    assert run.returncode == 2 and "reserved" in run.stderr and not (tmp_path / "latest").exists()


@pytest.mark.parametrize("env", [
    {"CUDA_VISIBLE_DEVICES": "0,0"}, {"CUDA_VISIBLE_DEVICES": "GPU-"}, {"CUDA_VISIBLE_DEVICES": "-1"},
    {"CUDA_VISIBLE_DEVICES": "\x1b[2J,\u202e0"}, {"CUDA_VISIBLE_DEVICES": "0," * 3000},
    {"LOCAL_RANK": "abc", "WORLD_SIZE": "0"}, {"RANK": "\x1b[2J", "WORLD_SIZE": "2"},
], ids=["dup", "gpu-dash", "minus-one", "escapes", "long", "local-rank-abc", "rank-escape"])
def test_garbage_in_the_environment_is_reported_not_raised(env: dict[str, str]) -> None:
    """doctor, map and pick read these variables: a finding or an error line, never a traceback."""
    for command in ("doctor", "map", "pick"):
        run = _cli(command, "--snapshot", str(snapshot_path("h200x2")), env=env)
        _clean(run)
        assert run.returncode in (0, 1, 2)


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their mode")
def test_an_unreadable_checkpoint_is_one_line(tmp_path: Path) -> None:
    """chmod 000: the system's answer, with the path, and no traceback."""
    path = torchplace.save(tmp_path / "c.pt", model=torch.nn.Linear(2, 2))
    path.chmod(0)
    run = _cli("ckpt", "inspect", str(path))
    _clean(run)
    assert run.returncode == 2 and "c.pt" in run.stderr


def test_ctrl_c_during_convert_leaves_no_partial_file(tmp_path: Path) -> None:
    """SIGINT while converting: exit 130 quietly with nothing written (or, if it already finished, a whole file)."""
    src = torchplace.save(tmp_path / "src.pt", model=torch.nn.Linear(4096, 4096))
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.Popen([sys.executable, "-m", "torchplace", "ckpt", "convert", str(src), str(out_dir / "o.pt")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    # Interrupt once the write has begun (its temporary file is there): past interpreter start-up and
    # imports, where Python itself prints a traceback for SIGINT (a fixed sleep was too short on a busy host).
    deadline = time.monotonic() + 120
    while proc.poll() is None and not any(out_dir.iterdir()) and time.monotonic() < deadline:
        time.sleep(0.001)
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert "Traceback" not in err, err[-2000:]
    left = sorted(p.name for p in out_dir.iterdir())
    if proc.returncode == 130:
        assert left == [], left
    else:
        assert proc.returncode == 0 and left == ["o.pt"], (proc.returncode, left, err)
        torchplace.load(out_dir / "o.pt")
    shutil.rmtree(out_dir)
