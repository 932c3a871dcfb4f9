"""HELD OUT: device mistakes and legal device patterns from other projects' public reports (speech, graphs,
recommenders, reinforcement learning, diffusion, detection, NLP, time series), kept from anyone changing the
diagnosis (issue 31). Do not read this file while working on torchplace.checks or torchplace.memory, do not score
it while doing so, and do not add it to any test that runs by default: the lead scores it once, at the end, with
`torchplace bench diagnose --corpus tests/checks/corpus_heldout4.py` (on the CPU and on GPUs), and records the
number. Its reports are different from those of every other corpus here (tests/checks/test_corpus_public.py checks
it).

Same shape as corpus_heldout3.py (see corpus_kit.py): each case cites its public source (owner/repo#number or a
documentation page), a mistake names what a report must contain (culprit, as the user wrote it), its module path
(from the user's own variable; None where the failing code runs outside any module's forward) and the user's line
(the line ending in `# case: NAME`); a legal pattern must raise nothing in any mode. On the CPU the pair is meta
(where the model runs) vs cpu (where a factory without a device lands); a case that only a real accelerator refuses
(meta kernels let matmul, convolution, embedding lookups, bucketize and indexing mix devices) lists the GPU pairs
only, and a case about two GPUs the cuda:1 vs cuda:0 pair only.

Every case was checked with plain torch (no torchplace) when written, with tools/corpus_plain_check.py: on cpu vs
meta each mistake raises torch's device error at its `# case:` line and each legal pattern runs; the GPU-only ones
were checked on fake cuda tensors (torch's FakeTensorMode) where fake tensors model the op, by torch's documented
rules otherwise.
"""

from __future__ import annotations

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


# --------------------------------------------------------------------------- mistakes: speech and audio

class SpectrogramFrontend(nn.Module):
    """A speech classifier whose front end takes the STFT with a Hann window made on each call."""

    def __init__(self, n_fft: int = 16, hop_length: int = 4, win_length: int = 16) -> None:
        super().__init__()
        self.n_fft, self.hop_length, self.win_length = n_fft, hop_length, win_length
        self.classifier = nn.Linear(n_fft // 2 + 1, C)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n_fft, hop_length, win_length = self.n_fft, self.hop_length, self.win_length
        window = torch.hann_window(window_length=win_length)
        spec = torch.stft(x, n_fft, hop_length, win_length, window, return_complex=True)  # case: stft_hann_window
        return self.classifier(spec.abs().mean(-1))


# torch.stft(x, ..., window=window) with x moved to CUDA and window = torch.hann_window(400) left on the CPU
@R.mistake("pytorch/pytorch#30865", ("window", "torch.hann_window"), "model")
def stft_hann_window(dev: torch.device, other: torch.device) -> Program:
    model = SpectrogramFrontend().to(dev)
    x = randn(2, 64, device=dev)
    return Program(model, lambda: model(x), (x,))


def stft(x: torch.Tensor, fft_size: int, hop_size: int, win_length: int, window: torch.Tensor) -> torch.Tensor:
    x_stft = torch.stft(x, fft_size, hop_size, win_length, window, return_complex=True)  # case: denoiser_stft_window
    return x_stft.abs().clamp(min=1e-7)


class STFTLoss(nn.Module):
    """The denoiser's STFT loss: its window is a plain attribute, so .to(device) leaves it on the CPU."""

    def __init__(self, fft_size: int = 16, shift_size: int = 4, win_length: int = 12) -> None:
        super().__init__()
        self.fft_size, self.shift_size, self.win_length = fft_size, shift_size, win_length
        self.window = torch.hann_window(win_length)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x_mag = stft(x, self.fft_size, self.shift_size, self.win_length, self.window)
        y_mag = stft(y, self.fft_size, self.shift_size, self.win_length, self.window)
        sc_loss = torch.norm(y_mag - x_mag, p="fro") / torch.norm(y_mag, p="fro")
        mag_loss = F.l1_loss(torch.log(y_mag), torch.log(x_mag))
        return sc_loss, mag_loss


class MultiResolutionSTFTLoss(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stft_losses = nn.ModuleList([STFTLoss(16, 4, 12), STFTLoss(32, 8, 24)])

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        sc_loss, mag_loss = 0.0, 0.0
        for f in self.stft_losses:
            sc_l, mag_l = f(x, y)
            sc_loss, mag_loss = sc_loss + sc_l, mag_loss + mag_l
        return sc_loss / len(self.stft_losses), mag_loss / len(self.stft_losses)


class Demucs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Conv1d(1, W, 5, padding=2)
        self.decoder = nn.Conv1d(W, 1, 5, padding=2)

    def forward(self, noisy: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.encoder(noisy).relu())


class Solver:
    def __init__(self, model: nn.Module, device: torch.device) -> None:
        self.model = model
        self.mrstftloss = MultiResolutionSTFTLoss().to(device)

    def _run_one_epoch(self, noisy: torch.Tensor, clean: torch.Tensor) -> torch.Tensor:
        explain_here(self.model, noisy)
        estimate = self.model(noisy)
        loss = F.l1_loss(clean, estimate)
        sc_loss, mag_loss = self.mrstftloss(estimate.squeeze(1), clean.squeeze(1))
        return loss + sc_loss + mag_loss


# the denoiser's STFT loss with stft_loss=true on a GPU: the loss module is moved, its window attribute is not
@R.mistake("facebookresearch/denoiser#27", "window", "mrstftloss.stft_losses.0")
def denoiser_stft_window(dev: torch.device, other: torch.device) -> Program:
    model = Demucs().to(dev)
    solver = Solver(model, dev)
    noisy, clean = randn(2, 1, 64, device=dev), randn(2, 1, 64, device=dev)
    return stepped(model, lambda: solver._run_one_epoch(noisy, clean), (noisy,))


class BandPassFilter:
    """torch-audiomentations' BandPassFilter, shortened: the center frequencies are drawn on the samples' device,
    the bandwidth fractions from a distribution of CPU tensors."""

    def __init__(self, min_center_frequency: float = 200.0, max_center_frequency: float = 4000.0,
                 min_bandwidth_fraction: float = 0.5, max_bandwidth_fraction: float = 1.99) -> None:
        self.min_center_frequency, self.max_center_frequency = min_center_frequency, max_center_frequency
        self.min_bandwidth_fraction, self.max_bandwidth_fraction = min_bandwidth_fraction, max_bandwidth_fraction

    def randomize_parameters(self, selected_samples: torch.Tensor) -> dict[str, torch.Tensor]:
        batch_size = selected_samples.shape[0]
        device = selected_samples.device
        center_dist = torch.distributions.Uniform(
            low=torch.tensor(self.min_center_frequency, dtype=torch.float32, device=device),
            high=torch.tensor(self.max_center_frequency, dtype=torch.float32, device=device), validate_args=False)
        center_freq = center_dist.sample(sample_shape=(batch_size,))
        bandwidth_dist = torch.distributions.Uniform(
            low=torch.tensor(self.min_bandwidth_fraction, dtype=torch.float32),
            high=torch.tensor(self.max_bandwidth_fraction, dtype=torch.float32), validate_args=False)
        bandwidth = center_freq * bandwidth_dist.sample(sample_shape=(batch_size,))  # case: bandwidth_dist_on_cpu
        return {"center_freq": center_freq, "bandwidth": bandwidth}

    def __call__(self, samples: torch.Tensor) -> torch.Tensor:
        params = self.randomize_parameters(samples)
        gain = (params["bandwidth"] / params["center_freq"]).clamp(max=1.0)
        return samples * gain[:, None, None]


def augmented_step(model: nn.Module, transform: BandPassFilter, audio: torch.Tensor) -> torch.Tensor:
    explain_here(model, audio)
    return model(transform(audio)).square().mean()


# "bandwidth_dist is allocated on the CPU while center_dist is allocated on the GPU"
@R.mistake("iver56/torch-audiomentations#137", "bandwidth_dist")
def bandwidth_dist_on_cpu(dev: torch.device, other: torch.device) -> Program:
    model = Demucs().to(dev)
    audio = randn(2, 1, 64, device=dev)
    return stepped(model, lambda: augmented_step(model, BandPassFilter(), audio), (audio,))


class Resample(nn.Module):
    """torchaudio's Resample since 0.9: the sinc kernel is computed once, in __init__, and kept as a buffer."""

    def __init__(self, orig_freq: int = 16000, new_freq: int = 8000) -> None:
        super().__init__()
        self.orig_freq, self.new_freq = orig_freq // 8000, new_freq // 8000
        self.register_buffer("kernel", torch.hann_window(8).reshape(1, 1, 8) / 4)

    def forward(self, waveform: torch.Tensor) -> torch.Tensor:
        resampled = F.conv1d(waveform[:, None], self.kernel, stride=self.orig_freq)  # case: resampler_left_on_cpu
        return resampled[:, 0]


# resampler = torchaudio.transforms.Resample(16000, 8000) applied to x on cuda:0 without resampler.to(...)
# (meta lets a convolution take a CPU weight)
@R.mistake("pytorch/audio#1619", "resampler", "resampler", pairs=GPU)
def resampler_left_on_cpu(dev: torch.device, other: torch.device) -> Program:
    resampler = Resample(16000, 8000)
    x = torch.rand(4, 64, device=dev)
    return Program(resampler, lambda: resampler(x), (x,))


# --------------------------------------------------------------------------- mistakes: graphs

class GCNConv(nn.Module):
    """A GCN layer, shortened: the features are transformed, then summed over edge_index."""

    def __init__(self, in_channels: int, out_channels: int) -> None:
        super().__init__()
        self.lin = nn.Linear(in_channels, out_channels)

    def forward(self, x: torch.Tensor, edge_index: torch.Tensor) -> torch.Tensor:
        x = self.lin(x)  # case: test_loader_data_not_moved
        out = torch.zeros_like(x)
        return out.index_add_(0, edge_index[1], x.index_select(0, edge_index[0])) + x


class Data:
    """A PyG-style graph batch."""

    def __init__(self, x: torch.Tensor, edge_index: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.edge_index, self.y = x, edge_index, y

    def to(self, device: torch.device) -> Data:
        return Data(self.x.to(device), self.edge_index.to(device), self.y.to(device))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = GCNConv(W, W)
        self.lin = nn.Linear(W, C)

    def forward(self, data: Data) -> torch.Tensor:
        x = self.conv1(data.x, data.edge_index).relu()
        return F.log_softmax(self.lin(x), dim=-1)


def train(model: nn.Module, optimizer: torch.optim.Optimizer, loader: list[Data], device: torch.device) -> None:
    for data in loader:
        data = data.to(device)
        optimizer.zero_grad()
        F.nll_loss(model(data), data.y.to(device)).backward()
        optimizer.step()


def test(model: nn.Module, loader: list[Data]) -> int:
    correct = 0
    for data in loader:
        data = data  # .to(device)
        explain_here(model, data)
        pred = model(data).max(dim=1)[1]
        correct += int(pred.eq(data.y).sum())
    return correct


# the clique-pooling GNN trained on the GPU: train() moves each batch, test() has `data = data#.to(device)`
@R.mistake("pyg-team/pytorch_geometric#5028", "data", "model.conv1.lin")
def test_loader_data_not_moved(dev: torch.device, other: torch.device) -> Program:
    model = Net().to(dev)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.0001, weight_decay=0.001)
    edge_index = torch.tensor([[0, 1, 2, 3], [1, 2, 3, 0]])
    loader = [Data(torch.randn(4, W), edge_index, torch.randint(0, C, (4,)))]
    train(model, optimizer, loader, dev)
    return stepped(model, lambda: test(model, loader), (loader[0].to(dev),), optimizer)


class DGLGraph:
    """A DGL graph, shortened: g.to(device) moves ndata, in_degrees() is computed from the CPU adjacency list."""

    def __init__(self, src: list[int], dst: list[int], num_nodes: int) -> None:
        self.src, self.dst, self.num_nodes = src, dst, num_nodes
        self.ndata: dict[str, torch.Tensor] = {}

    def to(self, device: torch.device) -> DGLGraph:
        g = DGLGraph(self.src, self.dst, self.num_nodes)
        g.ndata = {k: v.to(device) for k, v in self.ndata.items()}
        return g

    def in_degrees(self) -> torch.Tensor:
        return torch.bincount(torch.tensor(self.dst), minlength=self.num_nodes)

    def adjacency(self) -> torch.Tensor:
        adj = torch.zeros(self.num_nodes, self.num_nodes)
        adj[self.dst, self.src] = 1.0
        return adj


class GraphConv(nn.Module):
    def __init__(self, in_feats: int, out_feats: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(in_feats, out_feats) * 0.1)

    def forward(self, g: DGLGraph, feat: torch.Tensor) -> torch.Tensor:
        h = torch.matmul(feat, self.weight)  # case: dgl_in_degrees_on_cpu
        return g.ndata["adj"] @ h


class Classifier(nn.Module):
    def __init__(self, in_dim: int, hidden_dim: int, n_classes: int) -> None:
        super().__init__()
        self.conv1 = GraphConv(in_dim, hidden_dim)
        self.classify = nn.Linear(hidden_dim, n_classes)

    def forward(self, g: DGLGraph) -> torch.Tensor:
        h = g.in_degrees().view(-1, 1).float()
        h = self.conv1(g, h).relu()
        return self.classify(h.mean(0, keepdim=True))


# the DGL batched-graph tutorial on cuda: h = g.in_degrees().view(-1, 1).float() is on the CPU even after g.to(device)
# (meta lets matmul take a CPU operand)
@R.mistake("dmlc/dgl#1594", "h", "model.conv1", pairs=GPU)
def dgl_in_degrees_on_cpu(dev: torch.device, other: torch.device) -> Program:
    model = Classifier(1, W, C).to(dev)
    g = DGLGraph([0, 1, 2, 3], [1, 2, 3, 0], 4)
    g.ndata["adj"] = g.adjacency()
    bg = g.to(dev)
    return Program(model, lambda: model(bg), (bg,))


def negative_sampling(edge_index: torch.Tensor, num_nodes: int, num_neg_samples: int) -> torch.Tensor:
    """Random node pairs, drawn (as in the user's copy of the split) without a device."""
    return torch.randint(0, num_nodes, (2, num_neg_samples))


class RandomLinkSplit:
    """The user's improved_random_link_split.py, shortened: labels for positive and negative edges."""

    def __call__(self, x: torch.Tensor, edge_index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        num_neg = edge_index.size(1)
        neg_edge_index = negative_sampling(edge_index, x.size(0), num_neg)
        edge_label = torch.cat([torch.ones(num_neg, device=x.device), torch.zeros(num_neg, device=x.device)])
        return self._create_label(edge_index, neg_edge_index), edge_label

    def _create_label(self, edge_index: torch.Tensor, neg_edge_index: torch.Tensor) -> torch.Tensor:
        edge_index = torch.cat([edge_index, neg_edge_index], dim=-1)  # case: neg_edge_index_on_cpu
        return edge_index


class LinkPredictor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = GCNConv(W, W)

    def encode(self, x: torch.Tensor, edge_index: torch.Tensor) -> torch.Tensor:
        return self.conv1(x, edge_index)

    def decode(self, z: torch.Tensor, edge_label_index: torch.Tensor) -> torch.Tensor:
        return (z[edge_label_index[0]] * z[edge_label_index[1]]).sum(dim=-1)

    def forward(self, x: torch.Tensor, edge_index: torch.Tensor) -> torch.Tensor:
        return self.encode(x, edge_index)


def link_pred_step(model: LinkPredictor, x: torch.Tensor, edge_index: torch.Tensor) -> torch.Tensor:
    explain_here(model, x, edge_index)
    edge_label_index, edge_label = RandomLinkSplit()(x, edge_index)
    z = model(x, edge_index)
    return F.binary_cross_entropy_with_logits(model.decode(z, edge_label_index), edge_label)


# PyG's link_pred example on Colab, with the dataset moved to cuda: the negative edges sampled in the split are on
# the CPU, and torch.cat([edge_index, neg_edge_index]) fails
@R.mistake("pyg-team/pytorch_geometric#3709", "neg_edge_index")
def neg_edge_index_on_cpu(dev: torch.device, other: torch.device) -> Program:
    model = LinkPredictor().to(dev)
    x, edge_index = randn(4, W, device=dev), torch.tensor([[0, 1, 2, 3], [1, 2, 3, 0]], device=dev)
    return stepped(model, lambda: link_pred_step(model, x, edge_index), (x, edge_index))


# --------------------------------------------------------------------------- mistakes: detection

def convert_locations_to_boxes(locations: torch.Tensor, priors: torch.Tensor, center_variance: float,
                               size_variance: float) -> torch.Tensor:
    if priors.dim() + 1 == locations.dim():
        priors = priors.unsqueeze(0)
    return torch.cat([
        locations[..., :2] * center_variance * priors[..., 2:] + priors[..., :2],  # case: ssd_priors_on_cpu
        torch.exp(locations[..., 2:] * size_variance) * priors[..., 2:]], dim=locations.dim() - 1)


class SSD(nn.Module):
    """pytorch-ssd's SSD, shortened: the priors are a plain attribute handed over from the config."""

    def __init__(self, num_classes: int, priors: torch.Tensor, is_test: bool = True) -> None:
        super().__init__()
        self.base_net = nn.Conv2d(3, W, 3, padding=1)
        self.classification_headers = nn.Conv2d(W, num_classes, 1)
        self.regression_headers = nn.Conv2d(W, 4, 1)
        self.is_test = is_test
        self.priors = priors
        self.center_variance, self.size_variance = 0.1, 0.2

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = self.base_net(x).relu()
        confidences = self.classification_headers(y).flatten(2).transpose(1, 2)
        locations = self.regression_headers(y).flatten(2).transpose(1, 2)
        if self.is_test:
            confidences = F.softmax(confidences, dim=2)
            boxes = convert_locations_to_boxes(locations, self.priors, self.center_variance, self.size_variance)
            return confidences, boxes
        return confidences, locations


class Predictor:
    def __init__(self, net: nn.Module) -> None:
        self.net = net

    def predict(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        explain_here(self.net, images)
        with torch.no_grad():
            scores, boxes = self.net.forward(images)
        return scores[0], boxes[0]


# run_ssd_example.py on a Jetson: the net is on cuda, self.priors (from the config) on the CPU
@R.mistake("dusty-nv/jetson-inference#1041", "priors", "net")
def ssd_priors_on_cpu(dev: torch.device, other: torch.device) -> Program:
    priors = torch.rand(16, 4)
    net = SSD(C, priors, is_test=True).to(dev)
    predictor = Predictor(net)
    images = randn(1, 3, 4, 4, device=dev)
    return stepped(net, lambda: predictor.predict(images), (images,))


class BlazeFace(nn.Module):
    """face-alignment's BlazeFace, shortened: the anchors are loaded from a file into a plain attribute."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Conv2d(3, W, 3, padding=1)
        self.regressor = nn.Conv2d(W, 4, 1)
        self.x_scale, self.y_scale, self.w_scale, self.h_scale = 128.0, 128.0, 128.0, 128.0

    def load_anchors(self, path: np.ndarray) -> None:
        self.anchors = torch.tensor(path, dtype=torch.float32)

    def _decode_boxes(self, raw_boxes: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
        boxes = torch.zeros_like(raw_boxes)
        x_center = raw_boxes[..., 0] / self.x_scale * anchors[:, 2] + anchors[:, 0]  # case: blazeface_anchors_on_cpu
        y_center = raw_boxes[..., 1] / self.y_scale * anchors[:, 3] + anchors[:, 1]
        boxes[..., 0], boxes[..., 1] = x_center, y_center
        return boxes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raw_boxes = self.regressor(self.backbone(x).relu()).flatten(2).transpose(1, 2)
        return self._decode_boxes(raw_boxes, self.anchors)


# BlazeFace on a CUDA device: _decode_boxes() mixes the GPU raw boxes with the anchors left on the CPU
@R.mistake("1adrianb/face-alignment#200", "anchors", "face_detector")
def blazeface_anchors_on_cpu(dev: torch.device, other: torch.device) -> Program:
    face_detector = BlazeFace().to(dev)
    face_detector.load_anchors(np.random.rand(16, 4))
    img = randn(1, 3, 4, 4, device=dev)
    return Program(face_detector, lambda: face_detector(img), (img,))


# --------------------------------------------------------------------------- mistakes: NLP

class GPT2LMHeadModel(nn.Module):
    def __init__(self, vocab_size: int = 16) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab_size, W)
        self.lm_head = nn.Linear(W, vocab_size)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.wte(input_ids).cumsum(1))


def choose_from_top_k_top_n(probs: np.ndarray) -> int:
    return int(np.argmax(probs))


@torch.no_grad()
def generate(tokenizer_ids: list[int], model: nn.Module, device: torch.device, max_len: int = 3) -> torch.Tensor:
    cur_ids = torch.tensor(tokenizer_ids).unsqueeze(0).long()
    explain_here(model, cur_ids)
    for _ in range(max_len):
        logits = model(cur_ids)
        softmax_logits = torch.softmax(logits[0, -1], dim=0)
        next_token_id = choose_from_top_k_top_n(softmax_logits.to("cpu").numpy())
        cur_ids = torch.cat([cur_ids, torch.ones((1, 1)).long().to(device) * next_token_id], dim=1)  # case: gpt2_cat
    return cur_ids


# the text-augmentation generate(): DEVICE is "cuda", but the model was never moved and cur_ids stay on the CPU;
# only the sampled token is sent .to(device), and torch.cat gets a CPU and a CUDA tensor (a CPU model, so no
# cuda:1-vs-cuda:0 pair)
@R.mistake("prakhar21/TextAugmentation-GPT2#8", ("cur_ids", "torch.ones"), pairs=("cpu-meta", "cuda-cpu"))
def gpt2_cat(dev: torch.device, other: torch.device) -> Program:
    model = GPT2LMHeadModel().to(other)
    return stepped(model, lambda: generate([1, 2, 3], model, dev), (torch.tensor([[1, 2, 3]], device=other),))


class NLL(nn.Module):
    """A MeanMetric-style aggregate: its states are buffers, moved with the module."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("mean_value", torch.tensor(0.0))
        self.register_buffer("weight", torch.tensor(0.0))

    def update(self, value: torch.Tensor, weight: torch.Tensor) -> None:
        self.mean_value += value.sum()
        self.weight += weight.sum()

    def compute(self) -> torch.Tensor:
        return self.mean_value / self.weight


class Diffusion(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.backbone = GPT2LMHeadModel()
        self.gen_ppl = NLL()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.backbone(x)

    def compute_generative_perplexity(self, retokenized: torch.Tensor, pad_token_id: int = 0) -> torch.Tensor:
        eval_ids = retokenized.to(self.backbone.lm_head.weight.device)
        logits = self(eval_ids)
        nlls = F.cross_entropy(logits[:, :-1].transpose(1, 2), eval_ids[:, 1:], reduction="none")
        valid_tokens = (retokenized[:, 1:] != pad_token_id).float()
        self.gen_ppl.update(nlls * valid_tokens, valid_tokens)  # case: gen_ppl_valid_tokens_on_cpu
        return self.gen_ppl.compute()


def sample_eval(model: Diffusion, retokenized: torch.Tensor) -> torch.Tensor:
    explain_here(model, retokenized.to(model.backbone.lm_head.weight.device))
    return model.compute_generative_perplexity(retokenized)


# didi-instruct's sample_eval: the NLL metric's buffers and the nlls are on the GPU, the valid_tokens mask (from the
# samples retokenized on the CPU) is not
@R.mistake("haoyangzheng-ai/didi-instruct#1", "valid_tokens")
def gen_ppl_valid_tokens_on_cpu(dev: torch.device, other: torch.device) -> Program:
    model = Diffusion().to(dev)
    retokenized = torch.randint(1, 16, (2, 6), device=other)
    return stepped(model, lambda: sample_eval(model, retokenized), (retokenized.to(dev),))


class LlamaForCausalLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(16, W)
        self.lm_head = nn.Linear(W, 16)

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.embed_tokens(input_ids))  # case: llama_input_ids_left_on_cpu

    def generate(self, input_ids: torch.Tensor, max_new_tokens: int = 2) -> torch.Tensor:
        for _ in range(max_new_tokens):
            next_token = self(input_ids)[:, -1].argmax(-1, keepdim=True)
            input_ids = torch.cat([input_ids, next_token], dim=1)
        return input_ids


def open_llama_generate(model: LlamaForCausalLM, prompt_ids: list[int]) -> torch.Tensor:
    input_ids = torch.tensor([prompt_ids])
    explain_here(model, input_ids)
    return model.generate(input_ids=input_ids, max_new_tokens=2)


# OpenLLaMA loaded with device_map='auto' puts the model on the GPU; the tokenizer's input_ids stay on the CPU
# (the answer: input_ids = input_ids.to(model.device)); meta lets an embedding lookup take CPU indices
@R.mistake("openlm-research/open_llama#76", "input_ids", "model.embed_tokens", pairs=GPU)
def llama_input_ids_left_on_cpu(dev: torch.device, other: torch.device) -> Program:
    model = LlamaForCausalLM().to(dev)
    return stepped(model, lambda: open_llama_generate(model, [1, 2, 3]), (torch.tensor([[1, 2, 3]], device=dev),))


class BlockDiagonalCausalMask:
    """xformers' attention bias: from_seqlens() builds its tensors on `device`, "cuda" (the current GPU) if unset."""

    def __init__(self, seqstart: torch.Tensor) -> None:
        self.seqstart = seqstart

    @classmethod
    def from_seqlens(cls, q_seqlen: list[int], device: torch.device | str | None = None) -> BlockDiagonalCausalMask:
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"  # cuda-only: xformers' default device
        return cls(torch.tensor([0, *np.cumsum(q_seqlen).tolist()], device=device))

    def materialize(self, n: int, device: torch.device) -> torch.Tensor:
        mask = torch.full((n, n), float("-inf"), device=device).triu(1)
        return mask


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wq, self.wk, self.wv = nn.Linear(W, W), nn.Linear(W, W), nn.Linear(W, W)

    def forward(self, x: torch.Tensor, mask: BlockDiagonalCausalMask) -> torch.Tensor:
        q, k, v = self.wq(x), self.wk(x), self.wv(x)
        attn_bias = mask.materialize(x.shape[0], mask.seqstart.device)
        scores = q @ k.transpose(-1, -2) + attn_bias  # case: mistral_mask_default_cuda
        return scores.softmax(-1) @ v


class Transformer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention = Attention()
        self.output = nn.Linear(W, C)

    def forward(self, x: torch.Tensor, seqlens: list[int]) -> torch.Tensor:
        mask = BlockDiagonalCausalMask.from_seqlens(seqlens)
        return self.output(self.attention(x, mask))


# mistral-inference on cuda:7 (here cuda:1): the cache builds its attention masks with from_seqlens() and no device,
# so they land on cuda:0
@R.mistake("mistralai/mistral-inference#215", ("mask", "from_seqlens"), "model.attention", pairs=TWO_GPUS)
def mistral_mask_default_cuda(dev: torch.device, other: torch.device) -> Program:
    model = Transformer().to(dev)
    x = randn(4, W, device=dev)
    return Program(model, lambda: model(x, [4]), (x, [4]))


# --------------------------------------------------------------------------- mistakes: diffusion

class UNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv_in = nn.Conv2d(4, W, 3, padding=1)
        self.conv_out = nn.Conv2d(W, 4, 3, padding=1)

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return self.conv_out(self.conv_in(x).relu())


class DDPMScheduler:
    """diffusion-ddpm's scheduler: betas from torch.linspace() without a device, so alphas_hat live on the CPU."""

    def __init__(self, num_timesteps: int = 10, beta_start: float = 1e-4, beta_end: float = 0.02) -> None:
        self.num_timesteps = num_timesteps
        self.betas = torch.linspace(beta_start, beta_end, num_timesteps)
        self.alphas = 1.0 - self.betas
        self.alphas_hat = torch.cumprod(self.alphas, dim=0)

    def add_noise(self, images: torch.Tensor, timesteps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        alpha_hat = self.alphas_hat[timesteps].to(images.device)  # case: alphas_hat_indexed_by_gpu_timesteps
        alpha_hat = alpha_hat[:, None, None, None]
        noise = torch.randn_like(images)
        return alpha_hat.sqrt() * images + (1 - alpha_hat).sqrt() * noise, noise


def ddpm_train_step(model: nn.Module, noise_scheduler: DDPMScheduler, images: torch.Tensor,
                    device: torch.device) -> torch.Tensor:
    timesteps = torch.randint(0, noise_scheduler.num_timesteps, (images.shape[0],), device=device)
    explain_here(model, images, timesteps)
    noisy_images, noise = noise_scheduler.add_noise(images, timesteps)
    return F.mse_loss(model(noisy_images, timesteps), noise)


# "self.alphas_hat[timesteps].to(images.device) triggers a device mismatch": timesteps are made on the training
# device, the table they index on the CPU (meta lets a CPU tensor take meta indices)
@R.mistake("mattroz/diffusion-ddpm#5", ("alphas_hat", "timesteps"), pairs=GPU)
def alphas_hat_indexed_by_gpu_timesteps(dev: torch.device, other: torch.device) -> Program:
    model = UNet().to(dev)
    images = randn(2, 4, 4, 4, device=dev)
    return stepped(model, lambda: ddpm_train_step(model, DDPMScheduler(), images, dev), (images, labels(2, dev)))


class EulerDiscreteScheduler:
    """diffusers' Euler scheduler, shortened: set_timesteps(device=...) moves timesteps and sigmas, never
    alphas_cumprod."""

    def __init__(self, num_train_timesteps: int = 10) -> None:
        betas = torch.linspace(0.00085 ** 0.5, 0.012 ** 0.5, num_train_timesteps) ** 2
        self.alphas_cumprod = torch.cumprod(1.0 - betas, dim=0)
        self.num_train_timesteps = num_train_timesteps

    def set_timesteps(self, num_inference_steps: int, device: torch.device) -> None:
        timesteps = torch.linspace(self.num_train_timesteps - 1, 0, num_inference_steps).round().long()
        sigmas = ((1 - self.alphas_cumprod[timesteps]) / self.alphas_cumprod[timesteps]) ** 0.5
        self.timesteps, self.sigmas = timesteps.to(device), sigmas.to(device)
        self.init_noise_sigma = self.sigmas.max()


class StableDiffusionSAGPipeline:
    def __init__(self, unet: nn.Module, scheduler: EulerDiscreteScheduler) -> None:
        self.unet, self.scheduler = unet, scheduler

    def pred_x0(self, sample: torch.Tensor, model_output: torch.Tensor, timestep: torch.Tensor) -> torch.Tensor:
        alpha_prod_t = self.scheduler.alphas_cumprod[timestep]  # case: sag_alphas_cumprod_gpu_timestep
        beta_prod_t = 1 - alpha_prod_t
        return (sample - beta_prod_t ** 0.5 * model_output) / alpha_prod_t ** 0.5

    def __call__(self, latents: torch.Tensor, num_inference_steps: int = 3) -> torch.Tensor:
        self.scheduler.set_timesteps(num_inference_steps, device=latents.device)
        explain_here(self.unet, latents, self.scheduler.timesteps[0])
        for t in self.scheduler.timesteps:
            noise_pred = self.unet(latents, t)
            pred_x0 = self.pred_x0(latents, noise_pred, t)
            latents = 0.5 * (latents + pred_x0)
        return latents


# StableDiffusionSAGPipeline with an Euler scheduler: pred_x0 indexes the CPU alphas_cumprod with a GPU timestep
# (meta lets a CPU tensor take meta indices)
@R.mistake("huggingface/diffusers#4924", ("alphas_cumprod", "timestep"), pairs=GPU)
def sag_alphas_cumprod_gpu_timestep(dev: torch.device, other: torch.device) -> Program:
    unet = UNet().to(dev)
    pipe = StableDiffusionSAGPipeline(unet, EulerDiscreteScheduler())
    latents = randn(1, 4, 4, 4, device=dev)
    return stepped(unet, lambda: pipe(latents), (latents, torch.tensor(9, device=dev)))


def get_random_noise(n_imgs: int, height: int, width: int, generator: torch.Generator | None = None) -> torch.Tensor:
    return torch.randn((n_imgs, 4, height // 8, width // 8), generator=generator, device="cpu")


def get_initial_latents(scheduler: EulerDiscreteScheduler, n_imgs: int, height: int, width: int,
                        n_prompts: int, generator: torch.Generator | None = None) -> torch.Tensor:
    noise = get_random_noise(n_imgs, height, width, generator=generator).repeat(n_prompts, 1, 1, 1)
    latents = noise * scheduler.init_noise_sigma  # case: euler_init_noise_sigma_on_gpu
    return latents


def slider_train_step(unet: nn.Module, scheduler: EulerDiscreteScheduler, device: torch.device) -> torch.Tensor:
    scheduler.set_timesteps(3, device=device)
    explain_here(unet, torch.zeros(1, 4, 4, 4, device=device), scheduler.timesteps[0])
    latents = get_initial_latents(scheduler, 1, 32, 32, 1)
    return unet(latents.to(device), scheduler.timesteps[0])


# the sliders training script with noise_scheduler euler_a: the CPU noise times init_noise_sigma, a 0-dim tensor on
# the GPU (a 0-dim tensor is only let through when it is on the CPU)
@R.mistake("rohitgandikota/sliders#20", ("noise", "init_noise_sigma"))
def euler_init_noise_sigma_on_gpu(dev: torch.device, other: torch.device) -> Program:
    unet = UNet().to(dev)
    scheduler = EulerDiscreteScheduler()
    return stepped(unet, lambda: slider_train_step(unet, scheduler, dev),
                   (torch.zeros(1, 4, 4, 4, device=dev), torch.tensor(9, device=dev)))


class FlowMatchScheduler:
    """Bernini's FlowMatchScheduler: set_timesteps(device=...) is honoured, step() sends the timestep to .cuda()."""

    def set_timesteps(self, num_inference_steps: int, device: torch.device) -> None:
        self.timesteps = torch.linspace(1000, 0, num_inference_steps, device=device)
        self.sigmas = self.timesteps / 1000

    def step(self, model_output: torch.Tensor, timestep: torch.Tensor, sample: torch.Tensor) -> torch.Tensor:
        if isinstance(timestep, torch.Tensor):
            timestep = timestep.cuda()
        timestep_id = torch.argmin((self.timesteps - timestep).abs())  # case: flow_match_step_timestep_cuda
        sigma = self.sigmas[timestep_id]
        sigma_ = self.sigmas[min(int(timestep_id) + 1, len(self.sigmas) - 1)]
        return sample + model_output * (sigma_ - sigma)


def flow_sample(dit: nn.Module, scheduler: FlowMatchScheduler, latents: torch.Tensor) -> torch.Tensor:
    scheduler.set_timesteps(3, device=latents.device)
    explain_here(dit, latents, scheduler.timesteps[0])
    for timestep in scheduler.timesteps:
        latents = scheduler.step(dit(latents, timestep), timestep, latents)
    return latents


# on a non-default GPU the scheduler's timesteps are on cuda:1 and timestep.cuda() moves each step's timestep to the
# current GPU, 0
@R.mistake("bytedance/Bernini#61", ("timestep", ".cuda()"), pairs=TWO_GPUS)
def flow_match_step_timestep_cuda(dev: torch.device, other: torch.device) -> Program:
    dit = UNet().to(dev)
    latents = randn(1, 4, 4, 4, device=dev)
    return stepped(dit, lambda: flow_sample(dit, FlowMatchScheduler(), latents),
                   (latents, torch.tensor(1000.0, device=dev)))


# --------------------------------------------------------------------------- mistakes: reinforcement learning

class EnvModel:
    """A GOPS environment model: its action bounds are CPU tensors."""

    def __init__(self) -> None:
        self.action_lower_bound = torch.tensor([-2.0, -1.0])
        self.action_upper_bound = torch.tensor([2.0, 1.0])


class ScaleActionData:
    """GOPS' scale_action wrapper: the scaled bounds are made from the model's (CPU) bounds."""

    def __init__(self, model: EnvModel, min_action: float = -1.0, max_action: float = 1.0) -> None:
        self.model = model
        self.min_action = torch.zeros_like(model.action_lower_bound) + min_action
        self.max_action = torch.zeros_like(model.action_upper_bound) + max_action
        self.action_lower_bound = self.min_action
        self.action_upper_bound = self.max_action

    def action(self, action: torch.Tensor) -> torch.Tensor:
        action = torch.clip(action, self.min_action, self.max_action)  # case: scale_action_bounds_on_cpu
        lb, ub = self.model.action_lower_bound, self.model.action_upper_bound
        return lb + (action - self.min_action) * (ub - lb) / (self.max_action - self.min_action)


def rollout_step(policy: nn.Module, env_model: ScaleActionData, obs: torch.Tensor) -> torch.Tensor:
    explain_here(policy, obs)
    action = policy(obs).tanh()
    return env_model.action(action)


# GOPS trained with enable_cuda: the policy's actions are on cuda, the wrapper's min_action/max_action on the CPU
@R.mistake("Intelligent-Driving-Laboratory/GOPS#15", "min_action")
def scale_action_bounds_on_cpu(dev: torch.device, other: torch.device) -> Program:
    policy = nn.Sequential(nn.Linear(W, W), nn.Tanh(), nn.Linear(W, 2)).to(dev)
    env_model = ScaleActionData(EnvModel())
    obs = randn(4, W, device=dev)
    return stepped(policy, lambda: rollout_step(policy, env_model, obs), (obs,))


def search(ob: torch.Tensor, x: torch.Tensor, y: torch.Tensor, depth: int, n: int) -> bool:
    return bool(ob[x, y] < 1.0)  # case: placement_obs_indexed_by_gpu_action


class PlaceEnv:
    """DeepPlace's placement environment: the grid observation stays on the CPU."""

    def __init__(self, n: int = 4) -> None:
        self.n = n
        self.obs = torch.zeros(1, 1, n, n)

    def step(self, action: torch.Tensor) -> tuple[torch.Tensor, bool]:
        x, y = action // self.n, action % self.n
        done = search(self.obs[0, 0], x, y, 0, self.n)
        return self.obs, done


def placement_step(actor_critic: nn.Module, envs: PlaceEnv, device: torch.device) -> bool:
    obs = envs.obs.flatten(1).to(device)
    explain_here(actor_critic, obs)
    action = actor_critic(obs).argmax(-1)
    obs, done = envs.step(action)
    return done


# DeepPlace's training loop: the action comes from the policy on the GPU, so x and y index the CPU observation with
# GPU indices (meta lets a CPU tensor take meta indices)
@R.mistake("Thinklab-SJTU/EDA-AI#21", ("ob", "x"), pairs=GPU)
def placement_obs_indexed_by_gpu_action(dev: torch.device, other: torch.device) -> Program:
    actor_critic = nn.Sequential(nn.Linear(16, W), nn.ReLU(), nn.Linear(W, 16)).to(dev)
    envs = PlaceEnv()
    return stepped(actor_critic, lambda: placement_step(actor_critic, envs, dev), (torch.zeros(1, 16, device=dev),))


# --------------------------------------------------------------------------- mistakes: recommenders

class EmbeddingMult(nn.Module):
    """A collaborative-filtering model: the dot product of a user and an item embedding."""

    def __init__(self, n_factors: int, n_users: int, n_items: int) -> None:
        super().__init__()
        self.u = nn.Embedding(n_users, n_factors)
        self.m = nn.Embedding(n_items, n_factors)

    def forward(self, cats: torch.Tensor) -> torch.Tensor:
        users, movies = cats[:, 0], cats[:, 1]
        u, m = self.u(users), self.m(movies)  # case: collab_embeddings_never_moved
        return (u * m).sum(1)


class CollabFilterModel(nn.Module):
    def __init__(self, em_model: nn.Module) -> None:
        super().__init__()
        self.em_model = em_model

    def forward(self, cats: torch.Tensor) -> torch.Tensor:
        return self.em_model(cats)


def collab_fit(model: nn.Module, opt: torch.optim.Optimizer, cats: torch.Tensor, ratings: torch.Tensor) -> None:
    explain_here(model, cats, optimizer=opt)
    F.mse_loss(model(cats), ratings).backward()
    opt.step()


# the notebook's EmbeddingMult, made without .cuda() while fastai's learner puts each batch on the GPU
# (meta lets an embedding lookup take meta indices into a CPU table)
@R.mistake("anhquan0412/basic_model_scratch#1", "em_model", "model.em_model.u", pairs=GPU)
def collab_embeddings_never_moved(dev: torch.device, other: torch.device) -> Program:
    em_model = EmbeddingMult(4, 10, 12)
    model = CollabFilterModel(em_model)
    opt = torch.optim.Adam(model.parameters(), 1e-2, weight_decay=1e-4)
    cats = torch.stack([torch.randint(0, 10, (8,)), torch.randint(0, 12, (8,))], 1).to(dev)
    ratings = torch.rand(8, device=dev) * 5
    return stepped(model, lambda: collab_fit(model, opt, cats, ratings), (cats,), opt)


class BagOfWords(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bow = nn.EmbeddingBag(10, W)
        self.fc = nn.Linear(W, C)

    def forward(self, text: torch.Tensor) -> torch.Tensor:
        return self.fc(self.bow(text))  # case: embedding_bag_cpu_input


# bow = torch.nn.EmbeddingBag(10, 10).cuda(); bow(torch.tensor([[1, 2]], dtype=torch.long).cpu())
# (meta lets an embedding bag take CPU indices)
@R.mistake("pytorch/pytorch#7689", "test", "model.bow", pairs=GPU)
def embedding_bag_cpu_input(dev: torch.device, other: torch.device) -> Program:
    model = BagOfWords().to(dev)
    test = torch.tensor([[1, 2]], dtype=torch.long).cpu()
    return Program(model, lambda: model(test), (test.to(dev),))


# --------------------------------------------------------------------------- mistakes: time series

class MeanScaleUniformBins:
    """Chronos' tokenizer: the bin boundaries are made once, on the CPU, where it expects the context to be."""

    def __init__(self, low_limit: float = -15.0, high_limit: float = 15.0, n_tokens: int = 16) -> None:
        self.centers = torch.linspace(low_limit, high_limit, n_tokens - 1)
        self.boundaries = torch.concat((torch.tensor([-1e20]), (self.centers[1:] + self.centers[:-1]) / 2,
                                        torch.tensor([1e20])))

    def context_input_transform(self, context: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scale = context.abs().mean(dim=-1).clamp(min=1e-8)
        scaled_context = context / scale.unsqueeze(-1)
        token_ids = torch.bucketize(input=scaled_context, boundaries=self.boundaries, right=True)  # case: chronos_bins
        return token_ids.clamp(0, 15), scale


class ChronosModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, W)
        self.head = nn.Linear(W, 16)

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(token_ids).mean(1))


class ChronosPipeline:
    def __init__(self, model: nn.Module) -> None:
        self.model, self.tokenizer = model, MeanScaleUniformBins()

    def predict(self, context: torch.Tensor) -> torch.Tensor:
        token_ids, scale = self.tokenizer.context_input_transform(context)
        explain_here(self.model, token_ids.to(self.model.head.weight.device))
        return self.model(token_ids.to(self.model.head.weight.device))


# context_tensor = torch.tensor(df[TARGET].tolist(), device=device) handed to a pipeline on the GPU: the tokenizer's
# boundaries stay on the CPU ("ensuring that the input batches you pass live on CPU should make it work")
# (meta lets bucketize take CPU boundaries)
@R.mistake("amazon-science/chronos-forecasting#208", ("context_tensor", "boundaries"), pairs=GPU)
def chronos_bins(dev: torch.device, other: torch.device) -> Program:
    model = ChronosPipeline(ChronosModel().to(dev))
    context_tensor = torch.tensor(np.random.rand(2, 12).tolist(), dtype=torch.float32, device=dev)
    return stepped(model.model, lambda: model.predict(context_tensor),
                   (torch.randint(0, 16, (2, 12), device=dev),))


def init_hidden(x: torch.Tensor, hidden_size: int) -> torch.Tensor:
    return torch.zeros(1, x.size(0), hidden_size)


class Encoder(nn.Module):
    """DA-RNN's input-attention encoder: the initial hidden and cell states come from init_hidden()."""

    def __init__(self, input_size: int, hidden_size: int, T: int) -> None:
        super().__init__()
        self.input_size, self.hidden_size, self.T = input_size, hidden_size, T
        self.lstm_layer = nn.LSTM(input_size=input_size, hidden_size=hidden_size, num_layers=1)
        self.attn_linear = nn.Linear(in_features=2 * hidden_size + T - 1, out_features=1)

    def forward(self, input_data: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        input_encoded = input_data.new_zeros(input_data.size(0), self.T - 1, self.hidden_size)
        hidden = init_hidden(input_data, self.hidden_size)
        cell = init_hidden(input_data, self.hidden_size)
        for t in range(self.T - 1):
            x = torch.cat((hidden.repeat(self.input_size, 1, 1).permute(1, 0, 2),  # case: da_rnn_init_hidden_on_cpu
                           cell.repeat(self.input_size, 1, 1).permute(1, 0, 2),
                           input_data.permute(0, 2, 1)), dim=2)
            x = self.attn_linear(x.view(-1, self.hidden_size * 2 + self.T - 1))
            attn_weights = F.softmax(x.view(-1, self.input_size), dim=1)
            weighted_input = torch.mul(attn_weights, input_data[:, t, :])
            _, (hidden, cell) = self.lstm_layer(weighted_input.unsqueeze(0), (hidden, cell))
            input_encoded[:, t, :] = hidden[0]
        return attn_weights, input_encoded


class DaRnnNet(nn.Module):
    def __init__(self, encoder: nn.Module) -> None:
        super().__init__()
        self.encoder = encoder
        self.fc = nn.Linear(W, 1)

    def forward(self, X: torch.Tensor) -> torch.Tensor:
        _, input_encoded = self.encoder(X)
        return self.fc(input_encoded[:, -1])


# DA-RNN on the GPU: init_hidden() makes the encoder's initial states with torch.zeros() and no device, and the first
# torch.cat mixes them with the GPU input ("All input tensors must be on the same device. Received cpu and cuda:0")
@R.mistake("Seanny123/da-rnn#22", ("hidden", "init_hidden"), "t_net.encoder")
def da_rnn_init_hidden_on_cpu(dev: torch.device, other: torch.device) -> Program:
    t_net = DaRnnNet(Encoder(input_size=3, hidden_size=W, T=5)).to(dev)
    X = randn(2, 4, 3, device=dev)
    return Program(t_net, lambda: t_net(X), (X,))


# --------------------------------------------------------------------------- mistakes: metrics

class Accuracy(nn.Module):
    """torchmetrics' Accuracy, shortened: its states are added with add_state() as CPU buffers."""

    def __init__(self, num_classes: int = C) -> None:
        super().__init__()
        self.add_state("tp", default=torch.zeros(num_classes))
        self.add_state("support", default=torch.zeros(num_classes))

    def add_state(self, name: str, default: torch.Tensor) -> None:
        self.register_buffer(name, default)

    def update(self, preds: torch.Tensor, target: torch.Tensor) -> None:
        pred_labels = preds.argmax(-1) if preds.dim() == target.dim() + 1 else (preds > 0.5).long()
        hits = F.one_hot(target, C).float() * F.one_hot(pred_labels, C).float()
        self.tp += hits.sum(0)  # case: accuracy_metric_not_moved
        self.support += F.one_hot(target, C).float().sum(0)

    def forward(self, preds: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        self.update(preds, target)
        return self.tp.sum() / self.support.sum()


# accuracy = torchmetrics.Accuracy(); accuracy(preds.cuda(), target.cuda()): the metric itself was never moved
# (meta lets an in-place add into a CPU tensor take a meta tensor)
@R.mistake("Lightning-AI/torchmetrics#917", "accuracy", "accuracy", pairs=GPU)
def accuracy_metric_not_moved(dev: torch.device, other: torch.device) -> Program:
    accuracy = Accuracy()
    preds = torch.tensor([[0.6, 0.9, 0.3], [0.1, 0.6, 0.1]])
    target = torch.tensor([1, 0])
    return Program(accuracy, lambda: accuracy(preds.to(dev), target.to(dev)), (preds.to(dev), target.to(dev)))


def categorical_accuracy(preds: torch.Tensor, y: torch.Tensor, tag_pad_idx: int) -> torch.Tensor:
    max_preds = preds.argmax(dim=1, keepdim=True)
    non_pad_elements = (y != tag_pad_idx).nonzero()
    correct = max_preds[non_pad_elements].squeeze(1).eq(y[non_pad_elements])
    return correct.sum() / torch.FloatTensor([y[non_pad_elements].shape[0]])  # case: pos_tagging_accuracy_denominator


class BiLSTMPOSTagger(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(16, W)
        self.lstm = nn.LSTM(W, W, bidirectional=True)
        self.fc = nn.Linear(2 * W, C)

    def forward(self, text: torch.Tensor) -> torch.Tensor:
        outputs, _ = self.lstm(self.embedding(text))
        return self.fc(outputs)


def pos_train_step(model: nn.Module, criterion: nn.Module, text: torch.Tensor, tags: torch.Tensor,
                   tag_pad_idx: int = 0) -> torch.Tensor:
    explain_here(model, text)
    predictions = model(text).view(-1, C)
    tags = tags.view(-1)
    loss = criterion(predictions, tags)
    return loss + categorical_accuracy(predictions, tags, tag_pad_idx)


# the PoS-tagging tutorial's categorical_accuracy on Colab's GPU: correct.sum() is a 0-dim CUDA tensor, the
# denominator torch.FloatTensor([n]) a one-element CPU tensor (one element is not a 0-dim scalar); meta tensors
# have no data for nonzero()
@R.mistake("bentrevett/pytorch-pos-tagging#6", "torch.FloatTensor", pairs=GPU)
def pos_tagging_accuracy_denominator(dev: torch.device, other: torch.device) -> Program:
    model = BiLSTMPOSTagger().to(dev)
    criterion = nn.CrossEntropyLoss(ignore_index=0).to(dev)
    text, tags = torch.randint(1, 16, (5, 2), device=dev), torch.randint(0, C, (5, 2), device=dev)
    return stepped(model, lambda: pos_train_step(model, criterion, text, tags), (text,))


class BinaryMCCMetric(nn.Module):
    """chemprop's MCC metric: task_weights is a buffer, but the metric is kept in a plain list, so it is never moved."""

    def __init__(self, task_weights: float = 1.0) -> None:
        super().__init__()
        self.register_buffer("task_weights", torch.as_tensor(task_weights, dtype=torch.float).view(1, -1))

    def _calc_unreduced_loss(self, preds: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        tp = (preds * targets * mask).sum(0, keepdim=True)
        return 1 - 2 * tp / (preds.sum(0, keepdim=True) + targets.sum(0, keepdim=True)).clamp(min=1e-8)

    def forward(self, preds: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        preds = preds.sigmoid()
        L = self._calc_unreduced_loss(preds, targets.long(), mask)
        L = L * self.task_weights  # case: chemprop_mcc_task_weights
        return L.mean()


class MPNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.message_passing = nn.Linear(W, W)
        self.predictor = nn.Linear(W, 1)
        self.criterion = nn.BCEWithLogitsLoss()
        self.metrics = [BinaryMCCMetric()]

    def forward(self, bmg: torch.Tensor) -> torch.Tensor:
        return self.predictor(self.message_passing(bmg).relu())


def validation_step(mpnn: MPNN, bmg: torch.Tensor, targets: torch.Tensor) -> list[torch.Tensor]:
    explain_here(mpnn, bmg)
    preds = mpnn(bmg)
    mask = torch.ones_like(targets)
    return [metric(preds, targets, mask) for metric in mpnn.metrics]


# chemprop's BinaryMCCMetric on a GPU: "L = L * self.task_weights" fails; the loss function is a registered
# submodule and moves, the metrics are not
@R.mistake("chemprop/chemprop#973", "task_weights")
def chemprop_mcc_task_weights(dev: torch.device, other: torch.device) -> Program:
    mpnn = MPNN().to(dev)
    bmg, targets = randn(6, W, device=dev), torch.randint(0, 2, (6, 1), device=dev).float()
    return stepped(mpnn, lambda: validation_step(mpnn, bmg, targets), (bmg,))


class RevIN(nn.Module):
    """RevIN: reversible instance normalization with learnable affine parameters."""

    def __init__(self, num_features: int, eps: float = 1e-5, affine: bool = True) -> None:
        super().__init__()
        self.num_features, self.eps, self.affine = num_features, eps, affine
        if self.affine:
            self.affine_weight = nn.Parameter(torch.ones(self.num_features))
            self.affine_bias = nn.Parameter(torch.zeros(self.num_features))

    def forward(self, x: torch.Tensor, mode: str) -> torch.Tensor:
        if mode == "norm":
            self.mean = torch.mean(x, dim=1, keepdim=True).detach()
            self.stdev = torch.sqrt(torch.var(x, dim=1, keepdim=True, unbiased=False) + self.eps).detach()
            x = (x - self.mean) / self.stdev
            if self.affine:
                x = x * self.affine_weight  # case: revin_layer_outside_model
                x = x + self.affine_bias
            return x
        if self.affine:
            x = (x - self.affine_bias) / (self.affine_weight + self.eps * self.eps)
        return x * self.stdev + self.mean


def forecast_step(model: nn.Module, revin_layer: RevIN, x_in: torch.Tensor) -> torch.Tensor:
    explain_here(model, x_in)
    x_in = revin_layer(x_in, "norm")
    x_out = model(x_in)
    return revin_layer(x_out, "denorm")


# RevIN used as its README shows, revin_layer = RevIN(num_features) beside the model: the model is moved to the GPU,
# the RevIN layer and its affine parameters are not
@R.mistake("ts-kim/RevIN#8", "revin_layer", "revin_layer")
def revin_layer_outside_model(dev: torch.device, other: torch.device) -> Program:
    model = nn.Linear(3, 3).to(dev)
    revin_layer = RevIN(3)
    x_in = randn(2, 6, 3, device=dev)
    return stepped(model, lambda: forecast_step(model, revin_layer, x_in), (x_in,))


class BCELoss(nn.Module):
    """chemprop's BCE loss, shortened: task_weights is a buffer, the default per-datapoint weights are made with
    torch.ones() and no device."""

    def __init__(self, task_weights: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("task_weights", task_weights.view(1, -1))

    def forward(self, preds: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor | None = None,
                weights: torch.Tensor | None = None) -> torch.Tensor:
        mask = torch.ones_like(targets, dtype=torch.bool) if mask is None else mask
        weights = torch.ones(targets.shape[0], 1) if weights is None else weights
        L = F.binary_cross_entropy_with_logits(preds, targets, reduction="none")
        L = L * weights * self.task_weights * mask  # case: chemprop_default_weights_on_cpu
        return L.sum() / mask.sum()


class BinaryClassificationFFN(nn.Module):
    def __init__(self, n_tasks: int, criterion: nn.Module) -> None:
        super().__init__()
        self.ffn = nn.Linear(W, n_tasks)
        self.criterion = criterion

    def forward(self, Z: torch.Tensor) -> torch.Tensor:
        return self.ffn(Z)


def predictor_loss(predictor: BinaryClassificationFFN, Z: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    explain_here(predictor, Z)
    return predictor.criterion(predictor(Z), targets)


# predictor.to(device) moves the criterion and its task_weights; the weights it makes itself when none are given
# stay on the CPU
@R.mistake("chemprop/chemprop#1296", ("weights", "torch.ones"), "predictor.criterion")
def chemprop_default_weights_on_cpu(dev: torch.device, other: torch.device) -> Program:
    task_dim = 3
    predictor = BinaryClassificationFFN(n_tasks=task_dim, criterion=BCELoss(task_weights=torch.ones(task_dim)))
    predictor.to(device=dev)
    Z, targets = randn(10, W, device=dev), torch.ones((10, task_dim)).to(device=dev)
    return stepped(predictor, lambda: predictor_loss(predictor, Z, targets), (Z,))


class PropPairModelInput:
    """sub-sentence-encoder's model input: token ids and proposition masks, with a .to() of its own."""

    def __init__(self, input_ids: torch.Tensor, all_prop_mask: torch.Tensor) -> None:
        self.input_ids, self.all_prop_mask = input_ids, all_prop_mask

    def to(self, device: torch.device | str) -> PropPairModelInput:
        return PropPairModelInput(self.input_ids.to(device), self.all_prop_mask.to(device))


class SubSentenceEncoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embeddings = nn.Embedding(16, W)
        self.proj = nn.Linear(W, W)

    def forward(self, inputs: PropPairModelInput) -> torch.Tensor:
        hidden = self.embeddings(inputs.input_ids)  # case: sub_sentence_inputs_not_moved
        prop = inputs.all_prop_mask[..., None] * hidden
        return self.proj(prop.sum(1) / inputs.all_prop_mask.sum(1, keepdim=True).clamp(min=1))


def encode_pairs(model: nn.Module, sent1_inputs: PropPairModelInput, sent2_inputs: PropPairModelInput) -> torch.Tensor:
    explain_here(model, sent1_inputs)
    return F.cosine_similarity(model(sent1_inputs), model(sent2_inputs))


# the README's step 3 with the model on cuda: sent1_inputs/sent2_inputs stay on the CPU until the user calls
# sent1_inputs.to("cuda") (meta lets an embedding lookup take CPU indices)
@R.mistake("schen149/sub-sentence-encoder#1", "sent1_inputs", "model.embeddings", pairs=GPU)
def sub_sentence_inputs_not_moved(dev: torch.device, other: torch.device) -> Program:
    model = SubSentenceEncoder().to(dev)
    ids = torch.randint(1, 16, (2, 5))
    sent1_inputs, sent2_inputs = PropPairModelInput(ids, torch.ones(2, 5)), PropPairModelInput(ids, torch.ones(2, 5))
    return stepped(model, lambda: encode_pairs(model, sent1_inputs, sent2_inputs), (sent1_inputs.to(dev),))


# --------------------------------------------------------------------------- legal patterns

class BiasedHead(nn.Module):
    """A head that adds a 0-dim CPU tensor, torch.ones(()), to its GPU output."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(W, C)
        self.offset = torch.ones(())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) + self.offset


# "zero-dim Tensor (scalars) are NOT required to be on the same device as other inputs because they behave almost
# like Python numbers": a 0-dim CPU tensor added to a GPU output
@R.legal("pytorch/pytorch#20690")
def zero_dim_cpu_tensor_with_gpu_tensor(dev: torch.device, other: torch.device) -> Program:
    model = BiasedHead().to(dev)
    x = randn(4, W, device=dev)
    return Program(model, lambda: model(x), (x,))


class PowerCompressedSpectrogram(nn.Module):
    """A spectrogram compressed with torch.pow(spec, exponent), the exponent a 0-dim CPU tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(1, W, 9, stride=4)
        self.exponent = torch.tensor(0.3)

    def forward(self, wav: torch.Tensor) -> torch.Tensor:
        spec = self.conv(wav).abs()
        return torch.pow(spec, self.exponent)


# torch.pow: "cuda x cpu scalar (zero dim tensor or actual scalar value)" is among the cases that work
@R.legal("pytorch/pytorch#46037")
def pow_with_cpu_scalar_exponent(dev: torch.device, other: torch.device) -> Program:
    model = PowerCompressedSpectrogram().to(dev)
    wav = randn(2, 1, 64, device=dev)
    return Program(model, lambda: model(wav), (wav,))


# resampler = torchaudio.transforms.Resample(...); resampler.to(torch.device('cuda')): the kernel buffer moves
@R.legal("pytorch/audio#2126")
def resampler_moved_with_to(dev: torch.device, other: torch.device) -> Program:
    resampler = Resample(16000, 8000)
    resampler.to(dev)
    x = torch.rand(4, 64, device=dev)
    return Program(resampler, lambda: resampler(x), (x,))


class DDPMSchedulerCached:
    """diffusers' DDPMScheduler after PR 6704: add_noise() moves alphas_cumprod to the samples' device once."""

    def __init__(self, num_train_timesteps: int = 10) -> None:
        self.alphas_cumprod = torch.cumprod(1.0 - torch.linspace(1e-4, 0.02, num_train_timesteps), dim=0)
        self.num_train_timesteps = num_train_timesteps

    def add_noise(self, original_samples: torch.Tensor, noise: torch.Tensor, timesteps: torch.Tensor) -> torch.Tensor:
        self.alphas_cumprod = self.alphas_cumprod.to(device=original_samples.device)
        alphas_cumprod = self.alphas_cumprod.to(dtype=original_samples.dtype)
        timesteps = timesteps.to(original_samples.device)
        sqrt_alpha_prod = (alphas_cumprod[timesteps] ** 0.5).flatten()[:, None, None, None]
        sqrt_one_minus_alpha_prod = ((1 - alphas_cumprod[timesteps]) ** 0.5).flatten()[:, None, None, None]
        return sqrt_alpha_prod * original_samples + sqrt_one_minus_alpha_prod * noise


def sd_train_step(unet: nn.Module, noise_scheduler: DDPMSchedulerCached, latents: torch.Tensor) -> torch.Tensor:
    noise = torch.randn_like(latents)
    timesteps = torch.randint(0, noise_scheduler.num_train_timesteps, (latents.shape[0],)).long()
    noisy_latents = noise_scheduler.add_noise(latents, noise, timesteps)
    explain_here(unet, noisy_latents, timesteps.to(latents.device))
    return F.mse_loss(unet(noisy_latents, timesteps.to(latents.device)), noise)


# timesteps drawn on the CPU and the scheduler's CPU table, both moved to the latents' device before the lookup
@R.legal("huggingface/diffusers#6704")
def add_noise_moves_alphas_to_sample_device(dev: torch.device, other: torch.device) -> Program:
    unet = UNet().to(dev)
    noise_scheduler = DDPMSchedulerCached()
    latents = randn(2, 4, 4, 4, device=dev)
    return stepped(unet, lambda: sd_train_step(unet, noise_scheduler, latents), (latents, labels(2, dev)))


def get_huber_threshold(noise_scheduler: EulerDiscreteScheduler, timesteps: torch.Tensor,
                        huber_c: float = 0.1) -> torch.Tensor:
    alphas_cumprod = noise_scheduler.alphas_cumprod.index_select(0, timesteps.to(noise_scheduler.alphas_cumprod.device))
    return (1 - alphas_cumprod) / alphas_cumprod * huber_c


def huber_train_step(unet: nn.Module, noise_scheduler: EulerDiscreteScheduler, latents: torch.Tensor) -> torch.Tensor:
    timesteps = torch.randint(0, noise_scheduler.num_train_timesteps, (latents.shape[0],), device=latents.device)
    explain_here(unet, latents, timesteps)
    noise_pred = unet(latents, timesteps)
    huber_c = get_huber_threshold(noise_scheduler, timesteps).to(latents.device)[:, None, None, None]
    return (huber_c * ((noise_pred - latents) ** 2 + huber_c ** 2).sqrt()).mean()


# sd-scripts' huber loss: the GPU timesteps are moved to the scheduler's CPU alphas_cumprod for the lookup, and the
# threshold back to the latents' device (meta has no data to copy to the CPU)
@R.legal("kohya-ss/sd-scripts#2153", pairs=GPU)
def timesteps_moved_to_scheduler_table(dev: torch.device, other: torch.device) -> Program:
    unet = UNet().to(dev)
    latents = randn(2, 4, 4, 4, device=dev)
    return stepped(unet, lambda: huber_train_step(unet, EulerDiscreteScheduler(), latents), (latents, labels(2, dev)))


class BatchEncoding(dict):
    """A tokenizer's output: .to(device) moves every tensor in it."""

    def to(self, device: torch.device | str) -> BatchEncoding:
        return BatchEncoding({k: v.to(device) for k, v in self.items()})


def tokenizer(text: str, return_tensors: str = "pt") -> BatchEncoding:
    ids = [ord(c) % 16 for c in text]
    return BatchEncoding(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long))


class BertModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embeddings = nn.Embedding(16, W)
        self.pooler = nn.Linear(W, W)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        hidden = self.embeddings(input_ids) * attention_mask[..., None]
        return self.pooler(hidden.sum(1) / attention_mask.sum(1, keepdim=True))


def encode_text(model: nn.Module, text: str, device: torch.device) -> torch.Tensor:
    encoding = tokenizer(text, return_tensors="pt").to(device)
    explain_here(model, encoding["input_ids"], encoding["attention_mask"])
    return model(**encoding)


# encoding = tokenizer(text, return_tensors="pt").to(device): the whole BatchEncoding is moved at once
@R.legal("huggingface/transformers#16359")
def tokenizer_output_moved_whole(dev: torch.device, other: torch.device) -> Program:
    model = BertModel().to(dev)
    ids = torch.tensor([[ord(c) % 16 for c in "hello world"]], device=dev)
    return stepped(model, lambda: encode_text(model, "hello world", dev), (ids, torch.ones_like(ids)))


class Forecaster(nn.Module):
    """A forecaster with RevIN as a child module: model.to(device) moves its affine parameters too."""

    def __init__(self, num_features: int = 3) -> None:
        super().__init__()
        self.revin_layer = RevIN(num_features)
        self.backbone = nn.Linear(num_features, num_features)

    def forward(self, x_in: torch.Tensor) -> torch.Tensor:
        return self.revin_layer(self.backbone(self.revin_layer(x_in, "norm")), "denorm")


# "Since the RevIN class inherits from nn.Module, using model.to(device) in the training code will also modify the
# device of RevIN accordingly"
@R.legal("ts-kim/RevIN#11")
def revin_child_module_moves(dev: torch.device, other: torch.device) -> Program:
    model = Forecaster().to(dev)
    x_in = randn(2, 6, 3, device=dev)
    return Program(model, lambda: model(x_in), (x_in,))


class ReplayMemory:
    """An in-RAM experience replay: transitions kept on the CPU, sampled batches copied to the GPU."""

    def __init__(self, capacity: int) -> None:
        self.capacity, self.memory = capacity, []

    def push(self, state: np.ndarray, action: int, reward: float, next_state: np.ndarray) -> None:
        self.memory = (self.memory + [(state, action, reward, next_state)])[-self.capacity:]

    def sample(self, batch_size: int, device: torch.device) -> tuple[torch.Tensor, ...]:
        batch = self.memory[:batch_size]
        states = torch.tensor(np.stack([b[0] for b in batch]), dtype=torch.float32).to(device)
        actions = torch.tensor([b[1] for b in batch]).to(device)
        rewards = torch.tensor([b[2] for b in batch], dtype=torch.float32).to(device)
        next_states = torch.tensor(np.stack([b[3] for b in batch]), dtype=torch.float32).to(device)
        return states, actions, rewards, next_states


def dqn_update(policy_net: nn.Module, target_net: nn.Module, memory: ReplayMemory, optimizer: torch.optim.Optimizer,
               device: torch.device, gamma: float = 0.99) -> None:
    states, actions, rewards, next_states = memory.sample(4, device)
    explain_here(policy_net, states, optimizer=optimizer)
    q = policy_net(states).gather(1, actions[:, None]).squeeze(1)
    with torch.no_grad():
        target = rewards + gamma * target_net(next_states).max(1).values
    F.smooth_l1_loss(q, target).backward()
    optimizer.step()
    optimizer.zero_grad()


# the in-RAM replay the paper starts from: the buffer lives on the CPU, each sampled batch is copied to the GPU
@R.legal("https://paperswithcode.com/paper/deep-in-gpu-experience-replay/review/")
def cpu_replay_memory_batches_copied(dev: torch.device, other: torch.device) -> Program:
    policy_net = nn.Sequential(nn.Linear(W, W), nn.ReLU(), nn.Linear(W, C)).to(dev)
    target_net = nn.Sequential(nn.Linear(W, W), nn.ReLU(), nn.Linear(W, C)).to(dev)
    optimizer = torch.optim.Adam(policy_net.parameters(), lr=1e-3)
    memory = ReplayMemory(100)
    for i in range(6):
        memory.push(np.random.rand(W), i % C, 1.0, np.random.rand(W))
    return stepped(policy_net, lambda: dqn_update(policy_net, target_net, memory, optimizer, dev),
                   (torch.zeros(4, W, device=dev),), optimizer)


# "Instead of `metric=Accuracy(...)` try to do `metric=Accuracy(...).to(device)`": the metric's states move with it
@R.legal("Lightning-AI/torchmetrics#1056")
def metric_moved_with_to(dev: torch.device, other: torch.device) -> Program:
    metric = Accuracy().to(dev)
    preds, target = torch.rand(4, C, device=dev), torch.randint(0, C, (4,), device=dev)
    return Program(metric, lambda: metric(preds, target), (preds, target))


class SequenceTagger(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(16, W)
        self.rnn = nn.GRU(W, W, batch_first=True)
        self.fc = nn.Linear(W, C)

    def forward(self, text: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        packed = pack_padded_sequence(self.embedding(text), lengths, batch_first=True, enforce_sorted=False)
        _, hidden = self.rnn(packed)
        return self.fc(hidden[-1])


# pack_padded_sequence(input, lengths): lengths "must be on the CPU if provided as a tensor", the input anywhere
@R.legal("https://docs.pytorch.org/docs/stable/generated/torch.nn.utils.rnn.pack_padded_sequence.html")
def pack_padded_with_cpu_lengths(dev: torch.device, other: torch.device) -> Program:
    model = SequenceTagger().to(dev)
    text, lengths = torch.randint(1, 16, (3, 5), device=dev), torch.tensor([5, 2, 4])
    return Program(model, lambda: model(text, lengths), (text, lengths))


class BerardEncoder(nn.Module):
    """fairseq's Berard speech encoder: the source lengths come with the batch, on the GPU."""

    def __init__(self) -> None:
        super().__init__()
        self.input_layers = nn.Linear(4, W)
        self.lstm = nn.LSTM(W, W, batch_first=True)

    def forward(self, src_tokens: torch.Tensor, src_lengths: torch.Tensor) -> torch.Tensor:
        x = self.input_layers(src_tokens)
        packed_x = nn.utils.rnn.pack_padded_sequence(x, src_lengths.cpu(), batch_first=True)
        packed_outs, _ = self.lstm(packed_x)
        x, output_lengths = nn.utils.rnn.pad_packed_sequence(packed_outs, batch_first=True)
        return x.sum(1) / output_lengths.to(x.device)[:, None]


# the Berard fix: pack_padded_sequence(x, src_lengths.cpu()), the lengths copied to the CPU as the docs require
# (meta has no data to copy to the CPU)
@R.legal("facebookresearch/fairseq#3557", pairs=GPU)
def berard_lengths_to_cpu(dev: torch.device, other: torch.device) -> Program:
    model = BerardEncoder().to(dev)
    src_tokens, src_lengths = randn(2, 6, 4, device=dev), torch.tensor([6, 3], device=dev)
    return Program(model, lambda: model(src_tokens, src_lengths), (src_tokens, src_lengths))


class DQNAgent:
    """PARL's torch DQN agent: numpy observations become tensors on the agent's device, actions go back to numpy."""

    def __init__(self, model: nn.Module, device: torch.device) -> None:
        self.model, self.device = model, device

    def predict(self, obs: np.ndarray) -> int:
        if obs.ndim == 1:
            obs = np.expand_dims(obs, axis=0)
        obs = torch.tensor(obs, dtype=torch.float, device=self.device)
        explain_here(self.model, obs)
        with torch.no_grad():
            pred_q = self.model(obs).cpu().numpy().squeeze()
        return int(pred_q.argmax())


# obs = torch.tensor(obs, dtype=torch.float, device=self.device); pred_q ... .cpu().numpy(): host values in and out
# (meta has no data to bring back to numpy)
@R.legal("PaddlePaddle/PARL#694", pairs=GPU)
def numpy_obs_to_agent_device(dev: torch.device, other: torch.device) -> Program:
    model = nn.Sequential(nn.Linear(W, W), nn.ReLU(), nn.Linear(W, C)).to(dev)
    agent = DQNAgent(model, dev)
    obs = np.random.rand(W).astype(np.float32)
    return stepped(model, lambda: agent.predict(obs), (torch.zeros(1, W, device=dev),))


def amp_train_step(model: nn.Module, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler,
                   loss_fn: nn.Module, input: torch.Tensor, target: torch.Tensor) -> None:
    explain_here(model, input, optimizer=optimizer)
    optimizer.zero_grad()
    with torch.autocast(device_type=input.device.type, dtype=torch.float16):
        output = model(input)
        loss = loss_fn(output, target)
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(optimizer)
    scaler.update()


# the AMP examples' typical use with unscaled gradients: the scaler keeps its scale and found-inf tensors on the
# gradients' device and the optimizer steps as usual (GradScaler needs CUDA)
@R.legal("https://pytorch.org/docs/stable/notes/amp_examples", pairs=GPU)
def grad_scaler_unscale_and_clip(dev: torch.device, other: torch.device) -> Program:
    model = Toy().to(dev)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler(dev.type)
    input, target = randn(4, W, device=dev), labels(4, dev)
    return stepped(model, lambda: amp_train_step(model, optimizer, scaler, nn.CrossEntropyLoss(), input, target),
                   (input,), optimizer)


class UrbanSoundDataset(torch.utils.data.Dataset):
    """The course's dataset after its fix: the signal and the Resample made for it both go to the device."""

    def __init__(self, signals: list[torch.Tensor], target_sample_rate: int, device: torch.device) -> None:
        self.signals, self.target_sample_rate, self.device = signals, target_sample_rate, device

    def __len__(self) -> int:
        return len(self.signals)

    def __getitem__(self, index: int) -> torch.Tensor:
        signal = self.signals[index].to(self.device)
        return self._resample_if_necessary(signal, 16000)

    def _resample_if_necessary(self, signal: torch.Tensor, sr: int) -> torch.Tensor:
        if sr != self.target_sample_rate:
            resampler = Resample(sr, self.target_sample_rate).to(self.device)
            signal = resampler(signal)
        return signal


class CNNNetwork(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv1d(1, W, 3, padding=1)
        self.linear = nn.Linear(W, C)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(self.conv1(x).relu().mean(-1))


def urban_sound_step(cnn: nn.Module, usd: UrbanSoundDataset) -> torch.Tensor:
    signal = usd[0]
    explain_here(cnn, signal[None])
    return cnn(signal[None])


# "add device for resampler": a transform made inside the dataset is moved to the device with the signal
@R.legal("musikalkemist/pytorchforaudio#6")
def dataset_resampler_moved(dev: torch.device, other: torch.device) -> Program:
    cnn = CNNNetwork().to(dev)
    usd = UrbanSoundDataset([torch.rand(1, 64)], 8000, dev)
    return stepped(cnn, lambda: urban_sound_step(cnn, usd), (torch.rand(1, 1, 32, device=dev),))
