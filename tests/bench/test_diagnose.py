"""bench diagnose's scoring: a case that cannot be judged is a miss that says why, never the end of the run."""

from __future__ import annotations

from pathlib import Path

from torchplace.bench import diagnose

KIT = Path(__file__).parents[1] / "checks"

CORPUS = f'''
import sys
sys.path.insert(0, {str(KIT)!r})
import torch
from corpus_kit import ALL, PAIRS, Program, Registry, explain_here, stepped

R = Registry(__file__)
CASES = R.CASES
for_pair = R.for_pair


@R.mistake("example/project#1", "w")
def breaks(dev, other):
    raise ValueError("this case cannot be built")


@R.mistake("example/project#3", "torch.ones")
def step_fails_before_it_explains(dev, other):
    model = torch.nn.Linear(2, 2).to(dev)
    x = torch.ones(1, 2, device=dev)

    def step():
        torch.ones(1, 2, device=dev) + torch.ones(1, 2, device=other)  # fails before it explains
        explain_here(model, x)
        return model(x)

    return stepped(model, step, (x,))


@R.mistake("example/project#2", "x")
def mixes_devices(dev, other):
    model = torch.nn.Linear(2, 2).to(dev)
    x = torch.ones(1, 2, device=other)
    return Program(model, lambda: model(x), (x,))


@R.mistake("example/project#4", "x", "net")
def held_as_net(dev, other):
    net = torch.nn.Linear(2, 2).to(dev)
    x = torch.ones(1, 2, device=other)
    return Program(net, lambda: net(x), (x,))
'''


def test_a_case_that_breaks_is_scored_as_a_miss_with_its_reason_and_the_others_are_still_scored(tmp_path):
    path = tmp_path / "corpus_breaks.py"
    path.write_text(CORPUS)
    corpus = diagnose.load_corpus(path)
    outcomes = {(o.case, o.tool): o for o in diagnose.score_all(["cpu-meta"], corpus)}
    broke = outcomes["breaks", "explain"]
    assert not broke.full and not broke.named
    assert all(outcomes["mixes_devices", tool].named for tool in diagnose.TOOLS)
    assert broke.unjudged == "ValueError: this case cannot be built", broke


def test_a_step_that_fails_before_the_users_explain_line_is_handed_to_explain(tmp_path):
    path = tmp_path / "corpus_early.py"
    path.write_text(CORPUS)
    corpus = diagnose.load_corpus(path)
    [case] = [c for c in corpus.CASES if c.name == "step_fails_before_it_explains"]
    out = diagnose.score(case, "cpu-meta", "explain", corpus)
    assert out.named and not out.unjudged and "the step fails (run on fake tensors)" in out.text, out


def test_explain_is_called_from_the_users_code_so_their_variable_names_the_model(tmp_path):
    path = tmp_path / "corpus_names.py"
    path.write_text(CORPUS)
    corpus = diagnose.load_corpus(path)
    [case] = [c for c in corpus.CASES if c.name == "held_as_net"]
    out = diagnose.score(case, "cpu-meta", "explain", corpus)
    assert out.full and "inside module net (Linear)" in out.text, out.text
