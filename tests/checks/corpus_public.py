"""The public corpus the diagnosis was developed against: two thirds of the public cases
(the rest are in corpus_heldout.py).

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
from typing import Any

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


def summary(model: nn.Module, size: tuple[int, ...]) -> torch.Tensor:
    explain_here(model)
    probe = torch.rand(2, *size)
    return model(probe)  # case: summary_probe_on_cpu


# torchsummary builds its probe batch on the CPU while the model is on the GPU
@R.mistake("sksq96/pytorch-summary#16", ("probe", "torch.rand"), "model.layers.0.proj")
def summary_probe_on_cpu(dev: torch.device, other: torch.device) -> Program:
    model = Toy().to(dev)
    return stepped(model, lambda: summary(model, (W,)))


class SplitResNet(nn.Module):
    def __init__(self, first: torch.device, second: torch.device) -> None:
        super().__init__()
        self.seq1 = nn.Sequential(nn.Linear(W, W), nn.ReLU()).to(first)
        self.seq2 = nn.Linear(W, C).to(second)
        self.second = second

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.seq2(self.seq1(x).to(self.second))


def split_train_step(model: nn.Module, b_x: torch.Tensor, b_y: torch.Tensor) -> torch.Tensor:
    explain_here(model, b_x)
    output = model(b_x)
    return F.cross_entropy(output, b_y)  # case: split_model_labels_on_first_device


# a model split over two GPUs: its output is on the second, the labels were moved to the first
@R.mistake("sksq96/pytorch-summary#178", "b_y")
def split_model_labels_on_first_device(dev: torch.device, other: torch.device) -> Program:
    model = SplitResNet(other, dev)
    b_x, b_y = randn(4, W, device=other), labels(4, other)
    return stepped(model, lambda: split_train_step(model, b_x, b_y), (b_x,))


class EditedLinear(nn.Module):
    def __init__(self, layer: nn.Linear) -> None:
        super().__init__()
        self.layer = layer
        self.new_weight = layer.weight.detach().clone()  # an edited copy, kept as a plain attribute

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.new_weight) + self.layer.bias  # case: edited_weight_plain_attribute


# WISE keeps its edited weight as a plain tensor: model.to() leaves it behind
@R.mistake("zjunlp/EasyEdit#516", "new_weight", "model", pairs=GPU)  # meta kernels let linear mix
def edited_weight_plain_attribute(dev: torch.device, other: torch.device) -> Program:
    model = EditedLinear(nn.Linear(W, W, device=other))
    model.to(dev)
    x = randn(4, W, device=dev)
    return Program(model, lambda: model(x), (x,))


def trajectory_loss(model: nn.Module, x: torch.Tensor, target_avail: torch.Tensor) -> torch.Tensor:
    explain_here(model, x)
    pred = model(x)
    axis_scale = torch.tensor([1.0, 2.0, 1.0])
    return (pred * target_avail * axis_scale).mean()  # case: loss_scale_factory_in_step


# a weight vector made with torch.tensor([...]) in the loss, without a device
@R.mistake("woven-by-toyota/l5kit#305", ("axis_scale", "torch.tensor"))
def loss_scale_factory_in_step(dev: torch.device, other: torch.device) -> Program:
    model = Toy().to(dev)
    x, target_avail = randn(4, W, device=dev), torch.ones(4, C, device=dev)
    return stepped(model, lambda: trajectory_loss(model, x, target_avail), (x,))


def assign_layers(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    explain_here(model, x)
    boxes = model(x)
    layer_ids = torch.ones(boxes.shape[0], 1) * 2
    return torch.cat([boxes, layer_ids], dim=1)  # case: layer_ids_cat_in_loss


# yolov7-style loss: from_which_layer made with torch.ones(...) * i, concatenated with GPU tensors
@R.mistake("iscyy/ultralyticsPro#159", ("layer_ids", "torch.ones"))
def layer_ids_cat_in_loss(dev: torch.device, other: torch.device) -> Program:
    model = Toy().to(dev)
    x = randn(4, W, device=dev)
    return stepped(model, lambda: assign_layers(model, x), (x,))


class Proposals(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.score = nn.Linear(W, 1)
        self.proposals_idx = torch.arange(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask_inds = self.score(x).squeeze(1) > 0
        return self.proposals_idx[mask_inds]  # case: cpu_tensor_indexed_by_gpu_mask


# a CPU tensor indexed with a mask computed on the GPU
@R.mistake("thangvubk/SoftGroup#215", "proposals_idx", "model", pairs=GPU)
def cpu_tensor_indexed_by_gpu_mask(dev: torch.device, other: torch.device) -> Program:
    model = Proposals().to(dev)
    x = randn(4, W, device=dev)
    return Program(model, lambda: model(x), (x,))


class Embedder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, W)
        self.head = nn.Linear(W, C)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(input_ids))


def generate_step(model: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    explain_here(model, input_ids)
    return model(input_ids)  # case: input_ids_not_moved


# tokenizer output left on the CPU: "argument index in method wrapper__index_select"
@R.mistake("bigcode-project/starcoder#29", "input_ids", "model.embed", pairs=GPU)
def input_ids_not_moved(dev: torch.device, other: torch.device) -> Program:
    model = Embedder().to(dev)
    input_ids = torch.randint(0, 10, (2, 5), device=other)
    return stepped(model, lambda: generate_step(model, input_ids), (input_ids,))


class Spectrogram(nn.Module):
    """An audio transform module with a window buffer, kept beside the model."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("window", torch.hann_window(W))

    def forward(self, wave: torch.Tensor) -> torch.Tensor:
        return wave * self.window  # case: audio_transform_not_moved


def audio_step(model: nn.Module, transform: nn.Module, wave: torch.Tensor) -> torch.Tensor:
    explain_here(model, wave, transform)
    return model(transform(wave))


# a transform module (MelSpectrogram-like) built on the CPU and never moved with the model
@R.mistake("2noise/ChatTTS#741", "transform.window", "transform")
def audio_transform_not_moved(dev: torch.device, other: torch.device) -> Program:
    model = Toy().to(dev)
    transform = Spectrogram()
    wave = randn(4, W, device=dev)
    return stepped(model, lambda: audio_step(model, transform, wave), (wave,))


class NoiseInjection(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(W, W)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        jitter = torch.randn(x.shape)
        return self.proj(x + jitter)  # case: randn_noise_in_forward


# noise made with torch.randn(shape) inside forward lands on the CPU
@R.mistake("TropComplique/lda2vec-pytorch#14", ("jitter", "torch.randn"), "model")
def randn_noise_in_forward(dev: torch.device, other: torch.device) -> Program:
    model = NoiseInjection().to(dev)
    x = randn(4, W, device=dev)
    return Program(model, lambda: model(x), (x,))


class LegacyState(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.cell = nn.Linear(2 * W, W)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        state0 = torch.FloatTensor(x.size(0), W).zero_()
        return self.cell(torch.cat([x, state0], 1))  # case: legacy_floattensor_state


# torch.FloatTensor(...) in forward always makes a CPU tensor
@R.mistake("JaidedAI/EasyOCR#1378", ("state0", "torch.FloatTensor"), "model")
def legacy_floattensor_state(dev: torch.device, other: torch.device) -> Program:
    model = LegacyState().to(dev)
    x = randn(4, W, device=dev)
    return Program(model, lambda: model(x), (x,))


class ERelu(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(W, W)
        self.constant = torch.zeros(W)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.max(self.proj(x), self.constant)  # case: constant_not_a_buffer


# a constant kept as a plain attribute: .cuda() only visits parameters and buffers
@R.mistake("pytorch/pytorch#2641", "constant", "model")
def constant_not_a_buffer(dev: torch.device, other: torch.device) -> Program:
    model = ERelu().to(dev)
    x = randn(4, W, device=dev)
    return Program(model, lambda: model(x), (x,))


class StaleDevice(nn.Module):
    def __init__(self, device: str = "cpu") -> None:
        super().__init__()
        self.device = device
        self.rnn = nn.GRUCell(W, W)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h_init = torch.zeros(x.shape[0], W, device=self.device)
        return self.rnn(x, h_init)  # case: stale_device_attribute


# a device string saved in __init__ ("cpu") that model.to() does not update
@R.mistake("Lightning-AI/pytorch-lightning#1978", "h_init", "model.rnn")
def stale_device_attribute(dev: torch.device, other: torch.device) -> Program:
    model = StaleDevice(str(other)).to(dev)
    x = randn(4, W, device=dev)
    return Program(model, lambda: model(x), (x,))


class Clipped(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(W, W)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        floor = torch.zeros(h.shape)
        return torch.where(h > 0, h, floor)  # case: where_with_cpu_zeros


# torch.where with a full-size fallback made without a device
@R.mistake("Lightning-AI/pytorch-lightning#17299", ("floor", "torch.zeros"), "model")
def where_with_cpu_zeros(dev: torch.device, other: torch.device) -> Program:
    model = Clipped().to(dev)
    x = randn(4, W, device=dev)
    return Program(model, lambda: model(x), (x,))


class PaddedAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(W, W)

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        scores = self.q(x) @ x.transpose(1, 2)
        pad = torch.arange(x.shape[1])[None, :] >= lengths[:, None]
        return scores.masked_fill(pad[:, None, :], -1e4)  # case: padding_mask_from_cpu_lengths


# a padding mask built from CPU lengths, used on GPU scores
@R.mistake("hangyu94/Ada-CM#10", "pad", "model")
def padding_mask_from_cpu_lengths(dev: torch.device, other: torch.device) -> Program:
    model = PaddedAttention().to(dev)
    x, lengths = randn(2, 5, W, device=dev), torch.tensor([5, 3])
    return stepped(model, lambda: forward_step(model, x, lengths), (x, lengths))


class RandomFeatures(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(W, W)
        self.proj_matrix = torch.randn(W, W)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.einsum("bi,ij->bj", self.proj(x), self.proj_matrix)  # case: einsum_random_features


# Performer's random projection matrix kept as a plain attribute
@R.mistake("lucidrains/rotary-embedding-torch#48", "proj_matrix", "model", pairs=GPU)  # einsum -> bmm: meta lets it mix
def einsum_random_features(dev: torch.device, other: torch.device) -> Program:
    model = RandomFeatures().to(dev)
    x = randn(4, W, device=dev)
    return Program(model, lambda: model(x), (x,))


class Rotary(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(W, W)
        self.inv_freq = 1.0 / (10000 ** (torch.arange(0, W, 2).float() / W))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = torch.arange(x.shape[0], device=x.device).float()
        freqs = torch.outer(t, self.inv_freq)  # case: rotary_inv_freq_attribute
        return self.proj(x) * torch.cat([freqs.cos(), freqs.sin()], -1)


# rotary embeddings' inv_freq computed in __init__ and never registered
@R.mistake("huggingface/transformers#35417", "inv_freq", "model")
def rotary_inv_freq_attribute(dev: torch.device, other: torch.device) -> Program:
    model = Rotary().to(dev)
    x = randn(4, W, device=dev)
    return Program(model, lambda: model(x), (x,))


class GumbelHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.logits = nn.Linear(W, C)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.logits(x)
        u = torch.rand(logits.shape)
        gumbel = -torch.log(-torch.log(u + 1e-9) + 1e-9)
        return (logits + gumbel).softmax(-1)  # case: gumbel_noise_on_cpu


# Gumbel noise sampled with torch.rand(shape) in forward
@R.mistake("galilai-group/stable-worldmodel#162", "gumbel", "model")
def gumbel_noise_on_cpu(dev: torch.device, other: torch.device) -> Program:
    model = GumbelHead().to(dev)
    x = randn(4, W, device=dev)
    return Program(model, lambda: model(x), (x,))


class OneHotEye(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(W, C)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        onehot = torch.eye(C)[y]  # case: eye_indexed_by_gpu_labels
        return (self.proj(x) * onehot).sum()


# one-hot labels by indexing torch.eye(C) (CPU) with labels on the GPU: torch refuses the indexing itself
@R.mistake("hiyouga/LlamaFactory#6003", ("torch.eye",), "model", pairs=GPU)
def eye_indexed_by_gpu_labels(dev: torch.device, other: torch.device) -> Program:
    model = OneHotEye().to(dev)
    x, y = randn(4, W, device=dev), labels(4, dev)
    return Program(model, lambda: model(x, y), (x, y))


class Warp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 1, 1)

    def forward(self, img: torch.Tensor) -> torch.Tensor:
        ys, xs = torch.meshgrid(torch.linspace(-1, 1, 4), torch.linspace(-1, 1, 4), indexing="ij")
        grid = torch.stack([xs, ys], -1)[None]
        return F.grid_sample(self.conv(img), grid, align_corners=False)  # case: meshgrid_sampling_grid


# a sampling grid from torch.meshgrid(torch.linspace(...)) in forward
@R.mistake("bernardo-torres/spectral-optimal-transport#3", "grid", "model")
def meshgrid_sampling_grid(dev: torch.device, other: torch.device) -> Program:
    model = Warp().to(dev)
    img = randn(1, 1, 4, 4, device=dev)
    return Program(model, lambda: model(img), (img,))


class Seq2SeqEncoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gru = nn.GRU(W, W)

    def forward(self, x: torch.Tensor, hidden0: torch.Tensor) -> torch.Tensor:
        return self.gru(x, hidden0)[0]


def encode_step(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    explain_here(model, x)
    hidden0 = torch.zeros(1, x.shape[1], W)
    return model(x, hidden0)  # case: initial_hidden_made_in_step


# the initial hidden state made in the training loop with torch.zeros(...)
@R.mistake("tsugumi-sys/SA-ConvLSTM-Pytorch#26", ("hidden0", "torch.zeros"), "model.gru")
def initial_hidden_made_in_step(dev: torch.device, other: torch.device) -> Program:
    model = Seq2SeqEncoder().to(dev)
    x = randn(5, 2, W, device=dev)
    return stepped(model, lambda: encode_step(model, x), (x,))


def numpy_targets_step(model: nn.Module, x: torch.Tensor, y_np: Any) -> torch.Tensor:
    explain_here(model, x)
    scores = model(x)
    targets_t = torch.from_numpy(y_np)
    return F.mse_loss(scores, targets_t)  # case: numpy_targets_in_step


# targets converted with torch.from_numpy in the loop, never moved
@R.mistake("shuxueslpi/chatGLM-6B-QLoRA#38", ("targets_t", "torch.from_numpy"))
def numpy_targets_in_step(dev: torch.device, other: torch.device) -> Program:
    import numpy as np

    model = Toy().to(dev)
    x, y_np = randn(4, W, device=dev), np.zeros((4, C), dtype=np.float32)
    return stepped(model, lambda: numpy_targets_step(model, x, y_np), (x,))


class FocalLoss(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.alpha = torch.tensor([0.25, 0.5, 0.25])

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logp = F.log_softmax(logits, -1).gather(1, targets[:, None]).squeeze(1)
        return -(self.alpha.gather(0, targets) * logp).mean()  # case: focal_alpha_attribute


def focal_step(model: nn.Module, criterion: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    explain_here(model, x, criterion)
    return criterion(model(x), y)


# a focal loss whose alpha is a plain tensor attribute, never moved with criterion.to()
@R.mistake("yatengLG/Focal-Loss-Pytorch#17", "alpha", "criterion")
def focal_alpha_attribute(dev: torch.device, other: torch.device) -> Program:
    model = Toy().to(dev)
    criterion = FocalLoss().to(dev)
    x, y = randn(4, W, device=dev), labels(4, dev)
    return stepped(model, lambda: focal_step(model, criterion, x, y), (x,))


def reinforce_loss(model: nn.Module, states: torch.Tensor, rewards: list[float]) -> torch.Tensor:
    explain_here(model, states)
    log_probs = model(states).log_softmax(-1)[:, 0]
    returns = torch.tensor(rewards)
    return -(log_probs * returns).sum()  # case: returns_from_python_list


# REINFORCE: discounted returns turned into a tensor with torch.tensor(list) on the CPU
@R.mistake("LiuXiaoxuanPKU/OSD#9", ("returns", "torch.tensor"))
def returns_from_python_list(dev: torch.device, other: torch.device) -> Program:
    model = Toy().to(dev)
    states = randn(4, W, device=dev)
    return stepped(model, lambda: reinforce_loss(model, states, [1.0, 0.5, 0.25, 0.1]), (states,))


class Anchors(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.reg = nn.Linear(W, 4)
        self.cell_anchors = [torch.rand(4, 4)]

    def forward(self, feats: torch.Tensor) -> torch.Tensor:
        deltas = self.reg(feats)
        return deltas + self.cell_anchors[0]  # case: anchors_in_plain_list


# torchvision AnchorGenerator kept its anchors in a list that model.to() cannot see
@R.mistake("pytorch/pytorch#29807", "cell_anchors", "model")
def anchors_in_plain_list(dev: torch.device, other: torch.device) -> Program:
    model = Anchors().to(dev)
    feats = randn(4, W, device=dev)
    return Program(model, lambda: model(feats), (feats,))


class GradientPenalty(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.critic = nn.Linear(W, 1)

    def forward(self, real: torch.Tensor, fake: torch.Tensor) -> torch.Tensor:
        eps = torch.rand(real.shape[0], 1)
        mixed = eps * real + (1 - eps) * fake  # case: wgan_gp_epsilon_on_cpu
        return self.critic(mixed)


# WGAN-GP's interpolation weight sampled on the CPU
@R.mistake("pkuliyi2015/multidiffusion-upscaler-for-automatic1111#348", ("eps", "torch.rand"), "model")
def wgan_gp_epsilon_on_cpu(dev: torch.device, other: torch.device) -> Program:
    model = GradientPenalty().to(dev)
    real, fake = randn(4, W, device=dev), randn(4, W, device=dev)
    return Program(model, lambda: model(real, fake), (real, fake))


class Contrastive(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Linear(W, W)

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        za, zb = self.enc(a), self.enc(b)
        sim = za @ zb.T
        targets = torch.arange(sim.shape[0])
        return F.cross_entropy(sim, targets)  # case: contrastive_arange_targets


# InfoNCE / CLIP loss: labels = torch.arange(n) without the logits' device
@R.mistake("huggingface/transformers#13217", ("targets", "torch.arange"), "model")
def contrastive_arange_targets(dev: torch.device, other: torch.device) -> Program:
    model = Contrastive().to(dev)
    a, b = randn(4, W, device=dev), randn(4, W, device=dev)
    return Program(model, lambda: model(a, b), (a, b))


class CRF(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emit = nn.Linear(W, C)
        self.transitions = torch.zeros(C, C)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        e = self.emit(x)
        return (e[:, :, None] + self.transitions[None]).logsumexp(1)  # case: crf_transitions_attribute


# a CRF's transitions kept as a tensor attribute instead of an nn.Parameter
@R.mistake("uchida-takumi/CustomizedLinear#3", "transitions", "model")
def crf_transitions_attribute(dev: torch.device, other: torch.device) -> Program:
    model = CRF().to(dev)
    x = randn(4, W, device=dev)
    return Program(model, lambda: model(x), (x,))


def distill_step(student: nn.Module, teacher: nn.Module, x: torch.Tensor) -> torch.Tensor:
    explain_here(student, x, teacher)
    soft = teacher(x)  # case: teacher_not_moved
    return F.kl_div(student(x).log_softmax(-1), soft.softmax(-1), reduction="batchmean")


# knowledge distillation: the teacher was loaded on the CPU and never moved
@R.mistake("JDAI-CV/fast-reid#690", "teacher", "teacher")
def teacher_not_moved(dev: torch.device, other: torch.device) -> Program:
    student = Toy().to(dev)
    teacher = Toy()
    x = randn(4, W, device=dev)
    return stepped(student, lambda: distill_step(student, teacher, x), (x,))


class SelfCond(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(2 * W, W)

    def forward(self, x: torch.Tensor, prev: torch.Tensor | None = None) -> torch.Tensor:
        if prev is None:
            prev = torch.zeros_like(x, device="cpu")
        return self.proj(torch.cat([x, prev], -1))  # case: zeros_like_forced_cpu


# zeros_like with an explicit device="cpu" left from CPU debugging
@R.mistake("vllm-project/vllm#27617", ("prev", "torch.zeros_like"), "model")
def zeros_like_forced_cpu(dev: torch.device, other: torch.device) -> Program:
    model = SelfCond().to(dev)
    x = randn(4, W, device=dev)
    return Program(model, lambda: model(x), (x,))


class Mixup(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = Toy()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        perm = torch.randperm(x.shape[0])
        lam = torch.distributions.Beta(1.0, 1.0).sample((x.shape[0], 1))
        return self.net(lam * x + (1 - lam) * x[perm])  # case: mixup_lambda_on_cpu


# mixup's lambda sampled from a torch.distributions.Beta on the CPU (the CPU permutation is fine)
@R.mistake("galilai-group/stable-worldmodel#162", "lam", "model")
def mixup_lambda_on_cpu(dev: torch.device, other: torch.device) -> Program:
    model = Mixup().to(dev)
    x = randn(4, W, device=dev)
    return Program(model, lambda: model(x), (x,))


class PackedLens(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(W, W)

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        packed = nn.utils.rnn.pack_padded_sequence(x, lengths.cpu(), enforce_sorted=False)
        return nn.utils.rnn.pad_packed_sequence(self.lstm(packed)[0])[0]


# lengths moved to the CPU with .cpu() before packing, as torch requires
@R.legal("bentrevett/pytorch-seq2seq#156", pairs=GPU)  # copies data to the host: meta tensors have none
def pack_lengths_dot_cpu(dev: torch.device, other: torch.device) -> Program:
    model = PackedLens().to(dev)
    x, lengths = randn(5, 2, W, device=dev), torch.tensor([3, 5], device=dev)
    return stepped(model, lambda: forward_step(model, x, lengths), (x, lengths))


class BoolSelect(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(W, W)

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        return self.proj(x)[keep]


# a CPU boolean mask indexing a GPU tensor: torch accepts CPU indices
@R.legal("iscyy/ultralyticsPro#159")
def cpu_bool_mask_index(dev: torch.device, other: torch.device) -> Program:
    model = BoolSelect().to(dev)
    x, keep = randn(4, W, device=dev), torch.tensor([True, False, True, True])
    return stepped(model, lambda: forward_step(model, x, keep), (x, keep))


def picked_logits(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    explain_here(model, x)
    logits = model(x)
    return logits[torch.arange(logits.shape[0]), y].sum()


# logits[torch.arange(n), y]: a CPU arange next to GPU labels as indices
@R.legal("CompVis/latent-diffusion#282")
def arange_and_label_indices(dev: torch.device, other: torch.device) -> Program:
    model = Toy().to(dev)
    x, y = randn(4, W, device=dev), labels(4, dev)
    return stepped(model, lambda: picked_logits(model, x, y), (x,))


class ClampMin(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(W, W)
        self.floor = torch.tensor(0.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.clamp(self.proj(x), min=self.floor)  # case: zero_dim_attribute_bound


# a 0-dim CPU tensor attribute as clamp's bound: elementwise ops take a 0-dim CPU tensor with tensors on any
# device, clamp's Tensor min does not (on an H200, torch 2.11: "min is on cpu, different from other tensors on cuda:0")
@R.mistake("kornia/kornia#224", ("self.floor", "model.floor"), "model", pairs=GPU)
def zero_dim_attribute_bound(dev: torch.device, other: torch.device) -> Program:
    model = ClampMin().to(dev)
    x = randn(4, W, device=dev)
    return stepped(model, lambda: forward_step(model, x), (x,))


class LikeFactories(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(W, W)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        return h + torch.randn_like(h) * 0.1 + h.new_zeros(h.shape) + torch.ones_like(h)


# factories that follow an existing tensor (randn_like, new_zeros, ones_like)
@R.legal("ARISE-Initiative/robomimic#124")
def like_factories_in_forward(dev: torch.device, other: torch.device) -> Program:
    model = LikeFactories().to(dev)
    x = randn(4, W, device=dev)
    return stepped(model, lambda: forward_step(model, x), (x,))


class TypeAs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(W, W)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        return h * torch.ones(W).type_as(h)


# Lightning's advice: type_as(x) moves a new tensor to x's device
@R.legal("Lightning-AI/pytorch-lightning#1978")
def type_as_new_tensor(dev: torch.device, other: torch.device) -> Program:
    model = TypeAs().to(dev)
    x = randn(4, W, device=dev)
    return stepped(model, lambda: forward_step(model, x), (x,))


def logged_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor, history: list[float]) -> float:
    explain_here(model, x)
    loss = F.cross_entropy(model(x), y)
    history.append(loss.item())
    running = torch.tensor(history).mean()  # a CPU tensor of host floats, only logged
    return float(running)


# losses kept as Python floats (loss.item()) and averaged on the host
# copies data to the host: meta tensors have none
@R.legal("https://pytorch.org/docs/stable/generated/torch.Tensor.item.html", pairs=GPU)
def host_loss_history(dev: torch.device, other: torch.device) -> Program:
    model = Toy().to(dev)
    x, y = randn(4, W, device=dev), labels(4, dev)
    return stepped(model, lambda: logged_step(model, x, y, [0.5]), (x,))


class RunningTotal(nn.Module):
    """A metric with a buffer, as torchmetrics metrics have."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("total", torch.zeros(C))

    def forward(self, preds: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        self.total = self.total + (preds - target).abs().sum(0)
        return self.total


def cpu_metric_step(model: nn.Module, metric: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    explain_here(model, x)
    preds = model(x)
    return metric(preds.detach().cpu(), F.one_hot(y, C).float().cpu())


# a metric kept on the CPU, fed .cpu() copies
@R.legal("Lightning-AI/torchmetrics#392", pairs=GPU)  # copies data to the host: meta tensors have none
def cpu_metric_fed_cpu_copies(dev: torch.device, other: torch.device) -> Program:
    model = Toy().to(dev)
    metric = RunningTotal()  # on the CPU
    x, y = randn(4, W, device=dev), labels(4, dev)
    return stepped(model, lambda: cpu_metric_step(model, metric, x, y), (x,))


class OffloadedEmbedding(nn.Module):
    def __init__(self, compute: torch.device) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, W)
        self.head = nn.Linear(W, C)
        self.compute = compute

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(ids).to(self.compute))


# a large embedding deliberately kept on the CPU, its output moved to the GPU
@R.legal("huggingface/transformers#45859")
def embedding_offloaded_on_purpose(dev: torch.device, other: torch.device) -> Program:
    model = OffloadedEmbedding(dev)
    model.head.to(dev)
    ids = torch.randint(0, 10, (2, 5), device=other)
    return stepped(model, lambda: forward_step(model, ids), (ids,))


class ParamContainers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scales = nn.ParameterList([nn.Parameter(torch.ones(W)) for _ in range(2)])
        self.biases = nn.ParameterDict({"a": nn.Parameter(torch.zeros(W))})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scales[0] * self.scales[1] + self.biases["a"]


# nn.ParameterList / nn.ParameterDict move with the model
@R.legal("pytorch/pytorch#29807")
def parameter_containers(dev: torch.device, other: torch.device) -> Program:
    with torch.device(other):
        model = ParamContainers()
    model.to(dev)
    x = randn(4, W, device=dev)
    return stepped(model, lambda: forward_step(model, x), (x,))


def optimizer_before_move_step(model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor) -> None:
    explain_here(model, x, optimizer=optimizer)
    model(x).square().mean().backward()
    optimizer.step()


# an optimizer built before model.to() and not stepped yet: Module.to moves parameters in place
# on meta, Module.to makes new parameters (the optimizer would train the old ones): a GPU pair only
@R.legal("https://pytorch.org/docs/stable/generated/torch.nn.Module.html#torch.nn.Module.to", pairs=GPU)
def optimizer_built_before_move_unstepped(dev: torch.device, other: torch.device) -> Program:
    model = Toy().to(other)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    model.to(dev)
    x = randn(4, W, device=dev)
    return stepped(model, lambda: optimizer_before_move_step(model, optimizer, x), (x,), optimizer)


def mixup_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    explain_here(model, x)
    perm = torch.randperm(x.shape[0])  # a CPU permutation indexing GPU tensors
    lam = 0.7
    mixed = lam * x + (1 - lam) * x[perm]
    logits = model(mixed)
    return lam * F.cross_entropy(logits, y) + (1 - lam) * F.cross_entropy(logits, y[perm])


# mixup with a CPU randperm as the index and a Python float as lambda
@R.legal("CompVis/latent-diffusion#282")
def mixup_cpu_permutation(dev: torch.device, other: torch.device) -> Program:
    model = Toy().to(dev)
    x, y = randn(4, W, device=dev), labels(4, dev)
    return stepped(model, lambda: mixup_step(model, x, y), (x,))


class EmaTeacherSplit(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.student = Toy()
        self.head = nn.Linear(C, C)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.student(x)
        return self.head(out.to(self.head.weight.device))


# a model split on purpose, each hop moved with .to(next_part.weight.device)
@R.legal("sksq96/pytorch-summary#178")
def split_moved_by_weight_device(dev: torch.device, other: torch.device) -> Program:
    model = EmaTeacherSplit()
    model.student.to(other)
    model.head.to(dev)
    x = randn(4, W, device=other)
    return stepped(model, lambda: forward_step(model, x), (x,))


def clip_and_step(model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor) -> None:
    explain_here(model, x, optimizer=optimizer)
    model(x).square().mean().backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad()


# gradient clipping and an SGD step, all on the model's device
@R.legal("https://pytorch.org/docs/stable/generated/torch.nn.utils.clip_grad_norm_.html")
def clip_grad_and_step(dev: torch.device, other: torch.device) -> Program:
    model = Toy().to(dev)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x = randn(4, W, device=dev)
    return stepped(model, lambda: clip_and_step(model, optimizer, x), (x,), optimizer)
