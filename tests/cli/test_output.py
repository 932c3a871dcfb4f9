"""What the CLI prints into a pipe and onto a narrow terminal (issue 18).

Piped output (stdout not a terminal) is never wrapped, whatever COLUMNS says, so ids and values
stay whole on one line; on an 80-column terminal ids are still never cut; text is never read as
rich markup, so brackets print as written.
"""

from __future__ import annotations

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


def test_doctor_into_a_pipe_keeps_each_value_on_one_line(run_cli, child_env):
    out = run_cli(["doctor", "--snapshot", X2], env=child_env(COLUMNS="80"))
    assert out.returncode == 0, out.stderr
    assert "fix: Usually harmless; processes and users are hidden across container PID namespaces." in out.stdout
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
