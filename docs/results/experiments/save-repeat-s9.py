"""Repeated-path probe (issue 34, s9): does each save_async take the repeated path (SaveFuture.repeated)?

1. the bench's stall and step saves (measure_stalls / measure_steps, CPU, --quick layouts);
2. a training loop as users write it: transformers GPT-2 (head tied to wte), AdamW, default rng_state.
Run: PYTHONPATH=src python docs/results/experiments/save-repeat-s9.py (CPU; needs transformers for part 2)."""
import os
import tempfile

import torch

import torchplace as tp
import torchplace.checkpoint.background as bg
from torchplace.bench import checkpoint as ck
from torchplace.bench import checkpoint_async as ca

seen = []
orig = bg.save_async
bg.save_async = lambda *a, **k: seen.append(orig(*a, **k)) or seen[-1]
cpu = torch.device("cpu")
for name in ("gpt2", "llama"):
    state = ck._state(ck.LAYOUTS[name][1](True), cpu)
    size = sum(t.numel() * t.element_size() for t in state.values())
    for what in ("stalls", "steps"):
        seen.clear()
        with tempfile.TemporaryDirectory() as root:
            if what == "stalls":
                ca.measure_stalls(state, size, cpu, root, 3, full=False, label=name)
            else:
                ca.measure_steps(state, cpu, root)
        print(f"bench {name} {what}: repeated per save {[f.repeated for f in seen]}")
bg.save_async = orig

from transformers import GPT2Config, GPT2LMHeadModel  # noqa: E402

torch.manual_seed(0)
model = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=100, n_positions=64))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
flags = []
with tempfile.TemporaryDirectory() as d:
    for step in range(4):
        fut = tp.save_async(os.path.join(d, f"s{step}"), model=model, optimizer=opt, extra={"step": step})
        fut.result()
        flags.append(fut.repeated)
        x = torch.randint(0, 100, (2, 16))
        model(x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()
print(f"GPT-2 training loop (tied head, AdamW, default rng_state), save before each step: repeated {flags}")
