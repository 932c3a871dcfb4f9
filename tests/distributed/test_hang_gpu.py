"""NCCL hangs on two GPUs: a rank that never enters a collective is named, by health_check and by
NCCL's flight recorder (read without unpickling code), and every rank exits (no orphan).

Run on a machine with two GPUs: PYTHONPATH=$PWD/src python3 -m pytest -m gpu tests/distributed/test_hang_gpu.py
"""

from __future__ import annotations

import json
import sys
import time

import psutil
import pytest

from torchplace.distributed.flight_recorder import read_traces, summarize

pytestmark = [pytest.mark.gpu, pytest.mark.multigpu]


def _ranks(stdout: str) -> list[dict]:
    return [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]


def _alive(records: list[dict]) -> list[int]:
    alive = []
    for r in records:
        try:
            if "pid" in r and psutil.Process(r["pid"]).status() != psutil.STATUS_ZOMBIE:
                alive.append(r["pid"])
        except psutil.NoSuchProcess:
            pass
    return alive


def _no_orphans(records: list[dict]) -> None:
    deadline = time.monotonic() + 120  # the ranks are ending: the bound is for one that never does
    while _alive(records) and time.monotonic() < deadline:
        time.sleep(0.1)
    alive = _alive(records)
    assert alive == [], f"ranks still running after the job ended: {alive}"


def test_the_flight_recorder_names_the_rank_that_never_entered_the_all_reduce(tmp_path, run_cli, scripts,
                                                                               child_env, lease_dir):
    folder = tmp_path / "fr"
    started = time.monotonic()
    out = run_cli(["run", "--gpus", "2", "--flight-recorder", str(folder), "--", sys.executable,
                   str(scripts / "hang_worker.py"), "nccl", "10"], env=child_env(), timeout=240)
    elapsed = time.monotonic() - started
    records = _ranks(out.stdout)
    print(f"exit {out.returncode} after {elapsed:.0f} s; dumps: {sorted(p.name for p in folder.iterdir())}")
    print(out.stderr[-4000:])
    assert out.returncode not in (0, 5), out.stderr[-3000:]  # 5: the all-reduce returned although rank 1 never came
    assert sorted(r["rank"] for r in records if "pid" in r) == [0, 1]
    assert all(r["device"].startswith("cuda:") for r in records if "device" in r)
    _no_orphans(records)
    traces = read_traces(folder)
    summary = summarize(traces)
    print(summary.describe())
    assert 0 in [t.rank for t in traces], "rank 0 (whose watchdog timed out) wrote no dump"
    stuck = [s for s in summary.stuck if s["op"] == "all_reduce"]
    if 1 in [t.rank for t in traces]:  # the stuck rank's own dump (written by its background thread)
        assert stuck and stuck[0]["behind"] == {1: stuck[0]["seq"] - 1} and 0 in stuck[0]["entered"]
        assert "never entered all_reduce" in out.stderr


def test_health_check_names_the_stuck_rank_on_nccl(tmp_path, run_cli, scripts, child_env, lease_dir):
    out = run_cli(["run", "--gpus", "2", "--flight-recorder", str(tmp_path / "fr"), "--", sys.executable,
                   str(scripts / "hang_worker.py"), "nccl", "10", "health"], env=child_env(), timeout=180)
    records = _ranks(out.stdout)
    errors = {r["rank"]: r["error"] for r in records if "error" in r}
    assert out.returncode == 3, out.stderr[-3000:]
    assert list(errors) == [0] and "rank 1 did not answer within 10 s" in errors[0]
    _no_orphans(records)
