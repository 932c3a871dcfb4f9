"""The corpus on cpu vs meta: strict(), watch() and explain() name every mistake with module path, tensor
and user line; nothing cries wolf."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import torchplace
from torchplace.bench import _corpus as corpus
from torchplace.bench import diagnose
from torchplace.checks.culprits import misplaced_state
from torchplace.checks.frames import is_installed, is_user, is_users_own, short_path

PAIR = "cpu-meta"
MISTAKES = corpus.for_pair(PAIR, "mistake")
LEGAL = corpus.for_pair(PAIR, "legal")
BY_NAME = {c.name: c for c in corpus.CASES}


def _file(name: str) -> str:
    """The case's file as reports show it (relative to here or to site-packages)."""
    return short_path(BY_NAME[name].file)


def _at(name: str) -> str:
    return f"{_file(name)}:{BY_NAME[name].line}"
def test_the_corpus_is_big_enough_and_cites_its_sources():
    assert len([c for c in corpus.CASES if c.kind == "mistake"]) >= 30 and len(MISTAKES) >= 30
    assert len([c for c in corpus.CASES if c.kind == "legal"]) >= 15
    assert all(c.source.count("/") == 1 and "#" in c.source for c in corpus.CASES)
    assert all(c.line for c in corpus.CASES if c.kind == "mistake")
    assert len({c.name for c in corpus.CASES}) == len(corpus.CASES)


@pytest.mark.parametrize("tool", ["strict", "watch"])
@pytest.mark.parametrize("case", MISTAKES, ids=lambda c: c.name)
def test_strict_and_watch_name_path_tensor_and_line(case, tool):
    out = diagnose.score(case, PAIR, tool, corpus)
    assert out.full, f"missing {out.missing} in:\n{out.text}"


@pytest.mark.parametrize("case", MISTAKES, ids=lambda c: c.name)
def test_explain_names_path_tensor_and_line(case):
    """Mistakes made in the step around the model (a loss's weight, labels, a stacked 0-dim tensor) are read
    from the code of the step that calls explain() (explain_here in the corpus), as a user calls it."""
    out = diagnose.score(case, PAIR, "explain", corpus)
    assert out.full, f"missing {out.missing} in:\n{out.text}"


@pytest.mark.parametrize("tool", diagnose.TOOLS)
@pytest.mark.parametrize("case", LEGAL, ids=lambda c: c.name)
def test_legal_patterns_raise_no_alarm(case, tool):
    out = diagnose.score(case, PAIR, tool, corpus)
    assert not out.alarm, out.text


def test_the_factory_that_made_a_culprit_is_named_with_its_line():
    out = diagnose.score(next(c for c in MISTAKES if c.name == "lstm_h0_zeros"), PAIR, "strict", corpus)
    assert f"`h0 = torch.zeros(1, x.shape[1], W)` at {_file('lstm_h0_zeros')}:" in out.text
    assert "torch.zeros(...) without a device, so on the CPU" in out.text and "pass device=" in out.text


def test_modules_in_plain_lists_suggest_module_list():
    out = diagnose.score(next(c for c in MISTAKES if c.name == "heads_in_list"), PAIR, "strict", corpus)
    assert "inside module model.heads[0] (Linear)" in out.text
    assert "Fix: make model.heads nn.ModuleList(...)" in out.text
    out = diagnose.score(next(c for c in MISTAKES if c.name == "branches_in_dict"), PAIR, "explain", corpus)
    assert "Fix: make model.branches nn.ModuleDict(...)" in out.text


def test_explain_given_the_step_names_the_line_in_the_class_that_uses_the_culprit():
    """A module in a plain list used by another method of the model, a scheduler's tensor used by its own
    step(): explain(..., step=...) runs that code on fake tensors, so the line is the one torch failed at."""
    by_name = {c.name: c for c in MISTAKES}
    out = diagnose.score(by_name["criterions_in_list"], PAIR, "explain", corpus)
    assert f"{_at('criterions_in_list')} in validation_step()" in out.text
    out = diagnose.score(by_name["scheduler_sigmas"], PAIR, "explain", corpus)
    assert f"{_at('scheduler_sigmas')} in step()" in out.text


def test_zero_dim_cpu_tensors_refused_by_stack_are_blamed():
    out = diagnose.score(next(c for c in MISTAKES if c.name == "stack_zero_dim_loss"), PAIR, "strict", corpus)
    assert "allowed" not in out.text and "which elementwise ops accept on any device but this op does not" in out.text
    assert "box_loss on cpu, while the rest are on meta" in out.text


def test_optimizer_state_is_named_by_parameter_and_key():
    """torch's meta kernels let an optimizer step mix devices (and Module.to('meta') makes new parameters),
    so the naming is checked directly: state moved away from its parameter, as a GPU run leaves it."""
    model = corpus.Toy()
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(2, corpus.W)).sum().backward()
    optimizer.step()
    for state in optimizer.state.values():
        state["exp_avg"] = state["exp_avg"].to("meta")
    found = misplaced_state(optimizer, model)
    assert found[0] == "model.layers.0.proj.weight['exp_avg'] on meta (parameter on cpu)" and len(found) == 10
    assert not any("'step'" in f for f in found)  # Adam keeps its step counters on the CPU by design


def test_the_corpus_ships_in_the_package_and_reads_as_user_code():
    """bench diagnose runs from a wheel: its corpus is a module of the package (it was read from tests/ by
    path), and its programs count as the user's code there, inside site-packages too."""
    package = Path(torchplace.__file__).parent
    assert diagnose.load_corpus() is corpus
    assert all(Path(c.file).is_relative_to(package / "bench" / "_corpus") for c in corpus.CASES)
    assert all(is_user(c.file) and is_users_own(c.file) and not is_installed(c.file) for c in corpus.CASES)
    assert not is_user(diagnose.__file__)


def test_explain_names_every_mistake_in_full_when_torchplace_is_installed(monkeypatch):
    """From a wheel the corpus sits in site-packages, where explain() skipped classes as library code:
    28/30 in full there (the line of criterions_in_list and scheduler_sigmas was missing)."""
    from torchplace.shared import frames

    installed_at = str(Path(torchplace.__file__).parent.parent) + "/"
    monkeypatch.setattr(frames, "SITE_DIRS", (*frames.SITE_DIRS, installed_at))
    assert frames.is_installed(diagnose.__file__) and not frames.is_installed(BY_NAME["scheduler_sigmas"].file)
    missed = [c.name for c in MISTAKES if not diagnose.score(c, PAIR, "explain", corpus).full]
    assert not missed
