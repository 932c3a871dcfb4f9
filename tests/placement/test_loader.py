"""DeviceLoader on cpu and meta: pass-through, the background worker's life cycle, packing."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import threading
import time
import weakref

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import torchplace as tp
from torchplace.errors import PackingError
from torchplace.placement import _hostcopy, _pack, image_transform
from torchplace.placement._inline import InlineIter
from torchplace.placement._stage import Staged, Stager
from torchplace.placement.loader import _BackgroundIter
from torchplace.shared.tree import map_tensors

BACKGROUND = [pytest.param(False, id="inline"), pytest.param(True, id="background")]


@dataclasses.dataclass
class Sample:
    image: torch.Tensor
    label: torch.Tensor
    name: str


def batches(n: int = 5) -> list[dict]:
    return [{"x": torch.full((2, 3), float(i)), "y": [torch.tensor(i), "tag"]} for i in range(n)]


def workers() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "torchplace-DeviceLoader"]


def wait_for_no_workers() -> None:
    deadline = time.monotonic() + 120  # the worker exits within one poll of its stop flag; this bound is for a hang
    while workers() and time.monotonic() < deadline:
        time.sleep(0.01)


def test_cpu_is_a_plain_pass_through():
    data = batches()
    loader = tp.DeviceLoader(data, "cpu")
    out = list(loader)
    assert len(out) == len(data) and all(a is b for a, b in zip(out, data))
    assert loader.stream is None and not workers()


@pytest.mark.parametrize("background", BACKGROUND)
@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_iterating_again_gives_the_same_epoch(background, device):
    loader = tp.DeviceLoader(batches(), device, background=background)
    first, second = list(loader), list(loader)
    assert len(first) == len(second) == len(loader) == 5
    for a, b in zip(first, second):
        assert a["x"].device.type == device and a["y"][1] == "tag"
        assert a["x"].shape == b["x"].shape
    if device == "cpu":
        assert [int(b["y"][0]) for b in second] == list(range(5))


@pytest.mark.parametrize("background", BACKGROUND)
def test_empty_loader(background):
    loader = tp.DeviceLoader([], "meta", background=background)
    assert list(loader) == [] and len(loader) == 0


@pytest.mark.parametrize("background", BACKGROUND)
def test_loader_shorter_than_the_prefetch_depth(background):
    out = list(tp.DeviceLoader(batches(2), "cpu", prefetch=8, background=background))
    assert [float(b["x"][0, 0]) for b in out] == [0.0, 1.0]


class Boom(RuntimeError):
    pass


def failing(after: int):
    for i in range(after):
        yield torch.full((2,), float(i))
    raise Boom(f"dataset broke at item {after}")


@pytest.mark.parametrize("background", BACKGROUND)
def test_the_loaders_exception_reaches_the_consumer(background):
    it = iter(tp.DeviceLoader(failing(2), "meta", background=background))
    assert next(it).shape == (2,) and next(it).shape == (2,)
    with pytest.raises(Boom, match="broke at item 2"):
        next(it)
    with pytest.raises(StopIteration):
        next(it)


@pytest.mark.parametrize("background", BACKGROUND)
def test_breaking_out_mid_epoch_cleans_up(background):
    closed = threading.Event()

    class Source:
        def __iter__(self):
            try:
                for i in range(1000):
                    yield torch.full((4,), float(i))
            finally:
                closed.set()

    for i, _batch in enumerate(tp.DeviceLoader(Source(), "meta", background=background)):
        if i == 3:
            break
    assert closed.wait(120), "the upstream iterator was not closed after the consumer broke out"
    wait_for_no_workers()
    assert not workers()


def test_a_users_own_iterator_is_not_closed_under_them():
    gen = (torch.ones(1) * i for i in range(10))
    for _ in tp.DeviceLoader(gen, "cpu"):
        break
    assert float(next(gen)) == 1.0  # a plain for loop would leave it open too


def test_the_worker_never_runs_more_than_prefetch_ahead():
    """The worker pulls batch k only once the loop has asked for batch k - PREFETCH; before each
    next() the test waits until it got that far, so every pull happens at the limit."""
    prefetch, n, lock = 3, 12, threading.Condition()
    asked = 0  # next() calls the loop has begun
    asked_at_pull: list[int] = []

    def source():
        for _ in range(n):
            with lock:
                asked_at_pull.append(asked)
                lock.notify_all()
            yield torch.ones(1)

    it = iter(tp.DeviceLoader(source(), "meta", prefetch=prefetch, background=True))
    for _ in range(n):
        with lock:  # the timeout only guards against a hang
            want = min(asked + prefetch, n)
            assert lock.wait_for(lambda want=want: len(asked_at_pull) >= want, timeout=120)
            asked += 1
        next(it)
    it.close()
    assert [k + 1 <= seen + prefetch for k, seen in enumerate(asked_at_pull)] == [True] * n, asked_at_pull


def test_len_of_an_unsized_loader_explains_itself():
    loader = tp.DeviceLoader((i for i in range(3)), "cpu")
    with pytest.raises(TypeError, match="has no len\\(\\).*generator"):
        len(loader)


@pytest.mark.parametrize("prefetch", [0, -1, 1.5, True])
def test_prefetch_must_be_a_positive_int(prefetch):
    with pytest.raises(ValueError, match="prefetch"):
        tp.DeviceLoader([], "cpu", prefetch=prefetch)


@pytest.mark.parametrize("background", BACKGROUND)
def test_a_torch_dataloader_with_dataclass_batches(background):
    data = TensorDataset(torch.arange(40, dtype=torch.float32).view(10, 4), torch.arange(10))
    loader = DataLoader(data, batch_size=3, collate_fn=lambda rows: Sample(
        torch.stack([r[0] for r in rows]), torch.stack([r[1] for r in rows]), "s"))
    out = list(tp.DeviceLoader(loader, "cpu", background=background))
    assert len(out) == len(loader) == 4 and all(isinstance(b, Sample) for b in out)
    assert torch.equal(torch.cat([b.label for b in out]), torch.arange(10))


def test_many_small_tensors_are_packed_and_viewed_back():
    small = [torch.full((3, 5), float(i)) for i in range(6)]
    big = torch.ones(_pack.MAX_TENSOR_BYTES // 4 + 1)  # one element past the packing limit
    batch = {"small": small, "big": big, "mask": torch.ones(3, dtype=torch.bool), "n": 1}
    out = next(iter(tp.DeviceLoader([batch], "meta", background=True)))
    assert [(t.shape, t.dtype, t.device.type) for t in out["small"]] == [((3, 5), torch.float32, "meta")] * 6
    storages = {t.untyped_storage().nbytes() for t in [*out["small"], out["mask"]]}
    assert len(storages) == 1 and storages.pop() >= 6 * 64 + 64  # one shared, aligned buffer
    assert out["big"].untyped_storage().nbytes() == big.nbytes and out["n"] == 1


def test_pack_false_copies_each_tensor_on_its_own():
    batch = [torch.ones(2), torch.zeros(3)]
    out = next(iter(tp.DeviceLoader([batch], "meta", background=True, pack=False)))
    assert [t.untyped_storage().nbytes() for t in out] == [8, 12]


def test_pack_round_trips_every_dtype_bit_exactly():
    tensors = [torch.randn(3, 4), torch.tensor(True), torch.arange(5, dtype=torch.int16), torch.empty(0, 3),
               torch.randn(2, dtype=torch.complex64), torch.randn(7).to(torch.bfloat16),
               torch.randint(0, 255, (9,), dtype=torch.uint8), torch.tensor(3.5, dtype=torch.float64)]
    plan = _pack.layout(tensors)
    assert all(offset % _pack.ALIGN == 0 for offset in plan.offsets)
    buf = torch.empty(plan.total, dtype=torch.uint8)
    _pack.copy(_pack.views(buf, plan), tensors)
    for original, view in zip(tensors, _pack.views(buf.clone(), plan)):
        assert view.dtype == original.dtype and view.shape == original.shape
        assert torch.equal(view.reshape(-1).view(torch.uint8), original.reshape(-1).view(torch.uint8))


@pytest.mark.parametrize("make,ok", [
    (lambda: torch.ones(4), True),
    (lambda: torch.ones(4, requires_grad=True), False),        # packing would cut the autograd graph
    (lambda: torch.ones(4, 4).t(), False),                     # not contiguous
    (lambda: torch.nn.Parameter(torch.ones(2), requires_grad=False), False),  # a subclass keeps its type
    (lambda: torch.ones(_pack.MAX_TENSOR_BYTES), False),       # large: its own copy
    (lambda: torch.ones(2).to_sparse(), False),
    (lambda: torch.ones(2, device="meta"), False),
])
def test_what_gets_packed(make, ok):
    assert _pack.packable(make()) is ok


class Moves:
    def __init__(self, device="cpu") -> None:
        self.device = torch.device(device)

    def to(self, device, non_blocking=False):
        return Moves(device)


def test_objects_with_their_own_to_move_in_the_background_too():
    out = next(iter(tp.DeviceLoader([{"obj": Moves(), "t": torch.ones(1)}], "meta", background=True)))
    assert out["obj"].device == torch.device("meta") and out["t"].device.type == "meta"


@pytest.mark.parametrize("background", BACKGROUND)
def test_image_transform(background):
    images = torch.randint(0, 256, (2, 3, 4, 5), dtype=torch.uint8)
    labels = torch.tensor([1, 2])
    mean, std = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
    loader = tp.DeviceLoader([(images, labels)], "cpu", background=background,
                             transform=image_transform(mean, std, channels_last=True))
    x, y = next(iter(loader))
    expected = (images.float() / 255 - torch.tensor(mean).view(3, 1, 1)) / torch.tensor(std).view(3, 1, 1)
    assert torch.allclose(x, expected, atol=1e-6) and x.dtype == torch.float32
    assert x.is_contiguous(memory_format=torch.channels_last)
    assert y is labels


def test_image_transform_refuses_channels_that_do_not_match():
    transform = image_transform((0.5, 0.5, 0.5), (0.2, 0.2, 0.2))
    with pytest.raises(ValueError, match=r"shape \(2, 1, 4, 4\) has 1 channels.*3 values"):
        transform({"x": torch.zeros(2, 1, 4, 4, dtype=torch.uint8)})
    with pytest.raises(ValueError, match="both mean and std"):
        image_transform((0.5,), None)


# --- memory is given back when the consumer lets go, without waiting for the garbage collector ---

@pytest.fixture
def no_gc():
    """Reference cycles are only freed by the collector: with it off, only plain refcounting frees."""
    was = gc.isenabled()
    gc.collect()
    gc.disable()
    yield
    if was:
        gc.enable()


@pytest.mark.parametrize("background", BACKGROUND)
@pytest.mark.parametrize("pack", [True, False], ids=["packed", "unpacked"])
def test_a_dropped_batch_is_freed_at_once(no_gc, background, pack):
    data = [{"x": torch.ones(300), "small": [torch.ones(3), torch.zeros(5)], "obj": Moves(), "n": i}
            for i in range(40)]
    alive = []
    for batch in tp.DeviceLoader(data, "meta", background=background, pack=pack, prefetch=2):
        alive.append([weakref.ref(batch["x"]), weakref.ref(batch["small"][1])])
        del batch
        still = [r for pair in alive for r in pair if r() is not None]  # only the batches not handed out yet live
        assert not still, f"{len(still)} tensors of batches the consumer dropped are still alive"
    wait_for_no_workers()
    assert all(r() is None for pair in alive for r in pair)


def test_map_tensors_leaves_no_reference_cycle(no_gc):
    class Held:
        pass

    held = Held()
    ref = weakref.ref(held)
    map_tensors({"a": [torch.ones(1)], "b": Sample(torch.ones(1), torch.ones(1), "s")}, lambda t, h=held: t)
    del held
    assert ref() is None


# --- the hand-out protocol, with a stand-in for a stream backend -------------------------------

class FakeEvent:
    def __init__(self, log: list, name: str) -> None:
        self.log, self.name = log, name

    def record(self, stream) -> None:
        self.log.append(("record", self.name, stream))

    def synchronize(self) -> None:
        self.log.append(("sync", self.name))


class FakeStream:
    def __init__(self, log: list, name: str) -> None:
        self.log, self.name = log, name

    def wait_event(self, event: FakeEvent) -> None:
        self.log.append(("wait", self.name, event.name))

    def __repr__(self) -> str:
        return self.name


class FakeMod:
    def __init__(self, log: list) -> None:
        self.log = log
        self.current = FakeStream(log, "consumer")

    def current_stream(self, device):
        return self.current


class FakeKeep:
    def __init__(self, log: list) -> None:
        self.log = log

    def record_stream(self, stream) -> None:
        self.log.append(("record_stream", stream.name))


class FakeStager:
    """Stages batch i as ('b', i) with events ready-i and started-i; logs what the worker does."""

    def __init__(self, log: list, prefetch: int) -> None:
        self.log, self.prefetch = log, prefetch
        self.mod, self.device = FakeMod(log), torch.device("meta")
        self.consumer = self.mod.current
        self.staged = 0

    _native = False  # the device module's current_stream, which FakeMod logs
    hand_out = Stager.hand_out  # the real consumer's side, on these events and streams

    def on_worker(self):
        return contextlib.nullcontext()

    def on_side(self):
        self.log.append(("side", threading.get_ident()))
        return contextlib.nullcontext()

    def __call__(self, batch):
        self.log.append(("stage", batch))
        self.staged += 1
        return Staged(("b", batch), FakeEvent(self.log, f"ready-{batch}"), FakeEvent(self.log, f"started-{batch}"),
                      [FakeKeep(self.log)], None)

    def handed(self, token) -> None:
        if token is not None:
            started, ready = token
            started.synchronize()

    def source_done(self, event) -> None:
        event.synchronize()


def test_the_consumer_waits_for_the_copy_then_records_started():
    # In this order nothing is queued between `started` and the free of the batch the loop drops
    # next, so the worker, woken by `started`, can reuse that memory (see loader.__next__).
    log: list = []
    stager = FakeStager(log, prefetch=2)
    it = _BackgroundIter(iter(range(3)), True, stager, 2)
    assert next(it) == ("b", 0)
    hand_out = [e for e in log if e[0] in ("record", "wait") and "-0" in e[-1 if e[0] == "wait" else 1]]
    assert hand_out == [("wait", "consumer", "ready-0"), ("record", "started-0", stager.consumer)]
    assert ("record_stream", "consumer") not in log  # the stream iter() saw: the worker marked it already
    stager.mod.current = FakeStream(log, "user")  # the consumer switched streams between iter() and next()
    assert next(it) == ("b", 1)
    assert ("record_stream", "user") in log and ("wait", "user", "ready-1") in log
    assert list(it) == [("b", 2)]


def test_the_worker_stages_batch_i_only_after_the_device_reached_batch_i_minus_prefetch():
    log: list = []
    stager = FakeStager(log, prefetch=2)
    it = _BackgroundIter(iter(range(6)), True, stager, 2)
    out = list(it)
    assert out == [("b", i) for i in range(6)]
    for i in range(2, 6):  # the loop took batch i-2, then the worker waited for it, then staged batch i
        handed = log.index(("record", f"started-{i - 2}", stager.consumer))
        assert handed < log.index(("sync", f"started-{i - 2}")) < log.index(("stage", i))


def test_inline_staging_keeps_the_same_hand_out_and_prefetch_bound_on_the_callers_thread():
    """Packed batches are staged on the loop's thread (InlineIter): the consumer waits for the copy
    then records started, and batch i is staged once the device has reached the point where the loop
    took batch i - prefetch - 1 (one batch more than the worker keeps, so that the loop waits for the
    device no sooner than with the worker)."""
    log: list = []
    stager = FakeStager(log, prefetch=2)
    it = InlineIter(iter(range(1, 6)), True, stager, 2, 0)
    out = list(it)
    assert out == [("b", i) for i in range(6)]
    assert {e[1] for e in log if e[0] == "side"} == {threading.get_ident()}  # no other thread staged
    assert not workers()
    hand_out = [e for e in log if e[0] in ("record", "wait") and "-0" in e[-1 if e[0] == "wait" else 1]]
    assert hand_out == [("wait", "consumer", "ready-0"), ("record", "started-0", stager.consumer)]
    for i in range(3, 6):
        handed = log.index(("record", f"started-{i - 3}", stager.consumer))
        assert handed < log.index(("sync", f"started-{i - 3}")) < log.index(("stage", i))
    assert ("sync", "started-3") not in log  # never a wait the loop did not need
    assert log.index(("stage", 1)) < log.index(("record", "started-0", stager.consumer))  # one ahead


def test_inline_staging_closes_the_upstream_and_passes_its_error():
    log: list = []
    closed = []

    def source():
        try:
            yield 1
            yield 2
            raise Boom("upstream")
        finally:
            closed.append(True)

    it = InlineIter(source(), True, FakeStager(log, prefetch=2), 2, 0)
    assert next(it) == ("b", 0)
    assert next(it) == ("b", 1)
    with pytest.raises(Boom):
        list(it)
    assert closed and next(it, None) is None  # ended for good
    early = InlineIter((i for i in range(10)), True, FakeStager([], prefetch=2), 2, 0)
    assert next(early) == ("b", 0)
    early.close()
    assert next(early, None) is None


def test_a_strided_nested_tensor_is_never_packed_by_the_loader():
    """DeviceLoader's own packing (Stager._collect, an inlined packable()) took a strided nested tensor
    for a small plain one and failed inside with "NestedTensorImpl doesn't support sizes"; it travels
    on its own (to meta, torch's refusal is then named: DeviceError)."""
    nested = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])
    batch = {"a": torch.ones(3), "b": torch.ones(4), "n": nested}
    with pytest.raises(tp.DeviceError, match="nested tensor of the strided layout"):
        list(tp.DeviceLoader([batch], "meta", background=True))


# --- packing layouts and the parallel host copy -------------------------------------------------

def test_a_layout_groups_equal_shapes_without_overlap_and_keeps_the_order():
    tensors = [torch.randn(3, 5), torch.arange(7), torch.randn(3, 5), torch.tensor(2.5, dtype=torch.float64),
               torch.randn(3, 5), torch.empty(0, 3), torch.arange(7) * 2, torch.ones(1, dtype=torch.bool)]
    plan = _pack.layout(tensors)
    assert plan is _pack.layout([t.clone() for t in tensors])  # cached per dtypes and shapes
    assert len(plan.groups) == 5  # (3, 5) f32 x3, (7,) i64 x2, and three alone
    spans = sorted((o, o + t.nbytes) for o, t in zip(plan.offsets, tensors) if t.nbytes)
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:]))
    assert all(o % _pack.ALIGN == 0 for o in plan.offsets) and plan.total % _pack.ALIGN == 0
    buf = torch.empty(plan.total, dtype=torch.uint8)
    views = _pack.views(buf, plan)
    _pack.copy(views, tensors)
    for original, view in zip(tensors, views):
        assert view.shape == original.shape and view.dtype == original.dtype and view.is_contiguous()
        assert torch.equal(view, original)
        assert view.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()
    views[0].fill_(0)  # views of one buffer, each its own bytes
    assert torch.equal(views[2], tensors[2]) and torch.equal(views[4], tensors[4])


def test_the_host_copy_shares_big_packs_out_and_reports_errors(monkeypatch):
    monkeypatch.setattr(_hostcopy, "threads", lambda: 2)  # helpers here, whatever this machine has
    monkeypatch.setattr(_hostcopy, "PARALLEL_BYTES", 1024)
    monkeypatch.setattr(_hostcopy, "CHUNK_BYTES", 256)
    src = [torch.randn(64) for _ in range(9)]
    dst = [torch.empty(64) for _ in range(9)]
    wait = _hostcopy.start(dst, src, [t.nbytes for t in src])
    wait()
    assert all(torch.equal(d, s) for d, s in zip(dst, src))
    helpers = {t.name for t in threading.enumerate() if t.name.startswith("torchplace-copy-")}
    assert {"torchplace-copy-1", "torchplace-copy-2"} <= helpers  # the process's kept pool of 2 (they stay)
    bad = _hostcopy.start([torch.empty(3)] * 9, src, [t.nbytes for t in src])  # 64 values into 3: an error
    with pytest.raises(RuntimeError):
        bad()
    one = _hostcopy.start(dst[:1], src[:1], [10])  # too small to hand out: copied right here
    one()


@pytest.mark.parametrize("value", ["²", "-1", "1e3", "100000", "three"])
def test_a_copy_thread_count_that_is_no_small_number_is_refused_by_name(monkeypatch, value):
    """'²' passed str.isdigit() and then int() raised ValueError; 100000 started that many threads."""
    monkeypatch.setenv("TORCHPLACE_COPY_THREADS", value)
    with pytest.raises(PackingError, match="TORCHPLACE_COPY_THREADS"):
        _hostcopy.threads()


def test_a_copy_thread_count_in_range_is_taken(monkeypatch):
    monkeypatch.setenv("TORCHPLACE_COPY_THREADS", " 2 ")
    assert _hostcopy.threads() == 2


def test_inline_staging_that_fails_on_the_first_batch_closes_the_upstream_at_once():
    # the first batch is staged in iter(): its failure left the upstream open until garbage collection
    closed = []

    def source():
        try:
            yield from range(3)
        finally:
            closed.append(True)

    def transform(batch):
        raise Boom("transform")

    it = source()
    next(it)  # started, as iter() starts it by pulling the first batch
    stager = Stager(torch.device("cpu"), None, None, None, transform, True)
    with pytest.raises(Boom) as raised:
        InlineIter(it, True, stager, 2, torch.ones(2))
    assert closed, raised  # the traceback still holds the half-made iterator: closed all the same


def test_a_transforms_sparse_and_nested_outputs_are_kept_by_the_tensors_holding_their_memory():
    # record_stream refuses sparse and nested tensors (NotImplementedError on SparseCUDA): their
    # indices, values and offsets are recorded instead, so the consumer's use still keeps the memory
    from torchplace.placement._stage import _memory_of

    coo = torch.eye(3).to_sparse()
    csr = torch.eye(3).to_sparse_csr()
    jagged = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)], layout=torch.jagged)
    strided = torch.nested.as_nested_tensor([torch.ones(2), torch.ones(3)])
    for t in (coo, csr, jagged, strided):
        parts = _memory_of(t)
        assert parts and all(p.layout is torch.strided and not p.is_nested for p in parts), t.layout
    assert {p.untyped_storage().data_ptr() for p in _memory_of(coo)} == {
        coo._indices().untyped_storage().data_ptr(), coo._values().untyped_storage().data_ptr()}
    stager = Stager(torch.device("cpu"), None, None, None, None, True)
    found = stager._device_tensors({"a": torch.ones(2), "s": coo, "n": jagged})
    assert len(found) == 1 + 2 + 2 and all(t.layout is torch.strided for t in found)


def test_wrapped_loader_keeps_the_dataloaders_attributes():
    """Wrapped where the loader is made, DDP programs still call loader.sampler.set_epoch and read
    len(loader.dataset) and loader.batch_size (issue 32, item 6)."""
    from torch.utils.data.distributed import DistributedSampler

    data = TensorDataset(torch.arange(10.0))
    sampler = DistributedSampler(data, num_replicas=2, rank=1, shuffle=True, seed=0)
    loader = tp.DeviceLoader(DataLoader(data, batch_size=2, sampler=sampler), "cpu")
    loader.sampler.set_epoch(3)
    assert sampler.epoch == 3
    assert len(loader.dataset) == 10 and loader.batch_size == 2 and len(loader) == 3
    first = [b[0].tolist() for b in loader]
    loader.sampler.set_epoch(4)
    assert first != [b[0].tolist() for b in loader]  # the new epoch reshuffled, through the wrapper
    with pytest.raises(AttributeError, match="neither DeviceLoader nor the DataLoader it wraps has an attribute"):
        _ = loader.nope
    import copy

    assert copy.copy(loader).loader is loader.loader
