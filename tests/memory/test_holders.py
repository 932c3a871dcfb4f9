"""What holds memory, with a transformers ModelOutput: an OrderedDict whose fields are also
attributes, so its entry and its attribute `__dict__` reference each tensor. One reference path
is one holder, in the heap walk of `track_memory` and in the names of `memory_report`."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from torchplace import memory_report, track_memory
from torchplace.memory import MemoryLeakWarning
from torchplace.memory.holders import holdings

modeling_outputs = pytest.importorskip("transformers.modeling_outputs")
CausalLMOutput = modeling_outputs.CausalLMOutput


def line_of(text: str) -> str:
    lines = Path(__file__).read_text().splitlines()
    return f"{Path(__file__).name}:{next(i for i, line in enumerate(lines, 1) if text in line)}"


def ours(report):
    """Our tensor among the largest (other tests may leave a larger buffer alive)."""
    return next(t for t in report.largest if t.shape == (3, 1_000_003))


def test_a_model_output_is_one_holder_of_its_fields():
    logits = torch.randn(1000)
    out = CausalLMOutput(logits=logits)
    assert out["logits"] is logits and vars(out)["logits"] is logits  # both paths exist
    ptr = logits.untyped_storage().data_ptr()
    held = holdings(lambda t: t.untyped_storage().data_ptr() == ptr)
    assert [(h.kind, h.tensors, h.nbytes) for h in held.values()] == [("CausalLMOutput", 1, 4000)]


def test_a_growing_model_output_field_is_named_once():
    x = torch.randn(2**20)  # 4 MiB
    out = CausalLMOutput(logits=torch.zeros(0))
    with pytest.warns(MemoryLeakWarning):
        with track_memory("cpu") as tracker:
            for _ in range(30):
                out.logits = torch.cat([out.logits, x])  # the leak
                tracker.step()
    grew = tracker.report.grew
    assert [(g.name, g.where) for g in grew] == [("tensor `out.logits`", line_of("out.logits = torch.cat"))]


def test_a_cache_of_model_outputs_names_each_output_once():
    cache = {}
    with pytest.warns(MemoryLeakWarning):
        with track_memory("cpu") as tracker:
            for step in range(8):
                cache[step] = CausalLMOutput(logits=torch.randn(2**22))  # 16 MiB each
                tracker.step()
    names = [g.name for g in tracker.report.grew]
    assert names[0] == "dict `cache`"
    assert all(name.startswith("tensor `cache[") and name.endswith("].logits`") for name in names[1:])
    assert len(set(names)) == len(names)  # no output twice, no anonymous "a dict of 4 items"


def test_memory_report_names_a_model_output_in_a_container():
    cache = {"step": CausalLMOutput(logits=torch.randn(3, 1_000_003))}
    held_by = ours(memory_report("cpu", top=5)).held_by
    assert held_by is not None and held_by.startswith("CausalLMOutput['logits']"), held_by
    del cache


def test_memory_report_names_the_model_output_entry():
    """The entry, never the attribute dict beside it ("CausalLMOutput.logits" or "a dict of 4 items")."""
    kept = CausalLMOutput(logits=torch.randn(3, 1_000_003))
    globals()["KEPT_OUTPUT"] = kept
    try:
        assert ours(memory_report("cpu", top=5)).held_by == f"{__name__}.KEPT_OUTPUT['logits']"
    finally:
        del globals()["KEPT_OUTPUT"]


def test_a_graph_alive_before_the_baseline_is_not_named_as_growth():
    """A graph that was alive before tracking began (a traceback's, an earlier loop's) is not this loop's growth: only
    the running total summed inside the loop is named, not `earlier`, whose graph saves more than any one step."""
    model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.Tanh(), torch.nn.Linear(1024, 1))
    earlier = model(torch.randn(8192, 1024)).sum()  # about 64 MiB saved by its graph, before the baseline
    total = 0
    with pytest.warns(MemoryLeakWarning):
        with track_memory("cpu") as tracker:
            for _ in range(20):
                total += model(torch.randn(1024, 1024)).sum()
                tracker.step()
    names = [g.name for g in tracker.report.grew]
    del earlier, total
    assert names == ["autograd graph of tensor `total`"], names
