"""explain() runs the step that calls it again on fake tensors (cpu vs meta): the loss, labels, stacked tensors
and the optimizer beside the model are judged by torch where the step uses them, legal placements stay silent,
and code without source (a REPL, python -c) is run all the same."""

from __future__ import annotations

import contextlib
import sys

import pytest
import torch
import torch.nn.functional as F
from checks_programs import Toy
from torch import nn

import torchplace as tp

M = "meta"


def step_problems(report):
    return [p for p in report.problems if p["kind"] == "step-device"]


def run_step(step, *args):
    """Run a step that appends explain()'s report to its last argument; the step may fail after it."""
    reports: list = []
    with contextlib.suppress(RuntimeError):
        step(*args, reports)
    return reports[-1]  # explain() run again inside its own dry run of the step appends first


def line_of(function, text: str) -> str:
    import inspect

    lines, first = inspect.getsourcelines(function)
    return f"test_explain_caller.py:{first + next(i for i, line in enumerate(lines) if text in line)}"


def loss_step(model, criterion, x, y, reports):
    reports.append(tp.explain(model, x))
    return criterion(model(x), y)


def moved_loss_step(model, criterion, x, y, reports):
    reports.append(tp.explain(model, x))
    criterion.to(x.device)
    return criterion(model(x), y)


def test_a_loss_weight_left_on_the_cpu_is_named_at_the_line_that_calls_the_loss():
    model, criterion = Toy().to(M), nn.CrossEntropyLoss(weight=torch.rand(3))
    x, y = torch.randn(2, 8, device=M), torch.randint(0, 3, (2,), device=M)
    [problem] = step_problems(run_step(loss_step, model, criterion, x, y))
    assert problem["where"] == "criterion" and "weight: cpu float32 [3] (buffer criterion.weight)" in problem["message"]
    assert line_of(loss_step, "criterion(model(x), y)") in problem["message"]
    assert "criterion.to('meta')" in problem["message"]
    assert step_problems(run_step(moved_loss_step, model, nn.CrossEntropyLoss(weight=torch.rand(3)), x, y)) == []


def labels_step(model, batch, reports):
    reports.append(tp.explain(model, batch["x"]))
    return F.cross_entropy(model(batch["x"]), batch["y"])


def labels_moved_step(model, batch, reports):
    reports.append(tp.explain(model, batch["x"]))
    batch = tp.to_device(batch, M)
    return F.cross_entropy(model(batch["x"]), batch["y"])


def test_labels_used_only_by_the_loss_are_named_unless_the_step_moves_them():
    model = Toy().to(M)
    batch = {"x": torch.randn(2, 8, device=M), "y": torch.randint(0, 3, (2,))}
    [problem] = step_problems(run_step(labels_step, model, batch))
    assert problem["where"] == "batch['y']"
    assert "target: cpu int64 [2] (batch['y'] in labels_step())" in problem["message"]
    assert line_of(labels_step, "return F.cross_entropy") in problem["message"]
    assert step_problems(run_step(labels_moved_step, model, batch)) == []


def stacked_step(model, x, y, reports):
    reports.append(tp.explain(model, x))
    cls_loss = F.cross_entropy(model(x), y)
    box_loss = torch.tensor(0.0)
    return torch.stack([cls_loss, box_loss]).sum()


def stacked_on_device_step(model, x, y, reports):
    reports.append(tp.explain(model, x))
    cls_loss = F.cross_entropy(model(x), y)
    box_loss = torch.tensor(0.0, device=x.device)
    scale = torch.tensor(0.5)  # a CPU scalar with an elementwise op: allowed
    return torch.stack([cls_loss, box_loss]).sum() * scale


def test_a_zero_dim_cpu_tensor_stacked_with_the_loss_is_named_with_the_line_that_made_it():
    model = Toy().to(M)
    x, y = torch.randn(2, 8, device=M), torch.randint(0, 3, (2,), device=M)
    [problem] = step_problems(run_step(stacked_step, model, x, y))
    assert problem["where"] == "box_loss" and "this op does not" in problem["message"]
    assert f"`box_loss = torch.tensor(0.0)` at tests/checks/{line_of(stacked_step, 'box_loss =')}" in problem["message"]
    assert step_problems(run_step(stacked_on_device_step, model, x, y)) == []


def indexed_step(model, x, y, keep, reports):
    reports.append(tp.explain(model, x))
    preds = model(x)
    return F.mse_loss(preds[:, keep], y[:, keep]) + (preds.argmax(1) == y.argmax(1)).float().mean()


def reassigned_after_use(model, x, y, reports):
    loss = F.cross_entropy(model(x), y)  # y is on meta here
    y = torch.zeros(2, dtype=torch.long)  # and on the CPU only after its use
    reports.append(tp.explain(model, x))
    return loss, y


def moved_after_explain(model, x, y, reports):
    reports.append(tp.explain(model))
    model.to(M)
    return F.cross_entropy(model(x), y)


class Wrapper(nn.Module):
    """A wrapper around the model (as DDP or torch.compile make) with host-side bookkeeping of its own."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module
        self.calls = torch.zeros(4)

    def forward(self, x):
        return self.module(x)


def wrapped_step(model, wrapped, x, y, reports):
    reports.append(tp.explain(model, x))
    return F.cross_entropy(wrapped(x), y)


def test_legal_placements_in_the_step_stay_silent():
    model = Toy().to(M)
    x, y = torch.randn(2, 8, device=M), torch.randn(2, 3, device=M)
    assert step_problems(run_step(indexed_step, model, x, y, torch.tensor([0, 2]))) == []
    labels = torch.randint(0, 3, (2,), device=M)
    assert step_problems(run_step(reassigned_after_use, model, x, labels)) == []
    assert step_problems(run_step(moved_after_explain, Toy(), x, labels)) == []  # the model moves in the step
    model = Toy().to(M)
    assert step_problems(run_step(wrapped_step, model, Wrapper(model), x, labels)) == []


def optimizer_step(model, optimizer, x, reports):
    reports.append(tp.explain(model, x))
    model(x).square().mean().backward()
    optimizer.step()


def test_the_optimizer_that_steps_in_the_caller_is_checked_and_its_line_given():
    """Optimizer state left on another device (made meta here, as a GPU run leaves it on the CPU)."""
    model = Toy()
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 8)).sum().backward()
    optimizer.step()
    for state in optimizer.state.values():
        state["exp_avg"] = state["exp_avg"].to(M)
    report = run_step(optimizer_step, model, optimizer, torch.randn(2, 8))
    [problem] = [p for p in report.problems if p["kind"] == "optimizer-state-device"]
    assert "model.layers.0.proj.weight['exp_avg'] on meta" in problem["message"]
    assert f"The optimizer steps at tests/checks/{line_of(optimizer_step, 'optimizer.step()')}" in problem["message"]
    assert report["optimizer"]["type"] == "Adam"


STEP_WITHOUT_SOURCE = """
def step(model, criterion, x, y, reports):
    reports.append(tp.explain(model, x))
    return criterion(model(x), y)
"""


@pytest.mark.parametrize("filename", ["<stdin>", "<string>", "/no/such/dir/script.py"])
def test_code_without_source_is_run_all_the_same(filename):
    """A REPL, python -c or a deleted file: running the step needs no source, so its loss weight is found."""
    namespace = {"tp": tp}
    exec(compile(STEP_WITHOUT_SOURCE, filename, "exec"), namespace)
    model, criterion = Toy().to(M), nn.CrossEntropyLoss(weight=torch.rand(3))
    report = run_step(namespace["step"], model, criterion, torch.randn(2, 8, device=M),
                      torch.randint(0, 3, (2,), device=M))
    [problem] = step_problems(report)
    assert report["forward"] == "not run: the step ran it" and problem["where"] == "criterion"
    assert "criterion.weight" in problem["message"]


def test_explain_at_module_level_of_a_script(tmp_path):
    """A script calling explain() at its top level: a script is not run twice, so only what explain() was given
    is judged (the forward ran: torch accepts it), and code that never runs is not judged either."""
    import subprocess

    script = tmp_path / "train.py"
    script.write_text("import torch, torch.nn.functional as F, torchplace as tp\n"
                      "from torch import nn\n"
                      "model = nn.Linear(8, 3).to('meta')\n"
                      "x, y = torch.randn(2, 8, device='meta'), torch.randint(0, 3, (2,))\n"
                      "print([p['where'] for p in tp.explain(model, x).problems])\n"
                      "if __name__ == '__never__':\n"
                      "    loss = F.cross_entropy(model(x), y)\n")
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


class Teacher(nn.Module):
    """A frozen model kept on another device, fed copies moved there."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(8, 3)

    def forward(self, x):
        return self.net(x)


def clean_step(model, teacher, criterion, optimizer, batch, step, reports):
    reports.append(tp.explain(model))  # before the batch is moved: only the model
    batch = {k: v.to(M, non_blocking=True) for k, v in batch.items()}
    with torch.device(M):
        noise = torch.randn(2, 8)  # made where the model is, by the with block
    x = batch["x"] + noise * 0.01
    logits = model(x)
    with torch.no_grad():
        soft = teacher(x.cpu()).to(logits.device).softmax(-1)
    loss = criterion(logits, batch["y"]) + F.kl_div(logits.log_softmax(-1), soft, reduction="batchmean")
    loss = loss / torch.tensor(float(step + 1))  # a CPU scalar
    weights = torch.stack([loss, torch.tensor(1.0, device=loss.device)])
    hits = sum((logits.argmax(1) == y).sum() for y in [batch["y"]])
    optimizer.zero_grad()
    (weights.sum() + hits * 0).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    return {"loss": loss.item(), "lr": optimizer.param_groups[0]["lr"]}


def test_a_clean_training_step_stays_silent():
    model, teacher = Toy().to(M), Teacher()
    criterion = nn.CrossEntropyLoss(weight=torch.rand(3, device=M))
    optimizer = torch.optim.AdamW(model.parameters())
    batch = {"x": torch.randn(2, 8), "y": torch.randint(0, 3, (2,))}
    report = run_step(clean_step, model, teacher, criterion, optimizer, batch, 3)
    assert [p for p in report.problems if p["severity"] != "note"] == [] and report["optimizer"]["type"] == "AdamW"
    [note] = report.problems  # loss.item() needs data: the run stops there and says so
    assert note["kind"] == "step-not-checked" and line_of(clean_step, "loss.item()") in note["message"]


def labels_from_a_list_step(model, x, label_list, reports):
    reports.append(tp.explain(model, x))
    labels = torch.tensor(label_list)
    return F.cross_entropy(model(x), labels)


def labels_from_a_number_step(model, x, scale, reports):
    reports.append(tp.explain(model, x))
    weight = torch.tensor(scale)
    return model(x).sum() * weight


def test_a_tensor_made_from_a_list_variable_is_not_taken_for_a_cpu_scalar():
    """torch.tensor(label_list) has the list's shape: on the CPU it is refused by a loss on another device
    (a 0-dim CPU tensor would be allowed), so the mismatch is named; torch.tensor(a number) stays legal."""
    model, x = Toy().to(M), torch.randn(2, 8, device=M)
    [problem] = step_problems(run_step(labels_from_a_list_step, model, x, [0, 2]))
    assert "labels" in problem["message"] and line_of(labels_from_a_list_step, "F.cross_entropy") in problem["message"]
    assert step_problems(run_step(labels_from_a_number_step, model, x, 0.5)) == []
