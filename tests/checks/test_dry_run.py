"""explain() inside a step runs that step again on fake tensors (cpu vs meta): torch's own device checks judge
it, the user's objects are left as they were, a loop is run for one step, a device this machine lacks ends the
run instead of the process; strict() names a tensor passed into the model where the user's code made it."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from checks_programs import Toy
from torch import nn

import torchplace as tp

M = "meta"


def run_step(step, *args):
    """Run a step that appends explain()'s report to its last argument; the step may fail after it."""
    reports: list = []
    with contextlib.suppress(RuntimeError, AssertionError):  # AssertionError: torch without CUDA
        step(*args, reports)
    return reports[-1]  # explain() run again inside its own dry run of the step appends first


def probe_step(model, reports):
    reports.append(tp.explain(model))  # no batch given: the step makes it
    probe = torch.rand(2, 8)
    return model(probe)


def test_a_tensor_the_step_makes_and_passes_to_the_model_is_named_where_the_step_made_it():
    [problem] = [p for p in run_step(probe_step, Toy().to(M)).problems if p["severity"] == "error"]
    assert problem["kind"] == "step-device" and problem["where"] == "model.layers.0.proj"
    assert "`probe = torch.rand(2, 8)` at tests/checks/test_dry_run.py:" in problem["message"]
    assert "torch.rand(...) without a device" in problem["message"]


def test_strict_names_the_same_tensor_where_the_user_made_it():
    model = Toy().to(M)
    with pytest.raises(tp.DeviceMismatchError) as caught, tp.strict(model=model):
        probe_step(model, [None])
    assert "input: cpu float32 [2, 8] (probe at tests/checks/test_dry_run.py:" in str(caught.value)
    assert "made by `probe = torch.rand(2, 8)`" in str(caught.value)


class Stateful(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.register_buffer("total", torch.zeros(8))
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        self.total = self.total + x.detach().sum(0)
        self.last = x
        return self.proj(x)


class Counter:
    def __init__(self) -> None:
        self.steps = 0


def training_step(model, optimizer, counter, x, reports):
    reports.append(tp.explain(model, optimizer=optimizer))
    model(x).square().mean().backward()
    optimizer.step()
    counter.steps += 1


def test_the_run_leaves_the_users_objects_as_they_were():
    model, counter = Stateful(), Counter()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x = torch.randn(2, 8)
    model(x).sum().backward()
    optimizer.step()
    grad, total, weight = model.proj.weight.grad.clone(), model.total.clone(), model.proj.weight.detach().clone()
    state = {k: v.clone() for k, v in optimizer.state[model.proj.weight].items()}
    before = (model.calls, dict(model._buffers), model.last)
    report = run_step(training_step, model, optimizer, counter, x)
    assert report["step"] == "ran" and [p for p in report.problems if p["severity"] != "note"] == []
    # the real step ran once after explain(); undo it to compare with what the dry run must not have changed
    assert counter.steps == 1 and model.calls == before[0] + 1
    assert not torch.equal(optimizer.state[model.proj.weight]["momentum_buffer"], state["momentum_buffer"])
    assert not isinstance(model.last, torch._subclasses.fake_tensor.FakeTensor)
    assert all(type(b) is torch.Tensor for b in model.buffers()) and type(model.proj.weight.grad) is torch.Tensor
    assert all(type(v) is torch.Tensor for v in optimizer.state[model.proj.weight].values())
    assert not torch.equal(model.proj.weight.detach(), weight) and grad.shape == model.proj.weight.grad.shape
    assert torch.equal(model.total, total + x.sum(0))


def loop_step(model, x, seen, reports):
    reports.append(tp.explain(model, x))
    for _ in range(5):
        seen.append(type(model(x)).__name__)


def test_a_loop_is_run_for_one_step_only():
    seen: list = []
    run_step(loop_step, Toy(), torch.randn(2, 8), seen)
    # the dry run stopped at its second model call; what the step's code did to a plain list before that stays
    assert seen == ["FakeTensor"] + ["Tensor"] * 5


def far_device_step(model, x, reports):
    reports.append(tp.explain(model))
    return model(x.to("cuda:7"))


@pytest.mark.skipif(torch.cuda.device_count() > 7, reason="needs a machine without cuda:7")
def test_a_device_this_machine_lacks_ends_the_run_not_the_process():
    report = run_step(far_device_step, Toy(), torch.randn(2, 8))
    assert report["step"].startswith("stopped at tests/checks/test_dry_run.py:")
    assert "cuda:7 is not a device of this machine" in report["step"]


def legal_step(model, x, y, lengths, reports):
    reports.append(tp.explain(model, x))
    keep = torch.tensor([0, 2])  # CPU index, CPU 0-dim scalar, CPU lengths: torch takes all three
    loss = F.cross_entropy(model(x)[:, :3], y) * torch.tensor(0.5) + model(x)[:, keep].sum()
    return loss, lengths.tolist()


def test_what_torch_accepts_is_not_flagged():
    model = Toy().to(M)
    x, y = torch.randn(2, 8, device=M), torch.randint(0, 3, (2,), device=M)
    report = run_step(legal_step, model, x, y, torch.tensor([2, 1]))
    assert [p for p in report.problems if p["severity"] != "note"] == []
