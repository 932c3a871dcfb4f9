"""A rank of the exact-resume tests: a small DDP model trained over 3 epochs, saved every 3 steps (mid-epoch).

argv[1] is the run's folder. Every trained batch is logged (rank{R}.jsonl: attempt, step, epoch, sample
ids), and so is how many samples the dataset loaded in this attempt. KILL_AT_STEP=N: rank 1 SIGKILLs itself
right after step N of the first attempt (kill -9 mid-epoch, after that step's checkpoint if it made one).
HOLD_WHEN_ALONE=1: a job that re-formed on one rank of two trains to its next checkpoint and then waits (at
most 240 s) for the node started again to join (torchrun's agent then restarts it as a membership change).
STEP_SLEEP=S: sleep S seconds after each step until a process resumes (a node can be killed mid-run from outside).
LOAD_ONLY=1: load the newest checkpoint on however many ranks this job has and print what setup() said.
"""

import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler

import torchplace as tp

EPOCHS, EVERY, BATCH = 3, 3, 4
out = Path(sys.argv[1])
kill_at = int(os.environ.get("KILL_AT_STEP", "-1"))
attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
load_only = bool(os.environ.get("LOAD_ONLY"))
rt = tp.setup("cpu", seed=0, threads=1, checkpoint_dir=out / "ck", resume=True if load_only else "auto")
loads = [0]


class Samples(Dataset):
    """48 fixed samples whose first field is their index, counting how many were loaded."""

    def __init__(self) -> None:
        gen = torch.Generator().manual_seed(1)
        self.x, self.y = torch.randn(48, 4, generator=gen), torch.randn(48, 1, generator=gen)

    def __len__(self) -> int:
        return 48

    def __getitem__(self, i: int):
        loads[0] += 1
        return i, self.x[i], self.y[i]


data = Samples()
sampler = DistributedSampler(data, num_replicas=rt.world_size, rank=rt.rank, shuffle=True, seed=0)
model = nn.Sequential(nn.Linear(4, 16), nn.Dropout(0.2), nn.Linear(16, 1))
if rt.world_size > 1:
    model = nn.parallel.DistributedDataParallel(model)
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
step, start = 0, 0
ck = rt.resume(model=model, optimizer=opt)
if ck is not None:
    step, start = ck["extra"]["step"], ck["extra"]["epoch"]
if load_only:
    weights = (model.module if rt.world_size > 1 else model).state_dict()
    print(json.dumps({"rank": rt.rank, "step": step, "weights": {k: v.sum().item() for k, v in weights.items()},
                      "decisions": rt.decisions}), flush=True)
    rt.close()
    sys.exit(0)
log = (out / f"rank{rt.rank}.jsonl").open("a")
for epoch in range(start, EPOCHS):
    sampler.set_epoch(epoch)
    for ids, x, y in rt.loader(DataLoader(data, batch_size=BATCH, sampler=sampler)):
        loss = ((model(x) - y) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        step += 1
        log.write(json.dumps({"attempt": attempt, "pid": os.getpid(), "world": rt.world_size, "step": step,
                              "epoch": epoch, "ids": ids.tolist()}) + "\n")
        log.flush()
        if step % EVERY == 0:
            rt.save(out / "ck" / f"step{step:04d}.tpck", model=model, optimizer=opt,
                    extra={"step": step, "epoch": epoch}, keep_last=2, all_ranks=True)
        if step == kill_at and attempt == 0 and rt.rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        if ck is None:
            time.sleep(float(os.environ.get("STEP_SLEEP", "0")))
        if os.environ.get("HOLD_WHEN_ALONE") and rt.world_size == 1 and step % EVERY == 0:
            time.sleep(240)
log.write(json.dumps({"attempt": attempt, "pid": os.getpid(), "loads": loads[0]}) + "\n")
log.close()
if rt.is_main:
    torch.save((model.module if rt.world_size > 1 else model).state_dict(), out / "final.pt")
rt.close()
