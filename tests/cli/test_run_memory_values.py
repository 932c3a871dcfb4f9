"""`torchplace run --memory SIZE` with values a user types: each bad one is a usage error (exit 2) that quotes
what was written and how to write it, never a traceback; a good one reaches the plan (h200x1 snapshot, --dry-run)."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize("value, said", [("0", "'0' is 0 bytes"), ("0.5", "'0.5' is 0 bytes"), ("-1", "negative"),
                                         ("1e30", "larger than any"), ("abc", "not understood"),
                                         ("200GiB", "140.4 GiB in all < 200.0 GiB")])
def test_a_memory_value_that_cannot_be_reserved_is_a_usage_error(value, said, tmp_path, run_cli, child_env):
    done = run_cli(["run", "--snapshot", "h200x1", "--memory", value, "--dry-run", "--", "true"],
                   env=child_env(TORCHPLACE_LEASE_DIR=str(tmp_path)))
    assert done.returncode == 2, done.stderr
    assert said in done.stderr and "Traceback" not in done.stderr


@pytest.mark.parametrize("value, nbytes", [("20 GB", 20 * 10**9), ("20GiB", 20 * 2**30)])
def test_a_memory_value_reaches_the_plan(value, nbytes, tmp_path, run_cli, child_env):
    done = run_cli(["run", "--snapshot", "h200x1", "--memory", value, "--dry-run", "--", "true"],
                   env=child_env(TORCHPLACE_LEASE_DIR=str(tmp_path)))
    assert done.returncode == 0, done.stderr
    assert f"TORCHPLACE_MEMORY_RESERVATION={nbytes}" in done.stdout
