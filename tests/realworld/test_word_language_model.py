"""pytorch/examples word_language_model/main.py (commit 77f55b9) as its author wrote it and ported to torchplace
(programs/word_language_model.py): an LSTM with tied weights whose hidden state is carried from batch to
batch, plain SGD by hand, dropout. The port must train to the same bits, resume a killed run to the same
bits (hidden state, lr and dropout's generator restored mid-epoch), keep strict mode silent, and write a
best-model file torch.load(weights_only=True) reads."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from realworld.launch import run_program

PROGRAM = "word_language_model.py"


def results(text: str) -> list[str]:
    """The program's loss, valid and test lines, in order."""
    return [line for line in text.splitlines() if re.match(r"(loss|valid|test) ", line)]


@pytest.fixture(scope="module")
def original(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    out = tmp_path_factory.mktemp("original")
    return results(run_program(PROGRAM, "original", str(out), cwd=out).stdout)


def test_the_port_trains_to_the_same_bits_and_its_best_model_loads_with_torch(original: list[str],
                                                                              tmp_path: Path) -> None:
    (tmp_path / "ckpt").mkdir()
    run = run_program(PROGRAM, "ported", str(tmp_path), cwd=tmp_path)
    assert results(run.stdout) == original
    assert len(original) == 3 * 15 + 3 + 1 and original[-1].startswith("test ")
    assert "strict mode: errors on device mistakes" in run.stderr and "Error" not in run.stderr
    saved = torch.load(tmp_path / "model.pt", weights_only=True)  # the reader a user keeps
    state = saved["model"]
    assert {"encoder.weight", "decoder.weight", "decoder.bias", "rnn.weight_hh_l1"} <= set(state)
    assert state["decoder.weight"].data_ptr() == state["encoder.weight"].data_ptr()  # still one tied tensor


def test_a_run_killed_mid_epoch_resumes_to_the_same_bits(original: list[str], tmp_path: Path) -> None:
    (tmp_path / "ckpt").mkdir()
    run = run_program(PROGRAM, "ported", str(tmp_path), "3", "2:7", cwd=tmp_path, max_restarts=1)
    text = run.stdout
    resumed = re.search(r"resumed at epoch (\d+) batch (\d+) \(step (\d+)\)", text)
    assert resumed and (int(resumed[1]), int(resumed[2])) == (2, 6), text[-2000:]  # the last save before the kill
    first, again = text.split(resumed[0])
    assert results(first) == original[:len(results(first))]
    start = next(i for i, line in enumerate(original) if line.startswith("loss 2 6 "))
    assert results(again) == original[start:]  # the batches after the checkpoint, the hidden state carried
    assert "continuing from" in run.stderr and "step-00021.safetensors" in run.stderr


def test_explain_at_the_top_of_the_step_changes_no_result(original: list[str], tmp_path: Path) -> None:
    (tmp_path / "ckpt").mkdir()
    run = run_program(PROGRAM, "ported", str(tmp_path), "3", "-", "1", cwd=tmp_path)
    assert results(run.stdout) == original
