"""Other tools' checkpoints: a torch.save file from a GPU job, Lightning, accelerate; inspect and convert."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import safetensors.torch
import torch
from torch import nn

import torchplace
from torchplace.checkpoint import convert, inspect


def _gpu_job_model() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


@pytest.fixture(scope="module")
def gpu_checkpoint(tmp_path_factory) -> tuple[Path, dict[str, torch.Tensor]]:
    """A training checkpoint as a job on cuda:1 writes it (module.-prefixed, Adam state), and its values."""
    import os
    import subprocess
    import sys

    path = tmp_path_factory.mktemp("gpu") / "ckpt.pt"
    helper = Path(__file__).parent / "helpers" / "make_cuda_checkpoint.py"
    subprocess.run([sys.executable, str(helper), str(path)], check=True, env=dict(os.environ))
    return path, safetensors.torch.load_file(str(path) + ".reference.safetensors")


def test_plain_torch_load_fails_here_and_torchplace_load_works(gpu_checkpoint) -> None:
    path, ref = gpu_checkpoint
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="Attempting to deserialize object on a CUDA device"):
            torch.load(path, weights_only=True)
    model = _gpu_job_model()
    opt = torch.optim.Adam(model.parameters(), lr=0.5)
    ck = torchplace.load(path, model=model, optimizer=opt)
    assert ck.tool == "torch.save (training dict)" and ck.stripped_prefix == "module." and ck.extra == {"epoch": 3}
    for k, v in model.state_dict().items():
        assert v.device.type == "cpu" and torch.equal(v, ref[f"model/{k}"])
    state = opt.state_dict()["state"]
    for pid, entry in state.items():
        assert entry["step"].device.type == "cpu"
        for name in ("exp_avg", "exp_avg_sq"):
            assert entry[name].device.type == "cpu" and torch.equal(entry[name], ref[f"opt/{pid}/{name}"])
    assert opt.param_groups[0]["lr"] == 1e-3


def test_inspect_reports_where_tensors_were_and_the_prefix(gpu_checkpoint) -> None:
    path, _ = gpu_checkpoint
    info = inspect(path)
    assert info.tool == "torch.save (training dict)"
    assert {t.saved_on for t in info.tensors} == {"cuda:1"}
    assert any(t.key == "model/module.0.weight" and t.shape == [8, 4] and t.dtype == "float32" for t in info.tensors)
    assert "'module.'" in info.notes[0]


def test_convert_makes_a_cpu_torchplace_checkpoint(gpu_checkpoint, tmp_path: Path) -> None:
    path, ref = gpu_checkpoint
    result = convert(path, tmp_path / "out.safetensors")
    assert result.stripped_prefix == "" and result.source_tool == "torch.save (training dict)"
    assert any("'module.', kept" in n for n in result.notes)  # DDP's, or an EMA wrapper's real submodule
    info = inspect(result.path, verify=True)
    assert info.tool == "torchplace" and info.verified
    assert {t.saved_on for t in info.tensors} == {"cpu"}
    assert info.metadata["converted_from"]["tool"] == "torch.save (training dict)"
    model = _gpu_job_model()
    torchplace.load(result.path, model=model)
    assert torch.equal(model[0].weight, ref["model/0.weight"])


def _lightning_checkpoint(model: nn.Module, opt: torch.optim.Optimizer, sched) -> dict:
    """The dict Lightning's Trainer.save_checkpoint writes (keys as Lightning 2.x names them)."""
    return {"epoch": 4, "global_step": 120, "pytorch-lightning_version": "2.4.0",
            "state_dict": {f"net.{k}": v for k, v in model.state_dict().items()},
            "loops": {"fit_loop": {"state_dict": {}, "epoch_progress": {"current": {"completed": 4}}}},
            "callbacks": {}, "optimizer_states": [opt.state_dict()], "lr_schedulers": [sched.state_dict()],
            "hparams_name": "kwargs", "hyper_parameters": {"lr": 0.01, "hidden": 8}}


def test_lightning_checkpoints_load_and_convert(tmp_path: Path) -> None:
    model = _gpu_job_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, 10)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    path = tmp_path / "epoch=4.ckpt"
    torch.save(_lightning_checkpoint(model, opt, sched), path)
    ck = torchplace.load(path)
    assert ck.tool == "lightning 2.4.0" and set(ck["model"]) == {f"net.{k}" for k in model.state_dict()}
    assert ck.extra["global_step"] == 120 and ck.extra["hyper_parameters"] == {"lr": 0.01, "hidden": 8}
    out = convert(path, tmp_path / "out.safetensors")
    back = torchplace.load(out.path)
    assert torch.equal(back["model"]["net.0.weight"], model[0].weight)
    assert back["optimizer"]["param_groups"][0]["momentum"] == 0.9 and back["scheduler"]["step_size"] == 10


def test_accelerate_save_state_directories_load(tmp_path: Path) -> None:
    Accelerator = pytest.importorskip("accelerate").Accelerator

    torch.manual_seed(0)
    model = _gpu_job_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, 2)
    accelerator = Accelerator(cpu=True)
    p_model, p_opt, p_sched = accelerator.prepare(model, opt, sched)
    p_model(torch.randn(3, 4)).sum().backward()
    p_opt.step()
    p_sched.step()
    accelerator.save_state(str(tmp_path / "acc"))

    target = _gpu_job_model()
    target_opt = torch.optim.AdamW(target.parameters(), lr=0.5)
    ck = torchplace.load(tmp_path / "acc", model=target, optimizer=target_opt)
    assert ck.tool == "accelerate" and any("random_states_0.pkl" in n for n in ck.notes)
    for a, b in zip(model.state_dict().values(), target.state_dict().values()):
        assert torch.equal(a, b)
    assert target_opt.state_dict()["state"][0]["step"] == 1
    assert "scheduler" in ck and inspect(tmp_path / "acc").tool.startswith("accelerate")


def test_a_plain_pickle_of_protocol_4_is_named_as_such_not_as_code(tmp_path):
    """pickle.dump's default protocol frames its data (FRAME, 149), which torch's safe unpickler does
    not read: it was reported as 'a pickle that needs code from the file to load (Unsupported operand 149)'."""
    import pickle

    path = tmp_path / "weights.pkl"
    path.write_bytes(pickle.dumps({"lr": 0.1}, protocol=4))
    with pytest.raises(torchplace.CheckpointError, match=r"plain pickle of protocol 4 or later .* FRAME instruction .*"
                                              r"trust_pickle=True.*write it again with torch.save"):
        inspect(path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch's own "Detected pickle protocol 4" line is not shown beside ours
        with pytest.raises(torchplace.CheckpointError, match="plain pickle of protocol 4"):
            torchplace.load(path)


@pytest.mark.parametrize("protocol", [2, 3])
def test_a_plain_pickle_of_protocol_2_or_3_is_named_as_such_not_as_corrupt(tmp_path, protocol):
    """torch.load reads pickles of protocol 2 as its legacy format and said 'Invalid magic number; corrupt
    file?'; a torch.save file of that format still loads."""
    import pickle

    path = tmp_path / "weights.pkl"
    path.write_bytes(pickle.dumps({"lr": 0.1}, protocol=protocol))
    with pytest.raises(torchplace.CheckpointError, match=rf"plain pickle of protocol {protocol} \(as pickle.dump "
                                                         r"writes it\), not a torch.save file.*load it with pickle"):
        inspect(path)
    legacy = tmp_path / "legacy.pt"
    torch.save({"w": torch.arange(3.0)}, legacy, _use_new_zipfile_serialization=False)
    assert torch.equal(torchplace.load(legacy)["model"]["w"], torch.arange(3.0))


def test_a_file_shorter_than_any_checkpoint_is_not_called_damaged(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("hello\n")
    with pytest.raises(torchplace.CheckpointError, match=r"is 6 bytes long: too short to be a checkpoint of any kind") \
            as info:
        inspect(path)
    assert "damaged" not in str(info.value)


def test_a_pre_port_training_dict_keeps_its_own_keys(tmp_path: Path) -> None:
    """imagenet's resume (checkpoint['epoch'], checkpoint['state_dict']) on the file torch.save wrote before
    the port raised a bare KeyError: 'epoch' (issue 32, item 2). Its keys are reachable as they were."""
    torch.manual_seed(0)
    model = nn.DataParallel(nn.Linear(3, 2))  # imagenet saves the wrapped model's state dict: 'module.' keys
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    torch.save({"epoch": 4, "arch": "resnet18", "state_dict": model.state_dict(), "best_acc1": torch.tensor(71.5),
                "optimizer": opt.state_dict()}, tmp_path / "checkpoint.pth.tar")
    fresh = nn.DataParallel(nn.Linear(3, 2))
    fresh_opt = torch.optim.SGD(fresh.parameters(), lr=0.1, momentum=0.9)
    ck = torchplace.load(tmp_path / "checkpoint.pth.tar", device="cpu", model=fresh, optimizer=fresh_opt)
    assert ck["epoch"] == 4 and ck["arch"] == "resnet18" and float(ck["best_acc1"]) == 71.5
    assert "epoch" in ck and ck.get("arch") == "resnet18" and ck.get("nope", 3) == 3
    assert list(ck) == ck.keys() == ["epoch", "arch", "state_dict", "best_acc1", "optimizer", "model", "extra"]
    fresh.load_state_dict(ck["state_dict"])  # the pre-port code's own line: 'module.' keys, as they were
    fresh_opt.load_state_dict(ck["optimizer"])
    assert torch.equal(fresh.module.weight, model.module.weight)
    with pytest.raises(KeyError, match="'lr' is not in checkpoint.pth.tar, which holds arch, best_acc1, epoch"):
        ck["lr"]
    torchplace.save(tmp_path / "ported.safetensors", model=fresh, extra={"epoch": 5}, best_acc1=72.0)
    ported = torchplace.load(tmp_path / "ported.safetensors")
    assert ported["best_acc1"] == 72.0
    with pytest.raises(KeyError, match=r"saved with extra=, so it is ck.extra\['epoch'\]"):
        ported["epoch"]


def test_a_pre_port_training_dict_fills_objects_named_by_its_own_keys(tmp_path: Path) -> None:
    """torchvision's reference checkpoint keeps its scheduler under 'lr_scheduler' and its EMA model under
    'model_ema'; load(..., lr_scheduler=, model_ema=) fills them from those keys, as the pre-port resume did."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    ema = torch.optim.swa_utils.AveragedModel(model, use_buffers=True)
    for _ in range(2):
        model(torch.randn(4, 3)).sum().backward()
        opt.step()
        sched.step()
        ema.update_parameters(model)
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "lr_scheduler": sched.state_dict(),
                "epoch": 1, "model_ema": ema.state_dict()}, tmp_path / "checkpoint.pth")
    fresh = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    fresh_opt = torch.optim.SGD(fresh.parameters(), lr=0.1, momentum=0.9)
    fresh_sched = torch.optim.lr_scheduler.StepLR(fresh_opt, step_size=1, gamma=0.5)
    fresh_ema = torch.optim.swa_utils.AveragedModel(fresh, use_buffers=True)
    ck = torchplace.load(tmp_path / "checkpoint.pth", model=fresh, optimizer=fresh_opt, lr_scheduler=fresh_sched,
                         model_ema=fresh_ema)
    assert ck["epoch"] == 1 and fresh_sched.last_epoch == 2 and int(fresh_ema.n_averaged) == 2
    assert all(torch.equal(v, fresh_ema.state_dict()[k]) for k, v in ema.state_dict().items())
    with pytest.raises(torchplace.CheckpointError, match="has no swa state"):  # a name the file lacks: refused
        torchplace.load(tmp_path / "checkpoint.pth", model=fresh, swa=fresh_ema)


def test_a_dict_of_several_models_names_its_keys_and_the_call_that_loads_one(tmp_path: Path) -> None:
    """A GAN's torch.save({"netG": ..., "netD": ...}) with model= was said to hold only 'extra'."""
    net_g, net_d = nn.Linear(3, 4), nn.Linear(4, 1)
    torch.save({"netG": net_g.state_dict(), "netD": net_d.state_dict(), "epoch": 2}, tmp_path / "gan.pth")
    with pytest.raises(torchplace.CheckpointError, match=r"holds: epoch, netD, netG\).*'.*gan.pth', netG=model\)"):
        torchplace.load(tmp_path / "gan.pth", model=nn.Linear(3, 4))
    fresh = nn.Linear(3, 4)
    torchplace.load(tmp_path / "gan.pth", netG=fresh)  # the call the message gives
    assert torch.equal(fresh.weight, net_g.weight)


@pytest.mark.parametrize("member", ["data.pkl", "data/0"])
def test_a_torch_save_member_that_fails_its_crc_is_refused_whatever_torch_makes_of_it(tmp_path: Path, member) -> None:
    """The CRC-32s are checked while torch reads (in a helper thread): the damage is still what is reported,
    when torch.load fails on the flipped byte (the pickle) and when it loads a wrong weight (a tensor)."""
    import zipfile

    path = tmp_path / "m.pt"
    torch.save({"weight": torch.arange(64.0)}, path)
    data = bytearray(path.read_bytes())
    with zipfile.ZipFile(path) as zf:
        name = next(n for n in zf.namelist() if n.endswith("/" + member))
        body = zf.read(name)
    at = data.find(body) + len(body) // 2
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(torchplace.CheckpointError, match=r"m.pt is damaged: member .* fails its CRC-32"):
        torchplace.load(path)
