"""HELD OUT: device mistakes and legal device patterns from other projects' public reports, kept from anyone
changing the diagnosis (issue 31). Do not read this file while working on torchplace.checks or
torchplace.memory, do not score it while doing so, and do not add it to any test that runs by default: the lead
scores it once, at the end, with `torchplace bench diagnose --corpus tests/checks/corpus_heldout2.py` (on the CPU
and on GPUs), and records the number. Its reports are different from those of corpus_public.py,
corpus_outside.py and the corpus shipped with torchplace.

Same shape as corpus_public.py (see corpus_kit.py): each case cites its public source, a mistake names what a
report must contain (culprit, as the user wrote it), its module path and the user's line (the line ending in
`# case: NAME`); a legal pattern must raise nothing in any mode. On the CPU the pair is meta vs cpu; cases that
only a real accelerator refuses list the GPU pairs, and those about two GPUs the cuda:1 vs cuda:0 pair only.
"""

from __future__ import annotations

import copy
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
    labels,
    randn,
    stepped,
)

R = Registry(__file__)
CASES = R.CASES
for_pair = R.for_pair
__all__ = ["ALL", "CASES", "PAIRS", "for_pair"]
TWO_GPUS = ("cuda1-cuda0",)
N_FFT = 16


# --------------------------------------------------------------------------- mistakes

class PitchShift(nn.Module):
    """An audio effect with a window buffer, as torchaudio's transforms have."""

    def __init__(self, n_steps: int = 1) -> None:
        super().__init__()
        self.rate = 2.0 ** (-n_steps / 12)
        self.register_buffer("window", torch.hann_window(N_FFT))

    def forward(self, waveform: torch.Tensor) -> torch.Tensor:
        spec = torch.stft(waveform, N_FFT, window=self.window, return_complex=True)  # case: pitch_shift_not_moved
        return spec.abs() * self.rate


def augment_step(model: nn.Module, effect: nn.Module, waveform: torch.Tensor) -> torch.Tensor:
    explain_here(model, waveform)
    shifted = effect(waveform).mean(-1)
    return model(shifted)


# an audio effect module made at the top of the script (no device), applied to a GPU waveform
@R.mistake("pytorch/audio#3446", "window", "effect")
def pitch_shift_not_moved(dev: torch.device, other: torch.device) -> Program:
    model = nn.Linear(N_FFT // 2 + 1, C).to(dev)
    effect = PitchShift(n_steps=1)
    waveform = randn(2, 64, device=dev)
    return stepped(model, lambda: augment_step(model, effect, waveform), (waveform,))


class Spectrogram(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("window", torch.hann_window(N_FFT))

    def forward(self, wave: torch.Tensor) -> torch.Tensor:
        return torch.stft(wave, N_FFT, window=self.window, return_complex=True).abs()  # case: spectrogram_on_gpu0


def melspecfunc(specfunc: nn.Module, waveform: torch.Tensor) -> torch.Tensor:
    specgram = specfunc(waveform)
    return specgram.log1p().mean(-1)


def encode_audio_step(model: nn.Module, specfunc: nn.Module, wave: torch.Tensor) -> torch.Tensor:
    explain_here(model, wave)
    return model(melspecfunc(specfunc, wave))


# the spectrogram transform was moved with .to('cuda') (GPU 0) while the waveforms live on GPU 1
@R.mistake("moiseshorta/MelSpecVAE#5", "window", "specfunc", pairs=TWO_GPUS)
def spectrogram_on_gpu0(dev: torch.device, other: torch.device) -> Program:
    model = nn.Linear(N_FFT // 2 + 1, C).to(dev)
    specfunc = Spectrogram().to(other)
    wave = randn(2, 64, device=dev)
    return stepped(model, lambda: encode_audio_step(model, specfunc, wave), (wave,))


class F1(nn.Module):
    """A classification metric whose counts are buffers, updated in place (torchmetrics.F1)."""

    def __init__(self, num_classes: int) -> None:
        super().__init__()
        self.num_classes = num_classes
        self.register_buffer("tp", torch.zeros(num_classes))
        self.register_buffer("support", torch.zeros(num_classes))

    def forward(self, preds: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        hit = F.one_hot(preds, self.num_classes) * F.one_hot(target, self.num_classes)
        self.tp += hit.sum(0)  # case: metric_made_inline_in_validation_step
        self.support += F.one_hot(target, self.num_classes).sum(0)
        return (self.tp / self.support.clamp(min=1)).mean()


class ImageNetClassify(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = Toy()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        logits = self(x)
        preds = torch.argmax(logits, dim=1)
        return F1(num_classes=C)(preds, y)


def val_loop(model: ImageNetClassify, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    explain_here(model, batch[0])
    return model.validation_step(batch)


# a metric instantiated and called in one expression inside validation_step, on GPU predictions
@R.mistake("Lightning-AI/torchmetrics#340", "F1", pairs=GPU)  # in place: meta lets it mix
def metric_made_inline_in_validation_step(dev: torch.device, other: torch.device) -> Program:
    model = ImageNetClassify().to(dev)
    batch = (randn(4, W, device=dev), labels(4, dev))
    return stepped(model, lambda: val_loop(model, batch), (batch[0],))


def diarization_error_rate(preds: torch.Tensor, target: torch.Tensor, threshold: float = 0.5) -> torch.Tensor:
    threshold_t = torch.tensor([threshold], dtype=preds.dtype)
    hypothesis = (preds.unsqueeze(-1) > threshold_t).float()  # case: der_threshold_tensor_on_cpu
    return (hypothesis.squeeze(-1) != target).float().mean()


def segmentation_val_step(model: nn.Module, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    explain_here(model, x)
    preds = model(x).sigmoid()
    return diarization_error_rate(preds, target)


# a metric helper turns a float threshold into torch.tensor([threshold]) on the CPU, compared with GPU preds
@R.mistake("pyannote/pyannote-audio#961", ("threshold_t", "torch.tensor"))
def der_threshold_tensor_on_cpu(dev: torch.device, other: torch.device) -> Program:
    model = Toy().to(dev)
    x, target = randn(4, W, device=dev), torch.ones(4, C, device=dev)
    return stepped(model, lambda: segmentation_val_step(model, x, target), (x,))


def bit_train_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    explain_here(model, x)
    logits = model(x)  # case: dataparallel_default_device_ids_model_on_gpu1
    return F.cross_entropy(logits, y)


# "Going to train on cuda:1": the model moved to cuda:1, then wrapped in DataParallel over all GPUs (cuda:0 first)
@R.mistake("google-research/big_transfer#73", "model.module", "model.module", pairs=TWO_GPUS)
def dataparallel_default_device_ids_model_on_gpu1(dev: torch.device, other: torch.device) -> Program:
    model = Toy().to(dev)
    model = nn.DataParallel(model)
    x, y = randn(4, W, device=dev), labels(4, dev)
    return stepped(model, lambda: bit_train_step(model, x, y), (x,))


class ReIDBase:
    """A trainer whose device attribute says 'cuda', which is the current device (GPU 0)."""

    def __init__(self, model: nn.Module) -> None:
        self.device = torch.device("cuda")
        self.model = model

    def train_step(self, imgs: torch.Tensor, pids: torch.Tensor) -> torch.Tensor:
        explain_here(self.model, imgs)
        imgs, pids = imgs.to(self.device), pids.to(self.device)
        features = self.model(imgs)  # case: device_cuda_means_current_gpu
        return F.cross_entropy(features, pids)


# the model was put on cuda:1 by the config, the batch moved with torch.device('cuda'): the current GPU, cuda:0
@R.mistake("wangguanan/HOReID#28", "imgs", pairs=TWO_GPUS)
def device_cuda_means_current_gpu(dev: torch.device, other: torch.device) -> Program:
    model = Toy().to(dev)
    base = ReIDBase(model)
    imgs, pids = randn(4, W, device=dev), labels(4, dev)
    return stepped(model, lambda: base.train_step(imgs, pids), (imgs,))


def knn_search(coords: torch.Tensor, k: int) -> torch.Tensor:
    points = coords.detach().cpu().numpy()
    dist = ((points[:, :, None, :] - points[:, None, :, :]) ** 2).sum(-1)
    return torch.from_numpy(np.argsort(dist, axis=-1)[:, :, :k])


class LocalSpatialEncoding(nn.Module):
    def __init__(self, k: int = 3) -> None:
        super().__init__()
        self.k = k
        self.mlp = nn.Linear(10, W)

    def forward(self, coords: torch.Tensor) -> torch.Tensor:
        B, N, _ = coords.shape
        idx = knn_search(coords, self.k)
        extended_idx = idx.unsqueeze(1).expand(B, 3, N, self.k)
        extended_coords = coords.transpose(-2, -1).unsqueeze(-1).expand(B, 3, N, self.k)
        neighbors = torch.gather(extended_coords, 2, extended_idx)  # case: knn_index_from_numpy_gather
        center = extended_coords
        rel = torch.cat([center, neighbors, center - neighbors, (center - neighbors).norm(dim=1, keepdim=True)], 1)
        return self.mlp(rel.permute(0, 2, 3, 1)).max(2).values


# RandLA-Net: neighbour indices found on the host (numpy) and gathered against GPU coordinates
@R.mistake("aRI0U/RandLA-Net-pytorch#29", ("extended_idx", "torch.from_numpy"), "model", pairs=GPU)
def knn_index_from_numpy_gather(dev: torch.device, other: torch.device) -> Program:
    model = LocalSpatialEncoding().to(dev)
    coords = randn(2, 6, 3, device=dev)
    return Program(model, lambda: model(coords), (coords,))


def get_costs(dataset: torch.Tensor, rec: torch.Tensor) -> torch.Tensor:
    d = dataset.gather(1, rec.long().unsqueeze(-1).expand_as(dataset))  # case: tour_costs_dataset_on_cpu
    return (d[:, 1:] - d[:, :-1]).norm(p=2, dim=2).sum(1) + (d[:, 0] - d[:, -1]).norm(p=2, dim=1)


def tsp_eval_step(model: nn.Module, dataset: torch.Tensor, rec_logits_in: torch.Tensor) -> torch.Tensor:
    explain_here(model, rec_logits_in)
    rec = model(rec_logits_in).argsort(-1)
    return get_costs(dataset, rec)


# the problem instances stayed on the CPU; the tours come from the model on the GPU (meta lets gather mix)
@R.mistake("yining043/TSP-improve#7", "dataset", pairs=GPU)
def tour_costs_dataset_on_cpu(dev: torch.device, other: torch.device) -> Program:
    model = nn.Linear(W, W).to(dev)
    dataset = torch.rand(2, W, 2)
    rec_in = randn(2, W, device=dev)
    return stepped(model, lambda: tsp_eval_step(model, dataset, rec_in), (rec_in,))


class ModelEmaV3(nn.Module):
    def __init__(self, model: nn.Module, decay: float = 0.999, device: torch.device | None = None) -> None:
        super().__init__()
        self.module = copy.deepcopy(model)
        self.decay = decay
        if device is not None:
            self.module.to(device=device)

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        for ema_v, model_v in zip(self.module.state_dict().values(), model.state_dict().values()):
            ema_v.lerp_(model_v, weight=1.0 - self.decay)  # case: timm_ema_kept_on_cpu


def ema_step(model: nn.Module, ema: ModelEmaV3, optimizer: torch.optim.Optimizer, x: torch.Tensor) -> None:
    explain_here(model, x, optimizer=optimizer)
    model(x).square().mean().backward()
    optimizer.step()
    ema.update(model)


# timm's ModelEmaV3(model, device='cpu') keeps the EMA weights on the host; its update lerps with GPU weights
@R.mistake("huggingface/pytorch-image-models#2127", "ema.module", "ema.module", pairs=GPU)  # meta has no data to copy
def timm_ema_kept_on_cpu(dev: torch.device, other: torch.device) -> Program:
    model = Toy().to(dev)
    ema = ModelEmaV3(model, device=torch.device("cpu"))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x = randn(4, W, device=dev)
    return stepped(model, lambda: ema_step(model, ema, optimizer, x), (x,), optimizer)


class ClickLSTM(nn.Module):
    def __init__(self, input_size: int = W, hidden_size: int = W, num_layers: int = 2) -> None:
        super().__init__()
        self.hidden_size, self.num_layers = hidden_size, num_layers
        self.lstm = nn.LSTM(input_size, hidden_size, num_layers, batch_first=True)
        self.fc = nn.Linear(hidden_size, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h0 = torch.zeros(self.num_layers, x.size(0), self.hidden_size)
        c0 = torch.zeros(self.num_layers, x.size(0), self.hidden_size)
        out, _ = self.lstm(x, (h0, c0))  # case: lstm_h0_zeros_in_forward
        return self.fc(out[:, -1, :])


def click_train_step(model: nn.Module, data: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
    explain_here(model, data)
    return F.binary_cross_entropy_with_logits(model(data).squeeze(1), label)


# "I am sure all the elements are already on GPU": the LSTM's h0/c0 made with torch.zeros in forward
@R.mistake("pytorch/pytorch#52186", ("h0", "torch.zeros"), "model.lstm")
def lstm_h0_zeros_in_forward(dev: torch.device, other: torch.device) -> Program:
    model = ClickLSTM().to(dev)
    data, label = randn(3, 4, W, device=dev), torch.ones(3, device=dev)
    return stepped(model, lambda: click_train_step(model, data, label), (data,))


class CPC(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Linear(W, W)
        self.gru = nn.GRU(W, W, batch_first=True)
        self.predictor = nn.Linear(W, W)

    def init_hidden(self, batch_size: int) -> torch.Tensor:
        return torch.zeros(1, batch_size, W)

    def forward(self, x: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        z = self.encoder(x)
        output, hidden = self.gru(z, hidden)  # case: cpc_hidden_from_init_hidden_in_fit
        return self.predictor(output[:, -1]), hidden


class CPCTrainer:
    def __init__(self, model: nn.Module) -> None:
        self.cpc = model

    def fit_batch(self, Xbatch: torch.Tensor) -> torch.Tensor:
        explain_here(self.cpc, Xbatch)
        hidden = self.cpc.init_hidden(len(Xbatch))
        predictions, hidden = self.cpc(Xbatch, hidden)
        return predictions.square().mean()


# contrastive predictive coding: the trainer asks the model's init_hidden() for the GRU state (a CPU zeros). When the
# step runs, the user's code holds the model only as trainer.cpc (`model` was this builder's, gone by then), so the
# path starts there, as the user would type it; it was model.gru while every path started at 'model'
@R.mistake("talipucar/CPC#1", ("hidden", "torch.zeros"), "trainer.cpc.gru")
def cpc_hidden_from_init_hidden_in_fit(dev: torch.device, other: torch.device) -> Program:
    model = CPC().to(dev)
    trainer = CPCTrainer(model)
    Xbatch = randn(2, 5, W, device=dev)
    return stepped(model, lambda: trainer.fit_batch(Xbatch), (Xbatch,))


class Graph:
    """A graph sample: node features and edges, as torch_geometric's Data."""

    def __init__(self, x: torch.Tensor, edge_index: torch.Tensor) -> None:
        self.x, self.edge_index = x, edge_index


class GCNConv(nn.Module):
    def __init__(self, dim_in: int, dim_out: int) -> None:
        super().__init__()
        self.lin = nn.Linear(dim_in, dim_out)

    def forward(self, x: torch.Tensor, edge_index: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        messages = h.index_select(0, edge_index[0])  # case: forward_reads_global_graph
        return h.index_add(0, edge_index[1], messages)


data = Graph(torch.randn(5, W), torch.tensor([[0, 1, 2, 3], [1, 2, 3, 4]]))  # loaded on the CPU


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = GCNConv(W, W)
        self.conv2 = GCNConv(W, C)

    def forward(self, x: torch.Tensor, edge_index: torch.Tensor) -> torch.Tensor:
        x, edge_index = x, data.edge_index  # the global, not the argument
        x = F.relu(self.conv1(x, edge_index))
        return F.log_softmax(self.conv2(x, edge_index), dim=1)


# the forward reads the global `data.edge_index` (on the CPU) instead of its argument (meta lets index_select mix)
@R.mistake("snap-stanford/ogb#68", "data.edge_index", "model.conv1", pairs=GPU)
def forward_reads_global_graph(dev: torch.device, other: torch.device) -> Program:
    model = Net().to(dev)
    x, edge_index = data.x.to(dev), data.edge_index.to(dev)
    return Program(model, lambda: model(x, edge_index), (x, edge_index))


class Selector(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(W, W)
        self.second = nn.Linear(W, W)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        first_opt, second_opt = self.first(x), self.second(x)
        decider = torch.randint(0, 2, size=first_opt.shape).bool()
        return torch.where(decider, first_opt, second_opt)  # case: where_condition_on_cpu


# torch.where with a random condition made by torch.randint(...) without a device
@R.mistake("pytorch/pytorch#8378", ("decider", "torch.randint"), "model")
def where_condition_on_cpu(dev: torch.device, other: torch.device) -> Program:
    model = Selector().to(dev)
    x = randn(4, W, device=dev)
    return Program(model, lambda: model(x), (x,))


class CaptionDecoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.GRU(W, W, batch_first=True)
        self.logit = nn.Linear(W, C)

    def forward(self, feats: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        packed = nn.utils.rnn.pack_padded_sequence(feats, lengths, batch_first=True)  # case: pack_lengths_on_gpu
        out, _ = nn.utils.rnn.pad_packed_sequence(self.rnn(packed)[0], batch_first=True)
        return self.logit(out)


def caption_train_step(model: nn.Module, feats: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    explain_here(model, feats, lengths)
    return model(feats, lengths).logsumexp(-1).mean()


# the lengths moved to the GPU with the rest of the batch: pack_padded_sequence wants them on the CPU
@R.mistake("YiwuZhong/Sub-GC#15", "lengths", "model")
def pack_lengths_on_gpu(dev: torch.device, other: torch.device) -> Program:
    model = CaptionDecoder().to(dev)
    feats = randn(2, 5, W, device=dev)
    lengths = torch.tensor([5, 3]).to(dev)
    return stepped(model, lambda: caption_train_step(model, feats, lengths), (feats, lengths))


class T5SelfAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v = nn.Linear(W, W), nn.Linear(W, W), nn.Linear(W, W)

    def forward(self, hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        scores = self.q(hidden) @ self.k(hidden).transpose(-2, -1)
        scores = scores.masked_fill(mask, float("-inf"))  # case: decoder_mask_made_on_cpu
        return scores.softmax(-1) @ self.v(hidden)


class T5Decoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.self_attn = T5SelfAttention()
        self.lm_head = nn.Linear(W, C)

    def _causal_mask(self, n: int) -> torch.Tensor:
        return torch.triu(torch.ones(n, n, dtype=torch.bool), diagonal=1)

    def forward(self, decoder_tokens: torch.Tensor) -> torch.Tensor:
        dec_mask = self._causal_mask(decoder_tokens.shape[1])
        return self.lm_head(self.self_attn(decoder_tokens, dec_mask))


# torchtext's T5 decoder built its causal mask on the CPU: fine on the CPU, a mismatch once the model is on a GPU
@R.mistake("pytorch/text#1977", "dec_mask", "model.self_attn")
def decoder_mask_made_on_cpu(dev: torch.device, other: torch.device) -> Program:
    model = T5Decoder().to(dev)
    decoder_tokens = randn(2, 5, W, device=dev)
    return Program(model, lambda: model(decoder_tokens), (decoder_tokens,))


class CTRLEmbeddings(nn.Module):
    def __init__(self, n_positions: int = 16) -> None:
        super().__init__()
        self.w = nn.Embedding(10, W)
        position = torch.arange(n_positions).float()[:, None]
        self.pos_encoding = torch.sin(position / 10000 ** (torch.arange(W).float() / W))  # a plain attribute
        self.head = nn.Linear(W, C)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        position_ids = torch.arange(input_ids.shape[-1], device=input_ids.device)[None]
        pos_embeds = self.pos_encoding[position_ids, :]  # case: pos_encoding_attribute_indexed_by_gpu_ids
        return self.head(self.w(input_ids) + pos_embeds)


# CTRL's sinusoidal pos_encoding is a plain tensor attribute, indexed with position_ids made on the GPU
@R.mistake("huggingface/transformers#19681", "pos_encoding", "model", pairs=GPU)  # meta lets it take meta indices
def pos_encoding_attribute_indexed_by_gpu_ids(dev: torch.device, other: torch.device) -> Program:
    model = CTRLEmbeddings().to(dev)
    input_ids = torch.randint(0, 10, (2, 6), device=dev)
    return Program(model, lambda: model(input_ids), (input_ids,))


def sequence_mask(lengths: torch.Tensor, max_len: int | None = None) -> torch.Tensor:
    batch_size = lengths.numel()
    max_len = max_len or int(lengths.max())
    positions = torch.arange(0, max_len).type_as(lengths)
    return positions.repeat(batch_size, 1).lt(lengths.unsqueeze(1))  # case: sequence_mask_type_as_current_gpu


class MaskedMeanEncoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(W, C)

    def forward(self, src: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        mask = sequence_mask(lengths, src.shape[1])
        return self.proj((src * mask[..., None]).sum(1))


# OpenNMT's sequence_mask: arange(...).type_as(lengths) lands on the *current* GPU (0), lengths are on GPU 1
@R.mistake("OpenNMT/OpenNMT-py#1494", ("positions", "type_as"), "model", pairs=TWO_GPUS)
def sequence_mask_type_as_current_gpu(dev: torch.device, other: torch.device) -> Program:
    model = MaskedMeanEncoder().to(dev)
    src, lengths = randn(2, 5, W, device=dev), torch.tensor([5, 3], device=dev)
    return Program(model, lambda: model(src, lengths), (src, lengths))


class LoRALinear(nn.Module):
    def __init__(self, base: nn.Linear, rank: int = 2, alpha: float = 4.0) -> None:
        super().__init__()
        self.base = base
        self.lora_A = nn.Parameter(torch.randn(rank, base.in_features) * 0.01)
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, rank))
        self.scaling = alpha / rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.lora_A.T @ self.lora_B.T) * self.scaling  # case: lora_injected_after_move


def inject_lora(model: nn.Module) -> nn.Module:
    for name, child in list(model.named_children()):
        if isinstance(child, nn.Linear):
            setattr(model, name, LoRALinear(child))
        else:
            inject_lora(child)
    return model


class TwoLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(W, W)
        self.down = nn.Linear(W, C)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.up(x).relu())


# inject_lora() replaces Linear layers after model.to('cuda'): the new lora_A/lora_B are made on the CPU
@R.mistake("ViperEkura/AstrAI#19", "lora_A", "model.up", pairs=GPU)  # matmul: meta lets it mix
def lora_injected_after_move(dev: torch.device, other: torch.device) -> Program:
    model = TwoLayer().to(dev)
    inject_lora(model)
    x = randn(4, W, device=dev)
    return stepped(model, lambda: forward_step(model, x), (x,))


class FourierPositionalEncoding(nn.Module):
    def __init__(self, sigma: float = 1.0, m: int = 4) -> None:
        super().__init__()
        self.sigma, self.m = sigma, m

    def forward(self, v: torch.Tensor) -> torch.Tensor:
        j = torch.arange(self.m)
        coeffs = 2 * np.pi * self.sigma ** (j / self.m)
        vp = coeffs * torch.unsqueeze(v, -1)  # case: fourier_features_arange
        return torch.cat((torch.cos(vp), torch.sin(vp)), dim=-1).flatten(-2)


class NeRFMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoding = FourierPositionalEncoding()
        self.mlp = nn.Linear(3 * 8, C)

    def forward(self, xyz: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.encoding(xyz))


# random-fourier-features' PositionalEncoding made torch.arange(m) on the CPU whatever the input's device
@R.mistake("jmclong/random-fourier-features-pytorch#4", ("coeffs", "torch.arange"), "model.encoding")
def fourier_features_arange(dev: torch.device, other: torch.device) -> Program:
    model = NeRFMLP().to(dev)
    xyz = randn(5, 3, device=dev)
    return Program(model, lambda: model(xyz), (xyz,))


class FirstHalf(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(W, W)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.embed(x).relu()


class SplitLM(nn.Module):
    """A model dispatched over two devices (device_map): the first block on one, the head on the other."""

    def __init__(self, first: torch.device, last: torch.device) -> None:
        super().__init__()
        self.block = FirstHalf().to(first)
        self.lm_head = nn.Linear(W, C).to(last)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.block(x)
        return self.lm_head(h.to(self.lm_head.weight.device))


def lm_step(model: nn.Module, x: torch.Tensor, labels_cpu: torch.Tensor) -> torch.Tensor:
    explain_here(model, x)
    first_device = next(model.parameters()).device
    labels = labels_cpu.to(first_device)
    logits = model(x.to(first_device))
    return F.cross_entropy(logits, labels)  # case: labels_moved_to_first_parameter_device


# a dispatched model's logits come out on its last device; the labels were moved to next(model.parameters()).device
@R.mistake("lyhue1991/torchkeras#20", "labels")
def labels_moved_to_first_parameter_device(dev: torch.device, other: torch.device) -> Program:
    model = SplitLM(other, dev)
    x, labels_cpu = torch.randn(4, W), torch.randint(0, C, (4,))
    return stepped(model, lambda: lm_step(model, x, labels_cpu), (x.to(other),))


# --------------------------------------------------------------------------- legal patterns

class SinusoidalPositionalEmbedding(nn.Module):
    def __init__(self, embedding_dim: int = W, init_size: int = 32) -> None:
        super().__init__()
        position = torch.arange(init_size).float()[:, None]
        self.weights = torch.sin(position / 10000 ** (torch.arange(embedding_dim).float() / embedding_dim))
        self.register_buffer("_float_tensor", torch.FloatTensor(1))  # follows the model's device

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        self.weights = self.weights.to(self._float_tensor)
        return self.weights[: tokens.shape[1]][None].expand(tokens.shape[0], -1, -1)


class FairseqEncoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed_positions = SinusoidalPositionalEmbedding()
        self.proj = nn.Linear(W, C)

    def forward(self, src: torch.Tensor) -> torch.Tensor:
        return self.proj(src + self.embed_positions(src))


# fairseq's sinusoidal table is a plain attribute moved in forward with .to(self._float_tensor), a dummy buffer
@R.legal("facebookresearch/fairseq#4420")
def sinusoidal_table_follows_dummy_buffer(dev: torch.device, other: torch.device) -> Program:
    model = FairseqEncoder().to(dev)
    src = randn(2, 5, W, device=dev)
    return stepped(model, lambda: forward_step(model, src), (src,))


class LRPHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(W, W)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lrp_p = self.lin(x)
        outlier_mask = lrp_p.abs() < lrp_p.abs().mean() * 3
        explanation = torch.where(outlier_mask, lrp_p, torch.tensor(0.0))
        return explanation


# torch.where(mask, x, torch.tensor(0.0)): the 0-dim CPU fallback is a scalar, which torch takes on any device
@R.legal("akarasman/yolo-heatmaps#13")
def where_zero_dim_explanation_fallback(dev: torch.device, other: torch.device) -> Program:
    model = LRPHead().to(dev)
    x = randn(4, W, device=dev)
    return stepped(model, lambda: forward_step(model, x), (x,))


class MultiHeadAttention(nn.Module):
    def __init__(self, context_length: int = 8) -> None:
        super().__init__()
        self.W_query, self.W_key, self.W_value = nn.Linear(W, W), nn.Linear(W, W), nn.Linear(W, W)
        self.register_buffer("mask", torch.triu(torch.ones(context_length, context_length), diagonal=1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[1]
        attn_scores = self.W_query(x) @ self.W_key(x).transpose(1, 2)
        attn_scores.masked_fill_(self.mask.bool()[:n, :n], -torch.inf)
        return torch.softmax(attn_scores / W ** 0.5, dim=-1) @ self.W_value(x)


# the causal mask registered as a buffer in __init__ (LLMs-from-scratch): it moves with the model
@R.legal("rasbt/LLMs-from-scratch#279")
def causal_mask_registered_buffer(dev: torch.device, other: torch.device) -> Program:
    model = MultiHeadAttention().to(dev)
    x = randn(2, 6, W, device=dev)
    return stepped(model, lambda: forward_step(model, x), (x,))


class TinyBert(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.word = nn.Embedding(10, W)
        self.token_type = nn.Embedding(2, W)
        self.head = nn.Linear(W, C)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                token_type_ids: torch.Tensor) -> torch.Tensor:
        h = self.word(input_ids) + self.token_type(token_type_ids)
        return self.head((h * attention_mask[..., None]).sum(1))


def encode_step(model: nn.Module, encoding: dict[str, torch.Tensor], dev: torch.device) -> torch.Tensor:
    model_input = {k: v.to(dev) for k, v in encoding.items()}
    explain_here(model, *model_input.values())
    return model(**model_input)


# the tokenizer's CPU output moved key by key to the model's device before model(**inputs)
@R.legal("huggingface/transformers#11165")
def tokenizer_output_moved_to_device(dev: torch.device, other: torch.device) -> Program:
    model = TinyBert().to(dev)
    encoding = {"input_ids": torch.randint(0, 10, (2, 5)), "attention_mask": torch.ones(2, 5),
                "token_type_ids": torch.zeros(2, 5, dtype=torch.long)}
    return stepped(model, lambda: encode_step(model, encoding, dev),
                   tuple(v.to(dev) for v in encoding.values()))


def finetune_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    explain_here(model, x)
    return F.cross_entropy(model(x), y)


# a checkpoint loaded with map_location='cpu' into a model already on the GPU: load_state_dict copies across
@R.legal("https://pytorch.org/tutorials/beginner/saving_loading_models.html#saving-loading-model-across-devices")
def state_dict_from_cpu_into_moved_model(dev: torch.device, other: torch.device) -> Program:
    with torch.device("cpu"):
        state_dict = Toy().state_dict()
    model = Toy().to(dev)
    model.load_state_dict(state_dict)
    x, y = randn(4, W, device=dev), labels(4, dev)
    return stepped(model, lambda: finetune_step(model, x, y), (x,))


def normalize_on_device(tensor: torch.Tensor, mean: list[float], std: list[float]) -> torch.Tensor:
    mean_t = torch.as_tensor(mean, dtype=tensor.dtype, device=tensor.device)
    std_t = torch.as_tensor(std, dtype=tensor.dtype, device=tensor.device)
    return (tensor - mean_t[:, None, None]) / std_t[:, None, None]


def normalized_forward_step(model: nn.Module, img: torch.Tensor) -> torch.Tensor:
    explain_here(model, img)
    return model(normalize_on_device(img, [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]))


# torchvision's fix: mean and std made with torch.as_tensor(..., device=tensor.device)
@R.legal("pytorch/vision#787")
def normalize_constants_on_tensor_device(dev: torch.device, other: torch.device) -> Program:
    model = nn.Conv2d(3, C, 1).to(dev)
    img = randn(2, 3, 4, 4, device=dev)
    return stepped(model, lambda: normalized_forward_step(model, img), (img,))


class Normalizer(nn.Module):
    def __init__(self, shift: list[float], scale: list[float]) -> None:
        super().__init__()
        self.shift = torch.tensor(shift)  # plain attributes on the host ...
        self.scale = torch.tensor(scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x - self.shift.to(x.device)) / self.scale.to(x.device)  # ... moved per call


class Surrogate(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.normalizer = Normalizer([0.0] * W, [2.0] * W)
        self.net = nn.Linear(W, C)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(self.normalizer(x))


# shift and scale kept on the host and moved with .to(x.device) in forward: a no-op on the CPU, a copy on the GPU
@R.legal("Emmi-AI/noether#156")
def normalizer_moves_constants_per_call(dev: torch.device, other: torch.device) -> Program:
    model = Surrogate().to(dev)
    x = randn(4, W, device=dev)
    return stepped(model, lambda: forward_step(model, x), (x,))


class RelativePosition2D(nn.Module):
    def __init__(self, max_relative_position: int = 3) -> None:
        super().__init__()
        self.max_relative_position = max_relative_position
        self.embeddings_table_v = nn.Parameter(torch.randn(2 * max_relative_position + 1, W))

    def forward(self, length_q: int, length_k: int) -> torch.Tensor:
        device = self.embeddings_table_v.device
        range_vec_q = torch.arange(length_q, device=device)
        range_vec_k = torch.arange(length_k, device=device)
        distance_mat = range_vec_k[None, :] - range_vec_q[:, None]
        final_mat = distance_mat.clamp(-self.max_relative_position, self.max_relative_position)
        return self.embeddings_table_v[final_mat + self.max_relative_position]


class RelAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rel_pos = RelativePosition2D()
        self.q = nn.Linear(W, W)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rel = self.rel_pos(x.shape[1], x.shape[1])
        return torch.einsum("bqd,qkd->bqk", self.q(x), rel).softmax(-1) @ x


# AutoFormer's fix: the relative positions made with torch.arange(..., device=self.embeddings_table_v.device)
@R.legal("microsoft/Cream#116")
def relative_positions_on_parameter_device(dev: torch.device, other: torch.device) -> Program:
    model = RelAttention().to(dev)
    x = randn(2, 5, W, device=dev)
    return stepped(model, lambda: forward_step(model, x), (x,))


def pinned_step(model: nn.Module, x_cpu: torch.Tensor, y: torch.Tensor, dev: torch.device) -> torch.Tensor:
    x = x_cpu.pin_memory().to(dev, non_blocking=True)
    explain_here(model, x)
    return F.cross_entropy(model(x), y)


# a host batch in pinned memory copied with non_blocking=True before the forward
@R.legal("https://pytorch.org/docs/stable/notes/cuda.html#use-pinned-memory-buffers", pairs=GPU)
def pinned_batch_non_blocking_copy(dev: torch.device, other: torch.device) -> Program:
    model = Toy().to(dev)
    x_cpu, y = torch.randn(4, W), labels(4, dev)
    return stepped(model, lambda: pinned_step(model, x_cpu, y, dev), (x_cpu.to(dev),))


def align_devices_hook(module: nn.Module, args: tuple) -> tuple:
    device = next(module.parameters()).device
    return tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in args)


class Offloaded(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Linear(W, W)
        self.decoder = nn.Linear(W, C)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.encoder(x).relu())


# a model dispatched over two devices whose submodules move their inputs in forward pre-hooks (accelerate's hooks)
@R.legal("https://huggingface.co/docs/accelerate/concept_guides/big_model_inference")
def dispatched_model_with_input_hooks(dev: torch.device, other: torch.device) -> Program:
    model = Offloaded()
    model.encoder.to(other)
    model.decoder.to(dev)
    for part in (model.encoder, model.decoder):
        part.register_forward_pre_hook(align_devices_hook)
    x = torch.randn(4, W).to(other)
    return stepped(model, lambda: forward_step(model, x), (x,))
