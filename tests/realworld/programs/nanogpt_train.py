"""A tiny nanoGPT train.py, ported to torchplace with its idioms kept.

The original: karpathy/nanoGPT, train.py. Kept: `ctx` built once and entered at every micro step and in
the evaluation loop; DDP under torchrun with `master_process` (rank 0) alone evaluating and saving
`ckpt.pt` when the validation loss is the best so far; `init_from='resume'` reading `ckpt.pt` back with
its own `torch.load`, stripping `_orig_mod.`. Synthetic tokens, a two-layer model, a few iterations.

Usage: nanogpt_train.py OUT_DIR MAX_ITERS [resume]
"""

from __future__ import annotations

import os
import sys

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import torchplace as tp

out_dir, max_iters = sys.argv[1], int(sys.argv[2])
init_from = sys.argv[3] if len(sys.argv) > 3 else "scratch"
eval_interval, eval_iters, block_size, batch_size, grad_accum = 2, 2, 8, 4, 2
vocab = 32

rt = tp.setup()  # the port's one line: device, process group under torchrun, threads, precision
ddp = rt.world_size > 1
master_process = rt.rank == 0
seed_offset = rt.rank
torch.manual_seed(1337 + seed_offset)
ctx = rt.autocast()  # nanoGPT: ctx = nullcontext() or torch.amp.autocast(...), made once
data = torch.randint(0, vocab, (2000,), generator=torch.Generator().manual_seed(0))


def get_batch(split: str) -> tuple[torch.Tensor, torch.Tensor]:
    part = data[:1600] if split == "train" else data[1600:]
    ix = torch.randint(len(part) - block_size, (batch_size,))
    x = torch.stack([part[i:i + block_size] for i in ix])
    y = torch.stack([part[i + 1:i + 1 + block_size] for i in ix])
    return rt.to(x), rt.to(y)


class TinyGPT(nn.Module):
    def __init__(self, n_embd: int, n_layer: int) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, n_embd)
        self.blocks = nn.Sequential(*[nn.Sequential(nn.LayerNorm(n_embd), nn.Linear(n_embd, n_embd), nn.GELU())
                                      for _ in range(n_layer)])
        self.lm_head = nn.Linear(n_embd, vocab)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(self.blocks(self.wte(idx)))
        return nn.functional.cross_entropy(logits.float().view(-1, vocab), targets.view(-1))


iter_num, best_val_loss = 0, 1e9
model_args = {"n_embd": 16, "n_layer": 2}
checkpoint = None
if init_from == "resume":  # nanoGPT's own resume code, unchanged: torch.load of the file tp.save wrote
    checkpoint = torch.load(os.path.join(out_dir, "ckpt.pt"), map_location=rt.device)
    model_args = checkpoint["model_args"]
    model = TinyGPT(**model_args)
    state_dict = checkpoint["model"]
    for k in list(state_dict):
        if k.startswith("_orig_mod."):
            state_dict[k[len("_orig_mod."):]] = state_dict.pop(k)
    model.load_state_dict(state_dict)
    iter_num, best_val_loss = checkpoint["iter_num"], checkpoint["best_val_loss"]
    print(f"resumed at iter {iter_num} (best val loss {best_val_loss:.4f})", flush=True)
else:
    model = TinyGPT(**model_args)
model.to(rt.device)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
if checkpoint is not None:
    optimizer.load_state_dict(checkpoint["optimizer"])
checkpoint = None
if ddp:
    model = DDP(model)
raw_model = model.module if ddp else model


@torch.no_grad()
def estimate_loss() -> dict[str, float]:
    out = {}
    model.eval()
    for split in ("train", "val"):
        losses = torch.zeros(eval_iters)
        for k in range(eval_iters):
            x, y = get_batch(split)
            with ctx:  # the same ctx, entered again
                losses[k] = raw_model(x, y).item()
        out[split] = losses.mean().item()
    model.train()
    return out


while True:
    if iter_num % eval_interval == 0 and master_process:
        losses = estimate_loss()
        print(f"step {iter_num}: val loss {losses['val']:.4f}", flush=True)
        if losses["val"] < best_val_loss:
            best_val_loss = losses["val"]
            if iter_num > 0:  # only rank 0 knows: tp.save must not wait for the other ranks
                tp.save(os.path.join(out_dir, "ckpt.pt"), model=raw_model, optimizer=optimizer,
                        model_args=model_args, iter_num=iter_num, best_val_loss=best_val_loss,
                        config={"block_size": block_size, "batch_size": batch_size})
                print(f"saving checkpoint to {out_dir}", flush=True)
    if iter_num >= max_iters:
        break
    for micro_step in range(grad_accum):
        if ddp:
            model.require_backward_grad_sync = micro_step == grad_accum - 1
        x, y = get_batch("train")
        with ctx:
            loss = model(x, y) / grad_accum
        loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    iter_num += 1

print(f"rank {rt.rank} done at iter {iter_num}", flush=True)
rt.close()
