"""torchplace.device: every spec form, resolved against snapshots of real H200 machines."""

from __future__ import annotations

import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from snapshots import load_snapshot_dict

import torchplace as tp
from torchplace.errors import DeviceError
from torchplace.hardware.topology import Topology
from torchplace.hardware.visible import map_visible
from torchplace.policy.devices import Machine, cuda_device_count, resolve

X2 = Topology.from_dict(load_snapshot_dict("h200x2"))
U0, U1 = (g.uuid for g in X2.gpus)


def machine(cvd=None, order=None, local_rank=None) -> Machine:
    return Machine.from_topology(X2, cvd, order, local_rank)


@pytest.mark.parametrize("spec,expected", [
    ("auto", "cuda:0"), (None, "cuda:0"), ("cuda", "cuda:0"), ("cuda:1", "cuda:1"), (1, "cuda:1"),
    (torch.device("cuda", 1), "cuda:1"), ("cpu", "cpu"), ("meta", "meta"), (" CUDA:1 ", "cuda:1"),
    ("physical:1", "cuda:1"), (U1, "cuda:1"), (U1[:10], "cuda:1"),
])
def test_specs_on_the_two_gpu_machine(spec, expected):
    assert resolve(spec, machine()) == torch.device(expected)


def test_auto_and_bare_cuda_follow_local_rank():
    assert resolve("auto", machine(local_rank=1)) == torch.device("cuda:1")
    assert resolve("cuda", machine(local_rank=1)) == torch.device("cuda:1")


def test_local_rank_beyond_visible_gpus_names_both():
    with pytest.raises(DeviceError, match=r"auto \(LOCAL_RANK=1\) requested, but CUDA_VISIBLE_DEVICES='0' "
                                          r"makes 1 GPU visible: cuda:0 = physical 0"):
        resolve("auto", machine(cvd="0", local_rank=1))


def test_the_issue_example_message():
    with pytest.raises(DeviceError) as info:
        resolve("cuda:3", machine(cvd="1,0"))
    text = str(info.value)
    assert text.startswith("cuda:3 requested, but CUDA_VISIBLE_DEVICES='1,0' makes 2 GPUs visible: "
                           f"cuda:0 = physical 1 (NVIDIA H200, {U1}); cuda:1 = physical 0 (NVIDIA H200, {U0})")
    assert "Fix:" in text


def test_physical_ids_survive_remapping():
    m = machine(cvd="1")
    assert resolve("physical:1", m) == torch.device("cuda:0")
    with pytest.raises(DeviceError, match="physical GPU 0 is not visible to this process"):
        resolve("physical:0", m)


def test_uuid_errors_list_the_visible_gpus():
    with pytest.raises(DeviceError, match="GPU-ffff matches no visible GPU"):
        resolve("GPU-ffff", machine())
    with pytest.raises(DeviceError, match="matches 2 visible GPUs"):
        resolve("GPU-", machine())


def test_no_gpu_visible():
    with pytest.raises(DeviceError, match="no CUDA GPU is visible|no GPU is visible"):
        resolve("cuda:0", machine(cvd=""))
    assert resolve("auto", machine(cvd="")) == torch.device("cpu")


def test_cpu_only_torch_says_so():
    m = machine()
    m.torch_has_cuda, m.cuda_count = False, 0
    with pytest.raises(DeviceError, match="CPU-only build although 2 GPU"):
        resolve("cuda:0", m)


@pytest.mark.parametrize("spec,match", [
    ("cpu:1", "cpu has a single device"), ("cuda:x", "not a device spec"), ("physical:x", "needs a GPU index"),
    ("banana", "names no device type"), (True, "is not a device"), (1.5, "is not a device spec"),
    ("xpu:0", "no xpu device is available"),
])
def test_bad_specs(spec, match):
    with pytest.raises(DeviceError, match=match):
        resolve(spec, machine())


@pytest.mark.parametrize("spec,hint", [
    ("gpu", "Did you mean 'cuda'?"), ("GPU:1", "Did you mean 'cuda:1'?"), ("cuda0", "Did you mean 'cuda:0'?"),
    ("cuda_1", "Did you mean 'cuda:1'?"), ("0", "Did you mean 'cuda:0' (or the int 0)?"),
    ("-1", "Did you mean 'cpu'?"), ("banana", "names no device type PyTorch knows. Accepted"),
])
def test_spellings_of_other_tools_get_the_torchplace_spelling(spec, hint):
    """What a new user types for a GPU: 'gpu' (Keras, Ray), 'cuda0', '0' from a --device flag, and
    transformers' -1 for the CPU, each answered with the spelling that works."""
    with pytest.raises(DeviceError, match=re.escape(hint)):
        resolve(spec, machine())


def test_an_accelerator_that_does_not_exist_says_what_to_ask_for():
    with pytest.raises(DeviceError, match=r"mps requested, but no mps device is available.*Available: cpu, "
                                          r"cuda:0\.\.cuda:1\. Fix: ask for one of those, or 'auto'"):
        resolve("mps", machine())


def test_device_error_is_a_value_error():
    assert issubclass(DeviceError, ValueError) and issubclass(DeviceError, tp.TorchplaceError)


def test_live_machine_here_resolves_auto_without_starting_cuda():
    assert tp.device("auto").type in ("cpu", "cuda", "mps", "xpu")
    assert not torch.cuda.is_initialized()


@settings(max_examples=400, deadline=None)
@given(spec=st.one_of(st.text(max_size=20), st.integers(-3, 5),
                      st.sampled_from(["cuda:", "physical:", "GPU-", "MIG-", "cuda:01", "auto", "mps", "cpu:0"])),
       cvd=st.sampled_from([None, "", "0", "1,0", "0,0", "2", U1[:8]]))
def test_any_spec_yields_a_device_or_a_device_error(spec, cvd):
    try:
        result = resolve(spec, machine(cvd=cvd))
    except DeviceError as exc:
        assert str(exc)
    else:
        assert isinstance(result, torch.device)
        assert result.type in ("cpu", "meta") or result.index is not None


@pytest.mark.parametrize("spec,fixed", [
    ("cuda:01", "cuda:1"), ("cuda:00", "cuda:0"), ("cpu:00", "cpu:0"),
    ("cuda:\u0661", "cuda:1"), ("cuda:\uff11", "cuda:1"), ("cuda:\u00b2", "cuda:2"), ("physical:\u0661", "physical:1"),
    ("\uff11", "1"),
])
def test_specs_torch_refuses_are_refused_with_the_ascii_spelling(spec, fixed):
    """Leading zeros and non-ASCII digits: torch.device refuses them, so do we, naming the fix."""
    if ":" in spec:
        with pytest.raises(RuntimeError):
            torch.device(spec)
    with pytest.raises(DeviceError, match=re.escape(f"Fix: write {fixed!r}")):
        resolve(spec, machine())


def test_uuid_in_upper_case_resolves_as_the_driver_reads_it():
    assert resolve(U1[:12].upper(), machine()) == torch.device("cuda:1")


@pytest.mark.parametrize("cvd", ["-", "+", "\u00b2", "1" + "0" * 5000])
def test_values_torch_cannot_parse_leave_cpu_and_count_alone(cvd, monkeypatch):
    """CUDA_VISIBLE_DEVICES='-' made torch's own parser raise ValueError from device('cpu')."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", cvd)
    assert tp.device("cpu") == torch.device("cpu")
    notes: list[str] = []
    visible = map_visible(cvd, X2, None)
    torch_count = lambda: len(torch.cuda._parse_visible_devices())  # noqa: E731  torch's real parser
    assert cuda_device_count(visible, notes, torch_count) == visible.count
    assert "using the driver's reading" in notes[0] and len(notes[0]) < 400


def test_device_takes_the_facts_that_read_facts_returns(monkeypatch):
    """The documented `machine=` took only the private Machine: read_facts()'s record raised AttributeError."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    facts = tp.read_facts(snapshot="h200x2")
    assert tp.device("physical:1", machine=facts) == torch.device("cuda", 0)
    with pytest.raises(DeviceError, match="physical GPU 0 is not visible to this process"):
        tp.device("physical:0", machine=facts)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert tp.device("cuda:1", machine=tp.read_facts(snapshot="h200x2")) == torch.device("cuda", 1)


def test_a_physical_gpu_no_visible_devices_value_can_reach_is_not_sent_to_cuda_visible_devices():
    """physical:3 where every GPU is visible, on a machine without GPUs, or with a CPU-only torch: setting
    CUDA_VISIBLE_DEVICES cannot help, so the fix says what can."""
    with pytest.raises(DeviceError, match="this machine has no physical GPU 3; CUDA_VISIBLE_DEVICES=unset") as err:
        resolve("physical:3", machine())
    assert "include it in CUDA_VISIBLE_DEVICES" not in str(err.value)
    nothing = Machine.from_topology(Topology.from_dict({"gpus": []}))
    with pytest.raises(DeviceError, match="no CUDA GPU is visible.*run where a GPU is visible"):
        resolve("physical:3", nothing)
    cpu_build = Machine(0, machine().visible, torch_has_cuda=False)
    with pytest.raises(DeviceError, match="this torch is a CPU-only build although 2 GPU"):
        resolve("physical:1", cpu_build)
