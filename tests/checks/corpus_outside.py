"""Device mistakes and legal device patterns from other projects' public reports: the development part of
the outside corpus (issue 31). Its held-out part, corpus_heldout2.py, holds different reports and is not
read by anyone changing the diagnosis.

Same shape as corpus_public.py (see corpus_kit.py): each case cites its public source (owner/repo#number or a
documentation page), a mistake names what a report must contain (culprit, as the user wrote it), its module path
(from the user's own variable; a module outside the model by the variable that holds it) and the user's line
(the line ending in `# case: NAME`); a legal pattern must raise nothing in any mode. On the CPU the pair is meta
(where the model runs) vs cpu (where a factory without a device lands); a case that only a real accelerator
refuses (meta kernels let linear, gather, indexing and in-place ops mix devices) lists the GPU pairs only.

Scored with `torchplace bench diagnose --corpus tests/checks/corpus_outside.py`; tests/checks/test_corpus_public.py
runs it on cpu vs meta with the cases that fail today marked xfail(strict=True) (OUTSIDE_XFAIL there).
Score when written (2026-12-02, main at 77ac0e0, cpu vs meta: 30 cases, 19 mistakes and 11 legal, of which 8 and 8
run on this pair; the other 14 need one GPU or two and were not scored here, no GPU being lent to this work):

    names the culprit                        strict 5/8   watch 5/8   explain 5/8
    ... with module path, tensor and line    strict 4/8   watch 4/8   explain 4/8
    false alarms on legal code               strict 0/8   watch 0/8   explain 0/8

Missed: stft_window_in_extractor (the buffer named by its class, Spectrogram.window, not by extractor.spec),
bilstm_zero_state_on_cpu and convlstm_init_hidden (the state is named, the torch.zeros that made it is not: in
the second it was made in the init_hidden() helper), ema_copy_left_on_cpu (`old` in calculate_ema() is named,
not ema.ema_model whose parameters were passed in).
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


# --------------------------------------------------------------------------- mistakes

def build_criterion(class_counts: torch.Tensor) -> nn.Module:
    weights = class_counts.sum() / class_counts
    return nn.CrossEntropyLoss(weight=weights)


def weighted_step(model: nn.Module, loss_fn: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    explain_here(model, x, loss_fn)
    logits = model(x)
    return loss_fn(logits, y)  # case: loss_weight_built_in_helper


# the loss is built in a helper with class weights on the CPU (never .cuda()), input and target on the GPU
@R.mistake("pytorch/pytorch#3879", "loss_fn.weight", "loss_fn")
def loss_weight_built_in_helper(dev: torch.device, other: torch.device) -> Program:
    model = Toy().to(dev)
    loss_fn = build_criterion(torch.tensor([30.0, 10.0, 5.0]))
    x, y = randn(4, W, device=dev), labels(4, dev)
    return stepped(model, lambda: weighted_step(model, loss_fn, x, y), (x,))


class StatScores(nn.Module):
    """A metric whose states are buffers (torchmetrics' add_state), updated in place."""

    def __init__(self, num_classes: int) -> None:
        super().__init__()
        self.num_classes = num_classes
        self.register_buffer("tp", torch.zeros(num_classes))
        self.register_buffer("total", torch.zeros(num_classes))

    def forward(self, preds: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        truth = F.one_hot(target, self.num_classes).float()
        self.tp += (F.one_hot(preds.argmax(1), self.num_classes) * truth).sum(0)  # case: metric_made_in_train_loop
        self.total += truth.sum(0)
        return self.tp.sum() / self.total.sum()


def metric_train_step(model: nn.Module, img: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
    explain_here(model, img)
    metric = StatScores(C)  # made in the loop, never moved
    yhat = model(img)
    out = torch.softmax(yhat, dim=1)
    return metric(out, label)


# torchmetrics.Accuracy() made inside the train loop and fed GPU predictions (in place: meta lets it mix)
@R.mistake("Lightning-AI/torchmetrics#608", "metric.tp", "metric", pairs=GPU)
def metric_made_in_train_loop(dev: torch.device, other: torch.device) -> Program:
    model = Toy().to(dev)
    img, label = randn(4, W, device=dev), labels(4, dev)
    return stepped(model, lambda: metric_train_step(model, img, label), (img,))


N_FFT = 16


class Spectrogram(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("window", torch.hann_window(N_FFT))

    def forward(self, wave: torch.Tensor) -> torch.Tensor:
        spec = torch.stft(wave, N_FFT, window=self.window, return_complex=True)  # case: stft_window_in_extractor
        return spec.abs().pow(2).mean(-1)


class FeatureExtractor:
    """An audio front end: a plain object holding its transform module (a MelSpectrogram)."""

    def __init__(self) -> None:
        self.spec = Spectrogram()

    def __call__(self, wave: torch.Tensor) -> torch.Tensor:
        return self.spec(wave).log1p()


def audio_classify_step(model: nn.Module, extractor: FeatureExtractor, wave: torch.Tensor) -> torch.Tensor:
    explain_here(model, wave)
    feats = extractor(wave)
    return model(feats)


# a spectrogram transform built on the CPU inside a feature extractor, called on a GPU waveform
@R.mistake("pytorch/pytorch#123167", "window", "extractor.spec")
def stft_window_in_extractor(dev: torch.device, other: torch.device) -> Program:
    model = nn.Sequential(nn.Linear(N_FFT // 2 + 1, W), nn.ReLU(), nn.Linear(W, C)).to(dev)
    extractor = FeatureExtractor()
    wave = randn(4, 64, device=dev)
    return stepped(model, lambda: audio_classify_step(model, extractor, wave), (wave,))


class CausalSelfAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(W, 3 * W)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, -1)
        L, S = q.shape[-2], k.shape[-2]
        attn_bias = torch.zeros(L, S, dtype=q.dtype, device=q.device)
        temp_mask = torch.ones(L, S, dtype=torch.bool).tril(diagonal=0)
        attn_bias.masked_fill_(temp_mask.logical_not(), float("-inf"))  # case: causal_mask_ones_tril
        weights = (q @ k.transpose(-2, -1) / W ** 0.5 + attn_bias).softmax(-1)
        return weights @ v


class TinyDecoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = CausalSelfAttention()
        self.head = nn.Linear(W, C)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x + self.attn(x))


# scaled_dot_product_attention's reference code: the causal mask made with torch.ones(L, S) (in place: meta mixes)
@R.mistake("pytorch/pytorch#166117", ("temp_mask", "torch.ones"), "model.attn", pairs=GPU)
def causal_mask_ones_tril(dev: torch.device, other: torch.device) -> Program:
    model = TinyDecoder().to(dev)
    x = randn(2, 5, W, device=dev)
    return Program(model, lambda: model(x), (x,))


class PositionalEncoding1D(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        inv_freq = 1.0 / (10000 ** (torch.arange(0, channels, 2).float() / channels))
        self.register_buffer("inv_freq", inv_freq)

    def forward(self, tensor: torch.Tensor) -> torch.Tensor:
        batch_size, x, _ = tensor.shape
        pos_x = torch.arange(x, dtype=self.inv_freq.dtype)
        sin_inp_x = pos_x[:, None] * self.inv_freq[None, :]  # case: positional_encoding_arange
        emb = torch.cat([sin_inp_x.sin(), sin_inp_x.cos()], -1)
        return emb[None].repeat(batch_size, 1, 1)


class Summer(nn.Module):
    def __init__(self, penc: nn.Module) -> None:
        super().__init__()
        self.penc = penc

    def forward(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor + self.penc(tensor)


class PatchEncoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(W, W)
        self.pos_enc = Summer(PositionalEncoding1D(W))
        self.head = nn.Linear(W, C)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        return self.head(self.pos_enc(self.embed(patches)))


# a positional-encoding library module makes its positions with torch.arange(x) (no device) inside a wrapper
@R.mistake("tatp22/multidim-positional-encoding#33", ("pos_x", "torch.arange"), "model.pos_enc.penc")
def positional_encoding_arange(dev: torch.device, other: torch.device) -> Program:
    model = PatchEncoder().to(dev)
    patches = randn(1, 6, W, device=dev)
    return Program(model, lambda: model(patches), (patches,))


class BiLSTM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(W, W, num_layers=1, bidirectional=True, batch_first=True)

    def forward(self, embedded_tokens: torch.Tensor, states: tuple | None = None) -> torch.Tensor:
        if states is None:
            bsz = embedded_tokens.size(0)
            state = (torch.zeros(2, bsz, W), torch.zeros(2, bsz, W))
        else:
            state = states
        rep, _ = self.lstm(embedded_tokens, state)  # case: bilstm_zero_state_on_cpu
        return rep


class DocClassifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Linear(W, W)
        self.representation = BiLSTM()
        self.decoder = nn.Linear(2 * W, C)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.representation(self.embedding(tokens))[:, -1])


# a zero initial state added to a BiLSTM representation, allocated on the CPU
@R.mistake("facebookresearch/pytext#297", ("state", "torch.zeros"), "model.representation.lstm")
def bilstm_zero_state_on_cpu(dev: torch.device, other: torch.device) -> Program:
    model = DocClassifier().to(dev)
    tokens = randn(2, 5, W, device=dev)
    return Program(model, lambda: model(tokens), (tokens,))


class ConvLSTMCell(nn.Module):
    def __init__(self, input_dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.hidden_dim = hidden_dim
        self.conv = nn.Conv2d(input_dim + hidden_dim, 4 * hidden_dim, 3, padding=1)

    def forward(self, input_tensor: torch.Tensor, cur_state: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        h_cur, c_cur = cur_state
        combined = torch.cat([input_tensor, h_cur], dim=1)  # case: convlstm_init_hidden
        i, f, o, g = torch.split(self.conv(combined), self.hidden_dim, dim=1)
        c_next = f.sigmoid() * c_cur + i.sigmoid() * g.tanh()
        return o.sigmoid() * c_next.tanh(), c_next

    def init_hidden(self, batch_size: int, image_size: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        height, width = image_size
        return (torch.zeros(batch_size, self.hidden_dim, height, width),
                torch.zeros(batch_size, self.hidden_dim, height, width))


class ConvLSTM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.cell_list = nn.ModuleList([ConvLSTMCell(1, 4)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _, h, w = x.shape
        hidden_state = [cell.init_hidden(b, (h, w)) for cell in self.cell_list]
        cur = x
        for i, cell in enumerate(self.cell_list):
            hid, c = hidden_state[i]
            outs = []
            for step in range(t):
                hid, c = cell(cur[:, step], [hid, c])
                outs.append(hid)
            cur = torch.stack(outs, 1)
        return cur


# ConvLSTM's init_hidden() helper makes the states with torch.zeros(...) and no device
@R.mistake("ndrplz/ConvLSTM_pytorch#10", ("h_cur", "torch.zeros"), "model.cell_list.0")
def convlstm_init_hidden(dev: torch.device, other: torch.device) -> Program:
    model = ConvLSTM().to(dev)
    x = randn(2, 3, 1, 4, 4, device=dev)
    return Program(model, lambda: model(x), (x,))


def dp_train_step(net: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    explain_here(net, x)
    out = net(x)  # case: dataparallel_net_never_moved
    return F.cross_entropy(out, y)


# nn.DataParallel(net, device_ids=devices) on a net still on the CPU; DataParallel refuses (a GPU rule)
@R.mistake("d2l-ai/d2l-en#2461", "net.module", "net.module", pairs=("cuda-cpu",))
def dataparallel_net_never_moved(dev: torch.device, other: torch.device) -> Program:
    devices = [dev]
    net = nn.DataParallel(Toy(), device_ids=devices)
    x, y = randn(4, W, device=dev), labels(4, dev)
    return stepped(net, lambda: dp_train_step(net, x, y), (x,))


def hash_loss(u: torch.Tensor, codes: torch.Tensor, s_batch: torch.Tensor) -> torch.Tensor:
    return (u @ codes.T / W - s_batch).pow(2).mean()


def hashing_step(model: nn.Module, x: torch.Tensor, index: torch.Tensor, codes: torch.Tensor,
                 similarity: torch.Tensor) -> torch.Tensor:
    explain_here(model, x)
    u = model(x)
    return hash_loss(u, codes, similarity[index, :])  # case: similarity_indexed_by_gpu_index


# deep hashing: the similarity matrix built on the CPU, indexed with the batch's sample indices on the GPU
@R.mistake("aassxun/SEMICON#2", "similarity", pairs=GPU)  # meta lets a CPU tensor take meta indices
def similarity_indexed_by_gpu_index(dev: torch.device, other: torch.device) -> Program:
    model = nn.Linear(W, C).to(dev)
    train_labels = F.one_hot(torch.arange(10) % C, C).float()
    similarity = (train_labels @ train_labels.T > 0).float()
    x, index = randn(4, W, device=dev), torch.arange(4, device=dev)
    codes = torch.sign(randn(10, C, device=dev))
    return stepped(model, lambda: hashing_step(model, x, index, codes, similarity), (x,))


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, -1)
    return torch.cat((-x2, x1), -1)


def apply_rotary_pos_emb(q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                         position_ids: torch.Tensor) -> torch.Tensor:
    gather_indices = position_ids[:, None, :, None].repeat(1, cos.shape[1], 1, cos.shape[3])
    cos = torch.gather(cos.repeat(gather_indices.shape[0], 1, 1, 1), 2, gather_indices)  # case: rotary_cache_gather
    sin = torch.gather(sin.repeat(gather_indices.shape[0], 1, 1, 1), 2, gather_indices)
    return q * cos + rotate_half(q) * sin


class RotaryEmbedding(nn.Module):
    def __init__(self, dim: int, max_position: int = 16) -> None:
        super().__init__()
        inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
        freqs = torch.outer(torch.arange(max_position).float(), inv_freq)
        emb = torch.cat((freqs, freqs), -1)
        self.cos_cached = emb.cos()[None, None]  # plain attributes: model.to() leaves them
        self.sin_cached = emb.sin()[None, None]

    def forward(self, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos_cached[:, :, :seq_len], self.sin_cached[:, :, :seq_len]


class RotaryAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q_proj = nn.Linear(W, W)
        self.rotary_emb = RotaryEmbedding(W)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        q = self.q_proj(x)[:, None]
        cos, sin = self.rotary_emb(x.shape[1])
        return apply_rotary_pos_emb(q, cos, sin, position_ids)


# Llama's rotary cos/sin cache on the CPU, gathered with GPU position_ids in a helper (meta lets gather mix)
@R.mistake("OptimalScale/LMFlow#465", "cos_cached", "model.rotary_emb", pairs=GPU)
def rotary_cache_gather(dev: torch.device, other: torch.device) -> Program:
    model = RotaryAttention().to(dev)
    x = randn(2, 5, W, device=dev)
    position_ids = torch.arange(5, device=dev)[None].repeat(2, 1)
    return Program(model, lambda: model(x, position_ids), (x, position_ids))


def normalize(tensor: torch.Tensor, mean: list[float], std: list[float]) -> torch.Tensor:
    mean_t = torch.tensor(mean, dtype=torch.float32)
    std_t = torch.tensor(std, dtype=torch.float32)
    return tensor.sub_(mean_t[:, None, None]).div_(std_t[:, None, None])  # case: normalize_mean_on_cpu


def denormalize(img: torch.Tensor) -> torch.Tensor:
    return normalize(img, [-0.485 / 0.229, -0.456 / 0.224, -0.406 / 0.225], [1 / 0.229, 1 / 0.224, 1 / 0.225])


def detection_flow_step(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    explain_here(model, batch)
    img = model(batch)
    return denormalize(img[0].detach())


# torchvision's normalize() built mean and std with torch.tensor(list) on the CPU; called on a GPU image
@R.mistake("pytorch/pytorch#19028", ("mean_t", "torch.tensor"), pairs=GPU)  # in place: meta lets it mix
def normalize_mean_on_cpu(dev: torch.device, other: torch.device) -> Program:
    model = nn.Conv2d(3, 3, 1).to(dev)
    batch = randn(2, 3, 4, 4, device=dev)
    return stepped(model, lambda: detection_flow_step(model, batch), (batch,))


class NoiseScheduler:
    """A DDPM scheduler: a plain object whose alphas_cumprod is made on the CPU."""

    def __init__(self, num_train_timesteps: int = 1000) -> None:
        betas = torch.linspace(1e-4, 0.02, num_train_timesteps)
        self.alphas_cumprod = torch.cumprod(1.0 - betas, dim=0)

    def add_noise(self, original: torch.Tensor, noise: torch.Tensor, timesteps: torch.Tensor) -> torch.Tensor:
        sqrt_alpha_prod = self.alphas_cumprod[timesteps] ** 0.5  # case: scheduler_alphas_indexed_by_gpu_timesteps
        sqrt_one_minus = (1 - self.alphas_cumprod[timesteps]) ** 0.5
        return sqrt_alpha_prod[:, None] * original + sqrt_one_minus[:, None] * noise


def diffusion_step(model: nn.Module, noise_scheduler: NoiseScheduler, latents: torch.Tensor) -> torch.Tensor:
    explain_here(model, latents)
    noise = torch.randn_like(latents)
    timesteps = torch.randint(0, 1000, (latents.shape[0],), device=latents.device)
    noisy_latents = noise_scheduler.add_noise(latents, noise, timesteps)
    return F.mse_loss(model(noisy_latents), noise)


# a diffusion training step: the scheduler's CPU alphas_cumprod indexed with GPU timesteps
@R.mistake("huggingface/diffusers#648", "alphas_cumprod", pairs=GPU)  # meta lets a CPU tensor take meta indices
def scheduler_alphas_indexed_by_gpu_timesteps(dev: torch.device, other: torch.device) -> Program:
    model = nn.Sequential(nn.Linear(W, W), nn.SiLU(), nn.Linear(W, W)).to(dev)
    noise_scheduler = NoiseScheduler()
    latents = randn(4, W, device=dev)
    return stepped(model, lambda: diffusion_step(model, noise_scheduler, latents), (latents,))


def subgraph(subset: torch.Tensor, edge_index: torch.Tensor, num_nodes: int) -> torch.Tensor:
    node_mask = torch.zeros(num_nodes, dtype=torch.bool, device=subset.device)
    node_mask[subset] = True
    edge_mask = node_mask[edge_index[0]] & node_mask[edge_index[1]]  # case: subgraph_node_mask_on_cpu
    return edge_index[:, edge_mask]


def gnn_step(model: nn.Module, x: torch.Tensor, edge_index: torch.Tensor, subset: torch.Tensor) -> torch.Tensor:
    explain_here(model, x)
    h = model(x)
    sub_edges = subgraph(subset, edge_index, x.shape[0])
    return h.index_add(0, sub_edges[1], h[sub_edges[0]]).sum()


# torch_geometric.utils.subgraph: the node subset (from a transform) on the CPU, edge_index on the GPU
@R.mistake("pyg-team/pytorch_geometric#8817", "node_mask", pairs=GPU)  # meta lets a CPU tensor take meta indices
def subgraph_node_mask_on_cpu(dev: torch.device, other: torch.device) -> Program:
    model = nn.Linear(W, W).to(dev)
    x = randn(6, W, device=dev)
    edge_index = torch.tensor([[0, 1, 2, 3, 4], [1, 2, 3, 4, 5]], device=dev)
    subset = torch.tensor([0, 1, 2, 3])
    return stepped(model, lambda: gnn_step(model, x, edge_index, subset), (x,))


def calculate_ema(beta: float, old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    return old * beta + new * (1 - beta)  # case: ema_copy_left_on_cpu


class EMA:
    def __init__(self, model: nn.Module, beta: float = 0.99) -> None:
        self.beta = beta
        self.online_model = model
        self.ema_model = copy.deepcopy(model)

    def update(self) -> None:
        for ema_param, online_param in zip(self.ema_model.parameters(), self.online_model.parameters()):
            ema_param.data = calculate_ema(self.beta, ema_param.data, online_param.data)


def ema_train_step(model: nn.Module, optimizer: torch.optim.Optimizer, ema: EMA, x: torch.Tensor) -> None:
    explain_here(model, x, optimizer=optimizer)
    model(x).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()
    ema.update()


# an EMA copy of the model made before the model was moved: its parameters stay on the CPU
@R.mistake("lucidrains/DALLE2-pytorch#87", "ema_model", "ema.ema_model")
def ema_copy_left_on_cpu(dev: torch.device, other: torch.device) -> Program:
    model = Toy()
    ema = EMA(model)
    model.to(dev)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x = randn(4, W, device=dev)
    return stepped(model, lambda: ema_train_step(model, optimizer, ema, x), (x,), optimizer)


class BertSelfAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.query, self.key, self.value = nn.Linear(W, W), nn.Linear(W, W), nn.Linear(W, W)

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        attention_scores = self.query(hidden_states) @ self.key(hidden_states).transpose(-1, -2) / W ** 0.5
        attention_scores = attention_scores + attention_mask  # case: bert_attention_mask_not_moved
        return attention_scores.softmax(-1) @ self.value(hidden_states)


class KBQABert(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embeddings = nn.Linear(W, W)
        self.attention = BertSelfAttention()
        self.classifier = nn.Linear(W, C)

    def forward(self, input_embeds: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        extended_attention_mask = (1.0 - attention_mask[:, None, :]) * -10000.0
        hidden = self.attention(self.embeddings(input_embeds), extended_attention_mask)
        return self.classifier(hidden[:, 0])


def kbqa_step(model: nn.Module, input_embeds: torch.Tensor, attention_mask: torch.Tensor,
              dev: torch.device) -> torch.Tensor:
    input_embeds = input_embeds.to(dev)
    explain_here(model, input_embeds, attention_mask)
    return model(input_embeds, attention_mask)


# BERT's extended attention mask made from a batch mask that was never moved, added to GPU scores
@R.mistake("lanyunshi/Multi-hopComplexKBQA#25", "attention_mask", "model.attention")
def bert_attention_mask_not_moved(dev: torch.device, other: torch.device) -> Program:
    model = KBQABert().to(dev)
    input_embeds, attention_mask = torch.randn(2, 5, W), torch.ones(2, 5)
    return stepped(model, lambda: kbqa_step(model, input_embeds, attention_mask, dev),
                   (input_embeds.to(dev), attention_mask))


class Critic(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(W + 2, 1)

    def forward(self, state: torch.Tensor, action: torch.Tensor) -> torch.Tensor:
        return self.q(torch.cat([state, action], -1))


def sample_batch(batch_size: int) -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(0)
    return (rng.random((batch_size, W), dtype=np.float32), rng.random((batch_size, 2), dtype=np.float32),
            rng.random((batch_size, 1), dtype=np.float32), np.zeros((batch_size, 1), dtype=np.float32),
            rng.random((batch_size, W), dtype=np.float32))


def td3_priority(critic_target: nn.Module, device: torch.device, discount: float = 0.99) -> torch.Tensor:
    state, action, reward, done, next_state = sample_batch(4)
    next_state = torch.Tensor(next_state).to(device)
    action = torch.Tensor(action).to(device)
    done = torch.Tensor(done).to(device)
    reward = torch.Tensor(reward)
    explain_here(critic_target, next_state, action)
    target_Q = critic_target(next_state, action)
    target_Q = reward + discount * (1 - done) * target_Q  # case: td3_reward_not_moved
    return target_Q.detach()


# TD3: everything sampled from the replay buffer moved to the device except the rewards
@R.mistake("reiniscimurs/DRL-robot-navigation#142", "reward")
def td3_reward_not_moved(dev: torch.device, other: torch.device) -> Program:
    critic_target = Critic().to(dev)
    return stepped(critic_target, lambda: td3_priority(critic_target, dev),
                   (randn(4, W, device=dev), randn(4, 2, device=dev)))


class DQNAgent:
    def __init__(self, Q: nn.Module) -> None:
        self.Q = Q

    def get_action(self, state: torch.Tensor) -> int:
        qvals = self.Q(state)  # case: dqn_state_from_numpy
        return int(qvals.argmax())


def dqn_act(agent: DQNAgent, state: np.ndarray) -> int:
    explain_here(agent.Q, torch.from_numpy(state))
    return agent.get_action(torch.from_numpy(state))


# the agent's Q network is on the GPU; the environment's state goes in as torch.from_numpy(state) (linear: GPU rule)
@R.mistake("DeepRLChinese/DeepRL-Chinese#4", ("state", "torch.from_numpy"), "agent.Q", pairs=GPU)
def dqn_state_from_numpy(dev: torch.device, other: torch.device) -> Program:
    agent = DQNAgent(nn.Sequential(nn.Linear(W, W), nn.ReLU(), nn.Linear(W, 2)).to(dev))
    state = np.zeros(W, dtype=np.float32)
    return stepped(agent.Q, lambda: dqn_act(agent, state), (torch.from_numpy(state),))


class IncrementalNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Linear(W, W)
        self.old_fc = nn.Linear(W, C)

    def forward(self, x: torch.Tensor, new_task_size: int = 2) -> torch.Tensor:
        features = self.backbone(x)
        new_rows = torch.zeros((new_task_size, W)).cuda()
        fc_weight = torch.cat([self.old_fc.weight, new_rows], dim=0)  # case: zeros_cuda_lands_on_gpu0
        return features @ fc_weight.T


# class-incremental learning run on GPU 1: the new classes' rows made with .cuda(), which means the current GPU 0
@R.mistake("LAMDA-CL/PyCIL#60", ("new_rows", ".cuda()"), "model", pairs=("cuda1-cuda0",))
def zeros_cuda_lands_on_gpu0(dev: torch.device, other: torch.device) -> Program:
    model = IncrementalNet().to(dev)
    x = randn(4, W, device=dev)
    return Program(model, lambda: model(x), (x,))


class PromptModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, W)
        self.head = nn.Linear(W, C)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(input_ids).mean(1))


def prompt_eval_step(prompt_model: nn.Module, inputs: torch.Tensor) -> torch.Tensor:
    inputs = inputs.cuda()
    explain_here(prompt_model, inputs)
    return prompt_model(inputs)  # case: inputs_cuda_while_model_on_gpu1


# prompt_model.cuda(1) for the model, inputs.cuda() for the batch: the batch goes to the current GPU, 0
@R.mistake("thunlp/OpenPrompt#160", "inputs", "prompt_model.embed", pairs=("cuda1-cuda0",))
def inputs_cuda_while_model_on_gpu1(dev: torch.device, other: torch.device) -> Program:
    prompt_model = PromptModel().cuda(dev.index)
    inputs = torch.randint(0, 10, (2, 5))
    return stepped(prompt_model, lambda: prompt_eval_step(prompt_model, inputs), (inputs.to(dev),))


# --------------------------------------------------------------------------- legal patterns

def clip_coords(x0: torch.Tensor, x1: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    x0 = torch.where(x0 < 0, torch.tensor(0), x0)
    x1 = torch.where(x1 > width - 1, torch.tensor(width - 1), x1)
    return x0, x1


class GridLookup(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.offset = nn.Linear(W, W)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pos = self.offset(x) * W
        x0 = pos.floor().long()
        x0, x1 = clip_coords(x0, x0 + 1, W)
        return (x1 - x0).float() * pos


# torch.where with a 0-dim CPU tensor as the fallback value: torch takes it with tensors on any device
@R.legal("open-mmlab/mmcv#2543")
def where_zero_dim_cpu_fallback(dev: torch.device, other: torch.device) -> Program:
    model = GridLookup().to(dev)
    x = randn(4, W, device=dev)
    return stepped(model, lambda: forward_step(model, x), (x,))


class DDPMStep:
    def __init__(self, num_train_timesteps: int = 1000) -> None:
        betas = torch.linspace(1e-4, 0.02, num_train_timesteps)
        self.alphas_cumprod = torch.cumprod(1.0 - betas, dim=0)

    def step(self, model_output: torch.Tensor, t: int, sample: torch.Tensor) -> torch.Tensor:
        alpha_prod_t = self.alphas_cumprod[t]  # a 0-dim CPU tensor
        beta_prod_t = 1 - alpha_prod_t
        return (sample - beta_prod_t ** 0.5 * model_output) / alpha_prod_t ** 0.5


def denoise_step(model: nn.Module, scheduler: DDPMStep, sample: torch.Tensor) -> torch.Tensor:
    explain_here(model, sample)
    return scheduler.step(model(sample), 500, sample)


# the scheduler's CPU alphas_cumprod indexed with a Python int: a 0-dim CPU scalar, which torch accepts
@R.legal("huggingface/diffusers#3089")
def scheduler_int_timestep_scalar(dev: torch.device, other: torch.device) -> Program:
    model = nn.Linear(W, W).to(dev)
    scheduler = DDPMStep()
    sample = randn(4, W, device=dev)
    return stepped(model, lambda: denoise_step(model, scheduler, sample), (sample,))


class RelPositionalEncoding(nn.Module):
    def __init__(self, d_model: int = W, max_len: int = 32) -> None:
        super().__init__()
        position = torch.arange(max_len).float()[:, None]
        div_term = torch.exp(torch.arange(0, d_model, 2).float() * -(9.21 / d_model))
        self.pe = torch.zeros(max_len, d_model)  # a plain attribute ...
        self.pe[:, 0::2] = torch.sin(position * div_term)
        self.pe[:, 1::2] = torch.cos(position * div_term)
        self.proj = nn.Linear(d_model, C)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.pe = self.pe.to(x.device)  # ... that forward moves itself
        return self.proj(x + self.pe[None, : x.shape[1]])


# wenet's positional encoding keeps pe as a plain attribute and moves it to x.device in forward
@R.legal("wenet-e2e/wenet#2413")
def pe_attribute_moved_in_forward(dev: torch.device, other: torch.device) -> Program:
    model = RelPositionalEncoding().to(dev)
    x = randn(2, 6, W, device=dev)
    return stepped(model, lambda: forward_step(model, x), (x,))


class HybridEncoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(W, W)
        self.register_buffer("pos_embed", torch.randn(1, 6, W), persistent=False)

    def forward(self, src: torch.Tensor) -> torch.Tensor:
        return self.proj(src) + self.pos_embed


# RT-DETR's fix: the precomputed position embedding as a non-persistent buffer, moved with the model
@R.legal("lyuwenyu/RT-DETR#679")
def pos_embed_nonpersistent_buffer(dev: torch.device, other: torch.device) -> Program:
    model = HybridEncoder().to(dev)
    src = randn(2, 6, W, device=dev)
    return stepped(model, lambda: forward_step(model, src), (src,))


class CaptionEncoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(W, W, batch_first=True)
        self.head = nn.Linear(W, C)

    def forward(self, seq: torch.Tensor, seq_lengths: torch.Tensor) -> torch.Tensor:
        packed = nn.utils.rnn.pack_padded_sequence(seq, seq_lengths, batch_first=True, enforce_sorted=False)
        out, _ = nn.utils.rnn.pad_packed_sequence(self.lstm(packed)[0], batch_first=True)
        return self.head(out[:, -1])


def caption_step(model: nn.Module, seq: torch.Tensor, seq_lengths: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    explain_here(model, seq, seq_lengths)
    return F.cross_entropy(model(seq, seq_lengths), y)


# lengths kept as a CPU tensor from the collate function, as pack_padded_sequence requires (since torch 1.7)
@R.legal("ruotianluo/self-critical.pytorch#239", pairs=GPU)  # packing copies data: meta tensors have none
def pack_with_cpu_lengths_from_collate(dev: torch.device, other: torch.device) -> Program:
    model = CaptionEncoder().to(dev)
    seq, y = randn(3, 5, W, device=dev), labels(3, dev)
    seq_lengths = torch.tensor([5, 2, 4])
    return stepped(model, lambda: caption_step(model, seq, seq_lengths, y), (seq, seq_lengths))


def dp_step(model: nn.Module, x_cpu: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    explain_here(model, x_cpu)
    return F.cross_entropy(model(x_cpu), y)


# DataParallel scatters CPU inputs to its devices itself: the batch may stay on the host
@R.legal("https://pytorch.org/docs/stable/generated/torch.nn.DataParallel.html", pairs=GPU)
def dataparallel_scatters_cpu_batch(dev: torch.device, other: torch.device) -> Program:
    model = nn.DataParallel(Toy().to(dev), device_ids=[dev])
    x_cpu, y = torch.randn(4, W), labels(4, dev)
    return stepped(model, lambda: dp_step(model, x_cpu, y), (x_cpu,))


def resume_step(model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor) -> None:
    explain_here(model, x, optimizer=optimizer)
    model(x).square().mean().backward()
    optimizer.step()


# resuming: the optimizer made after model.to(), then its state loaded from a CPU checkpoint;
# Optimizer.load_state_dict casts the state to each parameter's device (the step counts stay CPU scalars)
@R.legal("pytorch/pytorch#1515")
def optimizer_state_from_cpu_checkpoint(dev: torch.device, other: torch.device) -> Program:
    with torch.device("cpu"):
        saved = Toy()
        saved_opt = torch.optim.Adam(saved.parameters(), lr=1e-3)
        saved(torch.randn(4, W)).square().mean().backward()
        saved_opt.step()
    checkpoint = {"model": saved.state_dict(), "optimizer": saved_opt.state_dict()}
    model = Toy().to(dev)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    optimizer.load_state_dict(checkpoint["optimizer"])
    x = randn(4, W, device=dev)
    return stepped(model, lambda: resume_step(model, optimizer, x), (x,), optimizer)


class DeviceScoped(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(W, W)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.device(x.device):  # factories inside land on x's device
            scale = torch.ones(W) * 0.5
            bias = torch.zeros(x.shape[0], W)
        return self.proj(x) * scale + bias


# factories without a device inside `with torch.device(x.device):` land on that device
@R.legal("https://pytorch.org/docs/stable/tensor_attributes.html#torch-device")
def factories_under_device_context(dev: torch.device, other: torch.device) -> Program:
    model = DeviceScoped().to(dev)
    x = randn(4, W, device=dev)
    return stepped(model, lambda: forward_step(model, x), (x,))



class AttentionDecoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weights = nn.Parameter(torch.randn(W))
        self.out = nn.Linear(W, C)

    def forward(self, encoded: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        alignments_scores = encoded @ self.weights
        mask = torch.arange(encoded.shape[1])[None, :] < torch.tensor(lengths, device="cpu")[:, None]
        alignments_scores[~mask] = float("-inf")  # a CPU boolean mask as the index: torch takes it
        attn = alignments_scores.softmax(-1)
        return self.out((attn[..., None] * encoded).sum(1))


# deepparse built its attention mask on the CPU; its PR said assigning through it fails on the GPU (it could
# not check there): torch takes CPU indices, boolean masks included, for a tensor on any device
@R.legal("GRAAL-Research/deepparse#298")
def cpu_bool_mask_assignment(dev: torch.device, other: torch.device) -> Program:
    model = AttentionDecoder().to(dev)
    encoded = randn(2, 5, W, device=dev)
    return stepped(model, lambda: forward_step(model, encoded, [5, 3]), (encoded, [5, 3]))


class SpeechCTC(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(W, C + 1)

    def forward(self, feats: torch.Tensor) -> torch.Tensor:
        return self.proj(feats).log_softmax(-1).transpose(0, 1)  # (time, batch, classes)


def ctc_step(model: nn.Module, feats: torch.Tensor, targets: torch.Tensor, input_lengths: torch.Tensor,
             target_lengths: torch.Tensor) -> torch.Tensor:
    explain_here(model, feats)
    return F.ctc_loss(model(feats), targets, input_lengths, target_lengths)


# F.ctc_loss with its length tensors on the CPU (as the collate made them) and log-probs on the GPU
@R.legal("https://pytorch.org/docs/stable/generated/torch.nn.functional.ctc_loss.html", pairs=GPU)
def ctc_lengths_on_cpu(dev: torch.device, other: torch.device) -> Program:
    model = SpeechCTC().to(dev)
    feats = randn(2, 6, W, device=dev)
    targets = torch.randint(1, C + 1, (2, 3), device=dev)
    input_lengths, target_lengths = torch.tensor([6, 6]), torch.tensor([3, 2])
    return stepped(model, lambda: ctc_step(model, feats, targets, input_lengths, target_lengths), (feats,))


class CausalEncoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qk = nn.Linear(W, 2 * W)
        self.head = nn.Linear(W, C)

    def forward(self, src: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(src.shape[1])  # follows the default device
        q, k = self.qk(src).chunk(2, -1)
        return self.head(((q @ k.transpose(1, 2) + mask).softmax(-1) @ src)[:, -1])


def default_device_step(model: nn.Module, src: torch.Tensor, dev: torch.device) -> torch.Tensor:
    with torch.device(dev):  # the script's torch.set_default_device(...)
        explain_here(model, src)
        return model(src)


# nn.Transformer.generate_square_subsequent_mask under a default device: since the report it lands there
@R.legal("pytorch/pytorch#137186")
def square_subsequent_mask_follows_default_device(dev: torch.device, other: torch.device) -> Program:
    model = CausalEncoder().to(dev)
    src = randn(2, 5, W, device=dev)
    return stepped(model, lambda: default_device_step(model, src, dev), (src,))
