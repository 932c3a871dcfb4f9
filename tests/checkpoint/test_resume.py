"""Resuming from a checkpoint gives the same losses, bit for bit on the CPU, as never stopping."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import torchplace


def _seed(value: int) -> None:
    random.seed(value)
    np.random.seed(value)
    torch.manual_seed(value)


def _objects(make_net, init_seed: int):
    model = make_net(init_seed)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-2, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=2)
    return model, opt, sched, scaler


def _train(model, opt, sched, scaler, steps: int) -> list[float]:
    """Steps that draw from every generator: torch (data, dropout), numpy and Python (augmentation)."""
    losses = []
    model.train()
    for _ in range(steps):
        x = torch.randn(16, 8) * (1 + random.random()) + float(np.random.rand())
        y = torch.randint(0, 3, (16,))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.cross_entropy(model(x).float(), y)
        opt.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        sched.step()
        losses.append(loss.item())
    return losses


def test_resume_after_n_steps_is_bit_identical(tmp_path: Path, make_net) -> None:
    total, cut = 10, 4
    _seed(123)
    straight = _objects(make_net, 0)
    expected = _train(*straight, total)

    _seed(123)
    first = _objects(make_net, 0)
    before = _train(*first, cut)
    torchplace.save(tmp_path / "step-4.safetensors", model=first[0], optimizer=first[1], scheduler=first[2],
                    scaler=first[3], extra={"step": cut})
    assert first[3].get_scale() != 2.0**8  # the scaler's state really changed before the cut

    _seed(999)  # another process, another seed, other initial weights
    model, opt, sched, scaler = _objects(make_net, 7)
    ck = torchplace.load(tmp_path / "step-4.safetensors", model=model, optimizer=opt, scheduler=sched,
                         scaler=scaler)
    after = _train(model, opt, sched, scaler, total - ck.extra["step"])

    assert before + after == expected  # exact float equality, every step
    for a, b in zip(straight[0].state_dict().values(), model.state_dict().values()):
        assert torch.equal(a, b)
    assert sched.get_last_lr() == straight[2].get_last_lr() and scaler.get_scale() == straight[3].get_scale()


# --------------------------------------------------------------------------- the resume decision


def test_decide_resume_continues_after_a_restart_only_when_asked_to(tmp_path: Path) -> None:
    from torchplace.policy.resume import decide_resume

    ck = tmp_path / "ck"
    fresh = decide_resume("auto", ck, restarted=False, found=["epoch003.tpck"])
    assert fresh.path is None and fresh.reason == ""
    again = decide_resume("auto", ck, restarted=True, found=["epoch003.tpck", "epoch003.tpck"])
    assert again.path == ck / "epoch003.tpck" and "restarted by the launcher" in again.reason
    early = decide_resume("auto", ck, restarted=True, found=[None, None])  # killed before the first save
    assert early.path is None and "no complete checkpoint yet" in early.reason
    assert decide_resume(False, ck, restarted=True, found=["a.tpck"]).path is None
    assert decide_resume(True, ck, restarted=False, found=["a.tpck"]).path == ck / "a.tpck"
    blind = decide_resume("auto", None, restarted=True, found=[None])
    assert blind.path is None and "no checkpoint_dir was given" in blind.reason
    assert "beginning" not in blind.reason  # the program may resume through its own code (issue 32, item 9)
    # no restart counted, but this job started here before: a node started again after a membership change
    rejoined = decide_resume("auto", ck, restarted=False, found=["epoch003.tpck"], same_job="job42")
    assert rejoined.path == ck / "epoch003.tpck" and "job 'job42' started in this folder before" in rejoined.reason
    assert decide_resume(False, ck, restarted=False, found=["epoch003.tpck"], same_job="job42").path is None


def test_a_job_is_known_by_its_run_id_in_the_folder(tmp_path: Path) -> None:
    from torchplace.checkpoint.rotation import mark_started
    from torchplace.policy.resume import JOB_FILE, job_id, started_here

    assert [job_id(r) for r in ("job42", "none", "", None)] == ["job42", None, None, None]  # "none": torchrun's default
    assert not started_here(tmp_path / "ck", "job42")  # no folder yet
    mark_started(tmp_path / "ck", "job42")  # makes the folder
    assert started_here(tmp_path / "ck", "job42") and not started_here(tmp_path / "ck", "job43")
    assert not started_here(tmp_path / "ck", None)
    (tmp_path / "ck" / JOB_FILE).write_text("not json")
    assert not started_here(tmp_path / "ck", "job42")


@pytest.mark.parametrize("resume,directory,found,match", [
    (True, None, [None], r"resume=True needs the folder"),
    (True, "ck", [None], r"resume=True, but ck holds no complete torchplace checkpoint"),
    ("yes", "ck", [None], r"resume='yes' is not understood"),
    ("auto", "ck", ["epoch004.tpck", "epoch004.tpck", None],
     r"Rank 0 sees epoch004.tpck .* but rank 2 on node2 sees none .*not one shared file system"),
])
def test_decide_resume_refuses_what_cannot_work(directory, resume, found, match) -> None:
    from torchplace.errors import CheckpointError
    from torchplace.policy.resume import decide_resume

    with pytest.raises(CheckpointError, match=match):
        decide_resume(resume, directory, restarted=True, found=found, hosts=["node0", "node1", "node2"])
