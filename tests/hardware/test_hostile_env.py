"""Launch variables with garbage in them: refused with one DistributedError, in bounded memory and time.

A variable is a short string, so nothing it says may cost more than a bounded amount: the memory
cases run in a child with its address space capped, so a regression fails instead of taking the
machine down (the cap is a guard, not a measurement).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from torchplace.errors import DistributedError
from torchplace.hardware.launch import MAX_WORLD_SIZE, check, expand_nodelist, parse_tasks_per_node, read_launch_env

pytestmark = pytest.mark.timeout(300)


@pytest.mark.parametrize("nodelist", ["r[0-99999]n[0-99999]", "n[" + ",".join(["0-99999"] * 12) + "]",
                                      "a[0-999]b[0-999]c[0-999]"])
def test_a_node_list_naming_billions_of_hosts_is_refused(nodelist: str) -> None:
    """Each range was capped at 100,000, but bracket groups multiply: 10**10 names from 20 characters."""
    with pytest.raises(DistributedError, match=f"more than {MAX_WORLD_SIZE} hosts"):
        expand_nodelist(nodelist)


def test_tasks_per_node_repeating_a_billion_times_is_refused() -> None:
    """'2(x999999999)' was expanded into a list of a billion ints (MemoryError)."""
    with pytest.raises(DistributedError, match="LOCAL_WORLD_SIZE"):
        parse_tasks_per_node("2(x999999999)")
    assert parse_tasks_per_node("2(x3),1") == [2, 2, 2, 1]


@pytest.mark.parametrize("world", ["2000000000", str(MAX_WORLD_SIZE + 1)])
def test_a_world_size_beyond_any_job_is_refused_before_joining(world: str) -> None:
    """WORLD_SIZE=2000000000 passed the C-int check and joining built a key per rank: 5 GiB, then MemoryError."""
    with pytest.raises(DistributedError, match="more processes than any job has"):
        check(read_launch_env({"RANK": "0", "WORLD_SIZE": world, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}))


CHILD = textwrap.dedent('''
    import json, resource, sys
    resource.setrlimit(resource.RLIMIT_AS, (3 * 2**30, 3 * 2**30))
    import torchplace as tp
    try:
        tp.dist.init(env={"RANK": "0", "WORLD_SIZE": "2000000000", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                          "MASTER_PORT": "1"}, backend="gloo", timeout="5s", join_timeout="5s")
        print(json.dumps("joined"))
    except tp.TorchplaceError as exc:
        print(json.dumps(type(exc).__name__))
''')


def test_dist_init_with_a_huge_world_size_fails_at_once_in_bounded_memory() -> None:
    run = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert json.loads(run.stdout.splitlines()[-1]) == "DistributedError"


LAUNCH_VARS = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
               "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_JOB_NODELIST", "SLURM_TASKS_PER_NODE",
               "SLURM_STEP_NODELIST", "SLURM_STEP_TASKS_PER_NODE", "SLURM_NODEID", "SLURM_JOB_ID"]
NODELISTS = r"[a-z]{0,3}\[[0-9,\-\[\]]{0,20}\][a-z0-9\[\]\-]{0,12}"
TASK_COUNTS = r"[0-9]{1,12}(\(x[0-9]{1,12}\))?(,[0-9]{1,4}(\(x[0-9]{1,12}\))?){0,3}"
garbage = st.one_of(st.text(max_size=40), st.from_regex(NODELISTS, fullmatch=True),
                    st.from_regex(TASK_COUNTS, fullmatch=True), st.integers(-2**70, 2**70).map(str))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(st.sampled_from(LAUNCH_VARS), garbage, max_size=8))
def test_any_launch_variables_read_or_raise_distributed_error(env: dict[str, str]) -> None:
    """Every value a variable can hold: a LaunchEnv that checks out, or one DistributedError."""
    try:
        check(read_launch_env(env))
    except DistributedError:
        pass


@pytest.mark.parametrize("nodelist", ["n[0-99999]" + "[0]" * 200, "n" + "[0]" * 20_000, "n[" + "9" * 5000 + "]",
                                      "n[0-99999],m[0-99999]," * 6])
def test_a_small_node_list_is_expanded_in_proportion_or_refused(nodelist: str) -> None:
    """610 bytes hung `torchplace doctor`: the rest of the name was re-expanded for every number of a range.
    20,000 bracket groups recursed past Python's limit and 5000 digits passed int()'s: not DistributedError."""
    try:
        hosts = expand_nodelist(nodelist)
    except DistributedError as exc:
        assert "Fix: set MASTER_ADDR" in str(exc)
        assert len(str(exc)) < 400
    else:
        tail = "0" * nodelist.count("[0]")
        assert hosts[0] == "n0" + tail if "[0-99999]" in nodelist else hosts == ["n" + tail]
        assert len(hosts) in (1, 100_000)


def test_bracket_groups_expand_like_scontrol() -> None:
    assert expand_nodelist("r[1-2]n[07,9],gpu5,x[0]y") == ["r1n07", "r1n9", "r2n07", "r2n9", "gpu5", "x0y"]
