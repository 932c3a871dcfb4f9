"""strict() and watch() around whole training loops other frameworks run (Lightning's Trainer, Fabric,
accelerate's prepared loop, transformers' Trainer), on the CPU: a correct loop raises and warns nothing;
a planted mistake is named at the user's line, with the user's module paths (not the wrappers').
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

import torchplace as tp
from torchplace.errors import TorchplaceWarning


@pytest.fixture(autouse=True)
def _quiet(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("PYTORCH_NVML_BASED_CUDA_CHECK", "")  # importing lightning sets it: put it back after
    with warnings.catch_warnings():
        warnings.simplefilter("error", TorchplaceWarning)
        yield


def checks(model: nn.Module) -> list[Any]:
    return [tp.strict(model=model, factories=True), tp.watch(model)]


class Net(nn.Module):
    """The user's model; `plant` puts a meta tensor into its forward."""

    def __init__(self, plant: bool = False) -> None:
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(4, 8), nn.ReLU())
        self.head = nn.Linear(8, 1)
        self.plant = plant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.enc(x)
        if self.plant:
            bias = torch.zeros(8, device="meta")
            h = h + bias  # the planted mistake
        return self.head(h)


def loader() -> torch.utils.data.DataLoader:
    torch.manual_seed(0)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(12, 4), torch.randn(12, 1)),
                                       batch_size=4)


def lightning_trainer(plant: str) -> None:
    import lightning as L

    class Lit(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = Net(plant == "forward")

        def training_step(self, batch: Any, index: int) -> torch.Tensor:
            x, y = batch
            weight = torch.ones(1, device="meta" if plant == "loss" else x.device)
            return ((self.net(x) - y) ** 2 * weight).mean()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    model, data = Lit(), loader()
    for check in checks(model):
        trainer = L.Trainer(accelerator="cpu", max_steps=3, logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False)
        with check:
            trainer.fit(model, data)
        assert trainer.global_step == 3


def fabric_or_accelerate(which: str, plant: str) -> None:
    if which == "fabric":
        import lightning as L

        fabric = L.Fabric(accelerator="cpu", devices=1, precision="bf16-mixed")
        model, opt = fabric.setup(Net(plant == "forward"), torch.optim.SGD(Net().parameters(), lr=0.1))
        data, backward = fabric.setup_dataloaders(loader()), fabric.backward
    else:
        from accelerate import Accelerator
        from accelerate.state import AcceleratorState

        AcceleratorState._reset_state(True)  # a singleton: another test may have made it without bf16
        acc = Accelerator(cpu=True, mixed_precision="bf16")
        net = Net(plant == "forward")
        model, opt, data = acc.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1), loader())
        backward = acc.backward
    weight = torch.ones(1, device="meta" if plant == "loss" else "cpu")
    try:
        for check in checks(model):
            with check:
                for x, y in data:
                    loss = ((model(x) - y) ** 2 * weight).mean()  # the user's loss line
                    backward(loss)
                    opt.step()
                    opt.zero_grad()
    finally:
        if which != "fabric":
            AcceleratorState._reset_state(True)  # leave no bf16 state to the next test


def hf_trainer(plant: str, tmp_path: Any) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50, n_positions=16,
                                       bos_token_id=0, eos_token_id=0))

    class Tokens(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 8

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            ids = torch.randint(0, 50, (7,))  # a Dataset makes CPU tensors: not a strict(factories=) finding
            return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}

    class Weighted(Trainer):
        def compute_loss(self, model: Any, inputs: Any, return_outputs: bool = False, **kwargs: Any) -> Any:
            out = model(**inputs)
            class_weight = torch.ones(50, device="meta" if plant == "loss" else out.logits.device)
            loss = nn.functional.cross_entropy(out.logits.flatten(0, 1), inputs["labels"].flatten(),
                                               weight=class_weight)
            return (loss, out) if return_outputs else loss

    args = TrainingArguments(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=4, use_cpu=True,
                             report_to=[], save_strategy="no", logging_strategy="no", disable_tqdm=True)
    trainer = Weighted(model=model, args=args, train_dataset=Tokens())
    for check in checks(model):
        with check:
            trainer.train()


def test_lightning_trainer_fit_raises_and_warns_nothing() -> None:
    """Lightning-AI/pytorch-lightning tests/tests_pytorch/trainer/test_trainer.py fits a BoringModel for a
    few steps on the CPU; here that fit runs under strict() (every check on) and watch()."""
    pytest.importorskip("lightning")
    lightning_trainer("")


@pytest.mark.parametrize("plant", ["loss", "forward"])
def test_lightning_trainer_names_the_training_step_line(plant: str) -> None:
    pytest.importorskip("lightning")
    with pytest.raises(tp.DeviceMismatchError) as err:
        lightning_trainer(plant)
    text = str(err.value)
    assert "on meta" in text and "test_checks_training_loops.py" in text
    assert ("weight" in text and "training_step()" in text) if plant == "loss" else "model.net (Net)" in text


@pytest.mark.parametrize("which", ["fabric", "accelerate"])
def test_prepared_loops_raise_and_warn_nothing(which: str) -> None:
    """Lightning's tests_fabric/test_wrappers.py and accelerate's test_utils/scripts/test_script.py train
    a model through fabric.setup / accelerator.prepare with bf16 autocast on the CPU: no false alarms."""
    pytest.importorskip("lightning" if which == "fabric" else "accelerate")
    fabric_or_accelerate(which, "")


@pytest.mark.parametrize("which", ["fabric", "accelerate"])
def test_prepared_loops_name_the_users_module_not_the_wrapper(which: str) -> None:
    """A mistake inside the forward of a model Fabric wrapped (_FabricModule) used to be placed 'inside
    module model._forward_module (Net)'; the report now names the user's model, through the wrapper."""
    pytest.importorskip("lightning" if which == "fabric" else "accelerate")
    with pytest.raises(tp.DeviceMismatchError) as err:
        fabric_or_accelerate(which, "forward")
    text = str(err.value)
    assert "inside module model (Net)" in text and "_forward_module" not in text, text
    assert "h + bias" in text and "bias on meta" in text


@pytest.mark.parametrize("which", ["fabric", "accelerate"])
def test_prepared_loops_name_the_loss_weight(which: str) -> None:
    pytest.importorskip("lightning" if which == "fabric" else "accelerate")
    with pytest.raises(tp.DeviceMismatchError, match=r"weight on meta.*\nFix: .*\n.*made by `weight = torch.ones"):
        fabric_or_accelerate(which, "loss")


def test_parameter_names_through_ddp_and_fabric_wrappers(tmp_path: Any) -> None:
    """A parameter left on another device is named as the user's model names it (net.head.bias: the user holds
    the inner module as `net`), not through the wrapper's attribute (ddp.module.head.bias,
    model._forward_module.head.bias)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        net = Net()
        ddp = nn.parallel.DistributedDataParallel(net)
        net.head.bias = nn.Parameter(torch.zeros(1, device="meta"))
        with pytest.raises(tp.DeviceMismatchError) as err, tp.watch(ddp):
            net(torch.randn(2, 4))
    finally:
        dist.destroy_process_group()
    text = str(err.value)
    assert "parameter net.head.bias" in text and ".module" not in text, text


def test_hf_trainer_raises_and_warns_nothing(tmp_path: Any) -> None:
    """huggingface/transformers tests/trainer/test_trainer.py trains tiny models built from a config for a
    few steps; here 2 steps with a custom compute_loss, under strict() and watch(). The Dataset makes its
    tensors without device= (right: the DataLoader's batches are moved later); strict(factories=True)
    reported that as a mistake, and now leaves code the DataLoader runs alone."""
    pytest.importorskip("transformers")
    hf_trainer("", tmp_path)


def test_hf_trainer_names_the_class_weight(tmp_path: Any) -> None:
    """The class weight of compute_loss on meta: named with its line, at the op inside F.cross_entropy;
    under strict(factories=True) the op used to be placed on the handle_torch_function line of the mode."""
    pytest.importorskip("transformers")
    with pytest.raises(tp.DeviceMismatchError) as err:
        hf_trainer("loss", tmp_path)
    text = str(err.value)
    assert "weight on meta" in text and "made by `class_weight = torch.ones(50" in text, text
    assert "handle_torch_function" not in text and "compute_loss()" in text
