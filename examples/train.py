"""Train a small classifier anywhere, checkpoint every epoch, resume on another device.

    python examples/train.py --quick                       # CPU, GPU or other accelerator: whatever is here
    python examples/train.py --resume --device cpu         # continue the latest checkpoint on the CPU
    torchplace run --gpus 2 --max-restarts 3 -- python examples/train.py   # a killed worker: the job continues
    torchplace run --gpus 2 -- python examples/train.py    # two GPUs, one process each (DDP)

The data set (3 interleaved spirals, 6000 points) ships with the repository. Every device
decision is made once by `torchplace.setup()`; batches arrive through `DeviceLoader`; the
precision policy picks bf16/fp16/fp32 from the hardware; checkpoints are atomic, portable and
rotated, written in the background while the next epoch trains (`save_async`), and a resumed
run continues the same loss curve (bit for bit on the same device). When
torchrun restarts the workers after a failure, setup() sees it and the run continues from the
newest checkpoint instead of starting over.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch
from rich.progress import Progress
from safetensors.torch import load_file
from torch import nn

import torchplace as tp

DATA = Path(__file__).parent / "data" / "spirals.safetensors"


def make_model() -> nn.Module:
    return nn.Sequential(nn.Linear(2, 128), nn.GELU(), nn.Dropout(0.05), nn.Linear(128, 128), nn.GELU(),
                         nn.Linear(128, 3))


def epoch_loader(data: torch.utils.data.Dataset, rt: tp.Runtime, epoch: int, seed: int, batch: int):
    """A DataLoader whose order depends only on (seed, epoch), so a resumed run sees the same batches."""
    if rt.world_size > 1:
        sampler = torch.utils.data.DistributedSampler(data, num_replicas=rt.world_size, rank=rt.rank, seed=seed)
        sampler.set_epoch(epoch)
        return torch.utils.data.DataLoader(data, batch_size=batch, sampler=sampler)
    order = torch.Generator().manual_seed(seed * 1000 + epoch)
    return torch.utils.data.DataLoader(data, batch_size=batch, shuffle=True, generator=order)


def main(argv: list[str] | None = None) -> list[float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="auto", help="any torchplace.device spec (default: auto)")
    parser.add_argument("--precision", default="auto", help="auto, bf16, fp16 or fp32")
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--quick", action="store_true", help="3 epochs: a smoke run well under a minute on a CPU")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ckpt-dir", default="runs/spirals", help="where checkpoints go (default: runs/spirals)")
    parser.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --ckpt-dir")
    parser.add_argument("--stop-after", type=int, default=None, help="stop after this epoch (to test resuming)")
    parser.add_argument("--log", help="write the per-epoch losses as JSON to this file")
    args = parser.parse_args(argv)
    epochs = 3 if args.quick else args.epochs

    # resume="auto": when torchrun restarts the workers (--max-restarts), continue from the newest checkpoint
    rt = tp.setup(args.device, args.precision, seed=args.seed, checkpoint_dir=args.ckpt_dir,
                  resume=True if args.resume else "auto")
    tensors = load_file(str(DATA))
    x, y = tensors["x"], tensors["y"]
    data = torch.utils.data.TensorDataset(x, y)
    model = make_model().to(rt.device)
    if rt.world_size > 1:
        ids = [rt.device.index] if rt.device.type == "cuda" else None
        model = nn.parallel.DistributedDataParallel(model, device_ids=ids)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=epochs)
    scaler = rt.grad_scaler()

    losses: list[float] = []
    start = 0
    ckpt_dir = Path(args.ckpt_dir)
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    ck = rt.resume(model=model, optimizer=opt, scheduler=sched, scaler=scaler)
    if ck is not None:
        start, losses = ck["extra"]["epoch"] + 1, list(ck["extra"]["losses"])
        if rt.is_main:
            saved_on = ck.metadata.get("primary_device", "?")
            print(f"resumed {ck.path.name} (saved on {saved_on}) at epoch {start} on {rt.device}")

    pending = None  # the checkpoint being written in the background
    last = min(epochs, args.stop_after + 1) if args.stop_after is not None else epochs
    with Progress(disable=not rt.is_main) as progress:
        task = progress.add_task("train", total=(last - start))
        for epoch in range(start, last):
            model.train()
            total = torch.zeros((), device=rt.device)
            count = 0
            for xb, yb in rt.loader(epoch_loader(data, rt, epoch, args.seed, args.batch_size)):
                with rt.autocast():
                    loss = nn.functional.cross_entropy(model(xb), yb)
                opt.zero_grad(set_to_none=True)
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
                total += loss.detach().float()
                count += 1
            sched.step()
            if rt.world_size > 1:
                torch.distributed.all_reduce(total)
                total /= rt.world_size
            losses.append(round(total.item() / count, 6))
            # returns once the state is copied; the file holds this moment's state while training goes on;
            # all_ranks: every rank calls it, so each rank's RNG is saved and a restart resumes bit for bit
            pending = rt.save_async(ckpt_dir / f"epoch{epoch:03d}.tpck", model=model, optimizer=opt,
                                    scheduler=sched, scaler=scaler, extra={"epoch": epoch, "losses": losses},
                                    keep_last=2, all_ranks=True)
            progress.advance(task)
            if rt.is_main:
                progress.console.print(f"epoch {epoch}: loss {losses[-1]:.4f}")

    if pending is not None:
        pending.result()  # the last checkpoint is on disk (or its CheckpointError is raised here)
    model.eval()
    with torch.no_grad(), rt.autocast(check=False):
        correct = (model(x.to(rt.device)).argmax(1).cpu() == y).float().mean().item()
    if rt.is_main:
        print(f"accuracy {correct:.3f}; losses {losses}")
        if args.log:
            Path(args.log).write_text(json.dumps({"losses": losses, "device": str(rt.device),
                                                  "accuracy": correct}))
    rt.close()
    assert all(math.isfinite(v) for v in losses)
    return losses


if __name__ == "__main__":
    try:
        main()
    except tp.TorchplaceError as exc:  # a wrong --device, --resume with nothing saved: one line, not a traceback
        raise SystemExit(f"train.py: error: {exc}") from None
