"""`torchplace bench transfer` and `bench loader` on a GPU: the targets are measured (their values
are the benchmark's business, not a test's), and the loader's memory does not grow after warm-up."""

from __future__ import annotations

import argparse

import pytest

from torchplace.bench import loader as bench_loader
from torchplace.bench import transfer as bench_transfer

pytestmark = pytest.mark.gpu


def _args(module, *argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    module.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_transfer_checks_to_device_on_copies_and_the_loader_on_steps():
    result = bench_transfer.run(_args(bench_transfer, "--quick", "--device", "cuda:0"))
    names = [t.name for t in result.targets]
    assert "to_device / send_to_device, 64 small tensors, host time per batch, calls alternated" in names
    assert any(n.startswith("DeviceLoader / send_to_device per step, ") and n.endswith(" ms compute") for n in names)
    assert any(n.startswith("packed_collate + DeviceLoader / one pre-packed pinned copy") for n in names)
    assert all(t.measured > 0 for t in result.targets)
    assert any(note.startswith("copies only, DeviceLoader / send_to_device: ") for note in result.notes)


def test_loader_memory_check_sees_no_growth_after_warm_up():
    result = bench_loader.run(_args(bench_loader, "--quick", "--device", "cuda:0", "--epochs", "10"))
    reserved = result.params["reserved_mib_per_epoch"]
    assert len(reserved) == 11  # after the warm-up epoch, then after each of 10
    assert result.params["reserved_growth_mib"] == 0, f"memory_reserved() per epoch (MiB): {reserved}"
    assert [t.name for t in result.targets][-1] == "memory_reserved() growth over 10 epochs (MiB)"
