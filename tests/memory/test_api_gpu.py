"""Memory on a GPU: report numbers, the leak detector (with allocation sites), OOM diagnosis and
the batch-size search under torch.cuda.set_per_process_memory_fraction."""

from __future__ import annotations

import gc
import warnings
from pathlib import Path

import pytest
import torch
import torch._dynamo  # noqa: F401 - optimizers import it on first use, and it writes TORCHINDUCTOR_CACHE_DIR

from torchplace import diagnose_oom, find_batch_size, memory_report, track_memory
from torchplace.memory import MemoryLeakWarning, OutOfMemoryDiagnosis

pytestmark = pytest.mark.gpu
DEV = torch.device("cuda", 0)
MiB = 2**20
THIS_FILE = Path(__file__).name  # where the leak detector points


def test_report_numbers_and_largest_tensor():
    held = [torch.empty(256 * MiB, dtype=torch.uint8, device=DEV)]
    report = memory_report("cuda:0", top=1)
    cuda = report.devices[0]
    assert cuda.device == "cuda:0" and cuda.allocated_bytes >= 256 * MiB
    assert cuda.reserved_bytes >= cuda.allocated_bytes and cuda.total_bytes == torch.cuda.mem_get_info(DEV)[1]
    assert report.largest[0].nbytes == 256 * MiB and report.largest[0].held_by.startswith("a list of 1 items")
    held.clear()


def train(history: list, keep_graph: bool, **kwargs):
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Tanh(), torch.nn.Linear(256, 1)).to(DEV)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with track_memory(DEV, **kwargs) as tracker:
        for _ in range(16):
            loss = model(torch.randn(64, 256, device=DEV)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            history.append(loss if keep_graph else loss.item())
            tracker.step()
    return tracker


def test_leak_detector_on_the_gpu():
    clean: list = []
    with warnings.catch_warnings():
        warnings.simplefilter("error", MemoryLeakWarning)
        assert train(clean, keep_graph=False).report is None
    leaky: list = []
    with pytest.warns(MemoryLeakWarning, match="MeanBackward0"):
        tracker = train(leaky, keep_graph=True, record_origins=True)
    assert "in a list of 16 items" in tracker.report.kept_by[0]
    assert any(h.origin and THIS_FILE in h.origin for h in tracker.report.holders)


def test_kept_activations_grow_allocated_bytes():
    model = torch.nn.Linear(512, 512).to(DEV)
    outputs = []
    with pytest.warns(MemoryLeakWarning, match=r"cuda:0 \(bytes allocated by tensors\) grew by"):
        with track_memory(DEV) as tracker:
            for _ in range(12):
                outputs.append(model(torch.randn(512, 512, device=DEV)))  # 1 MiB kept per step
                tracker.step()
    assert tracker.report.growth_bytes >= 9 * MiB
    outputs.clear()


def test_growing_cache_of_plain_tensors_is_named_on_the_gpu():
    """The issue's case on CUDA: 8 MiB of graph-free tensors a step kept in a dict."""
    x = torch.randn(2**21, device=DEV)  # 8 MiB
    seen = {}
    with pytest.warns(MemoryLeakWarning) as caught:
        with track_memory(DEV) as tracker:
            for step in range(30):
                seen[step] = x * 2  # the leak
                tracker.step()
    top = tracker.report.grew[0]
    assert (top.name, top.growth_bytes, top.added_tensors, top.device) == ("dict `seen`", 28 * 8 * MiB, 28, "cuda:0")
    assert top.where.startswith(f"{THIS_FILE}:")
    assert f"dict `seen` ({THIS_FILE}:" in str(caught[0].message)
    assert "grew by 224.0 MiB: 28 tensor(s) of 8.0 MiB added (cuda:0)" in str(caught[0].message)
    seen.clear()


def test_clean_adamw_loop_stays_silent_on_the_gpu():
    model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 1)).to(DEV)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with warnings.catch_warnings():
        warnings.simplefilter("error", MemoryLeakWarning)
        with track_memory(DEV) as tracker:
            for _ in range(24):
                loss = model(torch.randn(256, 1024, device=DEV)).pow(2).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
                tracker.step()
    assert tracker.report is None


@pytest.fixture
def capped_gpu():
    """Cap this process at what it holds now plus 1 GiB; undo afterwards."""
    gc.collect()  # tensors earlier tests left in cycles would be freed mid-test and raise the headroom
    torch.cuda.synchronize()  # blocks freed while side streams still used them return to the pool only now
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(DEV).total_memory
    # allocated, not reserved: blocks a side stream (DeviceLoader) still held when the cap was set went
    # back to the pool later and made the headroom larger than 1 GiB on the H200 (batch 1023, 9 blocks)
    torch.cuda.set_per_process_memory_fraction((torch.cuda.memory_allocated(DEV) + 1024 * MiB) / total, DEV)
    yield
    torch.cuda.set_per_process_memory_fraction(1.0, DEV)
    torch.cuda.empty_cache()


def test_oom_report_on_the_gpu(capped_gpu):
    held = []
    with pytest.raises(OutOfMemoryDiagnosis) as info:
        with diagnose_oom():
            for _ in range(16):
                held.append(torch.empty(128 * MiB, dtype=torch.uint8, device=DEV))
    report = info.value.report
    assert isinstance(info.value, torch.OutOfMemoryError) and isinstance(info.value.__cause__, torch.OutOfMemoryError)
    assert report.device == "cuda:0" and report.requested_bytes == 128 * MiB and 4 <= len(held) <= 8
    assert report.memory.largest[0].held_by.startswith(f"a list of {len(held)} items")
    assert report.memory.devices[0].allocated_bytes >= len(held) * 128 * MiB
    held.clear()


def test_batch_search_on_the_gpu(capped_gpu):
    def step(batch: int) -> float:
        x = torch.empty(batch, MiB // 4, device=DEV)  # 1 MiB per sample, and as much again for x * 2
        return float((x * 2).sum())

    batch = find_batch_size(step, 16)
    assert 256 <= batch <= 512
    step(batch // 2)
