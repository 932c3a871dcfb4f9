"""explain() inside a step runs that step again on fake tensors (cpu vs meta): torch's own device checks judge
it, the user's objects are left as they were, a loop is run for one step, a device this machine lacks ends the
run instead of the process; strict() names a tensor passed into the model where the user's code made it."""

from __future__ import annotations

import contextlib
import io

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
    assert seen == ["Tensor"] * 5  # the run got a copy of the list


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


GLOBAL_SCALE = torch.ones(8)


def in_place_step(model, batch, optimizer, reports):
    reports.append(tp.explain(model, optimizer=optimizer))
    batch["x"].div_(2)  # an argument's tensor: the run writes into its fake copy
    model(batch["x"]).sum().backward()
    optimizer.step()  # the parameters and the state: fake copies too
    GLOBAL_SCALE.mul_(3)  # a global tensor, reached by no argument: swapped for a fake at its first use


def test_the_run_writes_into_no_tensor_of_the_users():
    model = Toy()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    batch = {"x": torch.ones(2, 8)}
    model(batch["x"]).sum().backward()
    optimizer.step()
    weights = [p.detach().clone() for p in model.parameters()]
    momentum = [optimizer.state[p]["momentum_buffer"].clone() for p in model.parameters()]
    grads = [p.grad.clone() for p in model.parameters()]
    report = tp.explain(model, optimizer=optimizer)  # outside a step: the baseline
    assert report["step"].startswith("not run")
    reports: list = []
    _explain_only(in_place_step, model, batch, optimizer, reports)
    report = reports[-1]
    assert report["step"] == "ran"
    assert torch.equal(batch["x"], torch.ones(2, 8)) and torch.equal(GLOBAL_SCALE, torch.ones(8))
    assert all(torch.equal(p.detach(), w) for p, w in zip(model.parameters(), weights))
    assert all(torch.equal(optimizer.state[p]["momentum_buffer"], m) for p, m in zip(model.parameters(), momentum))
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads))


class _RealStepSkipped(Exception):
    pass


def _explain_only(step, *args):
    """Run STEP only until its explain() call has returned (the real rest would change the tensors under test):
    the step's next line raises, once its report list (the last argument) holds the report."""
    import sys

    def tracer(frame, event, arg):
        if event == "line" and frame.f_code is step.__code__ and args[-1]:
            raise _RealStepSkipped
        return tracer

    def outer(frame, event, arg):
        return tracer if frame.f_code is step.__code__ else None

    old = sys.gettrace()
    sys.settrace(outer)
    try:
        step(*args)
    except _RealStepSkipped:
        pass
    finally:
        sys.settrace(old)


def test_a_report_that_ran_nothing_says_so():
    """explain(model) outside a step and without a batch: only where tensors sit is known, and the report says
    what to do to have the step checked."""
    report = tp.explain(Toy())
    [problem] = report.problems
    assert problem["kind"] == "not-checked" and problem["severity"] == "note"
    assert "could not check this" in problem["message"] and "step=train_step" in problem["message"]
    assert "could not check this" in " ".join(str(report).split())
    assert "not-checked" not in [p["kind"] for p in run_step(probe_step, Toy().to(M)).problems]


def test_a_dry_run_for_another_machine_finds_what_it_would_refuse():
    """explain(device="cuda:1", step=...) on a CPU-only torch: the model's parameters and buffers on a fake
    cuda:1, everything else where it is; backward and the optimizer step run as torch's device rules say."""
    from checks_programs import Scaled, WithBuffer

    def errors(model, step_body):
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

        def step(x):
            step_body(model, x).sum().backward()
            optimizer.step()

        report = tp.explain(model, torch.randn(2, 8), device="cuda:1", step=step)
        return report, [p for p in report.problems if p["severity"] == "error"]

    def moved(model, x):  # the batch moved where the model is, read from the model
        return model(x.to(next(model.parameters()).device))

    report, [attribute, failure] = errors(Scaled(), moved)
    assert report["step"] == "device mismatch" and attribute["where"] == "model.scale"
    assert "model.scale, not moved by .to()" in failure["message"] and "cuda:1" in failure["message"]
    report, found = errors(WithBuffer(), moved)
    assert report["step"] == "ran" and found == []
    _, [failure] = errors(WithBuffer(), lambda model, x: model(x.cuda()))  # .cuda() is cuda:0
    assert "cuda:0" in failure["message"] and "cuda:1" in failure["message"]
    model = WithBuffer()
    errors(model, moved)
    fake = torch._subclasses.fake_tensor.FakeTensor
    assert all(not isinstance(t, fake) and t.device.type == "cpu" and t.grad is None
               for t in [*model.parameters(), *model.buffers()])


def test_an_optimizer_built_before_the_move_fails_its_step_in_a_dry_run():
    """Adagrad makes its state in its constructor: built before the move, only its step shows it. The step's count,
    a CPU scalar it reads with .item(), keeps its value on fake tensors, so the run reaches torch's own refusal."""
    model = Toy()
    optimizer = torch.optim.Adagrad(model.parameters(), lr=0.1)

    def train_step(x):
        model(x.to("cuda:0")).square().mean().backward()
        optimizer.step()

    report = tp.explain(model, torch.randn(4, 8), step=train_step, device="cuda:0")
    errors = [p for p in report.problems if p["severity"] == "error"]
    assert report["step"] == "device mismatch" and len(errors) == 1, report.problems
    assert "'sum'] on cpu" in errors[0]["message"] and "optimizer" in errors[0]["message"]
    first = next(iter(model.parameters()))
    assert optimizer.state[first]["step"].item() == 0 and first.device.type == "cpu"  # the user's step count as it was



def errors_of(model, step, *inputs):
    """The errors of explain(model, *inputs, step=step) for a machine with a cuda:0 (a CPU-only torch fakes it)."""
    report = tp.explain(model, *inputs, step=step, device="cuda:0")
    return report, [p for p in report.problems if p["severity"] == "error"]


def test_ops_whose_fake_kernels_skip_the_device_check_are_judged_as_cuda_judges_them():
    """Fake tensors' own kernels for a convolution and an embedding bag take a CPU operand beside a cuda one;
    torch's CUDA kernels refuse it (not device_check: NoCheck in native_functions.yaml)."""
    kernel = torch.ones(1, 1, 3)  # a tensor the model does not hold: it stays on the CPU
    conv = nn.Conv1d(1, 1, 3)
    _, [failure] = errors_of(conv, lambda x: F.conv1d(conv(x.to("cuda:0")), kernel), torch.randn(2, 1, 8))
    assert "kernel: cpu" in failure["message"] and "cuda:0 and cpu" in failure["message"], failure["message"]
    bag = nn.EmbeddingBag(10, 4)
    _, [failure] = errors_of(bag, lambda ids: bag(ids), torch.tensor([[1, 2]]))
    assert "on cpu" in failure["message"] and "cuda:0" in failure["message"], failure["message"]


def test_data_an_op_makes_is_a_symbol_and_a_generation_loop_is_followed():
    """nonzero()'s size and item() are symbols on fake tensors, so the run goes past them; the model called on
    growing inputs (no optimizer steps) is followed to the code after the loop."""
    model = nn.Embedding(10, 4)
    scale = torch.ones(1)  # on the CPU, beside what the model puts on cuda:0

    def step(ids):
        ids = ids.to("cuda:0")
        picked = model(ids)[(ids != 0).nonzero()[:, 1]]
        return picked.sum().item() * picked * scale

    report, [failure] = errors_of(model, step, torch.tensor([[1, 0, 2]]))
    assert "scale on cpu" in failure["message"], report.problems

    def generate(prompt):
        ids = prompt.to("cuda:0")
        for _ in range(3):
            ids = torch.cat([ids, model(ids)[:, -1:, 0].long().clamp(0, 9)], 1)
        return torch.cat([prompt, ids], 1)  # the CPU prompt beside the generated ids

    report, [failure] = errors_of(model, generate, torch.tensor([[1, 2]]))
    assert "prompt on cpu" in failure["message"], report.problems


def test_a_checkpoint_of_fake_cuda_tensors_is_saved_and_loaded():
    """Inside fake_cuda() (bench diagnose --fake-gpu) torch.save() keeps fake tensors' shapes, not their values."""
    from torchplace.checks._dry_run import fake_cuda

    buffer = io.BytesIO()
    with fake_cuda():
        torch.save({"d": torch.ones(3, device="cuda")}, buffer)
        buffer.seek(0)
        assert torch.load(buffer, map_location="cpu")["d"].shape == (3,)


class Mixup(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = Toy()

    def forward(self, x):
        lam = torch.distributions.Beta(1.0, 1.0).sample((x.shape[0], 1))  # validated by its values, on the CPU
        return self.net(lam * x)


def test_a_distribution_checks_its_arguments_values_which_fake_tensors_lack_so_the_run_goes_on_to_its_sample():
    model, x = Mixup().to(M), torch.randn(4, 8, device=M)
    before = torch.distributions.Distribution._validate_args  # another test (or library) may have turned it off
    [problem] = [p for p in tp.explain(model, x, step=model).problems if p["severity"] == "error"]
    assert problem["where"] == "model" and "lam on cpu (the rest on meta)" in problem["message"]
    assert torch.distributions.Distribution._validate_args is before  # put back after the run


def zeros_state(x):
    return torch.zeros(1, x.shape[0], 8)


class WithHelper(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        h = zeros_state(x)
        return self.proj(x + h[0])


def test_a_tensor_a_helper_returns_is_named_with_the_helper_that_made_it():
    [problem] = [p for p in tp.explain(WithHelper().to(M), torch.randn(2, 8, device=M)).problems
                 if p["severity"] == "error"]
    assert "made by `return torch.zeros(1, x.shape[0], 8)` in zeros_state() at tests/checks/test_dry_run.py:" in \
        problem["message"], problem["message"]
