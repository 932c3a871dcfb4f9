"""Crafted flight recorder dumps (`torchplace run` reads them whenever TORCH_FR_DUMP_TEMP_FILE is set,
often in a folder others can write): objects shared through the pickle memo by every entry, a
profiling name that is a 40-deep [x, x] tree, and fields of the wrong type. Each must cost work in
proportion to the file and fail, if at all, with DistributedError. Memory is measured in a child;
the time bound only catches a hang."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from torchplace.distributed.flight_recorder import read_traces, summarize
from torchplace.errors import DistributedError

HANG = 120
BOUND = 2**28  # max(2 x input, 256 MiB)

CHILD = textwrap.dedent("""
    import json, resource, sys
    resource.setrlimit(resource.RLIMIT_AS, (6 * 2**30, 6 * 2**30))
    from torchplace.distributed.flight_recorder import read_traces, summarize
    from torchplace.errors import DistributedError
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    try:
        result = "read: " + summarize(read_traces(sys.argv[1])).describe()[:2000]
    except DistributedError as exc:
        result = "DistributedError: " + str(exc)
    except BaseException as exc:
        result = "other " + type(exc).__name__ + ": " + str(exc)[:300]
    grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024
    print(json.dumps({"result": result, "grown": grown}))
""")

FRAME = {"filename": "/site-packages/torch/distributed/distributed_c10d.py", "line": 3245, "name": "all_reduce"}


def entry(seq: int, **fields) -> dict:
    """An entry as torch 2.13 writes it (gloo all_reduce), with FIELDS replaced."""
    base = {"collective_seq_id": seq, "p2p_seq_id": 0, "pg_id": 0, "process_group": ("0", "default_pg"),
            "profiling_name": "gloo:all_reduce", "state": "completed", "is_p2p": False,
            "input_sizes": [[3, 2]], "frames": [FRAME, {"filename": "train.py", "line": 4, "name": "step"}]}
    return {**base, **fields}


def write(folder: Path, rank: int, entries: list, **top) -> Path:
    folder.mkdir(exist_ok=True)
    path = folder / f"fr_rank_{rank}"
    path.write_bytes(pickle.dumps({"version": "2.10", "entries": entries, **top}, protocol=4))
    return path


def read_in_child(folder: Path) -> dict:
    run = subprocess.run([sys.executable, "-c", CHILD, str(folder)], capture_output=True, text=True, timeout=HANG)
    assert run.returncode == 0, run.stderr[-2000:]
    return json.loads(run.stdout.splitlines()[-1])


def shared_sizes(folder: Path) -> None:
    sizes = [[1024, 1024]] * 150_000  # one list, in every entry
    write(folder, 0, [entry(i, input_sizes=sizes) for i in range(1, 4_001)])
    write(folder, 1, [entry(i, input_sizes=sizes) for i in range(1, 11)])


def shared_frames(folder: Path) -> None:
    frames = [FRAME] * 20_000  # torch's own frames only: the walk for a user frame goes to the end
    write(folder, 0, [{"collective_seq_id": i, "frames": frames} for i in range(1, 40_001)])
    write(folder, 1, [entry(i) for i in range(1, 11)])


def deep_name(folder: Path) -> None:
    name: object = "x"
    for _ in range(40):
        name = [name, name]  # 2**40 leaves, 200 bytes through the memo
    write(folder, 0, [entry(1, profiling_name=name)])


def a_group_per_entry(folder: Path) -> None:
    """40,000 process groups that rank 1 never joined: the verdict looked each one up in every entry."""
    write(folder, 0, [{"collective_seq_id": 1, "pg_id": i, "state": "started"} for i in range(40_000)])
    write(folder, 1, [entry(1)])


@pytest.mark.parametrize("craft", [shared_sizes, shared_frames, deep_name, a_group_per_entry],
                         ids=["sizes-shared-by-every-entry", "frames-shared-by-every-entry", "name-40-deep",
                              "a-group-per-entry"])
def test_a_small_dump_costs_its_size(tmp_path: Path, craft) -> None:
    craft(tmp_path / "fr")
    assert sum(p.stat().st_size for p in (tmp_path / "fr").iterdir()) < 2**20
    got = read_in_child(tmp_path / "fr")
    assert not got["result"].startswith("other"), got["result"]
    assert got["grown"] < BOUND, f"{got['grown'] >> 20} MiB"
    if craft is deep_name:
        assert "profiling_name is a list, not a string" in got["result"]
    else:  # a well-formed dump: the verdict names the rank behind
        assert "rank 1 (last entered #" in got["result"], got["result"]


@pytest.mark.parametrize("fields, what", [
    ({"collective_seq_id": float("inf")}, "not a sequence number"),
    ({"collective_seq_id": 10**30}, "not a sequence number"),
    ({"frames": 5}, "frames is a int, not a list"),
    ({"frames": [7]}, "a frame is a int, not a dict"),
    ({"frames": [{"filename": "t.py", "line": "x"}]}, "not a number"),
    ({"input_sizes": [5]}, "an input size is 5"),
    ({"process_group": ([1, 2], "pg")}, "a process group id is a list"),
    ({"state": {"a": 1}}, "state is a dict, not a string"),
], ids=["seq-inf", "seq-huge", "frames-int", "frame-int", "line-str", "size-int", "group-list", "state-dict"])
def test_a_malformed_field_is_a_distributed_error(tmp_path: Path, fields: dict, what: str) -> None:
    path = write(tmp_path / "fr", 0, [entry(1, **fields)])
    with pytest.raises(DistributedError, match=rf"{path} is not a flight recorder dump as torch writes it: .*"
                                               rf"{what}.*Fix: point at the files TORCH_FR_DUMP_TEMP_FILE names"):
        summarize(read_traces(tmp_path / "fr")).describe()


@pytest.mark.parametrize("top", [{"pg_status": [1]}, {"pg_status": {"0": {"last_enqueued_collective": "x"}}},
                                 {"pg_status": {(("a",) * 3,): {}}}], ids=["list", "str-seq", "tuple-key"])
def test_a_malformed_status_table_is_a_distributed_error(tmp_path: Path, top: dict) -> None:
    write(tmp_path / "fr", 0, [entry(1)], **top)
    with pytest.raises(DistributedError, match="not a flight recorder dump as torch writes it"):
        read_traces(tmp_path / "fr")
