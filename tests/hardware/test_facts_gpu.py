"""On a GPU machine: facts never start CUDA, stay fork-safe, and agree with the driver."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from torchplace.hardware.driver_probe import probe_driver
from torchplace.hardware.topology import read_topology
from torchplace.hardware.visible import map_visible

pytestmark = pytest.mark.gpu


def run_py(code: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **(env or {})})


def test_reading_every_fact_never_initializes_cuda():
    code = ("import torch, torchplace as tp; from torchplace.doctor.diagnose import diagnose; "
            "r = diagnose(check_driver=True); tp.device('auto'); tp.device('cuda:0'); "
            "tp.visible_devices(); print(len(r.facts.topology.gpus), torch.cuda.is_initialized())")
    out = run_py(code)
    assert out.returncode == 0, out.stderr
    gpus, initialized = out.stdout.split()
    assert int(gpus) >= 1 and initialized == "False"


def test_fork_after_facts_can_use_cuda():
    code = ("import os, torch; from torchplace.hardware.facts import read_facts; read_facts(); "
            "pid = os.fork()\nif pid == 0:\n    torch.ones(1, device='cuda').sum().item(); os._exit(0)\n"
            "_, status = os.waitpid(pid, 0); print(os.waitstatus_to_exitcode(status))")
    out = run_py(code)
    assert out.returncode == 0 and out.stdout.strip() == "0", out.stderr


def test_nvml_facts_are_complete_on_h200():
    topo = read_topology()
    assert topo.nvml_available and topo.driver_version
    for gpu in topo.gpus:
        assert gpu.uuid.startswith("GPU-") and gpu.name and gpu.compute_capability == [9, 0]
        assert gpu.memory_total_bytes and gpu.memory_total_bytes > 100 << 30 and gpu.processes is not None
        assert gpu.cores and gpu.max_sm_clock_mhz and gpu.cpu_affinity


def test_the_reading_for_picking_skips_only_the_details_picking_does_not_use():
    full, quick = read_topology(links=False), read_topology(links=False, details=False)
    assert [g.uuid for g in quick.gpus] == [g.uuid for g in full.gpus]
    for gpu in quick.gpus:
        assert gpu.memory_free_bytes is not None and gpu.utilization is not None and gpu.processes is not None
        assert gpu.compute_mode and gpu.mig_mode and gpu.pci_bus_id
        assert gpu.cores is None and gpu.cpu_affinity is None and not gpu.unknown


def _values(uuids: list[str]) -> list[str | None]:
    n = len(uuids)
    vals = [None, "", "0", f"{n - 1}", f"0,{n}", "0,0", "0,abc", " 0 ", "1abc", uuids[-1], uuids[-1][:12],
            f"{uuids[0]},0", "GPU-", "-1", "0,2,0", "0,abc,0"]
    if n > 1:
        vals += ["1,0", f"{uuids[1]},{uuids[0]}", "0,1,0"]
    return vals


@pytest.mark.parametrize("order", [None, "PCI_BUS_ID", "FASTEST_FIRST"])
def test_mapping_agrees_with_the_driver(order):
    topo = read_topology()
    for value in _values([g.uuid for g in topo.gpus]):
        env = {k: v for k, v in os.environ.items() if k not in ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER")}
        if value is not None:
            env["CUDA_VISIBLE_DEVICES"] = value
        if order:
            env["CUDA_DEVICE_ORDER"] = order
        view = probe_driver(env)
        ours = [d.uuid for d in map_visible(value, topo, order).visible]
        assert (view.uuids or []) == ours, f"CUDA_VISIBLE_DEVICES={value!r} order={order}: driver {view}"


def test_torch_device_count_agrees_with_the_mapping():
    topo = read_topology()
    for value in _values([g.uuid for g in topo.gpus])[:10]:
        env = {"CUDA_VISIBLE_DEVICES": value} if value is not None else {}
        out = run_py("import torch; print(torch.cuda.device_count())", env)
        assert int(out.stdout.strip() or -1) == map_visible(value, topo, None).count, value


def test_doctor_cli_reports_the_driver_check():
    out = run_py("from torchplace.cli import main; raise SystemExit(main(['doctor', '--check-driver', '--json']))")
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr
    assert '"driver.agrees"' in out.stdout
