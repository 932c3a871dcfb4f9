"""`torchplace pick` and `torchplace leases` from the command line, on snapshots."""

from __future__ import annotations

import json
import subprocess
import sys

from torchplace.distributed.leases import LeaseDir


def test_pick_prints_the_cuda_visible_devices_value(h200x2, h200x2_file, lease_dir, run_cli, child_env):
    out = run_cli(["pick", "--snapshot", str(h200x2_file)], env=child_env(TORCHPLACE_LEASE_DIR=str(lease_dir)))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() in {g.uuid for g in h200x2.gpus}


def test_pick_format_index_prints_nvidia_smi_indices(h200x2_file, lease_dir, run_cli, child_env):
    env = child_env(TORCHPLACE_LEASE_DIR=str(lease_dir))
    env.pop("CUDA_DEVICE_ORDER", None)
    out = run_cli(["pick", "--snapshot", str(h200x2_file), "--count", "2", "--format", "index"], env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout == "0,1\n"
    assert "CUDA_DEVICE_ORDER=PCI_BUS_ID" in out.stderr  # the indices mean the same to CUDA only then
    quiet = run_cli(["pick", "--snapshot", str(h200x2_file), "--count", "2", "--format", "index"],
                    env={**env, "CUDA_DEVICE_ORDER": "PCI_BUS_ID"})
    assert (quiet.stdout, quiet.stderr) == ("0,1\n", "")


def test_pick_json_and_explain(h200x2_file, lease_dir, run_cli, child_env):
    out = run_cli(["pick", "--snapshot", str(h200x2_file), "--count", "2", "--json", "--explain"],
                  env=child_env(TORCHPLACE_LEASE_DIR=str(lease_dir)))
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert [g["physical_index"] for g in data["gpus"]] == [0, 1]
    assert data["leased"] is False and data["cuda_device_order"] == "PCI_BUS_ID"
    assert out.stderr.count("picked GPU") == 2


def test_pick_skips_leased_gpus_and_fails_with_reasons(h200x2, h200x2_file, lease_dir, run_cli, child_env):
    env = child_env(TORCHPLACE_LEASE_DIR=str(lease_dir))
    held = LeaseDir(lease_dir).try_acquire(h200x2.gpus[0].uuid, command="someone's training")
    try:
        out = run_cli(["pick", "--snapshot", str(h200x2_file)], env=env)
        assert out.stdout.strip() == h200x2.gpus[1].uuid
        out = run_cli(["pick", "--snapshot", str(h200x2_file), "--count", "2"], env=env)
        assert out.returncode == 2
        assert "torchplace: error: Cannot pick 2 GPUs in " in out.stderr
        assert f"GPU 0 ({h200x2.gpus[0].uuid}): leased by pid " in out.stderr
        assert "(someone's training)" in out.stderr
        out = run_cli(["pick", "--snapshot", str(h200x2_file), "--min-free-memory", "200GiB"], env=env)
        assert "Cannot pick 1 GPU with >= 200.0 GiB free" in out.stderr
        assert "GPU 1 (GPU-36caea5e-7edb-38d1-3a42-094b7e0d7368): 139.8 GiB free < 200.0 GiB required" in out.stderr
        out = run_cli(["pick", "--snapshot", str(h200x2_file), "--min-free-memory", "lots"], env=env)
        assert out.returncode == 2 and "size 'lots' is not understood" in out.stderr
    finally:
        held.release()


def test_leases_lists_holders(h200x2, h200x2_file, lease_dir, scripts, run_cli, child_env):
    env = child_env(TORCHPLACE_LEASE_DIR=str(lease_dir))
    holder = subprocess.Popen([sys.executable, str(scripts / "hold_lease.py"), h200x2.gpus[1].uuid],
                              stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert holder.stdout.readline().strip() == "HELD"
        out = run_cli(["leases", "--json", "--snapshot", str(h200x2_file)], env=env)
        assert out.returncode == 0, out.stderr
        data = json.loads(out.stdout)
        assert data["lease_dir"] == str(lease_dir)
        [lease] = data["leases"]
        assert lease["physical_index"] == 1 and lease["name"] == "NVIDIA H200"
        assert lease["holder"]["pid"] == holder.pid and lease["holder"]["command"] == "hold_lease.py test holder"
        table = run_cli(["leases", "--snapshot", str(h200x2_file)], env=env)
        assert str(holder.pid) in table.stdout and "hold_lease" in table.stdout
    finally:
        holder.kill()
        holder.wait()
    out = run_cli(["leases", "--no-gpu-names"], env=env)
    assert "No GPU is leased" in out.stdout
