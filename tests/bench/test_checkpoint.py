"""`torchplace bench checkpoint --quick`: every variant runs, targets are recorded, files are removed."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from torchplace.bench import checkpoint as bench


def test_quick_run_measures_every_variant_and_cleans_up(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args(["--quick", "--sizes", "4MiB", "--dir", str(tmp_path), "--device", "cpu"])
    result = bench.run(args)
    variants = [row.variant for row in result.rows]
    assert variants == ["4MiB plain write+fsync", "4MiB torch.save+fsync", "4MiB torchplace.save",
                        "4MiB torch.load -> cpu", "4MiB torchplace.load -> cpu",
                        "4MiB stall: bare copy into pinned host memory", "4MiB stall: torch.save+fsync",
                        "4MiB stall: dcp.async_save", "4MiB stall: torchplace.save_async", "4MiB step alone",
                        "4MiB step while save_async writes", "4MiB load -> cpu: safetensors load_file",
                        "4MiB load -> cpu: torch.load(mmap)+.to", "4MiB load -> cpu: torchplace.load",
                        "4MiB cold: raw O_DIRECT read of the file", "4MiB cold: torchplace.load -> cpu"]
    assert all(row.value > 0 and row.unit in ("GB/s", "ms") and row.ratio is not None for row in result.rows)
    assert [t.name for t in result.targets] == ["4MiB save vs plain write", "4MiB save_async stall vs bare pinned copy",
                                                "4MiB save_async stall vs dcp.async_save stall",
                                                "4MiB step while writing vs alone"]
    assert result.targets[0].op == ">=" and result.targets[0].limit == 0.9
    assert [(t.op, t.limit) for t in result.targets[1:]] == [("<=", 1.2), ("<=", 0.25), ("<=", 1.05)]
    assert any("no GPU" in note for note in result.notes)
    assert list(tmp_path.iterdir()) == []


def test_sizes_parse_with_units() -> None:
    assert bench.parse_sizes("1GiB,512MiB,2") == [2**30, 2**29, 2 * 2**30]
    with pytest.raises(ValueError, match="not understood"):
        bench.parse_sizes("lots")
