"""save_async on the CPU: the file holds the state at the call, buffers are reused, errors reach the caller."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from torch import nn

import torchplace
from torchplace.checkpoint.staging import SLAB_BYTES, HostStaging, memory_problem


def _trained() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(8, 64)).sum().backward()
    opt.step()
    return model, opt


def _wait_done(fut: torchplace.SaveFuture) -> None:
    """Wait for FUT to end without collecting its error."""
    deadline = time.monotonic() + 120
    while not fut.done():
        assert time.monotonic() < deadline, "the background save never ended"
        time.sleep(0.005)


def test_the_file_holds_the_state_at_the_call(tmp_path: Path) -> None:
    model, opt = _trained()
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    exp_avg = opt.state_dict()["state"][0]["exp_avg"].clone()
    losses = [1.0, 0.5]
    pending = torchplace.save_async(tmp_path / "c.safetensors", model=model, optimizer=opt,
                                    extra={"losses": losses}, rng_state=False)
    with torch.no_grad():  # training goes on at once: every tensor and the extras change
        for p in model.parameters():
            p.mul_(-3.0)
    model(torch.randn(8, 64)).sum().backward()
    opt.step()
    losses.append(0.25)
    assert pending.result(timeout=120) == tmp_path / "c.safetensors" and pending.done()
    ck = torchplace.load(tmp_path / "c.safetensors")
    assert ck.extra == {"losses": [1.0, 0.5]}
    for key, value in weights.items():
        assert torch.equal(ck["model"][key], value), key
    assert torch.equal(ck["optimizer"]["state"][0]["exp_avg"], exp_avg)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.safetensors"]  # no temporary file left


def test_it_loads_into_objects_like_save(tmp_path: Path) -> None:
    model, opt = _trained()
    torchplace.save_async(tmp_path / "a", model=model, optimizer=opt, extra={"step": 3}).result(timeout=120)
    torchplace.save(tmp_path / "b", model=model, optimizer=opt, extra={"step": 3})
    other, other_opt = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4)), None
    other_opt = torch.optim.AdamW(other.parameters(), lr=1.0)
    ck = torchplace.load(tmp_path / "a", model=other, optimizer=other_opt)
    assert ck.extra == {"step": 3} and ck.rng_restored == ["python", "numpy", "cpu"]
    a, b = torchplace.checkpoint.inspect(tmp_path / "a"), torchplace.checkpoint.inspect(tmp_path / "b")
    assert [(t.key, t.dtype, t.shape) for t in a.tensors] == [(t.key, t.dtype, t.shape) for t in b.tensors]
    for x, y in zip(model.state_dict().values(), other.state_dict().values()):
        assert torch.equal(x, y)


def test_staging_buffers_are_reused_and_grow_only_with_the_state(tmp_path: Path) -> None:
    mib = 2**20
    small, large = {"w": torch.ones(24 * mib // 4)}, {"w": torch.ones(24 * mib // 4), "v": torch.ones(16 * mib // 4)}
    first = torchplace.save_async(tmp_path / "1", model=small, rng_state=False)
    first.result(timeout=120)
    second = torchplace.save_async(tmp_path / "2", model=small, rng_state=False)
    second.result(timeout=120)
    assert second.allocated_bytes == 0  # the first save's buffer, reused
    bigger = torchplace.save_async(tmp_path / "3", model=large, rng_state=False)
    bigger.result(timeout=120)
    assert bigger.allocated_bytes == 40 * mib  # the state grew: a buffer for all of it (the old one goes)
    again = torchplace.save_async(tmp_path / "4", model=small, rng_state=False)
    again.result(timeout=120)
    assert again.allocated_bytes == 0
    assert torch.equal(torchplace.load(tmp_path / "4")["model"]["w"], small["w"])


def test_large_states_grow_by_whole_slabs_and_keep_the_slabs_they_have() -> None:
    staging = HostStaging()
    assert staging.need(3 * 2**20 + 1, pinned=False) == 4 * 2**20  # small: one buffer, whole MiB
    staging.ensure(3 * 2**20 + 1, pinned=False)
    first = staging.slabs[0].data_ptr()
    staging.ensure(2**20, pinned=False)
    assert staging.slabs[0].data_ptr() == first  # smaller states reuse it
    assert staging.need(SLAB_BYTES + 1, pinned=False) == 2 * SLAB_BYTES  # large: whole slabs, the small one goes


def test_the_copy_joins_small_tensors_and_puts_every_byte_in_its_place(monkeypatch: pytest.MonkeyPatch) -> None:
    from torchplace.checkpoint import staging as staging_module
    from torchplace.checkpoint.fileio import plan_file
    from torchplace.checkpoint.format import SMALL_TENSOR_BYTES

    monkeypatch.setattr(staging_module, "JOIN_BYTES", 600)  # runs of small tensors split into several pieces
    g = torch.Generator().manual_seed(0)
    state = {f"bias{i}": torch.randn(20 + i, generator=g) for i in range(12)}
    state.update({"big": torch.randn(SMALL_TENSOR_BYTES // 4 + 3, generator=g), "empty": torch.empty(0, 3),
                  "strided": torch.randn(8, 6, generator=g).t(), "half": torch.randn(33, generator=g).half(),
                  "int": torch.arange(7), "flag": torch.tensor([True, False, True])})
    planned = plan_file({"model": state})
    staging = HostStaging()
    staging.slabs = [torch.zeros(4099, dtype=torch.uint8) for _ in range(-(-planned.data_bytes // 4099))]
    staging.copy_in(planned)  # slabs of an odd size: pieces cross their ends
    region = torch.cat(staging.slabs)
    for e in planned.entries:
        expected = planned.tensors[e.key].reshape(-1).view(torch.uint8)
        assert torch.equal(region[e.start:e.end], expected), e.key


def test_a_failure_while_the_copies_finish_saves_nothing_and_reports_once(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    from torchplace.checkpoint import background

    def failing(self: HostStaging, planned: object) -> object:
        def wait() -> None:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return wait

    monkeypatch.setattr(HostStaging, "start_copy", failing)  # the writer thread is started by then
    with pytest.raises(RuntimeError, match="illegal memory access"):
        torchplace.save_async(tmp_path / "c", model={"w": torch.ones(10)}, rng_state=False)
    monkeypatch.undo()
    saver = background.default_saver()
    deadline = time.monotonic() + 120
    while saver._pending:  # its writer thread ends without writing
        assert time.monotonic() < deadline, "the cancelled save's writer never ended"
        time.sleep(0.005)
    assert not (tmp_path / "c").exists() and saver.uncollected() is None  # raised at the call: not again
    assert torchplace.save_async(tmp_path / "d", model={"w": torch.ones(10)}, rng_state=False).result(timeout=120)


def test_the_shard_stager_is_reused_across_saves_of_a_state_holding_a_class() -> None:
    """torch 2.11's DefaultStager closes its stager after each stage, emptying its copy table, so the
    second stage of a state that holds a class object raised KeyError: <class 'type'> (H200 run,
    2026-12-01; pytorch's own report of it names the same line). The shard stager survives that, keeps
    each tensor's host copy for the next save, and still copies the values of the call."""
    staging = HostStaging()
    w = torch.ones(4)
    w.made_by = {"cls": torch.nn.Linear}  # a class inside a tensor's attributes, as in a DTensor's spec
    state = {"w": w}
    first = staging.dcp_stage(state, pinned=False)
    state["w"].add_(1)
    second = staging.dcp_stage(state, pinned=False)
    assert second["w"].made_by["cls"] is torch.nn.Linear
    assert torch.equal(second["w"], torch.full((4,), 2.0))
    assert second["w"].data_ptr() == first["w"].data_ptr()  # the host copy of the first save, reused
    assert staging.dcp_bytes == 16


def test_the_next_save_waits_for_the_one_in_flight(tmp_path: Path) -> None:
    model, _ = _trained()
    first = torchplace.save_async(tmp_path / "1", model=model)
    second = torchplace.save_async(tmp_path / "2", model=model)  # max_in_flight=1: returns after `first` ended
    assert first.done()
    second.result(timeout=120)


def test_max_in_flight_allows_more_and_writes_in_call_order(tmp_path: Path) -> None:
    model, _ = _trained()
    futures = [torchplace.save_async(tmp_path / f"step-{i}", model=model, extra={"i": i}, keep_last=2,
                                     max_in_flight=3) for i in range(5)]
    assert [f.result(timeout=120).name for f in futures] == [f"step-{i}" for i in range(5)]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-3", "step-4"]
    assert torchplace.load(tmp_path).extra == {"i": 4}


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_bad_max_in_flight_is_refused(tmp_path: Path, bad: object) -> None:
    with pytest.raises(ValueError, match="max_in_flight"):
        torchplace.save_async(tmp_path / "c", extra={"a": 1}, max_in_flight=bad)  # type: ignore[arg-type]


def test_save_checks_apply_at_the_call(tmp_path: Path) -> None:
    with pytest.raises(torchplace.CheckpointError, match="reserved"):
        torchplace.save_async(tmp_path / "latest", extra={"a": 1})
    with pytest.raises(TypeError, match="reserved"):
        torchplace.save_async(tmp_path / "c", rng={"a": 1})
    with pytest.raises(torchplace.CheckpointError, match="meta device"):
        torchplace.save_async(tmp_path / "c", model={"w": torch.empty(3, device="meta")})
    assert list(tmp_path.iterdir()) == []


def test_a_failed_write_is_raised_by_result(tmp_path: Path) -> None:
    pending = torchplace.save_async(tmp_path / "missing" / "c", extra={"a": 1})
    with pytest.raises(torchplace.CheckpointError, match=r"does not exist.*Fix: create it"):
        pending.result(timeout=120)
    assert pending.done()
    torchplace.save_async(tmp_path / "c", extra={"a": 2}).result(timeout=120)  # collected: the next one saves


def test_an_uncollected_failure_is_raised_by_the_next_save(tmp_path: Path) -> None:
    pending = torchplace.save_async(tmp_path / "missing" / "c", extra={"a": 1})
    _wait_done(pending)
    with pytest.raises(torchplace.CheckpointError, match=r"earlier background save failed.*saved nothing.*does not "
                                                         r"exist"):
        torchplace.save_async(tmp_path / "next", extra={"a": 2})
    assert not (tmp_path / "next").exists()
    torchplace.save_async(tmp_path / "next", extra={"a": 2}).result(timeout=120)  # raised once
    assert torchplace.load(tmp_path / "next").extra == {"a": 2}


def test_a_full_disk_during_the_background_write(tiny_tmpfs: Path) -> None:
    old = torchplace.save(tiny_tmpfs / "c", model={"w": torch.full((1000,), 1.0)}, rng_state=False)
    pending = torchplace.save_async(old, model={"w": torch.full((1_000_000,), 2.0)}, rng_state=False)  # 4 MB > 1 MiB
    with pytest.raises(torchplace.CheckpointError, match=r"could not save .*c: the file system .* is full.*ENOSPC"):
        pending.result(timeout=120)
    assert torch.equal(torchplace.load(old)["model"]["w"], torch.full((1000,), 1.0))
    assert [p.name for p in tiny_tmpfs.iterdir()] == ["c"]
    _wait_done(torchplace.save_async(old, model={"w": torch.full((1_000_000,), 3.0)}, rng_state=False))
    with pytest.raises(torchplace.CheckpointError, match=r"never collected.*is full"):  # ... or at the next save
        torchplace.save_async(old, extra={"a": 1})


def test_memory_check_says_what_is_needed_and_what_is_free() -> None:
    assert memory_problem(0, 0) is None
    assert memory_problem(2**30, 8 * 2**30) is None
    problem = memory_problem(10 * 2**30, 4 * 2**30)
    assert problem is not None and "10.0 GiB" in problem and "4.0 GiB is available" in problem


def _run(code: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=cwd)


def test_pending_saves_finish_at_exit(tmp_path: Path) -> None:
    out = _run("import torch, torchplace\n"
               "torchplace.save_async('c', model={'w': torch.arange(4_000_000.0)}, extra={'a': 1})\n", tmp_path)
    assert out.returncode == 0, out.stderr
    assert "waiting for 1 background checkpoint save(s) to finish" in out.stderr or out.stderr == ""
    ck = torchplace.load(tmp_path / "c")
    assert ck.extra == {"a": 1} and torch.equal(ck["model"]["w"], torch.arange(4_000_000.0))


def test_an_uncollected_failure_is_reported_at_exit(tmp_path: Path) -> None:
    out = _run("import torchplace\ntorchplace.save_async('missing/c', extra={'a': 1})\n", tmp_path)
    assert "a background checkpoint save failed and its error was never collected" in out.stderr, out.stderr
    assert "does not exist" in out.stderr


def test_a_stuck_sharded_write_is_abandoned_at_exit(tmp_path: Path) -> None:
    # a sharded write waiting in a collective for a peer that died never ends: exit must not wait forever
    out = _run("import threading\n"
               "from pathlib import Path\n"
               "from torchplace.checkpoint import background\n"
               "from torchplace.checkpoint import HostStaging\n"
               "background.SHARDED_EXIT_WAIT_S = 0.2\n"
               "fut = background.SaveFuture(Path('sharded-ckpt'))\n"
               "fut.sharded_rank = 1\n"
               "background.default_saver().submit(fut, HostStaging(), threading.Event().wait)\n", tmp_path)
    assert out.returncode == 0, out.stderr
    assert "abandoned the background save of sharded-ckpt (sharded, rank 1)" in out.stderr, out.stderr


def test_runtime_save_async(tmp_path: Path) -> None:
    rt = torchplace.setup("cpu", threads=None, verbose=False)
    try:
        model, _ = _trained()
        assert rt.save_async(tmp_path / "c", model=model).result(timeout=120) == tmp_path / "c"
    finally:
        rt.close()
    assert os.path.getsize(tmp_path / "c") > 64 * 64 * 4


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice values are Linux's")
def test_writer_threads_lower_their_own_priority_and_pass_it_on() -> None:
    from torchplace.checkpoint.stream import lower_priority

    main = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    seen: dict[str, int | None] = {}

    def writer() -> None:
        seen["writer"] = lower_priority(5)
        child = threading.Thread(target=lambda: seen.update(child=os.getpriority(os.PRIO_PROCESS,
                                                                                 threading.get_native_id())))
        child.start()
        child.join()
        seen["zero"] = lower_priority(0)  # 0: leaves it as it is

    thread = threading.Thread(target=writer)
    thread.start()
    thread.join()
    expected = min(19, main + 5)
    assert seen == {"writer": expected, "child": expected, "zero": expected}  # threads it starts inherit it
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == main  # the caller's thread keeps its own


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice values are Linux's")
def test_the_writer_runs_at_the_module_s_priority(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from torchplace.checkpoint import background

    main = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    monkeypatch.setattr(background, "WRITER_NICE", 3)  # read at each save: the bench can try values
    pending = torchplace.save_async(tmp_path / "c", model={"w": torch.ones(10)}, rng_state=False)
    assert pending.result(timeout=120) == tmp_path / "c" and pending.writer_nice == min(19, main + 3)
    monkeypatch.setattr(background, "WRITER_NICE", 0)
    assert torchplace.save_async(tmp_path / "d", extra={"a": 1}).result(timeout=120) == tmp_path / "d"


def test_the_shard_stager_waits_on_the_devices_the_state_is_on() -> None:
    from torchplace.shared.staging import accelerators as _devices

    assert _devices({"a": torch.ones(1), "b": torch.empty(2, device="meta"), "c": 3}) == set()


def test_a_torch_without_the_shard_stager_is_named_with_the_fix(monkeypatch) -> None:
    """Older torch has no StateDictStager: a CheckpointError saying so, not a raw ImportError."""
    import sys

    monkeypatch.setitem(sys.modules, "torch.distributed.checkpoint._state_dict_stager", None)
    with pytest.raises(torchplace.CheckpointError, match="StateDictStager.*Fix: upgrade torch"):
        HostStaging().dcp_stage({"w": torch.ones(2)}, pinned=False)


def test_the_sharded_writer_group_dies_with_its_process_group(monkeypatch) -> None:
    """Kept weakly: after destroy_process_group nothing of ours holds the groups (and their threads) into exit."""
    import gc
    import weakref

    import torch.distributed as dist
    from ports import free_port

    from torchplace.checkpoint.background import writer_group

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        first = writer_group()
        assert writer_group() is first  # made once per group
        held = weakref.ref(first)
        del first
    finally:
        dist.destroy_process_group()
    gc.collect()
    assert held() is None


def test_a_save_of_the_same_state_copies_before_encoding_and_a_changed_one_copies_again(tmp_path: Path) -> None:
    model, opt = _trained()
    saves = []

    def save(name: str, **state: object) -> torchplace.SaveFuture:
        fut = torchplace.save_async(tmp_path / name, rng_state=False, **state)  # type: ignore[arg-type]
        fut.result(timeout=120)
        saves.append(fut.repeated)
        return fut

    save("1", model=model, optimizer=opt, extra={"step": 1})
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # new values in the same tensors: the previous layout holds them
    save("2", model=model, optimizer=opt, extra={"step": 2})
    ck = torchplace.load(tmp_path / "2")
    assert ck.extra == {"step": 2}
    for key, value in model.state_dict().items():
        assert torch.equal(ck["model"][key], value), key
    assert torch.equal(ck["optimizer"]["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])

    state = {"a": torch.arange(6.0), "b": torch.ones(3), "c": torch.zeros(2, 2)}
    save("3", model=state)
    save("4", model={**state, "b": torch.full((3,), 7.0)})  # another tensor of the same shape at b: same layout
    assert torch.equal(torchplace.load(tmp_path / "4")["model"]["b"], torch.full((3,), 7.0))
    tied = {**state, "c": state["a"][:4].view(2, 2)}  # c now a view of a's memory: the same layout
    save("5", model=tied)
    assert torch.equal(torchplace.load(tmp_path / "5")["model"]["c"], tied["c"])
    save("6", model={"a": torch.arange(7.0), "b": state["b"], "c": state["c"]})  # a grew: another layout
    assert torch.equal(torchplace.load(tmp_path / "6")["model"]["a"], torch.arange(7.0))
    save("7", model={"b": state["b"], "a": state["a"], "c": state["c"]})  # the same tensors in another order
    assert [t.key for t in torchplace.checkpoint.inspect(tmp_path / "7").tensors][:3] == \
        ["model/b", "model/a", "model/c"]
    save("8", model={"b": state["b"], "a": state["a"], "c": state["c"].t()})  # a strided view at c: copied as it is now
    assert torch.equal(torchplace.load(tmp_path / "8")["model"]["c"], state["c"].t())
    save("9", model={"b": state["b"], "a": state["a"].half(), "c": state["c"]})  # another dtype at a
    assert torchplace.load(tmp_path / "9")["model"]["a"].dtype == torch.float16
    assert saves == [False, True, False, True, True, False, False, True, False]


class _TiedLM(nn.Module):
    """GPT-2's pattern in small: many small tensors, and a head tied to the token embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(50, 16)
        self.blocks = nn.Sequential(*(nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 16)) for _ in range(3)))
        self.lm_head = nn.Linear(16, 50, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.blocks(self.wte(ids)))


def test_a_training_loop_saves_into_the_previous_layout_and_each_file_holds_its_call(tmp_path: Path) -> None:
    """The saves of a training loop as users call them (tied weights, AdamW whose state appears at its first step,
    the default RNG state, numpy's an array): once the layout stops changing every save takes the repeated path."""
    import numpy as np

    torch.manual_seed(0)
    model = _TiedLM()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

    def train() -> None:
        model(torch.randint(0, 50, (4, 8))).sum().backward()
        opt.step()
        opt.zero_grad()
        np.random.rand()  # numpy's RNG state moves on too

    repeated = []
    for step in range(4):
        fut = torchplace.save_async(tmp_path / f"s{step}", model=model, optimizer=opt, extra={"step": step})
        weights = {k: v.clone() for k, v in model.state_dict().items()}
        moments = [s["exp_avg"].clone() for s in opt.state_dict()["state"].values()]
        numpy_state = np.random.get_state()[1].copy()
        train()  # the state changes while the file is written
        fut.result(timeout=120)
        repeated.append(fut.repeated)
        ck = torchplace.load(tmp_path / f"s{step}")
        assert ck.extra == {"step": step}
        for key, value in weights.items():
            assert torch.equal(ck["model"][key], value), (step, key)
        saved = [s["exp_avg"] for s in ck["optimizer"]["state"].values()]
        assert len(saved) == len(moments) and all(torch.equal(a, b) for a, b in zip(saved, moments)), step
        assert np.array_equal(np.asarray(ck["rng"]["numpy"][1]), numpy_state), step
    # the first save has no layout before it; AdamW's state appears at the first step (another layout); then the same
    assert repeated == [False, False, True, True]
