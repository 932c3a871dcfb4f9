"""A progress bar for long commands on a terminal, and nothing extra into a pipe (issue 18)."""

from __future__ import annotations

import torch
from terminal import on_terminal


def _checkpoint(tmp_path):
    src = tmp_path / "plain.pt"
    torch.save({"model": {f"w{i}": torch.randn(512, 512) for i in range(16)}}, src)  # 16 MiB: a few chunks
    return src


def test_convert_and_verify_draw_a_bar_on_a_terminal(tmp_path, child_env):
    src = _checkpoint(tmp_path)
    run = on_terminal(["ckpt", "convert", str(src), str(tmp_path / "out.tp")], child_env(), columns=100)
    assert run.returncode == 0, run.text
    assert "writing out.tp" in run.text and "━" in run.text and "%" in run.text, run.text
    assert "wrote " in run.text
    run = on_terminal(["ckpt", "inspect", "--verify", str(tmp_path / "out.tp")], child_env(), columns=100)
    assert run.returncode == 0, run.text
    assert "verifying out.tp" in run.text and "every checksum matches" in run.text


def test_into_a_pipe_nothing_extra_appears(tmp_path, run_cli, child_env):
    src = _checkpoint(tmp_path)
    out = run_cli(["ckpt", "convert", str(src), str(tmp_path / "out.tp")], env=child_env())
    assert out.returncode == 0, out.stderr
    assert out.stderr == ""
    assert out.stdout.splitlines() == [f"wrote {tmp_path / 'out.tp'}: 16 tensors from a torch.save (training dict) "
                                       "checkpoint, on the CPU"]
    out = run_cli(["ckpt", "inspect", "--verify", str(tmp_path / "out.tp")], env=child_env())
    assert out.returncode == 0 and out.stderr == "" and "verifying" not in out.stdout


def test_a_bench_draws_its_bar_on_a_terminal(child_env):
    run = on_terminal(["bench", "doctor", "--repeat", "1"], child_env(), columns=120)
    assert run.returncode == 0, run.text
    assert "timing commands" in run.text and "torchplace bench doctor" in run.text
