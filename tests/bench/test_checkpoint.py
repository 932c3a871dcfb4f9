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
    # --quick on a CPU printed each target as missed or met: none is judged on a smoke test
    assert all(t.not_here and "--quick" in t.not_here for t in result.targets)
    assert all(t["met"] is None for t in result.to_dict()["targets"])


def test_targets_set_for_a_gpu_are_not_judged_on_a_cpu() -> None:
    import torch

    from torchplace.bench import checkpoint_async

    stalls = {"copy": 1.0, "tsave": 2.0, "dcp": 4.0, "dcp_total": 5.0, "async": 0.5, "async_total": 3.0}
    steps = {"alone": 1.0, "during": 1.5, "before": 1.0, "after": 1.0, "during_steps": 10}
    loads = {"st": 1.0, "mmap": 1.0, "tp": 1.0, "direct_cold": 1.0, "tp_cold": 1.0}
    for dev, judged in ((torch.device("cpu"), ["4MiB save_async stall vs dcp.async_save stall"]),
                        (torch.device("cuda", 0), None)):
        _, targets = checkpoint_async.rows_for("4MiB", 4 * 2**20, dev, stalls, steps, loads, {})
        names = [t.name for t in targets if t.not_here is None]
        assert names == judged if judged else len(names) == len(targets)


def test_sizes_parse_with_units() -> None:
    assert bench.parse_sizes("1GiB,512MiB,2") == [2**30, 2**29, 2 * 2**30]
    with pytest.raises(ValueError, match="not understood"):
        bench.parse_sizes("lots")
