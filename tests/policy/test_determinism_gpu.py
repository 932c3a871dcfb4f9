"""On a GPU: two deterministic runs of a conv + embedding training loop match bit for bit, and an
op without a deterministic CUDA kernel is named."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo  # noqa: F401 - optimizers import it on first use, and it writes TORCHINDUCTOR_CACHE_DIR

from torchplace import deterministic, seed_everything

pytestmark = pytest.mark.gpu


class GlobalMean(torch.nn.Module):
    """Global average pooling by mean (AdaptiveAvgPool2d's CUDA backward has no deterministic kernel)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mean(dim=(2, 3))


def train(seed: int) -> torch.Tensor:
    dev = torch.device("cuda", 0)
    seed_everything(seed)
    with deterministic(True):
        conv = torch.nn.Sequential(torch.nn.Conv2d(3, 16, 3), torch.nn.BatchNorm2d(16), torch.nn.ReLU(),
                                   GlobalMean(), torch.nn.Dropout(0.2), torch.nn.Linear(16, 10)).to(dev)
        emb = torch.nn.Embedding(100, 10).to(dev)
        params = [*conv.parameters(), *emb.parameters()]
        opt = torch.optim.AdamW(params, lr=1e-3)
        for _ in range(10):
            images = torch.randn(32, 3, 32, 32, device=dev)
            tokens = torch.randint(0, 100, (32,), device=dev)  # repeated ids: embedding backward accumulates
            target = torch.randn(32, 10, device=dev)
            loss = (conv(images) + emb(tokens) - target).pow(2).mean()  # NLLLoss on CUDA has no deterministic kernel
            opt.zero_grad()
            loss.backward()
            opt.step()
        return torch.cat([p.detach().flatten() for p in params]).cpu()


def test_two_gpu_runs_match():
    first, second = train(3), train(3)
    assert torch.equal(first, second)
    assert not torch.equal(first, train(4))


def test_a_cuda_op_without_deterministic_kernel_is_named():
    x = torch.rand(1000, device="cuda:0")
    with pytest.raises(RuntimeError, match="does not have a deterministic implementation") as info:
        with deterministic(True) as state:
            torch.histc(x, bins=10)
    assert state.nondeterministic_ops and "histc" in state.nondeterministic_ops[0]
    assert any(note.startswith("torchplace:") for note in info.value.__notes__)
