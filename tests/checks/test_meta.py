"""Meta tensors used for their data, from the workflow "build the model under torch.device('meta'), forget to
load it": watch(), strict() and explain() name the meta tensors, the user's line, why they are on meta and
the fix; shape inference on meta raises nothing; errors about anything else pass through untouched.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import torchplace as tp


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 8), nn.ReLU())
        self.lm_head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.body(x))


def on_meta() -> Net:
    with torch.device("meta"):
        return Net()


def predict(model: Net, x: torch.Tensor) -> list[int]:
    return model(x).argmax(-1).tolist()  # the user's line that needs data


FACES = {"watch": lambda m: tp.watch(m), "strict": lambda m: tp.strict(model=m), "watch-no-model": lambda m: tp.watch()}


@pytest.mark.parametrize("face", FACES)
def test_module_to_on_a_meta_model_names_its_weights_and_the_load_fix(face: str) -> None:
    model = on_meta()
    with pytest.raises(tp.MetaTensorError) as err, FACES[face](model):
        model.to("cpu")
    text = str(err.value)
    assert 'in `model.to("cpu")` at ' in text and "test_meta.py:" in text, text
    assert "model.body.0.weight is on meta" in text, text
    assert "model (Net): 4 of 4 parameters and buffers on meta: model.body.0.weight, model.body.0.bias" in text
    assert "built on meta (torch.device('meta')" in text and "never loaded" in text
    assert "Fix: load the weights into it: torchplace.load(path, model=model)" in text
    assert "model.to_empty(device='cpu')" in text and "load_checkpoint_and_dispatch" in text
    assert isinstance(err.value, NotImplementedError) and isinstance(err.value.__cause__, NotImplementedError)
    assert err.value.__cause__ is not None and "Cannot copy out of meta tensor" in str(err.value.__cause__)


@pytest.mark.parametrize("face", FACES)
def test_a_weight_copied_to_the_cpu_is_named_by_its_path(face: str) -> None:
    model = on_meta()
    with pytest.raises(tp.MetaTensorError) as err, FACES[face](model):
        model.lm_head.weight.cpu()
    text = str(err.value)
    assert "`model.lm_head.weight.cpu()`" in text and "model.lm_head.weight is on meta" in text, text
    assert "  model.lm_head.weight: meta float32 [3, 8] (parameter model.lm_head.weight)" in text


def test_an_output_read_with_tolist_and_item_names_the_expression_and_the_model() -> None:
    model = on_meta()
    with pytest.raises(tp.MetaTensorError) as err, tp.watch(model):
        predict(model, torch.randn(2, 4, device="meta"))
    text = str(err.value)
    assert "in `model(x).argmax(-1).tolist()` at " in text and "in predict()" in text, text
    assert "model(x).argmax(-1) is on meta" in text
    assert "computed from meta tensors" in text and "torchplace.load(path, model=model)" in text
    with pytest.raises(tp.MetaTensorError) as err, tp.strict(model=model):
        model(torch.randn(2, 4, device="meta")).sum().item()
    assert "Tensor.item() cannot be called on meta tensors" in str(err.value)


def test_a_forward_mixing_meta_weights_and_a_cpu_batch_says_why_and_how_to_load() -> None:
    """PyTorch's 'Tensor on device meta is not on the expected device cpu!': still a DeviceMismatchError."""
    model = on_meta()
    with pytest.raises(tp.DeviceMismatchError) as err, tp.strict(model=model):
        model(torch.randn(2, 4))
    text = str(err.value)
    assert "Why: model.body.0.weight, model.body.0.bias are on meta, which holds shapes but no data" in text
    assert "never loaded (4 of 4 parameters and buffers on meta" in text
    assert "Fix: load the weights into it: torchplace.load(path, model=model)" in text, text


def test_a_head_left_on_meta_in_a_loaded_model_is_the_culprit() -> None:
    """Most of the model is real; one module was never loaded: the meta weight is blamed, not the input."""
    model = Net()
    with torch.device("meta"):
        model.lm_head = nn.Linear(8, 3)
    with pytest.raises(tp.DeviceMismatchError) as err, tp.watch(model):
        model(torch.randn(2, 4))
    text = str(err.value)
    assert "model.lm_head.weight, model.lm_head.bias are on meta" in text, text
    assert "2 of 4 parameters and buffers on meta" in text and "call model.to(" not in text


def test_the_load_fix_works_and_the_model_then_runs_under_strict(tmp_path: Path) -> None:
    torch.manual_seed(0)
    trained, x = Net(), torch.randn(2, 4)
    path = tp.save(tmp_path / "ckpt", model=trained)
    model = on_meta()
    with tp.strict(model=model):
        tp.load(path, model=model)
        assert torch.equal(model(x), trained(x)) and len(predict(model, x)) == 2


def test_to_empty_then_init_also_fixes_it() -> None:
    model = on_meta().to_empty(device="cpu")
    for module in model.modules():
        if isinstance(module, nn.Linear):
            module.reset_parameters()
    with tp.strict(model=model), tp.watch(model):
        assert len(predict(model, torch.randn(2, 4))) == 2


def test_shape_inference_on_meta_raises_nothing() -> None:
    model = on_meta()
    with tp.strict(model=model, factories="warn"), tp.watch(model):
        out = model(torch.empty(5, 4, device="meta"))
        scratch = torch.empty(3, 7, device="meta") * 2
        shape = (out.shape, out.dtype, scratch.sum(0).shape, repr(out))
    assert shape[:3] == (torch.Size([5, 3]), torch.float32, torch.Size([7])) and "meta" in shape[3]
    report = tp.explain(model, torch.empty(5, 4, device="meta"))
    assert report["forward"] == "ran" and report.problems == []


def test_explain_reports_a_forward_that_needs_data_and_notes_meta_weights() -> None:
    class Reads(Net):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            scale = float(self.lm_head.bias.abs().max())  # data read inside forward
            return super().forward(x) * scale

    model = Reads.__new__(Reads)
    with torch.device("meta"):
        Reads.__init__(model)
    report = tp.explain(model, torch.empty(2, 4, device="meta"))
    [problem] = [p for p in report.problems if p["kind"] == "meta-tensor"]
    assert report["forward"] == "meta tensor used for its data" and problem["severity"] == "error"
    assert "Tensor.item() cannot be called on meta tensors" in problem["message"]
    assert "torchplace.load(path, model=model)" in problem["message"]
    batch = tp.explain(on_meta(), torch.randn(2, 4))  # a CPU batch for a meta model
    failing = next(p for p in batch.problems if p["kind"] == "mismatch")
    assert "never loaded" in failing["message"]
    noted = next(p for p in batch.problems if p["kind"] == "input-device")
    assert "Note: 4 of 4 parameters and buffers on meta" in noted["message"], noted


def test_errors_that_are_not_about_meta_pass_through_unchanged() -> None:
    model = Net()
    for face in (tp.watch(model), tp.strict(model=model)):
        with pytest.raises(RuntimeError) as err, face:
            model(torch.randn(2, 5))  # a shape error
        assert type(err.value) is RuntimeError and "mat1 and mat2 shapes cannot be multiplied" in str(err.value)
        with pytest.raises(NotImplementedError) as other, face:
            raise NotImplementedError("subclass must implement forward")
        assert type(other.value) is NotImplementedError
    with pytest.raises(TypeError) as numpy_err, tp.watch(model):
        on_meta().lm_head.weight.detach().numpy()  # torch's TypeError, not about copying: left as it is
    assert type(numpy_err.value) is TypeError
