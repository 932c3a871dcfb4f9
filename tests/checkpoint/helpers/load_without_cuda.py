"""Load GPU-made checkpoints in a process that sees no GPU (run with CUDA_VISIBLE_DEVICES="").

Usage: load_without_cuda.py TORCHPLACE_FILE TORCH_SAVE_FILE REFERENCE.safetensors
REFERENCE holds CPU copies of the values: model/KEY and opt/PID/NAME. Prints "ok" on success.
"""

from __future__ import annotations

import sys

import safetensors.torch
import torch
from torch import nn

import torchplace


def main(ours: str, theirs: str, reference: str) -> None:
    assert not torch.cuda.is_available(), "this check must run without a visible GPU"
    ref = safetensors.torch.load_file(reference)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))  # as in test_checkpoint_gpu.py
    opt = torch.optim.Adam(model.parameters(), lr=1.0)
    ck = torchplace.load(ours, model=model, optimizer=opt)
    for key, value in model.state_dict().items():
        assert value.device.type == "cpu" and torch.equal(value, ref[f"model/{key}"]), key
    for pid, entry in opt.state_dict()["state"].items():
        assert entry["step"].device.type == "cpu"
        for name in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(entry[name], ref[f"opt/{pid}/{name}"]), (pid, name)
    assert ck.metadata["primary_device"].startswith("cuda")
    assert ck.rng_skipped and all("no usable CUDA" in why for why in ck.rng_skipped.values()), ck.rng_skipped
    assert torch.equal(ck.extra["on_gpu"], ref["extra/on_gpu"]) and ck.extra["on_gpu"].device.type == "cpu"

    plain = torchplace.load(theirs)  # a torch.save file of CUDA tensors
    for key, value in plain["model"].items():
        assert value.device.type == "cpu" and torch.equal(value, ref[f"model/{key}"]), key
    print("ok", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:4])
