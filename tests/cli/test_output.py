"""What the CLI prints into a pipe and onto a narrow terminal (issue 18).

Piped output (stdout not a terminal) is never wrapped, whatever COLUMNS says, so ids and values
stay whole on one line; on an 80-column terminal ids are still never cut; text is never read as
rich markup, so brackets print as written.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from snapshots import snapshot_path
from terminal import on_terminal

X2 = str(snapshot_path("h200x2"))
UUIDS = ("GPU-7fbb5c6b-5000-1564-ecb5-3c1b2da34bf7", "GPU-36caea5e-7edb-38d1-3a42-094b7e0d7368")


def _lines_with(text: str, needle: str) -> list[str]:
    return [line for line in text.splitlines() if needle in line]


def test_map_into_a_pipe_shows_whole_uuids_at_80_columns(run_cli, child_env):
    out = run_cli(["map", "--snapshot", X2], env=child_env(COLUMNS="80"))
    assert out.returncode == 0, out.stderr
    for uuid in UUIDS:
        row = _lines_with(out.stdout, uuid)
        assert len(row) == 1, out.stdout
        assert "NVIDIA H200" in row[0] and "0.6 GiB / 140.4 GiB" in row[0]  # the other columns unwrapped too
    assert "…" not in out.stdout


def test_doctor_on_a_terminal_wraps_its_version_lines_between_fields(child_env):
    """At 80 columns `... NCCL` ended one line and `2.28.9` began the next: two facts to a reader."""
    run = on_terminal(["doctor", "--snapshot", str(snapshot_path("h200x1"))], child_env(), columns=80)
    assert "NCCL 2.28.9" in run.text and "/dev/shm 128.0 GiB" in run.text, run.text
    assert max(len(line) for line in run.text.splitlines()[:4]) <= 80, run.text


def test_doctor_into_a_pipe_keeps_each_value_on_one_line(run_cli, child_env):
    out = run_cli(["doctor", "--snapshot", X2], env=child_env(COLUMNS="80"))
    assert out.returncode == 0, out.stderr
    assert ("numa_node: Not Supported (GPU 0, 1): normal on a single-socket host or a VM; threads follow the GPU's "
            "CPU affinity instead") in out.stdout
    for uuid in UUIDS:
        assert len(_lines_with(out.stdout, uuid)) == 1
    assert not [line for line in out.stdout.splitlines() if line != line.rstrip()], "trailing spaces"


def test_doctor_on_a_snapshot_names_what_it_does_not_record(run_cli, child_env):
    out = run_cli(["doctor", "--snapshot", X2], env=child_env())
    assert "None" not in out.stdout and "not installed" not in out.stdout, out.stdout
    assert "the snapshot does not record: python, torch" in out.stdout
    assert "driver 580.159.04" in out.stdout


def test_map_on_an_80_column_terminal_never_cuts_a_uuid(child_env):
    run = on_terminal(["map", "--snapshot", X2], child_env(), columns=80)
    assert run.returncode == 0, run.text
    for uuid in UUIDS:
        assert len(_lines_with(run.text, uuid)) == 1, run.text
    assert "…" not in run.text
    assert max(len(line) for line in run.text.splitlines()) <= 80


def test_map_on_a_wide_terminal_is_a_table(child_env):
    run = on_terminal(["map", "--snapshot", X2], child_env(), columns=160)
    rows = _lines_with(run.text, UUIDS[0])
    assert len(rows) == 1 and rows[0].startswith("│") and "cuda:0" in rows[0], run.text


def test_brackets_in_notes_print_as_written(run_cli, child_env):
    out = run_cli(["map", "--snapshot", X2], env=child_env(CUDA_VISIBLE_DEVICES="0,[bold]x"))
    assert "'[bold]x'" in out.stdout, out.stdout


X8 = Path(__file__).parents[1] / "fixtures" / "h200x8_constructed.json"  # 8 x H200, built from the recorded h200x2
SNAPSHOTS = {"h200x8": X8, "h200x2": Path(X2)}


def _gpu_section(text: str, gpus: list[dict]) -> list[str]:
    """The lines of the GPU table or of its records: from the first line naming the first GPU to the last's end."""
    lines = text.splitlines()
    first = next(i for i, line in enumerate(lines) if gpus[0]["uuid"] in line)
    last = next(i for i, line in enumerate(lines) if gpus[-1]["uuid"] in line)
    tail = next((i for i in range(last + 1, len(lines)) if not lines[i].startswith(("│", "    "))), len(lines))
    return lines[first - (1 if lines[first].startswith("    ") else 0):tail]


@pytest.mark.parametrize("command", ["map", "doctor"])
@pytest.mark.parametrize(("snapshot", "columns"), [("h200x8", 80), ("h200x8", 100), ("h200x8", 120),
                                                   ("h200x8", 160), ("h200x2", 120), ("h200x2", 130)])
def test_the_gpu_table_reads_at_each_width(child_env, command, snapshot, columns):
    """Issue 33: between 116 and 139 columns each cell wrapped to 3-4 lines (`NVIDIA / H200`); the layout
    is now chosen by what fits: a table whose cells take at most two lines, else one record per GPU."""
    gpus = json.loads(SNAPSHOTS[snapshot].read_text())["gpus"]
    run = on_terminal([command, "--snapshot", str(SNAPSHOTS[snapshot])], child_env(), columns=columns)
    assert run.returncode in (0, 1), run.text
    assert max(len(line) for line in run.text.splitlines()) <= columns, run.text
    for gpu in gpus:  # ids whole, each on one line
        assert len(_lines_with(run.text, gpu["uuid"])) == 1 and len(_lines_with(run.text, gpu["pci_bus_id"])) == 1
    section = _gpu_section(run.text, gpus)
    table = section[0].startswith("│")
    assert len(section) <= len(gpus) * (2 if table else 4), "\n".join(section)
    if not table:  # no value broken into fragments in a record
        assert all("\n".join(section).count(piece) == len(gpus) for piece in ("NVIDIA H200", " / 140.4 GiB")), run.text
    if snapshot == "h200x8":
        assert table == (columns == 160), f"{columns} columns: {'a table' if table else 'records'}\n{run.text}"


def test_a_cpu_build_of_torch_has_no_cudnn_or_nccl_to_call_unknown(run_cli, child_env, tmp_path):
    snap = tmp_path / "cpu.json"
    snap.write_text(json.dumps({"gpus": [], "versions": {"python": "3.11.7", "torch": "2.13.0+cpu"}}))
    out = run_cli(["doctor", "--snapshot", str(snap)], env=child_env())
    assert "built with CUDA none" in out.stdout and "cuDNN" not in out.stdout and "NCCL" not in out.stdout, out.stdout
    snap.write_text(json.dumps({"gpus": [], "versions": {"python": "3.11.7", "torch": "2.13.0", "torch_cuda": "13.0"}}))
    out = run_cli(["doctor", "--snapshot", str(snap)], env=child_env())
    assert "does not record: cuDNN, NCCL" in out.stdout, out.stdout
