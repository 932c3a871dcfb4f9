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


class UrbanSoundDataset(torch.utils.data.Dataset):
    """The course's dataset: the signal is moved to the device, then resampled by a Resample made on the spot."""

    def __init__(self, signals: list[torch.Tensor], target_sample_rate: int, device: torch.device) -> None:
        self.signals = signals
        self.target_sample_rate = target_sample_rate
        self.device = device

    def __len__(self) -> int:
        return len(self.signals)

    def __getitem__(self, index: int) -> torch.Tensor:
        signal = self.signals[index].to(self.device)
        return self._resample_if_necessary(signal, 16000)

    def _resample_if_necessary(self, signal: torch.Tensor, sr: int) -> torch.Tensor:
        if sr != self.target_sample_rate:
            resampler = Resample(sr, self.target_sample_rate)
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


# the course's UrbanSoundDataset on CUDA: the signal is on the GPU, the Resample made in the dataset on the CPU
# (meta lets a convolution take a CPU weight)
@R.mistake("musikalkemist/pytorchforaudio#11", ("resampler", "Resample"), "resampler", pairs=GPU)
def dataset_resampler_made_on_cpu(dev: torch.device, other: torch.device) -> Program:
    cnn = CNNNetwork().to(dev)
    usd = UrbanSoundDataset([torch.rand(1, 64)], 8000, dev)
    return stepped(cnn, lambda: urban_sound_step(cnn, usd), (torch.rand(1, 1, 32, device=dev),))


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
        cur_ids = torch.cat([cur_ids, torch.ones((1, 1)).long().to(device) * next_token_id], dim=1)  # case: gpt2_token_cat
    return cur_ids


# the text-augmentation generate(): DEVICE is "cuda", but the model was never moved and cur_ids stay on the CPU;
# only the sampled token is sent .to(device), and torch.cat gets a CPU and a CUDA tensor
@R.mistake("prakhar21/TextAugmentation-GPT2#8", ("cur_ids", "torch.ones"))
def gpt2_token_cat(dev: torch.device, other: torch.device) -> Program:
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
@R.mistake("haoyangzheng-ai/didi-instruct#1", "valid_tokens", "model")
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
