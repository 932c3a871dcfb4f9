"""GPU twin of test_checkpoint.py: `torchplace bench checkpoint --quick` on cuda:0, peers included where
installed (fastsafetensors, instanttensor: tools/fetch_gpu_wheels.sh). Checks that every figure ran with
its spread and each peer either ran or is named as left out; whether targets were met is the bench's result."""

from __future__ import annotations

import importlib.util
import json

import pytest


@pytest.mark.gpu
def test_bench_checkpoint_quick_on_a_gpu(run_cli, tmp_path):
    out = run_cli(["bench", "checkpoint", "--quick", "--json", "--dir", str(tmp_path)], timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout)
    variants = [row["variant"] for row in result["rows"]]
    assert all(row["extra"]["n"] >= 1 and row["value"] > 0 for row in result["rows"])
    assert "8MiB cold: torchplace.load -> cuda:0" in variants and "llama load -> cuda:0: torchplace.load" in variants
    peers = (("fastsafetensors", "fastsafetensors (no GDS)"), ("instanttensor", "instanttensor (buffered)"))
    for module, name in peers:
        ran = f"gpt2 load -> cuda:0: {name}" in variants
        left_out = any(f"{module} left out" in note and "cold:" not in note for note in result["notes"])
        assert ran != left_out, (module, result["notes"])
        if importlib.util.find_spec(module) is None:
            assert left_out
    assert any("load vs instanttensor" in t["name"] for t in result["targets"]) == (
        "gpt2 load -> cuda:0: instanttensor (buffered)" in variants)
    assert list(tmp_path.iterdir()) == []
