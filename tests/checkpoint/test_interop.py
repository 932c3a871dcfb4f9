"""Checkpoints of other libraries, both ways, with their real objects (issue 15 items 1, 2, 7).

Theirs -> ours: a file written by Lightning (Trainer and Fabric), accelerate's save_state, HF's
save_pretrained, a timm-style EMA wrapper, a model with compiled submodules, or torch's DCP,
loaded with `torchplace.load`. Ours -> theirs: a torchplace file loaded into their objects, or
exported with `convert(weights_only=True)` and read by their own loader. Module versions
(`_metadata`) are checked with a quantization observer, which resets its `eps` when it sees no version.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch
from torch import nn
from torch.ao.quantization.observer import MinMaxObserver

import torchplace
from torchplace.checkpoint import convert, inspect, read_header
from torchplace.cli import main


@pytest.fixture(autouse=True)
def _lightning_env(monkeypatch) -> None:
    """Importing lightning sets PYTORCH_NVML_BASED_CUDA_CHECK; put it back after each test."""
    monkeypatch.setenv("PYTORCH_NVML_BASED_CUDA_CHECK", "")
    monkeypatch.delenv("PYTORCH_NVML_BASED_CUDA_CHECK")


EPS = 1e-3  # not the observer's default: it survives a load only if the module's version does


def net(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
    model.add_module("obs", MinMaxObserver(eps=EPS) if seed == 0 else MinMaxObserver())
    with torch.no_grad():
        model[1].running_mean.add_(seed + 1)
    return model


class Encoder(nn.Module):
    """A model with a submodule to compile (as `model.encoder = torch.compile(model.encoder)`)."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.encoder = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
        self.head = nn.Linear(4, 2)


class Ema(nn.Module):
    """timm's ModelEmaV2 layout: the averaged copy is `self.module`, so its keys are `module.*`."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.module = model


def same(a: nn.Module, b: nn.Module, *, versions: bool = True) -> bool:
    """A and B hold equal state. versions=False: except the observer's eps, which a state dict without
    module versions resets (plain safetensors and hand-built dicts cannot say which version they are)."""
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    assert [k for k in sa if not torch.equal(sa[k], sb[k]) and (versions or not k.endswith("obs.eps"))] == []
    return True


def eps_of(model: nn.Module) -> float:
    return float(next(m for m in model.modules() if isinstance(m, MinMaxObserver)).eps)


def header_keys(path: Path) -> list[str]:
    return [e.key for e in read_header(path).entries]


# --- item 1: module versions (`_metadata`) kept -----------------------------------------------


def test_versions_of_a_torch_save_state_dict_are_kept(tmp_path: Path) -> None:
    torch.save(net(0).state_dict(), tmp_path / "sd.pt")
    target = net(1)
    torchplace.load(tmp_path / "sd.pt", model=target)
    assert eps_of(target) == pytest.approx(EPS) and same(net(0), target)


def test_versions_of_a_state_dict_given_to_save_are_kept(tmp_path: Path) -> None:
    path = torchplace.save(tmp_path / "a.safetensors", model=net(0).state_dict(), ema=net(0), rng_state=False)
    target, ema = net(1), net(2)
    torchplace.load(path, model=target, ema=ema)
    assert eps_of(target) == pytest.approx(EPS) and eps_of(ema) == pytest.approx(EPS)


def test_a_state_loaded_without_a_model_carries_its_versions(tmp_path: Path) -> None:
    path = torchplace.save(tmp_path / "a.safetensors", model=net(0), rng_state=False)
    for source in (path, tmp_path / "sd.pt"):
        torch.save(net(0).state_dict(), tmp_path / "sd.pt")
        sd = torchplace.load(source)["model"]
        assert sd._metadata["obs"]["version"] == 3
        target = net(1)
        target.load_state_dict(sd)  # torch's own loader sees the versions too
        assert eps_of(target) == pytest.approx(EPS)


def test_convert_keeps_versions(tmp_path: Path) -> None:
    torch.save({"model": net(0).state_dict(), "epoch": 1}, tmp_path / "job.pt")
    convert(tmp_path / "job.pt", tmp_path / "out.safetensors")
    target = net(1)
    torchplace.load(tmp_path / "out.safetensors", model=target)
    assert eps_of(target) == pytest.approx(EPS)


# --- item 2: compiled submodules ----------------------------------------------------------------


def compiled(seed: int) -> Encoder:
    model = Encoder(seed)
    model.encoder = torch.compile(model.encoder)  # type: ignore[assignment]
    return model


def test_compiled_submodules_save_clean_keys_and_load_both_ways(tmp_path: Path) -> None:
    source = compiled(0)
    assert any("._orig_mod." in k for k in source.state_dict())
    path = torchplace.save(tmp_path / "c.safetensors", model=source, rng_state=False)
    assert not any("_orig_mod" in k for k in header_keys(path))
    assert "encoder.0" in json.dumps(read_header(path).meta["module_versions"])
    plain = Encoder(1)
    torchplace.load(path, model=plain)  # clean file -> plain model
    assert same(Encoder(0), plain)
    again = compiled(2)
    ck = torchplace.load(torchplace.save(tmp_path / "p.safetensors", model=Encoder(0)), model=again)
    assert same(source, again) and any("compiled submodules" in n for n in ck.notes)  # clean -> compiled


def test_a_file_with_inner_orig_mod_loads_into_the_plain_model(tmp_path: Path) -> None:
    torch.save(compiled(0).state_dict(), tmp_path / "inner.pt")  # what torch.save of such a model writes
    plain = Encoder(1)
    ck = torchplace.load(tmp_path / "inner.pt", model=plain)
    assert same(Encoder(0), plain) and any("'_orig_mod.' inside" in n for n in ck.notes)
    assert not any("_orig_mod" in k for k in torchplace.load(tmp_path / "inner.pt")["model"])
    result = convert(tmp_path / "inner.pt", tmp_path / "out.safetensors")
    assert result.stripped_prefix == "_orig_mod." and not any("_orig_mod" in k for k in header_keys(result.path))


def test_accelerate_compile_regions(tmp_path: Path) -> None:
    from accelerate.utils import compile_regions

    model = compile_regions(Encoder(0))
    path = torchplace.save(tmp_path / "r.safetensors", model=model, rng_state=False)
    assert not any("_orig_mod" in k for k in header_keys(path))
    torch.save(model.state_dict(), tmp_path / "r.pt")
    for source in (path, tmp_path / "r.pt"):
        plain, regions = Encoder(1), compile_regions(Encoder(2))
        torchplace.load(source, model=plain)
        torchplace.load(source, model=regions)
        assert same(Encoder(0), plain) and same(model, regions)


# --- item 7: a model that wraps another as `self.module` ----------------------------------------


def test_ema_wrapper_keys_are_kept_when_they_match(tmp_path: Path) -> None:
    torch.save(Ema(net(0)).state_dict(), tmp_path / "ema.pt")  # timm saves ModelEmaV2.state_dict()
    wrapper = Ema(net(1))
    ck = torchplace.load(tmp_path / "ema.pt", model=wrapper)
    assert ck.stripped_prefix == "" and not ck.notes and same(Ema(net(0)), wrapper)
    assert eps_of(wrapper) == pytest.approx(EPS)
    bare = net(1)  # the averaged weights into the bare model: `module.` is a prefix here
    ck = torchplace.load(tmp_path / "ema.pt", model=bare)
    assert ck.stripped_prefix == "module." and same(net(0), bare) and eps_of(bare) == pytest.approx(EPS)
    assert "stripped 'module.'" in ck.notes[0]


def test_a_bare_models_file_loads_into_the_ema_wrapper(tmp_path: Path) -> None:
    path = torchplace.save(tmp_path / "bare.safetensors", model=net(0), rng_state=False)
    wrapper = Ema(net(1))
    ck = torchplace.load(path, model=wrapper)
    assert same(Ema(net(0)), wrapper) and "added the model's 'module.'" in ck.notes[0]
    assert eps_of(wrapper) == pytest.approx(EPS)
    ours = torchplace.save(tmp_path / "ema.safetensors", model=Ema(net(0)), rng_state=False)
    assert all(k.startswith("model/module.") for k in header_keys(ours))  # a real submodule: saved as is


def test_convert_keeps_module_it_cannot_decide(tmp_path: Path) -> None:
    torch.save(Ema(net(0)).state_dict(), tmp_path / "ema.pt")
    result = convert(tmp_path / "ema.pt", tmp_path / "ema.safetensors")
    assert result.stripped_prefix == "" and any("'module.', kept" in n for n in result.notes)
    wrapper = Ema(net(1))
    torchplace.load(result.path, model=wrapper)
    assert same(Ema(net(0)), wrapper)


def test_a_mismatch_names_the_best_mapping(tmp_path: Path) -> None:
    torch.save({"module." + k: v for k, v in net(0).state_dict().items()}, tmp_path / "x.pt")
    with pytest.raises(torchplace.errors.CheckpointError, match="wrapper prefixes module, _orig_mod, model"):
        torchplace.load(tmp_path / "x.pt", model=Encoder(0))


# --- Lightning ----------------------------------------------------------------------------------


@pytest.fixture
def lightning_ckpt(tmp_path: Path) -> tuple[Path, nn.Module]:
    import lightning as L

    class Lit(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = net(0)

        def training_step(self, batch: Any, _: int) -> torch.Tensor:
            return self.model[:3](batch[0]).pow(2).mean()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=0.01)

    lit = Lit()
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 4)), batch_size=4)
    trainer = L.Trainer(max_steps=2, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path)
    trainer.fit(lit, data)
    path = tmp_path / "lit.ckpt"
    trainer.save_checkpoint(path)
    return path, lit


def test_lightning_checkpoint_loads_into_the_bare_module(lightning_ckpt) -> None:
    path, lit = lightning_ckpt
    bare = net(1)
    opt = torch.optim.AdamW(bare.parameters(), lr=0.5)
    ck = torchplace.load(path, model=bare, optimizer=opt)
    assert ck.tool.startswith("lightning") and ck.stripped_prefix == "model."
    assert same(lit.model, bare) and eps_of(bare) == pytest.approx(EPS)
    assert opt.param_groups[0]["lr"] == 0.01 and len(opt.state) == 6


def test_ours_into_a_lightning_module_and_out_as_plain_weights(lightning_ckpt, tmp_path: Path) -> None:
    path, lit = lightning_ckpt
    fresh = type(lit)()  # the same LightningModule class, fresh
    with torch.no_grad():
        fresh.model[0].weight.zero_()
    ours = torchplace.save(tmp_path / "ours.safetensors", model=lit.model, rng_state=False)
    ck = torchplace.load(ours, model=fresh)  # bare keys -> `model.*`
    assert same(lit, fresh) and "added the model's 'model.'" in ck.notes[0]
    convert(path, tmp_path / "w.safetensors", weights_only=True)  # theirs -> plain weights
    again = type(lit)()
    again.load_state_dict(safetensors.torch.load_file(tmp_path / "w.safetensors"))
    assert same(lit, again, versions=False)  # a plain safetensors file holds no module versions


def test_fabric_save_and_load_both_ways(tmp_path: Path) -> None:
    from lightning.fabric import Fabric

    fabric = Fabric(accelerator="cpu", devices=1)
    source = net(0)
    model, opt = fabric.setup(source, torch.optim.AdamW(source.parameters(), lr=0.02))
    fabric.save(tmp_path / "f.ckpt", {"model": model, "optimizer": opt, "step": 3})
    bare = net(1)
    ck = torchplace.load(tmp_path / "f.ckpt", model=bare, optimizer=torch.optim.AdamW(bare.parameters()))
    assert same(net(0), bare) and ck.extra["step"] == 3 and eps_of(bare) == pytest.approx(EPS)
    # ours -> Fabric: into the module Fabric set up, and what fabric.load reads
    path = torchplace.save(tmp_path / "ours.safetensors", model=net(0), rng_state=False)
    target = fabric.setup(net(2))
    torchplace.load(path, model=target)
    assert same(net(0), target.module)
    torch.save({"model": {"_forward_module." + k: v for k, v in net(0).state_dict().items()}}, tmp_path / "fw.pt")
    bare = net(1)
    assert torchplace.load(tmp_path / "fw.pt", model=bare).stripped_prefix == "_forward_module."
    assert same(net(0), bare, versions=False)  # a hand-built dict has no versions: loaded as torch would


# --- accelerate ---------------------------------------------------------------------------------


@pytest.fixture
def accelerator():
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    yield Accelerator(cpu=True)
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def test_accelerate_save_state_both_ways(accelerator, tmp_path: Path) -> None:
    model = net(0)
    opt = torch.optim.AdamW(model.parameters(), lr=0.03)
    model, opt = accelerator.prepare(model, opt)
    accelerator.save_state(tmp_path / "state")
    bare = net(1)
    bopt = torch.optim.AdamW(bare.parameters())
    torchplace.load(tmp_path / "state", model=bare, optimizer=bopt)
    assert same(net(0), bare) and bopt.param_groups[0]["lr"] == 0.03
    # ours -> accelerate: a weights-only export is the model.safetensors its load_state reads
    ours = torchplace.save(tmp_path / "ours.safetensors", model=net(0), rng_state=False)
    (tmp_path / "back").mkdir()
    convert(ours, tmp_path / "back" / "model.safetensors", weights_only=True)
    target = accelerator.prepare(net(2))
    accelerator._models[:] = [target]
    accelerator._optimizers.clear()
    accelerator.load_state(tmp_path / "back")
    assert same(net(0), target, versions=False)  # accelerate loads a state dict without module versions


# --- HF -----------------------------------------------------------------------------------------


def tiny_bert() -> Any:
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(vocab_size=32, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=16, max_position_embeddings=16, num_labels=2)
    return transformers, config


def test_hf_save_pretrained_both_ways(tmp_path: Path) -> None:
    transformers, config = tiny_bert()
    torch.manual_seed(0)
    hf = transformers.BertForSequenceClassification(config)
    hf.save_pretrained(tmp_path / "hf")
    fresh = transformers.BertForSequenceClassification(config)
    torchplace.load(tmp_path / "hf" / "model.safetensors", model=fresh)
    assert same(hf, fresh)
    fresh = transformers.BertForSequenceClassification(config)
    torchplace.load(tmp_path / "hf", model=fresh)  # the folder, as accelerate's
    assert same(hf, fresh)
    # ours -> HF: export the weights beside the config; from_pretrained reads them
    ours = torchplace.save(tmp_path / "ours.safetensors", model=hf, rng_state=False)
    (tmp_path / "back").mkdir()
    (tmp_path / "back" / "config.json").write_text((tmp_path / "hf" / "config.json").read_text())
    assert main(["ckpt", "convert", "--weights-only", str(ours), str(tmp_path / "back" / "model.safetensors")]) == 0
    back = transformers.BertForSequenceClassification.from_pretrained(tmp_path / "back")
    assert same(hf, back)


def test_hf_style_safetensors_without_transformers(tmp_path: Path) -> None:
    """The same layout with a stand-in: HF names keys by attribute path, with `{"format": "pt"}` metadata."""
    model = nn.ModuleDict({"bert": nn.ModuleDict({"pooler": nn.Linear(4, 4)}), "classifier": nn.Linear(4, 2)})
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    safetensors.torch.save_file(sd, tmp_path / "model.safetensors", metadata={"format": "pt"})
    target = nn.ModuleDict({"bert": nn.ModuleDict({"pooler": nn.Linear(4, 4)}), "classifier": nn.Linear(4, 2)})
    torchplace.load(tmp_path / "model.safetensors", model=target)
    assert same(model, target)
    ours = torchplace.save(tmp_path / "ours.safetensors", model=model, rng_state=False)
    convert(ours, tmp_path / "w.safetensors", weights_only=True)
    with safetensors.safe_open(tmp_path / "w.safetensors", "pt") as fh:
        assert fh.metadata() == {"format": "pt"} and set(fh.keys()) == set(sd)


# --- weights-only export ------------------------------------------------------------------------


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(6, 4)
        self.out = nn.Linear(4, 6, bias=False)
        self.out.weight = self.embed.weight


def test_weights_only_export_from_every_source(tmp_path: Path, capsys) -> None:
    sources = {
        "ours": torchplace.save(tmp_path / "ours.safetensors", model=compiled(0), rng_state=False),
        "ddp": tmp_path / "ddp.pt",
        "compiled": tmp_path / "compiled.pt",
    }
    torch.save({"model": {"module." + k: v for k, v in Encoder(0).state_dict().items()}, "epoch": 1}, sources["ddp"])
    torch.save(compiled(0).state_dict(), sources["compiled"])
    for name, src in sources.items():
        out = tmp_path / f"{name}.w.safetensors"
        assert main(["ckpt", "convert", "--weights-only", "--json", str(src), str(out)]) == 0
        result = json.loads(capsys.readouterr().out)
        assert result["weights_only"] is True
        plain = Encoder(1)
        if name == "ddp":  # `module.` cannot be decided without the model: kept, and said so
            assert any("'module.', kept" in n for n in result["notes"])
            Ema(plain).load_state_dict(safetensors.torch.load_file(out))
        else:
            plain.load_state_dict(safetensors.torch.load_file(out))
        assert same(Encoder(0), plain)
    info = inspect(tmp_path / "ours.w.safetensors")
    assert info.tool == "safetensors"


def test_weights_only_export_of_tied_weights(tmp_path: Path) -> None:
    torch.save(Tied().state_dict(), tmp_path / "tied.pt")
    result = convert(tmp_path / "tied.pt", tmp_path / "tied.safetensors", weights_only=True)
    target = Tied()
    with torch.no_grad():
        target.embed.weight.zero_()
    target.load_state_dict(safetensors.torch.load_file(result.path))
    assert same(Tied(), target) and any("tied" in n for n in result.notes)


def test_weights_only_needs_a_model(tmp_path: Path) -> None:
    torch.save({"epoch": 3}, tmp_path / "e.pt")
    with pytest.raises(torchplace.errors.CheckpointError, match="holds no model weights to export"):
        convert(tmp_path / "e.pt", tmp_path / "w.safetensors", weights_only=True)
    assert not (tmp_path / "w.safetensors").exists()


# --- DCP ----------------------------------------------------------------------------------------


def test_dcp_folder_both_ways(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.save(net(0).state_dict(), checkpoint_id=str(tmp_path / "dcp"))  # torch alone, no process group
    bare = net(1)
    torchplace.load(tmp_path / "dcp", model=bare)
    assert same(net(0), bare)
    # ours -> DCP: a torchplace file's state, written by DCP, read back by DCP alone
    state = torchplace.load(torchplace.save(tmp_path / "o.safetensors", model=net(0), rng_state=False))["model"]
    dcp.save(dict(state), checkpoint_id=str(tmp_path / "dcp2"))
    dest = net(1).state_dict()
    dcp.load(dest, checkpoint_id=str(tmp_path / "dcp2"))
    assert all(torch.equal(dest[k], v) for k, v in net(0).state_dict().items())


def test_timm_model_ema_v2(tmp_path: Path) -> None:
    """The real ModelEmaV2 where timm is installed (the GPU machine); `Ema` above stands in elsewhere."""
    timm_utils = pytest.importorskip("timm.utils")
    ema = timm_utils.ModelEmaV2(net(0), decay=0.9)
    torch.save(ema.state_dict(), tmp_path / "ema.pt")
    again = timm_utils.ModelEmaV2(net(1), decay=0.9)
    assert torchplace.load(tmp_path / "ema.pt", model=again).stripped_prefix == ""
    bare = net(1)
    assert torchplace.load(tmp_path / "ema.pt", model=bare).stripped_prefix == "module."
    assert same(ema.module, again.module) and same(ema.module, bare)
    path = torchplace.save(tmp_path / "ours.safetensors", model=bare, rng_state=False)
    back = timm_utils.ModelEmaV2(net(2), decay=0.9)
    torchplace.load(path, model=back)
    assert same(ema.module, back.module)


# --- Lightning with any attribute name, and prefix= (issue 32, item 4) --------------------------


def _lit_class(attr: str) -> type:
    import lightning as L

    class Lit(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            setattr(self, attr, net(0))

        def training_step(self, batch: Any, _: int) -> torch.Tensor:
            return getattr(self, attr)[:3](batch[0]).pow(2).mean()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=0.01)

    return Lit


@pytest.mark.parametrize("attr", ["net", "backbone", "encoder"])
def test_lightning_with_any_attribute_name_both_ways(tmp_path: Path, attr: str) -> None:
    """Only `self.model` loaded; `self.net`, `self.backbone`, `self.encoder` failed both ways."""
    import lightning as L

    lit = _lit_class(attr)()
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 4)), batch_size=4)
    trainer = L.Trainer(max_steps=2, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path)
    trainer.fit(lit, data)
    trainer.save_checkpoint(tmp_path / "lit.ckpt")
    bare = net(1)
    ck = torchplace.load(tmp_path / "lit.ckpt", model=bare)  # theirs -> the bare network
    assert ck.stripped_prefix == f"{attr}." and same(getattr(lit, attr), bare)
    ours = torchplace.save(tmp_path / "ours.safetensors", model=bare, rng_state=False)
    fresh = _lit_class(attr)()
    with torch.no_grad():
        getattr(fresh, attr)[0].weight.zero_()
    ck = torchplace.load(ours, model=fresh)  # ours -> their LightningModule
    assert same(lit, fresh) and f"added the model's '{attr}.'" in ck.notes[0]


def test_an_explicit_prefix_takes_one_child_of_several(tmp_path: Path) -> None:
    class Two(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.encoder, self.decoder = net(0), nn.Linear(2, 4)

    torch.save({"state_dict": {k: v for k, v in Two().state_dict().items()}, "global_step": 3}, tmp_path / "two.ckpt")
    with pytest.raises(torchplace.errors.CheckpointError, match="do not fit"):
        torchplace.load(tmp_path / "two.ckpt", model=net(1))  # two children: no single prefix to guess
    bare = net(1)
    ck = torchplace.load(tmp_path / "two.ckpt", model=bare, prefix="encoder.")
    assert same(net(0), bare, versions=False) and "under 'encoder.' (prefix=)" in ck.notes[0]
    with pytest.raises(torchplace.errors.CheckpointError, match="no saved model key starts with 'head.'.*'decoder.', "
                                                                "'encoder.'. Fix: pass one of those as prefix="):
        torchplace.load(tmp_path / "two.ckpt", model=net(1), prefix="head")
