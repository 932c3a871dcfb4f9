"""HELD OUT: device mistakes and legal device patterns from other projects' public reports (neural ODEs and DDEs,
normalizing flows, Bayesian layers, mixture-of-experts routing, quantization observers and fake-quant, optimal
transport and Sinkhorn, sparse tensors, Fourier filters, torch.Generator and sampling, optimizers' state,
meta-learning, federated averaging, OCR/CTC, recommender and knowledge-graph negative sampling, reinforcement-learning
replay buffers, Hugging Face logits processors, knowledge distillation), kept from anyone changing the diagnosis
(issue 31). Do not read this file while working on torchplace.checks or torchplace.memory, do not score it while
doing so, and do not add it to any test that runs by default: the lead scores it ONCE, at the end, with
`torchplace bench diagnose --corpus tests/checks/corpus_heldout6.py` (on the CPU and on GPUs), and records the
number. Its reports are different from those of every other corpus here (tests/checks/test_corpus_public.py checks
it).

Same shape as corpus_heldout5.py (see corpus_kit.py): each case cites its public source (owner/repo#number or a
documentation page), a mistake names what a report must contain (culprit, as the user wrote it), its module path
(from the user's own variable; None where the failing code runs outside any module's forward) and the user's line
(the line ending in `# case: NAME`); a legal pattern must raise nothing in any mode. On the CPU the pair is meta
(where the model runs) vs cpu (where a factory without a device lands); a case that only a real accelerator refuses
lists the GPU pairs only: meta kernels let matmul, linear and convolution, in-place updates of a CPU tensor by a meta
one, isin, indexing and the copy into a CPU slice mix devices, and have no fake-quant, CTC or sparse matmul kernel;
a case about two GPUs (`device='cuda'` meaning the current GPU, 0, while the model sits on another) lists the
cuda:1 vs cuda:0 pair only, and one about a CPU torch.Generator meeting a CUDA factory the cuda-cpu pair only.

Every case was checked with plain torch (no torchplace) when written, with tools/corpus_plain_check.py: on cpu vs
meta each mistake raises torch's device error at its `# case:` line and each legal pattern runs. The GPU-only ones
were checked against torch's documented rules and the report's own traceback; no GPU was used.
"""

from __future__ import annotations

import copy
import math
import sys
from collections import OrderedDict
from pathlib import Path

import numpy as np
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
    randn,
    stepped,
)

R = Registry(__file__)
CASES = R.CASES
for_pair = R.for_pair
__all__ = ["ALL", "CASES", "PAIRS", "for_pair"]
TWO_GPUS = ("cuda1-cuda0",)
CUDA_CPU = ("cuda-cpu",)


# --------------------------------------------------------------------------- mistakes: neural ODEs and DDEs

class Dopri5(nn.Module):
    """torchdde's Dopri5, shortened: its Butcher tableau is a set of buffers, so the solver has to be moved too."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("c", torch.tensor([0.0, 1 / 5, 3 / 10, 4 / 5, 8 / 9, 1.0]))
        a_lower = torch.zeros(6, 6)
        a_lower[1, :1] = torch.tensor([1 / 5])
        a_lower[2, :2] = torch.tensor([3 / 40, 9 / 40])
        a_lower[3, :3] = torch.tensor([44 / 45, -56 / 15, 32 / 9])
        a_lower[4, :4] = torch.tensor([19372 / 6561, -25360 / 2187, 64448 / 6561, -212 / 729])
        a_lower[5, :5] = torch.tensor([9017 / 3168, -355 / 33, 46732 / 5247, 49 / 176, -5103 / 18656])
        self.register_buffer("a_lower", a_lower)
        self.register_buffer("b", torch.tensor([35 / 384, 0.0, 500 / 1113, 125 / 192, -2187 / 6784, 11 / 84]))

    def step(self, func: nn.Module, t: float, y: torch.Tensor, dt: float) -> torch.Tensor:
        k = [func(y)]
        for i in range(1, 6):
            stages = torch.stack(k)
            dy = (self.a_lower[i, :i, None, None] * stages).sum(0)  # case: torchdde_dopri5_tableau_not_moved
            k.append(func(y + dt * dy))
        return y + dt * (self.b[:, None, None] * torch.stack(k)).sum(0)


def integrate(func: nn.Module, solver: Dopri5, y0: torch.Tensor, ts: list[float]) -> torch.Tensor:
    explain_here(func, y0)
    ys = [y0]
    for t0, t1 in zip(ts[:-1], ts[1:]):
        ys.append(solver.step(func, t0, ys[-1], t1 - t0))
    return torch.stack(ys)


# "in line 93 and 107, self.c[0], self.a_lower are at 'cpu'": the maintainer's answer, `solver.to(device)`
@R.mistake("thibmonsel/torchdde#43", ("a_lower", "solver"))
def torchdde_dopri5_tableau_not_moved(dev: torch.device, other: torch.device) -> Program:
    func = nn.Sequential(nn.Linear(W, W), nn.Tanh()).to(dev)
    solver = Dopri5()
    y0 = randn(2, W, device=dev)
    return stepped(func, lambda: integrate(func, solver, y0, [0.0, 0.1, 0.2]), (y0,))


class HybridNeuralDE(nn.Module):
    """torchdyn's HybridNeuralDE (0.2.2): the trajectory Y is allocated with torch.zeros, on the CPU."""

    def __init__(self) -> None:
        super().__init__()
        self.jump = nn.LSTMCell(W, W)
        self.flow = nn.Sequential(nn.Linear(W, W), nn.Tanh())
        self.out = nn.Linear(W, C)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = c = torch.zeros(x.shape[1], W, device=x.device)
        Y = torch.zeros(x.shape[0], *h.shape)
        for t, x_t in enumerate(x):
            h, c = self.jump(x_t, (h, c))
            h = self.flow(h)
            Y[t] = h
        Y = self.out(Y)  # case: torchdyn_hybrid_trajectory_on_cpu
        return Y


# "the `Y` remains as CPU tensor after it is initialized even if HybridNeuralDE parameters and input tensor are
# placed on GPU" (the fix: torch.zeros(...).to(x)); meta cannot copy into the CPU trajectory, so the GPU pairs
@R.mistake("DiffEqML/torchdyn#73", ("Y", "torch.zeros"), "model", pairs=GPU)
def torchdyn_hybrid_trajectory_on_cpu(dev: torch.device, other: torch.device) -> Program:
    model = HybridNeuralDE().to(dev)
    x = randn(3, 2, W, device=dev)
    return Program(model, lambda: model(x), (x,))


# --------------------------------------------------------------------------- mistakes: normalizing flows

class MAF(nn.Module):
    """tonyduan/normalizing-flows' MAF layer, shortened: log_det starts as torch.zeros(z.shape[0]), on the CPU."""

    def __init__(self, dim: int = W) -> None:
        super().__init__()
        self.dim = dim
        self.layers = nn.ModuleList([nn.Linear(max(i, 1), 2) for i in range(dim)])

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        z = torch.zeros_like(x)
        log_det = torch.zeros(z.shape[0])
        for i in range(self.dim):
            inp = x[:, :i] if i else torch.zeros_like(x[:, :1])
            mu, alpha = self.layers[i](inp).chunk(2, dim=1)
            z[:, i] = (x[:, i] - mu.squeeze(1)) / torch.exp(alpha.squeeze(1))
            log_det -= alpha.squeeze(1)  # case: maf_log_det_zeros_on_cpu
        return z.flip(dims=(1,)), log_det


class NormalizingFlowModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.flows = nn.ModuleList([MAF()])

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        log_det = torch.zeros(x.shape[0], device=x.device)
        for flow in self.flows:
            x, ld = flow(x)
            log_det = log_det + ld
        return x, log_det


# the GPU-support PR of the repository: "log_det = torch.zeros(z.shape[0])" inside the flows, on the CPU while x is
# on the GPU (an in-place update of a CPU tensor: meta lets it pass, so the GPU pairs)
@R.mistake("tonyduan/normalizing-flows#6", ("log_det", "torch.zeros"), "model.flows.0", pairs=GPU)
def maf_log_det_zeros_on_cpu(dev: torch.device, other: torch.device) -> Program:
    model = NormalizingFlowModel().to(dev)
    x = randn(4, W, device=dev)
    return Program(model, lambda: model(x), (x,))


class AffineCoupling(nn.Module):
    """A spline/affine coupling transform as pyro's T.spline_coupling(...).to('cuda') gives it: moved to the GPU."""

    def __init__(self, dim: int = 2) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(dim // 2, W), nn.Tanh(), nn.Linear(W, dim))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x1, x2 = x.chunk(2, dim=1)
        s, t = self.net(x1).chunk(2, dim=1)
        return torch.cat([x1, x2 * torch.exp(s) + t], dim=1), s.sum(1)


def flow_nll_step(transform: nn.Module, base_dist: torch.distributions.Distribution,
                  dataset: torch.Tensor) -> torch.Tensor:
    explain_here(transform, dataset)
    z, log_det = transform(dataset)
    log_prob = base_dist.log_prob(z).sum(1) + log_det  # case: pyro_flow_base_distribution_on_cpu
    return -log_prob.mean()


# "spline_transform = T.spline_coupling(2, count_bins=16).to('cuda')", the base dist.Normal(torch.zeros(2),
# torch.ones(2)) left on the CPU: "Expected all tensors to be on the same device"
@R.mistake("pyro-ppl/pyro#2761", ("base_dist", "torch.zeros"))
def pyro_flow_base_distribution_on_cpu(dev: torch.device, other: torch.device) -> Program:
    transform = AffineCoupling().to(dev)
    base_dist = torch.distributions.Normal(torch.zeros(2), torch.ones(2), validate_args=False)
    dataset = randn(8, 2, device=dev)
    return stepped(transform, lambda: flow_nll_step(transform, base_dist, dataset), (dataset,))


# --------------------------------------------------------------------------- mistakes: Bayesian layers

class TrainableRandomDistribution(nn.Module):
    """blitz's weight sampler before it kept epsilon in a buffer: epsilon drawn from Normal(0, 1), on the CPU."""

    def __init__(self, mu: torch.Tensor, rho: torch.Tensor) -> None:
        super().__init__()
        self.mu = nn.Parameter(mu)
        self.rho = nn.Parameter(rho)
        self.normal = torch.distributions.Normal(0, 1)

    def sample(self) -> torch.Tensor:
        epsilon = self.normal.sample(self.rho.size())
        self.sigma = torch.log1p(torch.exp(self.rho))
        self.w = self.mu + self.sigma * epsilon  # case: blitz_weight_epsilon_sampled_on_cpu
        return self.w


class BayesianLinear(nn.Module):
    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.weight_sampler = TrainableRandomDistribution(torch.randn(out_features, in_features) * 0.1,
                                                          torch.full((out_features, in_features), -3.0))
        self.bias = nn.Parameter(torch.zeros(out_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight_sampler.sample(), self.bias)


class BayesianRegressor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blinear1 = BayesianLinear(W, W)
        self.blinear2 = BayesianLinear(W, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blinear2(self.blinear1(x).relu())


# "feature: epsilon for weights on torch buffer": the sampled epsilon moves with the module once it is a buffer;
# before, epsilon = Normal(0, 1).sample(...) landed on the CPU beside GPU mu and sigma
@R.mistake("piEsposito/blitz-bayesian-deep-learning#19", ("epsilon", "sample"), "model.blinear1.weight_sampler")
def blitz_weight_epsilon_sampled_on_cpu(dev: torch.device, other: torch.device) -> Program:
    model = BayesianRegressor().to(dev)
    x = randn(4, W, device=dev)
    return Program(model, lambda: model(x), (x,))


# --------------------------------------------------------------------------- mistakes: mixture of experts

class MoE(nn.Module):
    """A sparsely gated mixture of experts (noisy top-k gating), shortened."""

    def __init__(self, dim: int = W, num_experts: int = 4, k: int = 2) -> None:
        super().__init__()
        self.k = k
        self.w_gate = nn.Parameter(torch.randn(dim, num_experts) * 0.1)
        self.w_noise = nn.Parameter(torch.zeros(dim, num_experts))
        self.experts = nn.ModuleList([nn.Linear(dim, dim) for _ in range(num_experts)])

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        clean_logits = x @ self.w_gate  # case: moe_layer_not_moved_to_cuda
        noise_stddev = F.softplus(x @ self.w_noise) + 1e-2
        logits = clean_logits + torch.randn_like(clean_logits) * noise_stddev
        top_logits, top_indices = logits.topk(self.k, dim=1)
        gates = torch.zeros_like(logits).scatter(1, top_indices, top_logits.softmax(1))
        out = sum(gates[:, i:i + 1] * expert(x) for i, expert in enumerate(self.experts))
        return out, gates.sum(0).var()


def moe_step(encoder: nn.Module, moe: MoE, x: torch.Tensor) -> torch.Tensor:
    explain_here(encoder, x)
    out, aux_loss = moe(encoder(x))
    return out.mean() + aux_loss


# the answer of the thread: "you need to move the MoE to cuda" (init on CPU, inputs on the GPU); the first meeting
# is a matmul, so the GPU pairs
@R.mistake("lucidrains/mixture-of-experts#5", ("moe", "w_gate"), "moe", pairs=GPU)
def moe_layer_not_moved_to_cuda(dev: torch.device, other: torch.device) -> Program:
    encoder = nn.Linear(W, W).to(dev)
    moe = MoE()
    x = randn(4, W, device=dev)
    return stepped(encoder, lambda: moe_step(encoder, moe, x), (x,))


# --------------------------------------------------------------------------- mistakes: quantization

class FakeQuantize(nn.Module):
    """torch.ao's FakeQuantize, shortened: scale and zero_point are buffers made on the CPU."""

    def __init__(self, quant_min: int = 0, quant_max: int = 255) -> None:
        super().__init__()
        self.quant_min, self.quant_max = quant_min, quant_max
        self.register_buffer("scale", torch.tensor([1.0], dtype=torch.float))
        self.register_buffer("zero_point", torch.tensor([0], dtype=torch.int32))

    def forward(self, X: torch.Tensor) -> torch.Tensor:
        return torch.fake_quantize_per_tensor_affine(  # case: fake_quantize_qparams_on_cpu_after_move
            X, self.scale, self.zero_point, self.quant_min, self.quant_max)


class QuantWrapper(nn.Module):
    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module
        self.activation_post_process = nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.activation_post_process(self.module(x))


def insert_fake_quant(model: QuantWrapper) -> QuantWrapper:
    """What a PTQ flow does after the model was moved: the fake-quant modules it inserts are built on the CPU."""
    model.activation_post_process = FakeQuantize()
    return model


# "scale and zero_point will be default to cpu device ... if we want to run ptq with CUDA, X will be cuda while
# scale and zero_point will be in cpu" (meta has no fake-quant kernel, so the GPU pairs)
@R.mistake("pytorch/pytorch#127783", ("scale", "zero_point"), "model.activation_post_process", pairs=GPU)
def fake_quantize_qparams_on_cpu_after_move(dev: torch.device, other: torch.device) -> Program:
    model = insert_fake_quant(QuantWrapper(nn.Linear(W, W)).to(dev))
    x = randn(4, W, device=dev)
    return Program(model, lambda: model(x), (x,))


class HistogramObserver(nn.Module):
    """torch.ao's HistogramObserver, shortened (a fixed range here, so the bin widths are Python floats): the
    histogram follows the input; the bin edges given to _get_norm are made with torch.arange/torch.ones, on the
    CPU."""

    def __init__(self, bins: int = 16, range_min: float = 0.0, range_max: float = 1.0) -> None:
        super().__init__()
        self.bins, self.range_min, self.range_max = bins, range_min, range_max
        self.register_buffer("histogram", torch.zeros(bins))

    def _get_norm(self, delta_begin: torch.Tensor, delta_end: torch.Tensor, density: torch.Tensor) -> torch.Tensor:
        norm = (delta_end * delta_end * delta_end - delta_begin * delta_begin * delta_begin) / 3
        return density * norm  # case: histogram_observer_norm_bins_on_cpu

    def _compute_quantization_error(self, next_start_bin: int, next_end_bin: int) -> torch.Tensor:
        bin_width = (self.range_max - self.range_min) / self.bins
        dst_bin_width = bin_width * (next_end_bin - next_start_bin + 1) / self.bins
        src_bin = torch.arange(self.bins)
        src_bin_begin = (src_bin - next_start_bin) * bin_width
        delta_begin = src_bin_begin - dst_bin_width / 2
        delta_end = delta_begin + torch.ones(self.bins) * bin_width
        density = self.histogram / bin_width
        return self._get_norm(delta_begin, delta_end, density).sum()

    def forward(self, x_orig: torch.Tensor) -> torch.Tensor:
        x = x_orig.detach()
        self.histogram = self.histogram + x.reshape(-1)[: self.bins].abs()
        self._compute_quantization_error(0, self.bins - 1)
        return x_orig


class QATNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(W, 2 * W)
        self.activation_post_process = HistogramObserver()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.activation_post_process(self.fc(x))


# QAT on the GPU with HistogramObserver: "the histogram is calculated through input activation x which is on the
# GPU, while other arguments to the _get_norm() function is on the CPU"
@R.mistake("pytorch/pytorch#59075", ("delta_begin", "torch.arange"), "model.activation_post_process")
def histogram_observer_norm_bins_on_cpu(dev: torch.device, other: torch.device) -> Program:
    model = QATNet().to(dev)
    x = randn(4, W, device=dev)
    return Program(model, lambda: model(x), (x,))


class MinMaxObserver(nn.Module):
    """torch.quantization's MinMaxObserver (1.6), shortened: the eps floor is made on device='cuda', the current
    GPU, whatever GPU min_val is on."""

    def __init__(self, eps: float = torch.finfo(torch.float32).eps) -> None:
        super().__init__()
        self.eps = eps
        self.register_buffer("min_val", torch.tensor([float("inf")]))
        self.register_buffer("max_val", torch.tensor([float("-inf")]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.min_val = torch.minimum(self.min_val, x.detach().min().reshape(1))
        self.max_val = torch.maximum(self.max_val, x.detach().max().reshape(1))
        return x

    def calculate_qparams(self) -> torch.Tensor:
        min_val, max_val = self.min_val, self.max_val
        device = "cuda" if min_val.is_cuda else "cpu"
        scale = (max_val - min_val) / 255.0
        eps = torch.tensor(self.eps, device=device, dtype=scale.dtype)
        scale = torch.max(scale, eps)  # case: observer_eps_on_current_gpu
        return scale


def calibrate(model: nn.Module, observer: MinMaxObserver, x: torch.Tensor) -> torch.Tensor:
    explain_here(model, x)
    observer(model(x))
    return observer.calculate_qparams()


# train_quantization.py with --device cuda:1: "found at least two devices, cuda:1 and cuda:0" at
# torch.tensor(self.eps, device=device) in _calculate_qparams()
@R.mistake("pytorch/pytorch#46533", ("eps", "device"), pairs=TWO_GPUS)
def observer_eps_on_current_gpu(dev: torch.device, other: torch.device) -> Program:
    model = nn.Linear(W, W).to(dev)
    observer = MinMaxObserver().to(dev)
    x = randn(4, W, device=dev)
    return stepped(model, lambda: calibrate(model, observer, x), (x,))


class PerChannelObserver:
    """TICO's PTQ observer before its fix: not an nn.Module, its state plain tensors that model.to() never sees."""

    def __init__(self, channels: int) -> None:
        self.min_val = torch.full((channels,), float("inf"))
        self.max_val = torch.full((channels,), float("-inf"))

    def observe(self, x: torch.Tensor) -> None:
        cur_min, cur_max = x.detach().amin(0), x.detach().amax(0)
        self.min_val = torch.minimum(self.min_val, cur_min)  # case: ptq_observer_plain_tensor_state
        self.max_val = torch.maximum(self.max_val, cur_max)


class ObservedLinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(W, W)
        self.obs = PerChannelObserver(W)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)
        self.obs.observe(y)
        return y


# "When calling model.to('cuda'), tensors inside PTQ observers (e.g. min_val, max_val, cached scale / zero_point)
# do not move to the target device"
@R.mistake("Samsung/TICO#443", ("min_val", "torch.full"), "model.obs")
def ptq_observer_plain_tensor_state(dev: torch.device, other: torch.device) -> Program:
    model = ObservedLinear().to(dev)
    x = randn(4, W, device=dev)
    return Program(model, lambda: model(x), (x,))


def quantize_per_channel(x: torch.Tensor, scales: torch.Tensor, zero_points: torch.Tensor) -> torch.Tensor:
    q = torch.round(x / scales[:, None]) + zero_points[:, None]  # case: derived_zero_point_on_cpu
    return torch.clamp(q, -128, 127)


def derive_qparams(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scales = weight.detach().abs().amax(1).clamp(min=1e-8) / 127
    derived_zero = torch.zeros(scales.shape[0], dtype=torch.int32)
    return scales, derived_zero


class QuantizedLinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(W, W)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scales, zero_points = derive_qparams(self.linear.weight)
        q_weight = quantize_per_channel(self.linear.weight, scales, zero_points)
        return F.linear(x, (q_weight - zero_points[:, None]) * scales[:, None], self.linear.bias)


# quantizing on the GPU: "input.device.type cuda scales.device.type cuda zero_points.device.type cpu" (the derived
# zero point was made without the other inputs' device)
@R.mistake("pytorch/executorch#14978", ("derived_zero", "torch.zeros"), "model")
def derived_zero_point_on_cpu(dev: torch.device, other: torch.device) -> Program:
    model = QuantizedLinear().to(dev)
    x = randn(4, W, device=dev)
    return Program(model, lambda: model(x), (x,))


# --------------------------------------------------------------------------- mistakes: optimal transport

class TorchBackend:
    """POT's torch backend, shortened: from_numpy and ones without type_as land on the CPU."""

    def from_numpy(self, a: np.ndarray, type_as: torch.Tensor | None = None) -> torch.Tensor:
        t = torch.from_numpy(a)
        return t if type_as is None else t.to(dtype=type_as.dtype, device=type_as.device)

    def ones(self, shape: tuple[int, ...], type_as: torch.Tensor | None = None) -> torch.Tensor:
        return torch.ones(shape) if type_as is None else torch.ones(shape, dtype=type_as.dtype,
                                                                       device=type_as.device)


nx = TorchBackend()


def expected_sliced_plan(X_s: torch.Tensor, X_t: torch.Tensor, n_projections: int = 1) -> torch.Tensor:
    n = X_s.shape[0]
    projections = torch.randn(X_s.shape[1], n_projections, device=X_s.device)
    order_s = (X_s @ projections).argsort(0)[:, 0]
    order_t = (X_t @ projections).argsort(0)[:, 0]
    plan = torch.zeros(n, n, device=X_s.device)
    plan[order_s, order_t] = 1.0 / n
    dist = nx.from_numpy(np.ones((n, n), dtype=np.float32) - np.eye(n, dtype=np.float32))
    return (plan * dist).sum()  # case: pot_sliced_plan_distance_on_cpu


def sliced_ot_step(encoder: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    explain_here(encoder, x)
    return expected_sliced_plan(encoder(x), encoder(y))


# ot.sliced.expected_sliced_plan on CUDA tensors: "computes the transport plan on CUDA, but subsequently multiplies
# it with a distance matrix created on CPU"
@R.mistake("PythonOT/POT#845", ("dist", "from_numpy"))
def pot_sliced_plan_distance_on_cpu(dev: torch.device, other: torch.device) -> Program:
    encoder = nn.Linear(W, 2).to(dev)
    x, y = randn(4, W, device=dev), randn(4, W, device=dev)
    return stepped(encoder, lambda: sliced_ot_step(encoder, x, y), (x,))


def bregman_projection_batch(K: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                             n_iters: int = 5) -> torch.Tensor:
    B, n, m = K.shape
    f = nx.ones((B, n))
    g = nx.ones((B, m))
    for _ in range(n_iters):
        f = a / (K * g[:, None, :]).sum(-1)  # case: pot_batch_sinkhorn_scalings_default_device
        g = b / (K * f[:, :, None]).sum(1)
    return f[:, :, None] * K * g[:, None, :]


def solve_sample_batch(x: torch.Tensor, y: torch.Tensor, reg: float = 1.0) -> torch.Tensor:
    M = torch.cdist(x, y) ** 2
    K = torch.exp(-M / reg)
    a = torch.full(x.shape[:2], 1.0 / x.shape[1], device=x.device)
    b = torch.full(y.shape[:2], 1.0 / y.shape[1], device=y.device)
    return (bregman_projection_batch(K, a, b) * M).sum((1, 2))


def batch_ot_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    explain_here(model, x)
    return solve_sample_batch(model(x), y).mean()


# ot.solve_sample_batch(x.cuda(), y.cuda(), reg=1): "the scaling vectors f/g were allocated with a bare
# nx.ones((B, n)), so they landed on the default (CPU) device and clashed with the GPU K"
@R.mistake("PythonOT/POT#783", ("g", "nx.ones"))
def pot_batch_sinkhorn_scalings_default_device(dev: torch.device, other: torch.device) -> Program:
    model = nn.Linear(1, 1).to(dev)
    x, y = randn(3, 5, 1, device=dev), randn(3, 5, 1, device=dev)
    return stepped(model, lambda: batch_ot_step(model, x, y), (x,))


class SinkhornDistance(nn.Module):
    """wassdistance's SinkhornDistance, shortened: the marginals mu and nu are made with torch.empty(...).fill_(),
    without a device."""

    def __init__(self, eps: float = 0.1, max_iter: int = 5) -> None:
        super().__init__()
        self.eps, self.max_iter = eps, max_iter

    def M(self, C: torch.Tensor, u: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return (-C + u.unsqueeze(-1) + v.unsqueeze(-2)) / self.eps  # case: sinkhorn_marginals_made_without_device

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        C = torch.cdist(x, y) ** 2
        x_points, y_points = x.shape[-2], y.shape[-2]
        batch_size = 1 if x.dim() == 2 else x.shape[0]
        mu = torch.empty(batch_size, x_points, dtype=torch.float, requires_grad=False).fill_(1.0 / x_points).squeeze()
        nu = torch.empty(batch_size, y_points, dtype=torch.float, requires_grad=False).fill_(1.0 / y_points).squeeze()
        u, v = torch.zeros_like(mu), torch.zeros_like(nu)
        for _ in range(self.max_iter):
            u = self.eps * (torch.log(mu + 1e-8) - torch.logsumexp(self.M(C, u, v), dim=-1)) + u
            v = self.eps * (torch.log(nu + 1e-8) - torch.logsumexp(self.M(C, u, v).transpose(-2, -1), dim=-1)) + v
        pi = torch.exp(self.M(C, u, v))
        return (pi * C).sum((-2, -1))


def wasserstein_step(model: nn.Module, sinkhorn: SinkhornDistance, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    explain_here(model, x)
    return sinkhorn(model(x), y)


# "Added device option to Wasserstein": mu = torch.empty(batch_size, x_points, ...).fill_(1.0 / x_points) lands on
# the CPU, and u = torch.zeros_like(mu) with it, while the cost matrix is on the GPU (the maintainer: "grab the
# device during the forward pass")
@R.mistake("dfdazac/wassdistance#3", ("u", "mu", "torch.empty"), "sinkhorn")
def sinkhorn_marginals_made_without_device(dev: torch.device, other: torch.device) -> Program:
    model = nn.Linear(2, 2).to(dev)
    sinkhorn = SinkhornDistance()
    x, y = randn(5, 2, device=dev), randn(4, 2, device=dev)
    return stepped(model, lambda: wasserstein_step(model, sinkhorn, x, y), (x,))


# --------------------------------------------------------------------------- mistakes: sparse tensors, Fourier filters

def build_adjacency(edge_index: torch.Tensor, num_nodes: int) -> torch.Tensor:
    values = torch.ones(edge_index.shape[1])
    return torch.sparse_coo_tensor(edge_index, values, (num_nodes, num_nodes))  # case: sparse_adjacency_values_on_cpu


class SparseGCN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(W, C)

    def forward(self, x: torch.Tensor, edge_index: torch.Tensor) -> torch.Tensor:
        adj = build_adjacency(edge_index, x.shape[0])
        return torch.sparse.mm(adj, self.lin(x))


# torch.sparse_coo_tensor with indices on the GPU and values made without a device: "found at least two devices,
# cuda:0 and cpu! (when checking argument for argument values in method
# wrapper___sparse_coo_tensor_with_dims_and_tensors)"; meta says "backend of indices (Meta) must match backend of
# values (CPU)", so the GPU pairs
@R.mistake("pytorch/pytorch#89402", ("values", "torch.ones"), "model", pairs=GPU)
def sparse_adjacency_values_on_cpu(dev: torch.device, other: torch.device) -> Program:
    model = SparseGCN().to(dev)
    x = randn(4, W, device=dev)
    edge_index = torch.tensor([[0, 1, 2, 3], [1, 2, 3, 0]], device=dev)
    return Program(model, lambda: model(x, edge_index), (x, edge_index))


class SparseTensor:
    """MinkowskiEngine's SparseTensor, shortened: dense() builds its tensor_stride and min_coordinate on the CPU."""

    def __init__(self, features: torch.Tensor, coordinates: torch.Tensor, tensor_stride: int = 2) -> None:
        self.F, self.C, self._tensor_stride = features, coordinates, tensor_stride

    def dense(self, shape: tuple[int, ...]) -> torch.Tensor:
        tensor_stride = torch.IntTensor([self._tensor_stride] * (self.C.shape[1] - 1))
        min_coordinate = torch.IntTensor([0] * (self.C.shape[1] - 1))
        coords = self.C[:, 1:] - min_coordinate  # case: minkowski_dense_stride_on_cpu
        coords = coords // tensor_stride
        dense = torch.zeros(shape, device=self.F.device)
        dense[self.C[:, 0].long(), :, coords[:, 0].long(), coords[:, 1].long()] = self.F
        return dense


class SparseUNetHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.final = nn.Linear(W, C)

    def forward(self, feats: torch.Tensor, coords: torch.Tensor) -> torch.Tensor:
        out = SparseTensor(self.final(feats), coords)
        return out.dense((1, C, 4, 4))


# "When I called dense() function to convert sparse tensor back to dense tensor ... the problem comes from the local
# variable of tensor_stride which should be initialised at the device that is being used"
@R.mistake("NVIDIA/MinkowskiEngine#319", ("min_coordinate", "torch.IntTensor"), "model")
def minkowski_dense_stride_on_cpu(dev: torch.device, other: torch.device) -> Program:
    model = SparseUNetHead().to(dev)
    feats = randn(3, W, device=dev)
    coords = torch.tensor([[0, 0, 0], [0, 2, 2], [0, 4, 6]], dtype=torch.int32, device=dev)
    return Program(model, lambda: model(feats, coords), (feats, coords))


class HannFilter:
    """pytorch_radon's HannFilter before the fix: the Hann window comes from a NumPy/CPU computation."""

    def create_filter(self, fourier_ramp: torch.Tensor) -> torch.Tensor:
        n = np.arange(fourier_ramp.shape[0])
        hann = torch.from_numpy(0.5 - 0.5 * np.cos(2.0 * np.pi * n / (fourier_ramp.shape[0] - 1))).float()
        return fourier_ramp * hann.roll(fourier_ramp.shape[0] // 2)  # case: radon_hann_window_on_cpu


class IRadon(nn.Module):
    """Filtered back-projection, shortened: a ramp filter in the Fourier domain times the Hann window."""

    def __init__(self, size: int = W) -> None:
        super().__init__()
        self.size = size
        self.filter = HannFilter()
        self.conv = nn.Conv1d(1, 1, 3, padding=1)

    def forward(self, sinogram: torch.Tensor) -> torch.Tensor:
        freqs = torch.fft.fftfreq(self.size, device=sinogram.device)
        fourier_ramp = 2 * freqs.abs()
        projection = torch.fft.fft(sinogram, dim=-1) * self.filter.create_filter(fourier_ramp)
        return self.conv(torch.fft.ifft(projection, dim=-1).real)


# "Fix: HannFilter error, wrong torch.device. Quick fix: put hann on same device as fourier_ramp before
# multiplication"
@R.mistake("phernst/pytorch_radon#2", ("hann", "from_numpy"))
def radon_hann_window_on_cpu(dev: torch.device, other: torch.device) -> Program:
    model = IRadon().to(dev)
    sinogram = randn(2, 1, W, device=dev)
    return Program(model, lambda: model(sinogram), (sinogram,))


# --------------------------------------------------------------------------- mistakes: generators and samplers

def prepare_latents(unet: nn.Module, batch_size: int, generator: torch.Generator,
                    device: torch.device) -> torch.Tensor:
    shape = (batch_size, W)
    latents = torch.randn(shape, generator=generator, device=device)  # case: diffusers_cpu_generator_for_cuda_latents
    return latents * 1.0


def denoise(unet: nn.Module, generator: torch.Generator, device: torch.device) -> torch.Tensor:
    latents = prepare_latents(unet, 2, generator, device)
    explain_here(unet, latents)
    return unet(latents)


# "The problem is that the random tensors are being created in the GPU and you're passing a CPU generator"
# ("Expected a 'cuda' device type for generator but found 'cpu'"); meta takes a CPU generator
@R.mistake("huggingface/diffusers#6501", ("generator", "torch.Generator"), pairs=CUDA_CPU)
def diffusers_cpu_generator_for_cuda_latents(dev: torch.device, other: torch.device) -> Program:
    unet = nn.Linear(W, W).to(dev)
    generator = torch.Generator().manual_seed(0)
    return stepped(unet, lambda: denoise(unet, generator, dev), (randn(2, W, device=dev),))


class BernoulliNegativeSampler:
    """torchkge's BernoulliNegativeSampler, shortened: its per-relation probabilities stay on the CPU."""

    def __init__(self, n_ent: int, n_rel: int) -> None:
        self.n_ent = n_ent
        self.bern_probs = torch.full((n_rel,), 0.5)

    def corrupt_batch(self, heads: torch.Tensor, tails: torch.Tensor, relations: torch.Tensor) -> torch.Tensor:
        mask = torch.bernoulli(self.bern_probs[relations]).bool()  # case: kge_bernoulli_sampler_probs_on_cpu
        neg_heads = heads.clone()
        neg_heads[mask] = torch.randint(0, self.n_ent, (int(mask.sum()),), device=heads.device)
        return neg_heads


class TransE(nn.Module):
    def __init__(self, n_ent: int = 10, n_rel: int = 3) -> None:
        super().__init__()
        self.ent_emb = nn.Embedding(n_ent, W)
        self.rel_emb = nn.Embedding(n_rel, W)

    def forward(self, h: torch.Tensor, t: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        return (self.ent_emb(h) + self.rel_emb(r) - self.ent_emb(t)).norm(dim=-1)


def kge_train_step(model: TransE, sampler: BernoulliNegativeSampler, h: torch.Tensor, t: torch.Tensor,
                   r: torch.Tensor) -> torch.Tensor:
    explain_here(model, h, t, r)
    n_h = sampler.corrupt_batch(h, t, r)
    return F.relu(1.0 + model(h, t, r) - model(n_h, t, r)).mean()


# "I was not able to use CUDA with negative sampler as it was throwing error that 'indices should be on same device
# (CPU)'" (CUDA relation ids index the sampler's CPU probabilities; meta does not check indexing)
@R.mistake("torchkge-team/torchkge#246", ("bern_probs", "torch.full"), pairs=GPU)
def kge_bernoulli_sampler_probs_on_cpu(dev: torch.device, other: torch.device) -> Program:
    model = TransE().to(dev)
    sampler = BernoulliNegativeSampler(10, 3)
    h, t, r = (torch.tensor([0, 1, 2], device=dev), torch.tensor([3, 4, 5], device=dev),
               torch.tensor([0, 1, 2], device=dev))
    return stepped(model, lambda: kge_train_step(model, sampler, h, t, r), (h, t, r))


class RandomRecommender(nn.Module):
    """RecBole's Random model, shortened: full_sort_predict scores with torch.rand, on the CPU."""

    def __init__(self, n_items: int = 6) -> None:
        super().__init__()
        self.n_items = n_items
        self.fake_loss = nn.Parameter(torch.zeros(1))

    def full_sort_predict(self, user: torch.Tensor) -> torch.Tensor:
        return torch.rand(len(user), self.n_items).squeeze(-1)


def full_sort_eval(model: RandomRecommender, user: torch.Tensor, history_mask: torch.Tensor) -> torch.Tensor:
    explain_here(model, user)
    scores = model.full_sort_predict(user)
    scores = torch.where(history_mask, -math.inf, scores)  # case: recbole_random_scores_on_cpu
    return scores.topk(2, dim=1).indices


# training MovieLens-100K on Random, ADMMSLIM and SLIMElastic: "Expected all tensors to be on the same device, but
# found at least two devices, cuda:0 and CPU!" (their scores are made on the CPU, the history mask on the GPU)
@R.mistake("RUCAIBox/RecBole#1984", ("scores", "torch.rand"))
def recbole_random_scores_on_cpu(dev: torch.device, other: torch.device) -> Program:
    model = RandomRecommender().to(dev)
    user = torch.tensor([0, 1], device=dev)
    history_mask = torch.zeros(2, 6, dtype=torch.bool, device=dev)
    return stepped(model, lambda: full_sort_eval(model, user, history_mask), (user,))


def negative_sampling(edge_index: torch.Tensor, num_nodes: int, num_neg_samples: int) -> torch.Tensor:
    idx = torch.randperm(num_nodes * num_nodes)[:num_neg_samples]
    return torch.stack([idx // num_nodes, idx % num_nodes])


def random_link_split(edge_index: torch.Tensor, num_nodes: int) -> tuple[torch.Tensor, torch.Tensor]:
    neg_edge_index = negative_sampling(edge_index, num_nodes, edge_index.shape[1])
    edge_label_index = torch.cat([edge_index, neg_edge_index], dim=-1)  # case: pyg_link_split_negatives_on_cpu
    edge_label = torch.cat([torch.ones(edge_index.shape[1], device=edge_index.device),
                            torch.zeros(neg_edge_index.shape[1], device=edge_index.device)])
    return edge_label_index, edge_label


def link_pred_step(model: nn.Module, x: torch.Tensor, edge_index: torch.Tensor) -> torch.Tensor:
    explain_here(model, x)
    edge_label_index, edge_label = random_link_split(edge_index, x.shape[0])
    z = model(x)
    logits = (z[edge_label_index[0]] * z[edge_label_index[1]]).sum(-1)
    return F.binary_cross_entropy_with_logits(logits, edge_label)


# RandomLinkSplit after T.ToDevice(device): "is negative sampling with the device being the cpu ... we would run
# into the error 'Expected all tensors to be on the same device' when we operate on the two tensors (eg. torch.cat)"
@R.mistake("pyg-team/pytorch_geometric#3641", ("neg_edge_index", "negative_sampling"))
def pyg_link_split_negatives_on_cpu(dev: torch.device, other: torch.device) -> Program:
    model = nn.Linear(W, W).to(dev)
    x = randn(5, W, device=dev)
    edge_index = torch.tensor([[0, 1, 2, 3], [1, 2, 3, 4]], device=dev)
    return stepped(model, lambda: link_pred_step(model, x, edge_index), (x,))


# --------------------------------------------------------------------------- mistakes: optimizers, MAML, federated

def resume_then_move(model: nn.Module, checkpoint: dict, device: torch.device) -> torch.optim.Optimizer:
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    optimizer.load_state_dict(checkpoint["optimizer"])
    model.to(device)
    return optimizer


def resumed_train_step(model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor) -> None:
    explain_here(model, x, optimizer=optimizer)
    optimizer.zero_grad()
    model(x).pow(2).mean().backward()
    optimizer.step()  # case: optimizer_state_loaded_before_model_moved


# "Fix Incorrect Optimizer Device during State Loading: a device mismatch when an optimizer state dict is loaded and
# its state does not match the device" (load_state_dict casts the state to where the parameters are at that moment:
# the CPU, before model.to(device)); meta lets Adam's in-place updates of the CPU state pass, so the GPU pairs
@R.mistake("autrainer/autrainer#146", ("exp_avg", "load_state_dict"), pairs=GPU)
def optimizer_state_loaded_before_model_moved(dev: torch.device, other: torch.device) -> Program:
    saved = nn.Linear(W, 1)
    saved_optimizer = torch.optim.Adam(saved.parameters(), lr=1e-3)
    saved(torch.randn(4, W)).sum().backward()
    saved_optimizer.step()
    model = nn.Linear(W, 1)
    model.load_state_dict(saved.state_dict())
    optimizer = resume_then_move(model, {"optimizer": saved_optimizer.state_dict()}, dev)
    x = randn(4, W, device=dev)
    return stepped(model, lambda: resumed_train_step(model, optimizer, x), (x,), optimizer)


class RunnerWrapper:
    """cherry's runner, shortened: the environment's states come back as CPU tensors."""

    def __init__(self, obs_dim: int = W) -> None:
        self.obs_dim = obs_dim

    def run(self, get_action: nn.Module, episodes: int = 1) -> list[torch.Tensor]:
        states = []
        for _ in range(episodes):
            state = torch.from_numpy(np.random.randn(1, self.obs_dim).astype(np.float32))
            states.append(get_action(state))
        return states


class DiagNormalPolicy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mean = nn.Sequential(nn.Linear(W, W), nn.Tanh(), nn.Linear(W, 2))
        self.sigma = nn.Parameter(torch.ones(2))

    def forward(self, state: torch.Tensor) -> torch.Tensor:
        loc = self.mean(state)  # case: maml_trpo_runner_states_on_cpu
        return loc + self.sigma * torch.randn_like(loc)


def maml_adapt_step(policy: nn.Module, task: RunnerWrapper) -> torch.Tensor:
    clone = copy.deepcopy(policy)
    explain_here(clone, torch.zeros(1, W, device=next(policy.parameters()).device))
    return torch.stack(task.run(clone, episodes=2)).pow(2).mean()


# examples/rl/maml_trpo.py with cuda=1: train_episodes = task.run(clone, episodes=adapt_bsz) -> loc =
# self.mean(state) fails, the runner's states on the CPU (a linear layer: the GPU pairs)
@R.mistake("learnables/learn2learn#162", ("state", "from_numpy"), "clone.mean.0", pairs=GPU)
def maml_trpo_runner_states_on_cpu(dev: torch.device, other: torch.device) -> Program:
    policy = DiagNormalPolicy().to(dev)
    task = RunnerWrapper()
    return stepped(policy, lambda: maml_adapt_step(policy, task), (torch.zeros(1, W, device=dev),))


def aggregate(w_locals: list[tuple[int, dict[str, torch.Tensor]]]) -> dict[str, torch.Tensor]:
    """FedML's FedAvg aggregator, shortened: weighted sum of the clients' state dicts, in place."""
    training_num = sum(n for n, _ in w_locals)
    num0, averaged_params = w_locals[0]
    averaged_params = {k: v * (num0 / training_num) for k, v in averaged_params.items()}
    for local_sample_number, local_model_params in w_locals[1:]:
        w = local_sample_number / training_num
        for k in averaged_params:
            averaged_params[k] += local_model_params[k] * w  # case: fedavg_clients_on_cpu_and_gpu
    return averaged_params


def server_round(global_model: nn.Module, clients: list[nn.Module], x: torch.Tensor) -> None:
    explain_here(global_model, x)
    w_locals = [(10, c.state_dict()) for c in clients]
    global_model.load_state_dict(aggregate(w_locals))


# "CUDA error: when some use CPU and some use GPU, CUDA tensor will not match": one client trained on the CPU, the
# others on the GPU, their state dicts summed in place (meta lets the in-place sum of a CPU tensor pass)
@R.mistake("FedML-AI/FedML#779", ("averaged_params", "local_model_params"), pairs=GPU)
def fedavg_clients_on_cpu_and_gpu(dev: torch.device, other: torch.device) -> Program:
    global_model = nn.Linear(W, C).to(dev)
    clients = [nn.Linear(W, C), nn.Linear(W, C).to(dev)]
    x = randn(2, W, device=dev)
    return stepped(global_model, lambda: server_round(global_model, clients, x), (x,))


# --------------------------------------------------------------------------- mistakes: OCR, RL, generation, KD

class CRNN(nn.Module):
    def __init__(self, n_class: int = 5) -> None:
        super().__init__()
        self.cnn = nn.Conv2d(1, W, 3, padding=1)
        self.rnn = nn.LSTM(W, W)
        self.fc = nn.Linear(W, n_class)

    def forward(self, img: torch.Tensor) -> torch.Tensor:
        f = self.cnn(img).mean(2).permute(2, 0, 1)
        return self.fc(self.rnn(f)[0])


def rec_train_step(model: nn.Module, img: torch.Tensor, targets: torch.Tensor, target_lengths: torch.Tensor,
                   device: torch.device) -> torch.Tensor:
    explain_here(model, img)
    preds = model(img).log_softmax(2)
    preds_lengths = torch.full((img.shape[0],), preds.shape[0], dtype=torch.long)
    return F.ctc_loss(preds, targets, preds_lengths, target_lengths)  # case: ocr_ctc_targets_left_on_cpu


# PytorchOCR's recognition training: "Tensor for argument #2 'targets' is on CPU, but expected it to be on GPU
# (while checking arguments for ctc_loss_gpu)" (int64 padded targets take the native kernel, not cuDNN's; meta has
# no CTC kernel)
@R.mistake("WenmuZhou/PytorchOCR#140", "targets", pairs=GPU)
def ocr_ctc_targets_left_on_cpu(dev: torch.device, other: torch.device) -> Program:
    model = CRNN().to(dev)
    img = randn(2, 1, 4, 8, device=dev)
    targets = torch.tensor([[1, 2, 3], [2, 3, 0]])
    target_lengths = torch.tensor([3, 2])
    return stepped(model, lambda: rec_train_step(model, img, targets, target_lengths, dev), (img,))


class TanhGaussianPolicy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fcs = nn.ModuleList([nn.Linear(W, W), nn.Linear(W, W)])
        self.last_fc = nn.Linear(W, 2)

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        h = obs
        for fc in self.fcs:
            h = torch.relu(fc(h))  # case: rlkit_eval_np_obs_from_numpy_cpu
        return torch.tanh(self.last_fc(h))


class PtuDevice:
    """rlkit's pytorch_util: the device is the CPU until set_gpu_mode(True) is called."""

    device = torch.device("cpu")

    @classmethod
    def from_numpy(cls, *args, **kwargs) -> torch.Tensor:
        return torch.from_numpy(*args, **kwargs).float().to(cls.device)


def eval_np(module: nn.Module, *args) -> np.ndarray:
    torch_args = tuple(PtuDevice.from_numpy(x) for x in args)
    outputs = module(*torch_args)
    return outputs.detach().cpu().numpy()


def simulate_policy(policy: nn.Module, obs: np.ndarray) -> np.ndarray:
    explain_here(policy, torch.zeros(1, W, device=next(policy.parameters()).device))
    return eval_np(policy, obs[None])


# run_goal_conditioned_policy.py: data['trainer/policy'] is on the GPU, set_gpu_mode() was not called, so eval_np
# sends the observation to ptu.device, the CPU (linear layers: the GPU pairs)
@R.mistake("rail-berkeley/rlkit#94", ("torch_args", "from_numpy"), "policy.fcs.0", pairs=GPU)
def rlkit_eval_np_obs_from_numpy_cpu(dev: torch.device, other: torch.device) -> Program:
    policy = TanhGaussianPolicy().to(dev)
    obs = np.random.randn(W).astype(np.float32)
    return stepped(policy, lambda: simulate_policy(policy, obs), (torch.zeros(1, W, device=dev),))


class CQLPolicy:
    """RLlib's CQL/SAC torch policy, shortened: the target model is built beside the model and never moved."""

    def __init__(self, device: torch.device) -> None:
        self.model = nn.Sequential(nn.Linear(W, W), nn.ReLU(), nn.Linear(W, 2)).to(device)
        self.target_model = nn.Sequential(nn.Linear(W, W), nn.ReLU(), nn.Linear(W, 2))

    def loss(self, obs: torch.Tensor, next_obs: torch.Tensor, rewards: torch.Tensor) -> torch.Tensor:
        explain_here(self.model, obs)
        q_t = self.model(obs).max(1).values
        q_tp1 = self.target_model(next_obs).max(1).values  # case: cql_target_model_not_moved
        return F.mse_loss(q_t, rewards + 0.99 * q_tp1.detach())


# CQL on a GPU: "All input tensors must be on the same device. Received cuda:0 and cpu" (the maintainer: "where we
# make sure the target model is moved to the GPU"); a linear layer: the GPU pairs
@R.mistake("ray-project/ray#13823", "target_model", "target_model.0", pairs=GPU)
def cql_target_model_not_moved(dev: torch.device, other: torch.device) -> Program:
    policy = CQLPolicy(dev)
    obs, next_obs, rewards = randn(4, W, device=dev), randn(4, W, device=dev), randn(4, device=dev)
    return stepped(policy.model, lambda: policy.loss(obs, next_obs, rewards), (obs,))


def compute_output_size(observation_shape: tuple[int, ...], encoder: nn.Module, device: torch.device) -> int:
    with torch.no_grad():
        inp = torch.rand((1,) + observation_shape, device=device)
        return int(encoder(inp).shape[1])  # case: d3rlpy_encoder_not_moved_before_size_probe


class DiscreteQFunction(nn.Module):
    def __init__(self, encoder: nn.Module, hidden: int, n_actions: int) -> None:
        super().__init__()
        self.encoder = encoder
        self.fc = nn.Linear(hidden, n_actions)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.encoder(x))


def make_encoder(observation_shape: tuple[int, ...]) -> nn.Module:
    return nn.Sequential(nn.Conv2d(observation_shape[0], 4, 3), nn.ReLU(), nn.Flatten())


def create_discrete_q_function(encoder: nn.Module, observation_shape: tuple[int, ...], n_actions: int,
                               device: torch.device) -> nn.Module:
    explain_here(encoder, torch.rand((1,) + observation_shape, device=device))
    hidden = compute_output_size(observation_shape, encoder, device)
    return DiscreteQFunction(encoder, hidden, n_actions).to(device)


# DiscreteCQL created with device="cuda:0": create_discrete_q_function calls compute_output_size while "the encoder
# has not been moved to cuda" (a convolution: the GPU pairs)
@R.mistake("takuseno/d3rlpy#329", "encoder", "encoder.0", pairs=GPU)
def d3rlpy_encoder_not_moved_before_size_probe(dev: torch.device, other: torch.device) -> Program:
    encoder = make_encoder((1, 4, 4))
    return stepped(encoder, lambda: create_discrete_q_function(encoder, (1, 4, 4), 2, dev),
                   (torch.rand(1, 1, 4, 4, device=dev),))


class PrioritizedReplayBuffer:
    """morl-baselines' PER buffer, shortened: priorities live in a NumPy sum tree."""

    def __init__(self, size: int = 8) -> None:
        self.priorities = np.ones(size, dtype=np.float32)

    def update_priorities(self, idxes: torch.Tensor, priorities: np.ndarray) -> None:
        idxes = np.unique(idxes)  # case: per_priority_indices_left_on_gpu
        self.priorities[idxes] = priorities[: len(idxes)]


def gpi_pd_update(q_net: nn.Module, buffer: PrioritizedReplayBuffer, obs: torch.Tensor,
                  idxes: torch.Tensor) -> None:
    explain_here(q_net, obs)
    td_error = q_net(obs).max(1).values
    per = td_error.abs().detach()
    priority = per.cpu().numpy().flatten()
    buffer.update_priorities(idxes, priority)


# GPIPDContinuousAction.update: "update_priorities calls self.tree.batch_set, which in turn calls np.unique on the
# input indices. Since the indices are still a Tensor which may be stored on the GPU, a TypeError is thrown"
@R.mistake("LucasAlegre/morl-baselines#185", "idxes", pairs=GPU)
def per_priority_indices_left_on_gpu(dev: torch.device, other: torch.device) -> Program:
    q_net = nn.Linear(W, 2).to(dev)
    buffer = PrioritizedReplayBuffer()
    obs, idxes = randn(4, W, device=dev), torch.tensor([0, 2, 4, 6], device=dev)
    return stepped(q_net, lambda: gpi_pd_update(q_net, buffer, obs, idxes), (obs,))


class SuppressTokensLogitsProcessor:
    """transformers' SuppressTokensLogitsProcessor before device guards: its token tensor is made on the CPU."""

    def __init__(self, suppress_tokens: list[int]) -> None:
        self.suppress_tokens = torch.tensor(suppress_tokens)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        vocab_tensor = torch.arange(scores.shape[-1], device=scores.device)
        suppress_token_mask = torch.isin(vocab_tensor, self.suppress_tokens)  # case: logits_processor_tokens_on_cpu
        return torch.where(suppress_token_mask, -float("inf"), scores)


class TinyLM(nn.Module):
    def __init__(self, vocab: int = 10) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, W)
        self.lm_head = nn.Linear(W, vocab)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.embed(input_ids))


def greedy_generate(model: TinyLM, input_ids: torch.Tensor, processors: list, steps: int = 2) -> torch.Tensor:
    explain_here(model, input_ids)
    for _ in range(steps):
        scores = model(input_ids)[:, -1, :]
        for processor in processors:
            scores = processor(input_ids, scores)
        input_ids = torch.cat([input_ids, scores.argmax(-1, keepdim=True)], dim=-1)
    return input_ids


# "There are a few LogitsProcessor classes that have a torch.Tensor attribute, and when __call__ is called that
# tensor may not be on the same device as scores" (isin: meta does not compare the devices, so the GPU pairs)
@R.mistake("huggingface/transformers#38558", ("suppress_tokens", "torch.tensor"), pairs=GPU)
def logits_processor_tokens_on_cpu(dev: torch.device, other: torch.device) -> Program:
    model = TinyLM().to(dev)
    input_ids = torch.tensor([[1, 2, 3]], device=dev)
    processors = [SuppressTokensLogitsProcessor([0, 5])]
    return stepped(model, lambda: greedy_generate(model, input_ids, processors), (input_ids,))


class KnowledgeDistillationSingleStageDetector(nn.Module):
    """mmdet's KD detector, shortened: the teacher is kept out of the submodules on purpose (__setattr__) and moved
    only by the overridden cuda(); .to(device) leaves it on the CPU."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Conv2d(3, W, 3, padding=1)
        self.bbox_head = nn.Conv2d(W, C, 1)
        self.teacher_model = nn.Sequential(nn.Conv2d(3, W, 3, padding=1), nn.Conv2d(W, C, 1))

    def cuda(self, device=None):
        self.teacher_model.cuda(device=device)
        return super().cuda(device=device)

    def __setattr__(self, name: str, value) -> None:
        if name == "teacher_model":
            object.__setattr__(self, name, value)
        else:
            super().__setattr__(name, value)

    def forward(self, img: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            teacher_x = self.teacher_model[0](img)  # case: kd_teacher_unregistered_moved_only_by_cuda
            out_teacher = self.teacher_model[1](teacher_x)
        student = self.bbox_head(self.backbone(img))
        return F.kl_div(student.log_softmax(1), out_teacher.softmax(1), reduction="batchmean")


# "teacher_model.cuda()?": the teacher is not registered (kd_one_stage.py overrides __setattr__ and cuda()), so a
# model moved with .to(device) keeps its teacher on the CPU (a convolution: the GPU pairs)
@R.mistake("open-mmlab/mmdetection#5055", "teacher_model", "model.teacher_model.0", pairs=GPU)
def kd_teacher_unregistered_moved_only_by_cuda(dev: torch.device, other: torch.device) -> Program:
    model = KnowledgeDistillationSingleStageDetector().to(dev)
    img = randn(1, 3, 4, 4, device=dev)
    return Program(model, lambda: model(img), (img,))


# --------------------------------------------------------------------------- legal: quantization and optimal transport

class BufferedMinMaxObserver(nn.Module):
    """MinMaxObserver as it is now: min_val and max_val are buffers, so .cuda()/.to() moves them."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("min_val", torch.tensor(float("inf")))
        self.register_buffer("max_val", torch.tensor(float("-inf")))

    def forward(self, x_orig: torch.Tensor) -> torch.Tensor:
        x = x_orig.detach()
        self.min_val.copy_(torch.minimum(x.min(), self.min_val))
        self.max_val.copy_(torch.maximum(x.max(), self.max_val))
        return x_orig


# "This works now, closing: obs = torch.quantization.MinMaxObserver().cuda(); obs(data.cuda())"
@R.legal("pytorch/pytorch#29648")
def observer_buffers_moved_with_cuda(dev: torch.device, other: torch.device) -> Program:
    model = nn.Sequential(nn.Linear(W, W), BufferedMinMaxObserver()).to(dev)
    x = randn(4, W, device=dev)
    return Program(model, lambda: model(x), (x,))


class AffinityObserver(nn.Module):
    """The observer after "respects device affinity": its state is moved to the input's device before use."""

    def __init__(self, channels: int = W) -> None:
        super().__init__()
        self.register_buffer("min_val", torch.full((channels,), float("inf")))

    def forward(self, x_orig: torch.Tensor) -> torch.Tensor:
        x = x_orig.detach()
        self.min_val = self.min_val.to(x.device)
        self.min_val = torch.minimum(x.amin(0), self.min_val)
        return x_orig


# self.min_val = self.min_val.to(x.device) before torch.min(min_val_cur, self.min_val)
@R.legal("pytorch/pytorch#47514")
def observer_state_moved_to_input_device(dev: torch.device, other: torch.device) -> Program:
    model = nn.Sequential(nn.Linear(W, W).to(dev), AffinityObserver())
    x = randn(4, W, device=dev)
    return Program(model, lambda: model(x), (x,))


def bregman_projection_batch_type_as(K: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                                     n_iters: int = 5) -> torch.Tensor:
    B, n, m = K.shape
    f = nx.ones((B, n), type_as=K)
    g = nx.ones((B, m), type_as=K)
    for _ in range(n_iters):
        f = a / (K * g[:, None, :]).sum(-1)
        g = b / (K * f[:, :, None]).sum(1)
    return f[:, :, None] * K * g[:, None, :]


def batch_ot_step_fixed(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    explain_here(model, x)
    M = torch.cdist(model(x), y) ** 2
    K = torch.exp(-M)
    a = torch.full(x.shape[:2], 1.0 / x.shape[1], device=x.device)
    return (bregman_projection_batch_type_as(K, a, a) * M).sum()


# the fix: "give f/g (and the default a/b) the input backend/device via type_as"
@R.legal("PythonOT/POT#851")
def pot_scalings_made_with_type_as(dev: torch.device, other: torch.device) -> Program:
    model = nn.Linear(1, 1).to(dev)
    x, y = randn(3, 5, 1, device=dev), randn(3, 5, 1, device=dev)
    return stepped(model, lambda: batch_ot_step_fixed(model, x, y), (x,))


# --------------------------------------------------------------------------- legal: sampling, buffers, generation

def prepare_latents_on_cpu(shape: tuple[int, ...], generator: torch.Generator, device: torch.device) -> torch.Tensor:
    if generator.device.type == "cpu" and device.type != "cpu":
        return torch.randn(shape, generator=generator, device="cpu").to(device)
    return torch.randn(shape, generator=generator, device=device)


def denoise_reproducibly(unet: nn.Module, generator: torch.Generator, device: torch.device) -> torch.Tensor:
    latents = prepare_latents_on_cpu((2, W), generator, device)
    explain_here(unet, latents)
    return unet(latents)


# randn_tensor: "Tensors will be created on 'cpu' and then moved to {device}" when the generator is a CPU one
@R.legal("huggingface/diffusers#1902")
def diffusers_cpu_generator_latents_moved(dev: torch.device, other: torch.device) -> Program:
    unet = nn.Linear(W, W).to(dev)
    generator = torch.Generator().manual_seed(0)
    return stepped(unet, lambda: denoise_reproducibly(unet, generator, dev), (randn(2, W, device=dev),))


class ExperienceReplayBuffer:
    """A replay buffer kept in CPU memory (store_device) whose samples go to the training device."""

    def __init__(self, size: int, device: torch.device, store_device: str = "cpu") -> None:
        self.device, self.store_device = device, torch.device(store_device)
        self.obs = torch.randn(size, W, device=self.store_device)
        self.rewards = torch.randn(size, device=self.store_device)

    def sample(self, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        idx = torch.randint(0, self.obs.shape[0], (batch_size,), device=self.store_device)
        return self.obs[idx].to(self.device), self.rewards[idx].to(self.device)


def dqn_update(q_net: nn.Module, buffer: ExperienceReplayBuffer) -> torch.Tensor:
    obs, rewards = buffer.sample(4)
    explain_here(q_net, obs)
    return F.mse_loss(q_net(obs).max(1).values, rewards)


# "store the replay buffer on a different device than it expects input and output to be ... stored in CPU memory
# while the network and training lives in GPU memory"
@R.legal("cpnota/autonomous-learning-library#186")
def replay_buffer_on_cpu_samples_moved(dev: torch.device, other: torch.device) -> Program:
    q_net = nn.Linear(W, 2).to(dev)
    buffer = ExperienceReplayBuffer(16, dev)
    return stepped(q_net, lambda: dqn_update(q_net, buffer), (randn(4, W, device=dev),))


class LazyTensorStorage:
    def __init__(self, size: int, device: str = "cpu") -> None:
        self.device = torch.device(device)
        self.obs = torch.zeros(size, W, device=self.device)
        self.cursor = 0

    def extend(self, obs: torch.Tensor) -> None:
        self.obs[self.cursor:self.cursor + obs.shape[0]] = obs
        self.cursor += obs.shape[0]


def collect(policy: nn.Module, storage: LazyTensorStorage, obs: torch.Tensor) -> None:
    explain_here(policy, obs)
    with torch.no_grad():
        rollout = policy(obs)
    storage.extend(rollout.to(storage.device))


# "remove this line (defaulting to storing the rollout on the sampling device). And then calling
# .to(buffer.storage.device) before adding it to the buffer" (meta has no data to copy to the CPU: the GPU pairs)
@R.legal("facebookresearch/BenchMARL#180", pairs=GPU)
def rollout_moved_to_buffer_device(dev: torch.device, other: torch.device) -> Program:
    policy = nn.Linear(W, W).to(dev)
    storage = LazyTensorStorage(8)
    obs = randn(2, W, device=dev)
    return stepped(policy, lambda: collect(policy, storage, obs), (obs,))


class SuppressTokensAtBegin:
    """A logits processor given the device at init: its tensor is made where the scores will be."""

    def __init__(self, begin_suppress_tokens: list[int], device: str | torch.device = "cpu") -> None:
        self.begin_suppress_tokens = torch.tensor(begin_suppress_tokens, device=device)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        vocab_tensor = torch.arange(scores.shape[-1], device=scores.device)
        mask = torch.isin(vocab_tensor, self.begin_suppress_tokens)
        return torch.where(mask, -float("inf"), scores)


# "adds the ability to pass in device when initializing LogitsProcessors"
@R.legal("huggingface/transformers#29804")
def logits_processor_given_device_at_init(dev: torch.device, other: torch.device) -> Program:
    model = TinyLM().to(dev)
    input_ids = torch.tensor([[1, 2, 3]], device=dev)
    processors = [SuppressTokensAtBegin([0, 5], device=input_ids.device)]
    return stepped(model, lambda: greedy_generate(model, input_ids, processors), (input_ids,))


class ItemTower(nn.Module):
    def __init__(self, n_items: int = 10) -> None:
        super().__init__()
        self.item_emb = nn.Embedding(n_items, W)

    def forward(self, users: torch.Tensor) -> torch.Tensor:
        neg_items = torch.randint(0, self.item_emb.num_embeddings, (users.shape[0],))
        return self.item_emb.weight[neg_items] @ users.T


# "indices should be either on cpu or on the same device as the indexed tensor": negative item ids drawn on the CPU
# index the embedding table on the device
@R.legal("dizcza/sparse-representation#1")
def cpu_negative_ids_index_device_table(dev: torch.device, other: torch.device) -> Program:
    model = ItemTower().to(dev)
    users = randn(3, W, device=dev)
    return Program(model, lambda: model(users), (users,))


def pinned_train_step(model: nn.Module, batch: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device.type == "cuda":
        batch = batch.pin_memory()
    batch = batch.to(device, non_blocking=True)
    explain_here(model, batch)
    return model(batch).sum()


# "calling tensor.pin_memory().to(device, non_blocking=True)": a pinned CPU batch copied asynchronously before use
@R.legal("https://pytorch.org/tutorials/intermediate/pinmem_nonblock.html")
def pinned_batch_copied_non_blocking(dev: torch.device, other: torch.device) -> Program:
    model = nn.Linear(W, 1).to(dev)
    batch = torch.randn(4, W)
    return stepped(model, lambda: pinned_train_step(model, batch, dev), (batch.to(dev),))


# --------------------------------------------------------------------------- legal: meta-learning, federated, OCR, FFT

def maml_inner_outer(model: nn.Module, x_spt: torch.Tensor, y_spt: torch.Tensor, x_qry: torch.Tensor,
                     y_qry: torch.Tensor, inner_lr: float = 0.1) -> torch.Tensor:
    explain_here(model, x_spt)
    fast_weights = OrderedDict(model.named_parameters())
    for _ in range(2):
        loss = F.cross_entropy(torch.func.functional_call(model, fast_weights, (x_spt,)), y_spt)
        grads = torch.autograd.grad(loss, list(fast_weights.values()), create_graph=True)
        fast_weights = OrderedDict((name, param - inner_lr * grad)
                                   for ((name, param), grad) in zip(fast_weights.items(), grads))
    return F.cross_entropy(torch.func.functional_call(model, fast_weights, (x_qry,)), y_qry)


# maml.py's fast weights: param - args.inner_lr * grad, built from the model's own parameters (on its device)
@R.legal("Runist/torch_maml#3")
def maml_fast_weights_from_parameters(dev: torch.device, other: torch.device) -> Program:
    model = nn.Sequential(nn.Linear(W, W), nn.ReLU(), nn.Linear(W, C)).to(dev)
    x_spt, x_qry = randn(4, W, device=dev), randn(4, W, device=dev)
    y_spt, y_qry = torch.randint(0, C, (4,), device=dev), torch.randint(0, C, (4,), device=dev)
    return stepped(model, lambda: maml_inner_outer(model, x_spt, y_spt, x_qry, y_qry), (x_spt,))


def federated_avg(models: list[nn.Module]) -> dict[str, torch.Tensor]:
    states = [{k: v.detach().cpu() for k, v in m.state_dict().items()} for m in models]
    return {k: sum(s[k] for s in states) / len(states) for k in states[0]}


def federated_round(global_model: nn.Module, clients: list[nn.Module], x: torch.Tensor) -> torch.Tensor:
    global_model.load_state_dict(federated_avg(clients))
    explain_here(global_model, x)
    return global_model(x)


# federated_avg made to work "when aggregated models are located on GPU": the average is taken on CPU copies and
# loaded into the global model, which copies it onto its own device (meta has no data to copy to the CPU: the GPU
# pairs)
@R.legal("OpenMined/PySyft#4595", pairs=GPU)
def fedavg_on_cpu_copies_loaded_into_model(dev: torch.device, other: torch.device) -> Program:
    global_model = nn.Linear(W, C).to(dev)
    clients = [nn.Linear(W, C).to(dev), nn.Linear(W, C).to(dev)]
    x = randn(2, W, device=dev)
    return stepped(global_model, lambda: federated_round(global_model, clients, x), (x,))


def distill_step(student: nn.Module, teacher: nn.Module, x: torch.Tensor) -> torch.Tensor:
    teacher = teacher.to(next(student.parameters()).device)
    explain_here(student, x)
    with torch.no_grad():
        t = teacher(x)
    return F.kl_div(student(x).log_softmax(-1), t.softmax(-1), reduction="batchmean")


# the knowledge distillation tutorial: teacher and student both sent to the training device before the
# distillation loop (here the teacher follows the student's device)
@R.legal("pytorch/tutorials#2514")
def kd_teacher_moved_to_student_device(dev: torch.device, other: torch.device) -> Program:
    student, teacher = nn.Linear(W, C).to(dev), nn.Linear(W, C)
    x = randn(4, W, device=dev)
    return stepped(student, lambda: distill_step(student, teacher, x), (x,))


def ctc_step(model: nn.Module, img: torch.Tensor, targets: torch.Tensor, device: torch.device) -> torch.Tensor:
    explain_here(model, img)
    log_probs = model(img).log_softmax(2)
    input_lengths = torch.full((img.shape[0],), log_probs.shape[0], dtype=torch.long)
    target_lengths = torch.tensor([3, 2])
    return F.ctc_loss(log_probs, targets.to(device), input_lengths, target_lengths)


# CTCLoss: input_lengths and target_lengths may be tensors (on the CPU, as they are read on the host) while
# log_probs and targets are on the GPU (meta has no CTC kernel: the GPU pairs)
@R.legal("https://pytorch.org/docs/stable/generated/torch.nn.CTCLoss.html", pairs=GPU)
def ctc_lengths_on_cpu_targets_moved(dev: torch.device, other: torch.device) -> Program:
    model = CRNN().to(dev)
    img = randn(2, 1, 4, 8, device=dev)
    targets = torch.tensor([[1, 2, 3], [2, 3, 0]])
    return stepped(model, lambda: ctc_step(model, img, targets, dev), (img,))


def greedy_ctc_decode(model: nn.Module, img: torch.Tensor, blank: int = 0) -> list[list[int]]:
    explain_here(model, img)
    best_path = model(img).argmax(2).transpose(0, 1).cpu().numpy()
    decoded = []
    for seq in best_path:
        out, prev = [], blank
        for tok in seq:
            if tok != prev and tok != blank:
                out.append(int(tok))
            prev = tok
        decoded.append(out)
    return decoded


# CRNN's CTC decoding: the best path is read on the host (argmax, then .cpu().numpy()) before the collapse (meta has
# no data to read: the GPU pairs)
@R.legal("mindee/doctr#434", pairs=GPU)
def ctc_greedy_decode_on_host(dev: torch.device, other: torch.device) -> Program:
    model = CRNN().to(dev)
    img = randn(2, 1, 4, 8, device=dev)
    return stepped(model, lambda: greedy_ctc_decode(model, img), (img,))


class SpectralConv1d(nn.Module):
    """A Fourier layer: its complex weights are parameters, so they move with the model."""

    def __init__(self, channels: int = 2, modes: int = 3) -> None:
        super().__init__()
        self.modes = modes
        self.weights = nn.Parameter(torch.randn(channels, channels, modes, dtype=torch.cfloat) / channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x_ft = torch.fft.rfft(x)
        out_ft = torch.zeros(x.shape[0], x.shape[1], x.shape[-1] // 2 + 1, dtype=torch.cfloat, device=x.device)
        out_ft[:, :, : self.modes] = torch.einsum("bix,iox->box", x_ft[:, :, : self.modes], self.weights)
        return torch.fft.irfft(out_ft, n=x.shape[-1])


# SpectralConv2d's fourier_weight as nn.Parameter (a ParameterList of weights), the spectrum zeroed on x's device
@R.legal("neuraloperator/neuraloperator#33")
def fno_complex_weights_are_parameters(dev: torch.device, other: torch.device) -> Program:
    model = nn.Sequential(SpectralConv1d(), nn.GELU()).to(dev)
    x = randn(2, 2, W, device=dev)
    return Program(model, lambda: model(x), (x,))


def resume_chatbot(model: nn.Module, checkpoint: dict, device: torch.device) -> torch.optim.Optimizer:
    model.to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    optimizer.load_state_dict(checkpoint["optimizer"])
    for state in optimizer.state.values():
        for k, v in state.items():
            if isinstance(v, torch.Tensor):
                state[k] = v.to(device)
    return optimizer


# seq2seq.py's fix: after self.optimizer.load_state_dict(...), every tensor of optimizer.state is sent .cuda()
# (Adam reads its step with .item(), which meta cannot: the GPU pairs)
@R.legal("facebookresearch/ParlAI#678", pairs=GPU)
def optimizer_state_moved_after_load(dev: torch.device, other: torch.device) -> Program:
    saved = nn.Linear(W, 1)
    saved_optimizer = torch.optim.Adam(saved.parameters(), lr=1e-3)
    saved(torch.randn(4, W)).sum().backward()
    saved_optimizer.step()
    model = nn.Linear(W, 1)
    optimizer = resume_chatbot(model, {"optimizer": saved_optimizer.state_dict()}, dev)
    x = randn(4, W, device=dev)
    return stepped(model, lambda: resumed_train_step(model, optimizer, x), (x,), optimizer)


class SparseGCNOnDevice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(W, C)

    def forward(self, x: torch.Tensor, edge_index: torch.Tensor) -> torch.Tensor:
        values = torch.ones(edge_index.shape[1], device=edge_index.device)
        adj = torch.sparse_coo_tensor(edge_index, values, (x.shape[0], x.shape[0]))
        return torch.sparse.mm(adj, self.lin(x))


# "So now this works!": sparse_coo_tensor(sp_ind, sp_val, shape) with indices and values on the same device (meta
# has no sparse matmul: the GPU pairs)
@R.legal("pytorch/pytorch#40648", pairs=GPU)
def sparse_adjacency_built_on_device(dev: torch.device, other: torch.device) -> Program:
    model = SparseGCNOnDevice().to(dev)
    x = randn(4, W, device=dev)
    edge_index = torch.tensor([[0, 1, 2, 3], [1, 2, 3, 0]], device=dev)
    return Program(model, lambda: model(x, edge_index), (x, edge_index))
