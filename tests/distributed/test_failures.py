"""Known distributed failures get messages that say what to do. The texts are torch's own,
captured from torch 2.13 (store and gloo) and from NCCL's watchdog format."""

from __future__ import annotations

import pytest

from torchplace.distributed.failures import explain, explained
from torchplace.errors import DistributedError
from torchplace.hardware.launch import read_launch_env

LAUNCH = read_launch_env({"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "MASTER_ADDR": "node0",
                          "MASTER_PORT": "29500"})


def test_port_in_use():
    text = ("The server socket has failed to listen on any local network address. port: 29500, useIpv6: false, "
            "code: -98, name: EADDRINUSE, message: address already in use")
    err = explain(RuntimeError(text), LAUNCH)
    assert "Port 29500 is already in use" in str(err) and "MASTER_PORT" in str(err) and "--standalone" in str(err)


def test_ranks_that_never_connected():
    err = explain("Timed out after 30 seconds waiting for clients. 1/4 clients joined.", LAUNCH)
    assert str(err).startswith("Only 1 of WORLD_SIZE=4 processes connected to MASTER_ADDR='node0' "
                               "MASTER_PORT=29500 within 30 s")


def test_store_unreachable():
    err = explain("The client socket has timed out after 8000ms while trying to connect to (node0, 29500).", LAUNCH)
    assert "rank 1 (RANK=1, WORLD_SIZE=4) could not reach the rendezvous store at node0:29500 within 8 s" in str(err)


def test_nccl_watchdog_timeout():
    text = ("[Rank 1] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=812, OpType=ALLREDUCE, "
            "NumelIn=1, NumelOut=1, Timeout(ms)=600000) ran for 600012 milliseconds before timing out.")
    err = explain(text, LAUNCH)
    assert str(err).startswith("ALLREDUCE #812 did not finish on rank 1")
    assert "health_check" in str(err) and "NCCL_DEBUG=INFO" in str(err)


def test_duplicate_gpu():
    err = explain("NCCL error: invalid usage ... Duplicate GPU detected : rank 0 and rank 1 both on CUDA device 1a000",
                  LAUNCH)
    assert "Ranks 0 and 1 both use CUDA device 1a000" in str(err)


def test_unknown_errors_pass_through_unchanged():
    assert explain(RuntimeError("shape mismatch"), LAUNCH) is None
    original = RuntimeError("shape mismatch")
    with pytest.raises(RuntimeError) as info:
        with explained(LAUNCH):
            raise original
    assert info.value is original


def test_explained_converts_known_failures():
    with pytest.raises(DistributedError, match="Port 29500 is already in use") as info:
        with explained(LAUNCH):
            raise RuntimeError("port: 29500, useIpv6: false, code: -98, name: EADDRINUSE")
    assert isinstance(info.value.__cause__, RuntimeError)
