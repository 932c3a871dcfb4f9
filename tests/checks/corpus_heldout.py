"""The held-out corpus: a random third of the public cases, NOT read while changing the diagnosis;
scored once at the end.

Device mistakes and legal patterns from public reports (each case names its source: an issue as owner/repo#number
or a documentation page), none of them in corpus.py. Same shape as corpus.py (see corpus_kit.py); scored by
`torchplace bench diagnose --corpus tests/checks/FILE`. A mistake names what a report must contain (culprit), its
module path and the user's line (the line ending in `# case: NAME`); a legal pattern must raise nothing in any
mode. On the CPU the pair is meta (where the model runs) vs cpu (where a factory without a device lands); cases
only a real accelerator refuses list the GPU pairs only.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
from corpus_kit import (  # noqa: E402, F401
    ALL,
    GPU,
    PAIRS,
    C,
    Program,
    Registry,
    Toy,
    W,
    _explain,
    explain_here,
    forward_step,
    labels,
    randn,
    stepped,
)

R = Registry(__file__)
CASES = R.CASES
for_pair = R.for_pair
__all__ = ["ALL", "CASES", "PAIRS", "for_pair"]


class ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 2, 3)
        self.fc = nn.Linear(18, C)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.conv(x).flatten(1))


def image_step(model: nn.Module, images: torch.Tensor) -> torch.Tensor:
    explain_here(model, images)
    return model(images)  # case: conv_images_not_moved


# images from the loader never moved: "Input type (torch.FloatTensor) and weight type (torch.cuda.FloatTensor)"
@R.mistake("glam-imperial/cider#6", "images", "model.conv", pairs=GPU)
def conv_images_not_moved(dev: torch.device, other: torch.device) -> Program:
    model = ConvNet().to(dev)
    images = randn(2, 1, 5, 5, device=other)
    return stepped(model, lambda: image_step(model, images), (images,))


def depth_loss(model: nn.Module, x: torch.Tensor, depth_gt: torch.Tensor) -> torch.Tensor:
    explain_here(model, x)
    depth = model(x)
    return F.smooth_l1_loss(depth, depth_gt)  # case: smooth_l1_target_on_cpu


# the ground truth depth stays on the CPU, the loss mixes it with the prediction
@R.mistake("FangjinhuaWang/PatchmatchNet#35", "depth_gt")
def smooth_l1_target_on_cpu(dev: torch.device, other: torch.device) -> Program:
    model = Toy().to(dev)
    x, depth_gt = randn(4, W, device=dev), randn(4, C, device=other)
    return stepped(model, lambda: depth_loss(model, x, depth_gt), (x,))


def perplexity_loss(model: nn.Module, x: torch.Tensor, target_ids: torch.Tensor) -> torch.Tensor:
    explain_here(model, x)
    logp = model(x).log_softmax(-1)
    return F.nll_loss(logp, target_ids)  # case: nll_target_ids_on_cpu


# "argument target in method wrapper_CUDA_nll_loss_forward": token ids from the tokenizer not moved
@R.mistake("asahi417/lmppl#14", "target_ids")
def nll_target_ids_on_cpu(dev: torch.device, other: torch.device) -> Program:
    model = Toy().to(dev)
    x, target_ids = randn(4, W, device=dev), labels(4, other)
    return stepped(model, lambda: perplexity_loss(model, x, target_ids), (x,))


class Schedule:
    """A diffusion schedule: a plain object whose tables stay where they were made."""

    def __init__(self) -> None:
        self.alphas_cumprod = torch.linspace(0.99, 0.01, 10)

    def q_sample(self, x0: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return x0 * self.alphas_cumprod[t].view(-1, 1)  # case: schedule_table_indexed_by_gpu_t


# indexing a CPU table with timesteps on the GPU: "indices should be either on cpu or on the same device"
@R.mistake("modelscope/modelscope#220", "alphas_cumprod", pairs=GPU)
def schedule_table_indexed_by_gpu_t(dev: torch.device, other: torch.device) -> Program:
    model = Toy().to(dev)
    schedule = Schedule()
    x, t = randn(4, W, device=dev), torch.randint(0, 10, (4,), device=dev)
    return Program(model, lambda: schedule.q_sample(model(x), t), (x,), explain=lambda: _explain(model, x, schedule))


class LitOneHot(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer_1 = nn.Linear(W, W)
        self.tem = torch.eye(W)[:1].repeat(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer_1(x) + self.tem  # case: lightning_tem_attribute


# a tensor made in __init__ is not moved to the GPU with the LightningModule
@R.mistake("Lightning-AI/pytorch-lightning#3674", "tem", "model")
def lightning_tem_attribute(dev: torch.device, other: torch.device) -> Program:
    model = LitOneHot().to(dev)
    x = randn(4, W, device=dev)
    return Program(model, lambda: model(x), (x,))


class BufferList(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(W, W)
        self.params = []
        for i in range(2):
            self.register_buffer(f"param_{i}", torch.rand(W))
            self.params.append(getattr(self, f"param_{i}"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x) * self.params[0]  # case: list_of_registered_buffers


# a list that points at buffers: .cuda() replaces the buffers, the list keeps the CPU tensors
@R.mistake("pytorch/pytorch#29807", "params", "model")
def list_of_registered_buffers(dev: torch.device, other: torch.device) -> Program:
    model = BufferList().to(dev)
    x = randn(4, W, device=dev)
    return Program(model, lambda: model(x), (x,))


class DeterministicPolicy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mean = nn.Linear(W, C)
        self.noise = torch.Tensor(C)

    def forward(self, state: torch.Tensor) -> torch.Tensor:
        noise = self.noise.normal_(0.0, std=0.1)
        return self.mean(state) + noise  # case: policy_noise_attribute


# the policy's noise tensor made with torch.Tensor(n) in __init__ stays on the CPU
@R.mistake("pranz24/pytorch-soft-actor-critic#21", "noise", "model")
def policy_noise_attribute(dev: torch.device, other: torch.device) -> Program:
    model = DeterministicPolicy().to(dev)
    state = randn(4, W, device=dev)
    return Program(model, lambda: model(state), (state,))


def weighted_ce(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    explain_here(model, x)
    logits = model(x)
    class_w = torch.tensor([1.0, 2.0, 0.5])
    return F.cross_entropy(logits, y, weight=class_w)  # case: class_weight_factory_in_step


# class weights made in the step with torch.tensor(...) and passed to cross_entropy
@R.mistake("pytorch/pytorch#150750", ("class_w", "torch.tensor"))
def class_weight_factory_in_step(dev: torch.device, other: torch.device) -> Program:
    model = Toy().to(dev)
    x, y = randn(4, W, device=dev), labels(4, dev)
    return stepped(model, lambda: weighted_ce(model, x, y), (x,))


class DropConnect(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(W, W)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        keep = torch.bernoulli(torch.full((x.shape[0], 1), 0.9))
        return self.proj(x) * keep / 0.9  # case: drop_mask_bernoulli_cpu


# EfficientNet's drop-connect mask made on the CPU
@R.mistake("ARISE-Initiative/robomimic#124", ("keep", "torch.bernoulli"), "model")
def drop_mask_bernoulli_cpu(dev: torch.device, other: torch.device) -> Program:
    model = DropConnect().to(dev)
    x = randn(4, W, device=dev)
    return Program(model, lambda: model(x), (x,))


def accuracy_step(model: nn.Module, x: torch.Tensor, gold: torch.Tensor) -> torch.Tensor:
    explain_here(model, x)
    pred = model(x).argmax(1)
    return (pred == gold).float().mean()  # case: accuracy_gold_on_cpu


# validation accuracy comparing GPU predictions with CPU labels
@R.mistake("HoyTta0/KnowledgeDistillation#10", "gold")
def accuracy_gold_on_cpu(dev: torch.device, other: torch.device) -> Program:
    model = Toy().to(dev)
    x, gold = randn(4, W, device=dev), labels(4, other)
    return stepped(model, lambda: accuracy_step(model, x, gold), (x,))


class Discriminator(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(W, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def gan_d_step(model: nn.Module, real: torch.Tensor) -> torch.Tensor:
    explain_here(model, real)
    d_out = model(real)
    real_label = torch.ones(real.shape[0], 1)
    return F.binary_cross_entropy_with_logits(d_out, real_label)  # case: gan_label_ones_on_cpu


# the DCGAN loop's label tensor made with torch.ones(...) without a device
@R.mistake("Lightning-AI/pytorch-lightning#17299", ("real_label", "torch.ones"))
def gan_label_ones_on_cpu(dev: torch.device, other: torch.device) -> Program:
    model = Discriminator().to(dev)
    real = randn(4, W, device=dev)
    return stepped(model, lambda: gan_d_step(model, real), (real,))


class Prompted(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(W, W)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x) + self.prompt  # case: prompt_set_after_move


# an adapter's tensor assigned on the model after model.to(): a plain attribute on the CPU
@R.mistake("OpenNMT/OpenNMT-py#240", "prompt", "model")
def prompt_set_after_move(dev: torch.device, other: torch.device) -> Program:
    model = Prompted().to(dev)
    model.prompt = torch.zeros(W)
    x = randn(4, W, device=dev)
    return Program(model, lambda: model(x), (x,))


class Normalizer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(W, C)
        self.mean = torch.full((W,), 0.5)
        self.std = torch.full((W,), 0.25)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net((x - self.mean) / self.std)  # case: normalize_stats_attribute


# input normalisation statistics kept as plain attributes of the model
@R.mistake("woven-by-toyota/l5kit#305", "mean", "model")
def normalize_stats_attribute(dev: torch.device, other: torch.device) -> Program:
    model = Normalizer().to(dev)
    x = randn(4, W, device=dev)
    return Program(model, lambda: model(x), (x,))


class TimeEmbedding(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mlp = nn.Linear(W, W)

    def forward(self, x: torch.Tensor, timesteps: torch.Tensor) -> torch.Tensor:
        half = W // 2
        freqs = torch.exp(-torch.arange(half, dtype=torch.float32) / half)
        args = timesteps[:, None].float() * freqs[None]  # case: timestep_freqs_on_cpu
        return self.mlp(x + torch.cat([args.cos(), args.sin()], -1))


# sinusoidal timestep embedding: freqs = torch.exp(torch.arange(...)) made without a device
@R.mistake("huggingface/diffusers#9354", "freqs", "model")
def timestep_freqs_on_cpu(dev: torch.device, other: torch.device) -> Program:
    model = TimeEmbedding().to(dev)
    x, timesteps = randn(4, W, device=dev), torch.randint(0, 10, (4,), device=dev)
    return Program(model, lambda: model(x, timesteps), (x, timesteps))


def ema_update(model: nn.Module, ema: nn.Module, x: torch.Tensor) -> None:
    explain_here(model, x, ema)
    with torch.no_grad():
        for e, p in zip(ema.parameters(), model.parameters()):
            e.mul_(0.99).add_(p.detach() * 0.01)  # case: ema_copy_not_moved
    return ema(x)


# an EMA copy of the model made with copy.deepcopy before model.to(): it stays on the CPU (torch refuses the in-place
# update of its CPU parameters with the GPU model's: the line is the update's, not the EMA's forward after it)
@R.mistake("JDAI-CV/fast-reid#690", "ema", "ema", pairs=GPU)
def ema_copy_not_moved(dev: torch.device, other: torch.device) -> Program:
    import copy

    model = Toy()
    ema = copy.deepcopy(model)
    model.to(dev)
    x = randn(4, W, device=dev)
    return stepped(model, lambda: ema_update(model, ema, x), (x,))


class RotaryBuffer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(W, W)
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, W, 2).float() / W)), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = torch.arange(x.shape[0], device=x.device).float()
        freqs = torch.outer(t, self.inv_freq)
        return self.proj(x) * torch.cat([freqs.cos(), freqs.sin()], -1)


# inv_freq registered as a non-persistent buffer: it moves with the model
@R.legal("vllm-project/vllm#27617")
def rotary_buffer(dev: torch.device, other: torch.device) -> Program:
    model = RotaryBuffer().to(dev)
    x = randn(4, W, device=dev)
    return stepped(model, lambda: forward_step(model, x), (x,))


class NormalizeOnDevice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(W, C)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mean = torch.as_tensor([0.5] * W, dtype=x.dtype, device=x.device)
        return self.net(x - mean)


# torchvision's Normalize makes mean and std on the image's device
@R.legal("kornia/kornia#224")
def normalize_on_input_device(dev: torch.device, other: torch.device) -> Program:
    model = NormalizeOnDevice().to(dev)
    x = randn(4, W, device=dev)
    return stepped(model, lambda: forward_step(model, x), (x,))


class AnchorSizes(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(W, W)
        self.sizes = torch.tensor([2, 6])
        self.count = torch.tensor(4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        n = int(self.count)
        return torch.split(self.proj(x)[:n], self.sizes.tolist(), dim=1)


# tensor attributes read only on the host (tolist(), int()): where they sit does not matter
@R.legal("pytorch/pytorch#7466")
def host_read_attributes(dev: torch.device, other: torch.device) -> Program:
    model = AnchorSizes().to(dev)
    x = randn(4, W, device=dev)
    return stepped(model, lambda: forward_step(model, x), (x,))


class RunningBuffer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(W, W)
        self.register_buffer("running", torch.zeros(W))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        self.running = 0.9 * self.running + 0.1 * h.detach().mean(0)  # reassigned: stays a buffer
        return h - self.running


# a buffer reassigned in forward stays a buffer and moves with the model
@R.legal("Lightning-AI/torchmetrics#167")
def buffer_reassigned_in_forward(dev: torch.device, other: torch.device) -> Program:
    model = RunningBuffer().to(dev)
    x = randn(4, W, device=dev)
    return stepped(model, lambda: forward_step(model, x), (x,))


class WithGenerator(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(W, W)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gen = torch.Generator(device=x.device).manual_seed(0) if x.device.type != "meta" else None
        return self.proj(x) + torch.randn(x.shape, generator=gen, device=x.device)


# a generator made on the input's device
@R.legal("pytorch/pytorch#62152")
def generator_on_input_device(dev: torch.device, other: torch.device) -> Program:
    model = WithGenerator().to(dev)
    x = randn(4, W, device=dev)
    return stepped(model, lambda: forward_step(model, x), (x,))


class CpuIndexAttr(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(W, W)
        self.order = torch.tensor([7, 6, 5, 4, 3, 2, 1, 0])  # a CPU permutation, used as an index

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)[:, self.order]


# a CPU index tensor kept as an attribute: indexing takes CPU indices on any device
@R.legal("pytorch/xla#3188")
def cpu_index_attribute(dev: torch.device, other: torch.device) -> Program:
    model = CpuIndexAttr().to(dev)
    x = randn(4, W, device=dev)
    return stepped(model, lambda: forward_step(model, x), (x,))


class ScalarTensorArg(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(W, W)

    def forward(self, x: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
        return (self.proj(x) / temperature).softmax(-1)


# a 0-dim CPU tensor passed as an input (a temperature): a scalar to torch
@R.legal("kornia/kornia#224")
def zero_dim_input(dev: torch.device, other: torch.device) -> Program:
    model = ScalarTensorArg().to(dev)
    x, temperature = randn(4, W, device=dev), torch.tensor(0.07)
    return stepped(model, lambda: forward_step(model, x, temperature), (x, temperature))
