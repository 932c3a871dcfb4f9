"""Who is served next and what fits (policy.fairness), on the real H200 snapshots; the GPU processes
of the last tests are CONSTRUCTED (added to the captured snapshot, which has none)."""

from __future__ import annotations

import copy

from snapshots import load_snapshot_dict

from torchplace.hardware.topology import Topology
from torchplace.policy.fairness import Ask, Room, admit, fits, room, serve_order, unleased_bytes

GIB = 2**30


def h200(name: str = "h200x2", processes: list[dict] | None = None) -> Topology:
    data = copy.deepcopy(load_snapshot_dict(name))
    if processes is not None:
        data["gpus"][0]["processes"] = processes
    return Topology.from_dict(data, source=f"{name}.json")


def rooms_of(topo: Topology) -> list[Room]:
    return [room(g, whole_leased=False, reserved_bytes=0, unleased=0) for g in topo.gpus]


def test_fifo_within_a_user():
    asks = [Ask(f"a{i}", "alice", since_ns=t) for i, t in enumerate([30, 10, 20])]
    assert [a.key for a in serve_order(asks)] == ["a1", "a2", "a0"]


def test_round_robin_across_users_one_job_does_not_wait_for_another_users_hundred():
    asks = [Ask(f"a{i}", "alice", since_ns=i) for i in range(100)] + [Ask("b0", "bob", since_ns=500)]
    order = [a.key for a in serve_order(asks)]
    assert order[:3] == ["a0", "b0", "a1"]
    # alice was served last (her served file is newer): bob's job goes first
    assert serve_order(asks, {"alice": 10**9, "bob": 5})[0].key == "b0"
    three = [Ask("a0", "alice", 1), Ask("a1", "alice", 2), Ask("b0", "bob", 3), Ask("c0", "carol", 4),
             Ask("b1", "bob", 5)]
    assert [a.key for a in serve_order(three)] == ["a0", "b0", "c0", "a1", "b1"]


def test_whole_gpus_on_the_h200x2_snapshot_go_to_the_first_two_in_line():
    topo = h200()
    order = serve_order([Ask(k, "u", i) for i, k in enumerate(["x", "y", "z"])])
    granted = admit(order, rooms_of(topo))
    assert list(granted) == ["x", "y"]
    assert sorted(granted["x"] + granted["y"]) == sorted(g.uuid for g in topo.gpus)


def test_the_head_that_does_not_fit_holds_back_those_behind_it():
    topo = h200()
    rooms = rooms_of(topo)
    rooms[0] = Room(rooms[0].uuid, False, 0)  # leased whole
    order = [Ask("big", "alice", 1, count=2), Ask("small", "bob", 2, memory_bytes=10 * GIB)]
    assert admit(order, rooms) == {}  # small would fit on GPU 1, but big came first


def test_memory_reservations_share_one_h200_while_they_fit():
    gpu = h200("h200x1").gpus[0]  # 140.4 GiB as NVML reports it
    rooms = [room(gpu, whole_leased=False, reserved_bytes=0, unleased=0)]
    order = [Ask(f"j{i}", "u", i, memory_bytes=20 * GIB) for i in range(8)]
    assert list(admit(order, rooms)) == [f"j{i}" for i in range(7)]  # 7 x 20 GiB fit in 140.4 GiB, 8 do not
    # four reserved already: three more fit
    assert len(admit(order, [room(gpu, whole_leased=False, reserved_bytes=80 * GIB, unleased=0)])) == 3


def test_whole_and_memory_leases_never_overlap():
    gpu = h200("h200x1").gpus[0]
    reserved = room(gpu, whole_leased=False, reserved_bytes=1 * GIB, unleased=0)
    assert not reserved.whole_free and fits(Ask("w", "u", 0), [reserved]) is None
    whole = room(gpu, whole_leased=True, reserved_bytes=0, unleased=0)
    assert whole.reservable_bytes == 0 and fits(Ask("m", "u", 0, memory_bytes=1), [whole]) is None
    granted = admit([Ask("w", "u", 0), Ask("m", "u", 1, memory_bytes=GIB)], [room(gpu, whole_leased=False,
                                                                                   reserved_bytes=0, unleased=0)])
    assert granted == {"w": [gpu.uuid]}


def test_memory_used_without_a_lease_is_taken_constructed_processes():
    # CONSTRUCTED: two processes added to the captured h200x1 snapshot; pid 4242 runs under a lease
    topo = h200("h200x1", processes=[{"pid": 4242, "used_memory_bytes": 30 * GIB, "user": "alice"},
                                     {"pid": 777, "used_memory_bytes": 50 * GIB, "user": "mallory"}])
    gpu = topo.gpus[0]
    assert unleased_bytes(gpu, {4242}) == 50 * GIB
    left = room(gpu, whole_leased=False, reserved_bytes=30 * GIB, unleased=unleased_bytes(gpu, {4242}))
    assert left.reservable_bytes == gpu.memory_total_bytes - 80 * GIB
    order = [Ask(f"j{i}", "u", i, memory_bytes=20 * GIB) for i in range(4)]
    assert len(admit(order, [left])) == 3  # 60.4 GiB left: three of 20 GiB


def test_an_ask_that_could_never_fit_holds_back_no_one():
    # a queue entry written by hand: more GPUs than the machine has, or more memory than a GPU has
    rooms = rooms_of(h200())
    order = [Ask("greedy", "mallory", 0, count=64), Ask("huge", "mallory", 1, memory_bytes=10**15),
             Ask("mine", "alice", 2)]
    assert list(admit(order, rooms)) == ["mine"]
