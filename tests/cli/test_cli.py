"""The CLI end to end, in subprocesses, on this machine and on committed snapshots."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from snapshots import snapshot_path

X2 = str(snapshot_path("h200x2"))


def tp(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if k not in ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER")}
    full.update(env or {})
    return subprocess.run([sys.executable, "-m", "torchplace", *args], capture_output=True, text=True, env=full,
                          timeout=120)


def test_map_json_keys_other_tools_rely_on():
    out = tp("map", "--json", "--snapshot", X2, env={"CUDA_VISIBLE_DEVICES": "1"})
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["cuda_visible_devices"] == "1" and data["cuda_device_order"] is None
    assert data["visible"] == [{"logical": 0, "physical_index": 1, "uuid": data["visible"][0]["uuid"],
                                "name": "NVIDIA H200", "mig_uuid": None}]
    assert data["visible"][0]["uuid"].startswith("GPU-36caea5e")
    assert isinstance(data["notes"], list)


def test_doctor_json_is_a_snapshot_and_errors_exit_nonzero():
    out = tp("doctor", "--json", "--snapshot", X2, env={"CUDA_VISIBLE_DEVICES": "0,0"})
    assert out.returncode == 1
    report = json.loads(out.stdout)
    assert any(f["id"] == "cvd.duplicate" for f in report["findings"])
    assert len(report["gpus"]) == 2 and report["exit_code"] == 1


def test_doctor_on_this_machine_is_useful_without_gpus(tmp_path):
    out = tp("doctor", "--json")
    assert out.returncode in (0, 1), out.stderr
    report = json.loads(out.stdout)
    assert report["versions"]["torch"] and report["host"]["usable_cpus"] >= 1
    snap = tmp_path / "me.json"
    snap.write_text(out.stdout)
    again = tp("doctor", "--snapshot", str(snap))
    assert again.returncode in (0, 1) and "torchplace doctor" in again.stdout


def test_rich_output_names_physical_and_logical_ids():
    out = tp("map", "--snapshot", X2, env={"CUDA_VISIBLE_DEVICES": "1", "COLUMNS": "200"})
    assert "hidden" in out.stdout and "cuda:0" in out.stdout
    doc = tp("doctor", "--snapshot", X2, env={"COLUMNS": "200"})
    assert "NVIDIA H200" in doc.stdout and "interconnect" in doc.stdout


def test_missing_snapshot_is_a_clear_error(tmp_path):
    out = tp("map", "--snapshot", str(tmp_path / "nope.json"))
    assert out.returncode == 2
    assert "does not exist" in out.stderr and "torchplace doctor --json" in out.stderr
    bad = tmp_path / "bad.json"
    bad.write_text('{"gpus": [{"index": "x"}]}')
    out = tp("doctor", "--snapshot", str(bad))
    assert out.returncode == 2 and "malformed snapshot (gpus[0]" in out.stderr


def test_fact_commands_never_import_torch():
    code = ("import sys; from torchplace.cli import main; main(['map', '--json']); "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    code = code.replace("'map', '--json'", "'doctor', '--json'")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode in (0, 1) and "torch was imported" not in out.stderr, out.stderr


def test_version_and_help():
    assert tp("--version").stdout.startswith("torchplace ")
    assert "doctor" in tp("--help").stdout


def test_bench_checkpoint_sizes_none_measures_the_layouts_only(tmp_path):
    """`--sizes none` is what --help offers for a run of model-shaped states alone (it was refused as size zero)."""
    from torchplace.cli import main

    out = tmp_path / "out"
    code = main(["bench", "checkpoint", "--quick", "--sizes", "none", "--layouts", "gpt2", "--device", "cpu",
                 "--dir", str(tmp_path), "--out", str(out)])
    assert code == 0
    rows = json.loads(next(out.glob("*.json")).read_text())["rows"]
    assert rows and all(r["variant"].startswith("gpt2 ") for r in rows)
