"""tp.place on models other frameworks build or wrap: a Hugging Face GPT-2 with tied embeddings, a
model accelerate offloaded with its hooks, a torch.compile'd module, a LightningModule; cpu and meta
devices stand in for two GPUs.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import torchplace as tp
from torchplace.errors import DeviceError


def gpt2() -> tuple[nn.Module, torch.Tensor]:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=50, n_positions=16,
                                       bos_token_id=0, eos_token_id=0)).eval()
    return model, torch.randint(0, 50, (2, 7))


def devices_of(model: nn.Module) -> dict[str, str]:
    return {name: str(t.device) for name, t in [*model.named_parameters(), *model.named_buffers()]}


def test_tied_embedding_split_across_devices_is_refused_before_anything_moves():
    """Ported in our terms from huggingface/accelerate tests/test_big_modeling.py (tied weights kept on
    one device by dispatch_model): GPT-2's lm_head shares wte's weight; a split that puts them apart
    is refused and no tensor moved; placed together, the forward is unchanged."""
    model, ids = gpt2()
    before, expected = devices_of(model), model(ids).logits
    with pytest.raises(DeviceError, match="tied.*'transformer.wte.weight' -> cpu; 'lm_head.weight' -> meta"):
        tp.place(model, {"transformer.wte": "cpu", "lm_head": "meta"})
    assert devices_of(model) == before and not model._forward_pre_hooks
    tp.place(model, {"transformer": "cpu", "lm_head": "cpu"})
    assert model.lm_head.weight is model.transformer.wte.weight
    assert torch.equal(model(ids).logits, expected)


def test_device_map_style_dict_with_torch_devices_and_numpy_ints():
    """Ported in our terms from huggingface/transformers tests/utils/test_modeling_utils.py (device_map
    dicts of module name -> int / 'cpu' / torch.device): the values accelerate writes are taken."""
    import numpy as np

    model, ids = gpt2()
    plan = tp.place(model, {"transformer.wte": torch.device("cpu"), "transformer.h": "cpu", "lm_head": "CPU "})
    assert set(plan.devices.values()) == {torch.device("cpu")}
    assert model(ids).logits.shape == (2, 7, 50)
    with pytest.raises(DeviceError, match="'disk' names no device type"):
        tp.place(gpt2()[0], {"transformer": "cpu", "lm_head": "disk"})
    plan = tp.place(gpt2()[0], {"transformer": np.int64(0)} if torch.cuda.is_available() else {"transformer": "cpu"})
    assert plan.devices["transformer"].type in ("cuda", "cpu")  # accelerate's int 0 is cuda:0, numpy's too


def test_an_accelerate_offloaded_model_is_refused_with_its_hooks_named_and_left_as_it_was():
    """Ported in our terms from huggingface/accelerate tests/test_big_modeling.py (cpu_offload keeps
    the weights on meta and loads them in its hooks): place() used to raise torch's bare
    NotImplementedError 'Cannot copy out of meta tensor' half way through moving the model."""
    from accelerate import cpu_offload

    model, ids = gpt2()
    expected = model(ids).logits
    cpu_offload(model, execution_device=torch.device("cpu"))
    before = devices_of(model)
    with pytest.raises(DeviceError, match="(?s)dispatched by accelerate; nothing was moved.*weights offloaded"):
        tp.place(model, {"": "cpu"})
    assert devices_of(model) == before and not model._forward_pre_hooks
    assert torch.allclose(model(ids).logits, expected)  # accelerate's hooks still work


def test_a_model_accelerate_dispatched_is_refused_naming_its_hooks_and_the_fix():
    """dispatch_model with a device_map attaches AlignDevicesHooks that move every input to their
    execution device inside forward, after place()'s pre-hooks: place() moved layer 2 to meta and
    the forward died in torch's 'Cannot copy out of meta tensor'. Refused before anything moves;
    after accelerate.hooks.remove_hook_from_submodules the same place() works."""
    from accelerate import dispatch_model
    from accelerate.hooks import remove_hook_from_submodules

    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    x = torch.randn(3, 4)
    expected = net(x)
    dispatch_model(net, device_map={"0": "cpu", "1": "cpu", "2": "cpu"}, force_hooks=True)
    with pytest.raises(DeviceError) as err:
        tp.place(net, {"2": "meta"})
    message = str(err.value)
    assert "Sequential is already dispatched by accelerate; nothing was moved" in message
    assert "4 module(s) carry accelerate device hooks" in message
    assert "'2' -> AlignDevicesHook on cpu" in message and "hf_device_map: {'0': 'cpu'," in message
    assert "Or: accelerate.hooks.remove_hook_from_submodules(model)" in message
    assert devices_of(net) == dict.fromkeys(devices_of(net), "cpu") and not net[2]._forward_pre_hooks
    assert torch.equal(net(x), expected)  # accelerate's placement still runs
    remove_hook_from_submodules(net)
    tp.place(net, {"2": "meta"})
    assert net(x).is_meta and net[0].weight.device.type == "cpu"


def test_a_disk_offloaded_model_is_refused_and_placeable_once_its_hooks_are_off(tmp_path):
    from accelerate import dispatch_model
    from accelerate.hooks import remove_hook_from_submodules

    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    x = torch.randn(3, 4)
    expected = net(x)
    dispatch_model(net, device_map={"0": "cpu", "1": "cpu", "2": "disk"}, offload_dir=str(tmp_path))
    assert net[2].weight.is_meta
    with pytest.raises(DeviceError, match="'2' -> AlignDevicesHook on cpu, weights offloaded"):
        tp.place(net, {"": "cpu"})
    remove_hook_from_submodules(net)  # the offloaded weights come back from the offload folder
    assert not net[2].weight.is_meta
    tp.place(net, {"": "cpu"}, output="cpu")
    assert torch.equal(net(x), expected)


def test_accelerate_hooks_in_a_sequential_hook_count_and_hooks_that_move_nothing_do_not():
    from accelerate.hooks import AlignDevicesHook, ModelHook, add_hook_to_module

    net = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    add_hook_to_module(net[1], ModelHook())  # a user's hook that moves nothing
    assert tp.place(net, {"1": "meta"}).devices == {"1": torch.device("meta")}
    net = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    add_hook_to_module(net[1], ModelHook())
    add_hook_to_module(net[1], AlignDevicesHook(execution_device="cpu"), append=True)  # -> SequentialHook
    assert type(net[1]._hf_hook).__name__ == "SequentialHook"
    with pytest.raises(DeviceError, match=r"1 module\(s\).*'1' -> AlignDevicesHook on cpu\."):
        tp.place(net, {"1": "meta"})


def test_a_model_made_on_meta_placed_on_cpu_is_refused_by_name():
    with torch.device("meta"):
        net = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    with pytest.raises(DeviceError, match="'0.weight' is a meta tensor.*to_empty"):
        tp.place(net, {"": "cpu"})
    assert tp.place(net, {"": "meta"}).devices == {"": torch.device("meta")}


def test_a_dispatched_model_without_hooks_places_like_a_plain_one():
    """Ported in our terms from huggingface/accelerate tests/test_big_modeling.py (dispatch_model on
    one device moves the model and adds no hooks)."""
    from accelerate import dispatch_model

    model, ids = gpt2()
    expected = model(ids).logits
    model = dispatch_model(model, device_map={"": "cpu"})
    plan = tp.place(model, {"": "cpu"}, output="cpu")
    assert torch.equal(model(ids).logits, expected) and plan.output_device == torch.device("cpu")


def test_a_module_that_inherits_its_device_gets_its_inputs_moved_after_a_split_sibling():
    """With {'': A, 'transformer.h.1': B}, ln_f and lm_head inherit A but receive h.1's output on B:
    their inputs are moved to A too (only the named modules were hooked, so on GPUs lm_head met a
    cuda:1 activation with cuda:0 weights). On cpu/meta, moving a meta activation to cpu is a clear
    DeviceError rather than torch's 'Tensor on device cpu is not on the expected device meta'."""
    net = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 8), nn.Linear(8, 2))
    plan = tp.place(net, {"": "cpu", "1": "meta"})
    assert net[2]._forward_pre_hooks and net[0]._forward_pre_hooks  # siblings of the split module
    with pytest.raises(DeviceError, match="cannot move a meta tensor"):  # was: a meta output, silently
        net(torch.randn(3, 4))
    plan.remove()
    assert not any(m._forward_pre_hooks for m in net.modules())
    model, ids = gpt2()
    tp.place(model, {"": "cpu", "transformer.h.1": "meta"})
    with pytest.raises(DeviceError, match="cannot move a meta tensor"):
        model(ids)


def test_a_compiled_module_takes_the_names_of_the_model_it_wraps():
    """torch.compile wraps the model as `_orig_mod`; its own names ('2') were refused with only
    '_orig_mod' listed. Both spellings now place the same submodule, and the compiled forward runs
    through the hooks."""
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    compiled = torch.compile(net, backend="eager")
    plan = tp.place(compiled, {"2": "meta"})
    assert plan.devices == {"_orig_mod.2": torch.device("meta")} and net[2].weight.is_meta
    assert compiled(torch.randn(3, 4)).device == torch.device("meta")
    with pytest.raises(DeviceError, match="'3' is not a submodule"):
        tp.place(compiled, {"3": "cpu"})


def test_a_lightning_module_is_placed_and_keeps_its_device_property_honest(monkeypatch):
    """Ported in our terms from Lightning-AI/pytorch-lightning tests/tests_pytorch/core/test_lightning_module.py
    (a LightningModule's device follows .to()): place() on a LightningModule split over cpu/meta."""
    monkeypatch.setenv("PYTORCH_NVML_BASED_CUDA_CHECK", "")  # importing lightning sets it: put it back after
    import lightning as L

    class Lit(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.body, self.head = nn.Linear(4, 8), nn.Linear(8, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.body(x))

    lit = Lit()
    plan = tp.place(lit, {"": "cpu", "head": "meta"})
    assert lit.body.weight.device == torch.device("cpu") and lit.head.weight.is_meta
    assert lit(torch.randn(2, 4)).is_meta and plan.output_device == torch.device("meta")
