"""Reading torch's flight recorder: a restricted unpickler, and real dumps from gloo groups."""

from __future__ import annotations

import json
import pickle
import sys

import pytest

from torchplace.distributed.flight_recorder import load_dump, read_traces, recorder_env, summarize
from torchplace.errors import DistributedError


class _Boom:
    def __reduce__(self):
        return (print, ("code from the file ran",))


def test_a_dump_that_names_any_global_is_refused_not_run(tmp_path, capsys):
    path = tmp_path / "fr_rank_0"
    path.write_bytes(pickle.dumps({"entries": [], "x": _Boom()}))
    with pytest.raises(DistributedError,
                       match=r"not a flight recorder dump torchplace can read safely .*builtins.print"):
        load_dump(path)
    assert "code from the file ran" not in capsys.readouterr().out
    path.write_bytes(pickle.dumps([1, 2]))
    with pytest.raises(DistributedError, match="holds list, not a flight recorder dump"):
        load_dump(path)


def test_recorder_env_names_both_spellings(tmp_path):
    env = recorder_env(tmp_path, entries=50)
    assert env["TORCH_NCCL_TRACE_BUFFER_SIZE"] == env["TORCH_FR_BUFFER_SIZE"] == "50"
    assert env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert env["TORCH_FR_DUMP_TEMP_FILE"] == env["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] == str(tmp_path / "fr_rank_")


@pytest.mark.slow
def test_the_rank_that_never_entered_the_collective_is_named(tmp_path, run_cli, scripts, child_env):
    """Two gloo ranks through `torchplace run --flight-recorder`: rank 1 stops after 3 all-reduces, rank 0
    enters a 4th; both dump (gloo has no dump on timeout; the script calls dump_here), rank 0 exits 3,
    torchrun stops rank 1, and torchplace run prints the verdict from the dumps."""
    out = run_cli(["run", "--gpus", "none", "--nproc", "2", "--flight-recorder", str(tmp_path / "fr"), "--",
                   sys.executable, str(scripts / "hang_worker.py"), "gloo", "30"], env=child_env(), timeout=180)
    assert out.returncode == 3, out.stderr[-3000:]
    traces = read_traces(tmp_path / "fr")
    assert [t.rank for t in traces] == [0, 1]
    assert traces[0].last_enqueued["0"] >= 4 and traces[1].last_enqueued["0"] == 3
    summary = summarize(traces)
    [stuck] = summary.stuck
    assert (stuck["op"], stuck["seq"], stuck["behind"], stuck["entered"]) == ("all_reduce", 4, {1: 3}, [0])
    assert "hang_worker.py" in stuck["where"]
    assert "rank 1 (last entered #3) never entered all_reduce #4 of process group 0" in out.stderr
    assert [json.loads(line)["rank"] for line in out.stdout.splitlines() if line.startswith("{")] in ([0, 1], [1, 0])
