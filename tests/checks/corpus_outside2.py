"""Device mistakes and legal device patterns from other projects' public reports: the second development part of
the outside corpus (issue 31), which anyone changing the diagnosis may read. Its reports are different from those
of every other corpus here (corpus_public.py, corpus_outside.py, the held-out parts and the corpus shipped with
torchplace; tests/checks/test_corpus_public.py checks it).

Same shape as corpus_public.py (see corpus_kit.py): each case cites its public source (owner/repo#number or a forum
or documentation page), a mistake names what a report must contain (culprit, as the user wrote it), its module path
(from the user's own variable; None where the failing code runs outside any module's forward) and the user's line
(the line ending in `# case: NAME`); a legal pattern must raise nothing in any mode. On the CPU the pair is meta
(where the model runs) vs cpu (where a factory without a device lands); a case that only a real accelerator refuses
(meta kernels let some ops mix devices, and have no data to copy or pack) lists the GPU pairs only, and a case about
two GPUs the cuda:1 vs cuda:0 pair only.

Every case was checked with plain torch (no torchplace) when written: on cpu vs meta each mistake raises torch's
device error at its `# case:` line and each legal pattern runs; the GPU-only ones were checked on fake cuda tensors
(torch's FakeTensorMode) where fake tensors model the op, by torch's documented rules otherwise.
Scored with `torchplace bench diagnose --corpus tests/checks/corpus_outside2.py`.
"""

from __future__ import annotations

import copy
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
TWO_GPUS = ("cuda1-cuda0",)


# --------------------------------------------------------------------------- mistakes

class GlobalStatsNormalization(nn.Module):
    """The RNN-T pipeline's feature normalization: its statistics kept as plain tensor attributes."""

    def __init__(self, mean: torch.Tensor, invstddev: torch.Tensor) -> None:
        super().__init__()
        self.mean = mean
        self.invstddev = invstddev

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return (input - self.mean) * self.invstddev  # case: global_stats_plain_attributes


class StreamingFrontEnd(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.normalization = GlobalStatsNormalization(torch.linspace(-1, 1, W), torch.full((W,), 2.0))
        self.encoder = nn.Linear(W, C)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.encoder(self.normalization(features))


# torchaudio's global stats normalization kept mean and invstddev as plain attributes: model.to() leaves them
@R.mistake("pytorch/audio#2175", "mean", "model.normalization")
def global_stats_plain_attributes(dev: torch.device, other: torch.device) -> Program:
    model = StreamingFrontEnd().to(dev)
    features = randn(2, 5, W, device=dev)
    return stepped(model, lambda: forward_step(model, features), (features,))


class ConditionalDiagonalNormal(nn.Module):
    """A flow's base distribution whose mean and log-std come from a context encoder."""

    def __init__(self, features: int) -> None:
        super().__init__()
        self.features = features
        self.context_encoder = nn.Linear(W, 2 * features)

    def sample(self, num_samples: int, context: torch.Tensor) -> torch.Tensor:
        means, log_stds = self.context_encoder(context).chunk(2, -1)
        noise = torch.randn(context.shape[0], num_samples, self.features)
        return means[:, None] + log_stds.exp()[:, None] * noise  # case: flow_base_sample_randn


class ConditionalFlow(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.transform = nn.Linear(W, W)
        self.base_dist = ConditionalDiagonalNormal(W)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.transform(inputs)

    def sample(self, num_samples: int, context: torch.Tensor) -> torch.Tensor:
        return self.transform(self.base_dist.sample(num_samples, context))


def sample_step(flow: ConditionalFlow, context: torch.Tensor) -> torch.Tensor:
    explain_here(flow, context)
    return flow.sample(3, context)


# nflows' ConditionalDiagonalNormal sampled its noise with torch.randn(...) and no device, on a model on the GPU
@R.mistake("bayesiains/nflows#8", ("noise", "torch.randn"))
def flow_base_sample_randn(dev: torch.device, other: torch.device) -> Program:
    flow = ConditionalFlow().to(dev)
    context = randn(2, W, device=dev)
    return stepped(flow, lambda: sample_step(flow, context), (context,))


class TinyLM(nn.Module):
    def __init__(self, vocab: int = 11) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, W)
        self.unembed = nn.Linear(W, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.unembed(self.embed(tokens))


def generate(model: nn.Module, input: torch.Tensor, max_new_tokens: int, device: torch.device) -> torch.Tensor:
    input_tokens = input  # bound before the move below: it stays where the caller made it
    input = input.to(device)
    explain_here(model, input)
    sampled_tokens = []
    for _ in range(max_new_tokens):
        next_token = model(input)[:, -1].argmax(-1, keepdim=True)
        sampled_tokens.append(next_token)
        input = torch.cat((input, next_token), dim=1)
    return torch.cat((input_tokens, torch.cat(sampled_tokens, dim=1)), dim=1)  # case: generate_input_tokens_on_cpu


# TransformerLens' generate() kept input_tokens pointing at the caller's CPU tokens, then concatenated the
# sampled tokens (on the model's device) onto them
@R.mistake("TransformerLensOrg/TransformerLens#1508", "input_tokens")
def generate_input_tokens_on_cpu(dev: torch.device, other: torch.device) -> Program:
    model = TinyLM().to(dev)
    tokens = torch.randint(0, 11, (2, 4))
    return stepped(model, lambda: generate(model, tokens, 3, dev), (tokens.to(dev),))


class OnlineLabelSmoothing(nn.Module):
    """Online label smoothing: the soft targets are buffers, updated in place from the batch's predictions."""

    def __init__(self, alpha: float, n_classes: int, smoothing: float = 0.1) -> None:
        super().__init__()
        self.a = alpha
        supervise = torch.full((n_classes, n_classes), smoothing / (n_classes - 1))
        supervise.fill_diagonal_(1 - smoothing)
        self.register_buffer("supervise", supervise)
        self.register_buffer("update", torch.zeros_like(supervise))
        self.register_buffer("idx_count", torch.zeros(n_classes))
        self.hard_loss = nn.CrossEntropyLoss()

    def forward(self, y_h: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.a * self.hard_loss(y_h, y) + (1 - self.a) * self.soft_loss(y_h, y)

    def soft_loss(self, y_h: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        y_h = y_h.log_softmax(dim=-1)
        if self.training:
            with torch.no_grad():
                self.step(y_h.exp(), y)
        true_dist = torch.index_select(self.supervise, 1, y).swapaxes(-1, -2)
        return torch.mean(torch.sum(-true_dist * y_h, dim=-1))

    def step(self, y_h: torch.Tensor, y: torch.Tensor) -> None:
        y_h_idx = y_h.argmax(dim=-1)
        mask = torch.eq(y_h_idx, y)
        y_h_c, y_h_idx_c = y_h[mask], y_h_idx[mask]
        self.update.index_add_(1, y_h_idx_c, y_h_c.swapaxes(-1, -2))  # case: online_label_smoothing_not_moved
        self.idx_count.index_add_(0, y_h_idx_c, torch.ones_like(y_h_idx_c, dtype=torch.float32))


def ols_train_step(model: nn.Module, criterion: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    explain_here(model, x)
    return criterion(model(x), y)


# the online label smoothing loss built without .cuda(): its buffers stay on the CPU while the logits are on the GPU
# (boolean-mask selection needs data: meta cannot run it)
@R.mistake("ankandrew/online-label-smoothing-pt#2", "update", "criterion", pairs=GPU)
def online_label_smoothing_not_moved(dev: torch.device, other: torch.device) -> Program:
    model = Toy().to(dev)
    criterion = OnlineLabelSmoothing(alpha=0.5, n_classes=C, smoothing=0.1)
    x, y = randn(8, W, device=dev), labels(8, dev)
    return stepped(model, lambda: ols_train_step(model, criterion, x, y), (x,))


class MomentumNet(nn.Module):
    """A momentum residual network: its velocity starts at zero, moved to the input's device *type*."""

    def __init__(self, gamma: float = 0.9) -> None:
        super().__init__()
        self.functions = nn.ModuleList([nn.Sequential(nn.Linear(W, W), nn.Tanh()) for _ in range(2)])
        self.gamma = gamma

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        device = x.device.type  # "cuda": the current GPU, not x's
        velocity = torch.zeros(x.shape).to(device)
        for f in self.functions:
            velocity = self.gamma * velocity + (1 - self.gamma) * f(x)  # case: momentum_velocity_device_type
            x = x + velocity
        return x


# momentumnet moved its tensors to val.device.type, which is "cuda", so GPU 0, while the model ran on GPU 1
@R.mistake("michaelsdr/momentumnet#30", ("velocity", "torch.zeros"), "model", pairs=TWO_GPUS)
def momentum_velocity_device_type(dev: torch.device, other: torch.device) -> Program:
    model = MomentumNet().to(dev)
    x = randn(4, W, device=dev)
    return Program(model, lambda: model(x), (x,))


def neuron_norm(x: torch.Tensor) -> torch.Tensor:
    if x.dim() > 1:
        view_shape = [x.shape[0]] + [1] * (x.dim() - 1)
        return x.reshape(x.shape[0], -1).norm(dim=1).view(*view_shape)
    return x.abs()


class Nero(torch.optim.Optimizer):
    """The Nero optimizer: it makes its per-neuron state in __init__, from the parameters as they are then."""

    def __init__(self, params, lr: float = 0.01, beta: float = 0.999) -> None:
        super().__init__(params, dict(lr=lr, beta=beta))
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                state["step"] = 0
                state["exp_avg_sq"] = torch.zeros_like(neuron_norm(p))

    @torch.no_grad()
    def step(self, closure=None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                state["step"] += 1
                b = group["beta"]
                g2 = neuron_norm(p.grad) ** 2
                state["exp_avg_sq"] = b * state["exp_avg_sq"] + (1 - b) * g2  # case: nero_state_made_before_cuda
                grad_normed = p.grad / (state["exp_avg_sq"] / (1 - b ** state["step"])).sqrt().clamp_min(1e-12)
                p.data -= group["lr"] * neuron_norm(p) * grad_normed


def nero_train_step(net: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> None:
    explain_here(net, x, optimizer=optimizer)
    F.cross_entropy(net(x), y).backward()
    optimizer.step()
    optimizer.zero_grad()


# Nero built on the model's parameters before net.cuda(): the state it made in __init__ stays on the CPU
# (Module.to('meta') makes new parameters, so meta never reaches the old state)
@R.mistake("jxbz/nero#1", "exp_avg_sq", pairs=GPU)
def nero_state_made_before_cuda(dev: torch.device, other: torch.device) -> Program:
    net = Toy()
    optimizer = Nero(net.parameters(), lr=0.01)
    net.to(dev)
    x, y = randn(4, W, device=dev), labels(4, dev)
    return stepped(net, lambda: nero_train_step(net, optimizer, x, y), (x,), optimizer)


class GRUScratch(nn.Module):
    """A GRU written from scratch, as in d2l's chapter on gated recurrent units."""

    def __init__(self, num_inputs: int, num_hiddens: int, sigma: float = 0.01) -> None:
        super().__init__()
        self.num_hiddens = num_hiddens

        def triple() -> tuple[nn.Parameter, nn.Parameter, nn.Parameter]:
            return (nn.Parameter(torch.randn(num_inputs, num_hiddens) * sigma),
                    nn.Parameter(torch.randn(num_hiddens, num_hiddens) * sigma),
                    nn.Parameter(torch.zeros(num_hiddens)))

        self.W_xz, self.W_hz, self.b_z = triple()
        self.W_xr, self.W_hr, self.b_r = triple()
        self.W_xh, self.W_hh, self.b_h = triple()

    def forward(self, inputs: torch.Tensor, H: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        if H is None:
            H = torch.zeros((inputs.shape[1], self.num_hiddens))
        outputs = []
        for X in inputs:
            Z = torch.sigmoid(X @ self.W_xz + torch.matmul(H, self.W_hz) + self.b_z)  # case: gru_scratch_state_zeros
            R_ = torch.sigmoid(torch.matmul(X, self.W_xr) + torch.matmul(H, self.W_hr) + self.b_r)
            H_tilde = torch.tanh(torch.matmul(X, self.W_xh) + torch.matmul(R_ * H, self.W_hh) + self.b_h)
            H = Z * H + (1 - Z) * H_tilde
            outputs.append(H)
        return torch.stack(outputs), H


# d2l's GRU from scratch made its initial state with torch.zeros((batch, num_hiddens)) and no device
@R.mistake("d2l-ai/d2l-en#2233", ("H", "torch.zeros"), "model")
def gru_scratch_state_zeros(dev: torch.device, other: torch.device) -> Program:
    model = GRUScratch(W, W).to(dev)
    inputs = randn(3, 2, W, device=dev)
    return stepped(model, lambda: forward_step(model, inputs), (inputs,))


def _default_lengths(potentials: torch.Tensor, lengths: torch.Tensor | None) -> torch.Tensor:
    batch, N = potentials.shape[:2]
    if lengths is None:
        lengths = torch.LongTensor([N] * batch)
    return lengths


def kmax(potentials: torch.Tensor, k: int, lengths: torch.Tensor | None = None) -> torch.Tensor:
    """The k best scores of a linear-chain structure, over the valid positions only."""
    lengths = _default_lengths(potentials, lengths)
    valid = torch.arange(potentials.shape[1])[None, :] < lengths[:, None]
    scores = torch.where(valid[..., None], potentials, -1e9)  # case: kmax_valid_mask_on_cpu
    return scores.flatten(1).topk(k, dim=-1).values


class ChainScorer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emission = nn.Linear(W, C)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.emission(x)


def kmax_step(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    explain_here(model, x)
    return kmax(model(x), 5)


# pytorch-struct's kmax()/topk() on the GPU: the default lengths, and so the mask of valid positions, are on the CPU
@R.mistake("harvardnlp/pytorch-struct#121", "valid")
def kmax_valid_mask_on_cpu(dev: torch.device, other: torch.device) -> Program:
    model = ChainScorer().to(dev)
    x = randn(2, 4, W, device=dev)
    return stepped(model, lambda: kmax_step(model, x), (x,))


class SumWithOnesGrad(torch.autograd.Function):
    """A sum whose backward spreads the gradient with a tensor of ones, as CrypTen's gradients.py did."""

    @staticmethod
    def forward(ctx, input: torch.Tensor) -> torch.Tensor:
        ctx.input_size = input.size()
        return input.sum()

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor) -> torch.Tensor:
        input_size = ctx.input_size
        return grad_output.mul(torch.ones(input_size))  # case: custom_backward_ones_no_device


class PooledHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(W, W)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return SumWithOnesGrad.apply(self.proj(x))


def backward_step(model: nn.Module, x: torch.Tensor) -> None:
    explain_here(model, x)
    model(x).backward()


# a custom autograd Function whose backward builds torch.ones(input_size) on the CPU for a gradient on the GPU
@R.mistake("facebookresearch/CrypTen#426", "torch.ones")
def custom_backward_ones_no_device(dev: torch.device, other: torch.device) -> Program:
    model = PooledHead().to(dev)
    x = randn(4, W, device=dev)
    return stepped(model, lambda: backward_step(model, x), (x,))


def moving_average(model: nn.Module, model_ema: nn.Module, beta: float = 0.992, device: str = "cpu") -> None:
    with torch.no_grad():
        for param, param_ema in zip(model.parameters(), model_ema.parameters()):
            data = param.data.to(device)
            param_ema.data.copy_((1 - beta) * data + beta * param_ema.data)  # case: ema_average_fetched_to_cpu


def ppo_train_step(actor: nn.Module, ema_model: nn.Module, optimizer: torch.optim.Optimizer,
                   x: torch.Tensor) -> None:
    explain_here(actor, x, optimizer=optimizer)
    actor(x).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()
    moving_average(actor, ema_model, 0.992, "cpu")


# OpenRLHF's EMA: the actor's parameters fetched to the CPU for the average, the EMA model left on the GPU
# (meta has no data to fetch)
@R.mistake("OpenRLHF/OpenRLHF#245", "data", pairs=GPU)
def ema_average_fetched_to_cpu(dev: torch.device, other: torch.device) -> Program:
    actor = Toy().to(dev)
    ema_model = copy.deepcopy(actor)
    optimizer = torch.optim.SGD(actor.parameters(), lr=0.1)
    x = randn(4, W, device=dev)
    return stepped(actor, lambda: ppo_train_step(actor, ema_model, optimizer, x), (x,), optimizer)


# --------------------------------------------------------------------------- legal patterns

class TwoStageModel(nn.Module):
    """A model too large for one device, split on purpose: each half placed, the activations moved between them."""

    def __init__(self, first: torch.device, second: torch.device) -> None:
        super().__init__()
        self.first, self.second = first, second
        self.large_submodule1 = nn.Sequential(nn.Linear(W, W), nn.ReLU()).to(first)
        self.large_submodule2 = nn.Linear(W, C).to(second)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.large_submodule1(x.to(self.first))
        x = x.to(self.second)  # the hand-over between the two halves
        return self.large_submodule2(x)


def split_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    explain_here(model, x)
    return F.cross_entropy(model(x), y)


# a model split over two devices by hand, the activations moved with .to() between the halves
@R.legal("https://discuss.pytorch.org/t/model-parallelism-in-pytorch-for-large-r-than-1-gpu-models/778/2")
def hand_split_over_two_devices(dev: torch.device, other: torch.device) -> Program:
    model = TwoStageModel(other, dev)
    x, y = torch.randn(4, W, device=other), labels(4, dev)
    return stepped(model, lambda: split_step(model, x, y), (x,))


class SentimentRNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(20, W, padding_idx=0)
        self.rnn = nn.LSTM(W, W, batch_first=True)
        self.fc = nn.Linear(W, 1)

    def forward(self, text: torch.Tensor, text_lengths: torch.Tensor) -> torch.Tensor:
        embedded = self.embedding(text)
        packed_embedded = nn.utils.rnn.pack_padded_sequence(embedded, text_lengths.cpu(), batch_first=True)
        _, (hidden, _) = self.rnn(packed_embedded)
        return self.fc(hidden[-1])


def sentiment_step(model: nn.Module, text: torch.Tensor, text_lengths: torch.Tensor) -> torch.Tensor:
    explain_here(model, text, text_lengths)
    return model(text, text_lengths).sigmoid().mean()


# the tutorial's fix: the lengths (which the iterator put on the GPU) passed as text_lengths.cpu(), as packing needs
@R.legal("bentrevett/pytorch-sentiment-analysis#93", pairs=GPU)  # packing copies data: meta tensors have none
def packing_lengths_moved_to_cpu(dev: torch.device, other: torch.device) -> Program:
    model = SentimentRNN().to(dev)
    text = torch.randint(1, 20, (3, 5), device=dev)
    text_lengths = torch.tensor([5, 4, 2], device=dev)
    return stepped(model, lambda: sentiment_step(model, text, text_lengths), (text, text_lengths))


class Binarize(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.score = nn.Linear(W, W)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cond = self.score(x) > 0
        return torch.where(cond, torch.tensor(1.0), torch.tensor(0.0))  # 0-dim CPU tensors for both branches


# torch.where(cond_on_gpu, torch.tensor(0), torch.tensor(1)): 0-dim CPU tensors are taken as scalars on any device
@R.legal("flagos-ai/FlagGems#311")
def where_both_branches_cpu_scalars(dev: torch.device, other: torch.device) -> Program:
    model = Binarize().to(dev)
    x = randn(4, W, device=dev)
    return stepped(model, lambda: forward_step(model, x), (x,))


class ContrastiveHead(nn.Module):
    """A contrastive head with a fixed temperature held as a 0-dim tensor attribute (never moved)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(W, W)
        self.temperature = torch.tensor(0.07)

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        a, b = F.normalize(self.proj(a), dim=-1), F.normalize(self.proj(b), dim=-1)
        return a @ b.T / self.temperature


def contrastive_step(model: nn.Module, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    explain_here(model, a, b)
    logits = model(a, b)
    return F.cross_entropy(logits, torch.arange(a.shape[0], device=logits.device))


# PyTorch keeps letting a 0-dim CPU tensor meet tensors on any device (only 0-dim CUDA tensors stopped moving):
# a CPU temperature attribute divides GPU logits
@R.legal("pytorch/pytorch#38998")
def zero_dim_temperature_attribute(dev: torch.device, other: torch.device) -> Program:
    model = ContrastiveHead().to(dev)
    a, b = randn(4, W, device=dev), randn(4, W, device=dev)
    return stepped(model, lambda: contrastive_step(model, a, b), (a, b))


class LengthsFromList(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(W, W, batch_first=True)
        self.fc = nn.Linear(W, C)

    def forward(self, x: torch.Tensor, lens: list[int]) -> torch.Tensor:
        x_lens = torch.tensor(lens, dtype=torch.int64, device=torch.device("cpu"))
        x_packed = nn.utils.rnn.pack_padded_sequence(x, x_lens, batch_first=True)
        out, _ = nn.utils.rnn.pad_packed_sequence(self.lstm(x_packed)[0], batch_first=True)
        return self.fc(out[:, -1])


def lengths_step(model: nn.Module, x: torch.Tensor, lens: list[int], y: torch.Tensor) -> torch.Tensor:
    explain_here(model, x, lens)
    return F.cross_entropy(model(x, lens), y)


# the lengths made in forward as a CPU int64 tensor from a Python list, the batch on the GPU: what packing wants
@R.legal("pytorch/pytorch#13214", pairs=GPU)  # packing copies data: meta tensors have none
def packing_lengths_made_on_cpu_in_forward(dev: torch.device, other: torch.device) -> Program:
    model = LengthsFromList().to(dev)
    x, y, lens = randn(3, 5, W, device=dev), labels(3, dev), [5, 3, 2]
    return stepped(model, lambda: lengths_step(model, x, lens, y), (x, lens))
