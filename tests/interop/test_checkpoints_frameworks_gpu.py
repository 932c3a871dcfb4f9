"""GPU twin of test_checkpoints_frameworks.py: a model made on meta and a tied save_pretrained folder
loaded straight onto the GPU, and optimizer state beside its parameters there."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import torchplace as tp

from .test_checkpoints_frameworks import decay_groups, gpt2, same_weights, snapshot, unchanged

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_a_meta_model_is_made_on_the_gpu_from_a_tied_save_pretrained_folder(tmp_path: Path) -> None:
    """accelerate's init_empty_weights recipe onto cuda:0: every tensor is read onto the GPU (none on
    the host, none left on meta), tied weights one Parameter, the logits those of the saved model."""
    torch.manual_seed(0)
    saved = gpt2().eval()
    saved.save_pretrained(tmp_path / "hf")
    with torch.device("meta"):
        empty = gpt2()
    tp.load(tmp_path / "hf", model=empty, device="cuda:0")
    assert {t.device for t in [*empty.parameters(), *empty.buffers()]} == {torch.device("cuda:0")}
    assert empty.lm_head.weight is empty.transformer.wte.weight
    same_weights(saved.cuda(), empty)
    x = torch.randint(0, 50, (1, 6), device="cuda:0")
    torch.testing.assert_close(saved(x).logits, empty.eval()(x).logits, rtol=0, atol=0)


def test_optimizer_groups_that_do_not_fit_leave_the_gpu_model_as_it_was(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = gpt2().cuda()
    opt = torch.optim.AdamW(decay_groups(model), lr=1e-3)
    model(torch.randint(0, 50, (2, 8), device="cuda:0")).logits.float().pow(2).mean().backward()
    opt.step()
    path = tp.save(tmp_path / "ck.safetensors", model=model, optimizer=opt)
    fresh = gpt2().cuda()
    before = snapshot(fresh)
    with pytest.raises(tp.CheckpointError, match="Nothing was loaded"):
        tp.load(path, model=fresh, optimizer=torch.optim.AdamW(fresh.parameters()))
    assert unchanged(fresh, before)
    right = torch.optim.AdamW(decay_groups(fresh), lr=1e-3)
    tp.load(path, model=fresh, optimizer=right, device="cuda:0")
    same_weights(model, fresh)
    assert all(v.device == p.device for p, s in right.state.items() for k, v in s.items() if k != "step")
