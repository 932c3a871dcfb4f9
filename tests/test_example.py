"""The example training (the README's main job): runs on CPU, resumes bit for bit, runs under DDP."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from ports import free_port  # tests/ports.py (pythonpath = tests)

EXAMPLE = Path(__file__).parents[1] / "examples" / "train.py"


def train(tmp_path: Path, *args: str, log: str | None = None, env: dict | None = None,
          launcher: list[str] | None = None) -> dict:
    cmd = [*(launcher or [sys.executable]), str(EXAMPLE), "--quick", "--ckpt-dir", str(tmp_path / "ck"), *args]
    if log:
        cmd += ["--log", str(tmp_path / log)]
    full = {**os.environ, **(env or {})}
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=full, cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    return json.loads((tmp_path / log).read_text()) if log else {}


def test_quick_run_learns_on_cpu(tmp_path):
    result = train(tmp_path, "--device", "cpu", log="full.json")
    losses = result["losses"]
    assert len(losses) == 3 and losses[-1] < losses[0] * 0.6
    assert result["accuracy"] > 0.8 and result["device"] == "cpu"
    kept = sorted(p.name for p in (tmp_path / "ck").iterdir())
    assert kept == ["epoch001.tpck", "epoch002.tpck", "latest"]  # keep_last=2 and the pointer


def test_resume_after_a_process_restart_gives_the_same_losses_bit_for_bit(tmp_path):
    whole = tmp_path / "a"
    whole.mkdir()
    full = train(whole, "--device", "cpu", log="full.json")
    part = tmp_path / "b"
    part.mkdir()
    train(part, "--device", "cpu", "--stop-after", "0")
    resumed = train(part, "--device", "cpu", "--resume", log="resumed.json")
    assert resumed["losses"] == full["losses"]
    assert resumed["accuracy"] == full["accuracy"]


@pytest.mark.slow
def test_two_cpu_processes_through_torchplace_run(tmp_path):
    launcher = [sys.executable, "-m", "torchplace", "run", "--gpus", "none", "--nproc", "2", "--", sys.executable]
    result = train(tmp_path, "--device", "cpu", log="ddp.json", launcher=launcher)
    assert len(result["losses"]) == 3 and result["losses"][-1] < result["losses"][0]


def _job(folder: Path, *launch: str, gpus: str = "none", device: str = "cpu", epochs: int = 3) -> list[str]:
    """`torchplace run --gpus GPUS LAUNCH -- python examples/train.py` for EPOCHS into FOLDER (made here)."""
    folder.mkdir(exist_ok=True)
    return [sys.executable, "-m", "torchplace", "run", "--gpus", gpus, *launch,
            "--", sys.executable, str(EXAMPLE), "--device", device, "--epochs", str(epochs), "--batch-size", "32",
            "--ckpt-dir", str(folder / "ck"), "--log", str(folder / "log.json")]


def _torchrun_job(tmp_path: Path, name: str) -> list[str]:
    return _job(tmp_path / name, "--nproc", "2", "--max-restarts", "1")


def _final_weights(folder: Path) -> dict:
    import torchplace as tp

    return tp.load(folder / "ck")["model"]


def _same_run(a: Path, b: Path) -> None:
    """Two runs' loss curves, accuracies and final weights are equal, bit for bit."""
    log_a, log_b = (json.loads((folder / "log.json").read_text()) for folder in (a, b))
    assert log_a["losses"] == log_b["losses"] and log_a["accuracy"] == log_b["accuracy"]
    final_a, final_b = _final_weights(a), _final_weights(b)
    assert final_a.keys() == final_b.keys()
    assert all(torch.equal(final_a[k], final_b[k]) for k in final_a)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    """The kill tests' job (2 ranks, world size 2) run to its end without a failure: the reference."""
    folder = tmp_path_factory.mktemp("whole")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    whole = subprocess.run(_torchrun_job(folder, "job"), capture_output=True, text=True, env=env, timeout=300)
    assert whole.returncode == 0, whole.stderr[-3000:]
    return folder / "job"


def _wait_for_first_checkpoint(job: subprocess.Popen, ck: Path) -> None:
    while job.poll() is None and not (ck / "epoch000.tpck").exists():
        time.sleep(0.005)
    assert job.poll() is None, "the job ended before its first checkpoint"
    time.sleep(0.2)  # into epoch 1


def _resumed_from(out: str) -> int:
    """The epoch of the checkpoint the restarted run continued from (examples/train.py's line)."""
    found = re.search(r"resumed epoch(\d{3})\.tpck \(saved on [^)]+\) at epoch (\d+)", out)
    assert found, out[-2000:]
    assert int(found[2]) == int(found[1]) + 1
    return int(found[1])


@pytest.mark.slow
def test_a_worker_killed_mid_epoch_is_restarted_and_the_job_resumes_bit_for_bit(tmp_path, uninterrupted):
    """torchrun restarts both workers after one is SIGKILLed; setup() sees the restart and the run
    continues from the newest checkpoint: exit 0, at most one epoch redone, the same final weights."""
    import psutil

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    job = subprocess.Popen(_torchrun_job(tmp_path, "killed"), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True, env=env)
    ck = tmp_path / "killed" / "ck"
    try:
        _wait_for_first_checkpoint(job, ck)
        saved_before = sorted(p.name for p in ck.glob("epoch*.tpck"))
        victim = next(c for c in psutil.Process(job.pid).children(recursive=True)
                      if "train.py" in " ".join(c.cmdline()) and c.environ().get("RANK") == "1")
        victim.send_signal(signal.SIGKILL)
        out, err = job.communicate(timeout=300)
    finally:
        if job.poll() is None:
            job.kill()
            job.communicate()
    assert job.returncode == 0, err[-3000:]
    assert "epoch002.tpck" not in saved_before  # the kill came before the run's end
    newest = int(saved_before[-1][5:8])
    # it continued from the newest checkpoint there was when the worker died: at most one epoch redone.
    # That is the one listed before the kill or, when a background save finished between the listing
    # and the kill landing, the next one (CI saw that once).
    resumed = re.search(r"resumed epoch(\d{3})\.tpck \(saved on cpu\) at epoch (\d+)", out)
    assert resumed and int(resumed[1]) in (newest, newest + 1), out[-2000:]
    assert int(resumed[2]) == int(resumed[1]) + 1
    assert "restarted by the launcher: continuing from" in err
    _same_run(uninterrupted, tmp_path / "killed")


def _signal_node(agent: subprocess.Popen, sig: int) -> None:
    """SIG to a node: its torchrun agent and every worker, at once. torchrun starts each worker in a
    session of its own, so the agent's process group alone would leave them running."""
    import psutil

    tree = [agent.pid, *(c.pid for c in psutil.Process(agent.pid).children(recursive=True))]
    os.killpg(agent.pid, sig)  # the agent's group (started with a session of its own)
    for pid in tree:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def _kill_node(agent: subprocess.Popen) -> None:
    _signal_node(agent, signal.SIGKILL)
    agent.wait()


@pytest.mark.slow
@pytest.mark.parametrize("failure", ["killed", "frozen"])
def test_a_node_that_fails_mid_epoch_and_is_started_again_rejoins_and_the_job_resumes_bit_for_bit(
        tmp_path, uninterrupted, failure):
    """Two agents (`torchplace run --nnodes 2`, c10d rendezvous) form one job; mid-epoch the second
    node fails whole, agent and worker, and is started again with the same command; the run
    continues from the newest checkpoint: exit 0 on both agents, at most one epoch redone, the same
    final weights as a run never interrupted.

    killed (SIGKILL): the survivor's collective fails at once (connection reset), its agent restarts
    its worker (a counted restart, --max-restarts 1) into a new rendezvous round, which the new
    agent joins. frozen (SIGSTOP: a hung or unreachable host, its sockets open): the survivor's
    collective waits; the new agent's arrival makes torchrun restart the survivor's worker as a
    membership change, which it does not count, so setup() knows the restart by the job's run id
    in the checkpoint folder."""
    node = node_failure_run(tmp_path, failure)
    assert node.returncodes == [0, -signal.SIGKILL, 0], node.out["first"][-3000:] + node.out["again"][-3000:]
    assert ("restarted by the launcher: continuing from" if failure == "killed" else
            "job 'node-restart' started in this folder before") in node.survivors
    _same_run(uninterrupted, tmp_path / "nodes")


@dataclass
class NodeRun:
    """What `node_failure_run` saw: exit codes (first, failed, again), each agent's output, and the
    epoch of the checkpoint the run continued from."""

    returncodes: list[int | None]
    out: dict[str, str]
    resumed: int

    @property
    def survivors(self) -> str:
        return self.out["first"] + self.out["again"]


def node_failure_run(tmp_path: Path, failure: str, *, gpus: str = "none", device: str = "cpu",
                     epochs: int = 3) -> NodeRun:
    """Two agents of one job (c10d rendezvous on this host, `--gpus GPUS` each); after the first
    checkpoint the second node is killed (SIGKILL) or frozen (SIGSTOP) whole, and the same command
    is started again. Checks that the run continued from the newest complete checkpoint."""
    endpoint = f"127.0.0.1:{free_port()}"
    # a node is declared dead 5 s after its last heartbeat (torchrun's default: 15 s), so the new round forms sooner
    node = _job(tmp_path / "nodes", "--nproc", "1", "--nnodes", "2", "--rdzv-backend", "c10d",
                "--rdzv-endpoint", endpoint, "--rdzv-id", "node-restart", "--max-restarts", "1",
                "--rdzv-conf", "join_timeout=120,keep_alive_interval=1,keep_alive_max_attempt=5",
                gpus=gpus, device=device, epochs=epochs)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    logs = tmp_path / "logs"
    logs.mkdir()

    def start(name: str) -> subprocess.Popen:  # output to files: nothing blocks on a full pipe meanwhile
        return subprocess.Popen(node, stdout=(logs / f"{name}.out").open("w"), stderr=(logs / f"{name}.err").open("w"),
                                env=env, start_new_session=True)

    first = start("first")  # hosts the rendezvous endpoint: it must outlive the job (see docs/distributed.md)
    while not _listening(first, endpoint) and first.poll() is None:
        time.sleep(0.01)
    agents = [first, start("second")]
    ck = tmp_path / "nodes" / "ck"
    try:
        _wait_for_first_checkpoint(first, ck)
        _signal_node(agents[1], signal.SIGKILL if failure == "killed" else signal.SIGSTOP)
        saved_before = sorted(p.name for p in ck.glob("epoch*.tpck"))
        agents.append(start("again"))  # the same command, as a scheduler or a user would
        for agent in (agents[0], agents[2]):
            agent.wait(timeout=240)
    finally:
        for agent in agents:
            if agent.poll() is None:
                _kill_node(agent)  # the frozen node too (SIGKILL ends a stopped process)
    out = {name: (logs / f"{name}.out").read_text() + (logs / f"{name}.err").read_text()
           for name in ("first", "second", "again")}
    assert f"epoch{epochs - 1:03d}.tpck" not in saved_before  # the failure came before the run's end
    resumed = _resumed_from(out["first"] + out["again"])  # printed by rank 0, on whichever node it is now
    assert resumed >= int(saved_before[-1][5:8])  # the newest complete one: at most one epoch redone
    return NodeRun([a.returncode for a in agents], out, resumed)


def _listening(agent: subprocess.Popen, endpoint: str) -> bool:
    """AGENT listens on ENDPOINT's port: it hosts the rendezvous store (asked of the OS, not the port)."""
    import psutil

    port = int(endpoint.rsplit(":", 1)[1])
    return any(c.status == psutil.CONN_LISTEN and c.laddr.port == port
               for c in psutil.Process(agent.pid).net_connections())
