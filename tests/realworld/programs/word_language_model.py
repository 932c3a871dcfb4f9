"""pytorch/examples word_language_model/main.py (commit 77f55b912142e11fcfdf5b530231fb9c52f181e8), CPU-sized,
as its author wrote it (MODE original) and ported to torchplace the way the docs say (MODE ported).

Kept from the original: an LSTM language model with dropout and the encoder/decoder weights tied
(`--tied`); `batchify` into columns and `get_batch` slices of `bptt` rows; the hidden state carried
from batch to batch and cut from its history by `repackage_hidden` (a tuple for an LSTM); plain SGD by
hand (`p.data.add_(p.grad, alpha=-lr)`) after `clip_grad_norm_`; the learning rate divided by 4 when
the validation loss does not improve; the best model written to `--save` and read back for the test.
A synthetic corpus stands in for Wikitext-2.

The port: `tp.setup(seed=..., strict=True, checkpoint_dir=..., resume="auto")` replaces the seed and
the device choice, `rt.to` the `.to(device)`; `tp.save`/`tp.load` replace `torch.save(model)` and
`torch.load` of the pickled module (the best model, `model.pt`); `tp.watch(model)` wraps the
forward; and, new, a checkpoint every SAVE_EVERY batches (`rt.save`, with the carried hidden state, the
lr and the position) that `rt.resume()` continues from after torchrun restarts a killed run. With KILL_AT=E:B the first
attempt SIGKILLs itself before batch B of epoch E. With EXPLAIN=1 the step starts with the line a
user adds while debugging, `tp.explain(model, data, hidden)`.

Each batch prints `loss EPOCH BATCH <float repr>`; the test compares them bit for bit.

Usage: word_language_model.py original|ported OUT_DIR [EPOCHS] [KILL_AT] [EXPLAIN]
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

mode, out = sys.argv[1], Path(sys.argv[2])
epochs = int(sys.argv[3]) if len(sys.argv) > 3 else 3
kill_at = tuple(int(n) for n in sys.argv[4].split(":")) if len(sys.argv) > 4 and sys.argv[4] != "-" else None
explain_step = len(sys.argv) > 5 and sys.argv[5] == "1"
seed, bsz, eval_bsz, bptt, clip, lr0, save_every = 1111, 4, 2, 5, 0.25, 20.0, 3
emsize = nhid = 16
nlayers, dropout, ntokens = 2, 0.2, 40
save = out / "model.pt"


class RNNModel(nn.Module):
    """Encoder, recurrent module, decoder, as the example's model.py (LSTM, tied weights)."""

    def __init__(self, ntoken: int, ninp: int, nhid: int, nlayers: int, dropout: float, tie_weights: bool) -> None:
        super().__init__()
        self.ntoken = ntoken
        self.drop = nn.Dropout(dropout)
        self.encoder = nn.Embedding(ntoken, ninp)
        self.rnn = nn.LSTM(ninp, nhid, nlayers, dropout=dropout)
        self.decoder = nn.Linear(nhid, ntoken)
        if tie_weights:
            self.decoder.weight = self.encoder.weight
        nn.init.uniform_(self.encoder.weight, -0.1, 0.1)
        nn.init.zeros_(self.decoder.bias)
        nn.init.uniform_(self.decoder.weight, -0.1, 0.1)
        self.nhid, self.nlayers = nhid, nlayers

    def forward(self, input: torch.Tensor, hidden: tuple[torch.Tensor, torch.Tensor]):
        emb = self.drop(self.encoder(input))
        output, hidden = self.rnn(emb, hidden)
        decoded = self.decoder(self.drop(output)).view(-1, self.ntoken)
        return F.log_softmax(decoded, dim=1), hidden

    def init_hidden(self, bsz: int) -> tuple[torch.Tensor, torch.Tensor]:
        weight = next(self.parameters())
        return (weight.new_zeros(self.nlayers, bsz, self.nhid), weight.new_zeros(self.nlayers, bsz, self.nhid))


ported = mode == "ported"
if ported:
    import torchplace as tp

    rt = tp.setup(seed=seed, strict=True, checkpoint_dir=out / "ckpt", resume="auto")
    device = rt.device
else:
    torch.manual_seed(seed)
    device = torch.device("cpu")

words = torch.randint(0, ntokens, (460,), generator=torch.Generator().manual_seed(7))  # the corpus
corpus = {"train": words[:300], "valid": words[300:380], "test": words[380:]}


def batchify(data: torch.Tensor, bsz: int) -> torch.Tensor:
    nbatch = data.size(0) // bsz
    data = data.narrow(0, 0, nbatch * bsz).view(bsz, -1).t().contiguous()
    return rt.to(data) if ported else data.to(device)


train_data = batchify(corpus["train"], bsz)
val_data = batchify(corpus["valid"], eval_bsz)
test_data = batchify(corpus["test"], eval_bsz)
model = RNNModel(ntokens, emsize, nhid, nlayers, dropout, tie_weights=True).to(device)
criterion = nn.NLLLoss()


def repackage_hidden(h):
    return h.detach() if isinstance(h, torch.Tensor) else tuple(repackage_hidden(v) for v in h)


def get_batch(source: torch.Tensor, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    seq_len = min(bptt, len(source) - 1 - i)
    return source[i:i + seq_len], source[i + 1:i + 1 + seq_len].view(-1)


def evaluate(data_source: torch.Tensor) -> float:
    model.eval()
    total_loss = 0.0
    hidden = model.init_hidden(eval_bsz)
    with torch.no_grad():
        for i in range(0, data_source.size(0) - 1, bptt):
            data, targets = get_batch(data_source, i)
            output, hidden = model(data, hidden)
            hidden = repackage_hidden(hidden)
            total_loss += len(data) * criterion(output, targets).item()
    return total_loss / (len(data_source) - 1)


def checkpoint(step: int, epoch: int, batch: int, hidden) -> None:
    """The port's addition: where the epoch stands, every SAVE_EVERY batches (the newest 2 kept)."""
    rt.save(out / "ckpt" / f"step-{step:05d}.safetensors", model=model, hidden=hidden, keep_last=2,
            extra={"epoch": epoch, "batch": batch, "lr": lr, "best_val_loss": best_val_loss})


def train(epoch: int, start: int = 0, hidden=None) -> None:
    global step
    model.train()
    if hidden is None:
        hidden = model.init_hidden(bsz)
    for batch, i in enumerate(range(0, train_data.size(0) - 1, bptt)):
        if batch < start:
            continue
        if kill_at == (epoch, batch) and os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0":
            os.kill(os.getpid(), signal.SIGKILL)
        data, targets = get_batch(train_data, i)
        if explain_step:
            tp.explain(model, data, hidden)
        model.zero_grad()
        hidden = repackage_hidden(hidden)
        with tp.watch(model) if ported else contextlib.nullcontext():  # the port names a mismatch's culprit
            output, hidden = model(data, hidden)
        loss = criterion(output, targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        for p in model.parameters():
            p.data.add_(p.grad, alpha=-lr)
        print(f"loss {epoch} {batch} {loss.item()!r}", flush=True)
        step += 1
        if ported and step % save_every == 0:
            checkpoint(step, epoch, batch + 1, hidden)


lr, best_val_loss, step, first_epoch, resumed = lr0, None, 0, 1, None
if ported:
    ck = rt.resume(model=model)
    if ck is not None:
        lr, best_val_loss = ck.extra["lr"], ck.extra["best_val_loss"]
        first_epoch, step = ck.extra["epoch"], int(ck.path.stem.split("-")[1])
        resumed = (ck.extra["batch"], ck["hidden"])
        print(f"resumed at epoch {first_epoch} batch {ck.extra['batch']} (step {step})", flush=True)
for epoch in range(first_epoch, epochs + 1):
    if resumed is not None:
        train(epoch, *resumed)
        resumed = None
    else:
        train(epoch)
    val_loss = evaluate(val_data)
    print(f"valid {epoch} {val_loss!r}", flush=True)
    if not best_val_loss or val_loss < best_val_loss:
        if ported:
            tp.save(save, model=model)
        else:
            with open(save, "wb") as f:
                torch.save(model, f)
        best_val_loss = val_loss
    else:
        lr /= 4.0

if ported:
    tp.load(save, model=model)
else:
    with open(save, "rb") as f, torch.serialization.safe_globals(
            [RNNModel, nn.Dropout, nn.Linear, nn.LSTM, nn.Embedding]):
        model = torch.load(f)
model.rnn.flatten_parameters()
print(f"test {evaluate(test_data)!r}", flush=True)
if ported:
    rt.close()
