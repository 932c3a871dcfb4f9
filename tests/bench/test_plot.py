"""`--plot` on every benchmark (bench/plot.py) and the plots of the recorded runs in docs/results."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from torchplace.bench.common import BenchResult, Row
from torchplace.bench.plot import MISSING, draw, wants_log
from torchplace.cli import build_parser
from torchplace.cli.bench import BENCHES

RESULTS = Path(__file__).resolve().parents[2] / "docs" / "results"


def _png_size(path: Path) -> tuple[int, int]:
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    return struct.unpack(">II", head[16:24])


def test_a_log_axis_only_where_values_span_a_hundredfold():
    assert wants_log([1.0, 45.0, 2500.0, 9400.0])
    assert wants_log([0.5, 50.0])
    assert not wants_log([10.0, 999.0])
    assert not wants_log([0.0, 5.0, float("nan"), 400.0])  # zero and nan cannot go on a log axis
    assert not wants_log([3.0])


def test_every_bench_takes_plot():
    parser = build_parser("bench")
    for name in BENCHES:
        args = parser.parse_args(["bench", name, "--plot", "x.png"])
        assert args.plot == "x.png", name


def test_draw_writes_one_panel_per_unit(tmp_path):
    pytest.importorskip("matplotlib")
    result = BenchResult("demo", [Row("naive", 2500.0, "µs/step", 1.0), Row("torchplace to_device", 12.0, "µs/step"),
                                  Row("bulk", 9.5, "GB/s")], baseline="naive")
    path = draw(result, str(tmp_path / "demo.png"))
    width, height = _png_size(Path(path))
    assert width >= 600 and height >= 200


def test_missing_matplotlib_is_one_line_before_the_run(tmp_path, child_env):
    code = ("import sys; sys.modules['matplotlib'] = None\n"  # as without the bench extra
            "from torchplace.cli import main\n"
            "sys.exit(main(['bench', 'doctor', '--plot', sys.argv[1]]))")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "p.png")], capture_output=True, text=True,
                         env=child_env(), timeout=120)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.strip().splitlines() == [f"torchplace: error: {MISSING}."]
    assert "pip install 'torchplace[bench]'" in out.stderr
    assert not (tmp_path / "p.png").exists()


def test_bench_plot_from_the_command(tmp_path, run_cli, child_env):
    pytest.importorskip("matplotlib")
    plot = tmp_path / "diagnose.png"
    out = run_cli(["bench", "diagnose", "--plot", str(plot)], env=child_env(COLUMNS="80"))
    assert out.returncode == 0, out.stderr
    assert f"plot written to {plot}" in out.stdout and _png_size(plot)[0] > 0
    assert out.stderr == ""  # no progress bar into a pipe


def test_notes_with_brackets_print_as_written(capsys):
    from torchplace.cli.render import bench_table

    result = BenchResult("demo", [Row("a [x]", 1.0, "s")],
                         notes=["accelerate is not installed: its variants were skipped "
                                "(pip install 'torchplace[bench]')",
                                "[bold]not bold[/bold] :smile:"])
    result.machine = {"date": "d", "hostname": "h", "torch": "t", "gpus": ["[red]GPU"]}
    bench_table(result)
    out = capsys.readouterr().out
    assert "(pip install 'torchplace[bench]')" in out
    assert "[bold]not bold[/bold] :smile:" in out and "a [x]" in out and "[red]GPU" in out


@pytest.mark.parametrize("result", sorted(RESULTS.glob("bench-*.json")), ids=lambda p: p.name)
def test_every_recorded_result_has_its_plot_linked(result):
    png = result.with_suffix(".png")
    assert png.is_file(), f"{png.name} missing: run python tools/plot_results.py"
    assert png.stat().st_size < 200_000
    assert f"({png.name})" in (RESULTS / "README.md").read_text()
    json.loads(result.read_text())  # still the JSON the plot was drawn from
