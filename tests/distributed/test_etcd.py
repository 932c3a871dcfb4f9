"""Discovery through etcd (issue 35): two `torchplace run` agents meet through a real etcd server's v2 API
(`--rdzv-backend etcd-v2`, torchrun's etcd rendezvous with the python-etcd client) instead of a hard-coded
master address, form one 2-rank gloo job, and `torchplace doctor` inside the job names the rendezvous."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from ports import free_port  # tests/ports.py (pythonpath = tests)

SCRIPTS = Path(__file__).parent / "scripts"
ETCD = shutil.which("etcd")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(ETCD is None, reason="no etcd server here: `apt-get install etcd-server` (Debian; .ci/run "
                                            "installs it) puts /usr/bin/etcd on the PATH"),
    pytest.mark.skipif(importlib.util.find_spec("etcd") is None,
                       reason="torchrun's etcd rendezvous needs the python-etcd client: pip install python-etcd "
                              "(the test extra has it)"),
]


@pytest.fixture
def etcd_endpoint(tmp_path: Path) -> Iterator[str]:
    """A real etcd on localhost, v2 API on, on free ports; stopped after the test."""
    client, peer = free_port(), free_port()
    log = (tmp_path / "etcd.log").open("w")
    server = subprocess.Popen(
        [ETCD, "--name", "tp", "--data-dir", str(tmp_path / "etcd"), "--enable-v2",
         "--listen-client-urls", f"http://127.0.0.1:{client}", "--advertise-client-urls", f"http://127.0.0.1:{client}",
         "--listen-peer-urls", f"http://127.0.0.1:{peer}", "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
         "--initial-cluster", f"tp=http://127.0.0.1:{peer}"], stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert server.poll() is None, (tmp_path / "etcd.log").read_text()[-3000:]
            with contextlib.suppress(OSError):
                with urllib.request.urlopen(f"http://127.0.0.1:{client}/v2/keys", timeout=5):
                    break
            assert time.monotonic() < deadline, "etcd did not answer within 120 s"
            time.sleep(0.1)
        yield f"127.0.0.1:{client}"
    finally:
        server.terminate()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        log.close()


def test_two_agents_form_one_job_through_etcd_and_doctor_names_the_rendezvous(etcd_endpoint, tmp_path):
    agent = [sys.executable, "-m", "torchplace", "run", "--gpus", "none", "--nproc", "1", "--nnodes", "2",
             "--rdzv-backend", "etcd-v2", "--rdzv-endpoint", etcd_endpoint, "--rdzv-id", "etcd-job",
             "--", sys.executable, str(SCRIPTS / "dist_worker.py"), "ok"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    agents = [subprocess.Popen(agent, stdout=(tmp_path / f"node{i}.out").open("w"),
                               stderr=(tmp_path / f"node{i}.err").open("w"), env=env, start_new_session=True)
              for i in range(2)]
    try:
        codes = [a.wait(timeout=240) for a in agents]
    finally:
        for a in agents:
            if a.poll() is None:
                os.killpg(a.pid, 9)
                a.wait()
    errs = "".join((tmp_path / f"node{i}.err").read_text()[-2000:] for i in range(2))
    assert codes == [0, 0], errs
    ranks = [json.loads(line) for i in range(2) for line in (tmp_path / f"node{i}.out").read_text().splitlines()
             if line.startswith("{")]
    assert sorted(r["rank"] for r in ranks) == [0, 1]
    assert all(r["world_size"] == 2 and r["all_reduce"] == 3.0 and r["backend"] == "gloo" for r in ranks)
    assert sorted(r["node_rank"] for r in ranks) == [0, 1]  # one rank on each agent
    for r in ranks:
        said = " ".join(f["detail"] for f in r["doctor"] if f["id"] == "launch.rendezvous")
        assert f"the nodes met through the etcd-v2 rendezvous at {etcd_endpoint} (nnodes 2, rdzv id etcd-job" in said
