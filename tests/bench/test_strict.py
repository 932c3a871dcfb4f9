"""`torchplace bench strict --quick`: the code path runs on a CPU, and the module stays cheap to import."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from torchplace.bench import strict as bench

pytestmark = pytest.mark.usefixtures("strict_leaves_nothing_behind")


def test_importing_the_bench_module_does_not_import_torch():
    code = "import sys, torchplace.bench.strict; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "False", out.stderr


def test_quick_run_measures_every_variant_and_finds_no_false_alarm():
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args(["--quick", "--rounds", "1", "--steps", "1", "--device", "cpu", "--models", "gpt2"])
    result = bench.run(args)
    variants = [row.variant.split(": ", 1)[1] for row in result.rows]
    assert variants == ["bare", "watch(model) every step", "strict() around the loop",
                            "strict() entered every step", "TORCHPLACE_STRICT=1 (whole program)",
                            "strict off (env unset)"]
    assert all(row.value > 0 for row in result.rows) and result.rows[0].variant.startswith("tiny transformer LM")
    assert result.rows[0].extra["n"] == 6  # one round: a bare block before the first variant and after each
    assert all(len(row.extra["round_ratios"]) == 1 for row in result.rows[1:])  # each against its two neighbours
    alarms = [t for t in result.targets if "false alarms" in t.name]
    assert [t.measured for t in alarms] == [0.0]
    untouched = [t for t in result.targets if "functions in place" in t.name]
    assert [t.met for t in untouched] == [True]
    assert result.params["quick"] and any("tiny built-in models" in note for note in result.notes)
