"""Write a torch.save training checkpoint whose storages say they were on cuda:1, on any machine.

torch.save records each storage's location from the registered taggers; registering one that
tags CPU storages "cuda:1" makes exactly the file a job on GPU 1 writes. Run in its own process,
since the registration is global and permanent. Also writes PATH.reference.safetensors with the
same values. Usage: make_cuda_checkpoint.py PATH
"""

from __future__ import annotations

import sys

import safetensors.torch
import torch
from torch import nn


def _tag(obj):  # noqa: ANN001, ANN202 - torch's tagger signature
    return "cuda:1" if obj.device.type == "cpu" else None


def _never(obj, location):  # noqa: ANN001, ANN202 - torch's deserializer signature
    return None


def main(path: str) -> None:
    torch.serialization.register_package(1, _tag, _never)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    torch.save({"model_state_dict": {"module." + k: v for k, v in model.state_dict().items()},
                "optimizer_state_dict": opt.state_dict(), "epoch": 3}, path)
    reference = {f"model/{k}": v for k, v in model.state_dict().items()}  # the values, through another tool
    reference.update({f"opt/{pid}/{name}": v for pid, entry in opt.state_dict()["state"].items()
                      for name, v in entry.items()})
    safetensors.torch.save_file({k: v.contiguous() for k, v in reference.items()}, path + ".reference.safetensors")


if __name__ == "__main__":
    main(sys.argv[1])
