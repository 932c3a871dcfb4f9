"""torchplace.progress: long library calls tell a callback what they do, and nothing else hears it."""

from __future__ import annotations

import torch

import torchplace
from torchplace import progress
from torchplace.checkpoint import convert, inspect


def _recorder() -> tuple[list[tuple[str, int, int | None]], progress.ProgressFn]:
    calls: list[tuple[str, int, int | None]] = []
    return calls, lambda what, done, total: calls.append((what, done, total))


def test_phases_count_up_and_nothing_is_told_outside_a_block():
    calls, fn = _recorder()
    progress.begin("ignored", 3)  # no callback current: a no-op
    progress.advance()
    with progress.reporting(fn):
        progress.begin("one", 2)
        progress.advance()
        with progress.silenced():
            progress.begin("inner", 1)
            progress.advance()
        progress.advance()
        progress.begin("two")
        progress.advance(3, total=3)
    assert calls == [("one", 0, 2), ("one", 1, 2), ("one", 2, 2), ("two", 0, None), ("two", 3, 3)]
    assert not progress.active()


def test_convert_and_verify_report_reading_writing_and_every_chunk(tmp_path):
    src = tmp_path / "plain.pt"
    torch.save({"model": {f"w{i}": torch.randn(256, 256) for i in range(8)}}, src)
    calls, fn = _recorder()
    convert(src, tmp_path / "out.tp", progress=fn)
    phases = list(dict.fromkeys(what for what, _, _ in calls))
    assert phases == ["reading plain.pt", "writing out.tp"]
    writes = [(done, total) for what, done, total in calls if what == "writing out.tp"]
    assert writes[0] == (0, None) and writes[-1][0] == writes[-1][1] >= 1  # every chunk of the data region

    calls, fn = _recorder()
    info = inspect(tmp_path / "out.tp", verify=True, progress=fn)
    assert info.verified
    assert calls[0] == ("verifying out.tp", 0, None) and calls[-1][1] == calls[-1][2] >= 1

    calls, fn = _recorder()
    inspect(tmp_path / "out.tp", progress=fn)  # no verification: nothing long to report
    torchplace.save(tmp_path / "plain.tp", model={"w": torch.zeros(4)})  # no callback: no reports anywhere
    assert calls == []
