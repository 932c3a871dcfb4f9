"""Scopes and guards on real GPUs."""

from __future__ import annotations

import threading

import pytest
import torch

import torchplace as tp
from torchplace.errors import DeviceLeakWarning

pytestmark = [pytest.mark.gpu, pytest.mark.multigpu]


def leaky_helper():
    torch.cuda.set_device(1)


def test_on_sets_and_restores_current_device():
    torch.cuda.set_device(0)
    with tp.on("cuda:1") as dev:
        assert dev == torch.device("cuda:1") and torch.cuda.current_device() == 1
        assert torch.ones(1, device="cuda").device == torch.device("cuda:1")
    assert torch.cuda.current_device() == 0


def test_on_is_per_thread_on_gpu():
    torch.cuda.set_device(0)
    seen = {}

    def worker():
        seen["worker"] = torch.cuda.current_device()

    with tp.on("cuda:1"):
        t = threading.Thread(target=worker)
        t.start()
        t.join()
    assert seen["worker"] == 0


def test_guard_warns_names_the_line_and_restores():
    torch.cuda.set_device(0)

    @tp.guard
    def step():
        leaky_helper()

    with pytest.warns(DeviceLeakWarning,
                      match=r"changed the current device from cuda:0 to cuda:1.*test_scope_gpu.py:\d+ in leaky_helper"):
        step()
    assert torch.cuda.current_device() == 0


def test_guard_raises_when_asked():
    torch.cuda.set_device(0)
    with pytest.raises(tp.DeviceLeakError, match="leaky_helper"):
        with tp.guard(action="raise"):
            leaky_helper()
    assert torch.cuda.current_device() == 0


def test_guard_is_silent_when_scopes_restore():
    torch.cuda.set_device(0)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with tp.guard(action="raise"):
            with tp.on("cuda:1"):
                torch.ones(1, device="cuda")
            with torch.cuda.device(1):
                torch.ones(1, device="cuda")


def test_device_resolves_and_validates_on_real_gpus():
    n = torch.cuda.device_count()
    assert tp.device("auto") == torch.device("cuda:0")
    assert tp.device(f"cuda:{n - 1}").index == n - 1
    with pytest.raises(tp.DeviceError, match=f"cuda:{n} requested, but .*{n} GPUs? visible"):
        tp.device(f"cuda:{n}")
