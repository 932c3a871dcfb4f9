"""Memory on the CPU: the report names live tensors and their holders, the leak detector flags
real leaking loops and stays silent on a clean one, and OOM diagnosis works under a real cap
(RLIMIT_AS in a child process) and on a real allocator failure in this process."""

from __future__ import annotations

import collections
import json
import subprocess
import sys
import textwrap
import warnings
import weakref
from pathlib import Path

import pytest
import torch
import torch._dynamo  # noqa: F401 - optimizers import it on first use, and it writes TORCHINDUCTOR_CACHE_DIR

from torchplace import diagnose_oom, find_batch_size, memory_report, track_memory
from torchplace.memory import MemoryLeakError, MemoryLeakWarning, OutOfMemoryDiagnosis, is_oom


class Cache:
    def __init__(self) -> None:
        self.table = torch.zeros(700, 1000)


KEPT = Cache()


def test_report_lists_largest_tensors_with_their_holders():
    report = memory_report("cpu", top=3)
    cpu = report.devices[0]
    assert cpu.device == "cpu" and cpu.total_bytes and cpu.reserved_bytes and cpu.free_bytes
    assert cpu.allocated_bytes >= KEPT.table.untyped_storage().nbytes()
    # the largest three: other tests may leave a larger buffer alive (save_async keeps its staging slabs)
    top = next(t for t in report.largest if t.held_by == "Cache.table")
    assert (top.shape, top.dtype) == ((700, 1000), "float32")
    assert "2.7 MiB float32 [700, 1000] on cpu, held by Cache.table" in report.text()


def small_model():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    return model, torch.optim.SGD(model.parameters(), lr=0.01)


def run_training(history: list, keep_graph: bool, steps: int = 24, **kwargs):
    model, opt = small_model()
    with track_memory("cpu", **kwargs) as tracker:
        for _ in range(steps):
            loss = model(torch.randn(32, 64)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            history.append(loss if keep_graph else loss.item())
            tracker.step()
    return tracker


def test_clean_loop_stays_silent():
    history: list = []
    with warnings.catch_warnings():
        warnings.simplefilter("error", MemoryLeakWarning)
        tracker = run_training(history, keep_graph=False)
    assert tracker.report is None and len(tracker.samples) == 23


def test_losses_kept_with_their_graphs_are_named():
    history: list = []
    with pytest.warns(MemoryLeakWarning, match=r"live tensors holding autograd graphs") as caught:
        tracker = run_training(history, keep_graph=True)
    report = tracker.report
    assert report is not None and report.new_graph_holders >= 20
    assert report.kept_by[0].startswith("2")  # 20-odd losses since the baseline step
    assert "float32 [] made by MeanBackward0 in a list of 24 items" in report.kept_by[0]
    assert "loss.item()" in str(caught[0].message)


def test_leak_raises_under_strict():
    history: list = []
    with pytest.raises(MemoryLeakError, match="MeanBackward0"):
        run_training(history, keep_graph=True, strict=True)


def test_outputs_kept_without_no_grad_grow_memory():
    """Evaluation without no_grad, outputs kept: activations pile up (about 16 MiB a step).

    On the CPU the tracker reads the resident set, and freed heap memory left by earlier tests is
    reused before it grows: a few MiB a step could pile up unseen, 288 MiB cannot.
    """
    model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.Tanh(), torch.nn.Linear(1024, 1024))
    outputs = []
    with pytest.warns(MemoryLeakWarning, match=r"grew by .* over 18 steps .* beyond the tolerance of 16.0 MiB"):
        with track_memory("cpu") as tracker:
            for _ in range(20):
                outputs.append(model(torch.randn(1024, 1024)))
                tracker.step()
    assert tracker.report.growth_bytes > 16 * 2**20
    assert "made by AddmmBackward0 in a list of 20 items" in tracker.report.kept_by[0]


def line_of(text: str) -> str:
    """'FILE.py:N' of the first line of this file containing TEXT."""
    lines = Path(__file__).read_text().splitlines()
    return f"{Path(__file__).name}:{next(i for i, line in enumerate(lines, 1) if text in line)}"


def test_clean_adamw_loop_stays_silent():
    """AdamW makes two state tensors per parameter at its first step: warmup covers them."""
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Tanh(), torch.nn.Linear(256, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with warnings.catch_warnings():
        warnings.simplefilter("error", MemoryLeakWarning)
        with track_memory("cpu") as tracker:
            for _ in range(24):
                loss = model(torch.randn(64, 256)).pow(2).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
                tracker.step()
    assert tracker.report is None


def test_growing_cache_of_plain_tensors_is_named():
    """The issue's case: a per-step cache of graph-free tensors, 8 MiB a step; no autograd graph."""
    x = torch.randn(2**21)  # 8 MiB
    seen = {}
    with pytest.warns(MemoryLeakWarning) as caught:
        with track_memory("cpu") as tracker:
            for step in range(30):
                seen[step] = x * 2  # the leak
                tracker.step()
    grew = tracker.report.grew
    assert [(g.name, g.where, g.growth_bytes, g.added_tensors) for g in grew] == [
        ("dict `seen`", line_of("seen[step] = x * 2"), 28 * 8 * 2**20, 28)]
    message = str(caught[0].message)
    assert f"dict `seen` ({line_of('seen[step] = x * 2')}) grew by 224.0 MiB: 28 tensor(s) of 8.0 MiB added (cpu)" \
        in message
    assert "deque(maxlen=...)" in message and "autograd graph" not in message
    seen.clear()


class Trainer:
    def __init__(self) -> None:
        self.outputs: list = []
        self.recent: collections.deque = collections.deque(maxlen=4)  # bounded: never a leak

    def step(self, x: torch.Tensor) -> None:
        self.recent.append(x + 1)
        self.outputs.append((x * 2, x * 3))  # the leak: two tensors a step, in a tuple


class Accumulator(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.memory: dict = {}


def test_holders_are_named_by_attribute_path():
    """An object's list of tuples and a submodule's dict are named by the path the user typed;
    a bounded deque that holds as much at the end as at the start is not named."""
    x = torch.randn(2**20)  # 4 MiB
    trainer = Trainer()
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), Accumulator())
    with pytest.warns(MemoryLeakWarning):
        with track_memory("cpu") as tracker:
            for step in range(24):
                trainer.step(x)
                model[1].memory[step] = x - 1
                tracker.step()
    found = {g.name: (g.where, g.growth_bytes, g.added_tensors) for g in tracker.report.grew}
    assert found == {"list `trainer.outputs`": (line_of("self.outputs.append("), 22 * 8 * 2**20, 44),
                     "dict `model.1.memory`": (line_of("model[1].memory[step] ="), 22 * 4 * 2**20, 22)}


class Metrics:
    def __init__(self) -> None:
        self.preds: list = []
        self.targets: list = []
        self.scores: list = []


def test_an_object_whose_attributes_grow_alike_names_its_attributes():
    """Growth spread over an object's three lists names the lists (what grows), not the object above them."""
    x = torch.randn(2**20)  # 4 MiB
    metrics = Metrics()
    with pytest.warns(MemoryLeakWarning):
        with track_memory("cpu") as tracker:
            for _ in range(16):
                metrics.preds.append(x + 1)
                metrics.targets.append(x + 2)
                metrics.scores.append(x + 3)
                tracker.step()
    names = {g.name for g in tracker.report.grew}
    assert names == {"list `metrics.preds`", "list `metrics.targets`", "list `metrics.scores`"}, names


class Key:
    """A weak-referenceable key without tensors."""


def test_a_weak_key_cache_is_named_by_its_own_name():
    """A WeakKeyDictionary whose keys stay alive: named by the user's variable, never by its inner `.data`."""
    x = torch.randn(2**20)  # 4 MiB
    keys, cache = [], weakref.WeakKeyDictionary()
    with pytest.warns(MemoryLeakWarning):
        with track_memory("cpu") as tracker:
            for _ in range(16):
                keys.append(Key())
                cache[keys[-1]] = x * 2  # the leak: every key is kept
                tracker.step()
    grew = tracker.report.grew
    assert [(g.name, g.where) for g in grew] == [("WeakKeyDictionary `cache`", line_of("cache[keys[-1]] = x * 2"))]


def test_tensor_attribute_that_grows_is_named():
    class Buffer:
        def __init__(self) -> None:
            self.rows = torch.zeros(0, 2**19)

    buffer = Buffer()
    with pytest.warns(MemoryLeakWarning):
        with track_memory("cpu") as tracker:
            for _ in range(20):
                buffer.rows = torch.cat([buffer.rows, torch.ones(4, 2**19)])  # 8 MiB more each step
                tracker.step()
    top = tracker.report.grew[0]
    assert (top.name, top.where, top.added_tensors, top.growth_bytes) == (
        "tensor `buffer.rows`", line_of("buffer.rows = torch.cat("), 0, 18 * 8 * 2**20)
    assert "its 1 tensor(s) grew to 160.0 MiB (cpu)" in top.describe()


# --------------------------------------------------------------------------- out of memory

CHILD = textwrap.dedent("""
    import json, resource
    import psutil, torch
    torch.set_num_threads(1)
    from torchplace import diagnose_oom, find_batch_size
    torch.ones(64, 64) @ torch.ones(64, 64)
    cap = 256 * 2**20
    vms = psutil.Process().memory_info().vms
    resource.setrlimit(resource.RLIMIT_AS, (vms + cap, resource.RLIM_INFINITY))
    out = {}
    held = []
    try:
        with diagnose_oom():
            for _ in range(64):
                held.append(torch.ones(4 * 2**20))  # 16 MiB each
    except torch.OutOfMemoryError as exc:
        r = exc.report
        out.update(type=type(exc).__name__, cause=str(exc.__cause__)[:200], held=len(held), device=r.device,
                   requested=r.requested_bytes, largest=[t.describe() for t in r.memory.largest],
                   limit=r.memory.devices[0].limit_kind, suggestions=r.suggestions, text=exc.report.text())
    held.clear()

    def step(batch):  # one MiB of activations per sample, and as much again for the result
        x = torch.ones(batch, 2**18)
        return (x * 2).sum().item()

    out["batch"] = find_batch_size(step, 4)
    out["half"] = step(out["batch"] // 2)  # the boundary itself leaves no headroom; half of it runs
    print(json.dumps(out))
""")


def test_oom_under_a_real_memory_cap():
    proc = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["type"] == "OutOfMemoryDiagnosis" and "DefaultCPUAllocator: can't allocate memory" in out["cause"]
    assert out["device"] == "cpu" and out["requested"] == 16 * 2**20 and 5 <= out["held"] < 16
    held_by = f"held by a list of {out['held']} items (global 'held' in __main__)"
    assert out["largest"][0] == f"16.0 MiB float32 [4194304] on cpu, {held_by}"
    assert out["limit"] == "RLIMIT_AS, address space"
    assert any("find_batch_size" in s for s in out["suggestions"])
    # 2 MiB per sample under 256 MiB of address space, less what the interpreter itself maps
    assert 32 <= out["batch"] <= 128 and out["half"] == out["batch"] // 2 * 2**19


def test_decorator_turns_a_real_allocator_failure_into_a_report():
    @diagnose_oom()
    def allocate() -> torch.Tensor:
        return torch.empty(2**50, dtype=torch.uint8)  # 1 PiB: more than any address space holds

    with pytest.raises(torch.OutOfMemoryError) as info:
        allocate()
    err = info.value
    assert isinstance(err, OutOfMemoryDiagnosis) and is_oom(err.__cause__)
    assert err.report.requested_bytes == 2**50 and err.report.device == "cpu"
    assert str(err).startswith("Out of memory on cpu allocating 1024.0 TiB")


def test_other_errors_pass_through():
    with pytest.raises(KeyError):
        with diagnose_oom():
            raise KeyError("not memory")


def capped(limit: int, calls: list[int]):
    """A step whose batches above LIMIT fail the way CUDA fails them (a cap of the test's making)."""
    def step(batch: int) -> None:
        calls.append(batch)
        if batch > limit:
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {batch} MiB.")
    return step


@pytest.mark.parametrize("limit,start", [(37, 1), (37, 64), (1, 8), (5, 5)])
def test_batch_search_finds_the_boundary(limit, start):
    calls: list[int] = []
    assert find_batch_size(capped(limit, calls), start) == limit
    assert len(calls) <= 2 * max(limit, start).bit_length() + 2


def test_batch_search_limits_and_errors():
    assert find_batch_size(capped(100, []), 8, max_size=50) == 50
    with pytest.raises(OutOfMemoryDiagnosis, match="Out of memory"):
        find_batch_size(capped(0, []), 4)
    with pytest.raises(ZeroDivisionError):
        find_batch_size(lambda b: 1 / 0, 4)
    with pytest.raises(ValueError, match="1 <= start <= max_size"):
        find_batch_size(capped(5, []), 0)


def test_memory_held_only_through_an_autograd_graph_is_named_by_the_graphs_root():
    """Validation without no_grad summed into a running total: each step's activations stay saved in the
    total's graph, which no Python container holds; the total, the graph's root, is named (issue 31)."""
    model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.Tanh(), torch.nn.Linear(1024, 1))
    total = torch.zeros(())
    with pytest.warns(MemoryLeakWarning) as caught:
        with track_memory("cpu") as tracker:
            for _ in range(20):
                total = total + model(torch.randn(1024, 1024)).mean()  # the leak: should be .item()
                tracker.step()
    grew = tracker.report.grew
    assert [(g.name, g.where) for g in grew] == [("autograd graph of tensor `total`", line_of("total = total +"))]
    assert grew[0].growth_bytes > 16 * 2**20 and grew[0].tensors >= 18
    assert "autograd graph of tensor `total`" in str(caught[0].message)


def test_a_fake_tensor_with_a_graph_left_alive_does_not_break_the_graph_search():
    """A fake tensor (explain runs the step under FakeTensorMode) that carries a graph and is still alive has
    no storage to read: the search for graph roots skips it and still names the real leak (found in the
    whole suite, where an earlier test's fake tensors were still in the heap)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        weight = torch.ones(3, 2, requires_grad=True)
        fake_with_graph = weight * weight  # its graph saves fake tensors
    model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.Tanh(), torch.nn.Linear(1024, 1))
    total = torch.zeros(())
    with pytest.warns(MemoryLeakWarning) as caught:
        with track_memory("cpu") as tracker:
            for _ in range(20):
                total = total + model(torch.randn(1024, 1024)).mean()
                tracker.step()
    assert [g.name for g in tracker.report.grew] == ["autograd graph of tensor `total`"]
    assert not [w for w in caught if "data pointer" in str(w.message)]  # the fake storage was never read
    assert fake_with_graph.grad_fn is not None  # alive through the whole run
