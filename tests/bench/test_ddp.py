"""`torchplace bench ddp --quick`: the benchmark's launches (one process, DDP through torchplace
run, hand-written DDP) run end to end on CPU with gloo. SLOW: seven processes import torch."""

from __future__ import annotations

import json

import pytest

from torchplace.cli import main


@pytest.mark.slow
def test_quick_bench_runs_every_launch(tmp_path, capsys):
    assert main(["bench", "ddp", "--quick", "--json", "--out", str(tmp_path)]) == 0
    result = json.loads(capsys.readouterr().out)
    rows = {row["variant"]: row for row in result["rows"]}
    assert set(rows) == {"compute-bound: 1 CPU process", "compute-bound: DDP x2 (torchplace run)",
                         "comm-bound: 1 CPU process", "comm-bound: DDP x2 (torchplace run)",
                         "comm-bound: DDP x2 (hand-written)"}
    for name, row in rows.items():
        assert row["value"] > 0 and row["unit"] == "samples/s"
        assert row["extra"]["processes"] == (1 if "1 CPU" in name else 2)
        assert row["ratio"] == (1.0 if "1 CPU" in name else pytest.approx(
            row["value"] / rows[name.split(":")[0] + ": 1 CPU process"]["value"]))
    assert rows["comm-bound: DDP x2 (torchplace run)"]["extra"]["params"] == 8 * (512 * 512 + 512)
    assert result["targets"] == []  # targets are for GPUs only
    assert any("--quick" in note for note in result["notes"])
    assert list(tmp_path.glob("bench-ddp-*.json"))
