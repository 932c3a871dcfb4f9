"""setup(): one record of device decisions, with helpers bound to them."""

from __future__ import annotations

import json
import logging

import pytest
import torch

import torchplace as tp
from torchplace.checks import strict as strict_mod


def test_setup_on_cpu_binds_helpers(tmp_path, caplog, restore_threads):
    caplog.set_level(logging.INFO, logger="torchplace")
    rt = tp.setup("cpu", seed=3)
    assert rt.device == torch.device("cpu") and rt.world_size == 1 and rt.is_main
    assert [r.name for r in caplog.records] == ["torchplace"] and "device cpu" in caplog.records[0].getMessage()
    batch = {"x": torch.ones(2), "y": [torch.zeros(1)]}
    assert rt.to(batch)["x"].device.type == "cpu"
    assert [b["x"].sum().item() for b in rt.loader([batch, batch])] == [2.0, 2.0]
    model = torch.nn.Linear(2, 2)
    with rt.autocast():
        model(torch.ones(1, 2))
    rt.save(tmp_path / "c.tpck", model=model)
    other = torch.nn.Linear(2, 2)
    rt.load(tmp_path / "c.tpck", model=other)
    assert torch.equal(other.weight, model.weight)
    assert "meta" not in str(rt.explain(model, torch.ones(1, 2)))
    assert torch.initial_seed() == 3


def test_setup_reports_on_stderr_where_logging_is_not_configured_and_can_be_silenced(
        capsys, monkeypatch, restore_threads):
    """setup() printed to stderr: now the `torchplace` logger, which a user routes or silences; a program that
    configures no logging still sees the report, as before."""
    monkeypatch.setattr(logging.getLogger(), "handlers", [])  # no handler anywhere: pytest's own are set aside
    tp.setup("cpu")
    assert "device cpu" in capsys.readouterr().err
    monkeypatch.setattr(logging.getLogger("torchplace"), "level", logging.WARNING)
    tp.setup("cpu")
    assert capsys.readouterr().err == ""


def test_setup_resolves_other_devices_and_reports_them(restore_threads):
    rt = tp.setup("meta", threads=None, verbose=False)
    assert rt.device == torch.device("meta") and rt.threads is None
    assert "meta" in rt.summary()


def test_setup_rejects_impossible_devices_at_once():
    with pytest.raises(tp.DeviceError, match="cuda:7 requested"):
        tp.setup("cuda:7", verbose=False)


def test_setup_can_turn_strict_mode_on(restore_threads):
    rt = tp.setup("cpu", threads=None, strict="warn", verbose=False)
    try:
        assert rt.strict == "warn" and strict_mod.is_enabled()
    finally:
        strict_mod.disable()


def test_setup_continues_from_the_newest_checkpoint_when_torchrun_restarted_the_worker(
        tmp_path, monkeypatch, restore_threads):
    model = torch.nn.Linear(2, 2)
    tp.save(tmp_path / "step1.tpck", model=model, extra={"step": 1}, keep_last=2)
    with torch.no_grad():
        model.weight.add_(1.0)
    tp.save(tmp_path / "step2.tpck", model=model, extra={"step": 2}, keep_last=2)
    # a one-process torchrun job (world size 1: no group) that torchrun restarted once
    for name, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "TORCHELASTIC_RUN_ID": "t",
                        "TORCHELASTIC_RESTART_COUNT": "1"}.items():
        monkeypatch.setenv(name, value)
    rt = tp.setup("cpu", checkpoint_dir=tmp_path, verbose=False)
    assert rt.resume_from == tmp_path / "step2.tpck" and rt.checkpoint_dir == tmp_path
    assert any("restarted by the launcher: continuing from" in d for d in rt.decisions)
    other = torch.nn.Linear(2, 2)
    ck = rt.resume(model=other)
    assert ck.extra["step"] == 2 and torch.equal(other.weight, model.weight)
    assert tp.setup("cpu", checkpoint_dir=tmp_path, resume=False, verbose=False).resume(model=other) is None
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "another-job")  # another job's first start: from the beginning
    assert tp.setup("cpu", checkpoint_dir=tmp_path, verbose=False).resume_from is None
    assert json.loads((tmp_path / ".torchplace-job").read_text()) == {"run_id": "another-job"}
    # the same job again with no restart counted (a node started again after a membership change): it continues
    rt = tp.setup("cpu", checkpoint_dir=tmp_path, verbose=False)
    assert rt.resume_from == tmp_path / "step2.tpck"
    assert any("job 'another-job' started in this folder before" in d for d in rt.decisions)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")  # torchrun's default id names no job: never matched
    assert tp.setup("cpu", checkpoint_dir=tmp_path, verbose=False).resume_from is None
    assert tp.setup("cpu", checkpoint_dir=tmp_path, verbose=False).resume_from is None


def test_setup_with_ranks_set_by_hand_waits_a_minute_not_five_and_says_no_launcher_started_them(
        monkeypatch, restore_threads):
    """RANK=0 WORLD_SIZE=2 left in a shell: `python train.py` waited 300 s for a rank no launcher started."""
    from ports import free_port

    import torchplace.runtime as runtime

    assert runtime.SETUP_JOIN_BY_HAND_S == 60.0
    monkeypatch.setattr(runtime, "SETUP_JOIN_BY_HAND_S", 1.0)  # the same path, without the minute
    for key, value in {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(free_port())}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    with pytest.raises(tp.DistributedError, match=r"did not join within 1 s: rank\(s\) 1 .*No launcher started"):
        tp.setup("cpu", verbose=False)
    assert not torch.distributed.is_initialized()


def test_setup_keeps_a_thread_count_the_program_set(monkeypatch, restore_threads):
    """OMP_NUM_THREADS=1 became 2 intra-op threads and nanoGPT's weights differed (issue 32, item 7):
    a count set before setup() is kept, and the decision line says whose it is."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    rt = tp.setup("cpu", verbose=False)
    assert torch.get_num_threads() == 1 and rt.threads is None
    line = next(d for d in rt.decisions if d.startswith("threads:"))
    assert "kept: OMP_NUM_THREADS=1 from the environment" in line
    monkeypatch.delenv("OMP_NUM_THREADS")
    rt = tp.setup("cpu", verbose=False)  # torch.set_num_threads(1) since torchplace was imported
    assert torch.get_num_threads() == 1
    assert "kept: torch.set_num_threads(1) called before setup()" in rt.decisions[1]
    rt = tp.setup("cpu", threads=2, verbose=False)
    assert torch.get_num_threads() == rt.threads.intra_op and "(threads= given)" in rt.decisions[1]


def test_users_thread_count_names_whose_it_is():
    from torchplace.policy.threads import users_thread_count

    assert users_thread_count({}, 4, 4) is None
    assert "yours, or torchrun's default" in users_thread_count({"OMP_NUM_THREADS": "1"}, 1, 1, "torchrun", 2)
    assert "set before the program started" in users_thread_count({"OMP_NUM_THREADS": "3"}, 3, 3)
    assert "torch.set_num_threads(2)" in users_thread_count({}, 2, 8)


def test_setup_on_a_cpu_stays_fp32_and_says_so(restore_threads):
    """setup() turned on bf16 autocast on a CPU with AVX512-BF16 (issue 32, item 8)."""
    rt = tp.setup("cpu", threads=None, verbose=False)
    assert rt.precision.dtype == torch.float32 and not rt.precision.autocast_enabled
    line = next(d for d in rt.decisions if d.startswith("precision:"))
    assert "float32" in line and ("the CPU default" in line or "no bf16 instructions" in line)
