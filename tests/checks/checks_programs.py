"""Small programs that make each device mistake of issue 4, and clean ones that must stay silent.

Shared by the hardware-free tests (cpu and meta) and their GPU twins (cuda:0, cuda:1, cpu): every
program takes its devices as arguments. A line that makes a mistake ends with `# mistake: NAME`,
so a test can check that the report names this file and that line.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

FILE = Path(__file__).name
WIDTH, CLASSES = 8, 3


def line_of(name: str) -> int:
    """The line that carries `# mistake: NAME` in this file."""
    for number, line in enumerate(Path(__file__).read_text().splitlines(), 1):
        if re.search(rf"# mistake: {re.escape(name)}$", line):
            return number
    raise LookupError(name)


def at(name: str) -> str:
    """'checks_programs.py:LINE', as reports print a location."""
    return f"{FILE}:{line_of(name)}"


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(WIDTH, WIDTH)
        self.norm = nn.LayerNorm(WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.proj(x)).relu()  # mistake: block


class Toy(nn.Module):
    """model.layers.0.proj ... model.head: deep enough for module paths to mean something."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(WIDTH, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)  # mistake: head


class Scaled(nn.Module):
    """Keeps a tensor as a plain attribute: model.to() leaves it behind."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(WIDTH, WIDTH)
        self.scale = torch.ones(WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x) * self.scale  # mistake: plain-attribute


class WithConstant(nn.Module):
    """Makes a constant in forward without a device: it stays on the CPU."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        offsets = torch.arange(WIDTH, dtype=x.dtype)
        return self.proj(x) + offsets  # mistake: constant


class WithBuffer(nn.Module):
    """The clean version of both: a registered buffer and a constant made on the input's device."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(WIDTH, WIDTH)
        self.register_buffer("scale", torch.ones(WIDTH), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        offsets = torch.arange(WIDTH, dtype=x.dtype, device=x.device)
        return self.proj(x) * self.scale + offsets * 0.5


def batch_on(device: torch.device | str, n: int = 4) -> dict[str, torch.Tensor]:
    return {"x": torch.randn(n, WIDTH, device=device), "y": torch.randint(0, CLASSES, (n,), device=device)}


def forward_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    logits = model(batch["x"])  # mistake: call
    return F.cross_entropy(logits, batch["y"])  # mistake: loss


def late_submodule(device: torch.device | str) -> Toy:
    model = Toy().to(device)
    model.head = nn.Linear(WIDTH, CLASSES)  # mistake: late-submodule
    return model


# placement that depends on the current device
def cuda_without_index(t: torch.Tensor) -> torch.Tensor:
    return t.cuda()  # mistake: cuda-no-index


def to_cuda_string(t: torch.Tensor) -> torch.Tensor:
    return t.to("cuda")  # mistake: to-cuda


def to_cuda_device(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.device("cuda"), non_blocking=True)  # mistake: to-cuda-device


def module_cuda(model: nn.Module) -> nn.Module:
    return model.cuda()  # mistake: module-cuda


def mask_without_device(n: int) -> torch.Tensor:
    return torch.ones(n, n)  # mistake: factory-no-device


def zeros_on_cuda(n: int) -> torch.Tensor:
    return torch.zeros(n, device=torch.device("cuda"))  # mistake: factory-cuda


# current-device changes that leak out of a function
def init_on_meta() -> None:
    torch.set_default_device("meta")  # mistake: leak-default


def pick_gpu(index: int) -> None:
    torch.cuda.set_device(index)  # mistake: leak-cuda


def restoring_helper() -> torch.Tensor:
    torch.set_default_device("meta")
    try:
        return torch.zeros(2)
    finally:
        torch.set_default_device(None)


def scoped_helper() -> torch.Tensor:
    with torch.device("meta"):
        return torch.zeros(2)


# autocast for a device type none of the tensors are on
def amp_forward(model: nn.Module, x: torch.Tensor, device_type: str) -> torch.Tensor:
    with torch.autocast(device_type, dtype=torch.bfloat16):  # mistake: autocast
        return model(x)


# host-device synchronization inside a hot loop
def hot_loop(model: nn.Module, batches: list[dict[str, torch.Tensor]]) -> float:
    total = 0.0
    for batch in batches:
        total += forward_loss(model, batch).item()  # mistake: sync
    return total


# clean programs: real training and inference that must stay silent
def clean_training(device: torch.device | str, steps: int = 3, amp: bool = True) -> list[float]:
    """DataLoader, explicit non_blocking copies, autocast for the model's device, AdamW, buffers;
    every factory names its device, so even strict(factories=True) has nothing to say."""
    device = torch.device(device)
    torch.manual_seed(0)
    model = nn.Sequential(Toy(), nn.Linear(CLASSES, CLASSES)).to(device)
    model[0].layers.append(WithBuffer().to(device))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = torch.utils.data.TensorDataset(torch.randn(steps * 4, WIDTH, device="cpu"),
                                          torch.randint(0, CLASSES, (steps * 4,), device="cpu"))
    loader = torch.utils.data.DataLoader(data, batch_size=4, pin_memory=device.type == "cuda")
    losses = []
    for x, y in loader:
        batch = {"x": x.to(device, non_blocking=True), "y": y.to(device, non_blocking=True)}
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
            loss = forward_loss(model, batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    return [float(v) for v in losses] if device.type != "meta" else []


def clean_inference(device: torch.device | str) -> torch.Tensor:
    device = torch.device(device)
    model = Toy().to(device).eval()
    with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16):
        return model(torch.randn(2, WIDTH, device=device)).float()
