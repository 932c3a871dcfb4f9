"""MPI and Lightning launch variables (launch.py) with garbage in them, as doctor and setup() see them.

doctor read only the variables `relevant_env` keeps, and it kept none of MPI's: a process started by
mpirun with OMPI_COMM_WORLD_SIZE=1e9 (or PMI_RANK past PMI_SIZE) got a clean report from doctor and a
DistributedError from setup(). A job id that is not a number (Open MPI 5's PRRTE ids, a hand-set
SLURM_JOB_ID) raised where it only picks a default port.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from torchplace.errors import DistributedError
from torchplace.hardware.facts import relevant_env
from torchplace.hardware.launch import MAX_WORLD_SIZE, check, read_launch_env, read_mpi

pytestmark = pytest.mark.timeout(300)
_LAUNCH_PREFIXES = ("OMPI_", "PMI_", "MV2_", "MPI_", "SLURM_", "RANK", "WORLD_SIZE", "LOCAL_", "MASTER_",
                    "NODE_RANK", "GROUP_", "TORCHELASTIC_")


def _doctor(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith(_LAUNCH_PREFIXES)}
    base.pop("TORCHPLACE_DEBUG", None)
    return subprocess.run([sys.executable, "-m", "torchplace", "doctor"], capture_output=True, text=True,
                          timeout=120, env={**base, "CUDA_VISIBLE_DEVICES": "", **env})


def test_doctor_sees_the_mpi_and_lightning_variables() -> None:
    env = {"OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
           "OMPI_COMM_WORLD_LOCAL_SIZE": "4", "OMPI_MCA_ess_base_jobid": "7", "MV2_COMM_WORLD_RANK": "0",
           "MV2_COMM_WORLD_SIZE": "1", "PMI_RANK": "0", "PMI_SIZE": "1", "MPI_LOCALRANKID": "0",
           "MPI_LOCALNRANKS": "1", "NODE_RANK": "0", "HOME": "/root"}
    kept = relevant_env(env)
    assert set(kept) == set(env) - {"HOME"}
    assert read_launch_env(kept) == read_launch_env(env)


@pytest.mark.parametrize(("env", "said"), [
    ({"OMPI_COMM_WORLD_SIZE": "1e9"}, "OMPI_COMM_WORLD_SIZE='1e9' is not an integer"),
    ({"OMPI_COMM_WORLD_SIZE": "\u0663"}, "is not an integer (ASCII digits"),
    ({"OMPI_COMM_WORLD_SIZE": "9" * 4000}, "has 4000 digits"),
    ({"PMI_SIZE": "2", "PMI_RANK": "5"}, "PMI_RANK=5 is not below PMI_SIZE=2"),
], ids=["float", "arabic-digit", "4000-digits", "rank-past-size"])
def test_doctor_reports_what_setup_would_refuse(env: dict[str, str], said: str) -> None:
    env = {"OMPI_COMM_WORLD_RANK": "0", **env}
    run = _doctor(env)
    assert "Traceback" not in run.stderr, run.stderr[-2000:]
    assert run.returncode == 1 and said in run.stdout + run.stderr, run.stdout[-2000:]
    assert "Fix:" in run.stdout


@pytest.mark.parametrize(("size", "said"), [
    (str(10**9), f"at most {MAX_WORLD_SIZE}"), ("-1", "is negative"), ("0", "must be at least 1"),
])
def test_crafted_mpi_world_sizes_are_refused_by_the_reading_or_the_check(size: str, said: str) -> None:
    env = {"OMPI_COMM_WORLD_SIZE": size, "OMPI_COMM_WORLD_RANK": "0", "MASTER_ADDR": "h", "MASTER_PORT": "29500"}
    with pytest.raises(DistributedError, match=said) as info:
        check(read_launch_env(env))
    assert "Fix:" in str(info.value) and "OMPI_COMM_WORLD_SIZE" in str(info.value)


@pytest.mark.parametrize("job", ["prterun-host-1234@1", "123_4", "", "\u0663"])
def test_a_job_id_that_is_no_number_derives_no_port_and_raises_nothing(job: str) -> None:
    env = {"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
           "OMPI_MCA_ess_base_jobid": job}
    mpi = read_mpi(env)
    assert mpi is not None and mpi.master_port is None and mpi.master_addr == "127.0.0.1"
    with pytest.raises(DistributedError, match="MASTER_PORT is not set"):
        check(mpi)


def test_a_4000_digit_job_id_gives_the_port_the_whole_number_gives() -> None:
    job = "1" + "0" * 3990 + "123456789"
    env = {"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "0", "SLURM_JOB_ID": job}
    mpi = read_mpi(env)
    assert mpi is not None and mpi.master_port == 15000 + 123456789 % 20000
    assert len(mpi.derived["MASTER_PORT"]) < 200  # the id is shown cut short


def test_empty_mpi_variables_are_no_mpi_launch() -> None:
    """`export PMI_RANK= PMI_SIZE=` left in a script: as unset, like every other launch variable."""
    assert read_mpi({"PMI_RANK": "", "PMI_SIZE": " "}) is None
    assert not read_launch_env({"PMI_RANK": "", "PMI_SIZE": ""}).launched


def test_two_mpi_flavours_that_disagree_read_the_most_specific() -> None:
    env = {"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "1", "PMI_SIZE": "4", "PMI_RANK": "3"}
    mpi = read_mpi(env)
    assert mpi is not None and (mpi.rank, mpi.world_size) == (1, 2)
    assert "PMI_RANK" not in mpi.variables
