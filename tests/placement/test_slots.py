"""packed_collate's slots: real DataLoader worker processes pack into shared slots they reuse, and a
slot is written again only once the training process is done with the batch in it."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import warnings
from collections import namedtuple
from pathlib import Path

import pytest
import torch
from placement.test_collate import RecsysBatches, _recsys_batch, _sample, assert_same
from torch.utils.data import DataLoader, Dataset, default_collate, default_convert

import torchplace as tp
from torchplace.errors import PackingError, PackingWarning
from torchplace.placement import PackedBatch, _build, _slots, collate, pack, packed_collate
from torchplace.placement import loader as loader_module


class Numbered(Dataset):
    """Batch i holds i everywhere, so a batch overwritten by a later one is seen at once."""

    def __init__(self, n: int = 24) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        return {"a": torch.full((64, 8), float(i)), "b": torch.full((5,), i, dtype=torch.int64),
                "c": [torch.full((3, 3), i, dtype=torch.int16)], "i": i}


def _check(batch, i: int) -> None:
    assert batch["i"] == i
    assert bool((batch["a"] == i).all()) and bool((batch["b"] == i).all()) and bool((batch["c"][0] == i).all())


def _rings(collate_fn) -> list[_slots.HostRing]:
    return [_slots._rings[r] for r in _slots._owned.get(collate_fn.token, ())]


def test_workers_reuse_their_slots_and_batches_come_back_bit_for_bit():
    fn = packed_collate(default_convert, slots=3)
    loader = DataLoader(Numbered(), batch_size=None, num_workers=2, collate_fn=fn)
    with warnings.catch_warnings():
        warnings.simplefilter("error", PackingWarning)  # no fallback: every batch found a free slot
        for i, raw in enumerate(loader):
            assert isinstance(raw, PackedBatch) and raw.lease is not None
            _check(raw.unpack(), i)
            del raw
    rings = _rings(fn)
    assert len(rings) == 2  # one per worker
    for ring in rings:  # 12 batches each, through at most 3 slots, each made once (same size)
        assert 1 <= len(ring.storages) <= 3 and all(v == 1 for v, _ in ring.storages.values())
        assert list(ring._flags) == [0, 0, 0]  # every slot free again


def test_a_batch_kept_keeps_its_slot_and_the_worker_falls_back_once_with_one_message():
    fn = packed_collate(default_convert, slots=2)
    fn.wait_s = 0.05
    collate._warned.clear()
    loader = DataLoader(Numbered(16), batch_size=None, num_workers=2, collate_fn=fn)
    kept = list(loader)  # nothing is let go: slots run out, later batches use fresh buffers
    assert sum(b.lease is not None for b in kept) == 4  # 2 workers x 2 slots
    with pytest.warns(PackingWarning, match="found none of its 2 slots free") as said:
        for i, raw in enumerate(kept):
            _check(raw.unpack(), i)  # none of the kept ones was written over
    assert len([w for w in said if "slots free" in str(w.message)]) == 1


def test_views_outlive_their_packed_batch_and_keep_the_slot():
    fn = packed_collate(default_convert, slots=2)
    fn.wait_s = 0.05
    loader = DataLoader(Numbered(12), batch_size=None, num_workers=1, collate_fn=fn)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PackingWarning)
        unpacked = [raw.unpack() for raw in loader]  # each PackedBatch is dropped, its views kept
    for i, batch in enumerate(unpacked):
        _check(batch, i)
    del unpacked
    gc.collect()
    assert list(_rings(fn)[0]._flags) == [0, 0]


@pytest.mark.parametrize("persistent", [True, False], ids=["persistent", "restarted_each_epoch"])
def test_epochs_with_persistent_or_restarted_workers(persistent):
    fn = packed_collate(default_convert)
    loader = DataLoader(Numbered(10), batch_size=None, num_workers=2, collate_fn=fn, persistent_workers=persistent)
    seen = set()
    for _ in range(3):
        for i, batch in enumerate(tp.DeviceLoader(loader, "cpu", background=True)):
            _check(batch, i)
        seen |= {r.id for r in _rings(fn)}
    assert len(_rings(fn)) == 2  # the rings of the running workers
    assert len(seen) == (2 if persistent else 6)  # restarted workers made new rings, which replaced the old


def test_two_iterators_of_one_loader_at_once_each_keep_their_workers_slots():
    fn = packed_collate(default_convert, slots=2)
    loader = DataLoader(Numbered(8), batch_size=None, num_workers=2, collate_fn=fn)
    first, second = iter(loader), iter(loader)  # four workers, two with each worker id
    for i in range(8):
        _check(next(first).unpack(), i)
        _check(next(second).unpack(), i)
    assert len(_rings(fn)) == 4


def test_slots_grow_for_larger_batches_and_variable_lengths_stay_exact():
    fn = packed_collate(default_convert, slots=2)
    loader = DataLoader(RecsysBatches(), batch_size=None, num_workers=1, collate_fn=fn)
    for i, batch in enumerate(tp.DeviceLoader(loader, "cpu")):
        assert_same(_recsys_batch(i), batch)
    ring = _rings(fn)[0]
    assert max(v for v, _ in ring.storages.values()) >= 1
    assert all(s.nbytes() % (64 << 10) == 0 for _, s in ring.storages.values())


_SPAWNED = """
import torch
from torch.utils.data import DataLoader, default_convert
import torchplace as tp
from torchplace.placement import _slots
from placement.test_slots import Numbered, _check

if __name__ == "__main__":
    fn = tp.packed_collate(default_convert)
    loader = DataLoader(Numbered(6), batch_size=None, num_workers=2, collate_fn=fn, multiprocessing_context="spawn")
    for i, batch in enumerate(tp.DeviceLoader(loader, "cpu")):
        _check(batch, i)
    print(len(_slots._owned[fn.token]), "rings")
"""


def test_spawned_workers_use_slots_too(tmp_path):
    # in a process of its own: spawn starts multiprocessing's resource tracker, which outlives the test
    script = tmp_path / "spawned.py"
    script.write_text(_SPAWNED)
    tests = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tests), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "2 rings"


def test_no_slots_outside_workers_or_with_slots_0():
    assert pack(default_collate([_sample(i) for i in range(2)])).lease is None  # packed in this process
    fn = packed_collate(default_convert, slots=0)
    loader = DataLoader(Numbered(4), batch_size=None, num_workers=1, collate_fn=fn)
    raw = next(iter(loader))
    assert raw.lease is None and raw.buffer.is_shared()
    with pytest.raises(ValueError, match="slots"):
        packed_collate(slots=-1)


def test_device_loader_gives_slots_for_a_deep_prefetch():
    fn = packed_collate(default_convert)
    loader = DataLoader(Numbered(8), batch_size=None, num_workers=1, collate_fn=fn, prefetch_factor=6)
    for i, batch in enumerate(tp.DeviceLoader(loader, "cpu", prefetch=3)):
        _check(batch, i)
    assert fn.slots == 6 + 3 + 2
    timed = packed_collate(default_convert)
    # set as an epoch starts, before the workers do; not iterated: a 2 s DataLoader timeout would time the machine
    loader_module._fit_slots(DataLoader(Numbered(2), batch_size=None, num_workers=1, collate_fn=timed, timeout=2), 2)
    assert timed.wait_s == 0.5  # a quarter of the DataLoader's timeout
    assert packed_collate(slots=4).auto_slots is False


def test_pinning_in_place_is_refused_cleanly_without_cuda():
    if torch.cuda.is_available():
        pytest.skip("CUDA is here: tests/placement/test_slots_gpu.py pins for real")
    collate._warned.clear()
    loader = DataLoader(Numbered(4), batch_size=None, num_workers=1, collate_fn=packed_collate(default_convert))
    raw = next(iter(loader))
    with pytest.warns(PackingWarning, match=r"could not page-lock .*no CUDA device here.* copies each batch"):
        assert collate.pin_slot(raw.lease) is False
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once
        assert collate.pin_slot(raw.lease) is False
    _check(raw.unpack(), 0)


Pair = namedtuple("Pair", "x y")


def test_the_cached_rebuild_equals_the_walk_and_reads_each_batchs_own_values():
    batches = [{"ids": torch.arange(i, i + 3), "pair": (torch.ones(2) * i,), "step": i, "tags": ["a", i],
                "deep": [{"m": torch.tensor(i % 2 == 0), "v": torch.zeros(i + 1)}], "big": torch.ones(70_000)}
               for i in range(3)]
    for i, b in enumerate(batches):
        raw = pack(b)
        assert raw.key is not None and raw.loose  # "big" stays in the skeleton
        built = raw.unpack()
        assert built["step"] == i and built["tags"] is raw.skeleton["tags"]  # values: the batch's own objects
        assert_same(b, built)
        raw.key = None
        assert_same(built, raw.unpack())  # the walk gives the same batch
    assert len({pack(b).key for b in batches}) == 3  # variable lengths: other layouts, other names
    assert pack({"a": torch.ones(2), "b": torch.ones(2)}).loose is False
    one, true = pack({1: torch.ones(2), "b": torch.ones(2)}), pack({True: torch.ones(2), "b": torch.ones(2)})
    assert one.key != true.key and list(true.unpack()) == [True, "b"] and type(list(one.unpack())[0]) is int
    odd = pack({"p": Pair(torch.ones(2), torch.zeros(2))})  # a namedtuple: walked, as before
    assert odd.key is None and type(odd.unpack()["p"]) is Pair


def test_a_builder_is_made_once_per_structure():
    b = default_collate([_sample(i) for i in range(3)])
    first, second = pack(b), pack(default_collate([_sample(i) for i in range(3, 6)]))
    assert first.key == second.key
    assert _build.builder(first.key, first.skeleton, first.slot, first.layout) is _build._builders[first.key]


def test_rebuilt_views_work_with_autograd_and_in_place_ops_like_collated_tensors():
    raw = pack({"x": torch.randn(4, 3), "y": torch.randn(4, 3), "n": torch.arange(4)})
    batch = raw.unpack()
    layer = torch.nn.Linear(3, 2)
    layer(batch["x"]).sum().backward()  # saved for backward, as any input
    assert layer.weight.grad is not None
    batch["y"].mul_(2)  # an in-place op on one tensor leaves the others alone
    assert torch.equal(batch["x"], raw.unpack()["x"])
    leaf = batch["n"].float().requires_grad_()
    (leaf * 2).sum().backward()
    assert torch.equal(leaf.grad, torch.full((4,), 2.0))


def test_a_slot_batch_in_a_process_that_never_received_its_slot_says_what_to_do():
    import pickle

    fn = packed_collate(default_convert)
    it = iter(DataLoader(Numbered(4), batch_size=None, num_workers=1, collate_fn=fn))
    first, second = next(it), next(it)
    ref = second.lease.ring.id
    stray = _slots.SlotRef("123.abc", fn.token, 0, 0, 1, 64, None, None)
    with pytest.raises(PackingError, match="has not received"):
        _slots.receive(stray)
    with pytest.raises(PackingError, match="has no version"):
        _slots.receive(stray._replace(ring=ref, slot=5))
    assert pickle.loads(pickle.dumps(first)).unpack()["i"] == 0  # a batch held here travels with its bytes


@pytest.mark.parametrize("how", ["deepcopy", "copy", "pickle"])
def test_a_copy_of_the_collate_collected_in_the_training_process_leaves_the_loaders_rings(how):
    import copy
    import pickle

    fn = packed_collate(default_convert, slots=2)
    it = iter(DataLoader(Numbered(4), batch_size=None, num_workers=1, collate_fn=fn))
    _check(next(it).unpack(), 0)
    twin = {"deepcopy": copy.deepcopy, "copy": copy.copy, "pickle": lambda f: pickle.loads(pickle.dumps(f))}[how](fn)
    assert twin.token != fn.token  # its own name: forgetting it forgets nothing of fn's
    del twin
    gc.collect()
    for i in range(1, 4):  # before: PackingError "... has not received", the worker's ring forgotten
        _check(next(it).unpack(), i)
    assert len(_rings(fn)) == 1


class _Pending:
    """An event stand-in for a copy still in flight (CPU has no stream to record one on)."""

    def __init__(self) -> None:
        self.waited = False

    def query(self) -> bool:
        return self.waited

    def synchronize(self) -> None:
        self.waited = True


def test_the_oldest_held_buffer_is_dropped_outside_the_lock():
    import weakref

    _slots.settle()
    locked = []
    first = torch.zeros(4)
    weakref.finalize(first, lambda: locked.append(_slots._held_lock.locked()))  # as a slot's SlotHold.__del__ would run
    _slots.hold_until(_Pending(), first)
    del first
    for _ in range(_slots._HOLD_MAX):  # one more than are kept: the oldest is waited for and let go
        _slots.hold_until(_Pending(), torch.zeros(4))
    assert locked == [False]  # before: dropped while holding the lock its last reference may need
    _slots.settle()
    assert not _slots._held


def test_a_loaders_epoch_end_waits_only_for_its_own_copies():
    import threading

    _slots.settle()
    train, evaluate = _Pending(), _Pending()
    evaluating = threading.Thread(target=_slots.hold_until, args=(evaluate, torch.zeros(4)))
    evaluating.start()  # another DeviceLoader's worker thread: its copy is in flight
    evaluating.join()
    _slots.hold_until(train, torch.zeros(4))
    _slots.settle()  # this thread's epoch ended
    assert train.waited and not evaluate.waited  # before: it waited for the other loader's copy too
    assert len(_slots._held) == 1
    _slots.hold_until(_Pending(), torch.zeros(4), owner="eval")  # an explicit owner: settled by name
    _slots.settle("eval")
    assert len(_slots._held) == 1
    _slots.reap()
    assert len(_slots._held) == 1  # still in flight
    evaluate.synchronize()
    _slots.reap()
    assert not _slots._held
