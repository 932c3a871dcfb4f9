"""A small real training run that works on whatever device this machine has.

    python examples/train.py --quick

Trains a classifier on a data set generated from a fixed seed (nothing is downloaded) on the
device torchplace resolves ("auto": LOCAL_RANK's GPU, else cuda:0, else another accelerator,
else cpu), and prints the loss per epoch.
"""

from __future__ import annotations

import argparse

import torch
from rich.progress import Progress

import torchplace as tp


def make_data(n: int = 4096, features: int = 32, classes: int = 4, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    centers = torch.randn(classes, features, generator=g) * 2
    labels = torch.randint(0, classes, (n,), generator=g)
    x = centers[labels] + torch.randn(n, features, generator=g)
    return torch.utils.data.TensorDataset(x, labels)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="auto")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="2 epochs, for a smoke run")
    args = parser.parse_args()
    epochs = 2 if args.quick else args.epochs

    dev = tp.device(args.device)
    torch.manual_seed(0)
    data = torch.utils.data.DataLoader(make_data(), batch_size=128, shuffle=True)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4)).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    print(f"training on {dev}")
    with Progress() as progress:
        task = progress.add_task("train", total=epochs * len(data))
        for epoch in range(epochs):
            total = 0.0
            for x, y in data:
                x, y = x.to(dev), y.to(dev)
                loss = torch.nn.functional.cross_entropy(model(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                total += loss.item()
                progress.advance(task)
            progress.console.print(f"epoch {epoch}: loss {total / len(data):.4f}")


if __name__ == "__main__":
    main()
