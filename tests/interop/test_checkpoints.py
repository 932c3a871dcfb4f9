"""`save` / `load` / `save_async` on the models and optimizers other frameworks make: every value
round-trips bit for bit, tied and shared parameters stay tied, wrapper prefixes are mapped, and a
model whose keys differ is refused with the keys named (never loaded silently wrong).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import torchplace as tp

from .helpers import on_host


def same_state(a: Any, b: Any) -> None:
    """A and B (state dicts, optimizer states: nested dicts, lists, tensors, numbers) equal bit for bit."""
    assert on_host(a) == on_host(b)


def round_trip(tmp_path: Path, make: Any, **save_kw: Any) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    saved = make()
    torch.manual_seed(1)
    loaded = make()
    path = tp.save(tmp_path / "ck.safetensors", model=saved, **save_kw)
    tp.load(path, model=loaded)
    same_state(saved.state_dict(), loaded.state_dict())
    return saved, loaded


def tiny_gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50, n_positions=16,
                                      bos_token_id=0, eos_token_id=0))


def test_hf_model_with_tied_embeddings(tmp_path: Path) -> None:
    """huggingface/transformers, tests/test_modeling_common.py (test_tied_weights_keys, save and load
    keep lm_head tied to the input embeddings): after our load they are still one tensor."""
    pytest.importorskip("transformers")
    _, loaded = round_trip(tmp_path, tiny_gpt2)
    assert loaded.lm_head.weight is loaded.transformer.wte.weight


def test_hf_tied_model_through_save_async(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    saved = tiny_gpt2()
    torch.manual_seed(1)
    loaded = tiny_gpt2()
    tp.save_async(tmp_path / "ck.safetensors", model=saved).result()
    tp.load(tmp_path / "ck.safetensors", model=loaded)
    same_state(saved.state_dict(), loaded.state_dict())
    assert loaded.lm_head.weight is loaded.transformer.wte.weight


class LitNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))
        self.register_buffer("steps", torch.tensor(5))


def test_lightning_module_with_buffers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Lightning-AI/pytorch-lightning, tests/tests_pytorch/checkpointing/ (a LightningModule's weights
    and buffers, BatchNorm's running stats and num_batches_tracked included, come back)."""
    monkeypatch.setenv("PYTORCH_NVML_BASED_CUDA_CHECK", "")  # importing lightning sets it: put it back after
    monkeypatch.delenv("PYTORCH_NVML_BASED_CUDA_CHECK")
    lightning = pytest.importorskip("lightning")

    class Lit(lightning.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.body = LitNet()

    def make() -> nn.Module:
        m = Lit()
        m.body.net(torch.randn(2, 3, 5, 5))  # running stats moved off their start
        return m

    round_trip(tmp_path, make)


def test_accelerate_prepared_model_and_optimizer(tmp_path: Path) -> None:
    """huggingface/accelerate, tests/test_accelerator.py (save_state/load_state of prepared objects),
    with our save and load: the AcceleratedOptimizer's state comes back bit for bit."""
    accelerate = pytest.importorskip("accelerate")
    acc = accelerate.Accelerator(cpu=True)
    torch.manual_seed(0)
    model = acc.prepare(nn.Linear(3, 3))
    opt = acc.prepare(torch.optim.AdamW(model.parameters()))
    model(torch.randn(2, 3)).sum().backward()
    opt.step()
    tp.save(tmp_path / "ck.safetensors", model=model, optimizer=opt)
    model2 = acc.prepare(nn.Linear(3, 3))
    opt2 = acc.prepare(torch.optim.AdamW(model2.parameters()))
    tp.load(tmp_path / "ck.safetensors", model=model2, optimizer=opt2)
    same_state(model.state_dict(), model2.state_dict())
    same_state(opt.state_dict(), opt2.state_dict())


def test_compiled_and_data_parallel_prefixes(tmp_path: Path) -> None:
    """pytorch/pytorch, test/dynamo/test_modules.py (OptimizedModule's state dict under '_orig_mod.')
    and nn.DataParallel's 'module.' prefix: each loads into the bare model and back."""
    torch.manual_seed(0)
    compiled = torch.compile(nn.Linear(3, 3))
    tp.save(tmp_path / "c.safetensors", model=compiled.state_dict())
    bare = nn.Linear(3, 3)
    tp.load(tmp_path / "c.safetensors", model=bare)
    same_state(compiled._orig_mod.state_dict(), bare.state_dict())
    wrapped = nn.DataParallel(nn.Linear(3, 3))
    tp.save(tmp_path / "b.safetensors", model=bare)
    tp.load(tmp_path / "b.safetensors", model=wrapped)
    same_state(bare.state_dict(), wrapped.module.state_dict())
    tp.save(tmp_path / "w.safetensors", model=wrapped.state_dict())
    again = nn.Linear(3, 3)
    tp.load(tmp_path / "w.safetensors", model=again)
    same_state(bare.state_dict(), again.state_dict())


class SharedHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Linear(4, 4)
        self.dec = nn.Linear(4, 4)
        self.dec.weight = self.enc.weight


class Symmetric(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.triu() + x.triu(1).t()


class Parametrized(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.sym = nn.Linear(3, 3)
        nn.utils.parametrize.register_parametrization(self.sym, "weight", Symmetric())
        self.wn = nn.utils.parametrizations.weight_norm(nn.Linear(3, 4))
        self.register_buffer("scratch", torch.randn(2), persistent=False)
        self.register_buffer("kept", torch.randn(2))


def test_shared_parameters_stay_shared(tmp_path: Path) -> None:
    """pytorch/pytorch, test/test_nn.py (state_dict of modules sharing a parameter): one tensor after load."""
    _, loaded = round_trip(tmp_path, SharedHead)
    assert loaded.dec.weight is loaded.enc.weight


def test_parametrizations_weight_norm_and_non_persistent_buffers(tmp_path: Path) -> None:
    """pytorch/pytorch, test/nn/test_parametrization.py (a parametrized module's state dict holds
    'parametrizations.weight.original*' and loads back); a non-persistent buffer is not saved and
    the loaded model keeps its own."""
    torch.manual_seed(1)
    target = Parametrized()
    own = target.scratch.clone()
    torch.manual_seed(0)
    source = Parametrized()
    tp.save(tmp_path / "p.safetensors", model=source)
    tp.load(tmp_path / "p.safetensors", model=target)
    same_state(source.state_dict(), target.state_dict())
    assert torch.equal(target.scratch, own) and torch.equal(target.sym.weight, source.sym.weight)
    assert torch.equal(target.wn.weight, source.wn.weight)


OPTIMIZERS = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2),
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True),
    "lbfgs": lambda ps: torch.optim.LBFGS(ps, history_size=3),
    "adam_amsgrad": lambda ps: torch.optim.Adam(ps, amsgrad=True),
}


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_optimizer_scheduler_and_grad_scaler_state(tmp_path: Path, name: str) -> None:
    """pytorch/pytorch, test/optim/test_optim.py (state_dict/load_state_dict round trips of each
    optimizer: step counts, momentum buffers, LBFGS's history lists) with an lr_scheduler and a
    GradScaler (test/test_torch.py, GradScaler state_dict), saved and loaded by us."""
    make = OPTIMIZERS[name]
    torch.manual_seed(0)
    model = nn.Linear(3, 3)
    opt = make(model.parameters())
    sched = None if name == "lbfgs" else torch.optim.lr_scheduler.StepLR(opt, 1, 0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=7)

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = model(torch.randn(4, 3)).pow(2).sum()
        loss.backward()
        return loss

    for _ in range(3):
        opt.step(closure)
        if sched is not None:
            sched.step()
    tp.save(tmp_path / "o.safetensors", model=model, optimizer=opt, scheduler=sched, scaler=scaler)
    model2 = nn.Linear(3, 3)
    opt2 = make(model2.parameters())
    sched2 = None if sched is None else torch.optim.lr_scheduler.StepLR(opt2, 3, 0.1)
    scaler2 = torch.amp.GradScaler("cpu", init_scale=2.0)
    tp.load(tmp_path / "o.safetensors", model=model2, optimizer=opt2, scheduler=sched2, scaler=scaler2)
    same_state(opt.state_dict(), opt2.state_dict())
    assert scaler2.state_dict() == scaler.state_dict()
    if sched is not None:
        assert sched2.state_dict() == sched.state_dict()


def test_keys_that_differ_are_named_never_loaded_silently(tmp_path: Path) -> None:
    """pytorch/pytorch, test/test_nn.py (load_state_dict strict: missing and unexpected keys listed;
    strict=False loads the rest and reports them): through our load the refusal names the keys, and
    strict=False reports them on the result."""
    torch.manual_seed(0)
    tp.save(tmp_path / "k.safetensors", model=nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 3)))
    target = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(3, 3))
    with pytest.raises(tp.CheckpointError, match=r"(?s)Missing key.*2\.weight.*Unexpected key.*1\.weight"):
        tp.load(tmp_path / "k.safetensors", model=target)
    ck = tp.load(tmp_path / "k.safetensors", model=target, strict=False)
    assert set(ck.missing_keys) == {"2.weight", "2.bias"} and set(ck.unexpected_keys) == {"1.weight", "1.bias"}
    tp.save(tmp_path / "s.safetensors", model=nn.Linear(2, 3))
    with pytest.raises(tp.CheckpointError, match="size mismatch for weight"):
        tp.load(tmp_path / "s.safetensors", model=nn.Linear(2, 4))
