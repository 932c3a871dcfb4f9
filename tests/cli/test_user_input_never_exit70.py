"""Exit 70 means a bug in torchplace: no user input may reach it. Each case here did: a 5000-digit GPU
index (int()'s digit limit), a snapshot whose free memory is 10**4000 (OverflowError in pick), and
stdout closed by the shell (`>&-`: AttributeError on flush). Also: a command name that is not UTF-8
is shown as typed, and a folder of that name is not "in this directory" to run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from snapshots import load_snapshot_dict, snapshot_path  # tests/snapshots.py (pythonpath = tests)

SNAPSHOT = snapshot_path("h200x1")


def one_line_error(out: subprocess.CompletedProcess, code: int = 2) -> str:
    assert out.returncode == code, (out.returncode, out.stderr)
    assert "internal error" not in out.stderr and "Traceback" not in out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    return lines[0]


def test_a_gpu_index_of_5000_digits_is_a_usage_error(run_cli) -> None:
    line = one_line_error(run_cli(["run", "--gpus", "0," + "1" * 5000, "--snapshot", str(SNAPSHOT), "--dry-run",
                                   "--", "true"]))
    assert "GPU 1111111111" in line and "was requested, but this machine has GPU 0" in line and len(line) < 600


def test_a_snapshot_reading_beyond_64_bits_is_refused(run_cli, tmp_path: Path) -> None:
    data = load_snapshot_dict("h200x1")
    data["gpus"][0]["memory_free"] = -12345  # written as a number of 4001 digits (no int -> str here: that
    snap = tmp_path / "huge.json"            # limit is process-wide, and torch's CVD parser relies on it)
    snap.write_text(json.dumps(data).replace("-12345", "1" + "0" * 4000, 1))
    for command in (["pick", "--snapshot", str(snap), "--explain"], ["map", "--snapshot", str(snap)]):
        line = one_line_error(run_cli(command))
        assert "gpus[0].memory_free_bytes is a number of 4001 digits, more than any reading holds" in line
        assert "Fix: capture it again" in line


def test_stdout_closed_by_the_shell_is_said_not_a_bug(child_env) -> None:
    out = subprocess.run([sys.executable, "-m", "torchplace", "map", "--snapshot", str(SNAPSHOT)],
                         stderr=subprocess.PIPE, text=True, env=child_env(), timeout=120,
                         preexec_fn=lambda: os.close(1))  # the shell's >&-
    line = one_line_error(out, code=1)
    assert line.startswith("torchplace: error: standard output is closed") and "Fix:" in line


def test_a_command_name_that_is_not_utf8_is_shown_as_typed(child_env, tmp_path: Path) -> None:
    name = os.fsdecode(b"\xff\xfe")
    (tmp_path / name).mkdir()  # a folder of that name: nothing here runs
    out = subprocess.run([sys.executable, "-m", "torchplace", "run", "--gpus", "none", "--", name],
                         capture_output=True, text=True, env=child_env(), timeout=120, cwd=tmp_path)
    line = one_line_error(out, code=127)  # as a shell says for a command it cannot find
    assert r"Command '\xff\xfe' was not found on PATH" in line, line
    assert "udc" not in line and "in this directory" not in line
