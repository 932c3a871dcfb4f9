"""strict(), explain() and watch() around the forward passes of models other frameworks build, on the
CPU: no false alarms (no error, no StrictWarning), and the forward's result is what it is without them.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from torch import nn

import torchplace as tp
from torchplace.errors import TorchplaceWarning


def gpt2() -> tuple[nn.Module, dict[str, torch.Tensor]]:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=50, n_positions=16,
                                       bos_token_id=0, eos_token_id=0)).eval()
    ids = torch.randint(0, 50, (2, 7))
    return model, {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}


def bert() -> tuple[nn.Module, dict[str, torch.Tensor]]:
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    model = BertForSequenceClassification(BertConfig(num_hidden_layers=1, hidden_size=16, num_attention_heads=2,
                                                     intermediate_size=32, vocab_size=40)).eval()
    ids = torch.randint(0, 40, (2, 6))
    return model, {"input_ids": ids, "token_type_ids": torch.zeros_like(ids), "labels": torch.tensor([0, 1])}


def convnet() -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """timm-style: conv stem, BatchNorm buffers, channels_last input (timm cannot be installed beside this torch)."""
    class ConvNet(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                                      nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.body(x)

    torch.manual_seed(0)
    return ConvNet().eval(), {"x": torch.randn(2, 3, 8, 8).to(memory_format=torch.channels_last)}


def lightning_module() -> tuple[nn.Module, dict[str, torch.Tensor]]:
    import lightning

    class Lit(lightning.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 2))
            self.register_buffer("scale", torch.tensor(2.0))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(x) * self.scale

    torch.manual_seed(0)
    return Lit().eval(), {"x": torch.randn(3, 4)}


MODELS = {"hf_gpt2": (gpt2, "transformers"), "hf_bert": (bert, "transformers"), "convnet": (convnet, None),
          "lightning": (lightning_module, "lightning")}


@pytest.fixture
def built(request: Any, monkeypatch: pytest.MonkeyPatch) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    make, needs = MODELS[request.param]
    if needs:
        monkeypatch.setenv("PYTORCH_NVML_BASED_CUDA_CHECK", "")  # importing lightning sets it: put it back after
        monkeypatch.delenv("PYTORCH_NVML_BASED_CUDA_CHECK")
        pytest.importorskip(needs)
    return make()


def forward(model: nn.Module, inputs: dict[str, torch.Tensor]) -> Any:
    with torch.no_grad():
        out = model(**inputs)
    return out.logits if hasattr(out, "logits") else out


@pytest.mark.parametrize("built", list(MODELS), indirect=True)
def test_no_false_alarms(built: tuple[nn.Module, dict[str, torch.Tensor]]) -> None:
    """huggingface/transformers, tests/test_modeling_common.py runs each model's forward under many
    wrappers; here under strict() (every check on, factories and syncs included), watch() and
    explain(), each on the CPU, must raise nothing, warn nothing and leave the output unchanged."""
    model, inputs = built
    want = forward(model, inputs)
    with warnings.catch_warnings():
        warnings.simplefilter("error", TorchplaceWarning)
        with tp.strict(model=model, factories=True, syncs=True):
            got_strict = forward(model, inputs)
        with tp.watch(model):
            got_watch = forward(model, inputs)
        report = tp.explain(model, *list(inputs.values())[:1])  # the first input, positionally: the forward runs
        static = tp.explain(model, inputs)  # a whole batch the forward does not take: the static findings
    assert torch.equal(got_strict, want) and torch.equal(got_watch, want)
    assert report.problems == [] and static.problems == [], str(report)
    assert "ran" in (report["forward"], report["step"]), report["forward"]  # this test's body is the step
    assert torch.equal(forward(model, inputs), want)  # explain restored the buffers it ran with


def test_watch_still_names_a_real_mismatch_in_an_hf_model() -> None:
    """The same HF model with one input on "meta": watch() names the culprit instead of torch's bare message."""
    pytest.importorskip("transformers")
    model, inputs = gpt2()
    inputs["attention_mask"] = inputs["attention_mask"].to("meta")
    with pytest.raises((tp.DeviceMismatchError, RuntimeError)) as err, tp.watch(model):
        forward(model, inputs)
    assert "meta" in str(err.value)


@pytest.mark.parametrize("built", ["hf_gpt2", "lightning"], indirect=True)
def test_a_training_step_under_strict_raises_nothing(built: tuple[nn.Module, dict[str, torch.Tensor]]) -> None:
    """A training step (train mode, dropout, loss, backward, AdamW step) under strict() with every check on."""
    model, inputs = built
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with warnings.catch_warnings():
        warnings.simplefilter("error", TorchplaceWarning)
        with tp.strict(model=model, factories=True, syncs=True):
            out = model(**inputs)
            loss = out.loss if hasattr(out, "loss") else out.pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())
