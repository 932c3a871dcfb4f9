"""nanoGPT (karpathy/nanoGPT, train.py) ported: rank 0 alone saves the best checkpoint under DDP, the
autocast context made once is entered at every step, and the program's own torch.load resumes."""

from __future__ import annotations

from pathlib import Path

import torch

from realworld.launch import run_program


def test_nanogpt_saves_on_rank0_and_resumes_through_its_own_torch_load(tmp_path: Path) -> None:
    first = run_program("nanogpt_train.py", str(tmp_path), "4", cwd=tmp_path, nproc=2)
    assert "rank 0 done at iter 4" in first.stdout and "rank 1 done at iter 4" in first.stdout
    assert "saving checkpoint" in first.stdout
    assert "kept: OMP_NUM_THREADS=1" in first.stderr  # the launcher's thread count, not replaced
    assert "precision: float32" in first.stderr  # a CPU run stays fp32
    saved = torch.load(tmp_path / "ckpt.pt")  # the original's reader (weights_only)
    assert saved["model_args"] == {"n_embd": 16, "n_layer": 2} and saved["iter_num"] in (2, 4)
    again = run_program("nanogpt_train.py", str(tmp_path), "6", "resume", cwd=tmp_path)
    assert f"resumed at iter {saved['iter_num']}" in again.stdout and "rank 0 done at iter 6" in again.stdout
