"""watch() and explain() on models other code wrapped or compiled: torch.compile (the mismatch is found
while Dynamo traces, so the user's frames are only named in its message), DataParallel, and tensors made
inside the failing expression itself.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import torchplace as tp


class Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)
        self.register_buffer("scale", torch.ones(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        return h * self.scale


class Weighted(nn.Module):
    def __init__(self, device: str | None) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)
        self.device = device

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * torch.tensor([1.0, 2.0], device=self.device) if self.device else \
            self.lin(x) * torch.tensor([1.0, 2.0])


@pytest.fixture
def compiled() -> tuple[nn.Module, nn.Module]:
    model = Scaled()
    fast = torch.compile(model, backend="eager")  # Dynamo's tracing is what matters; no code generation
    fast(torch.randn(3, 2))
    return model, fast


def test_a_compiled_models_buffer_on_another_device_is_named(compiled: tuple[nn.Module, nn.Module]) -> None:
    """pytorch/pytorch test/dynamo/test_modules.py calls compiled modules whose buffers change between
    calls; one replaced on another device made watch() say 'tensors on different devices' at the
    `fast(x)` line, with no tensor, module or line of the forward (Dynamo's TorchRuntimeError carries them
    only as text: 'from user code: File ..., line ...')."""
    model, fast = compiled
    model.scale = torch.ones(2, device="meta")
    with pytest.raises(tp.DeviceMismatchError) as err, tp.watch(fast):
        fast(torch.randn(3, 2))
    text = str(err.value)
    assert "in h * self.scale (op mul) at " in text and "test_explain_wrapped.py" in text, text
    assert "inside module model (Scaled)" in text and "self.scale on meta, while the rest are on cpu" in text
    assert "self.scale: meta float32 [2] (buffer model.scale)" in text
    assert "PyTorch said: Expected all tensors to be on the same device" in text


def test_a_compiled_models_input_on_another_device_is_named(compiled: tuple[nn.Module, nn.Module]) -> None:
    _, fast = compiled
    batch = torch.randn(3, 2, device="meta")
    with pytest.raises(tp.DeviceMismatchError) as err, tp.watch(fast):
        fast(batch)
    text = str(err.value)
    # this test keeps only `fast` (the model itself went to `_`): fast.lin is what it would type (the compiled
    # wrapper passes attribute lookups on), where the report used to say model.lin
    assert "inside module fast.lin (Linear)" in text and "batch on meta, while the rest are on cpu" in text, text
    assert "Fix: move batch" in text


def test_explain_names_a_compiled_models_modules_as_the_users(compiled: tuple[nn.Module, nn.Module]) -> None:
    """explain() on the compiled wrapper: module rows and findings say model.lin, not model._orig_mod.lin."""
    model, fast = compiled
    model.scale = torch.ones(2, device="meta")
    report = tp.explain(fast, torch.randn(3, 2))
    assert [m["module"] for m in report["modules"]] == ["model", "model.lin"], report["modules"]
    assert "_orig_mod" not in str(report.problems)
    failing = next(p for p in report.problems if p["kind"] == "mismatch")
    assert "h * self.scale" in failing["message"] and "buffer model.scale" in failing["message"]


def test_dataparallel_paths_are_the_wrapped_modules() -> None:
    """torch's DataParallel on the CPU (no GPUs: it calls the module directly), as in pytorch/pytorch
    test/distributed/test_data_parallel.py's CPU fallbacks: explain's rows name model.lin, not model.module.lin;
    watch() names the parameter from the user's own variable for the inner module (inner.lin.bias), as the user
    would type it."""
    inner = Scaled()
    inner.lin.bias = nn.Parameter(torch.zeros(2, device="meta"))
    wrapped = nn.DataParallel(inner)
    report = tp.explain(wrapped, torch.randn(3, 2))
    assert {m["module"] for m in report["modules"]} == {"model", "model.lin"}, report["modules"]
    assert "model.module" not in str(report.problems)
    with pytest.raises(tp.DeviceMismatchError, match=r"parameter inner\.lin\.bias"), tp.watch(wrapped):
        wrapped(torch.randn(3, 2))


def test_a_tensor_made_inside_the_failing_expression_is_listed() -> None:
    """`out * torch.tensor([...])` in a forward: the tensor made in the op has no name, so the report used to
    list only the other operand and say 'tensors on different devices'. It is now listed with its device
    (here the default device, none being given), and the fix says where to make it."""
    model, x = Weighted(None).to("meta"), torch.randn(3, 2, device="meta")
    with pytest.raises(tp.DeviceMismatchError) as err, tp.watch(model):
        model(x)
    text = str(err.value)
    assert "torch.tensor([1.0, 2.0]) on cpu, while the rest are on meta" in text, text
    assert "torch.tensor([1.0, 2.0]): cpu (made inside the expression)" in text
    assert "Fix: make torch.tensor([1.0, 2.0]) on the other operands' device" in text


def test_a_device_that_is_not_a_literal_is_not_evaluated() -> None:
    """device=self.device could run code (a property): such a call is not listed."""
    with pytest.raises(tp.DeviceMismatchError) as err, tp.watch(Weighted("meta")):
        Weighted("meta")(torch.randn(3, 2))
    assert "made inside the expression" not in str(err.value)


def test_a_literal_device_inside_the_expression_is_listed() -> None:
    class Literal(nn.Module):
        def forward(self, h: torch.Tensor) -> torch.Tensor:
            return h + torch.zeros(2, device="meta")

    with pytest.raises(tp.DeviceMismatchError, match=r"torch.zeros\(2, device='meta'\) on meta, while the rest"):
        with tp.watch(Literal()):
            Literal()(torch.randn(3, 2))
