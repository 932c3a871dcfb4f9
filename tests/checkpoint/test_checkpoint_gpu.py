"""GPU twins: CUDA checkpoints on a machine without CUDA, cuda:1 -> cuda:0, the pinned fast path.

Run on a GPU machine: pytest -m gpu tests/checkpoint
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import safetensors.torch
import torch
from torch import nn

import torchplace
from torchplace.checkpoint import fileio, inspect, read_header

pytestmark = pytest.mark.gpu
HELPER = Path(__file__).parent / "helpers" / "load_without_cuda.py"


def _trained(device: torch.device) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(8, 16, device=device)).pow(2).mean().backward()
        opt.step()
    return model, opt


def _reference(model: nn.Module, opt: torch.optim.Optimizer, extra: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    ref = {f"model/{k}": v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    ref.update({f"opt/{pid}/{name}": v.cpu().contiguous() for pid, entry in opt.state_dict()["state"].items()
                for name, v in entry.items()})
    ref.update({f"extra/{k}": v.cpu().contiguous() for k, v in extra.items()})
    return ref


def test_a_cuda_checkpoint_loads_in_a_process_without_cuda(tmp_path: Path) -> None:
    dev = torch.device("cuda", 0)
    model, opt = _trained(dev)
    extra = {"on_gpu": torch.arange(10, device=dev)}
    ours = torchplace.save(tmp_path / "gpu.safetensors", model=model, optimizer=opt, extra=extra)
    theirs = tmp_path / "gpu.pt"
    torch.save(model.state_dict(), theirs)
    ref = tmp_path / "ref.safetensors"
    safetensors.torch.save_file(_reference(model, opt, extra), str(ref))
    assert {t.saved_on for t in inspect(ours).tensors if t.key.startswith("model/")} == {"cuda:0"}
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, str(HELPER), str(ours), str(theirs), str(ref)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stdout + proc.stderr


@pytest.mark.multigpu
def test_cuda1_to_cuda0_keeps_values_and_moves_everything(tmp_path: Path) -> None:
    model, opt = _trained(torch.device("cuda", 1))
    ref = _reference(model, opt, {})
    torch.cuda.manual_seed_all(1234)
    path = torchplace.save(tmp_path / "c.safetensors", model=model, optimizer=opt)
    expected_draw = torch.rand(4, device="cuda:1").cpu()  # what cuda:1's generator gives next

    target = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    target_opt = torch.optim.Adam(target.parameters(), lr=1.0)
    ck = torchplace.load(path, device="cuda:0", model=target, optimizer=target_opt)
    for key, value in target.state_dict().items():
        assert value.device == torch.device("cuda", 0) and torch.equal(value.cpu(), ref[f"model/{key}"])
    for pid, entry in target_opt.state_dict()["state"].items():
        assert entry["step"].device.type == "cpu"
        assert entry["exp_avg"].device == torch.device("cuda", 0)
        assert torch.equal(entry["exp_avg"].cpu(), ref[f"opt/{pid}/exp_avg"])
    assert "cuda:0 (saved from cuda:1)" in ck.rng_restored
    assert torch.equal(torch.rand(4, device="cuda:0").cpu(), expected_draw)  # dropout continues where it was
    assert {t.saved_on for t in inspect(path).tensors if t.key.startswith("model/")} == {"cuda:1"}


def test_large_round_trip_through_pinned_staging(tmp_path: Path) -> None:
    """Odd sizes, tensors straddling chunks, CPU and GPU tensors sharing chunks, several threads."""
    dev = torch.device("cuda", 0)
    g = torch.Generator(device=dev).manual_seed(0)
    tree = {"model": {f"t{i}": torch.randn(1_000_003 + i * 4097, device=dev, generator=g) for i in range(12)},
            "extra": {"cpu": torch.arange(100_001), "half": torch.randn(77_777, device=dev, generator=g).half()}}
    path = fileio.write_file(tmp_path / "big", tree, info={}, chunk_bytes=1 << 20)
    assert len(read_header(path).meta["crc32"]) > 40
    back = fileio.read_file(path, lambda p: dev if p[0] == "model" else torch.device("cpu")).tree
    for key, value in tree["model"].items():
        assert back["model"][key].device == dev and torch.equal(back["model"][key], value)
    assert back["extra"]["cpu"].device.type == "cpu" and torch.equal(back["extra"]["cpu"], tree["extra"]["cpu"])
    assert torch.equal(back["extra"]["half"].to(dev), tree["extra"]["half"])
    ck = torchplace.load(path, device="cuda:0")
    assert all(t.device == dev for t in ck["model"].values()) and ck.extra["cpu"].device == dev


def test_a_flipped_bit_is_caught_on_the_way_to_the_gpu(tmp_path: Path) -> None:
    dev = torch.device("cuda", 0)
    path = torchplace.save(tmp_path / "c", model={"w": torch.randn(3_000_000, device=dev)})
    header = read_header(path)
    data = bytearray(path.read_bytes())
    data[header.data_offset + 5_000_000] ^= 0x04
    path.write_bytes(bytes(data))
    with pytest.raises(torchplace.CheckpointError, match="fail their checksum.*model/w"):
        torchplace.load(path, device="cuda:0")


def test_save_from_the_gpu_does_not_race_pending_kernels(tmp_path: Path) -> None:
    """Values written by kernels still queued on the current stream are what gets saved."""
    dev = torch.device("cuda", 0)
    x = torch.zeros(8_000_000, device=dev)
    for _ in range(20):  # a queue of work on the default stream
        x.add_(1.0)
    path = torchplace.save(tmp_path / "c", model={"x": x})
    assert torch.all(torchplace.load(path)["model"]["x"] == 20.0)
