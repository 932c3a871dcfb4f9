"""`torchplace run`: the --gpus spec, the plan (argv and environment), and the exec hand-over
(exit code, signals, environment and leases seen by the job)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import pytest

from torchplace.distributed.leases import LeaseDir
from torchplace.distributed.run import GpuRequest, plan
from torchplace.errors import DistributedError


@pytest.mark.parametrize("text,expected", [
    ("2", GpuRequest(count=2)), (3, GpuRequest(count=3)), ("0,2", GpuRequest(named=("0", "2"))),
    ("3,", GpuRequest(named=("3",))), ("GPU-7fbb", GpuRequest(named=("GPU-7fbb",))),
    ("auto", GpuRequest(auto=True)), ("none", GpuRequest(none=True)), ("CPU", GpuRequest(none=True))])
def test_gpu_spec(text, expected):
    assert GpuRequest.parse(text) == expected


@pytest.mark.parametrize("text,match", [("0", "--gpus none for CPU"), ("two", "is not understood"),
                                        ("1,x", "is not understood")])
def test_bad_gpu_spec(text, match):
    with pytest.raises(DistributedError, match=match):
        GpuRequest.parse(text)


def test_cpu_processes_go_through_torchrun():
    run = plan(["--", "python", "train.py", "--nproc", "3"], gpus="none", nproc=2)
    assert run.launcher == "torchrun" and run.nproc == 2 and run.picked is None
    assert run.argv[:4] == [sys.executable, "-m", "torchplace.distributed.run", "--standalone"]
    # "--" keeps torchrun from reading the job's own --nproc as --nproc-per-node
    assert run.argv[4:] == ["--nproc-per-node", "2", "--no-python", "--", sys.executable, "train.py", "--nproc", "3"]
    assert run.env_changes == {"CUDA_VISIBLE_DEVICES": ""}


def test_one_gpu_runs_the_command_itself(h200x2_file, lease_dir):
    run = plan(["python", "train.py"], gpus=1, snapshot=str(h200x2_file))
    try:
        assert run.launcher == "direct" and run.argv == [sys.executable, "train.py"]
        assert run.env_changes["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
        assert run.env_changes["CUDA_VISIBLE_DEVICES"].startswith("GPU-")
        assert run.env_changes["TORCHPLACE_LEASE_DIR"] == str(lease_dir)
        assert LeaseDir().status(run.picked.uuids[0]).mine
    finally:
        run.picked.release()


def test_two_gpus_lease_both_and_use_torchrun(h200x2_file, lease_dir):
    run = plan(["python", "train.py"], gpus="0,1", snapshot=str(h200x2_file))
    try:
        assert run.launcher == "torchrun" and run.nproc == 2
        assert run.env_changes["CUDA_VISIBLE_DEVICES"] == ",".join(run.picked.uuids)
        assert all(LeaseDir().status(u).held for u in run.picked.uuids)
    finally:
        run.picked.release()


def test_once_runs_one_process_on_several_gpus(h200x2_file, lease_dir):
    run = plan(["python", "dp.py"], gpus=2, once=True, snapshot=str(h200x2_file))
    run.picked.release()
    assert run.launcher == "direct" and run.env_changes["CUDA_VISIBLE_DEVICES"].count(",") == 1


def test_python_is_the_interpreter_torchplace_runs_under(monkeypatch, tmp_path):
    """`-- python x.py` started the python on PATH, without torch (issue 32, item 9): as accelerate launch,
    a bare python, python3 or python3.12 is sys.executable; a path is kept."""
    fake = tmp_path / "python3"
    fake.write_text("#!/bin/sh\necho wrong python\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
    for name in ("python", "python3", "python3.12"):
        run = plan(["--", name, "-c", "print(1)"], gpus="none")
        assert run.argv[0] == sys.executable and any("not the one on PATH" in n for n in run.notes)
    assert plan([str(fake), "x.py"], gpus="none").argv[0] == str(fake)
    assert plan(["python3", "-m", "torch.distributed.run", "x.py"], gpus="none").launcher == "direct"
    out = subprocess.run([sys.executable, "-m", "torchplace", "run", "--gpus", "none", "--", "python3", "-c",
                          "import sys, torch; print(sys.executable)"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == sys.executable


def test_multinode_options_pass_through_without_standalone():
    run = plan(["python", "train.py"], gpus="none", nproc=1,
               torchrun={"nnodes": "2", "rdzv_backend": "c10d", "rdzv_endpoint": "node0:29400", "rdzv_id": "j1"})
    assert "--standalone" not in run.argv
    i = run.argv.index("--nnodes")
    assert run.argv[i:i + 2] == ["--nnodes", "2"]
    assert run.argv[run.argv.index("--rdzv-endpoint") + 1] == "node0:29400"


def test_several_nodes_get_a_rendezvous_store_per_start(monkeypatch):
    """torch's shared store keeps a node that is started again out of the job (tests/test_example.py)."""
    monkeypatch.delenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", raising=False)
    nodes = {"nnodes": "2", "rdzv_backend": "c10d", "rdzv_endpoint": "node0:29400"}
    run = plan(["python", "train.py"], gpus="none", nproc=1, torchrun=nodes)
    assert run.env_changes["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
    assert any("a node that dies and is started again can rejoin" in note for note in run.notes)
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" not in plan(["python", "t.py"], gpus="none", nproc=2).env_changes
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "0")  # the user's own choice stands
    run = plan(["python", "train.py"], gpus="none", nproc=1, torchrun=nodes)
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" not in run.env_changes


def test_nproc_must_match_the_gpus(h200x2_file, lease_dir):
    with pytest.raises(DistributedError, match=r"--nproc 3 does not match the 2 GPU\(s\) picked"):
        plan(["python", "x.py"], gpus=2, nproc=3, snapshot=str(h200x2_file))
    assert not any(s.held for s in LeaseDir().list())  # released on the error


def test_torchrun_options_with_one_process_are_refused():
    with pytest.raises(DistributedError, match=r"torchrun options \['max_restarts'\] need several processes"):
        plan(["python", "x.py"], gpus="none", torchrun={"max_restarts": "2"})


def test_no_command():
    with pytest.raises(DistributedError, match="No command to run"):
        plan(["--"], gpus="none")


JOB = """
import json, os, sys
from torchplace.distributed.leases import LeaseDir
uuids = os.environ["CUDA_VISIBLE_DEVICES"].split(",")
status = LeaseDir().status(uuids[0])
print(json.dumps({"pid": os.getpid(), "cvd": uuids, "order": os.environ.get("CUDA_DEVICE_ORDER"),
                  "nvls": os.environ.get("NCCL_NVLS_ENABLE"), "held": status.held,
                  "holder": status.holder.pid if status.holder else None, "argv": sys.argv[1:]}))
sys.exit(7)
"""


def test_job_gets_the_environment_the_leases_and_its_exit_code(h200x2_file, lease_dir, run_cli, child_env):
    env = child_env(TORCHPLACE_LEASE_DIR=str(lease_dir), NCCL_NVLS_ENABLE="0")
    out = run_cli(["run", "--snapshot", str(h200x2_file), "--gpus", "1", "--",
                   sys.executable, "-c", JOB, "--lr", "1"], env=env)
    assert out.returncode == 7, out.stderr
    seen = json.loads(out.stdout)
    assert seen["order"] == "PCI_BUS_ID" and seen["cvd"][0].startswith("GPU-") and len(seen["cvd"]) == 1
    assert seen["nvls"] == "0"  # passed through untouched
    assert seen["held"] and seen["holder"] == seen["pid"]  # the job itself holds the lease (exec)
    assert seen["argv"] == ["--lr", "1"]
    assert not LeaseDir(lease_dir).status(seen["cvd"][0]).held  # gone with the job


def test_signals_reach_the_job(lease_dir, run_cli, child_env):
    job = ("import signal, sys, time\n"
           "signal.signal(signal.SIGTERM, lambda *a: sys.exit(42))\n"
           "print('ready', flush=True)\n"
           "time.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-m", "torchplace", "run", "--gpus", "none", "--",
                             sys.executable, "-c", job], stdout=subprocess.PIPE, text=True, env=child_env())
    assert proc.stdout.readline().strip() == "ready"
    proc.send_signal(signal.SIGTERM)  # sent to `torchplace run`'s pid
    assert proc.wait(timeout=120) == 42


def test_unknown_command_exits_127(run_cli):
    out = run_cli(["run", "--gpus", "none", "--", "no-such-program-torchplace"])
    assert out.returncode == 127
    assert "'no-such-program-torchplace' was not found on PATH" in out.stderr


def test_script_that_is_not_executable(run_cli, tmp_path):
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    out = run_cli(["run", "--gpus", "none", "--", str(script)])
    assert out.returncode == 127
    assert "Permission denied" in out.stderr and f"-- python3 {script}" in out.stderr


def test_a_directory_as_the_command_is_named_as_one(run_cli, tmp_path):
    """`run -- ./outputs` said 'Permission denied. Fix: make it executable (chmod +x)'."""
    out = run_cli(["run", "--gpus", "none", "--", str(tmp_path)])
    assert out.returncode == 127 and "it is a directory" in out.stderr and "chmod" not in out.stderr


def test_dry_run_prints_the_command_as_a_shell_reads_it(h200x2_file, lease_dir, run_cli, child_env):
    """`--dry-run -- python 'my script.py' --name 'a b'` printed `python my script.py --name a b`."""
    out = run_cli(["run", "--snapshot", str(h200x2_file), "--gpus", "1", "--once", "--dry-run", "--",
                   "echo", "my script.py", "--name", "a b"], env=child_env(TORCHPLACE_LEASE_DIR=str(lease_dir)))
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[-1] == "echo 'my script.py' --name 'a b'"


def test_dry_run_json_holds_no_lease(h200x2_file, lease_dir, run_cli, child_env):
    out = run_cli(["run", "--snapshot", str(h200x2_file), "--gpus", "2", "--dry-run", "--json", "--",
                   "python", "train.py"], env=child_env(TORCHPLACE_LEASE_DIR=str(lease_dir)))
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["launcher"] == "torchrun" and data["nproc_per_node"] == 2
    assert data["picked"]["leased"] is False
    assert data["argv"][-3:] == ["--", sys.executable, "train.py"]


def test_json_without_dry_run_is_refused_with_the_fix(h200x2_file, lease_dir, run_cli, child_env, tmp_path):
    ran = tmp_path / "ran"
    out = run_cli(["run", "--snapshot", str(h200x2_file), "--gpus", "1", "--json", "--",
                   "touch", str(ran)], env=child_env(TORCHPLACE_LEASE_DIR=str(lease_dir)))
    assert out.returncode == 2 and out.stdout == ""
    assert "--json prints the plan, which only --dry-run reports" in out.stderr
    assert "Fix: `torchplace run --dry-run --json" in out.stderr and "Traceback" not in out.stderr
    assert not ran.exists()  # refused before anything ran or was leased


@pytest.mark.parametrize("cmd, launcher", [
    (["torchrun", "--nproc-per-node", "2", "train.py"], "torchrun"),
    (["/usr/bin/torchrun", "train.py"], "torchrun"),
    (["python", "-m", "torch.distributed.run", "train.py"], "torchrun"),
    (["python3", "-u", "-m", "torch.distributed.launch", "train.py"], "torchrun"),
    (["accelerate", "launch", "train.py"], "accelerate launch"),
    (["deepspeed", "train.py"], "deepspeed"),
])
def test_a_launcher_under_several_gpus_is_refused_with_the_fix(cmd, launcher, h200x2_file, lease_dir):
    with pytest.raises(DistributedError, match=f"starts {launcher}.*--once"):
        plan(cmd, gpus=2, snapshot=str(h200x2_file))
    again = plan(["python", "train.py"], gpus=2, snapshot=str(h200x2_file))  # the refusal gave both GPUs back
    again.picked.release()


def test_a_launcher_with_once_runs_once_with_a_note(h200x2_file, lease_dir):
    run = plan(["torchrun", "--nproc-per-node", "2", "train.py"], gpus=2, once=True, snapshot=str(h200x2_file))
    assert run.launcher == "direct" and run.argv[0] == "torchrun"
    assert any("launcher (torchrun)" in note for note in run.notes)
    run.picked.release()


@pytest.mark.parametrize("cmd", [["python", "train.py"], ["accelerate", "config"], ["python", "-m", "mypkg"],
                                 ["python", "-m"]])
def test_ordinary_commands_are_not_launchers(cmd):
    from torchplace.distributed.run import launcher_in

    assert launcher_in(cmd) is None
