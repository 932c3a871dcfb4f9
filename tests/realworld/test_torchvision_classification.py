"""torchvision's references/classification/train.py (pytorch/vision 017e9b99) as its authors wrote it (torchrun,
gloo, 2 ranks) and ported to torchplace (programs/torchvision_classification.py, under `torchplace run --gpus
none`): mixup/cutmix in the collate_fn, dropout, an EMA model, SGD over two parameter groups, a warm-up
SequentialLR, DDP, and every epoch's {model, optimizer, lr_scheduler, epoch, args, model_ema} checkpoint.
The port must give the same bits on both ranks, come back from a SIGKILLed rank through torchrun's restart
and setup(resume="auto") to the same bits, write files torchvision's own resume code reads with
torch.load(weights_only=True), and read the pre-port files (a pickled argparse.Namespace inside, plain data that
runs no code: read without trust_pickle, as timm's own reader does)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from torch import nn

import torchplace as tp
from realworld.launch import run_program

PROGRAM = "torchvision_classification.py"


def results(text: str) -> tuple[list[tuple[str, ...]], list[tuple[str, ...]]]:
    """Each rank's (rank, epoch, batch, loss, lr), once each, sorted; and rank 0's test lines, in order, each
    epoch once (ranks print at once, so lines may interleave: matched by pattern, not by line)."""
    losses = sorted(set(re.findall(r"\[rank (\d)\] loss (\d+) (\d+) ([-0-9.e]+) lr ([-0-9.e]+)", text)))
    tests = re.findall(r"Test: (EMA )?\s*samples (\d+) loss ([-0-9.e]+) acc1 ([-0-9.e]+)", text)
    return losses, list(dict.fromkeys(tests))


def build() -> tuple[nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler, nn.Module]:
    """The program's model, optimizer, scheduler and EMA model, for torchvision's resume code run here."""
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                          nn.Flatten(), nn.Dropout(0.2), nn.Linear(8, 5))
    groups = [{"params": list(model[1].parameters()), "weight_decay": 0.0},
              {"params": [*model[0].parameters(), *model[6].parameters()], "weight_decay": 1e-4}]
    optimizer = torch.optim.SGD(groups, lr=0.1, momentum=0.9, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.SequentialLR(optimizer, [
        torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.01, total_iters=1),
        torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=2)], milestones=[1])
    return model, optimizer, scheduler, torch.optim.swa_utils.AveragedModel(model, use_buffers=True)


@pytest.fixture(scope="module")
def original(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    out = tmp_path_factory.mktemp("original")
    return out, run_program(PROGRAM, "original", str(out), cwd=out, nproc=2).stdout


def test_the_port_gives_the_same_bits_and_a_killed_rank_resumes_exactly(original, tmp_path: Path) -> None:
    _, expected = original
    run = run_program(PROGRAM, "ported", str(tmp_path), "--kill-at", "2", cwd=tmp_path, nproc=2, max_restarts=1,
                      cli=True)
    text = run.stdout + run.stderr
    assert "[rank 0] resumed from " in text and "[rank 1] resumed from " in text, text[-3000:]
    assert re.search(r"resumed from (model_1|checkpoint)\.pth at epoch 2", text)
    losses, tests = results(run.stdout)
    expected_losses, expected_tests = results(expected)
    assert losses == expected_losses and len(losses) == 2 * 3 * 4  # both ranks' generators came back (all_ranks)
    # Each rank's EMA averages its own BatchNorm statistics (DDP syncs gradients only), and a checkpoint holds
    # rank 0's: after any resume, rank 1's EMA is rank 0's, so the EMA's evaluation (all ranks') moves a little.
    ema = dict(re.findall(r"\[rank (\d)\] ema running_mean 1 ([-0-9.e]+)", expected))
    assert ema["0"] != ema["1"]
    assert tests[:5] == expected_tests[:5] and len(tests) == 2 * 3
    assert tests[5][0] == "EMA " and abs(float(tests[5][2]) - float(expected_tests[5][2])) < 1e-3
    checkpoint = torch.load(tmp_path / "checkpoint.pth", map_location="cpu", weights_only=True)
    model, optimizer, lr_scheduler, model_ema = build()  # torchvision's resume, on the port's file
    model.load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(checkpoint["optimizer"])
    lr_scheduler.load_state_dict(checkpoint["lr_scheduler"])
    model_ema.load_state_dict(checkpoint["model_ema"])
    assert checkpoint["epoch"] == 2 and checkpoint["args"]["batch_size"] == 4 and lr_scheduler.last_epoch == 3
    assert int(model_ema.n_averaged) > 0 and len(optimizer.state) == 6


def test_the_pre_port_checkpoint_loads_without_trusting_its_namespace(original) -> None:
    folder, _ = original
    path = folder / "checkpoint.pth"
    model, optimizer, lr_scheduler, model_ema = build()
    ck = tp.load(path, model=model, optimizer=optimizer, lr_scheduler=lr_scheduler, model_ema=model_ema)
    saved = torch.load(path, map_location="cpu", weights_only=False)
    assert ck["epoch"] == 2 and ck["args"].batch_size == 4
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in saved["model"].items())
    assert all(torch.equal(v, model_ema.state_dict()[k]) for k, v in saved["model_ema"].items())
    assert lr_scheduler.last_epoch == saved["lr_scheduler"]["last_epoch"] and len(optimizer.state) == 6
