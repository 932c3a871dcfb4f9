"""Exact mid-epoch resume (issue 35): a rank SIGKILLed at a random step under `torchplace run --max-restarts 1`
resumes at the batch after its newest checkpoint, skipping the batches before by index (none is loaded),
and ends with the weights of a run never interrupted, bit for bit; every batch trained exactly once. The same
when a whole node (agent and worker) is killed and started again, with `--nnodes 2` and elastic `1:2`."""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from ports import free_port  # tests/ports.py (pythonpath = tests)

SCRIPT = Path(__file__).parent / "scripts" / "resume_worker.py"
EVERY, STEPS, BATCH, SAMPLES = 3, 18, 4, 48  # resume_worker.py: a checkpoint every 3 steps, 3 epochs of 6 steps


def job(folder: Path, nproc: int = 2, **env: str) -> subprocess.Popen:
    """resume_worker.py started under `torchplace run --gpus none --nproc NPROC --max-restarts 1` into FOLDER."""
    folder.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "torchplace", "run", "--gpus", "none", "--nproc", str(nproc), "--max-restarts", "1",
           "--", sys.executable, str(SCRIPT), str(folder)]
    with (folder / "job.out").open("w") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1",
                                                                                  **env})


def finished(run: subprocess.Popen, folder: Path) -> tuple[int | None, str]:
    """The exit code and output of a `job` into FOLDER once it has ended (hang bound 300 s)."""
    try:
        run.wait(timeout=300)
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
    return run.returncode, (folder / "job.out").read_text()


def rows(folder: Path, rank: int) -> list[dict]:
    return [json.loads(line) for line in (folder / f"rank{rank}.jsonl").read_text().splitlines()]


KILL_AT = random.randint(EVERY + 1, STEPS - 1)  # after the first checkpoint, before the end


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, tuple[Path, int | None, str]]:
    """Two jobs started at once: "whole", never interrupted (the reference of every test here), and "killed", whose
    rank 1 SIGKILLs itself after step KILL_AT; each: its folder, exit code and output."""
    base = tmp_path_factory.mktemp("exact")
    folders = {"whole": base / "whole", "killed": base / "killed"}
    started = {"whole": job(folders["whole"]), "killed": job(folders["killed"], KILL_AT_STEP=str(KILL_AT))}
    return {name: (folders[name], *finished(run, folders[name])) for name, run in started.items()}


@pytest.fixture(scope="module")
def uninterrupted(runs) -> Path:
    folder, code, out = runs["whole"]
    assert code == 0, out[-6000:]
    return folder


@pytest.mark.slow
def test_a_rank_killed_at_a_random_step_resumes_at_the_next_batch_bit_for_bit(runs, uninterrupted):
    (folder, code, out), kill_at = runs["killed"], KILL_AT
    why = f"(rank 1 killed after step {kill_at})"
    assert code == 0, why + out[-6000:]
    resumed_at = kill_at // EVERY * EVERY  # the newest checkpoint complete when it died
    assert f"step{resumed_at:04d}.tpck, the newest complete checkpoint" in out, why + out[-3000:]
    for rank in (0, 1):
        whole = [r for r in rows(uninterrupted, rank) if "ids" in r]
        assert [r["step"] for r in whole] == list(range(1, STEPS + 1))
        got = rows(folder, rank)
        first = [r for r in got if r.get("attempt") == 0 and "ids" in r]
        again = [r for r in got if r.get("attempt") == 1 and "ids" in r]
        assert first[-1]["step"] >= kill_at - 1, why  # rank 0 may be one step behind when rank 1 dies
        # the restart trained from the step after the checkpoint: not the epoch's start, nothing skipped
        assert again[0]["step"] == resumed_at + 1, why
        kept = [r for r in first if r["step"] <= resumed_at]  # the updates the checkpoint holds
        assert [(r["step"], r["ids"]) for r in kept + again] == [(r["step"], r["ids"]) for r in whole], why
        loads = [r["loads"] for r in got if r.get("attempt") == 1 and "loads" in r]
        assert loads == [BATCH * len(again)], why  # the batches skipped were not loaded
    for epoch in range(3):  # each epoch: every sample once over both ranks
        ids = [i for rank in (0, 1) for r in rows(uninterrupted, rank) if r.get("epoch") == epoch for i in r["ids"]]
        assert sorted(ids) == list(range(SAMPLES))
    final, reference = torch.load(folder / "final.pt"), torch.load(uninterrupted / "final.pt")
    assert final.keys() == reference.keys()
    assert all(torch.equal(final[k], reference[k]) for k in final), why


def _ranks_phases(folder: Path, rank: int) -> list[list[dict]]:
    """Rank RANK's trained batches, one list per process that had that rank, in order."""
    phases: dict[int, list[dict]] = {}
    for row in rows(folder, rank):
        phases.setdefault(row["pid"], []).append(row)
    return list(phases.values())


def _kill_node(agent: subprocess.Popen) -> None:
    """SIGKILL a node: its agent's process group (os.killpg) and every worker (torchrun gives each its own session)."""
    import psutil

    tree = [agent.pid, *(c.pid for c in psutil.Process(agent.pid).children(recursive=True))]
    os.killpg(agent.pid, signal.SIGKILL)
    for pid in tree:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    agent.wait()


def _wait(predicate, what: str, agents: list[subprocess.Popen], bound: float = 240) -> None:
    deadline = time.monotonic() + bound
    while not predicate():
        assert all(a.poll() is None for a in agents), f"an agent ended while waiting for {what}"
        assert time.monotonic() < deadline, f"no {what} within {bound} s"
        time.sleep(0.02)


def agent(folder: Path, name: str, nnodes: str, port: int, conf: str, host: bool) -> subprocess.Popen:
    """One node: `torchplace run --nnodes NNODES` of resume_worker.py into FOLDER, c10d rendezvous on PORT of this
    host, hosting its store when HOST (is_host: every node can start at once), output in FOLDER/NAME.out."""
    cmd = [sys.executable, "-m", "torchplace", "run", "--gpus", "none", "--nproc", "1", "--nnodes", nnodes,
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "node-loss",
           "--max-restarts", "1", "--rdzv-conf", f"{conf},keep_alive_interval=1,keep_alive_max_attempt=3,"
           f"is_host={int(host)}", "--", sys.executable, str(SCRIPT), str(folder)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "STEP_SLEEP": "0.2", "HOLD_WHEN_ALONE": "1"}
    return subprocess.Popen(cmd, stdout=(folder / f"{name}.out").open("w"), stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)


def node_loss(folder: Path, nnodes: str) -> tuple[list[int | None], str]:
    """Two agents (`torchplace run --nnodes NNODES`, c10d rendezvous on this host); once the checkpoint of step 9
    (mid-epoch 1) is complete the second node is killed whole and started again (elastic: once the first has
    re-formed the job alone). Returns the exit codes (first, killed, again) and the agents' output."""
    folder.mkdir(parents=True)
    port, conf = free_port(), "join_timeout=120,last_call_timeout=2"
    # the first hosts the rendezvous store: it must outlive the job
    agents = [agent(folder, "first", nnodes, port, conf, True), agent(folder, "second", nnodes, port, conf, False)]
    try:
        _wait(lambda: (folder / "ck" / "step0009.tpck").exists(), "checkpoint of step 9", agents)
        _kill_node(agents[1])
        if nnodes != "2":  # elastic: the first re-forms the job alone before the node comes back
            _wait(lambda: any(r.get("world") == 1 for r in rows(folder, 0)), "job of one rank", agents[:1])
        agents.append(agent(folder, "again", nnodes, port, conf, False))
        for node in (agents[0], agents[2]):
            node.wait(timeout=240)
    finally:
        for node in agents:
            if node.poll() is None:
                _kill_node(node)
    return [a.returncode for a in agents], "".join((folder / f"{n}.out").read_text()[-3000:]
                                                   for n in ("first", "again"))


@pytest.mark.slow
def test_a_node_killed_mid_epoch_and_started_again_rejoins_and_the_job_resumes_bit_for_bit(tmp_path, uninterrupted):
    """Fixed `--nnodes 2`: the survivor's worker fails, its agent restarts it into a new round, which the node
    started again joins; both ranks resume at the batch after the newest checkpoint."""
    codes, out = node_loss(tmp_path / "fixed", "2")
    assert codes == [0, -signal.SIGKILL, 0], out
    for rank in (0, 1):
        whole = [(r["step"], r["ids"]) for r in rows(uninterrupted, rank) if "ids" in r]
        *before, final = _ranks_phases(tmp_path / "fixed", rank)
        batches = [r for r in final if "ids" in r]
        resumed = batches[0]["step"] - 1
        assert resumed >= 9 and resumed % EVERY == 0, out  # the newest checkpoint at the kill, mid-epoch
        kept = [(r["step"], r["ids"]) for r in before[-1] if "ids" in r and r["step"] <= resumed]
        assert kept + [(r["step"], r["ids"]) for r in batches] == whole, out
        assert [r["loads"] for r in final if "loads" in r] == [BATCH * len(batches)]
    final, reference = torch.load(tmp_path / "fixed" / "final.pt"), torch.load(uninterrupted / "final.pt")
    assert all(torch.equal(final[k], reference[k]) for k in reference)


@pytest.mark.slow
def test_an_elastic_job_re_forms_alone_when_a_node_dies_and_grows_again_when_it_returns(tmp_path):
    """Elastic `--nnodes 1:2`: after the kill the survivor goes on alone (1 rank, resuming the 2-rank
    checkpoint: 2 x 3 batches of epoch 1 skipped), then the node started again joins (a membership change)
    and the job ends on 2 ranks from the 1-rank checkpoint."""
    codes, out = node_loss(tmp_path / "elastic", "1:2")
    assert codes == [0, -signal.SIGKILL, 0], out
    worlds = [{r.get("world") for r in phase if "ids" in r} for phase in _ranks_phases(tmp_path / "elastic", 0)]
    assert worlds[0] == {2} and {1} in worlds and worlds[-1] == {2}, worlds
    assert "saved by 2 rank(s), this run has 1" in out and "saved by 1 rank(s), this run has 2" in out, out
    assert "each rank skips 6 batch(es) of the epoch's order (exact)" in out, out
    assert (tmp_path / "elastic" / "final.pt").exists()


JOIN_S = 10  # the lost-node test's join_timeout: how long the survivor waits for the node (both start at once)


@pytest.mark.slow
def test_a_node_lost_and_not_started_again_fails_within_the_join_timeout_naming_it(tmp_path):
    """Fixed `--nnodes 2`, the second node killed whole once the job trains and never started again: the
    survivor's worker fails, its agent waits for the node in a new round and gives up after join_timeout
    with an error that names the lost node (host, agent pid, node rank) instead of torch's bare timeout."""
    port, conf = free_port(), f"join_timeout={JOIN_S},last_call_timeout=1"
    # both at once, the first hosting the rendezvous store: their join deadlines start together
    agents = [agent(tmp_path, "first", "2", port, conf, True), agent(tmp_path, "second", "2", port, conf, False)]
    try:
        _wait(lambda: all((tmp_path / f"rank{r}.jsonl").exists() for r in (0, 1)), "the job training", agents)
        _kill_node(agents[1])
        agents[0].wait(timeout=240)
    finally:
        for node in agents:
            if node.poll() is None:
                _kill_node(node)
    out = (tmp_path / "first.out").read_text()
    assert agents[0].returncode != 0, out[-3000:]
    host = socket.getfqdn()
    assert f"The rendezvous timed out: for {JOIN_S} s (join_timeout) the job waited for its nodes (--nnodes 2)" \
        in out, out[-3000:]
    lost = re.search(rf"but node {re.escape(repr(host))} \(agent pid {agents[1].pid}, node rank (\d)\) stopped", out)
    here = re.search(rf"This node is {re.escape(repr(host))} \(agent pid {agents[0].pid}, node rank (\d)\)", out)
    assert lost and here and {lost[1], here[1]} == {"0", "1"}, out[-3000:]
    assert "Traceback" not in out.split("The rendezvous timed out")[-1], out[-3000:]
