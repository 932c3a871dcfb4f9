"""save_async from cuda:0: the state at the call (after the work queued before it), the copy into
reused pinned memory is what the caller waits for, the write comes after.

Run on a GPU machine: pytest -m gpu tests/checkpoint/test_background_gpu.py
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import torchplace

pytestmark = pytest.mark.gpu


def test_the_file_holds_the_state_after_queued_work_and_before_later_work(tmp_path: Path) -> None:
    dev = torch.device("cuda:0")
    w = torch.zeros(64 * 2**20 // 4, device=dev)
    big = torch.randn(4096, 4096, device=dev)
    for _ in range(20):  # queued, not finished, when save_async is called: it must wait for them
        big = big @ big / 4096
    w.add_(big[0, 0] * 0 + 1.0)  # w == 1 once the queue reaches here
    pending = torchplace.save_async(tmp_path / "c", model={"w": w}, rng_state=False)
    w.add_(1.0)  # training goes on at once: not in the file
    assert pending.result(timeout=120) == tmp_path / "c"
    loaded = torchplace.load(tmp_path / "c", device="cpu")["model"]["w"]
    assert torch.all(loaded == 1.0) and torch.all(w == 2.0)


def test_pinned_buffers_are_reused_and_the_write_follows_the_return(tmp_path: Path) -> None:
    dev = torch.device("cuda:0")
    model = torch.nn.Sequential(*[torch.nn.Linear(4096, 4096) for _ in range(8)]).to(dev)  # 512 MiB
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4096, device=dev)).sum().backward()
    opt.step()  # 1.5 GiB with Adam's state
    first = torchplace.save_async(tmp_path / "1", model=model, optimizer=opt)
    assert first.pinned
    first.result(timeout=300)
    second = torchplace.save_async(tmp_path / "2", model=model, optimizer=opt)
    returned = second.done()  # the call returned after the copy; checksums, fsync and rename come after
    assert second.pinned and second.allocated_bytes == 0  # pinned once, reused
    assert not returned
    assert second.result(timeout=300) == tmp_path / "2"
    ck = torchplace.load(tmp_path / "2", device=dev)
    assert torch.equal(ck["model"]["0.weight"], model[0].weight)
    assert torch.equal(ck["optimizer"]["state"][0]["exp_avg"], opt.state[model[0].weight]["exp_avg"])


def test_a_state_on_the_gpu_and_the_cpu(tmp_path: Path) -> None:
    cpu = torch.arange(1000.0)
    gpu = torch.arange(1000.0, device="cuda:0").to(torch.bfloat16)
    pending = torchplace.save_async(tmp_path / "c", model={"cpu": cpu, "gpu": gpu}, extra={"step": 1})
    cpu.zero_()
    gpu.zero_()
    pending.result(timeout=120)
    ck = torchplace.load(tmp_path / "c", device="cpu")
    assert torch.equal(ck["model"]["cpu"], torch.arange(1000.0))
    assert torch.equal(ck["model"]["gpu"], torch.arange(1000.0).to(torch.bfloat16))


def test_a_sharded_model_on_the_gpu_with_an_nccl_group(tmp_path: Path) -> None:
    """FSDP2 on cuda:0 in a one-rank NCCL group: the shards are copied into pinned memory at the call
    (reused by the next save), written through DCP on save_async's own gloo group, and load back."""
    import socket

    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cuda", (1,))

        def sharded(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
            torch.manual_seed(seed)
            model = nn.Sequential(*[nn.Linear(2048, 2048) for _ in range(4)]).to("cuda:0")
            for layer in model:
                fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
            return model, torch.optim.AdamW(model.parameters())

        model, opt = sharded(0)
        model(torch.randn(8, 2048, device="cuda:0")).sum().backward()
        opt.step()
        before = [p.full_tensor().clone() for p in model.parameters()]
        pending = torchplace.save_async(tmp_path / "c", model=model, optimizer=opt, extra={"step": 1})
        assert pending.pinned
        with torch.no_grad():  # queued right after the call: not in the checkpoint
            for p in model.parameters():
                p.mul_(-3.0)
        assert pending.result(timeout=120) == tmp_path / "c"
        again = torchplace.save_async(tmp_path / "d", model=model, optimizer=opt, extra={"step": 2})
        assert again.allocated_bytes == 0  # the pinned copies of the shards, reused
        again.result(timeout=120)
        other, other_opt = sharded(5)
        ck = torchplace.load(tmp_path / "c", model=other, optimizer=other_opt)
        assert ck.extra == {"step": 1}
        for a, b in zip(before, other.parameters()):
            assert torch.equal(a, b.full_tensor())
    finally:
        dist.destroy_process_group()


@pytest.mark.multigpu
def test_sharded_staging_waits_for_copies_on_a_gpu_other_than_the_current_one() -> None:
    # torch.accelerator.synchronize() waited for the current device only: a state on cuda:1 (moved
    # there without set_device) came back while its copies still ran behind queued work
    from torchplace.checkpoint import HostStaging

    torch.cuda.set_device(0)
    value = torch.full((64 * 2**20,), 3.0, device="cuda:1")
    torch.cuda._sleep(2_000_000_000)  # on cuda:0's stream: nothing to do with the copy
    with torch.cuda.device(1):
        torch.cuda._sleep(2_000_000_000)  # queued before the copies, on the stream they are queued on
    staged = HostStaging().dcp_stage({"w": value}, pinned=True)
    assert torch.equal(staged["w"], torch.full((64 * 2**20,), 3.0))
