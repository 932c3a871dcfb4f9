"""CUDA_VISIBLE_DEVICES mapping: replayed against real driver answers and hand-checked rules."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from snapshots import snapshot_path

from torchplace.hardware.topology import Topology
from torchplace.hardware.visible import map_visible

FIXTURES = Path(__file__).parents[1] / "fixtures"
CAPTURES = sorted(FIXTURES.glob("driver_visible_devices_h200x2*.json"))
DRIVER = json.loads((FIXTURES / "driver_visible_devices_h200x2.json").read_text())
X2 = Topology.from_dict(json.loads(snapshot_path("h200x2").read_text()))
U0, U1 = (g.uuid for g in X2.gpus)


def _machine_of(capture: dict) -> Topology:
    """The 2 x H200 snapshot with the UUIDs of the machine the capture was made on."""
    data = json.loads(snapshot_path("h200x2").read_text())
    for gpu, uuid in zip(data["gpus"], capture["nvml_uuids"]):
        gpu["uuid"] = uuid
    return Topology.from_dict(data)


def _cases():
    for path in CAPTURES:
        capture = json.loads(path.read_text())
        topology = _machine_of(capture)
        for case in capture["results"]:
            value = case["value"]
            shown = value if value is None or len(value) < 60 else f"<{len(value)} chars>"
            yield pytest.param(topology, case, id=f"{path.stem[-10:]}-{shown!r}-{case.get('order')}")


@pytest.mark.parametrize("topology,case", list(_cases()))
def test_matches_what_the_driver_enumerated(topology, case):
    """Every value a 2 x H200 driver was asked about maps to the same UUIDs, in order."""
    mapping = map_visible(case["value"], topology, case.get("order"))
    assert [d.uuid for d in mapping.visible] == (case["driver_uuids"] or [])


def test_driver_fixture_has_enough_cases():
    assert len(DRIVER["results"]) >= 20
    assert sum(len(json.loads(p.read_text())["results"]) for p in CAPTURES) >= 130


@pytest.mark.parametrize("value,expected", [
    ("GPU-" + U1[4:].upper(), [1]),                      # upper-case hex: the driver accepts it
    (U1[:12].upper().replace("GPU-", "GPU-"), [1]),
    (U1.replace("-", "")[:3] + "-" + U1.replace("-", "")[3:16], [1]),  # dashes are skipped
    (" " + U1, []),                                      # a space before a UUID: an int entry, no digit
    ("\t" + U1, []),
    (U0 + ", " + U1, [0]),                               # ... also after a comma
    (U1 + " ", [1]),                                     # after a full UUID the rest is ignored
    (U1[:12] + " ", []),                                 # ... but not inside a short one
    ("\u0661", []), ("\uff11", []), ("\u00b2", []),      # Unicode digits are no digits
    ("0,\uff11", [0]), ("0\u0661", [0]), ("1\uff11", [1]),  # ... and end the list
    ("\u00a01", []),                                     # no-break space is not C whitespace
    ("\t1", [1]), (" \n1", [1]), ("1, \t0", [1, 0]),    # C whitespace is
    ("4294967297", [1]), ("-4294967295", [1]),           # the low 32 bits
    ("2147483648", []), ("18446744073709551616", []),
    ("1" + "0" * 5000, [0, 1]),                          # longer than the driver reads: ignored
    ("1" + " " * 2623, [1]), ("1" + " " * 2624, [0, 1]),
])
def test_driver_rules_for_odd_values(value, expected):
    assert [d.physical_index for d in map_visible(value, X2, None).visible] == expected


def test_odd_values_say_what_happened():
    assert "low 32 bits of 4294967297" in map_visible("4294967297", X2, None).notes[0]
    assert "ASCII digits only" in map_visible("\uff11", X2, None).stopped_at
    assert any("torch.cuda.device_count() may disagree" in n for n in map_visible("\uff11", X2, None).notes)
    assert "ignores a value longer than 2624 bytes" in map_visible("1" * 3000, X2, None).notes[0]
    assert "not a hex digit" in map_visible(U0[:12] + " ", X2, None).stopped_at
    assert map_visible("0,1", X2, None).notes == []


@pytest.mark.parametrize("value,expected,stopped", [
    ("1,0", [1, 0], None),
    ("0,2", [0], "out of range"),
    ("2,0", [], "out of range"),
    ("0,abc,1", [0], "not a number"),
    ("0,-1,1", [0], "negative"),
    (f"{U0},0", [0], "int entry in a list of GPU entries"),
    ("GPU-", [], "has no UUID after its prefix"),
    ("GPU-36ca,GPU-7", [1, 0], None),
    ("GPU-ffff", [], "matches no device"),
])
def test_where_and_why_the_list_stops(value, expected, stopped):
    mapping = map_visible(value, X2, None)
    assert [d.physical_index for d in mapping.visible] == expected
    if stopped:
        assert stopped in mapping.stopped_at
        assert any("stops at" in n for n in mapping.notes)


def test_duplicates_hide_every_gpu_and_say_why():
    mapping = map_visible("1,0,1", X2, None)
    assert mapping.visible == [] and mapping.duplicates == ["1"]
    assert "cuInit error 101" in mapping.notes[0]


def test_remapping_table_from_the_article_is_corrected():
    """CUDA_VISIBLE_DEVICES=2,0,1 on 4 GPUs: physical 0 is visible, as logical 1 (article 003 was wrong)."""
    four = _derived(4)
    mapping = map_visible("2,0,1", four, "PCI_BUS_ID")
    assert [(d.logical, d.physical_index) for d in mapping.visible] == [(0, 2), (1, 0), (2, 1)]
    assert mapping.logical_of(0) == 1 and mapping.logical_of(3) is None


def test_fastest_first_puts_faster_gpus_first_and_pci_order_follows_nvidia_smi():
    topo = _derived(2)
    topo.gpus[0].cores = 6912  # an A100-class card at PCI position 0, an H200 at 1
    topo.gpus[0].name = "NVIDIA A100"
    assert [d.physical_index for d in map_visible(None, topo, None).visible] == [1, 0]
    assert [d.physical_index for d in map_visible(None, topo, "PCI_BUS_ID").visible] == [0, 1]
    assert [d.physical_index for d in map_visible("0", topo, "FASTEST_FIRST").visible] == [1]


def test_unknown_order_falls_back_to_fastest_first_with_a_note():
    mapping = map_visible(None, X2, "BOGUS")
    assert mapping.order == "FASTEST_FIRST" and "BOGUS" in mapping.notes[0]


def test_mig_instances_replace_their_gpu():
    topo = _derived(2)
    from torchplace.hardware.topology import MigInstance

    topo.gpus[1].mig_mode = "enabled"
    topo.gpus[1].mig = [MigInstance(uuid="MIG-aaaa-1111"), MigInstance(uuid="MIG-bbbb-2222")]
    mapping = map_visible(None, topo, "PCI_BUS_ID")
    assert [d.mig_uuid for d in mapping.visible] == [None, "MIG-aaaa-1111", "MIG-bbbb-2222"]
    only = map_visible("MIG-bbbb", topo, None)
    assert [(d.physical_index, d.mig_uuid) for d in only.visible] == [(1, "MIG-bbbb-2222")]
    assert "cuda:0 = physical 1 MIG slice" in only.visible[0].describe()


def test_summary_lists_what_is_visible():
    text = map_visible("1", X2, None).summary()
    assert "CUDA_VISIBLE_DEVICES='1' makes 1 GPU visible: cuda:0 = physical 1 (NVIDIA H200" in text


def test_no_gpus_at_all():
    empty = Topology(nvml_error="NVML Shared Library Not Found")
    assert map_visible(None, empty, None).visible == []
    assert map_visible("0", empty, None).stopped_at.startswith("'0' is out of range")
    assert "0..-1" not in map_visible("0", empty, None).stopped_at  # no GPU: "no device exists", not a range


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.none(), st.text(max_size=40),
                 st.lists(st.sampled_from(["0", "1", "2", "-1", " 1", "GPU-", U0[:9], U1, "MIG-x", "", "x"]),
                          max_size=5).map(",".join)),
       st.sampled_from([None, "PCI_BUS_ID", "FASTEST_FIRST", "weird"]))
def test_any_value_yields_a_mapping(value, order):
    mapping = map_visible(value, X2, order)
    assert len(mapping.visible) <= 2
    assert len({d.uuid for d in mapping.visible}) == len(mapping.visible)
    assert [d.logical for d in mapping.visible] == list(range(len(mapping.visible)))


def _derived(n: int) -> Topology:
    """An n-GPU topology derived from the real 2 x H200 snapshot (uuids and bus ids rewritten)."""
    data = json.loads(snapshot_path("h200x2").read_text())
    base = data["gpus"][0]
    data["gpus"] = [dict(base, index=i, uuid=f"GPU-{i:08x}-0000-0000-0000-000000000000",
                         pci_bus_id=f"00000000:{i + 6:02X}:00.0") for i in range(n)]
    data["links"] = []
    return Topology.from_dict(data)
