"""How examples/data/spirals.safetensors was made (run once; the file ships with the repository)."""

import math

import torch
from safetensors.torch import save_file


def spirals(per_class: int = 2000, classes: int = 3, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    xs, ys = [], []
    for c in range(classes):
        r = torch.linspace(0.05, 1.0, per_class)
        theta = r * 4.0 + c * 2 * math.pi / classes + torch.randn(per_class, generator=g) * 0.15
        xs.append(torch.stack([r * torch.sin(theta), r * torch.cos(theta)], dim=1))
        ys.append(torch.full((per_class,), c))
    return torch.cat(xs).float(), torch.cat(ys).long()


if __name__ == "__main__":
    x, y = spirals()
    save_file({"x": x.contiguous(), "y": y.contiguous()}, "examples/data/spirals.safetensors")
