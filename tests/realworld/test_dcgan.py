"""pytorch/examples dcgan/main.py (commit 77f55b9) as its author wrote it and ported to torchplace
(programs/dcgan.py): two models, two Adams, a fixed noise tensor, labels made with torch.full on the
device, a DataLoader with 2 workers. The port must give the same bits under TORCHPLACE_STRICT=1, explain
nothing wrong, continue from the pre-port netG/netD files, and resume a killed run to the same bits from
its save_async checkpoint (both models, both optimizers, the fixed noise)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import torchplace as tp
from realworld.launch import run_program

PROGRAM = "dcgan.py"


def results(text: str) -> list[str]:
    """The step and sample lines, each once (a restarted run repeats the batches after its checkpoint)."""
    lines = [line for line in text.splitlines() if re.match(r"(step|sample) ", line)]
    return list(dict.fromkeys(lines))


@pytest.fixture(scope="module")
def original(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str]]:
    out = tmp_path_factory.mktemp("original")
    return out, results(run_program(PROGRAM, "original", str(out), cwd=out).stdout)


def test_the_port_continues_from_the_pre_port_files_and_a_killed_run_resumes_to_the_same_bits(
        original, tmp_path: Path) -> None:
    folder, _ = original
    weights = ["--netG", str(folder / "netG_epoch_2.pth"), "--netD", str(folder / "netD_epoch_2.pth")]
    (tmp_path / "o").mkdir()
    expected = results(run_program(PROGRAM, "original", str(tmp_path / "o"), "2", "-", *weights, cwd=tmp_path).stdout)
    (tmp_path / "p" / "ckpt").mkdir(parents=True)
    run = run_program(PROGRAM, "ported", str(tmp_path / "p"), "2", "1:1", *weights, cwd=tmp_path, max_restarts=1,
                      env={"TORCHPLACE_STRICT": "1"})
    assert "resumed after epoch 0" in run.stdout, run.stdout[-2000:]
    assert results(run.stdout) == expected and len(expected) == 2 * (4 + 2)  # tp.load read the pre-port files
    assert run.stdout.count("explain: []") == 2 and "saved epoch-001.safetensors" in run.stdout
    saved = torch.load(tmp_path / "p" / "netG_epoch_1.pth", weights_only=True)  # what torch.load gives
    pre_port = torch.load(tmp_path / "o" / "netG_epoch_1.pth", weights_only=True)
    assert all(torch.equal(saved["model"][k], v) for k, v in pre_port.items())
    ck = tp.load(tmp_path / "p" / "ckpt", device="cpu")  # the newest complete one, every part the resume needs
    assert {"model", "optimizer", "netD", "optimizerD", "fixed_noise"} <= set(ck.state) and ck.extra["epoch"] == 1


def test_the_pre_port_reader_continues_from_the_ports_weights(original, tmp_path: Path) -> None:
    folder, _ = original
    state = torch.load(folder / "netG_epoch_2.pth", weights_only=True)  # the pre-port file: a bare state dict
    tp.save(tmp_path / "netG_epoch_2.pth", model=state, weights_only=True)  # the port's save of the same weights
    assert set(torch.load(tmp_path / "netG_epoch_2.pth", weights_only=True)) == set(state)
