"""setup(): one record of device decisions, with helpers bound to them."""

from __future__ import annotations

import pytest
import torch

import torchplace as tp
from torchplace.checks import strict as strict_mod


def test_setup_on_cpu_binds_helpers(tmp_path, capsys, restore_threads):
    rt = tp.setup("cpu", seed=3)
    assert rt.device == torch.device("cpu") and rt.world_size == 1 and rt.is_main
    assert "device cpu" in capsys.readouterr().err
    batch = {"x": torch.ones(2), "y": [torch.zeros(1)]}
    assert rt.to(batch)["x"].device.type == "cpu"
    assert [b["x"].sum().item() for b in rt.loader([batch, batch])] == [2.0, 2.0]
    model = torch.nn.Linear(2, 2)
    with rt.autocast():
        model(torch.ones(1, 2))
    rt.save(tmp_path / "c.tpck", model=model)
    other = torch.nn.Linear(2, 2)
    rt.load(tmp_path / "c.tpck", model=other)
    assert torch.equal(other.weight, model.weight)
    assert "meta" not in str(rt.explain(model, torch.ones(1, 2)))
    assert torch.initial_seed() == 3


def test_setup_resolves_other_devices_and_reports_them(restore_threads):
    rt = tp.setup("meta", threads=None, verbose=False)
    assert rt.device == torch.device("meta") and rt.threads is None
    assert "meta" in rt.summary()


def test_setup_rejects_impossible_devices_at_once():
    with pytest.raises(tp.DeviceError, match="cuda:7 requested"):
        tp.setup("cuda:7", verbose=False)


def test_setup_can_turn_strict_mode_on(restore_threads):
    rt = tp.setup("cpu", threads=None, strict="warn", verbose=False)
    try:
        assert rt.strict == "warn" and strict_mod.is_enabled()
    finally:
        strict_mod.disable()
