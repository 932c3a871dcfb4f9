"""One rank of the 2-process gloo test of save_async with a sharded (FSDP2) model on the CPU.

Usage: async_sharded_worker.py RANK WORLD DIR (MASTER_ADDR / MASTER_PORT from the environment). Checks:
1. the folder holds the state at the call: parameters and optimizer state changed right after
   save_async returns are not in it; it loads back into a model sharded the same way;
2. atomic publish and rotation: saves in a row (max_in_flight=2 too) leave the newest keep_last
   folders, no temporary folder, and `latest` naming the newest;
3. a failed background write is raised by result() on every rank, and an error not collected on
   one rank is raised on every rank at the next save_async, which saves nothing;
4. a failure at the call on one rank only (rank 0's side file, rank 1's memory check) is raised on
   every rank, naming that rank, with nothing written and no collective left pending;
5. a failure after the publish (the rotation) says on every rank that the checkpoint is saved.
Prints "ok RANK" at the end; any failure exits non-zero with a traceback.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import torchplace
from torchplace.checkpoint import latest


def _model(seed: int, width: int = 32) -> tuple[nn.Module, torch.optim.Optimizer]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))

    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, width), nn.ReLU(), nn.Linear(width, 4))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _step(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    opt.zero_grad()
    model(torch.randn(6, 16)).sum().backward()
    opt.step()


def _full(model: nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every parameter and Adam moment, whole (a collective)."""
    out = [p.full_tensor().clone() for p in model.parameters()]
    out += [opt.state[p]["exp_avg"].full_tensor().clone() for p in model.parameters()]
    return out


def state_at_the_call(rank: int, root: Path) -> None:
    model, opt = _model(0)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    _step(model, opt)
    sched.step()
    before = _full(model, opt)
    target = root / "step-1"
    pending = torchplace.save_async(target, model=model, optimizer=opt, scheduler=sched, extra={"step": 1})
    with torch.no_grad():  # training goes on at once: parameters, moments and the schedule change
        for p in model.parameters():
            p.mul_(-3.0)
    _step(model, opt)
    sched.step()
    assert pending.written_here and pending.result(timeout=120) == target and pending.done()
    assert target.is_symlink() and (target / ".metadata").is_file()
    other, other_opt = _model(5)
    other_sched = torch.optim.lr_scheduler.StepLR(other_opt, step_size=1, gamma=0.5)
    ck = torchplace.load(target, model=other, optimizer=other_opt, scheduler=other_sched)
    assert ck.extra == {"step": 1}, ck.extra
    assert other_sched.state_dict()["last_epoch"] == 1 and other_opt.param_groups[0]["lr"] == 5e-3
    for k, (a, b) in enumerate(zip(before, _full(other, other_opt))):
        assert torch.equal(a, b), f"tensor {k} is not the state at the call"
    dist.barrier()


def rotation(rank: int, root: Path) -> None:
    model, opt = _model(1)
    futures = []
    for step in range(4):
        _step(model, opt)
        futures.append(torchplace.save_async(root / f"step-{step}", model=model, optimizer=opt, extra={"step": step},
                                             keep_last=2, max_in_flight=2))
    assert [f.result(timeout=120).name for f in futures] == [f"step-{i}" for i in range(4)]
    dist.barrier()
    visible = sorted(p.name for p in root.iterdir() if not p.name.startswith("."))
    assert visible == ["latest", "step-2", "step-3"], visible
    hidden = sorted(p.name for p in root.iterdir() if p.name.startswith("."))
    assert len(hidden) == 2 and all(".dcp-" in h for h in hidden), hidden  # the two kept folders' shards
    assert latest(root) == root / "step-3"
    assert torchplace.load(root, model=_model(2)[0]).extra == {"step": 3}
    dist.barrier()


def failures(rank: int, root: Path) -> None:
    model, opt = _model(3)
    (root / "a-file").write_text("not a directory")  # every rank: written before the barrier below
    dist.barrier()
    broken = torchplace.save_async(root / "a-file" / "c", model=model, optimizer=opt)
    try:
        broken.result(timeout=120)
    except torchplace.CheckpointError as exc:  # DCP's failure, one line per rank
        assert "rank 1: NotADirectoryError" in str(exc) and "Traceback" not in str(exc), str(exc)
    else:
        raise AssertionError("a failed sharded background write reported success")
    broken = torchplace.save_async(root / "a-file" / "c", model=model, optimizer=opt)
    if rank == 0:  # collected on rank 0 only: rank 1's uncollected error still stops the next save
        assert broken.exception(timeout=120) is not None
    from dist_worker import next_save_refused  # this folder is on sys.path when run as a script

    next_save_refused(broken, root / "next", "rank 1's earlier background save failed" if rank == 0
                      else "never collected", model=model, optimizer=opt)
    torchplace.save_async(root / "next", model=model, optimizer=opt).result(timeout=120)  # raised once
    dist.barrier()
    leftovers = [p.name for p in root.iterdir() if p.name.startswith(".") and "a-file" in p.name]
    assert not leftovers, leftovers


def one_rank_fails_at_the_call(rank: int, root: Path) -> None:
    from torchplace.checkpoint import staging

    model, opt = _model(4, width=256)  # larger than the host copies kept from the saves above
    free = staging.available_memory
    if rank == 1:  # rank 1's host has no memory for a copy of these shards: its memory check alone fails
        staging.available_memory = lambda: 0
    try:
        torchplace.save_async(root / "b", model=model, optimizer=opt)
    except torchplace.CheckpointError as exc:
        assert "rank 1: CheckpointError" in str(exc) and "host memory" in str(exc), str(exc)
    else:
        raise AssertionError("rank 1's failure at the call was not raised on every rank")
    finally:
        staging.available_memory = free
    try:  # rank 0 alone plans the side file: an object without allow_pickle fails there only
        torchplace.save_async(root / "a", model=model, optimizer=opt, extra={"o": object()})
    except torchplace.CheckpointError as exc:
        assert "saved nothing on any rank" in str(exc) and "rank 0: " in str(exc), str(exc)
        assert "rank 1: " not in str(exc), str(exc)
    else:
        raise AssertionError("rank 0's failure at the call was not raised on every rank")
    total = torch.ones(1)  # the next collective pairs with its own: nothing is left pending
    dist.all_reduce(total)
    assert total.item() == 2.0
    assert torchplace.save_async(root / "c", model=model, optimizer=opt).result(timeout=120) == root / "c"
    dist.barrier()
    names = sorted(p.name for p in root.iterdir())
    assert len(names) == 2 and names[0].startswith(".c.dcp-") and names[1] == "c", names  # nothing half-written


def rotation_fails_after_the_publish(rank: int, root: Path) -> None:
    from torchplace.checkpoint import background

    def rotate(target: Path, keep_last: int | None) -> list[Path]:
        raise OSError(f"the disk holding {target.parent} went read-only")

    model, opt = _model(6)
    real = background.rotate
    if rank == 0:
        background.rotate = rotate
    try:
        error = torchplace.save_async(root / "s", model=model, optimizer=opt, keep_last=2).exception(timeout=120)
    finally:
        background.rotate = real
    assert error is not None and "was saved" in str(error) and "went read-only" in str(error), str(error)
    assert "no rank has a new checkpoint" not in str(error), str(error)
    dist.barrier()
    assert (root / "s").is_symlink()
    torchplace.load(root / "s", model=_model(7)[0])  # the published checkpoint is whole


if __name__ == "__main__":
    from dist_worker import run_checks  # this folder is on sys.path when run as a script

    run_checks((("call", state_at_the_call), ("rotation", rotation), ("failures", failures),
                ("one_rank", one_rank_fails_at_the_call), ("after_publish", rotation_fails_after_the_publish)))
