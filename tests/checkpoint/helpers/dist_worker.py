"""One rank of the 2-process gloo checkpoint test. Usage: dist_worker.py RANK WORLD DIR

MASTER_ADDR / MASTER_PORT come from the environment. Checks, in order:
1. replicated (DDP), all_ranks=True: only rank 0 writes; no rank returns before the file is complete;
   each rank gets its own RNG streams back;
2. a failure on rank 0 is raised on every rank (all_ranks=True);
2b. rank-0 saves (`if rank == 0: save(...)`, as every DDP program does): rank 0 writes alone while
   rank 1 trains on; a sharded save or save(all_ranks=True) on rank 0 alone raises naming rank 1; a save on
   every rank (imagenet's) returns on rank 1 once rank 0's file is there, and one of rank 1's own is refused;
3. a sharded (DTensor) model goes through torch.distributed.checkpoint and comes back, with its
   optimizer, scheduler and extras, into a model sharded the same way;
4. save_async: rank 0 writes the state at the call, rank 1's future ends with rank 0's write, a failure of
   rank 0's background write is raised on every rank at the next save_async (sharded models:
   async_sharded_worker.py).
Prints "ok RANK" at the end; any failure exits non-zero with a traceback.
"""

from __future__ import annotations

import os
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

import torch
import torch.distributed as dist
from torch import nn

import torchplace
from torchplace.checkpoint import inspect, latest


def replicated(rank: int, root: Path) -> None:
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.5), nn.Linear(8, 2)))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    model(torch.randn(6, 4)).sum().backward()
    opt.step()
    torch.manual_seed(100 + rank)  # every rank has its own stream
    path = root / "ddp.safetensors"
    returned = torchplace.save(path, model=model, optimizer=opt, extra={"written_by": rank}, all_ranks=True)
    assert returned == path and path.exists(), "save returned before the file was complete"
    expected = torch.rand(3)  # what this rank draws right after the save
    names = sorted(p.name for p in root.iterdir())
    assert names == ["ddp.safetensors"], names  # no temp files, nothing written by rank 1
    torch.manual_seed(7)
    other = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.5), nn.Linear(8, 2)))
    other_opt = torch.optim.Adam(other.parameters(), lr=1.0)
    ck = torchplace.load(path, model=other, optimizer=other_opt)
    assert ck.extra == {"written_by": 0} and ck.metadata["world_size"] == 2
    assert ck.stripped_prefix == "" and ck.rng_restored == ["python", "numpy", "cpu"]
    assert torch.equal(torch.rand(3), expected), "this rank's RNG stream was not restored"
    for a, b in zip(model.state_dict().values(), other.state_dict().values()):
        assert torch.equal(a, b)
    dist.barrier()


def failure(rank: int, root: Path) -> None:
    try:
        torchplace.save(root / "missing-dir" / "c.safetensors", extra={"a": 1}, all_ranks=True)
    except torchplace.CheckpointError as exc:
        expected = "does not exist" if rank == 0 else "rank 0 could not save"
        assert expected in str(exc), str(exc)
    else:
        raise AssertionError("a failed save reported success")


T = TypeVar("T")


def rank0_saves(rank: int, root: Path) -> None:
    """`if rank == 0: save(...)` hung for ever (issue 32, item 1): rank 0 now writes alone."""
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.5), nn.Linear(8, 2)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    path = root / "best.safetensors"
    torch.manual_seed(100 + rank)
    for step in range(3):
        opt.zero_grad()
        model(torch.randn(4, 4)).sum().backward()  # an all-reduce per step: the ranks stay in step
        opt.step()
        if rank == 0 and step == 1:  # nanoGPT: only rank 0 knows the validation loss is the best
            assert torchplace.save(path, model=model, optimizer=opt, extra={"iter_num": step}) == path
            assert path.exists()
    weights = [p.detach().clone() for p in model.parameters()]
    if rank == 1:  # a file of its own, which rank 0 never writes: warned within TORCHPLACE_SAVE_JOIN_S, not silent,
        with warnings.catch_warnings(record=True) as said:  # and training goes on (a crash would lose the run)
            warnings.simplefilter("always")
            assert short_wait(lambda: torchplace.save(root / "not-written.safetensors", model=model)) == \
                root / "not-written.safetensors"
        told = [str(w.message) for w in said if issubclass(w.category, torchplace.TorchplaceWarning)]
        assert told and "rank 0 has not saved this path within 3 s" in told[0] and "Fix:" in told[0], told
    dist.barrier()
    assert not (root / "not-written.safetensors").exists()
    before = torch.get_rng_state()
    ck = torchplace.load(path, model=model, optimizer=opt)
    assert ck.extra == {"iter_num": 1} and ck.metadata["rng_rank"] == 0
    if rank == 0:
        assert ck.rng_restored == ["python", "numpy", "cpu"]
    else:
        assert not ck.rng_restored and "rank 0's generators only" in ck.rng_skipped["cpu"]
        assert torch.equal(torch.get_rng_state(), before)  # rank 1's own streams left alone
    assert not all(torch.equal(a, b) for a, b in zip(weights, model.parameters()))  # the step-1 weights came back

    from torch.distributed.device_mesh import init_device_mesh

    sharded_model = _sharded_model(0, init_device_mesh("cpu", (dist.get_world_size(),)))
    if rank == 0:
        refused_on_rank0_alone(lambda: torchplace.save(root / "sharded", model=sharded_model))
        refused_on_rank0_alone(lambda: torchplace.save(root / "all.safetensors", model=model, all_ranks=True))
        assert sorted(p.name for p in root.iterdir()) == ["best.safetensors"]
    every_rank_saves(rank, root, model)
    dist.barrier()
    torchplace.save(root / "sharded", model=sharded_model)  # every rank: the save after the refusal works
    assert (root / "sharded" / ".metadata").is_file()


def every_rank_saves(rank: int, root: Path, model: nn.Module) -> None:
    """imagenet's save_checkpoint runs on every rank under torchrun: `tp.save(state, 'checkpoint.pth.tar')`, then
    `shutil.copyfile` to model_best.pth.tar. Rank 1's save returned at once, and its copy found no file (or the
    previous epoch's): every rank's call now returns once rank 0's file is there."""
    import shutil

    root = root / "every"
    if rank == 0:
        root.mkdir()
    dist.barrier()
    path = root / "checkpoint.pth.tar"
    for epoch in range(2):
        if rank == 0:
            time.sleep(0.5)  # rank 0 is the slower one
        torchplace.save({"epoch": epoch + 1, "state_dict": model.state_dict()}, path)
        if rank == 1:
            shutil.copyfile(path, root / "model_best.pth.tar")
            assert torch.load(root / "model_best.pth.tar")["epoch"] == epoch + 1
        dist.barrier()
    try:  # rank 0's failure is rank 1's too
        torchplace.save({"epoch": 3}, root / "missing-dir" / "checkpoint.pth.tar")
    except torchplace.CheckpointError as exc:
        assert rank == 0 or "rank 0 could not save" in str(exc), str(exc)
    else:
        raise AssertionError(f"rank {rank}: a save rank 0 could not write returned as written")


def short_wait(call: Callable[[], T]) -> T:
    """CALL with TORCHPLACE_SAVE_JOIN_S at 3 s: a call whose wait for another rank is meant to run out (that rank
    never comes), so it ends in seconds; every other wait in these workers keeps the run's 120 s."""
    before = os.environ.get("TORCHPLACE_SAVE_JOIN_S")
    os.environ["TORCHPLACE_SAVE_JOIN_S"] = "3"
    try:
        return call()
    finally:
        if before is None:
            del os.environ["TORCHPLACE_SAVE_JOIN_S"]
        else:
            os.environ["TORCHPLACE_SAVE_JOIN_S"] = before


def refused_on_rank0_alone(call: Callable[[], object]) -> None:
    """CALL, a save that needs every rank, made on rank 0 only: refused naming rank 1 and the fix."""
    try:
        short_wait(call)
    except torchplace.CheckpointError as exc:
        assert "called on rank 0 only" in str(exc) and "rank(s) 1" in str(exc), str(exc)
        assert "Fix: call it on every rank" in str(exc), str(exc)
    else:
        raise AssertionError("a save that needs every rank, called on rank 0 only, did not raise")


def _sharded_model(seed: int, mesh) -> nn.Module:
    from torch.distributed.tensor import Shard, distribute_tensor

    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    for module in model:
        for name, param in list(module.named_parameters(recurse=False)):
            setattr(module, name, nn.Parameter(distribute_tensor(param.detach(), mesh, [Shard(0)])))
    return model


def sharded(rank: int, root: Path) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = _sharded_model(0, mesh)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for _ in range(2):
        opt.zero_grad()
        model(distribute_tensor(torch.randn(5, 4), mesh, [Replicate()])).sum().backward()
        opt.step()
        sched.step()
    target = root / "sharded"
    for step in (1, 2):  # the second save replaces the first atomically
        torchplace.save(target, model=model, optimizer=opt, scheduler=sched, extra={"step": step}, keep_last=1)
    assert target.is_symlink() and (target / ".metadata").is_file()
    hidden = [p.name for p in root.iterdir() if p.name.startswith(".sharded.")]
    assert len(hidden) == 1, hidden  # the first version's shards are gone

    other = _sharded_model(5, mesh)
    other_opt = torch.optim.Adam(other.parameters(), lr=1.0)
    other_sched = torch.optim.lr_scheduler.StepLR(other_opt, step_size=1, gamma=0.5)
    ck = torchplace.load(root if rank == 0 else target, model=other, optimizer=other_opt, scheduler=other_sched)
    assert ck.extra == {"step": 2}, ck.extra
    for a, b in zip(model.parameters(), other.parameters()):
        assert torch.equal(a.full_tensor(), b.full_tensor())
    s1, s2 = opt.state_dict()["state"], other_opt.state_dict()["state"]
    for pid in s1:
        assert torch.equal(s1[pid]["exp_avg"].full_tensor(), s2[pid]["exp_avg"].full_tensor())
        assert float(s1[pid]["step"]) == float(s2[pid]["step"]) == 2.0
    assert other_sched.state_dict() == sched.state_dict() and other_opt.param_groups[0]["lr"] == 2.5e-3
    if rank == 0:
        assert latest(root) == target
        info = inspect(target)
        assert info.tool.startswith("torch.distributed.checkpoint") and info.metadata["sharded"] is True
        assert {t.key for t in info.tensors} >= {"model/0.weight", "optimizer/state/0.weight/exp_avg"}
    dist.barrier()


def background(rank: int, root: Path) -> None:
    model = nn.parallel.DistributedDataParallel(nn.Linear(4, 3))
    path = root / "async.safetensors"
    if rank == 0:
        time.sleep(0.5)  # rank 0 is the slower one
    pending = torchplace.save_async(path, model=model, extra={"rank": rank})
    with torch.no_grad():
        model.module.weight.add_(1.0)  # after the call: not in the file
    assert pending.written_here == (rank == 0)
    assert pending.result(timeout=120) == path  # rank 1's future ends with rank 0's write: the file is there
    assert torchplace.load(path).extra == {"rank": 0}
    dist.barrier()
    ck = torchplace.load(path)
    assert ck.extra == {"rank": 0} and torch.equal(ck["model"]["weight"] + 1.0, model.module.weight.detach())
    if rank == 0:  # `if rank == 0: save_async(...)` (issue 32): rank 0 alone copies and writes, nothing hangs
        alone = torchplace.save_async(root / "alone.safetensors", model=model, extra={"step": 7})
        assert alone.result(timeout=120) == root / "alone.safetensors"
        refused_on_rank0_alone(lambda: torchplace.save_async(root / "all.safetensors", model=model, all_ranks=True))
        assert not (root / "all.safetensors").exists()
    dist.barrier()
    ck = torchplace.load(root / "alone.safetensors")
    assert ck.extra == {"step": 7} and ck.metadata["rng_rank"] == 0
    # all_ranks=True: every rank learns of rank 0's failed write at its next save_async
    broken = torchplace.save_async(root / "missing-dir" / "c.safetensors", model=model, all_ranks=True)
    next_save_refused(broken, root / "next.safetensors",
                      "does not exist" if rank == 0 else "rank 0's earlier background save failed", model=model,
                      all_ranks=True)
    dist.barrier()


def next_save_refused(broken, path: Path, expected: str, **state) -> None:
    """Once the failed save BROKEN is done (its error not collected here), the next save_async of STATE
    to PATH raises a CheckpointError containing EXPECTED and writes nothing."""
    while not broken.done():
        time.sleep(0.01)
    try:
        torchplace.save_async(path, **state)
    except torchplace.CheckpointError as exc:
        assert expected in str(exc), str(exc)
    else:
        raise AssertionError("an uncollected background failure was not raised at the next save_async")
    assert not path.exists()


Check = Callable[[int, Path], None]


def run_checks(checks: Sequence[tuple[str, Check]]) -> None:
    """Join the gloo group named by argv (RANK WORLD DIR), run each check in a fresh folder of DIR
    between barriers, print "ok RANK" and exit as any program does (interpreter shutdown included)."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    rank, world, root = int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        for name, check in checks:
            directory = root / name
            if rank == 0:
                directory.mkdir()
            dist.barrier()
            check(rank, directory)
            dist.barrier()
    finally:
        dist.destroy_process_group()
    print(f"ok {rank}", flush=True)


if __name__ == "__main__":
    run_checks((("replicated", replicated), ("failure", failure), ("rank0", rank0_saves), ("sharded", sharded),
                ("background", background)))
