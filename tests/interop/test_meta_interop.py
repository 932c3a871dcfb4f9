"""Meta models other libraries make, on the CPU: accelerate's init_empty_weights (the big-model loading
workflow: build empty, then load_checkpoint_and_dispatch), a transformers model made from its config on
meta (the from_config / device_map workflow), and accelerate's cpu_offload (weights on meta outside the
forward). A forgotten load is named by watch(), strict() and explain(); shape inference raises nothing.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import torchplace as tp

pytest.importorskip("accelerate")
pytest.importorskip("transformers")


def gpt2_config():  # type: ignore[no-untyped-def]
    from transformers import GPT2Config

    return GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50, n_positions=16, bos_token_id=0, eos_token_id=0)


def empty_gpt2() -> nn.Module:
    from accelerate import init_empty_weights
    from transformers import GPT2LMHeadModel

    with init_empty_weights():
        return GPT2LMHeadModel(gpt2_config())


def generate_one(model: nn.Module, ids: torch.Tensor) -> int:
    logits = model(input_ids=ids).logits
    return logits[0, -1].argmax().item()  # the user's line that reads data


@pytest.mark.parametrize("face", ["watch", "strict"])
def test_init_empty_weights_then_to_names_the_transformers_weights(face: str) -> None:
    model = empty_gpt2()
    block = tp.watch(model) if face == "watch" else tp.strict(model=model)
    with pytest.raises(tp.MetaTensorError) as err, block:
        model.to("cpu")
    text = str(err.value)
    assert 'in `model.to("cpu")`' in text and "test_meta_interop.py:" in text, text
    assert "model.transformer.wte.weight is on meta" in text
    assert "model (GPT2LMHeadModel): " in text and "parameters and buffers on meta" in text
    assert "init_empty_weights" in text and "torchplace.load(path, model=model)" in text


def test_the_lm_head_read_on_an_empty_model_is_named() -> None:
    model = empty_gpt2()
    with pytest.raises(tp.MetaTensorError) as err, tp.watch(model):
        model.lm_head.weight.detach().cpu()
    text = str(err.value)
    assert "model.lm_head.weight is on meta" in text, text  # tied to wte: named by the path the line used
    assert "  model.lm_head.weight: meta float32 [50, 16] (parameter model.lm_head.weight)" in text


def test_generating_from_a_model_built_on_meta_from_its_config() -> None:
    """A transformers model made from its config on meta runs (the embedding accepts CPU ids) and fails
    only where the logits are read: named at the user's line, with the model and the fix."""
    from transformers import GPT2LMHeadModel

    with torch.device("meta"):
        model = GPT2LMHeadModel(gpt2_config()).eval()
    ids = torch.tensor([[1, 2, 3]])
    for block in (tp.watch(model), tp.strict(model=model)):
        with pytest.raises(tp.MetaTensorError) as err, block:
            generate_one(model, ids)
        text = str(err.value)
        assert "in `logits[0, -1].argmax().item()`" in text and "in generate_one()" in text, text
        assert "logits[0, -1].argmax() is on meta" in text and "computed from meta tensors" in text
        assert "model (GPT2LMHeadModel)" in text and "torchplace.load(path, model=model)" in text
    report = tp.explain(model, ids)
    assert report["forward"] == "ran"  # the forward itself needs no data
    with tp.strict(model=model), tp.watch(model):  # shape inference: meta in, meta out, no alarm
        out = model(input_ids=ids.to("meta")).logits
    assert out.is_meta and out.shape == (1, 3, 50)


def test_loading_fixes_the_empty_model(tmp_path: Path) -> None:
    from transformers import GPT2LMHeadModel

    torch.manual_seed(0)
    trained = GPT2LMHeadModel(gpt2_config()).eval()
    path = tp.save(tmp_path / "gpt2", model=trained)
    model = empty_gpt2().eval()
    ids = torch.tensor([[1, 2, 3]])
    with tp.strict(model=model):
        tp.load(path, model=model)
        assert generate_one(model, ids) == generate_one(trained, ids)


def test_accelerate_load_checkpoint_and_dispatch_fixes_it_too(tmp_path: Path) -> None:
    from accelerate import init_empty_weights, load_checkpoint_and_dispatch

    torch.manual_seed(0)
    trained = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    torch.save(trained.state_dict(), tmp_path / "weights.bin")
    with init_empty_weights():
        model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    with pytest.raises(tp.MetaTensorError), tp.watch(model):
        model[1].bias.tolist()
    model = load_checkpoint_and_dispatch(model, str(tmp_path / "weights.bin"), device_map={"": "cpu"})
    with tp.strict(model=model):
        assert len(model[1].bias.tolist()) == 2


def test_offloaded_weights_read_outside_the_forward_say_offloaded() -> None:
    from accelerate import cpu_offload

    model = cpu_offload(nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2)), execution_device=torch.device("cpu"))
    x = torch.randn(3, 4)
    with tp.strict(model=model), tp.watch(model):
        assert model(x).shape == (3, 2)  # the hooks load the weights for the forward: no alarm
    with pytest.raises(tp.MetaTensorError) as err, tp.watch(model):
        model[0].weight.cpu()
    text = str(err.value)
    assert "model.0.weight is on meta" in text and "offload(s) its weights with accelerate" in text, text
    assert "Fix: use the weights through the module's forward" in text


def test_a_cpu_batch_for_an_empty_model_is_a_mismatch_with_the_meta_why() -> None:
    """init_empty_weights leaves a linear layer's weights on meta: a CPU batch fails in the forward."""
    from accelerate import init_empty_weights

    with init_empty_weights():
        model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    with pytest.raises(tp.DeviceMismatchError) as err, tp.strict(model=model):
        model(torch.randn(2, 4))
    text = str(err.value)
    assert "Why: model.0.weight, model.0.bias are on meta" in text and "init_empty_weights" in text, text
    assert "Fix: load the weights into it" in text
