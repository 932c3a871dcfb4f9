"""hardware.launch: reading what torchrun or srun set, and the consistency checks."""

from __future__ import annotations

import pytest

from torchplace.errors import DistributedError
from torchplace.hardware.launch import check, first_host, local_rank, parse_tasks_per_node, read_launch_env

TORCHRUN = {"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1",
            "MASTER_ADDR": "node0", "MASTER_PORT": "29400", "TORCHELASTIC_RUN_ID": "job7",
            "TORCHELASTIC_RESTART_COUNT": "2", "TORCHELASTIC_USE_AGENT_STORE": "True"}


def test_local_rank_sources():
    assert local_rank({}) is None
    assert local_rank({"LOCAL_RANK": "2"}) == 2
    assert local_rank({"SLURM_LOCALID": "3"}) == 3
    assert local_rank({"LOCAL_RANK": "1", "SLURM_LOCALID": "3"}) == 1
    # a torchrun-style launch without LOCAL_RANK does not borrow SLURM's value
    assert local_rank({"RANK": "0", "SLURM_LOCALID": "3"}) is None


@pytest.mark.parametrize("value", ["x", "1.5", "-1"])
def test_local_rank_rejects_garbage_with_the_variable_named(value):
    with pytest.raises(DistributedError, match=rf"LOCAL_RANK='{value}'"):
        local_rank({"LOCAL_RANK": value})


def test_torchrun_environment():
    env = read_launch_env(TORCHRUN)
    assert (env.launcher, env.rank, env.local_rank, env.world_size, env.local_world_size) == ("torchrun", 3, 1, 4, 2)
    assert (env.node_rank, env.master_addr, env.master_port) == (1, "node0", 29400)
    assert env.restart_count == 2 and env.run_id == "job7" and env.use_agent_store
    check(env)  # consistent


def test_plain_process_is_not_launched():
    env = read_launch_env({"HOME": "/root"})
    assert not env.launched and env.rank is None
    check(env)


def test_manual_env_launch():
    env = read_launch_env({"RANK": "0", "WORLD_SIZE": "1"})
    assert env.launcher == "env" and env.world_size == 1
    check(env)  # one process needs no rendezvous address


def test_slurm_environment_derives_address_and_port():
    env = read_launch_env({"SLURM_PROCID": "5", "SLURM_LOCALID": "1", "SLURM_NTASKS": "8", "SLURM_NODEID": "2",
                           "SLURM_STEP_TASKS_PER_NODE": "2(x3),2", "SLURM_JOB_NODELIST": "gpu[07-09,12]",
                           "SLURM_JOB_ID": "4242"})
    assert (env.launcher, env.rank, env.local_rank, env.world_size, env.local_world_size) == ("slurm", 5, 1, 8, 2)
    assert env.master_addr == "gpu07" and env.master_port == 15000 + 4242
    assert "MASTER_ADDR" in env.derived and "SLURM_JOB_ID=4242" in env.derived["MASTER_PORT"]
    check(env)


def test_torchrun_variables_win_over_slurm():
    env = read_launch_env({**TORCHRUN, "SLURM_PROCID": "0", "SLURM_NTASKS": "1"})
    assert env.launcher == "torchrun" and env.rank == 3


@pytest.mark.parametrize("text,expected", [("2(x3),1", [2, 2, 2, 1]), ("4", [4]), ("1,2", [1, 2])])
def test_parse_tasks_per_node(text, expected):
    assert parse_tasks_per_node(text) == expected


def test_parse_tasks_per_node_error():
    with pytest.raises(DistributedError, match=r"'2\(y3\)'"):
        parse_tasks_per_node("2(y3)")


@pytest.mark.parametrize("text,expected", [("node1", "node1"), ("a,b", "a"), ("gpu[07-09,12],cpu1", "gpu07"),
                                           ("cpu1,gpu[3-4]", "cpu1"), ("x-[5]", "x-5")])
def test_first_host(text, expected):
    assert first_host(text) == expected


def test_rank_past_world_size_names_both_variables():
    env = read_launch_env({"RANK": "2", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"})
    with pytest.raises(DistributedError, match=r"RANK=2 is not below WORLD_SIZE=2 \(ranks run 0\.\.1\)"):
        check(env)


def test_every_problem_is_listed_with_the_values_read():
    env = read_launch_env({"RANK": "0", "LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "2"})
    with pytest.raises(DistributedError) as info:
        check(env)
    text = str(info.value)
    assert "WORLD_SIZE is not set" in text
    assert "LOCAL_RANK=3 is not below LOCAL_WORLD_SIZE=2" in text
    assert "LOCAL_RANK='3'" in text and "torchplace run" in text


def test_missing_rendezvous_address_and_bad_port():
    env = read_launch_env({"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "70000"})
    with pytest.raises(DistributedError, match=r"MASTER_ADDR is not set.*MASTER_PORT=70000 is not a usable port"):
        check(env)


def test_local_world_size_larger_than_world():
    env = read_launch_env({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "4", "MASTER_ADDR": "h",
                           "MASTER_PORT": "29500"})
    with pytest.raises(DistributedError, match="LOCAL_WORLD_SIZE=4 is larger than WORLD_SIZE=2"):
        check(env)


def test_slurm_messages_use_slurm_names():
    env = read_launch_env({"SLURM_PROCID": "4", "SLURM_NTASKS": "4", "MASTER_ADDR": "h", "MASTER_PORT": "2"})
    with pytest.raises(DistributedError, match="SLURM_PROCID=4 is not below SLURM_NTASKS=4"):
        check(env)


@pytest.mark.parametrize("value,match", [
    ("\u0661", "not an integer"), ("\uff12", "not an integer"), ("\u00b2", "not an integer"), ("1_0", "not an integer"),
    ("1" * 5000, "5000 digits"),
])
def test_integers_are_ascii_digits_only(value, match):
    """int() takes Unicode digits and underscores; the launchers never write them."""
    with pytest.raises(DistributedError, match=match):
        read_launch_env({"RANK": "0", "WORLD_SIZE": value})


@pytest.mark.parametrize("change,match", [
    ({"WORLD_SIZE": "3000000000", "RANK": "0"}, r"WORLD_SIZE=3000000000 is larger than torch.distributed can count"),
    ({"MASTER_ADDR": "node0\x00evil"}, r"MASTER_ADDR='node0\\x00evil' contains a NUL byte"),
    ({"MASTER_ADDR": "node0 node1"}, "whitespace or a control character"),
    ({"MASTER_ADDR": "n" * 300}, "300 characters long"),
    ({"LOCAL_RANK": "3000000000", "LOCAL_WORLD_SIZE": ""}, "larger than a device index can be"),
])
def test_values_torch_cannot_take_are_refused_before_any_network_call(change, match):
    with pytest.raises(DistributedError, match=match):
        check(read_launch_env({**TORCHRUN, **change}))
