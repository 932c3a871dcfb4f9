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
def step_breaks_before_the_model(dev, other):
    model = torch.nn.Linear(2, 2).to(dev)

    x = torch.ones(1, 2, device=other)

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
'''


def test_a_case_that_breaks_is_scored_as_a_miss_with_its_reason_and_the_others_are_still_scored(tmp_path):
    path = tmp_path / "corpus_breaks.py"
    path.write_text(CORPUS)
    corpus = diagnose.load_corpus(path)
    outcomes = {(o.case, o.tool): o for o in diagnose.score_all(["cpu-meta"], corpus)}
    broke = outcomes["step_breaks_before_the_model", "explain"]
    assert not broke.full and not broke.named
    assert all(outcomes["mixes_devices", tool].named for tool in diagnose.TOOLS)
    assert broke.unjudged.startswith("LookupError: the step failed before it reached explain_here()"), broke
