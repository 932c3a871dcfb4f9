"""Checkpoints under what real jobs do to them: two writers in one folder, a reader beside a rotating writer,
forks while a background save writes. Real processes and real files; processes wait on files, never on sleeps."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

import torchplace
from torchplace.checkpoint import loading, read_header, rotation

# a writer: waits for GO (so two start together), then saves N checkpoints named TAG-i with the given rotation
WRITER = textwrap.dedent("""
    import os, sys, time, torch, torchplace
    d, tag, n, keep = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    open(os.path.join(d, f".ready-{tag}"), "w").close()
    while not os.path.exists(os.path.join(d, ".go")):
        time.sleep(0.01)
    for i in range(n):
        torchplace.save(os.path.join(d, f"{tag}-{i:03d}.safetensors"), model={"w": torch.full((20_000,), float(i))},
                        extra={"tag": tag, "i": i}, keep_last=keep or None, latest=not keep)
""")


def _start_writers(d: Path, n: int, keep: int) -> list[subprocess.Popen[str]]:
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, str(d), tag, str(n), str(keep)], text=True,
                              stderr=subprocess.PIPE) for tag in ("a", "b")]
    deadline = time.monotonic() + 120
    while not all((d / f".ready-{t}").exists() for t in ("a", "b")):
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs), "a writer did not start"
        time.sleep(0.01)
    (d / ".go").touch()
    return procs


def _finish(procs: list[subprocess.Popen[str]]) -> None:
    for p in procs:
        _, err = p.communicate(timeout=120)
        assert p.returncode == 0, err


def _sequences(d: Path) -> dict[str, int]:
    found = {}
    for name in os.listdir(d):
        if not name.startswith(".") and name != rotation.POINTER:
            meta = read_header(d / name).meta
            assert meta is not None
            found[name] = meta["sequence"]
    return found


def test_two_jobs_saving_into_one_folder_never_share_a_sequence_number(tmp_path: Path) -> None:
    # two jobs started by mistake with the same output folder, keeping everything: before the series lock,
    # both read the same largest sequence and wrote the same next one (80 saves got 58 numbers)
    _finish(_start_writers(tmp_path, 12, keep=0))
    seqs = _sequences(tmp_path)
    assert len(seqs) == 24 and sorted(seqs.values()) == list(range(1, 25))
    pointer = rotation.POINTER
    assert torchplace.load(tmp_path / pointer).path.name == max(seqs, key=seqs.__getitem__)


def test_two_writers_with_keep_last_2_and_a_reader_loading_the_folder_meanwhile(tmp_path: Path) -> None:
    procs = _start_writers(tmp_path, 15, keep=2)
    loads = 0
    while any(p.poll() is None for p in procs) or loads == 0:
        try:
            ck = torchplace.load(tmp_path)
        except torchplace.CheckpointError as exc:
            assert "holds no complete torchplace checkpoint" in str(exc)  # only before the first save
            assert not any(n.endswith(".safetensors") for n in os.listdir(tmp_path)) or loads == 0
            continue
        loads += 1
        assert torch.equal(ck["model"]["w"], torch.full((20_000,), float(ck.extra["i"])))  # never a torn mix
    _finish(procs)
    seqs = _sequences(tmp_path)  # the newest two of 30 saves, whoever wrote them; nothing else deleted or left
    assert sorted(seqs.values()) == [29, 30], seqs
    newest = max(seqs, key=seqs.__getitem__)
    assert torchplace.load(tmp_path / rotation.POINTER).path.name == newest
    assert rotation.complete_checkpoints(tmp_path)[0].name == newest


def test_a_newest_deleted_between_listing_and_opening_is_looked_for_again(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    for i in range(3):
        torchplace.save(tmp_path / f"s{i}.safetensors", model={"w": torch.full((4,), float(i))}, keep_last=3)
    stale = rotation.complete_checkpoints(tmp_path)  # what a reader listed before another job rotated
    (tmp_path / "s2.safetensors").unlink()
    torchplace.save(tmp_path / "s3.safetensors", model={"w": torch.full((4,), 3.0)}, keep_last=3)
    listings = [stale]
    monkeypatch.setattr(loading, "complete_checkpoints",
                        lambda d, **kw: listings.pop() if listings else rotation.complete_checkpoints(d, **kw))
    ck = torchplace.load(tmp_path)  # the real newest now, not the older one that happened to be listed second
    assert ck.path.name == "s3.safetensors" and ck["model"]["w"][0] == 3.0
    assert "s2.safetensors was deleted while it was being opened" in ck.notes[0]


def test_a_folder_whose_newest_keeps_being_deleted_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    torchplace.save(tmp_path / "s0.safetensors", model={"w": torch.ones(2)}, keep_last=2)
    gone = tmp_path / "gone.safetensors"
    monkeypatch.setattr(loading, "complete_checkpoints", lambda d, **kw: [gone])
    with pytest.raises(torchplace.CheckpointError, match=r"deleted while being opened, 9 times in a row "
                                                         r"\(gone.safetensors\).*Fix: load a checkpoint file by"):
        torchplace.load(tmp_path)


def _python(code: str, cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd)


def test_a_fork_while_save_async_writes_neither_writes_nor_hangs_in_the_child(tmp_path: Path) -> None:
    # the child inherited the pending save; at its exit it used to wait forever for a writer thread it does not have
    out = _python("""
        import os, sys, torch, torchplace
        fut = torchplace.save_async("c.safetensors", model={"w": torch.arange(4_000_000.0)}, keep_last=2)
        pid = os.fork()
        if pid == 0:
            try:
                fut.result()
            except torchplace.CheckpointError as exc:
                print("child:", exc, flush=True)
            sys.exit(0)
        fut.result()
        _, status = os.waitpid(pid, 0)
        print("parent: child exited", os.waitstatus_to_exitcode(status))
    """, tmp_path)
    assert out.returncode == 0, out.stderr
    assert "is written by process" in out.stdout and "Fix: call result() in process" in out.stdout
    assert "parent: child exited 0" in out.stdout
    assert "waiting for" not in out.stderr  # the child did not think it had a save to wait for
    ck = torchplace.load(tmp_path)
    assert torch.equal(ck["model"]["w"], torch.arange(4_000_000.0))


def test_dataloader_workers_forked_during_a_rotation_save_do_not_hold_the_folder(tmp_path: Path) -> None:
    # flock belongs to the open file description, which fork shares: workers forked while the writer held the
    # series lock kept the folder locked, and the next rotation save waited for them to exit
    out = _python("""
        import torch, torchplace
        from torch.utils.data import DataLoader
        from torchplace.checkpoint import series_lock
        from pathlib import Path
        with series_lock(Path(".")):  # as a background rotation save holds it while it writes
            loader = DataLoader(list(range(8)), num_workers=2, persistent_workers=True,
                                multiprocessing_context="fork")
            it = iter(loader)
            next(it)
        torchplace.save("after.safetensors", model={"w": torch.ones(2)}, keep_last=2)  # workers still alive
        print("saved while workers ran:", it._workers[0].is_alive())
    """, tmp_path)
    assert out.returncode == 0, out.stderr
    assert "saved while workers ran: True" in out.stdout


@pytest.mark.parametrize("ending", ["sys.exit(3)", "raise RuntimeError('loss is nan')"])
def test_a_pending_save_is_finished_when_the_training_loop_ends_abruptly(tmp_path: Path, ending: str) -> None:
    out = _python(f"""
        import sys, torch, torchplace
        torchplace.save_async("c.safetensors", model={{"w": torch.arange(4_000_000.0)}}, keep_last=2)
        {ending}
    """, tmp_path)
    assert out.returncode != 0
    ck = torchplace.load(tmp_path)
    assert torch.equal(ck["model"]["w"], torch.arange(4_000_000.0))


def test_sigterm_during_a_background_write_leaves_the_previous_checkpoint(tmp_path: Path) -> None:
    # a scheduler's SIGTERM: no exit handler runs, the write stops wherever it is; only a hidden temporary remains
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import torch, torchplace, threading
        torchplace.save("c0.safetensors", model={"w": torch.zeros(4)}, extra={"step": 0}, keep_last=2)
        torchplace.save_async("c1.safetensors", model={"w": torch.arange(30_000_000.0)}, extra={"step": 1}, keep_last=2)
        open("started", "w").close()
        threading.Event().wait()
    """)], cwd=tmp_path, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not (tmp_path / "started").exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.stderr else ""
        time.sleep(0.01)
    proc.terminate()
    proc.communicate(timeout=120)
    ck = torchplace.load(tmp_path)  # c1 when the write won the race, else c0: complete either way
    assert ck.extra["step"] in (0, 1) and ck["model"]["w"].numel() == (4 if ck.extra["step"] == 0 else 30_000_000)
    visible = {n for n in os.listdir(tmp_path) if not n.startswith(".")}
    assert visible <= {"c0.safetensors", "c1.safetensors", "latest", "started"}
