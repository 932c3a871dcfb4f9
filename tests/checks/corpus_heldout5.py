"""HELD OUT: device mistakes and legal device patterns from other projects' public reports (LLM fine-tuning,
vision transformers and segmentation, point clouds and 3D, GANs, contrastive learning, optimizers, distributions,
metrics, custom losses, knowledge distillation and EMA, graphs), kept from anyone changing the diagnosis (issue
31). Do not read this file while working on torchplace.checks or torchplace.memory, do not score it while doing so,
and do not add it to any test that runs by default: the lead scores it ONCE, at the end, with
`torchplace bench diagnose --corpus tests/checks/corpus_heldout5.py` (on the CPU and on GPUs), and records the
number. Its reports are different from those of every other corpus here (tests/checks/test_corpus_public.py checks
it).

Same shape as corpus_heldout4.py (see corpus_kit.py): each case cites its public source (owner/repo#number or a
documentation page), a mistake names what a report must contain (culprit, as the user wrote it), its module path
(from the user's own variable; None where the failing code runs outside any module's forward) and the user's line
(the line ending in `# case: NAME`); a legal pattern must raise nothing in any mode. On the CPU the pair is meta
(where the model runs) vs cpu (where a factory without a device lands); a case that only a real accelerator refuses
(meta kernels let matmul, convolution, embedding lookups, clamp bounds, in-place updates and indexing mix devices)
lists the GPU pairs only, and a case about two GPUs (`.cuda()` or device="cuda" meaning the current GPU, 0, while
the model sits on another) the cuda:1 vs cuda:0 pair only.

Every case was checked with plain torch (no torchplace) when written, with tools/corpus_plain_check.py: on cpu vs
meta each mistake raises torch's device error at its `# case:` line and each legal pattern runs. The GPU-only ones
were checked against torch's documented rules and the report's own traceback; fake cuda tensors (FakeTensorMode)
could model only the in-place metric update here, as moving a module onto a fake cuda device fails in a CPU-only
build of torch.
"""

from __future__ import annotations

import copy
import math
import sys
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


# --------------------------------------------------------------------------- mistakes: vision transformers

class PositionEmbedding:
    """FOD's sine position embedding: the table is built on the CPU and sent to .cuda(), the current GPU."""

    def __init__(self, dim: int, num_patches: int) -> None:
        self.dim, self.num_patches = dim, num_patches

    def __call__(self) -> torch.Tensor:
        position = torch.arange(self.num_patches, dtype=torch.float32)[:, None]
        div_term = torch.exp(torch.arange(0, self.dim, 2).float() * (-math.log(10000.0) / self.dim))
        pos_embed = torch.zeros(self.num_patches, self.dim)
        pos_embed[:, 0::2] = torch.sin(position * div_term)
        pos_embed[:, 1::2] = torch.cos(position * div_term)
        return pos_embed.cuda()


class FODTransformer(nn.Module):
    def __init__(self, num_patches: int = 4) -> None:
        super().__init__()
        self.input_proj = nn.Linear(W, W)
        self.pos_embed = PositionEmbedding(W, num_patches)
        self.head = nn.Linear(W, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.input_proj(x)
        x = x + self.pos_embed()  # case: fod_pos_embed_cuda
        return self.head(x)


# "when I wanted to run the project in cuda:2 ... the problem is at pos_embed.cuda() of PositionEmbedding"
@R.mistake("xcyao00/FOD#1", ("pos_embed", ".cuda()"), "model", pairs=TWO_GPUS)
def fod_pos_embed_cuda(dev: torch.device, other: torch.device) -> Program:
    model = FODTransformer().to(dev)
    x = randn(2, 4, W, device=dev)
    return Program(model, lambda: model(x), (x,))


class WindowAttention(nn.Module):
    """Swin Transformer V2's window attention: the cosine attention's logit scale is clamped by a CPU tensor."""

    def __init__(self, dim: int, num_heads: int = 2) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(dim, dim * 3, bias=False)
        self.logit_scale = nn.Parameter(torch.log(10 * torch.ones((num_heads, 1, 1))), requires_grad=True)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B_, N, C_ = x.shape
        qkv = self.qkv(x).reshape(B_, N, 3, self.num_heads, C_ // self.num_heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        attn = F.normalize(q, dim=-1) @ F.normalize(k, dim=-1).transpose(-2, -1)
        logit_scale = torch.clamp(self.logit_scale, max=torch.log(torch.tensor(1. / 0.01)))  # case: swinv2_clamp_max
        logit_scale = logit_scale.exp()
        attn = (attn * logit_scale).softmax(dim=-1)
        return self.proj((attn @ v).transpose(1, 2).reshape(B_, N, C_))


class SwinTransformerBlock(nn.Module):
    def __init__(self, dim: int = W) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = WindowAttention(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.norm1(self.attn(x))


class SwinTransformerV2(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.patch_embed = nn.Linear(3, W)
        self.layers = nn.ModuleList([SwinTransformerBlock()])
        self.head = nn.Linear(W, C)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x.mean(1))


# swin_transformer_v2.py on cuda: "argument max in method wrapper_CUDA_clamp_Tensor" (a 0-dim CPU bound that clamp
# does not take as a scalar; meta lets clamp take it)
@R.mistake("microsoft/Swin-Transformer#377", ("max", "torch.tensor"), "model.layers.0.attn", pairs=GPU)
def swinv2_clamp_max(dev: torch.device, other: torch.device) -> Program:
    model = SwinTransformerV2().to(dev)
    x = randn(2, 4, 3, device=dev)
    return Program(model, lambda: model(x), (x,))


class SpatialAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Sequential(nn.Conv2d(2, 1, kernel_size=(1, 1), stride=1), nn.BatchNorm2d(1), nn.ReLU())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, H, W_, C_ = x.shape
        x = x.view(B, C_, H, W_)
        x = torch.cat((torch.max(x, 1)[0].unsqueeze(1), torch.mean(x, 1).unsqueeze(1)), 1)
        x = self.conv(x)  # case: tokenlearner_tokenizers_plain_list
        return torch.sigmoid(x).view(B, H, W_, 1)


class TokenLearner(nn.Module):
    """tokenlearner-pytorch: the S spatial attentions are kept in a plain list, so .to() never sees them."""

    def __init__(self, S: int = 2) -> None:
        super().__init__()
        self.S = S
        self.tokenizers = [SpatialAttention() for _ in range(S)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = [(self.tokenizers[i](x) * x).sum(dim=(1, 2)) for i in range(self.S)]
        return torch.stack(tokens, dim=1)


class TokenLearnerViT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.patch_embed = nn.Linear(3, W)
        self.token_learner = TokenLearner()
        self.head = nn.Linear(W, C)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.token_learner(self.patch_embed(x)).mean(1))


# "self.tokenizers = [SpatialAttention() for _ in range(S)] -> nn.ModuleList([...])"; a plain list is no module path,
# so the path is what the code indexes, tokenizers[0], as the shipped corpus's blocks[0] of tokenlearner-pytorch#5
@R.mistake("rish-16/tokenlearner-pytorch#4", "tokenizers", "model.token_learner.tokenizers[0]")
def tokenlearner_tokenizers_plain_list(dev: torch.device, other: torch.device) -> Program:
    model = TokenLearnerViT().to(dev)
    x = randn(2, 4, 4, 3, device=dev)
    return Program(model, lambda: model(x), (x,))


# --------------------------------------------------------------------------- mistakes: segmentation and faces

def make_one_hot(labels: torch.Tensor, classes: int) -> torch.Tensor:
    one_hot = torch.FloatTensor(labels.size()[0], classes, labels.size()[2], labels.size()[3]).zero_().cuda()
    target = one_hot.scatter_(1, labels.data, 1)  # case: segmentation_make_one_hot_cuda
    return target


class DiceLoss(nn.Module):
    def __init__(self, smooth: float = 1.0) -> None:
        super().__init__()
        self.smooth = smooth

    def forward(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        target = make_one_hot(target.unsqueeze(dim=1), classes=output.size()[1])
        output = F.softmax(output, dim=1)
        intersection = (output * target).sum()
        return 1 - (2.0 * intersection + self.smooth) / (output.sum() + target.sum() + self.smooth)


def segmentation_step(model: nn.Module, criterion: nn.Module, img: torch.Tensor, aff_cls: torch.Tensor) -> torch.Tensor:
    explain_here(model, img)
    output = model(img)
    return criterion(output, aff_cls.long())


# pytorch-segmentation's dice loss on a second GPU: make_one_hot() sends the one-hot target to .cuda() (GPU 0)
# while the labels are on the training GPU ("arguments are located on different GPUs")
@R.mistake("yassouali/pytorch-segmentation#80", ("one_hot", ".cuda()"), "criterion", pairs=TWO_GPUS)
def segmentation_make_one_hot_cuda(dev: torch.device, other: torch.device) -> Program:
    model = nn.Conv2d(3, C, 1).to(dev)
    criterion = DiceLoss()
    img, aff_cls = randn(2, 3, 4, 4, device=dev), torch.randint(0, C, (2, 4, 4), device=dev)
    return stepped(model, lambda: segmentation_step(model, criterion, img, aff_cls), (img,))


class CosFace(nn.Module):
    """Face-Transformer's CosFace head: the one-hot label mask is made on device='cuda', the current GPU."""

    def __init__(self, in_features: int, out_features: int, s: float = 64.0, m: float = 0.35) -> None:
        super().__init__()
        self.s, self.m = s, m
        self.weight = nn.Parameter(torch.randn(out_features, in_features))

    def forward(self, input: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
        cosine = F.linear(F.normalize(input), F.normalize(self.weight))
        phi = cosine - self.m
        one_hot = torch.zeros(cosine.size(), device="cuda")
        one_hot.scatter_(1, label.view(-1, 1).long(), 1)  # case: face_transformer_one_hot_device_cuda
        return (one_hot * phi + (1.0 - one_hot) * cosine) * self.s


class ViTFace(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Linear(W, W)
        self.loss = CosFace(W, C)

    def forward(self, img: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
        return self.loss(self.backbone(img), label)


# Face-Transformer trained on GPU 1: "cuda:0 and cuda:1 (when checking argument for argument index in method
# wrapper_CUDA_scatter__value)"
@R.mistake("zhongyy/Face-Transformer#37", ("one_hot", "torch.zeros"), "model.loss", pairs=TWO_GPUS)
def face_transformer_one_hot_device_cuda(dev: torch.device, other: torch.device) -> Program:
    model = ViTFace().to(dev)
    img, label = randn(4, W, device=dev), torch.randint(0, C, (4,), device=dev)
    return Program(model, lambda: model(img, label), (img, label))


class AnchorGenerator:
    """mmdet's anchor generator, shortened: grid_priors() makes its anchors on `device`, "cuda" unless given."""

    def __init__(self, strides: list[int]) -> None:
        self.strides = strides

    def grid_priors(self, featmap_sizes: list[torch.Size], device: str | torch.device = "cuda") -> list[torch.Tensor]:
        anchors = []
        for (h, w), stride in zip(featmap_sizes, self.strides):
            shift_x = torch.arange(0, w, device=device) * stride
            shift_y = torch.arange(0, h, device=device) * stride
            yy, xx = torch.meshgrid(shift_y, shift_x, indexing="ij")
            centers = torch.stack([xx.reshape(-1), yy.reshape(-1)], dim=-1).float()
            anchors.append(torch.cat([centers - stride, centers + stride], dim=-1))
        return anchors


class FreeAnchorRetinaHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.retina_cls = nn.Conv2d(W, C, 1)
        self.retina_reg = nn.Conv2d(W, 4, 1)
        self.prior_generator = AnchorGenerator([8])

    def forward(self, feats: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        return [self.retina_cls(feats)], [self.retina_reg(feats)]

    def loss(self, cls_scores: list[torch.Tensor], bbox_preds: list[torch.Tensor]) -> torch.Tensor:
        featmap_sizes = [featmap.size()[-2:] for featmap in cls_scores]
        anchor_list = self.prior_generator.grid_priors(featmap_sizes)
        anchors = torch.cat(anchor_list)
        bbox_preds = torch.cat([b.permute(0, 2, 3, 1).reshape(b.size(0), -1, 4) for b in bbox_preds], dim=1)
        pred_boxes = anchors[None] + bbox_preds * 8  # case: free_anchor_anchors_on_gpu0
        return pred_boxes.abs().mean() + cls_scores[0].sigmoid().mean()


def retina_step(bbox_head: FreeAnchorRetinaHead, feats: torch.Tensor) -> torch.Tensor:
    explain_here(bbox_head, feats)
    cls_scores, bbox_preds = bbox_head(feats)
    return bbox_head.loss(cls_scores, bbox_preds)


# Free Anchor RetinaNet trained on GPU 2: the anchors land on cuda:0, the predicted boxes on cuda:2
@R.mistake("open-mmlab/mmdetection#7521", ("anchors", "grid_priors"), pairs=TWO_GPUS)
def free_anchor_anchors_on_gpu0(dev: torch.device, other: torch.device) -> Program:
    bbox_head = FreeAnchorRetinaHead().to(dev)
    feats = randn(1, W, 2, 2, device=dev)
    return stepped(bbox_head, lambda: retina_step(bbox_head, feats), (feats,))


class PointAssigner:
    """mmdet's PointAssigner, shortened: each gt box is given the points of its pyramid level."""

    def __init__(self, scale: int = 4) -> None:
        self.scale = scale

    def assign(self, points: torch.Tensor, gt_bboxes: torch.Tensor) -> torch.Tensor:
        num_points = points.shape[0]
        points_stride = points[:, 2]
        points_lvl = torch.log2(points_stride).int()
        gt_bboxes_wh = (gt_bboxes[:, 2:] - gt_bboxes[:, :2]).clamp(min=1e-6)
        gt_bboxes_lvl = ((torch.log2(gt_bboxes_wh[:, 0] / self.scale)
                          + torch.log2(gt_bboxes_wh[:, 1] / self.scale)) / 2).int()
        gt_bboxes_lvl = torch.clamp(gt_bboxes_lvl, min=points_lvl.min(), max=points_lvl.max())
        assigned_gt_inds = points.new_zeros((num_points,), dtype=torch.long)
        points_range = torch.arange(points.shape[0])
        for idx in range(gt_bboxes.shape[0]):
            lvl_idx = gt_bboxes_lvl[idx] == points_lvl
            points_index = points_range[lvl_idx]  # case: point_assigner_points_range_on_cpu
            assigned_gt_inds[points_index] = idx + 1
        return assigned_gt_inds


class RepPointsHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.reppoints_cls_out = nn.Conv2d(W, C, 1)
        self.point_assigner = PointAssigner()

    def forward(self, feats: torch.Tensor) -> torch.Tensor:
        return self.reppoints_cls_out(feats)

    def loss(self, cls_out: torch.Tensor, points: torch.Tensor, gt_bboxes: torch.Tensor) -> torch.Tensor:
        assigned = self.point_assigner.assign(points, gt_bboxes)
        return F.cross_entropy(cls_out.flatten(2).transpose(1, 2)[0], assigned.clamp(max=C - 1))


def reppoints_step(bbox_head: RepPointsHead, feats: torch.Tensor, points: torch.Tensor,
                   gt_bboxes: torch.Tensor) -> torch.Tensor:
    explain_here(bbox_head, feats)
    return bbox_head.loss(bbox_head(feats), points, gt_bboxes)


# training RepPoints: "indices should be either on cpu or on the same device as the indexed tensor (cpu)" at
# points_index = points_range[lvl_idx] (meta has no boolean-mask indexing to check)
@R.mistake("open-mmlab/mmdetection#10436", ("points_range", "torch.arange"), pairs=GPU)
def point_assigner_points_range_on_cpu(dev: torch.device, other: torch.device) -> Program:
    bbox_head = RepPointsHead().to(dev)
    feats = randn(1, W, 2, 2, device=dev)
    points = torch.tensor([[0.0, 0.0, 8.0], [8.0, 0.0, 8.0], [0.0, 8.0, 16.0], [8.0, 8.0, 16.0]], device=dev)
    gt_bboxes = torch.tensor([[0.0, 0.0, 32.0, 32.0]], device=dev)
    return stepped(bbox_head, lambda: reppoints_step(bbox_head, feats, points, gt_bboxes), (feats,))


# --------------------------------------------------------------------------- mistakes: point clouds and 3D

class GenScore(nn.Module):
    """GenScore's protein-ligand scorer, shortened: pairwise features masked by the distance cutoff on the GPU, the
    batch index of each pair from torch.tensor(range(B)) on the CPU."""

    def __init__(self, dist_threhold: float = 2.0) -> None:
        super().__init__()
        self.lig_model = nn.Linear(3, W)
        self.prot_model = nn.Linear(3, W)
        self.MLP = nn.Linear(2 * W, 3)
        self.dist_threhold = dist_threhold

    def forward(self, pos_l: torch.Tensor, pos_t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        B, N_l, N_t = pos_l.shape[0], pos_l.shape[1], pos_t.shape[1]
        h_l, h_t = self.lig_model(pos_l), self.prot_model(pos_t)
        C_ = torch.cat((h_l.unsqueeze(-2).repeat(1, 1, N_t, 1), h_t.unsqueeze(-3).repeat(1, N_l, 1, 1)), -1)
        dist = torch.cdist(pos_l, pos_t)
        C_mask = dist < self.dist_threhold
        C_ = C_[C_mask]
        C_batch = torch.tensor(range(B)).unsqueeze(-1).unsqueeze(-1)
        C_batch = C_batch.repeat(1, N_l, N_t)[C_mask]  # case: genscore_c_batch_on_cpu
        return self.MLP(C_), C_batch


# GenScore on a CUDA install: C_batch.repeat(1, N_l, N_t)[C_mask] -> "indices should be either on cpu or on the
# same device as the indexed tensor (cpu)" (meta has no boolean-mask indexing to check)
@R.mistake("sc8668/GenScore#16", ("C_batch", "torch.tensor"), "model", pairs=GPU)
def genscore_c_batch_on_cpu(dev: torch.device, other: torch.device) -> Program:
    model = GenScore().to(dev)
    pos_l, pos_t = randn(2, 3, 3, device=dev), randn(2, 4, 3, device=dev)
    return Program(model, lambda: model(pos_l, pos_t), (pos_l, pos_t))


class NeuSDataset:
    """NeuRIS' dataset: the images are kept on the CPU; exp_runner.py sets the default tensor type to CUDA, so the
    pixel coordinates drawn with torch.randint land on the GPU."""

    def __init__(self, images: np.ndarray) -> None:
        self.images = torch.from_numpy(images.astype(np.float32)).cpu()
        self.H, self.W = images.shape[1], images.shape[2]

    def random_get_rays_at(self, img_idx: int, batch_size: int) -> torch.Tensor:
        pixels_x = torch.randint(low=0, high=self.W, size=[batch_size])
        pixels_y = torch.randint(low=0, high=self.H, size=[batch_size])
        color = self.images[img_idx][(pixels_y, pixels_x)]  # case: neuris_images_on_cpu_default_cuda
        return color


class NeuSRenderer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.color_network = nn.Linear(3, 3)

    def forward(self, rays: torch.Tensor) -> torch.Tensor:
        return self.color_network(rays)


def neus_train_step(renderer: nn.Module, dataset: NeuSDataset, device: torch.device) -> torch.Tensor:
    explain_here(renderer, torch.rand(4, 3, device=device))
    with torch.device(device):  # the runner's torch.set_default_tensor_type('torch.cuda.FloatTensor')
        true_rgb = dataset.random_get_rays_at(0, 4)
        return F.l1_loss(renderer(torch.rand(4, 3)), true_rgb)


# NeuRIS' random_get_rays_at(): self.images[img_idx][(pixels_y, pixels_x)] with the images on the CPU and the
# pixels made on the default CUDA device (meta lets a CPU tensor take meta indices)
@R.mistake("jiepengwang/NeuRIS#34", ("pixels_y", "pixels_x", "images"), pairs=GPU)
def neuris_images_on_cpu_default_cuda(dev: torch.device, other: torch.device) -> Program:
    renderer = NeuSRenderer().to(dev)
    dataset = NeuSDataset(np.random.rand(1, 4, 4, 3))
    return stepped(renderer, lambda: neus_train_step(renderer, dataset, dev), (torch.rand(4, 3, device=dev),))


class BasicPBC(nn.Module):
    """BasicPBC's line-art colorization matcher, shortened: the area accuracy indexes a torch.arange() made on the
    CPU with a mask computed on the GPU."""

    def __init__(self) -> None:
        super().__init__()
        self.desc = nn.Linear(3, W)

    def forward(self, feats0: torch.Tensor, feats1: torch.Tensor, segment: torch.Tensor,
                all_matches_origin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = self.desc(feats0) @ self.desc(feats1).transpose(-1, -2)
        indices0 = scores.argmax(-1)
        n = all_matches_origin[0].shape[0]
        matched = torch.arange(0, n)[all_matches_origin[0] == indices0[0]]  # case: basicpbc_arange_gpu_mask
        area_accuracy = torch.tensor([(segment == ii + 1).sum() for ii in matched]).sum()
        return scores, area_accuracy


# "torch.arange() will create tensors on CPU by default": torch.arange(...)[all_matches_origin[0] == indices0[0]]
# fails once the model runs on the GPU (meta has no boolean-mask indexing to check)
@R.mistake("ykdai/BasicPBC#4", "torch.arange", "model", pairs=GPU)
def basicpbc_arange_gpu_mask(dev: torch.device, other: torch.device) -> Program:
    model = BasicPBC().to(dev)
    feats0, feats1 = randn(1, 4, 3, device=dev), randn(1, 4, 3, device=dev)
    segment, all_matches_origin = torch.randint(0, 4, (8, 8), device=dev), torch.randint(0, 4, (1, 4), device=dev)
    return Program(model, lambda: model(feats0, feats1, segment, all_matches_origin), (feats0, feats1))


# --------------------------------------------------------------------------- mistakes: GANs

class Generator(nn.Module):
    def __init__(self, latent_dim: int = 4, img_dim: int = 16) -> None:
        super().__init__()
        self.fc1 = nn.Linear(latent_dim, W)
        self.fc2 = nn.Linear(W, img_dim)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc2(F.leaky_relu(self.fc1(z), 0.2)))


class Discriminator(nn.Module):
    def __init__(self, img_dim: int = 16) -> None:
        super().__init__()
        self.fc1 = nn.Linear(img_dim, W)
        self.fc2 = nn.Linear(W, 1)

    def forward(self, img: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.fc2(F.leaky_relu(self.fc1(img.view(img.size(0), -1)), 0.2)))


class BasicGAN(nn.Module):
    """lightning-bolts' BasicGAN (a LightningModule), shortened: the real/fake targets are made without a device."""

    def __init__(self, latent_dim: int = 4) -> None:
        super().__init__()
        self.latent_dim = latent_dim
        self.generator = Generator(latent_dim)
        self.discriminator = Discriminator()

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.generator(z)

    def adversarial_loss(self, y_hat: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.binary_cross_entropy(y_hat, y)  # case: basic_gan_targets_on_cpu

    def discriminator_loss(self, x: torch.Tensor) -> torch.Tensor:
        b = x.size(0)
        x_real = x.view(b, -1)
        y_real = torch.ones(b, 1)
        D_real_loss = self.adversarial_loss(self.discriminator(x_real), y_real)
        z = torch.randn(b, self.latent_dim, device=x.device)
        y_fake = torch.zeros(b, 1)
        D_fake_loss = self.adversarial_loss(self.discriminator(self(z).detach()), y_fake)
        return D_real_loss + D_fake_loss

    def training_step(self, batch: torch.Tensor) -> torch.Tensor:
        return self.discriminator_loss(batch)


def lightning_step(model: BasicGAN, batch: torch.Tensor) -> torch.Tensor:
    explain_here(model, torch.randn(batch.size(0), model.latent_dim, device=batch.device))
    return model.training_step(batch)


# `python demo.py --gpus 1` with BasicGAN: "Expected object of device type cuda but got device type cpu for argument
# #2 'target'" in adversarial_loss
@R.mistake("Lightning-Universe/lightning-bolts#30", ("y_real", "torch.ones"))
def basic_gan_targets_on_cpu(dev: torch.device, other: torch.device) -> Program:
    model = BasicGAN().to(dev)
    batch = randn(4, 1, 4, 4, device=dev)
    return stepped(model, lambda: lightning_step(model, batch), (torch.randn(4, 4, device=dev),))


class Critic(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.disc = nn.Sequential(nn.Conv2d(1, W, 3, padding=1), nn.LeakyReLU(0.2), nn.Flatten(), nn.Linear(W * 16, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.disc(x)


def gradient_penalty(critic: nn.Module, real: torch.Tensor, fake: torch.Tensor, device: str = "cpu") -> torch.Tensor:
    BATCH_SIZE, C_, H, W_ = real.shape
    alpha = torch.rand((BATCH_SIZE, 1, 1, 1)).repeat(1, C_, H, W_)
    interpolated_images = real * alpha + fake * (1 - alpha)  # case: wgan_gp_alpha_on_cpu
    mixed_scores = critic(interpolated_images)
    gradient = torch.autograd.grad(inputs=interpolated_images, outputs=mixed_scores,
                                   grad_outputs=torch.ones_like(mixed_scores), create_graph=True, retain_graph=True)[0]
    gradient = gradient.view(gradient.shape[0], -1)
    return torch.mean((gradient.norm(2, dim=1) - 1) ** 2)


def wgan_critic_step(gen: nn.Module, critic: nn.Module, real: torch.Tensor, noise: torch.Tensor,
                     device: torch.device) -> torch.Tensor:
    explain_here(critic, real)
    fake = gen(noise).view(real.shape)
    critic_real, critic_fake = critic(real).reshape(-1), critic(fake).reshape(-1)
    gp = gradient_penalty(critic, real, fake, device=device)
    return -(torch.mean(critic_real) - torch.mean(critic_fake)) + 10 * gp


# the WGAN-GP utils.py: "i think you forget take to(device) on alpha" (the device argument is passed, never used)
@R.mistake("aladdinpersson/Machine-Learning-Collection#58", "alpha")
def wgan_gp_alpha_on_cpu(dev: torch.device, other: torch.device) -> Program:
    gen, critic = Generator().to(dev), Critic().to(dev)
    real, noise = randn(2, 1, 4, 4, device=dev), randn(2, 4, device=dev)
    return stepped(critic, lambda: wgan_critic_step(gen, critic, real, noise, dev), (real,))


# --------------------------------------------------------------------------- mistakes: distributions

class TruncatedStandardNormal:
    """torch_truncnorm's TruncatedStandardNormal, shortened: rsample() draws its uniforms with torch.empty(shape)."""

    def __init__(self, a: torch.Tensor, b: torch.Tensor) -> None:
        self.a, self.b = a, b
        self._dtype_min_gt_0 = torch.finfo(a.dtype).eps
        self._dtype_max_lt_1 = 1 - torch.finfo(a.dtype).eps
        self._big_phi_a, self._big_phi_b = self._big_phi(a), self._big_phi(b)
        self._Z = (self._big_phi_b - self._big_phi_a).clamp_min(self._dtype_min_gt_0)

    @staticmethod
    def _big_phi(x: torch.Tensor) -> torch.Tensor:
        return 0.5 * (1 + (x / math.sqrt(2)).erf())

    @staticmethod
    def _inv_big_phi(x: torch.Tensor) -> torch.Tensor:
        return math.sqrt(2) * (2 * x - 1).erfinv()

    def icdf(self, value: torch.Tensor) -> torch.Tensor:
        return self._inv_big_phi(self._big_phi_a + value * self._Z)  # case: truncnorm_rsample_uniforms_on_cpu

    def rsample(self, sample_shape: tuple[int, ...] = ()) -> torch.Tensor:
        shape = torch.Size(sample_shape) + self.a.shape
        p = torch.empty(shape).uniform_(self._dtype_min_gt_0, self._dtype_max_lt_1)
        return self.icdf(p)


class TruncatedNormal(TruncatedStandardNormal):
    def __init__(self, loc: torch.Tensor, scale: torch.Tensor, a: float, b: float) -> None:
        self.loc, self.scale = loc, scale
        super().__init__((a - loc) / scale, (b - loc) / scale)

    def rsample(self, sample_shape: tuple[int, ...] = ()) -> torch.Tensor:
        return super().rsample(sample_shape) * self.scale + self.loc


class Actor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(W, 2 * 2)

    def forward(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        loc, log_scale = self.net(obs).chunk(2, dim=-1)
        return torch.tanh(loc), log_scale.exp()


def act(actor: nn.Module, obs: torch.Tensor) -> torch.Tensor:
    explain_here(actor, obs)
    loc, scale = actor(obs)
    return TruncatedNormal(loc, scale, -1.0, 1.0).rsample()


# "a new tensor is created and will be defaultly located on cpu ... When the loc and scale are from cuda, error
# will occur in icdf()"
@R.mistake("toshas/torch_truncnorm#2", ("p", "torch.empty"))
def truncnorm_rsample_uniforms_on_cpu(dev: torch.device, other: torch.device) -> Program:
    actor = Actor().to(dev)
    obs = randn(3, W, device=dev)
    return stepped(actor, lambda: act(actor, obs), (obs,))


class AffineAutoregressive(nn.Module):
    """A flowtorch-style bijector: its parameters move with .to(device), the base distribution it is paired with
    does not."""

    def __init__(self, dim: int = 2) -> None:
        super().__init__()
        self.hypernet = nn.Linear(dim, 2 * dim)

    def inverse(self, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mean, log_scale = self.hypernet(torch.zeros_like(y)).chunk(2, dim=-1)
        return (y - mean) * torch.exp(-log_scale), -log_scale.sum(-1)


class Flow:
    def __init__(self, base_dist: torch.distributions.Distribution, bijector: nn.Module) -> None:
        self.base_dist, self.bijector = base_dist, bijector

    def log_prob(self, value: torch.Tensor) -> torch.Tensor:
        x, log_det = self.bijector.inverse(value)
        return self.base_dist.log_prob(x).sum(-1) + log_det  # case: flowtorch_base_dist_on_cpu


def flow_fit_step(bijector: nn.Module, dist_y: Flow, data: torch.Tensor, device: torch.device) -> torch.Tensor:
    data = data.to(device)
    explain_here(bijector, data)
    return -dist_y.log_prob(data).mean()


# `loss = -dist_y.log_prob(data).mean()` with data.to(device): "Do we need to register data as buffer?" (the base
# distribution is built from CPU tensors; validate_args off, as for speed in a training loop)
@R.mistake("facebookincubator/flowtorch#110", "base_dist")
def flowtorch_base_dist_on_cpu(dev: torch.device, other: torch.device) -> Program:
    bijector = AffineAutoregressive().to(dev)
    base_dist = torch.distributions.Normal(torch.zeros(2), torch.ones(2), validate_args=False)
    dist_y = Flow(base_dist, bijector)
    data = torch.randn(8, 2)
    return stepped(bijector, lambda: flow_fit_step(bijector, dist_y, data, dev), (data.to(dev),))


# --------------------------------------------------------------------------- mistakes: optimizers and NAS

class DiagonalShampoo(torch.optim.Optimizer):
    """A SIRFShampoo-style optimizer, shortened: its pre-conditioners live in an attribute, not in self.state, and
    load_state_dict() restores them as loaded (Optimizer.load_state_dict casts only self.state to the params)."""

    STATE_ATTRIBUTES = ("preconditioner", "global_step")

    def __init__(self, params, lr: float = 1e-3, beta2: float = 0.01) -> None:
        super().__init__(params, dict(lr=lr, beta2=beta2))
        self.global_step = 0
        self.preconditioner = [[torch.ones_like(p) for p in group["params"]] for group in self.param_groups]

    def state_dict(self) -> dict:
        state = super().state_dict()
        for name in self.STATE_ATTRIBUTES:
            state[name] = getattr(self, name)
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        state_dict = dict(state_dict)
        for name in self.STATE_ATTRIBUTES:
            setattr(self, name, state_dict.pop(name))
        super().load_state_dict(state_dict)

    @torch.no_grad()
    def step(self, closure=None) -> None:
        for group, precs in zip(self.param_groups, self.preconditioner):
            for i, (p, K) in enumerate(zip(group["params"], precs)):
                beta2 = group["beta2"]
                precs[i] = (1 - beta2) * K + beta2 * p.grad.square()  # case: shampoo_prec_on_cpu
                p.add_(p.grad / (precs[i] + 1e-8).sqrt(), alpha=-group["lr"])
        self.global_step += 1


class DebugNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.factor = nn.Parameter(torch.randn(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.factor * x


def resume_step(model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor) -> None:
    explain_here(model, x, optimizer=optimizer)
    y = model(x)
    loss = (y - x).pow(2).sum()
    loss.backward()
    optimizer.step()


# checkpoint = torch.load(checkpoint_fname, map_location="cpu"); optimizer.load_state_dict(...): the next step
# "will error now" (the checkpoint here is the one a CPU run wrote, as map_location="cpu" leaves it)
@R.mistake("f-dangel/sirfshampoo#34", ("K", "preconditioner"))
def shampoo_prec_on_cpu(dev: torch.device, other: torch.device) -> Program:
    saved_model = DebugNet()
    saved_optimizer = DiagonalShampoo(saved_model.parameters())
    saved_model(torch.randn(10)).pow(2).sum().backward()
    saved_optimizer.step()
    checkpoint = {"model_state": saved_model.state_dict(), "optimizer_state_dict": saved_optimizer.state_dict()}
    model = DebugNet().to(dev)
    optimizer = DiagonalShampoo(model.parameters())
    optimizer.load_state_dict(checkpoint["optimizer_state_dict"])
    x = randn(10, device=dev)
    return stepped(model, lambda: resume_step(model, optimizer, x), (x,), optimizer)


class MixedOp(nn.Module):
    def __init__(self, C_: int) -> None:
        super().__init__()
        self._ops = nn.ModuleList([nn.Linear(C_, C_), nn.Identity()])

    def forward(self, x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return sum(w * op(x) for w, op in zip(weights, self._ops))  # case: pc_darts_alphas_cuda_dataparallel


class Network(nn.Module):
    """PC-DARTS' search network: the architecture weights are plain tensors made with .cuda(), so DataParallel's
    replica on another GPU still reads them from GPU 0."""

    def __init__(self, C_: int = W, steps: int = 2) -> None:
        super().__init__()
        self.stem = nn.Linear(C_, C_)
        self.cells = nn.ModuleList([MixedOp(C_) for _ in range(steps)])
        self._initialize_alphas(steps)

    def _initialize_alphas(self, k: int, num_ops: int = 2) -> None:
        self.alphas_normal = (1e-3 * torch.randn(k, num_ops)).cuda().requires_grad_(True)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        s = self.stem(input)
        weights = F.softmax(self.alphas_normal, dim=-1)
        for i, cell in enumerate(self.cells):
            s = cell(s, weights[i])
        return s


# PC-DARTS searched on two GPUs: "cuda:0 and cuda:1!" in MixedOp's `sum(w * op(xtemp) ...)`; here the replica on
# GPU 1 is the model moved to cuda:1 while alphas_normal stays where .cuda() put it
@R.mistake("yuhuixu1993/PC-DARTS#57", ("weights", "alphas_normal"), "model.cells.0", pairs=TWO_GPUS)
def pc_darts_alphas_cuda_dataparallel(dev: torch.device, other: torch.device) -> Program:
    model = Network().to(dev)
    input = randn(2, W, device=dev)
    return Program(model, lambda: model(input), (input,))


class BinaryQuantize(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input: torch.Tensor, k: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(input, k, t)
        return torch.sign(input)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        input, k, t = ctx.saved_tensors
        grad_input = k * t * (1 - torch.pow(torch.tanh(input * t), 2)) * grad_output  # case: ir_net_k_t_on_gpu0
        return grad_input, None, None


class IRConv2d(nn.Conv2d):
    """IR-Net's binarized convolution: k and t are plain attributes the training loop sets with .cuda()."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.k = torch.tensor([10.0]).float()
        self.t = torch.tensor([0.1]).float()

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        bw = BinaryQuantize.apply(self.weight, self.k, self.t)
        return F.conv2d(input, bw, self.bias, self.stride, self.padding)


def ir_net_train_step(model: nn.Module, conv_modules: list[IRConv2d], images: torch.Tensor, target: torch.Tensor,
                      epoch: int, epochs: int = 10) -> None:
    t = torch.tensor([0.1 * (10 ** (epoch / epochs))]).float()
    k = torch.max(1 / t, torch.tensor(1.)).float()
    for module in conv_modules:
        module.k = k.cuda()
        module.t = t.cuda()
    explain_here(model, images)
    F.cross_entropy(model(images), target).backward()


# IR-Net under DataParallel: "input in device1 and k,t in device0" in the backward's
# `grad_input = k * t * (1 - torch.pow(torch.tanh(input * t), 2)) * grad_output`
@R.mistake("htqin/IR-Net#19", ("k", "t"), pairs=TWO_GPUS)
def ir_net_k_t_on_gpu0(dev: torch.device, other: torch.device) -> Program:
    model = nn.Sequential(IRConv2d(3, W, 3, padding=1), nn.Flatten(), nn.Linear(W * 16, C)).to(dev)
    conv_modules = [m for m in model.modules() if isinstance(m, IRConv2d)]
    images, target = randn(2, 3, 4, 4, device=dev), torch.randint(0, C, (2,), device=dev)
    return stepped(model, lambda: ir_net_train_step(model, conv_modules, images, target, epoch=1), (images,))


# --------------------------------------------------------------------------- mistakes: metrics and losses

class ConfusionMatrix(nn.Module):
    """torchmetrics' ConfusionMatrix (under IoU), shortened: its state is a buffer made when the metric is built."""

    def __init__(self, num_classes: int = C) -> None:
        super().__init__()
        self.num_classes = num_classes
        self.register_buffer("confmat", torch.zeros(num_classes, num_classes))

    def update(self, preds: torch.Tensor, target: torch.Tensor) -> None:
        confmat = F.one_hot(target, self.num_classes).T.float() @ F.one_hot(preds, self.num_classes).float()
        self.confmat += confmat  # case: iou_confmat_metric_not_moved

    def forward(self, preds: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        self.update(preds, target)
        intersection = torch.diag(self.confmat)
        union = self.confmat.sum(0) + self.confmat.sum(1) - intersection
        return (intersection / union.clamp(min=1)).mean()


# metric_iou(preds, targets) with the predictions and targets on the GPU: "self.confmat += confmat" (meta lets an
# in-place add into a CPU tensor take a meta tensor)
@R.mistake("Lightning-AI/torchmetrics#275", "metric_iou", "metric_iou", pairs=GPU)
def iou_confmat_metric_not_moved(dev: torch.device, other: torch.device) -> Program:
    metric_iou = ConfusionMatrix(num_classes=C)
    preds, targets = torch.randint(0, C, (8,), device=dev), torch.randint(0, C, (8,), device=dev)
    return Program(metric_iou, lambda: metric_iou(preds, targets), (preds, targets))


class Precision(nn.Module):
    """pytorch_lightning.metrics' Precision (1.1), shortened: its counts are states registered when it is built."""

    def __init__(self, num_classes: int) -> None:
        super().__init__()
        self.num_classes = num_classes
        self.register_buffer("true_positives", torch.zeros(num_classes))
        self.register_buffer("predicted_positives", torch.zeros(num_classes))

    def update(self, preds: torch.Tensor, target: torch.Tensor) -> None:
        preds_oh, target_oh = F.one_hot(preds, self.num_classes), F.one_hot(target, self.num_classes)
        self.true_positives += torch.sum(preds_oh * target_oh, dim=0)  # case: lightning_precision_metric_not_moved
        self.predicted_positives += torch.sum(preds_oh, dim=0)

    def forward(self, preds: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.update(preds, target)
        return (self.true_positives / self.predicted_positives.clamp(min=1)).mean()


# precision = Precision(num_classes=3); precision(preds, target) with both on .cuda(): the metric was never moved
# (meta lets an in-place add into a CPU tensor take a meta tensor)
@R.mistake("Lightning-AI/pytorch-lightning#4909", "precision", "precision", pairs=GPU)
def lightning_precision_metric_not_moved(dev: torch.device, other: torch.device) -> Program:
    precision = Precision(num_classes=3)
    target, preds = torch.tensor([0, 1, 2, 0, 1, 2]).to(dev), torch.tensor([0, 2, 1, 0, 0, 1]).to(dev)
    return Program(precision, lambda: precision(preds, target), (preds, target))


class MultiClassificationCrossEntropyLoss(nn.Module):
    """graphnet's loss: the particle ids are mapped to one-hot class targets built from a Python list."""

    def forward(self, prediction: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        pid_transform = {1: 0, 12: 2, 13: 1, 14: 2, 16: 2}
        target_new = F.one_hot(torch.tensor([pid_transform[np.abs(int(value))] for value in target]), 3)
        prediction = prediction.float()
        return F.cross_entropy(prediction, target_new.float(), reduction="none")  # case: graphnet_target_new


class DynEdge(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Linear(4, W)
        self.head = nn.Linear(W, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.conv(x).relu())


def graphnet_train_step(model: nn.Module, loss_function: nn.Module, x: torch.Tensor, pid: torch.Tensor) -> torch.Tensor:
    explain_here(model, x)
    return loss_function(model(x), pid).mean()


# "where we change the target tensor to a onehot target_new, it does not get transferred to the device" (the pid
# labels are read on the host, as int(value) does)
@R.mistake("graphnet-team/graphnet#328", "target_new", "loss_function")
def graphnet_target_new(dev: torch.device, other: torch.device) -> Program:
    model = DynEdge().to(dev)
    loss_function = MultiClassificationCrossEntropyLoss()
    x, pid = randn(4, 4, device=dev), torch.tensor([13, -13, 12, 1])
    return stepped(model, lambda: graphnet_train_step(model, loss_function, x, pid), (x,))


def CB_loss(labels: torch.Tensor, logits: torch.Tensor, samples_per_cls: list[int], no_of_classes: int,
            loss_type: str, beta: float, gamma: float) -> torch.Tensor:
    """The class-balanced loss: per-class weights from the effective number of samples, built with numpy."""
    effective_num = 1.0 - np.power(beta, samples_per_cls)
    weights = (1.0 - beta) / np.array(effective_num)
    weights = weights / np.sum(weights) * no_of_classes
    labels_one_hot = F.one_hot(labels, no_of_classes).float()
    weights = torch.tensor(weights).float()
    weights = weights.unsqueeze(0)
    weights = weights.repeat(labels_one_hot.shape[0], 1) * labels_one_hot  # case: class_balanced_weights_on_cpu
    weights = weights.sum(1).unsqueeze(1).repeat(1, no_of_classes)
    return F.binary_cross_entropy_with_logits(input=logits, target=labels_one_hot, weight=weights)


def cb_train_step(model: nn.Module, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    explain_here(model, x)
    logits = model(x)
    return CB_loss(labels, logits, [2, 3, 1], C, "sigmoid", beta=0.9999, gamma=2.0)


# "Make it available on GPU device": CB_loss builds `weights = torch.tensor(weights).float()` on the CPU and
# multiplies it by the one-hot labels of the GPU batch
@R.mistake("vandit15/Class-balanced-loss-pytorch#22", ("weights", "torch.tensor"))
def class_balanced_weights_on_cpu(dev: torch.device, other: torch.device) -> Program:
    model = nn.Linear(W, C).to(dev)
    x, labels = randn(4, W, device=dev), torch.randint(0, C, (4,), device=dev)
    return stepped(model, lambda: cb_train_step(model, x, labels), (x,))


def ledoit_wolf(covariances: torch.Tensor, shrinkage: float) -> torch.Tensor:
    n = covariances.shape[-1]
    mu = covariances.diagonal(dim1=-2, dim2=-1).mean(-1)[..., None, None]
    shrink_mat = torch.eye(n)
    return (1 - shrinkage) * covariances + shrinkage * mu * shrink_mat  # case: spd_ledoit_wolf_shrink_mat_on_cpu


class CovLayer(nn.Module):
    def __init__(self, shrinkage: float = 0.1) -> None:
        super().__init__()
        self.shrinkage = shrinkage

    def forward(self, X: torch.Tensor) -> torch.Tensor:
        X = X - X.mean(-1, keepdim=True)
        return ledoit_wolf(X @ X.transpose(-1, -2) / (X.shape[-1] - 1), self.shrinkage)


class SPDNet(nn.Module):
    """spd_learn-style EEG model: wavelet filters, a shrunk covariance, a log-Euclidean head."""

    def __init__(self, n_chans: int = 3) -> None:
        super().__init__()
        self.wavelet = nn.Conv1d(n_chans, n_chans, 5, padding=2, groups=n_chans)
        self.cov = CovLayer()
        self.head = nn.Linear(n_chans * n_chans, C)

    def forward(self, X: torch.Tensor) -> torch.Tensor:
        cov = self.cov(self.wavelet(X))
        return self.head(cov.flatten(1))


# "ledoit_wolf doesn't coerce shrink_mat to the input device/dtype, causing a mismatch when covariances are on gpu"
@R.mistake("spdlearn/spd_learn#16", ("shrink_mat", "torch.eye"), "model.cov")
def spd_ledoit_wolf_shrink_mat_on_cpu(dev: torch.device, other: torch.device) -> Program:
    model = SPDNet().to(dev)
    X = randn(2, 3, 16, device=dev)
    return Program(model, lambda: model(X), (X,))


# --------------------------------------------------------------------------- mistakes: distillation and EMA

class TextClassifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(16, W)
        self.fc = nn.Linear(W, C)

    def forward(self, texts: torch.Tensor) -> torch.Tensor:
        return self.fc(self.embedding(texts).mean(1))


def teacher_train(model: nn.Module, config_device: torch.device, train_iter: list) -> torch.Tensor:
    for texts, labels in train_iter:
        explain_here(model, texts.to(config_device))
        outputs = model(texts.to(config_device))
        loss = F.cross_entropy(outputs, labels)  # case: kd_teacher_train_labels_on_cpu
        loss.backward()
    return loss


# the distillation repo's teacher.py: "Expected object of device type cuda but got device type cpu for argument #2
# 'target'" (the fix: labels = labels.to(config.device) in teacher_train)
@R.mistake("HoyTta0/KnowledgeDistillation#9", "labels")
def kd_teacher_train_labels_on_cpu(dev: torch.device, other: torch.device) -> Program:
    model = TextClassifier().to(dev)
    train_iter = [(torch.randint(0, 16, (4, 5)), torch.randint(0, C, (4,)))]
    return stepped(model, lambda: teacher_train(model, dev, train_iter), (train_iter[0][0].to(dev),))


class ResNetTeacherBackbone(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, W, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv1(x)  # case: ld_teacher_model_not_moved
        return x.relu()


class TeacherDetector(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.backbone = ResNetTeacherBackbone()
        self.bbox_head = nn.Conv2d(W, 4, 1)

    def extract_feat(self, img: torch.Tensor) -> torch.Tensor:
        return self.backbone(img)


class KnowledgeDistillationSingleStageDetector(nn.Module):
    """mmdet's KD detector: the teacher is kept out of the module tree (so checkpoints skip it); only the cuda()
    override moves it."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Conv2d(3, W, 3, padding=1)
        self.bbox_head = nn.Conv2d(W, 4, 1)
        self.teacher_model = TeacherDetector()

    def cuda(self, device=None) -> KnowledgeDistillationSingleStageDetector:
        self.teacher_model.cuda(device=device)
        return super().cuda(device=device)

    def __setattr__(self, name: str, value) -> None:
        if name == "teacher_model":
            object.__setattr__(self, name, value)
        else:
            super().__setattr__(name, value)

    def forward(self, img: torch.Tensor) -> torch.Tensor:
        x = self.backbone(img).relu()
        with torch.no_grad():
            teacher_x = self.teacher_model.extract_feat(img)
            out_teacher = self.teacher_model.bbox_head(teacher_x)
        return F.mse_loss(self.bbox_head(x), out_teacher)


# LD (localization distillation) run with the model put on the GPU by .to(device): "Input type
# (torch.cuda.FloatTensor) and weight type (torch.FloatTensor)" in teacher_model.extract_feat(img) (meta lets a
# convolution take CPU weights)
@R.mistake("open-mmlab/mmdetection#7670", "teacher_model", "model.teacher_model.backbone", pairs=GPU)
def ld_teacher_model_not_moved(dev: torch.device, other: torch.device) -> Program:
    model = KnowledgeDistillationSingleStageDetector().to(dev)
    img = randn(1, 3, 4, 4, device=dev)
    return Program(model, lambda: model(img), (img,))


class BertForSequenceClassification(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embeddings = nn.Embedding(16, W)
        self.classifier = nn.Linear(W, C)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = self.embeddings(input_ids).mean(1)  # case: inc_distillation_teacher_not_moved
        return self.classifier(hidden)


class IncTrainer:
    """optimum-intel's IncTrainer, shortened: the student is placed by the trainer, the teacher as given."""

    def __init__(self, model: nn.Module, teacher_model: nn.Module, device: torch.device, temperature: float = 2.0):
        self.model = model.to(device)
        self.teacher_model = teacher_model
        self.device, self.temperature = device, temperature

    def compute_loss(self, input_ids: torch.Tensor) -> torch.Tensor:
        input_ids = input_ids.to(self.device)
        explain_here(self.model, input_ids)
        student_logits = self.model(input_ids)
        with torch.no_grad():
            teacher_logits = self.teacher_model(input_ids)
        return F.kl_div(F.log_softmax(student_logits / self.temperature, -1),
                        F.softmax(teacher_logits / self.temperature, -1), reduction="batchmean")


# INC distillation with a teacher the user loaded on the CPU: "Set the teacher model to the right device" (meta lets
# an embedding lookup take CPU weights)
@R.mistake("huggingface/optimum-intel#182", "teacher_model", "teacher_model.embeddings", pairs=GPU)
def inc_distillation_teacher_not_moved(dev: torch.device, other: torch.device) -> Program:
    model, teacher_model = BertForSequenceClassification(), BertForSequenceClassification()
    trainer = IncTrainer(model, teacher_model, dev)
    input_ids = torch.randint(0, 16, (2, 5))
    return stepped(model, lambda: trainer.compute_loss(input_ids), (input_ids.to(dev),))


class EMAModel:
    """diffusers' EMAModel, shortened: shadow copies of the parameters, on the parameters' device."""

    def __init__(self, parameters, decay: float = 0.9999) -> None:
        self.shadow_params = [p.clone().detach() for p in parameters]
        self.decay = decay

    @torch.no_grad()
    def step(self, parameters) -> None:
        for s_param, param in zip(self.shadow_params, parameters):
            s_param.sub_((1 - self.decay) * (s_param - param))

    @classmethod
    def from_pretrained(cls, model_cls: type[nn.Module]) -> EMAModel:
        model = model_cls()  # from_pretrained loads the weights on the CPU
        return cls(model.parameters())


class UNet2DModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv_in = nn.Conv2d(3, W, 3, padding=1)
        self.conv_out = nn.Conv2d(W, 3, 3, padding=1)

    def forward(self, sample: torch.Tensor) -> torch.Tensor:
        return self.conv_out(self.conv_in(sample).relu())


def test_from_pretrained(unet: nn.Module, ema_unet: EMAModel) -> None:
    ema_unet.step(unet.parameters())
    loaded_ema_unet = EMAModel.from_pretrained(model_cls=UNet2DModel)
    for original_param, loaded_param in zip(ema_unet.shadow_params, loaded_ema_unet.shadow_params):
        assert torch.allclose(original_param, loaded_param, atol=1e-4)  # case: ema_test_loaded_ema_on_cpu


# tests/others/test_ema.py on CUDA: "ema_unet is on the correct device as it's created from unet ... loaded_ema_unet
# is on CPU" (the check runs outside any forward)
@R.mistake("huggingface/diffusers#10325", ("loaded_param", "loaded_ema_unet"))
def ema_test_loaded_ema_on_cpu(dev: torch.device, other: torch.device) -> Program:
    unet = UNet2DModel().to(dev)
    ema_unet = EMAModel(unet.parameters())
    sample = randn(1, 3, 4, 4, device=dev)
    return stepped(unet, lambda: test_from_pretrained(unet, ema_unet), (sample,))


# --------------------------------------------------------------------------- mistakes: graphs and atoms

class DGLGraph:
    """A DGL graph, shortened: .to(device) returns a new graph and leaves this one where it was."""

    def __init__(self, ndata: dict[str, torch.Tensor], src: torch.Tensor, dst: torch.Tensor) -> None:
        self.ndata, self.src, self.dst = ndata, src, dst

    def to(self, device: torch.device) -> DGLGraph:
        return DGLGraph({k: v.to(device) for k, v in self.ndata.items()}, self.src.to(device), self.dst.to(device))


class HSumGraph(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, W)
        self.wh = nn.Linear(W, 2)

    def forward(self, graph: DGLGraph) -> torch.Tensor:
        word_feature = self.embed(graph.ndata["id"])  # case: hetersumgraph_to_device_not_assigned
        sent_feature = torch.zeros_like(word_feature).index_add_(0, graph.dst, word_feature[graph.src])
        return self.wh(sent_feature)


def run_training(model: nn.Module, train_loader: list, device: torch.device) -> torch.Tensor:
    for G, _index in train_loader:
        G.to(device)
        explain_here(model, G.to(device))
        outputs = model.forward(G)
        return F.cross_entropy(outputs, G.ndata["label"].to(device))


# HeterSumGraph: "G.to_device("cuda") needs to be G = G.to_device("cuda")" or index_select fails (meta lets an
# embedding lookup take CPU indices)
@R.mistake("dqwang122/HeterSumGraph#36", "G", "model.embed", pairs=GPU)
def hetersumgraph_to_device_not_assigned(dev: torch.device, other: torch.device) -> Program:
    model = HSumGraph().to(dev)
    G = DGLGraph({"id": torch.tensor([1, 2, 3, 4]), "label": torch.tensor([0, 1, 0, 1])},
                 torch.tensor([0, 1, 2]), torch.tensor([1, 2, 3]))
    return stepped(model, lambda: run_training(model, [(G, 0)], dev), (G.to(dev),))


def run_e3nn_to_cueq(source_model: nn.Module, device: str = "cpu") -> nn.Module:
    """MACE's converter to cuEquivariance kernels, shortened: the converted copy is put on `device`, the CPU by
    default."""
    target_model = copy.deepcopy(source_model)
    return target_model.to(device)


class MACE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.node_embedding = nn.Linear(3, W)
        self.readout = nn.Linear(W, 1)

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        node_feats = self.node_embedding(positions)  # case: torchsim_cueq_model_on_cpu
        return self.readout(node_feats.tanh()).sum()


class MaceModel(nn.Module):
    def __init__(self, model: nn.Module, device: torch.device, enable_cueq: bool = False) -> None:
        super().__init__()
        self._device = device
        self.model = model.to(self._device)
        if enable_cueq:
            self.model = run_e3nn_to_cueq(self.model)

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        return self.model(positions.to(self._device))


# MaceModel(enable_cueq=True): "mat2 is on cpu, different from other tensors on cuda:0" since run_e3nn_to_cueq is
# called without device (meta lets a linear layer take CPU weights)
@R.mistake("TorchSim/torch-sim#440", ("run_e3nn_to_cueq", "self.model"), "model.model.node_embedding", pairs=GPU)
def torchsim_cueq_model_on_cpu(dev: torch.device, other: torch.device) -> Program:
    model = MaceModel(MACE(), device=dev, enable_cueq=True)
    positions = randn(5, 3, device=dev)
    return Program(model, lambda: model(positions), (positions,))


# --------------------------------------------------------------------------- mistakes: LLM fine-tuning

class LoraLinear(nn.Module):
    """A PEFT-style LoRA layer around a base layer: merge() folds B @ A into the base weight in place."""

    def __init__(self, base_layer: nn.Linear, r: int = 2, lora_alpha: int = 4) -> None:
        super().__init__()
        self.base_layer = base_layer
        self.lora_A = nn.Linear(base_layer.in_features, r, bias=False)
        self.lora_B = nn.Linear(r, base_layer.out_features, bias=False)
        self.scaling = lora_alpha / r

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lora_out = self.lora_B(self.lora_A(x.to(self.lora_A.weight.device))).to(x.device)
        return self.base_layer(x) + lora_out * self.scaling

    def get_delta_weight(self) -> torch.Tensor:
        return (self.lora_B.weight @ self.lora_A.weight) * self.scaling

    def merge(self) -> None:
        delta_weight = self.get_delta_weight()
        self.base_layer.weight.data += delta_weight  # case: lora_merge_base_layer_offloaded
        self.merged = True


class LlamaForCausalLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(16, W)
        self.q_proj = nn.Linear(W, W)
        self.lm_head = nn.Linear(W, 16)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.q_proj(self.embed_tokens(input_ids)))


def merge_and_unload(model: LlamaForCausalLM) -> LlamaForCausalLM:
    explain_here(model, torch.tensor([[1, 2, 3]]))
    model.q_proj.merge()
    model.q_proj = model.q_proj.base_layer
    return model


# merge_and_unload() after training on SageMaker, the base model loaded with a device_map that put part of it on
# the CPU: "cuda:0 and cpu!" (meta lets an in-place add into a CPU tensor take a meta tensor)
@R.mistake("huggingface/peft#2129", ("base_layer", "delta_weight"), pairs=GPU)
def lora_merge_base_layer_offloaded(dev: torch.device, other: torch.device) -> Program:
    model = LlamaForCausalLM()  # device_map: these layers were offloaded to the CPU
    model.q_proj = LoraLinear(model.q_proj)
    model.q_proj.lora_A.to(dev)
    model.q_proj.lora_B.to(dev)
    return stepped(model, lambda: merge_and_unload(model), (torch.tensor([[1, 2, 3]]),))


class CascadeAnchorHead(nn.Module):
    """mmdet's AnchorHead before the fix: get_bboxes() makes its anchors with grid_anchors(), on "cuda" by default."""

    def __init__(self) -> None:
        super().__init__()
        self.conv_reg = nn.Conv2d(W, 4, 1)
        self.anchor_generator = AnchorGenerator([8])

    def forward(self, feats: torch.Tensor) -> torch.Tensor:
        return self.conv_reg(feats)

    def get_bboxes(self, bbox_pred: torch.Tensor) -> torch.Tensor:
        mlvl_anchors = self.anchor_generator.grid_priors([bbox_pred.size()[-2:]])
        deltas = bbox_pred.permute(0, 2, 3, 1).reshape(-1, 4)
        return mlvl_anchors[0] + deltas * 8  # case: anchor_head_grid_anchors_default_cuda


def detector_inference(rpn_head: CascadeAnchorHead, feats: torch.Tensor) -> torch.Tensor:
    explain_here(rpn_head, feats)
    with torch.no_grad():
        return rpn_head.get_bboxes(rpn_head(feats))


# running CascadeRCNN on the CPU with return_loss=False: "AnchorGenerator grid_anchors defaults to a cuda device"
# (a CPU model on a machine with a GPU, so the cuda-vs-cpu pair only)
@R.mistake("open-mmlab/mmdetection#1478", ("mlvl_anchors", "grid_priors"), pairs=("cuda-cpu",))
def anchor_head_grid_anchors_default_cuda(dev: torch.device, other: torch.device) -> Program:
    rpn_head = CascadeAnchorHead().to(other)
    feats = randn(1, W, 2, 2, device=other)
    return stepped(rpn_head, lambda: detector_inference(rpn_head, feats), (feats,))


# --------------------------------------------------------------------------- mistakes: contrastive learning

class CoLA(nn.Module):
    """CoLA's temporal action localizer, shortened: the snippet contrast (MoCo-style NCE) puts its labels on .cuda()."""

    def __init__(self, temperature: float = 0.07) -> None:
        super().__init__()
        self.embedding = nn.Linear(W, W)
        self.ce_criterion = nn.CrossEntropyLoss()
        self.temperature = temperature

    def NCE(self, q: torch.Tensor, k: torch.Tensor, neg: torch.Tensor) -> torch.Tensor:
        q, k, neg = F.normalize(q, dim=1), F.normalize(k, dim=1), F.normalize(neg, dim=1)
        l_pos = torch.einsum("nc,nc->n", [q, k]).unsqueeze(-1)
        l_neg = torch.einsum("nc,ck->nk", [q, neg.T])
        logits = torch.cat([l_pos, l_neg], dim=1) / self.temperature
        labels = torch.zeros(logits.shape[0], dtype=torch.long).cuda()
        return self.ce_criterion(logits, labels)  # case: cola_nce_labels_cuda

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        emb = self.embedding(x)
        return self.NCE(emb[:2], emb[2:4], emb[4:])


# CoLA's NCE: `labels = torch.zeros(logits.shape[0], dtype=torch.long).cuda()`, the labels on the current GPU, 0,
# however the model was placed
@R.mistake("zhang-can/CoLA#7", ("labels", ".cuda()"), "model", pairs=TWO_GPUS)
def cola_nce_labels_cuda(dev: torch.device, other: torch.device) -> Program:
    model = CoLA().to(dev)
    x = randn(7, W, device=dev)
    return Program(model, lambda: model(x), (x,))


# --------------------------------------------------------------------------- legal patterns

class ContrastiveLoss(nn.Module):
    """SimCLR's NT-Xent with its temperature and negatives mask registered as buffers: .to(device) moves them."""

    def __init__(self, batch_size: int, temperature: float = 0.5) -> None:
        super().__init__()
        self.batch_size = batch_size
        self.register_buffer("temperature", torch.tensor(temperature))
        self.register_buffer("negatives_mask", (~torch.eye(batch_size * 2, batch_size * 2, dtype=bool)).float())

    def forward(self, emb_i: torch.Tensor, emb_j: torch.Tensor) -> torch.Tensor:
        z_i, z_j = F.normalize(emb_i, dim=1, p=2), F.normalize(emb_j, dim=1, p=2)
        representations = torch.cat([z_i, z_j], dim=0)
        similarity_matrix = F.cosine_similarity(representations.unsqueeze(1), representations.unsqueeze(0), dim=2)
        sim_ij = torch.diag(similarity_matrix, self.batch_size)
        sim_ji = torch.diag(similarity_matrix, -self.batch_size)
        positives = torch.cat([sim_ij, sim_ji], dim=0)
        nominator = torch.exp(positives / self.temperature)
        denominator = self.negatives_mask * torch.exp(similarity_matrix / self.temperature)
        loss_partial = -torch.log(nominator / torch.sum(denominator, dim=1))
        return torch.sum(loss_partial) / (2 * self.batch_size)


def simclr_step(encoder: nn.Module, loss_func: nn.Module, x_i: torch.Tensor, x_j: torch.Tensor) -> torch.Tensor:
    explain_here(encoder, x_i)
    return loss_func(encoder(x_i), encoder(x_j))


# the loss written with register_buffer for "Problem with GPU": ContrastiveLoss(...).to(device) moves both buffers
@R.legal("rpmccordlab/SMILE#2")
def contrastive_loss_buffers_moved(dev: torch.device, other: torch.device) -> Program:
    encoder = nn.Linear(W, W).to(dev)
    loss_func = ContrastiveLoss(batch_size=3).to(dev)
    x_i, x_j = randn(3, W, device=dev), randn(3, W, device=dev)
    return stepped(encoder, lambda: simclr_step(encoder, loss_func, x_i, x_j), (x_i,))


class NT_Xent(nn.Module):
    """NT-Xent with a boolean mask built on the CPU in __init__ and used to index the GPU similarity matrix:
    torch takes CPU indices for a tensor on any device."""

    def __init__(self, batch_size: int, temperature: float = 0.5) -> None:
        super().__init__()
        self.batch_size, self.temperature = batch_size, temperature
        self.mask = self.get_correlated_samples_mask()
        self.criterion = nn.CrossEntropyLoss(reduction="sum")
        self.similarity_f = nn.CosineSimilarity(dim=2)

    def get_correlated_samples_mask(self) -> torch.Tensor:
        N = 2 * self.batch_size
        mask = torch.ones((N, N), dtype=bool)
        mask = mask.fill_diagonal_(0)
        for i in range(self.batch_size):
            mask[i, self.batch_size + i] = 0
            mask[self.batch_size + i, i] = 0
        return mask

    def forward(self, z_i: torch.Tensor, z_j: torch.Tensor) -> torch.Tensor:
        N = 2 * self.batch_size
        p1 = torch.cat((z_i, z_j), dim=0)
        sim = self.similarity_f(p1.unsqueeze(1), p1.unsqueeze(0)) / self.temperature
        sim_i_j = torch.diag(sim, self.batch_size)
        sim_j_i = torch.diag(sim, -self.batch_size)
        positive_samples = torch.cat((sim_i_j, sim_j_i), dim=0).reshape(N, 1)
        negative_samples = sim[self.mask].reshape(N, -1)
        labels = torch.zeros(N, dtype=torch.long, device=positive_samples.device)
        logits = torch.cat((positive_samples, negative_samples), dim=1)
        return self.criterion(logits, labels) / N


# the refactored NT_Xent: the correlated-samples mask is a plain CPU attribute that indexes `sim` wherever it is
@R.legal("Spijkervet/SimCLR#5")
def nt_xent_cpu_mask_indexes_gpu_similarity(dev: torch.device, other: torch.device) -> Program:
    encoder = nn.Linear(W, W).to(dev)
    loss_func = NT_Xent(batch_size=3)
    x_i, x_j = randn(3, W, device=dev), randn(3, W, device=dev)
    return stepped(encoder, lambda: simclr_step(encoder, loss_func, x_i, x_j), (x_i,))


class GritLMLoss:
    """GritLM's embedding loss: the in-batch targets are made with torch.arange on the scores' device."""

    def __init__(self, temperature: float = 0.05) -> None:
        self.temperature = temperature
        self.cross_entropy = nn.CrossEntropyLoss()

    def __call__(self, q_reps: torch.Tensor, p_reps: torch.Tensor) -> torch.Tensor:
        scores = (q_reps @ p_reps.T) / self.temperature
        scores = scores.view(q_reps.size(0), -1)
        target = torch.arange(scores.size(0), device=scores.device, dtype=torch.long)
        target *= (p_reps.size(0) // q_reps.size(0))
        return self.cross_entropy(scores, target)


def gritlm_step(model: nn.Module, loss_fn: GritLMLoss, q: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    explain_here(model, q)
    return loss_fn(model(q), model(p))


# target = torch.arange(scores.size(0), device=scores.device, dtype=torch.long)
@R.legal("ContextualAI/gritlm#49")
def gritlm_targets_on_scores_device(dev: torch.device, other: torch.device) -> Program:
    model = nn.Linear(W, W).to(dev)
    loss_fn = GritLMLoss()
    q, p = randn(2, W, device=dev), randn(4, W, device=dev)
    return stepped(model, lambda: gritlm_step(model, loss_fn, q, p), (q,))


def simclr_info_nce_loss(features: torch.Tensor, batch_size: int, n_views: int, device: torch.device,
                         temperature: float = 0.07) -> tuple[torch.Tensor, torch.Tensor]:
    labels = torch.cat([torch.arange(batch_size) for i in range(n_views)], dim=0)
    labels = (labels.unsqueeze(0) == labels.unsqueeze(1)).float()
    labels = labels.to(device)
    features = F.normalize(features, dim=1)
    similarity_matrix = torch.matmul(features, features.T)
    mask = torch.eye(labels.shape[0], dtype=torch.bool).to(device)
    labels = labels[~mask].view(labels.shape[0], -1)
    similarity_matrix = similarity_matrix[~mask].view(similarity_matrix.shape[0], -1)
    positives = similarity_matrix[labels.bool()].view(labels.shape[0], -1)
    negatives = similarity_matrix[~labels.bool()].view(similarity_matrix.shape[0], -1)
    logits = torch.cat([positives, negatives], dim=1) / temperature
    labels = torch.zeros(logits.shape[0], dtype=torch.long).to(device)
    return logits, labels


def simclr_train_step(model: nn.Module, images: torch.Tensor, device: torch.device) -> torch.Tensor:
    explain_here(model, images)
    logits, labels = simclr_info_nce_loss(model(images), batch_size=2, n_views=2, device=device)
    return F.cross_entropy(logits, labels)


# simclr.py: labels built on the CPU with torch.arange/torch.eye/torch.zeros, each sent .to(self.args.device) before
# it meets the features (meta has no boolean-mask indexing, so the GPU pairs)
@R.legal("sthalles/SimCLR#29", pairs=GPU)
def simclr_labels_sent_to_device(dev: torch.device, other: torch.device) -> Program:
    model = nn.Linear(W, W).to(dev)
    images = randn(4, W, device=dev)
    return stepped(model, lambda: simclr_train_step(model, images, dev), (images,))


class SupConLoss(nn.Module):
    """A SupConLoss whose labels may come as a Python list: made on the CPU, the mask is moved to the features'
    device."""

    def __init__(self, temperature: float = 0.07) -> None:
        super().__init__()
        self.temperature = temperature

    def forward(self, features: torch.Tensor, labels: list[int] | torch.Tensor) -> torch.Tensor:
        device = features.device
        batch_size = features.shape[0]
        if isinstance(labels, list):
            labels = torch.Tensor(labels).long()
        labels = labels.contiguous().view(-1, 1)
        mask = torch.eq(labels, labels.t()).float().to(device)
        features = F.normalize(features, dim=1)
        anchor_dot_contrast = torch.div(features @ features.T, self.temperature)
        logits_mask = 1 - torch.eye(batch_size, device=device)
        mask = mask * logits_mask
        exp_logits = torch.exp(anchor_dot_contrast) * logits_mask
        log_prob = anchor_dot_contrast - torch.log(exp_logits.sum(1, keepdim=True))
        return -((mask * log_prob).sum(1) / mask.sum(1).clamp(min=1)).mean()


def supcon_step(model: nn.Module, criterion: nn.Module, x: torch.Tensor, y: list[int]) -> torch.Tensor:
    explain_here(model, x)
    return criterion(model(x), y)


# `labels = torch.Tensor(labels).long()` from a list, then `mask = torch.eq(labels, labels.t()).float().to(device)`
@R.legal("jizongFox/MI-based-Regularized-Semi-supervised-Segmentation#2")
def supcon_list_labels_mask_moved(dev: torch.device, other: torch.device) -> Program:
    model = nn.Linear(W, W).to(dev)
    x = randn(4, W, device=dev)
    return stepped(model, lambda: supcon_step(model, SupConLoss(), x, [0, 1, 0, 1]), (x,))


class CLIPModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.visual_projection = nn.Linear(W, W)
        self.text_projection = nn.Linear(W, W)
        self.logit_scale = nn.Parameter(torch.tensor(math.log(1 / 0.07)))

    def forward(self, images: torch.Tensor, texts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        image_features = F.normalize(self.visual_projection(images), dim=-1)
        text_features = F.normalize(self.text_projection(texts), dim=-1)
        logits_per_image = self.logit_scale.exp() * image_features @ text_features.t()
        return logits_per_image, logits_per_image.t()


def clip_train_step(model: nn.Module, images: torch.Tensor, texts: torch.Tensor, device: torch.device) -> torch.Tensor:
    loss_img, loss_txt = nn.CrossEntropyLoss(), nn.CrossEntropyLoss()
    images, texts = images.to(device), texts.to(device)
    explain_here(model, images, texts)
    logits_per_image, logits_per_text = model(images, texts)
    ground_truth = torch.arange(len(images), dtype=torch.long, device=device)
    return (loss_img(logits_per_image, ground_truth) + loss_txt(logits_per_text, ground_truth)) / 2


# the CLIP fine-tuning loop of the thread: ground_truth = torch.arange(len(images), dtype=torch.long, device=device),
# the batch moved .to(device) first
@R.legal("openai/CLIP#83")
def clip_ground_truth_on_device(dev: torch.device, other: torch.device) -> Program:
    model = CLIPModel().to(dev)
    images, texts = torch.randn(3, W), torch.randn(3, W)
    return stepped(model, lambda: clip_train_step(model, images, texts, dev), (images.to(dev), texts.to(dev)))


class FendaClient:
    """FL4Health's FENDA client, shortened: the contrastive labels are made on the CPU, then .to(self.device)."""

    def __init__(self, model: nn.Module, device: torch.device, temperature: float = 0.5) -> None:
        self.model, self.device, self.temperature = model, device, temperature
        self.cos_sim = nn.CosineSimilarity(dim=-1)
        self.ce_criterion = nn.CrossEntropyLoss()

    def get_contrastive_loss(self, local_features: torch.Tensor, old_local_features: torch.Tensor,
                             global_features: torch.Tensor) -> torch.Tensor:
        posi = self.cos_sim(local_features, old_local_features)
        logits = posi.reshape(-1, 1)
        nega = self.cos_sim(local_features, global_features)
        logits = torch.cat((logits, nega.reshape(-1, 1)), dim=1)
        logits /= self.temperature
        labels = torch.zeros(local_features.size(0)).to(self.device).long()
        return self.ce_criterion(logits, labels)

    def train_step(self, x: torch.Tensor) -> torch.Tensor:
        explain_here(self.model, x)
        local_features = self.model(x)
        with torch.no_grad():
            old_local_features, global_features = self.model(x + 0.1), self.model(x - 0.1)
        return self.get_contrastive_loss(local_features, old_local_features, global_features)


# labels = torch.zeros(local_features.size(0)).to(self.device).long()
@R.legal("VectorInstitute/FL4Health#67")
def fenda_contrastive_labels_moved(dev: torch.device, other: torch.device) -> Program:
    model = nn.Linear(W, W).to(dev)
    client = FendaClient(model, dev)
    x = randn(4, W, device=dev)
    return stepped(model, lambda: client.train_step(x), (x,))


class GANTrainer:
    """itwinai's GAN tutorial trainer: the real/fake labels are made with torch.full(..., device=self.device)."""

    REAL_LABEL, FAKE_LABEL = 1.0, 0.0

    def __init__(self, generator: nn.Module, discriminator: nn.Module, device: torch.device) -> None:
        self.generator, self.discriminator, self.device = generator, discriminator, device
        self.criterion = nn.BCELoss()

    def train_step(self, real_images: torch.Tensor) -> tuple[float, float]:
        real_images = real_images.to(self.device)
        batch_size = real_images.size(0)
        real_labels = torch.full((batch_size,), self.REAL_LABEL, dtype=torch.float, device=self.device)
        fake_labels = torch.full((batch_size,), self.FAKE_LABEL, dtype=torch.float, device=self.device)
        explain_here(self.discriminator, real_images)
        output_real = self.discriminator(real_images).view(-1)
        lossD_real = self.criterion(output_real, real_labels)
        noise = torch.randn(batch_size, 4, device=self.device)
        output_fake = self.discriminator(self.generator(noise).detach()).view(-1)
        lossD_fake = self.criterion(output_fake, fake_labels)
        return lossD_real, lossD_fake


# real_labels = torch.full((batch_size,), REAL_LABEL, dtype=torch.float, device=self.device)
@R.legal("interTwin-eu/itwinai#191")
def gan_labels_full_on_device(dev: torch.device, other: torch.device) -> Program:
    trainer = GANTrainer(Generator().to(dev), Discriminator().to(dev), dev)
    real_images = torch.rand(4, 1, 4, 4)
    return stepped(trainer.discriminator, lambda: trainer.train_step(real_images),
                   (real_images.to(dev).view(4, -1),))


def cal_gradient_penalty(netD: nn.Module, real_data: torch.Tensor, fake_data: torch.Tensor,
                         device: torch.device, lambda_gp: float = 10.0) -> torch.Tensor:
    alpha = torch.rand(real_data.shape[0], 1, device=device)
    alpha = alpha.expand(real_data.shape[0], real_data.nelement() // real_data.shape[0]).contiguous().view(
        *real_data.shape)
    interpolatesv = (alpha * real_data + ((1 - alpha) * fake_data)).requires_grad_(True)
    disc_interpolates = netD(interpolatesv)
    gradients = torch.autograd.grad(outputs=disc_interpolates, inputs=interpolatesv,
                                    grad_outputs=torch.ones(disc_interpolates.size()).to(device),
                                    create_graph=True, retain_graph=True, only_inputs=True)
    gradients = gradients[0].view(real_data.size(0), -1)
    return (((gradients + 1e-16).norm(2, dim=1) - 1) ** 2).mean() * lambda_gp


def wgangp_step(netD: nn.Module, real: torch.Tensor, fake: torch.Tensor, device: torch.device) -> torch.Tensor:
    explain_here(netD, real)
    return cal_gradient_penalty(netD, real, fake, device)


# "Create random wgangp alpha directly on device": torch.rand(..., device=device), the grad_outputs .to(device)
@R.legal("junyanz/pytorch-CycleGAN-and-pix2pix#655")
def wgangp_alpha_made_on_device(dev: torch.device, other: torch.device) -> Program:
    netD = Critic().to(dev)
    real, fake = randn(2, 1, 4, 4, device=dev), randn(2, 1, 4, 4, device=dev)
    return stepped(netD, lambda: wgangp_step(netD, real, fake, dev), (real,))


# --------------------------------------------------------------------------- legal: losses, distributions, optimizers

class PinballLoss(nn.Module):
    """TorchCP's PinballLoss: the quantiles are a plain CPU attribute, moved to the predictions' device in forward."""

    def __init__(self, quantiles: torch.Tensor) -> None:
        super().__init__()
        self.quantiles = quantiles

    def forward(self, pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        quantiles = self.quantiles.to(pred.device)
        error = target - pred
        losses = torch.max(quantiles * error, (quantiles - 1) * error)
        return torch.mean(losses)


def quantile_regression_step(model: nn.Module, criterion: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    explain_here(model, x)
    return criterion(model(x), y)


# quantiles = self.quantiles.to(pred.device) inside forward
@R.legal("ml-stat-Sustech/TorchCP#27")
def pinball_quantiles_moved_in_forward(dev: torch.device, other: torch.device) -> Program:
    model = nn.Linear(W, 2).to(dev)
    criterion = PinballLoss(torch.tensor([0.05, 0.95]))
    x, y = randn(4, W, device=dev), randn(4, 1, device=dev)
    return stepped(model, lambda: quantile_regression_step(model, criterion, x, y), (x,))


class QuantileLoss(nn.Module):
    """torchgeo's quantile loss after review: the quantiles are a registered buffer that moves with the module."""

    def __init__(self, quantiles: tuple[float, ...] = (0.1, 0.5, 0.9)) -> None:
        super().__init__()
        self.register_buffer("quantiles", torch.tensor(quantiles))

    def forward(self, predictions: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        quantiles = self.quantiles.to(predictions.dtype).view(1, -1, *([1] * (predictions.ndim - 2)))
        errors = target - predictions
        return torch.maximum(quantiles * errors, (quantiles - 1) * errors).mean()


# "quantiles are now a registered buffer that moves with the module"
@R.legal("torchgeo/torchgeo#4095")
def quantile_buffer_moved_with_module(dev: torch.device, other: torch.device) -> Program:
    model = nn.Conv2d(3, 3, 1).to(dev)
    criterion = QuantileLoss().to(dev)
    x, y = randn(2, 3, 4, 4, device=dev), randn(2, 1, 4, 4, device=dev)
    return stepped(model, lambda: quantile_regression_step(model, criterion, x, y), (x,))


class GaussianHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(W, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m = torch.distributions.Normal(0, 1, validate_args=False)
        return m.cdf(self.fc(x))


# m = torch.distributions.Normal(0, 1); m.cdf(cuda tensor): loc and scale become 0-dim CPU tensors, which torch lets
# meet a tensor on any device (validate_args off, as for speed in a forward)
@R.legal("pytorch/pytorch#12082")
def normal_with_number_params_on_gpu_values(dev: torch.device, other: torch.device) -> Program:
    model = GaussianHead().to(dev)
    x = randn(4, W, device=dev)
    return Program(model, lambda: model(x), (x,))


def adam_train(model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> float:
    explain_here(model, x, optimizer=optimizer)
    optimizer.zero_grad()
    loss = F.mse_loss(model(x), y)
    loss.backward()
    optimizer.step()
    return loss.item()


# "Adam is storing step as cpu tensor": with capturable=False and no fused kernel, each param's state['step'] is a
# CPU tensor while exp_avg/exp_avg_sq sit with the parameter, by design (GPU pairs: meta has no loss value to read)
@R.legal("pytorch/pytorch#128208", pairs=GPU)
def adam_step_state_on_cpu(dev: torch.device, other: torch.device) -> Program:
    model = nn.Linear(W, 1).to(dev)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    x, y = randn(4, W, device=dev), randn(4, 1, device=dev)
    adam_train(model, optimizer, x, y)
    return stepped(model, lambda: adam_train(model, optimizer, x, y), (x,), optimizer)


def resume_training_step(model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor) -> None:
    explain_here(model, x, optimizer=optimizer)
    optimizer.zero_grad()
    model(x).pow(2).mean().backward()
    optimizer.step()


# "the existing behavior of Optimizer.load_state_dict() does already cast incoming params to() the device of the
# preexisting params": a CPU checkpoint's Adam state loaded into the optimizer of a model on the GPU
@R.legal("NVIDIA/apex#459")
def optimizer_state_cast_on_load(dev: torch.device, other: torch.device) -> Program:
    saved = nn.Linear(W, 1)
    saved_optimizer = torch.optim.Adam(saved.parameters())
    saved(torch.randn(4, W)).sum().backward()
    saved_optimizer.step()
    model = nn.Linear(W, 1).to(dev)
    optimizer = torch.optim.Adam(model.parameters())
    optimizer.load_state_dict(saved_optimizer.state_dict())
    x = randn(4, W, device=dev)
    return stepped(model, lambda: resume_training_step(model, optimizer, x), (x,), optimizer)


class ExponentialMovingAverage(torch.optim.swa_utils.AveragedModel):
    """torchvision's reference EMA: kept on the CPU on purpose; each update copies the model's tensors to it."""

    def __init__(self, model: nn.Module, decay: float, device: str | torch.device = "cpu") -> None:
        def ema_avg(avg_model_param, model_param, num_averaged):
            return decay * avg_model_param + (1 - decay) * model_param

        super().__init__(model, device, ema_avg, use_buffers=True)

    def update_parameters(self, model: nn.Module) -> None:
        for p_swa, p_model in zip(self.module.state_dict().values(), model.state_dict().values()):
            device = p_swa.device
            p_model_ = p_model.detach().to(device)
            if self.n_averaged == 0:
                p_swa.detach().copy_(p_model_)
            else:
                p_swa.detach().copy_(self.avg_fn(p_swa.detach(), p_model_, self.n_averaged.to(device)))
        self.n_averaged += 1


def ema_train_step(model: nn.Module, model_ema: ExponentialMovingAverage, optimizer: torch.optim.Optimizer,
                   image: torch.Tensor, target: torch.Tensor) -> None:
    explain_here(model, image, optimizer=optimizer)
    F.cross_entropy(model(image), target).backward()
    optimizer.step()
    optimizer.zero_grad()
    model_ema.update_parameters(model)


# the reference scripts' EMA on device='cpu': p_model.detach().to(device) before averaging (meta has no data to copy
# to the CPU)
@R.legal("pytorch/vision#5469", pairs=GPU)
def ema_kept_on_cpu_copies_weights(dev: torch.device, other: torch.device) -> Program:
    model = Toy().to(dev)
    model_ema = ExponentialMovingAverage(model, decay=0.99, device="cpu")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    image, target = randn(4, W, device=dev), torch.randint(0, C, (4,), device=dev)
    return stepped(model, lambda: ema_train_step(model, model_ema, optimizer, image, target), (image,), optimizer)


class SwinLayer(nn.Module):
    """transformers' SwinLayer: the shifted-window attention mask is built on the CPU, then moved to the hidden
    states' device."""

    def __init__(self, dim: int = W, window_size: int = 2, shift_size: int = 1) -> None:
        super().__init__()
        self.window_size, self.shift_size = window_size, shift_size
        self.qkv = nn.Linear(dim, 3 * dim)

    def get_attn_mask(self, height: int, width: int, dtype: torch.dtype) -> torch.Tensor:
        img_mask = torch.zeros((1, height, width, 1), dtype=dtype)
        count = 0
        ws, ss = self.window_size, self.shift_size
        slices = (slice(0, -ws), slice(-ws, -ss), slice(-ss, None))
        for h in slices:
            for w in slices:
                img_mask[:, h, w, :] = count
                count += 1
        mask_windows = img_mask.view(-1, self.window_size * self.window_size)
        attn_mask = mask_windows.unsqueeze(1) - mask_windows.unsqueeze(2)
        return attn_mask.masked_fill(attn_mask != 0, -100.0).masked_fill(attn_mask == 0, 0.0)

    def forward(self, hidden_states: torch.Tensor, height: int, width: int) -> torch.Tensor:
        attn_mask = self.get_attn_mask(height, width, dtype=hidden_states.dtype)
        if attn_mask is not None:
            attn_mask = attn_mask.to(hidden_states.device)
        q, k, v = self.qkv(hidden_states).chunk(3, dim=-1)
        scores = q @ k.transpose(-1, -2) + attn_mask[: q.shape[1], : q.shape[1]]
        return scores.softmax(-1) @ v


# "the attention mask is initially created on the CPU, processed, and then moved to the device" (slow, not wrong)
@R.legal("huggingface/transformers#31294")
def swin_mask_built_on_cpu_then_moved(dev: torch.device, other: torch.device) -> Program:
    model = SwinLayer().to(dev)
    hidden_states = randn(1, 4, W, device=dev)
    return Program(model, lambda: model(hidden_states, 4, 4), (hidden_states, 4, 4))
