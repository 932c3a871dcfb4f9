"""explain(): where everything lives and the problems, as a dict and as rich tables (cpu, meta)."""

from __future__ import annotations

import json

import pytest
import torch
from checks_programs import Scaled, Toy, WithBuffer, batch_on, late_submodule
from torch import nn

import torchplace as tp


def kinds(result):
    return [(p["kind"], p["where"], p["severity"]) for p in result["problems"] if p["kind"] != "not-checked"]


def test_clean_model_is_one_row_and_no_problems():
    model = nn.Sequential(WithBuffer(), Toy()).to("meta")
    result = tp.explain(model, batch_on("meta")["x"])
    assert result["problems"] == [] and result.problems == [] and result["forward"] == "ran"
    result = tp.explain(model, batch_on("meta"))  # a batch the forward does not take: nothing was checked
    assert [p["kind"] for p in result.problems] == ["not-checked"]
    assert result["model"]["devices"] == ["meta"]
    assert [(m["module"], m["device"], m["own"]) for m in result["modules"]] == [("model", "meta", False)]
    assert result["modules"][0]["buffers"] == 1
    assert [i["path"] for i in result["inputs"]] == ["inputs[0]['x']", "inputs[0]['y']"]
    assert json.loads(json.dumps(result)) == result  # a plain dict for code


def test_submodule_left_behind_shows_in_the_grouping_and_as_a_problem():
    result = tp.explain(late_submodule("meta"))
    rows = [(m["module"], m["device"]) for m in result["modules"]]
    assert rows == [("model.layers", "meta"), ("model.head", "cpu")]
    assert kinds(result) == [("model-split", "model", "note")]  # a hint: torch judges when it runs
    assert "model.head on cpu" in result["problems"][0]["message"]
    failing = tp.explain(late_submodule("meta"), torch.randn(2, 8, device="meta"))
    assert ("model-split", "model", "warning") in kinds(failing)  # beside the failure it explains
    assert ("mismatch", "model.head", "error") in kinds(failing)


def test_module_with_its_own_tensors_on_two_devices():
    model = Toy()
    model.head.bias = nn.Parameter(torch.zeros(3, device="meta"))
    result = tp.explain(model)
    problem = next(p for p in result["problems"] if p["kind"] == "split-module")
    assert problem["where"] == "model.head" and problem["severity"] == "note"
    assert "weight on cpu, bias on meta" in problem["message"]
    owned = [(m["module"], m["device"]) for m in result["modules"] if m["own"]]
    assert owned == [("model.head", "cpu"), ("model.head", "meta")]


def test_plain_attribute_is_found_and_is_an_error_where_torch_refuses_it():
    model = Scaled().to("meta")
    result = tp.explain(model)
    assert result["plain_attributes"] == [{"name": "model.scale", "device": "cpu", "dtype": "float32", "shape": [8]}]
    assert kinds(result) == [("plain-attribute", "model.scale", "note")]  # nothing ran: a hint
    assert "register_buffer" in result["problems"][0]["message"]
    result = tp.explain(model, torch.randn(2, 8, device="meta"))
    assert kinds(result) == [("plain-attribute", "model.scale", "error"), ("mismatch", "model", "error")]


def test_inputs_on_another_device_but_cpu_scalars_are_fine():
    model = Toy().to("meta")
    batch = {"x": torch.randn(2, 8), "scale": torch.tensor(0.5), "nested": [torch.ones(2, device="meta")]}
    result = tp.explain(model, batch)
    assert kinds(result)[0] == ("input-device", "inputs[0]['x']", "note")  # Toy takes no dict: nothing ran
    assert "to_device(batch, 'meta')" in result["problems"][0]["message"]
    assert ("mismatch", "model.layers.0.proj", "error") in kinds(tp.explain(model, batch["x"]))
    assert [i["path"] for i in result["inputs"]] == ["inputs[0]['x']", "inputs[0]['scale']",
                                                     "inputs[0]['nested'][0]"]


def test_optimizer_state_on_another_device_than_its_parameter():
    model = Toy().to("meta")
    optimizer = torch.optim.AdamW(model.parameters())
    weight = model.head.weight
    optimizer.state[weight] = {"step": torch.tensor(1.0), "exp_avg": torch.zeros(3, 8),
                               "exp_avg_sq": torch.zeros(3, 8, device="meta")}
    result = tp.explain(model, optimizer=optimizer)
    assert kinds(result) == [("optimizer-state-device", "optimizer", "note")]  # no step given: a hint
    assert "model.head.weight['exp_avg'] on cpu (parameter on meta)" in result["problems"][0]["message"]
    assert result["optimizer"]["state_devices"] == {"cpu": 2, "meta": 1}  # the CPU step counter is allowed


def test_optimizer_built_before_a_move_that_replaced_the_parameters():
    model = Toy()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model.to("meta")  # cpu -> meta makes new Parameter objects: the optimizer still holds the old ones
    result = tp.explain(model, optimizer=optimizer)
    problem = next(p for p in result["problems"] if p["kind"] == "optimizer-foreign-parameters")
    assert "updates 10 of 10 tensor(s) that are not this model's" in problem["message"]
    assert result["optimizer"]["foreign_parameters"] == 10


@pytest.mark.skipif(torch.cuda.is_available(), reason="with GPUs DataParallel has devices: the GPU twin")
def test_dataparallel_without_gpus_is_not_a_problem():
    wrapped = nn.DataParallel(Toy())
    assert wrapped.device_ids == [] and kinds(tp.explain(wrapped)) == []


def test_tied_weights_count_once():
    model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 10, bias=False))
    model[1].weight = model[0].weight
    assert tp.explain(model)["modules"][0]["parameters"] == 1


def test_prints_as_tables(capsys):
    model = Scaled().to("meta")
    result = tp.explain(model, {"x": torch.randn(2, 8)})
    text = str(result)
    assert "where Scaled lives (meta)" in text and "plain-attribute" in text and "inputs[0]['x']" in text
    result.print()
    assert "problems" in capsys.readouterr().out
    assert "no placement problems found" in str(tp.explain(Toy(), torch.randn(2, 8)))


def test_rejects_inputs_in_the_model_slot():
    with pytest.raises(TypeError, match=r"explain\(model, batch"):
        tp.explain(torch.ones(2))
