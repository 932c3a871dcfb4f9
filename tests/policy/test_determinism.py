"""Determinism on the CPU: two seeded runs (init, dropout, shuffled multi-worker loading with NumPy
and Python randomness in the workers) match bit for bit; settings are set and restored."""

from __future__ import annotations

import os
import random

import numpy as np
import pytest
import torch
import torch._dynamo  # noqa: F401 - optimizers import it on first use, and it writes TORCHINDUCTOR_CACHE_DIR

from torchplace import deterministic, seed_everything


class NoisyDataset(torch.utils.data.Dataset):
    """Each item draws from Python's random, NumPy and torch, as augmentation code does."""

    def __len__(self) -> int:
        return 32

    def __getitem__(self, i: int) -> torch.Tensor:
        noise = random.random() + float(np.random.rand()) + float(torch.rand(()))
        return torch.full((8,), i / 32) + noise


def train(seed: int) -> tuple[torch.Tensor, list[float]]:
    """A short training run; returns the final weights and the order of first elements seen."""
    state = seed_everything(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.5), torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    torch.rand(3)  # an unrelated draw: the loader's own generator keeps its order independent of it
    loader = torch.utils.data.DataLoader(NoisyDataset(), batch_size=4, shuffle=True, num_workers=2,
                                         **state.loader_kwargs())
    seen = []
    with deterministic(True):
        for batch in loader:
            seen += batch[:, 0].tolist()
            loss = model(batch).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    return torch.cat([p.detach().flatten() for p in model.parameters()]), seen


def test_two_cpu_runs_are_identical():
    weights_a, seen_a = train(7)
    weights_b, seen_b = train(7)
    assert torch.equal(weights_a, weights_b) and seen_a == seen_b
    weights_c, seen_c = train(8)
    assert not torch.equal(weights_a, weights_c) and seen_a != seen_c  # the seed does matter


def test_seed_everything_reports_what_it_seeded():
    state = seed_everything(0)
    assert state.seeded == ["python random", "numpy global generator", "torch (CPU and every device)"]
    first = (random.random(), float(np.random.rand()), float(torch.rand(())))
    seed_everything(0)
    assert (random.random(), float(np.random.rand()), float(torch.rand(()))) == first
    assert torch.equal(torch.randperm(10, generator=state.generator()), torch.randperm(10, generator=state.generator()))
    with pytest.raises(ValueError, match=r"seed=-1 must be an int in \[0, 2\*\*32\)"):
        seed_everything(-1)


def test_deterministic_sets_every_back_end_and_restores():
    before = (torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.deterministic,
              torch.backends.cudnn.benchmark, os.environ.get("CUBLAS_WORKSPACE_CONFIG"))
    with deterministic(True) as state:
        assert torch.are_deterministic_algorithms_enabled() and torch.backends.cudnn.deterministic
        assert not torch.backends.cudnn.benchmark
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] in (":4096:8", ":16:8")
        assert state.settings["torch.use_deterministic_algorithms"] is True
        assert torch.isnan(torch.empty(4)).all()  # torch fills uninitialized memory in this mode
    assert (torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.deterministic,
            torch.backends.cudnn.benchmark, os.environ.get("CUBLAS_WORKSPACE_CONFIG")) == before


def test_an_op_without_deterministic_kernel_is_named():
    index, values = torch.tensor([0, 1, 1]), torch.ones(3)
    with pytest.raises(RuntimeError, match="put_ does not have a deterministic implementation") as info:
        with deterministic(True) as state:
            torch.zeros(5).put_(index, values)
    assert state.nondeterministic_ops == ["put_"]
    assert any("torchplace: put_ has no deterministic implementation" in n for n in info.value.__notes__)


def test_warn_only_collects_the_ops_and_warns_once():
    index, values = torch.tensor([0, 1, 1]), torch.ones(3)
    with pytest.warns(UserWarning, match="ran without a deterministic implementation.*put_"):
        with deterministic(True, warn_only=True) as state:
            for _ in range(3):
                torch.zeros(5).put_(index, values)
    assert state.nondeterministic_ops == ["put_"]
    assert not torch.are_deterministic_algorithms_enabled()
