"""watch(model): a device mismatch becomes a DeviceMismatchError naming the culprit (cpu vs meta)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from checks_programs import (
    FILE,
    Scaled,
    Toy,
    WithBuffer,
    WithConstant,
    at,
    batch_on,
    clean_training,
    forward_loss,
    late_submodule,
)

import torchplace as tp


def mismatch(fn, *args, model=None):
    """Run fn under watch(model) and return the DeviceMismatchError it must raise."""
    with pytest.raises(tp.DeviceMismatchError) as info:
        with tp.watch(model):
            fn(*args)
    return info.value


def tensor(report, label):
    return next(t for t in report.tensors if t.label == label)


def test_batch_left_on_the_cpu_names_module_tensor_and_line():
    model = Toy().to("meta")
    batch = batch_on("cpu")
    err = mismatch(forward_loss, model, batch, model=model)
    report = err.report
    assert isinstance(err, RuntimeError) and isinstance(err.__cause__, RuntimeError)
    assert report.module == "model.layers.0.proj" and report.module_type == "Linear"
    assert report.site.expression == "F.linear(input, self.weight, self.bias)"
    x = tensor(report, "input")
    assert (x.device, x.dtype, x.shape, x.kind) == ("cpu", "float32", (4, 8), "batch")
    assert x.origin.startswith("batch['x']")
    assert tensor(report, "self.weight").origin == "model.layers.0.proj.weight"
    assert [t.label for t in report.culprits] == ["input"] and report.expected_device == "meta"
    assert at("block") in str(err)  # the user's line that reached the op
    assert "to_device(batch, 'meta')" in str(err)


def test_plain_attribute_left_behind_by_to():
    model = Scaled().to("meta")
    err = mismatch(model, torch.randn(2, 8, device="meta"), model=model)
    scale = tensor(err.report, "self.scale")
    assert (scale.kind, scale.origin, scale.device) == ("attribute", "model.scale", "cpu")
    assert err.report.module == "model" and err.report.op == "mul"
    assert at("plain-attribute") in str(err) and "register_buffer" in str(err)


def test_constant_made_in_forward_without_a_device():
    model = WithConstant().to("meta")
    err = mismatch(model, torch.randn(2, 8, device="meta"), model=model)
    offsets = tensor(err.report, "offsets")
    assert offsets.kind == "local" and "WithConstant.forward" in offsets.origin
    assert [t.label for t in err.report.culprits] == ["offsets"]
    assert at("constant") in str(err) and "device=x.device" in str(err)


def test_submodule_added_after_to_is_named_as_a_parameter():
    model = late_submodule("meta")
    err = mismatch(model, torch.randn(2, 8, device="meta"), model=model)
    report = err.report
    assert report.module == "model.head"
    assert {t.label for t in report.culprits} == {"self.weight", "self.bias"}
    assert tensor(report, "self.weight").origin == "model.head.weight"
    assert report.expected_device == "meta"
    assert "model.layers on meta" in str(err) and "model.head on cpu" in str(err)
    assert at("head") in str(err)


def test_labels_on_another_device_outside_any_module():
    model = Toy().to("meta")
    batch = {"x": torch.randn(4, 8, device="meta"), "y": torch.randint(0, 3, (4,))}
    err = mismatch(forward_loss, model, batch, model=model)
    assert err.report.module is None
    labels = err.report.culprits
    assert len(labels) == 1 and labels[0].device == "cpu" and labels[0].origin.startswith("batch['y']")
    assert at("loss") in str(err)


def test_without_a_model_paths_start_at_the_outermost_module():
    """No model given: paths start at the outermost running module, named by the test's variable for it (`net`,
    not the helper's `fn`); its class only where no variable of the user's holds it."""
    net = Toy().to("meta")
    err = mismatch(net, torch.randn(2, 8))
    assert err.report.module == "net.layers.0.proj"
    assert tensor(err.report, "self.weight").origin == "net.layers.0.proj.weight"
    err = mismatch(lambda x: Toy().to("meta")(x), torch.randn(2, 8))
    assert err.report.module == "Toy.layers.0.proj"


class _Parts(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.parts = torch.nn.ModuleList([torch.nn.Linear(3, 3)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for f in self.parts:
            x = f(x)
        return x


class _Holder:
    def __init__(self) -> None:
        self.loss = _Parts()  # never moved: on the CPU


def test_a_module_outside_the_model_is_named_by_the_users_variable_not_a_loop_variable():
    """A loss a plain object keeps, running its parts in a loop: the path starts at the variable this test holds
    it by (holder.loss.parts.0), not at the loop's `f`, nor at its class."""
    model, holder = Toy().to("meta"), _Holder()
    err = mismatch(lambda x: holder.loss(model(x)), torch.randn(2, 8, device="meta"), model=model)
    assert err.report.module == "holder.loss.parts.0"
    assert "parameter holder.loss.parts.0.weight" in str(err)


def test_cpu_scalars_are_allowed_and_not_blamed():
    model = WithBuffer().to("meta")
    with tp.watch(model):
        out = model(torch.randn(2, 8, device="meta"))
    assert out.device.type == "meta"
    x = torch.randn(3, device="meta")
    two = torch.tensor(2.0)
    offsets = torch.arange(3.0)
    with pytest.raises(tp.DeviceMismatchError) as info, tp.watch():
        x * two + offsets
    scalar = next(t for t in info.value.report.tensors if t.scalar)
    assert scalar.device == "cpu" and scalar not in info.value.report.culprits
    assert [t.label for t in info.value.report.culprits] == ["offsets"]


def test_clean_training_stays_silent_and_unchanged():
    with tp.watch():
        watched = clean_training("cpu")
    assert watched == clean_training("cpu")


def test_other_errors_pass_through_untouched():
    model = Toy()
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied") as info:
        with tp.watch(model):
            model(torch.randn(2, 5))
    assert not isinstance(info.value, tp.DeviceMismatchError)


def test_works_as_a_decorator():
    model = Toy().to("meta")

    @tp.watch(model)
    def step(batch):
        return forward_loss(model, batch)

    with pytest.raises(tp.DeviceMismatchError, match="model.layers.0.proj"):
        step(batch_on("cpu"))


def test_message_reads_in_one_go():
    model = Toy().to("meta")
    err = mismatch(forward_loss, model, batch_on("cpu"), model=model)
    text = str(err)
    first = text.splitlines()[0]
    assert first.startswith("Device mismatch in F.linear(input, self.weight, self.bias)")
    assert "inside module model.layers.0.proj (Linear)" in first and FILE in first
    assert text.splitlines()[1].startswith("Fix: ") and len(text.splitlines()[1]) <= 120  # the fix right under it
    assert "PyTorch said: Tensor on device" in text


def test_rejects_what_is_not_a_module():
    with pytest.raises(TypeError, match="nn.Module"):
        tp.watch(F.relu)


class _Shadows:
    def __init__(self, tensors):
        self.shadow = list(tensors)


def _compare(live: _Shadows, loaded: _Shadows) -> None:
    for a, b in zip(live.shadow, loaded.shadow):
        torch.add(a, b)


def test_a_loop_variable_or_a_librarys_local_is_named_by_the_object_that_holds_it():
    """`b` of a zip() loop and `self.loc` inside torch.distributions: named by where the user's objects hold that
    very tensor (`loaded.shadow[0]`, `self.base.loc`), not by the loop's or the library's name alone."""
    err = mismatch(_compare, _Shadows([torch.ones(2, device="meta")]), _Shadows([torch.ones(2)]))
    assert tensor(err.report, "b").origin == "loaded.shadow[0] in _compare()"

    class Flow:
        def __init__(self) -> None:
            self.base = torch.distributions.Normal(torch.zeros(2), torch.ones(2), validate_args=False)

        def log_prob(self, x: torch.Tensor) -> torch.Tensor:
            return self.base.log_prob(x)

    err = mismatch(Flow().log_prob, torch.zeros(2, device="meta"))
    assert tensor(err.report, "self.loc").origin == "self.base.loc in log_prob()"


class _Distiller(torch.nn.Module):
    """A distillation model that keeps its teacher out of the module tree (set past nn.Module's __setattr__)."""

    def __init__(self) -> None:
        super().__init__()
        self.student = torch.nn.Linear(8, 8)
        object.__setattr__(self, "teacher", torch.nn.Sequential(torch.nn.Linear(8, 8)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.student(x) + self.teacher(x)


def test_a_module_kept_as_a_plain_attribute_is_named_through_it():
    """model.to() never sees the teacher: the path goes through the attribute, the fix says to register it."""
    model = _Distiller()
    model.student.to("meta")
    err = mismatch(model, torch.randn(2, 8, device="meta"), model=model)
    assert err.report.module == "model.teacher.0"
    assert "parameter model.teacher.0.weight" in str(err)
    assert "Fix: register model.teacher as a submodule" in str(err)


def _score(logits: torch.Tensor) -> torch.Tensor:
    marks = torch.tensor([0, 2])
    return F.cross_entropy(logits, marks.long())


def _step(model: torch.nn.Module, images: torch.Tensor) -> torch.Tensor:
    return model(images)


def _line(text: str) -> str:
    """'test_watch.py:LINE' of the line of this file that ends with TEXT."""
    lines = open(__file__).read().splitlines()
    return f"test_watch.py:{next(n for n, line in enumerate(lines, 1) if line.endswith(text))}"


def test_a_culprit_passed_into_a_call_is_named_as_the_callers_code_wrote_it():
    """torch's `target` is what the user passed (`marks.long()`), made by a factory without a device; an input
    handed down through calls is named where the user's code got it (a loop's `images`), not a forward's `x`."""
    err = mismatch(_score, torch.zeros(2, 3, device="meta"))
    target = tensor(err.report, "target")
    assert target.origin.startswith("marks.long() at ") and target.origin.endswith(_line("marks.long())"))
    assert target.made.startswith("`marks = torch.tensor([0, 2])`") and "without a device" in target.factory

    model, batches = Toy().to("meta"), [torch.randn(2, 8)]

    def loop() -> None:
        for images in batches:
            _step(model, images)  # passes images

    err = mismatch(loop, model=model)
    origin = tensor(err.report, "input").origin
    assert origin.startswith("images at ") and origin.endswith(_line("# passes images"))
