"""`save` / `load` with the files and training objects of transformers, accelerate and plain torch
that tests/interop/test_checkpoints.py and tests/checkpoint/test_interop.py do not reach: a tied
model's save_pretrained folder (one file, shards, the index named), a checkpoint of an untied model
into a tied one, optimizers whose groups do not fit, bf16 weights with fp32 optimizer state,
schedulers that keep callables, an EMA AveragedModel and a DDP model on a gloo group.
"""

from __future__ import annotations

import copy
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import torchplace as tp


def same_weights(a: nn.Module, b: nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    assert [k for k in sa if not (sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]))] == []


def snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def unchanged(model: nn.Module, before: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def gpt2(tie: bool = True) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50, n_positions=16,
                                     bos_token_id=0, eos_token_id=0, tie_word_embeddings=tie)
    return transformers.GPT2LMHeadModel(config)


def t5() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    return transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=40, d_model=8, d_kv=4, d_ff=16, num_layers=1, num_heads=2, decoder_start_token_id=0))


TIES = {  # the model's keys that are one tensor: save_pretrained writes the first of each group only
    "gpt2": (gpt2, ["transformer.wte.weight", "lm_head.weight"]),
    "t5": (t5, ["shared.weight", "encoder.embed_tokens.weight", "decoder.embed_tokens.weight", "lm_head.weight"]),
}


@pytest.mark.parametrize("where", ["folder", "model.safetensors", "shards", "index"])
@pytest.mark.parametrize("arch", list(TIES))
def test_save_pretrained_of_a_tied_model_loads_bit_for_bit_and_stays_tied(tmp_path: Path, arch: str,
                                                                          where: str) -> None:
    """huggingface/transformers, tests/test_modeling_common.py (test_tied_weights_keys: save_pretrained
    writes one key per tied group, from_pretrained re-ties) and tests/utils/test_modeling_utils.py (checkpoint
    sharding with a small max_shard_size, loaded from the folder and from its index): through our load,
    the keys left out are filled from the one saved (torch's strict load called them missing), every
    weight is bit-equal and the ties hold."""
    make, tied = TIES[arch]
    torch.manual_seed(0)
    saved = make()
    saved.save_pretrained(tmp_path / "hf", max_shard_size="3KB" if where in ("shards", "index") else "5GB")
    path = tmp_path / "hf" / {"folder": "", "model.safetensors": "model.safetensors", "shards": "",
                              "index": "model.safetensors.index.json"}[where]
    torch.manual_seed(1)
    fresh = make()
    ck = tp.load(path, model=fresh)
    same_weights(saved, fresh)
    state = fresh.state_dict(keep_vars=True)
    assert all(state[k] is state[tied[0]] for k in tied)
    assert any(f"{tied[-1]} from {tied[0]}" in n for n in ck.notes), ck.notes
    assert ck.missing_keys == [] and ck.unexpected_keys == []


def test_a_checkpoint_of_an_untied_model_is_refused_by_a_tied_one(tmp_path: Path) -> None:
    """transformers' tie_word_embeddings=False checkpoints (a fine-tune that untied the head) loaded into
    the tied config: torch's load_state_dict copies both keys into the one tensor, the last wins, and the
    embedding is silently the head's. Ours refuses before anything is written and names the keys."""
    torch.manual_seed(0)
    untied = gpt2(tie=False)
    path = tp.save(tmp_path / "untied.safetensors", model=untied)
    torch.manual_seed(1)
    plain, ours = gpt2(), gpt2()
    plain.load_state_dict(untied.state_dict())
    assert not torch.equal(plain.transformer.wte.weight, untied.transformer.wte.weight)  # what torch does
    before = snapshot(ours)
    with pytest.raises(tp.CheckpointError, match=r"(?s)transformer\.wte\.weight = lm_head\.weight are one tensor.*"
                                                 r"tie_word_embeddings=False"):
        tp.load(path, model=ours)
    assert unchanged(ours, before)
    fits = gpt2(tie=False)
    tp.load(path, model=fits)
    same_weights(untied, fits)


def decay_groups(model: nn.Module) -> list[dict[str, Any]]:
    """transformers' Trainer.create_optimizer grouping: weight decay on weights, none on biases and norms."""
    decay = [p for n, p in model.named_parameters() if n.endswith("weight") and ".ln" not in n and "ln_" not in n]
    rest = [p for n, p in model.named_parameters() if not any(p is q for q in decay)]
    return [{"params": decay, "weight_decay": 0.01}, {"params": rest, "weight_decay": 0.0}]


def trained(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    loss = model(torch.randint(0, 50, (2, 8))).logits.float().pow(2).mean()
    loss.backward()
    opt.step()


def test_an_optimizer_whose_groups_do_not_fit_leaves_the_model_as_it_was(tmp_path: Path) -> None:
    """pytorch/pytorch, test/optim/test_optim.py (load_state_dict refuses another number of param groups
    or a group of another size) with transformers' decay / no-decay groups: torch refuses the optimizer
    only after our load had given the model the new weights; now nothing is loaded."""
    torch.manual_seed(0)
    model = gpt2()
    opt = torch.optim.AdamW(decay_groups(model), lr=1e-3)
    trained(model, opt)
    path = tp.save(tmp_path / "ck.safetensors", model=model, optimizer=opt)
    fresh = gpt2()
    before = snapshot(fresh)
    one_group = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
    with pytest.raises(tp.CheckpointError, match=r"different number of parameter groups: 2 saved, 1 in the "
                                                 r"optimizer\)\. Nothing was loaded"):
        tp.load(path, model=fresh, optimizer=one_group)
    assert unchanged(fresh, before) and one_group.state == {}
    groups = decay_groups(fresh)
    groups[1]["params"] = groups[1]["params"][1:]
    short = torch.optim.AdamW(groups, lr=1e-3)
    with pytest.raises(tp.CheckpointError, match="group 1 has .* parameters saved and .* in the optimizer"):
        tp.load(path, model=fresh, optimizer=short)
    assert unchanged(fresh, before)
    right = torch.optim.AdamW(decay_groups(fresh), lr=1e-3)
    tp.load(path, model=fresh, optimizer=right)
    same_weights(model, fresh)
    assert [g["weight_decay"] for g in right.param_groups] == [0.01, 0.0]


def test_asking_for_state_the_file_lacks_leaves_the_model_as_it_was(tmp_path: Path) -> None:
    """A save_pretrained folder (weights only) loaded with the optimizer= of a resumed run."""
    torch.manual_seed(0)
    gpt2().save_pretrained(tmp_path / "hf")
    fresh = gpt2()
    before = snapshot(fresh)
    with pytest.raises(tp.CheckpointError, match=r"has no optimizer state .*Fix: load it without optimizer=\. "
                                                 "Nothing was loaded"):
        tp.load(tmp_path / "hf", model=fresh, optimizer=torch.optim.AdamW(fresh.parameters()))
    assert unchanged(fresh, before)


@pytest.mark.parametrize("ours", [True, False])
def test_fp32_optimizer_state_into_bf16_parameters_is_cast_as_torch_casts_it(tmp_path: Path, ours: bool) -> None:
    """pytorch/pytorch, test/optim/test_optim.py (load_state_dict casts floating state to the parameter's
    dtype, `step` excepted): a run resumed in bf16 from an fp32 checkpoint gets the state torch would give."""
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    if ours:
        path = tp.save(tmp_path / "f.safetensors", model=model, optimizer=opt)
    else:
        path = tmp_path / "f.pt"
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, path)
    half = nn.Linear(4, 4).to(torch.bfloat16)
    half_opt = torch.optim.Adam(half.parameters())
    tp.load(path, model=half, optimizer=half_opt)
    ref = nn.Linear(4, 4).to(torch.bfloat16)
    ref_opt = torch.optim.Adam(ref.parameters())
    ref.load_state_dict(model.state_dict())
    ref_opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    same_weights(ref, half)
    for want, got in zip(ref_opt.state.values(), half_opt.state.values()):
        assert {k: (v.dtype, v.tolist()) for k, v in want.items()} == {k: (v.dtype, v.tolist()) for k, v in got.items()}


def on_meta(how: str, make: Any) -> nn.Module:
    if how == "torch.device":
        with torch.device("meta"):
            return make()
    accelerate = pytest.importorskip("accelerate")
    with accelerate.init_empty_weights():
        model = make()
    model.tie_weights()  # transformers ties after loading; accelerate's big-model recipe ties before
    return model


@pytest.mark.parametrize("how", ["torch.device", "init_empty_weights"])
def test_a_model_made_on_meta_takes_the_files_tensors(tmp_path: Path, how: str) -> None:
    """huggingface/accelerate, tests/test_big_modeling.py (init_empty_weights, then load a checkpoint into
    the empty model) and pytorch/pytorch, test/test_nn.py (load_state_dict(assign=True) into a meta model):
    torch's plain load into meta tensors is a no-op with a warning, so our load returned as if it had
    loaded and the model stayed empty (and device= raised torch's NotImplementedError from .to()). Now
    every tensor is the file's, on DEVICE, Parameters still, tied weights one Parameter again."""
    torch.manual_seed(0)
    saved = gpt2()
    saved.save_pretrained(tmp_path / "hf")
    empty = on_meta(how, gpt2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch's "copying ... to a meta parameter is a no-op" fails
        ck = tp.load(tmp_path / "hf", model=empty, device="cpu")
    same_weights(saved, empty)
    assert all(type(p) is nn.Parameter and p.requires_grad and p.device.type == "cpu" for p in empty.parameters())
    assert empty.lm_head.weight is empty.transformer.wte.weight
    assert len(list(empty.parameters())) == len(list(saved.parameters()))
    assert any("on the meta device" in n for n in ck.notes)
    x = torch.randint(0, 50, (1, 6))
    assert torch.equal(saved.eval()(x).logits, empty.eval()(x).logits)


def test_a_meta_model_takes_the_dtype_it_was_built_with(tmp_path: Path) -> None:
    """A bf16 model made on meta from an fp32 checkpoint holds bf16 weights, as a load into real bf16 tensors."""
    torch.manual_seed(0)
    saved = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3))
    path = tp.save(tmp_path / "s.safetensors", model=saved)
    with torch.device("meta"):
        empty = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3)).to(torch.bfloat16)
    tp.load(path, model=empty)
    same_weights(saved.to(torch.bfloat16), empty)


class Rotary(nn.Module):
    """A Llama-style rotary table: a non-persistent buffer, never in a checkpoint."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(0, 4, 2) / 4), persistent=False)


def test_a_meta_model_with_tensors_the_file_cannot_fill_is_refused_as_it_was(tmp_path: Path) -> None:
    path = tp.save(tmp_path / "r.safetensors", model=Rotary())
    with torch.device("meta"):
        empty = Rotary()
    with pytest.raises(tp.CheckpointError, match=r"(?s)1 of the 3 tensor\(s\) Rotary has on the meta device are "
                                                 r"not in the file.*nothing was loaded: inv_freq\..*to_empty"
                                                 r".*non-persistent"):
        tp.load(path, model=empty, device="cpu")
    assert all(t.is_meta for t in [*empty.parameters(), *empty.buffers()])
    real = Rotary()
    tp.load(path, model=real, device="cpu")
