"""keep_last and the `latest` pointer; resuming from a directory finds the newest complete checkpoint."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

import torchplace
from torchplace import TorchplaceWarning
from torchplace.checkpoint import complete_checkpoints, latest, read_header


def _save(directory: Path, step: int, **kwargs) -> Path:
    return torchplace.save(directory / f"step-{step:04d}.safetensors", model={"w": torch.full((10,), float(step))},
                           extra={"step": step}, rng_state=False, **kwargs)


def test_keep_last_keeps_the_newest_and_points_at_the_last(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("not a checkpoint")
    other = torchplace.save(tmp_path / "best.safetensors", extra={"best": True})  # saved without rotation
    for step in range(1, 6):
        _save(tmp_path, step, keep_last=2)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["best.safetensors", "latest", "notes.txt", "step-0004.safetensors", "step-0005.safetensors"]
    pointer = json.loads((tmp_path / "latest").read_text())
    assert pointer["latest"] == "step-0005.safetensors"
    assert pointer["history"] == ["step-0004.safetensors", "step-0005.safetensors"]
    assert torchplace.load(tmp_path).extra["step"] == 5
    assert other.exists()


def test_latest_true_keeps_everything_and_updates_the_pointer(tmp_path: Path) -> None:
    for step in (1, 2, 3):
        _save(tmp_path, step, latest=True)
    assert len(list(tmp_path.glob("step-*"))) == 3
    assert json.loads((tmp_path / "latest").read_text())["latest"] == "step-0003.safetensors"


def test_a_checkpoint_renamed_but_not_recorded_is_adopted(tmp_path: Path) -> None:
    """A writer killed between its rename and the pointer update: the next save counts that file."""
    for step in (1, 2):
        _save(tmp_path, step, keep_last=2)
    pointer = (tmp_path / "latest").read_bytes()
    _save(tmp_path, 3, keep_last=2)
    (tmp_path / "latest").write_bytes(pointer)  # as if killed before the pointer moved
    assert torchplace.load(tmp_path).extra["step"] == 3  # the directory still resolves to the newest
    _save(tmp_path, 4, keep_last=2)
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-0003.safetensors", "step-0004.safetensors"]


def test_a_damaged_newest_checkpoint_falls_back_with_a_warning(tmp_path: Path) -> None:
    for step in (1, 2, 3):
        _save(tmp_path, step, keep_last=3)
    newest = tmp_path / "step-0003.safetensors"
    header = read_header(newest)
    data = bytearray(newest.read_bytes())
    data[header.data_offset + 5] ^= 0xFF
    newest.write_bytes(bytes(data))
    with pytest.warns(RuntimeWarning, match="skipping .*step-0003.*checksum"):
        ck = torchplace.load(tmp_path)
    assert ck.extra["step"] == 2 and "skipped step-0003.safetensors" in ck.notes[0]

    os.truncate(tmp_path / "step-0002.safetensors", 100)  # a header that is not whole: not even a candidate
    assert complete_checkpoints(tmp_path)[0].name == "step-0003.safetensors"
    with pytest.warns(RuntimeWarning), pytest.warns(TorchplaceWarning, match="passed over step-0002"):
        assert torchplace.load(tmp_path).extra["step"] == 1


@pytest.mark.parametrize("cut_to", [-100, 100])  # the tensors cut off; the header itself cut
def test_a_truncated_newest_safetensors_is_named_when_resuming_passes_it_over(tmp_path: Path, cut_to: int) -> None:
    """It was passed over silently (a torch.save file cut short was named); now both are, with size and choice."""
    for step in (1, 2):
        _save(tmp_path, step, keep_last=3)
    newest = tmp_path / "step-0002.safetensors"
    os.truncate(newest, cut_to if cut_to > 0 else newest.stat().st_size + cut_to)  # a copy cut by a full disk
    size = newest.stat().st_size
    said = rf"passed over step-0002.safetensors \({size} bytes\): its header .*; {{}} step-0001.safetensors " \
           r"instead\. Fix: if step-0002.safetensors is the checkpoint to continue from, copy it again in full"
    with pytest.warns(TorchplaceWarning, match=said.format("loaded")):
        ck = torchplace.load(tmp_path)
    assert ck.extra["step"] == 1 and any(n.startswith("skipped step-0002.safetensors") for n in ck.notes)
    with pytest.warns(TorchplaceWarning, match=said.format("picked")):
        rt = torchplace.setup("cpu", threads=None, verbose=False, checkpoint_dir=tmp_path, resume=True)
    assert rt.resume_from == tmp_path / "step-0001.safetensors"


def test_a_missing_or_garbled_pointer_does_not_matter_for_resuming(tmp_path: Path) -> None:
    for step in (1, 2):
        _save(tmp_path, step, keep_last=5)
    (tmp_path / "latest").write_text("{not json")
    assert latest(tmp_path).name == "step-0002.safetensors"
    (tmp_path / "latest").unlink()
    assert torchplace.load(tmp_path).extra["step"] == 2
    _save(tmp_path, 3, keep_last=5)  # a new pointer is written from what is in the directory
    assert json.loads((tmp_path / "latest").read_text())["history"][-1] == "step-0003.safetensors"


def test_a_directory_without_checkpoints_says_what_it_holds(tmp_path: Path) -> None:
    (tmp_path / "readme.md").write_text("hello")
    with pytest.raises(torchplace.CheckpointError,
                       match=r"holds no complete torchplace checkpoint \(it holds: readme.md\)"):
        torchplace.load(tmp_path)


def test_resuming_refuses_a_pickled_newest_instead_of_skipping_it(tmp_path: Path) -> None:
    _save(tmp_path, 1, keep_last=3)
    torchplace.save(tmp_path / "step-0002.safetensors", extra={"obj": object.__new__(Holder)}, allow_pickle=True,
                    keep_last=3)
    with pytest.raises(torchplace.CheckpointError, match="trust_pickle=True"):
        torchplace.load(tmp_path)


class Holder:
    pass


# --- the name `latest` is the pointer's: a checkpoint saved there would be overwritten by it ---------------

@pytest.mark.parametrize("how", [{"keep_last": 3}, {"latest": True}, {}])
def test_a_checkpoint_named_latest_is_refused_before_anything_is_written(tmp_path: Path, how: dict) -> None:
    _save(tmp_path, 1, keep_last=3)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    with pytest.raises(torchplace.CheckpointError, match=r"'latest' is reserved.*pointer.*Fix: .*another name"):
        torchplace.save(tmp_path / "latest", model={"w": torch.ones(3)}, rng_state=False, **how)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before  # nothing written, nothing deleted
    with pytest.raises(torchplace.CheckpointError, match="reserved"):  # case-insensitive file systems too
        torchplace.save(tmp_path / "Latest", model={"w": torch.ones(3)}, rng_state=False, **how)


def test_a_plain_save_to_latest_cannot_be_lost_to_a_later_rotation(tmp_path: Path) -> None:
    with pytest.raises(torchplace.CheckpointError, match="reserved"):
        torchplace.save(tmp_path / "latest", model={"w": torch.ones(3)}, rng_state=False)
    assert list(tmp_path.iterdir()) == []


def test_rotation_refuses_to_replace_a_latest_that_is_not_a_pointer(tmp_path: Path) -> None:
    """A checkpoint copied to d/latest by hand (or saved there by an older torchplace) is never overwritten."""
    _save(tmp_path, 1)
    os.replace(tmp_path / "step-0001.safetensors", tmp_path / "latest")
    data = (tmp_path / "latest").read_bytes()
    with pytest.raises(torchplace.CheckpointError, match=r"latest.*not a `latest` pointer.*Fix: .*(move|rename)"):
        _save(tmp_path, 2, keep_last=1)
    assert (tmp_path / "latest").read_bytes() == data
    assert not (tmp_path / "step-0002.safetensors").exists()  # refused before writing


def test_loading_the_pointer_file_loads_the_newest_checkpoint(tmp_path: Path) -> None:
    for step in (1, 2, 3):
        _save(tmp_path, step, keep_last=2)
    ck = torchplace.load(tmp_path / "latest")
    assert ck.path.name == "step-0003.safetensors" and ck.extra["step"] == 3
    assert any("pointer" in note for note in ck.notes)


# --- order by a sequence number written in the metadata, never by wall time --------------------------------

class Clock:
    """time.time as fileio sees it, stepped by hand (NTP corrections, VM migrations)."""

    def __init__(self, now: float) -> None:
        self.now = now

    def time(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    from torchplace.checkpoint import fileio

    c = Clock(1_800_000_000.0)
    monkeypatch.setattr(fileio, "time", c)  # the module that stamps created_unix
    return c


def _meta(path: Path) -> dict:
    return read_header(path).meta


def test_rotation_and_resuming_follow_the_sequence_after_the_clock_steps_back(tmp_path: Path, clock: Clock) -> None:
    _save(tmp_path, 100, keep_last=2)
    clock.now -= 3600  # the clock steps back an hour
    for step in (200, 201, 202):
        _save(tmp_path, step, keep_last=2)
        clock.now += 1
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-0201.safetensors", "step-0202.safetensors"]
    assert [_meta(tmp_path / f"step-{s:04d}.safetensors")["sequence"] for s in (201, 202)] == [3, 4]
    assert _meta(tmp_path / "step-0202.safetensors")["created_unix"] < 1_800_000_000.0  # wall time went back
    assert torchplace.load(tmp_path).extra["step"] == 202
    assert latest(tmp_path).name == "step-0202.safetensors"
    assert json.loads((tmp_path / "latest").read_text())["latest"] == "step-0202.safetensors"


def test_a_clock_that_jumps_ahead_and_back_does_not_pin_the_newest(tmp_path: Path, clock: Clock) -> None:
    clock.now += 86_400 * 365  # one save with a clock a year ahead
    _save(tmp_path, 1, latest=True)
    clock.now -= 86_400 * 365
    for step in (2, 3):
        _save(tmp_path, step, latest=True)
    assert [p.name for p in complete_checkpoints(tmp_path)] == [f"step-000{s}.safetensors" for s in (3, 2, 1)]
    assert torchplace.load(tmp_path).extra["step"] == 3


def test_equal_sequences_are_ordered_by_name(tmp_path: Path) -> None:
    """Two writers that read the directory at the same moment get the same number: the name decides."""
    from torchplace.checkpoint import write_file

    for name in ("b.safetensors", "a.safetensors"):
        write_file(tmp_path / name, {"extra": {"name": name}}, info={"rotation": True, "sequence": 7})
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["b.safetensors", "a.safetensors"]


def test_checkpoints_without_a_sequence_rank_below_those_with_one(tmp_path: Path, clock: Clock) -> None:
    """A directory from an older torchplace: its files carry no sequence, so they count as older than any that
    does (and among themselves follow their creation time, the only order they have)."""
    from torchplace.checkpoint import write_file

    clock.now += 7200  # the old files were written with a clock ahead of today's
    for step in (1, 2):
        write_file(tmp_path / f"old-{step}.safetensors", {"extra": {"step": step}}, info={"rotation": True})
        clock.now += 1
    clock.now -= 7200
    assert torchplace.load(tmp_path).extra["step"] == 2  # old files among themselves: by creation time
    _save(tmp_path, 3, keep_last=2)
    assert _meta(tmp_path / "step-0003.safetensors")["sequence"] == 1
    assert sorted(p.name for p in tmp_path.glob("*.safetensors")) == ["old-2.safetensors", "step-0003.safetensors"]
    assert torchplace.load(tmp_path).extra["step"] == 3


def test_the_sequence_continues_from_the_largest_in_the_series(tmp_path: Path) -> None:
    torchplace.save(tmp_path / "plain.safetensors", extra={}, rng_state=False)  # no rotation: no sequence
    assert "sequence" not in _meta(tmp_path / "plain.safetensors")
    for step in (1, 2, 3):
        _save(tmp_path, step, keep_last=1)
    assert _meta(tmp_path / "step-0003.safetensors")["sequence"] == 3
    _save(tmp_path, 2, keep_last=2)  # saving over an old name again: still the newest
    assert _meta(tmp_path / "step-0002.safetensors")["sequence"] == 4
    assert torchplace.load(tmp_path).extra["step"] == 2
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-0002.safetensors", "step-0003.safetensors"]
