"""tp.device given the device objects other frameworks hand out, and tp.dist when another library
made (and destroyed) the process group: gloo, world size 1.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist

import torchplace as tp
from torchplace import dist as tpdist
from torchplace.errors import DeviceError, DistributedError


@pytest.mark.parametrize("spec", ["CPU", " cpu ", "cpu\n", "cpu:0", torch.device("cpu", 0), torch.device("cpu")])
def test_cpu_spellings_other_frameworks_write(spec):
    """Ported in our terms from Lightning-AI/pytorch-lightning tests/tests_fabric/utilities/test_device_parser.py
    (device strings of any case and spacing): all name the one cpu device."""
    assert tp.device(spec) == torch.device("cpu")


@pytest.mark.parametrize("spec", [np.int64(0), np.int32(0), np.uint8(0)])
def test_numpy_integers_are_ints(spec):
    """A device_map or a config read with numpy carries np.int64(0); it used to be refused as 'not a
    device spec' while torch.device takes it. It now resolves like the int 0 (cuda:0, or the message
    that says there is no GPU here)."""
    if torch.cuda.is_available():
        assert tp.device(spec) == torch.device("cuda", 0)
    else:
        with pytest.raises(DeviceError, match="^0 requested"):
            tp.device(spec)


@pytest.mark.parametrize("spec", [np.bool_(True), True, torch.tensor(0), 1.0])
def test_what_is_not_a_device_stays_refused(spec):
    with pytest.raises(DeviceError, match="not a device"):
        tp.device(spec)


def test_the_devices_accelerate_and_lightning_hand_out(monkeypatch):
    """Ported in our terms from huggingface/accelerate tests/test_state.py (PartialState(cpu=True).device)
    and Lightning-AI/pytorch-lightning tests/tests_pytorch/trainer/connectors/test_accelerator_connector.py
    (trainer.strategy.root_device on the CPU accelerator)."""
    monkeypatch.setenv("PYTORCH_NVML_BASED_CUDA_CHECK", "")  # importing lightning sets it: put it back after
    import lightning as L
    from accelerate import PartialState

    assert tp.device(PartialState(cpu=True).device) == torch.device("cpu")
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    assert tp.device(trainer.strategy.root_device) == torch.device("cpu")


def test_a_group_destroyed_by_its_maker_is_not_reported_as_alive(tmp_path):
    """Ported in our terms from Lightning-AI/pytorch-lightning tests/tests_fabric/strategies/test_ddp.py
    (teardown destroys the group it made): after the maker destroys the adopted group, info() used to
    return the stale record (adopted=True, rank 0 of 1); it now says the group is gone, and init()
    makes or adopts a new one."""
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        assert tpdist.init().adopted and tpdist.init() is tpdist.info()  # init twice: the same record
        dist.destroy_process_group()  # the other library's teardown
        with pytest.raises(DistributedError, match="(?s)destroyed outside torchplace.*init\\(\\) again"):
            tpdist.info()
        store = dist.FileStore(str(tmp_path / "store2"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        assert tpdist.init().adopted and tpdist.info().world_size == 1
    finally:
        tpdist.teardown()
        if dist.is_initialized():
            dist.destroy_process_group()


def test_lightning_precision_strings():
    """Ported in our terms from Lightning-AI/pytorch-lightning tests/tests_pytorch/trainer/connectors/
    test_accelerator_connector.py (the precision strings a Trainer takes and reports): '32-true', the
    Trainer's default trainer.precision, was refused while '16-mixed' and 'bf16-mixed' were taken; the
    '-true' half forms (weights cast, no autocast) are refused with what they mean."""
    from torchplace.errors import PrecisionError

    assert tp.precision_for("cpu", "32-true").dtype == torch.float32
    assert tp.precision_for("cpu", "bf16-mixed").dtype == torch.bfloat16
    with pytest.raises(PrecisionError, match="'bf16-true' is Lightning's.*model.to\\(dtype\\)"):
        tp.precision_for("cpu", "bf16-true")
