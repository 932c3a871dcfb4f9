"""What a forked DataLoader worker inherits (issue 28): no cyclic garbage that holds tensors left by our
paths, the parent's staging buffers never freed in the child, inherited garbage never collected there
when the parent's accelerator is started. GPU: test_fork_after_save_gpu.py."""

from __future__ import annotations

import gc
import os
import signal
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import torchplace as tp
from torchplace.checkpoint import background
from torchplace.checkpoint.staging import HostStaging
from torchplace.placement import _fork, _hostcopy

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="fork is POSIX")


@contextmanager
def cyclic_garbage() -> Iterator[list]:
    """Collect before; yield the list that, after the block, holds what the block left as cyclic garbage."""
    found: list = []
    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        yield found
        gc.collect()
    finally:
        gc.set_debug(0)
        found.extend(gc.garbage)
        gc.garbage.clear()


def tensors_in(objects: list) -> list:
    """The tensors (and staging buffers) among OBJECTS or directly referred to by one of them."""
    hits = []
    for o in objects:
        for r in [o, *gc.get_referents(o)]:
            if isinstance(r, (torch.Tensor, HostStaging)):
                hits.append((type(o).__name__, type(r).__name__))
    return hits


def trained() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    return model, opt


def _failed_save_async(path: Path, model: torch.nn.Module) -> None:
    future = tp.save_async(path / "missing" / "x.safetensors", model=model)
    with pytest.raises(tp.CheckpointError, match="does not exist"):
        future.result()


def _loop(packed: bool) -> None:
    data = TensorDataset(torch.randn(32, 8), torch.arange(32))
    source = DataLoader(data, batch_size=8, collate_fn=tp.packed_collate() if packed else None)
    assert sum(len(b[1]) for b in tp.DeviceLoader(source, "cpu")) == 32


def _strict_report(model: torch.nn.Module) -> None:
    with pytest.raises(tp.DeviceMismatchError), tp.strict():
        model(torch.randn(2, 8, device="meta"))


PATHS: dict[str, Callable[[Path, torch.nn.Module, torch.optim.Optimizer], None]] = {
    "save": lambda p, m, o: tp.save(p / "a.safetensors", model=m, optimizer=o),
    "save_async": lambda p, m, o: tp.save_async(p / "b.safetensors", model=m, optimizer=o).result(),
    "save_async-rotating": lambda p, m, o: tp.save_async(p / "c.safetensors", model=m, optimizer=o,
                                                         keep_last=2).result(),
    "save_async-failing": lambda p, m, o: _failed_save_async(p, m),
    "load": lambda p, m, o: tp.load(p / "a.safetensors", model=m, optimizer=o),
    "DeviceLoader-plain": lambda p, m, o: _loop(packed=False),
    "DeviceLoader-packed": lambda p, m, o: _loop(packed=True),
    "strict-report": lambda p, m, o: _strict_report(m),
}


@pytest.mark.parametrize("name", list(PATHS))
def test_no_path_leaves_cyclic_garbage_that_holds_tensors(tmp_path: Path, name: str) -> None:
    model, opt = trained()
    tp.save(tmp_path / "a.safetensors", model=model, optimizer=opt)
    PATHS[name](tmp_path, model, opt)  # first use: lazily made helpers are not this test's concern
    with cyclic_garbage() as found:
        PATHS[name](tmp_path, model, opt)
    assert tensors_in(found) == [], f"{name} left cyclic garbage holding tensors"


def test_a_failed_background_write_keeps_its_traceback_as_text(tmp_path: Path) -> None:
    future = tp.save_async(tmp_path / "missing" / "x.safetensors", model=torch.nn.Linear(2, 2))
    error = future.exception()
    assert error is not None and error.__traceback__ is None
    assert error.__cause__ is not None and error.__cause__.__traceback__ is None
    if hasattr(error, "__notes__"):  # Python 3.11+
        assert "background writer thread" in error.__notes__[0] and "atomic_write" in error.__notes__[0]


def _in_child(check: Callable[[], bool]) -> bool:
    """Run CHECK in a forked child; whether it returned True there (False for a child hung past 120 s, killed)."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            code = 0 if check() else 1
        finally:
            os._exit(code)  # a forked test child leaves without the parent's exit handlers
    deadline = time.monotonic() + 120.0  # a hang bound: the wait ends when the child does
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    if done[0] == 0:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        return False
    return os.waitstatus_to_exitcode(done[1]) == 0


def test_a_child_forked_while_a_parent_thread_starts_the_copy_helpers_copies_with_its_own(monkeypatch) -> None:
    """The host-copy pool's start lock was held by the parent's thread at the fork: the child's first big pack hung."""
    parent, entered, release = os.getpid(), threading.Event(), threading.Event()

    def threads() -> int:  # the parent's thread stops inside the helpers' start, as at an unlucky fork
        if os.getpid() == parent and threading.current_thread() is not threading.main_thread():
            entered.set()
            release.wait()
        return 2

    monkeypatch.setattr(_hostcopy, "threads", threads)
    monkeypatch.setattr(_hostcopy, "PARALLEL_BYTES", 1024)
    monkeypatch.setattr(_hostcopy, "CHUNK_BYTES", 256)
    src = [torch.randn(64) for _ in range(9)]
    starter = threading.Thread(target=lambda: _hostcopy.start([torch.empty(64) for _ in src], src, [256] * 9)())
    starter.start()
    assert entered.wait(120)

    def child() -> bool:
        dst = [torch.empty(64) for _ in src]
        _hostcopy.start(dst, src, [t.nbytes for t in src])()
        helpers = [t.name for t in threading.enumerate() if t.name.startswith("torchplace-copy-")]
        return all(torch.equal(d, s) for d, s in zip(dst, src)) and len(helpers) == 2

    try:
        assert _in_child(child)
    finally:
        release.set()
        starter.join()


def test_a_forked_child_keeps_the_parents_staging_buffers(tmp_path: Path) -> None:
    model, opt = trained()
    tp.save_async(tmp_path / "a.safetensors", model=model, optimizer=opt).result()
    kept = weakref.ref(background.default_saver()._idle[-1].slabs[0])

    def child() -> bool:
        gc.collect()
        return kept() is not None and background.default_saver()._idle == []

    assert _in_child(child)


def test_forked_children_collect_nothing_inherited_once_the_accelerator_is_started(monkeypatch) -> None:
    def frozen_in_child() -> bool:
        return gc.get_freeze_count() > 0 and gc.isenabled()

    gc.unfreeze()
    monkeypatch.setattr(_fork, "_accelerator_started", lambda: True)
    assert _in_child(frozen_in_child)
    assert gc.get_freeze_count() == 0 and gc.isenabled()  # the parent collects as before
    monkeypatch.setattr(_fork, "_accelerator_started", lambda: False)
    assert not _in_child(frozen_in_child)  # nothing started, nothing to protect: the child collects as ever
