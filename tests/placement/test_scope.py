"""Scopes on the CPU: decorator/context semantics, threads, and the leak message."""

from __future__ import annotations

import threading
import warnings

import pytest
import torch

import torchplace as tp
from torchplace.errors import DeviceLeakWarning
from torchplace.placement import guard
from torchplace.shared.setters import leak_message


def test_on_cpu_returns_the_device_and_changes_nothing():
    with tp.on("cpu") as dev:
        assert dev == torch.device("cpu")
        assert torch.zeros(1).device.type == "cpu"


def test_on_with_factories_places_factory_calls_and_restores():
    with tp.on("meta", factories=True):
        assert torch.zeros(2).device.type == "meta"
    assert torch.zeros(2).device.type == "cpu"


def test_on_restores_after_an_exception():
    with pytest.raises(KeyError):
        with tp.on("meta", factories=True):
            raise KeyError("boom")
    assert torch.zeros(1).device.type == "cpu"


def test_on_as_decorator_and_nested():
    scope = tp.on("meta", factories=True)

    @scope
    def make():
        with tp.on("cpu", factories=True):
            inner = torch.ones(1).device.type
        return inner, torch.ones(1).device.type

    assert make() == ("cpu", "meta")


def test_on_validates_at_once():
    with pytest.raises(tp.DeviceError):
        tp.on("cpu:3")


def test_on_is_per_thread():
    seen = {}
    scope = tp.on("meta", factories=True)

    def worker():
        seen["worker"] = torch.zeros(1).device.type

    with scope:
        t = threading.Thread(target=worker)
        t.start()
        t.join()
        seen["main"] = torch.zeros(1).device.type
    assert seen == {"worker": "cpu", "main": "meta"}


def test_guard_forms_are_silent_on_clean_code():
    @guard
    def a(x):
        return x + 1

    @guard(action="raise")
    def b(x):
        return x * 2

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert a(1) == 2 and b(2) == 4
        with guard():
            torch.ones(3).sum()


def test_guard_rejects_unknown_action():
    with pytest.raises(ValueError, match="use 'warn' or 'raise'"):
        guard(action="ignore")


def test_leak_message_names_who_where_and_the_fix():
    text = leak_message("helpers.train_step (helpers.py:10)", 0, 1, ["helpers.py:12 in set_up"])
    assert "helpers.train_step (helpers.py:10) changed the current device from cuda:0 to cuda:1" in text
    assert "made at helpers.py:12 in set_up" in text and "torchplace restored cuda:0" in text
    assert "torchplace.on" in text
    assert issubclass(DeviceLeakWarning, UserWarning)
