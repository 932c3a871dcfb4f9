"""A new user's first commands, with the mistakes people make: each answer names what was typed,
what it means here and the spelling that works; one line, exit 2, no traceback."""

from __future__ import annotations

import pytest
from snapshots import snapshot_path

from torchplace.cli import main

X2 = str(snapshot_path("h200x2"))


def error_of(capsys, *argv: str) -> str:
    assert main(list(argv)) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    return err


@pytest.mark.parametrize("option,value", [("--min-free-memory", "-5MB"), ("--wait", "-1s")])
def test_a_value_starting_with_a_dash_is_named_with_the_spelling_that_passes_it(capsys, option, value):
    """argparse read '-5MB' as the next option and said only 'expected one argument'."""
    err = error_of(capsys, "pick", "--snapshot", X2, option, value)
    assert f"'{value}' after {option} starts with '-', so it was read as an option" in err
    assert f"Fix: write {option}={value}" in err and "torchplace pick --help" in err


def test_the_equals_spelling_reaches_the_value_check(capsys):
    err = error_of(capsys, "pick", "--snapshot", X2, "--min-free-memory=-5MB")
    assert "size '-5MB' is negative; a size is 0 or more, e.g. 20GiB" in err


def test_sizes_in_scientific_notation_and_percentages_with_a_sign_are_taken(capsys):
    assert main(["pick", "--snapshot", X2, "--min-free-memory", "1e3MB", "--max-utilization", "50%"]) == 0
    assert capsys.readouterr().out.startswith("GPU-")


@pytest.mark.parametrize("value,said", [
    ("0", "'0' is too small (at least 1): give a number of GPUs"),  # was "(at least 1).: give"
    ("-1", "'-1' is negative: give a number of GPUs"),  # was "is not a whole number"
])
def test_a_gpu_count_below_one_says_why(capsys, value, said):
    assert said in error_of(capsys, "pick", "--snapshot", X2, "--count", value)


def test_a_utilization_that_is_no_number_asks_for_a_percentage(capsys):
    assert "write a percentage, e.g. 80" in error_of(capsys, "pick", "--snapshot", X2, "--max-utilization", "most")


@pytest.mark.parametrize(("argv", "said"), [
    (["dcotor"], "invalid choice: 'dcotor' (choose from 'doctor', "),
    (["doctor", "--jsn"], "unrecognized arguments: --jsn; did you mean '--json'? See `torchplace doctor --help`."),
    (["bench", "diagnse"], "did you mean 'diagnose'? See `torchplace bench --help`."),
    (["ckpt", "convert", "a", "b", "--weight-only"], "did you mean '--weights-only'? See `torchplace ckpt convert"),
])
def test_a_misspelt_command_or_option_gets_a_did_you_mean(capsys, argv, said):
    message = error_of(capsys, *argv)
    assert said in message and message.startswith("torchplace: error: ")
    assert "did you mean" in message


def test_every_usage_error_has_one_prefix(capsys):
    """`torchplace ckpt convert: error:` beside `torchplace: error:`: one prefix, the command in the help hint."""
    for argv in (["ckpt"], ["bench"], ["map", "--snapshot"], ["ckpt", "convert", "--nope", "a", "b"]):
        assert error_of(capsys, *argv).startswith("torchplace: error: "), argv
