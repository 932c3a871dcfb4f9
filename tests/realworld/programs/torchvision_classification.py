"""torchvision's references/classification/train.py (pytorch/vision, commit
017e9b99b5daddec3d82d5b05fe26f6834c48fa9, with its utils.py and transforms.py), CPU-sized, as its authors
wrote it (MODE original, under torchrun, gloo) and ported to torchplace the way the docs say (MODE ported,
under `torchplace run --gpus none`).

Kept from the original: `init_distributed_mode` from RANK/WORLD_SIZE/LOCAL_RANK and the `print` of
builtins replaced so only rank 0 prints (`force=True` passes); DistributedSampler for train and test and
`set_epoch`; mixup/cutmix as a `collate_fn` over `default_collate` (RandomChoice of RandomMixup and
RandomCutmix, soft targets); CrossEntropyLoss with label smoothing; SGD over two parameter groups
(normalization weights without weight decay); a linear warm-up epoch then cosine, as a SequentialLR;
an EMA model (`ExponentialMovingAverage`, an AveragedModel with buffers) updated every
`model_ema_steps` batches and reset during warm-up; DDP; evaluation under inference_mode with the
sample count and the meters all-reduced; every epoch `save_on_master` of {model, optimizer,
lr_scheduler, epoch, args, model_ema} to `model_{epoch}.pth` and `checkpoint.pth`; `--resume` reading
them back with torch.load. A dropout layer in the head (as in torchvision's efficientnet) makes each
rank draw from its generator. The original seeds nothing; both modes seed 0 so runs compare.

The port: `tp.setup(seed=0, checkpoint_dir=output_dir, resume="auto")` replaces init_distributed_mode,
the device and the seeds; `rt.loader` moves the batches; `rt.autocast`/`rt.grad_scaler` the amp
branches; the checkpoint goes through `tp.save(..., all_ranks=True)` (every rank calls save_on_master
anyway, and each rank's generators must come back for an exact resume) with `args=vars(args)` (a
Namespace is not plain data); `--resume`, or the newest checkpoint after torchrun restarts the job,
goes through `tp.load`. KILL_AT=E: rank 1 SIGKILLs itself at the start of epoch E of the first attempt.

Usage: torchvision_classification.py original|ported OUTPUT_DIR [--epochs N] [--resume PATH] [--kill-at E]
       [--trust-pickle]
"""

from __future__ import annotations

import argparse
import builtins
import math
import os
import random
import signal

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.dataloader import default_collate

parser = argparse.ArgumentParser()
parser.add_argument("mode", choices=["original", "ported"])
parser.add_argument("output_dir")
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--resume", default="")
parser.add_argument("--kill-at", type=int, default=-1)
parser.add_argument("--trust-pickle", action="store_true")
args = parser.parse_args()
args.batch_size, args.lr, args.momentum, args.weight_decay, args.norm_weight_decay = 4, 0.1, 0.9, 1e-4, 0.0
args.label_smoothing, args.mixup_alpha, args.cutmix_alpha, args.lr_warmup_epochs = 0.1, 0.2, 1.0, 1
args.lr_warmup_decay, args.model_ema_steps, args.model_ema_decay, args.start_epoch = 0.01, 2, 0.99, 0
args.workers, args.amp, args.clip_grad_norm, args.device = 0, False, None, "cpu"
num_classes = 5
ported = args.mode == "ported"


def setup_for_distributed(is_master: bool) -> None:
    builtin_print = builtins.print

    def print(*a, **kw):  # noqa: A001 - the reference's own override of print
        force = kw.pop("force", False)
        if is_master or force:
            builtin_print(*a, **kw, flush=True)

    builtins.print = print


def init_distributed_mode(args: argparse.Namespace) -> None:
    args.rank, args.world_size, args.gpu = (int(os.environ[k]) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
    args.distributed = True
    dist.init_process_group(backend="gloo", init_method="env://", world_size=args.world_size, rank=args.rank)
    setup_for_distributed(args.rank == 0)


if ported:
    import torchplace as tp

    rt = tp.setup(seed=0, checkpoint_dir=args.output_dir, resume="auto")
    args.rank, args.world_size, args.distributed = rt.rank, rt.world_size, rt.world_size > 1
    setup_for_distributed(rt.is_main)
    device = rt.device
else:
    init_distributed_mode(args)
    device = torch.device(args.device)
    random.seed(0)
    torch.manual_seed(0)


class RandomMixup(nn.Module):
    """references/classification/transforms.py's RandomMixup, in short: mix the batch with itself rolled by one."""

    def __init__(self, num_classes: int, p: float = 0.5, alpha: float = 1.0) -> None:
        super().__init__()
        self.num_classes, self.p, self.alpha = num_classes, p, alpha

    def forward(self, batch: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        batch, target = batch.clone(), nn.functional.one_hot(target, num_classes=self.num_classes).to(batch.dtype)
        if torch.rand(1).item() >= self.p:
            return batch, target
        batch_rolled, target_rolled = batch.roll(1, 0), target.roll(1, 0)
        lambda_param = float(torch._sample_dirichlet(torch.tensor([self.alpha, self.alpha]))[0])
        batch_rolled.mul_(1.0 - lambda_param)
        batch.mul_(lambda_param).add_(batch_rolled)
        target_rolled.mul_(1.0 - lambda_param)
        target.mul_(lambda_param).add_(target_rolled)
        return batch, target


class RandomCutmix(RandomMixup):
    """RandomCutmix, in short: paste a box of the rolled batch, mix the targets by its area."""

    def forward(self, batch: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        batch, target = batch.clone(), nn.functional.one_hot(target, num_classes=self.num_classes).to(batch.dtype)
        if torch.rand(1).item() >= self.p:
            return batch, target
        batch_rolled, target_rolled = batch.roll(1, 0), target.roll(1, 0)
        lambda_param = float(torch._sample_dirichlet(torch.tensor([self.alpha, self.alpha]))[0])
        H, W = batch.shape[-2:]
        r_x, r_y = torch.randint(W, (1,)), torch.randint(H, (1,))
        r = 0.5 * math.sqrt(1.0 - lambda_param)
        r_w_half, r_h_half = int(r * W), int(r * H)
        x1, y1 = int(torch.clamp(r_x - r_w_half, min=0)), int(torch.clamp(r_y - r_h_half, min=0))
        x2, y2 = int(torch.clamp(r_x + r_w_half, max=W)), int(torch.clamp(r_y + r_h_half, max=H))
        batch[:, :, y1:y2, x1:x2] = batch_rolled[:, :, y1:y2, x1:x2]
        lambda_param = float(1.0 - (x2 - x1) * (y2 - y1) / (W * H))
        target_rolled.mul_(1.0 - lambda_param)
        target.mul_(lambda_param).add_(target_rolled)
        return batch, target


class RandomChoice:
    """torchvision.transforms.RandomChoice: one of the transforms, picked with Python's random."""

    def __init__(self, transforms: list[nn.Module]) -> None:
        self.transforms = transforms

    def __call__(self, *a):
        return random.choice(self.transforms)(*a)


class FakeImages(Dataset):
    """An ImageFolder stand-in: image i drawn from a generator seeded with i, its class i % 5."""

    def __init__(self, n: int, offset: int) -> None:
        self.n, self.offset, self.classes = n, offset, [str(c) for c in range(num_classes)]

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        g = torch.Generator().manual_seed(self.offset + i)
        return torch.randn(3, 8, 8, generator=g), (self.offset + i) % num_classes


class ExponentialMovingAverage(torch.optim.swa_utils.AveragedModel):
    """utils.ExponentialMovingAverage: an AveragedModel with buffers, decay per update."""

    def __init__(self, model: nn.Module, decay: float, device: torch.device | str = "cpu") -> None:
        def ema_avg(avg_model_param, model_param, num_averaged):
            return decay * avg_model_param + (1 - decay) * model_param

        super().__init__(model, device, ema_avg, use_buffers=True)


def split_normalization_params(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    norm, other = [], []
    for module in model.modules():
        if next(module.children(), None) is None:
            (norm if isinstance(module, nn.BatchNorm2d) else other).extend(module.parameters(recurse=False))
    return norm, other


def accuracy(output: torch.Tensor, target: torch.Tensor) -> float:
    return float((output.argmax(1) == target).float().mean() * 100)


def train_one_epoch(model, criterion, optimizer, data_loader, epoch, model_ema=None, scaler=None) -> None:
    model.train()
    for i, (image, target) in enumerate(data_loader):
        image, target = image.to(device), target.to(device)
        if ported:
            with rt.autocast():
                output = model(image)
                loss = criterion(output, target)
            optimizer.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        else:
            output = model(image)
            loss = criterion(output, target)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        if model_ema and i % args.model_ema_steps == 0:
            model_ema.update_parameters(model)
            if epoch < args.lr_warmup_epochs:
                model_ema.n_averaged.fill_(0)  # reset ema buffer to keep copying weights during warm-up
        print(f"[rank {args.rank}] loss {epoch} {i} {loss.item()!r} lr {optimizer.param_groups[0]['lr']!r}",
              force=True)


def evaluate(model, criterion, data_loader, log_suffix: str = "") -> None:
    model.eval()
    total = torch.zeros(3, dtype=torch.float64)  # loss sum, correct-percent sum, samples
    with torch.inference_mode():
        for image, target in data_loader:
            image, target = image.to(device, non_blocking=True), target.to(device, non_blocking=True)
            output = model(image)
            n = image.shape[0]
            total += torch.tensor([criterion(output, target).item() * n, accuracy(output, target) * n, n],
                                  dtype=torch.float64)
    dist.all_reduce(total)  # reduce_across_processes and synchronize_between_processes
    print(f"Test: {log_suffix} samples {int(total[2])} loss {float(total[0] / total[2])!r} "
          f"acc1 {float(total[1] / total[2])!r}")


dataset, dataset_test = FakeImages(32, 0), FakeImages(16, 1000)
train_sampler = torch.utils.data.distributed.DistributedSampler(dataset)
test_sampler = torch.utils.data.distributed.DistributedSampler(dataset_test, shuffle=False)
mixupcutmix = RandomChoice([RandomMixup(num_classes, p=1.0, alpha=args.mixup_alpha),
                            RandomCutmix(num_classes, p=1.0, alpha=args.cutmix_alpha)])


def collate_fn(batch):
    return mixupcutmix(*default_collate(batch))


data_loader = DataLoader(dataset, batch_size=args.batch_size, sampler=train_sampler, num_workers=args.workers,
                         pin_memory=False, collate_fn=collate_fn)
data_loader_test = DataLoader(dataset_test, batch_size=args.batch_size, sampler=test_sampler,
                              num_workers=args.workers, pin_memory=False)
if ported:
    data_loader, data_loader_test = rt.loader(data_loader), rt.loader(data_loader_test)

model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                      nn.Flatten(), nn.Dropout(0.2), nn.Linear(8, num_classes))
model.to(device)
criterion = nn.CrossEntropyLoss(label_smoothing=args.label_smoothing)
param_groups = split_normalization_params(model)
parameters = [{"params": p, "weight_decay": w} for p, w in zip(param_groups, [args.norm_weight_decay,
                                                                              args.weight_decay]) if p]
optimizer = torch.optim.SGD(parameters, lr=args.lr, momentum=args.momentum, weight_decay=args.weight_decay)
scaler = rt.grad_scaler() if ported else (torch.amp.GradScaler("cuda") if args.amp else None)
main_lr_scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs - args.lr_warmup_epochs)
warmup_lr_scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=args.lr_warmup_decay,
                                                        total_iters=args.lr_warmup_epochs)
lr_scheduler = torch.optim.lr_scheduler.SequentialLR(optimizer, schedulers=[warmup_lr_scheduler, main_lr_scheduler],
                                                     milestones=[args.lr_warmup_epochs])
model_without_ddp = model
model = nn.parallel.DistributedDataParallel(model)
model_without_ddp = model.module
adjust = args.world_size * args.batch_size * args.model_ema_steps / args.epochs
alpha = min(1.0, (1.0 - args.model_ema_decay) * adjust)
model_ema = ExponentialMovingAverage(model_without_ddp, device=device, decay=1.0 - alpha)

resume = args.resume or (str(rt.resume_from) if ported and rt.resume_from else "")
if resume:
    if ported:
        ck = tp.load(resume, model=model_without_ddp, optimizer=optimizer, lr_scheduler=lr_scheduler,
                     model_ema=model_ema, trust_pickle=args.trust_pickle)
        args.start_epoch = ck["epoch"] + 1
    else:  # torch >= 2.6 reads the pickled Namespace under "args" only with weights_only=False
        checkpoint = torch.load(resume, map_location="cpu", weights_only=False)
        model_without_ddp.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        lr_scheduler.load_state_dict(checkpoint["lr_scheduler"])
        args.start_epoch = checkpoint["epoch"] + 1
        model_ema.load_state_dict(checkpoint["model_ema"])
    print(f"[rank {args.rank}] resumed from {os.path.basename(resume)} at epoch {args.start_epoch}", force=True)

for epoch in range(args.start_epoch, args.epochs):
    if epoch == args.kill_at and args.rank == 1 and os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0":
        os.kill(os.getpid(), signal.SIGKILL)
    train_sampler.set_epoch(epoch)
    train_one_epoch(model, criterion, optimizer, data_loader, epoch, model_ema, scaler)
    lr_scheduler.step()
    evaluate(model, criterion, data_loader_test)
    evaluate(model_ema, criterion, data_loader_test, log_suffix="EMA")
    running = model_ema.module[1].running_mean.sum().item()  # DDP syncs gradients, not BatchNorm's statistics
    print(f"[rank {args.rank}] ema running_mean {epoch} {running!r}", force=True)
    checkpoint = {"model": model_without_ddp.state_dict(), "optimizer": optimizer.state_dict(),
                  "lr_scheduler": lr_scheduler.state_dict(), "epoch": epoch, "args": args,
                  "model_ema": model_ema.state_dict()}
    for name in (f"model_{epoch}.pth", "checkpoint.pth"):
        path = os.path.join(args.output_dir, name)
        if ported:
            tp.save(path, model=model_without_ddp, optimizer=optimizer, lr_scheduler=lr_scheduler, epoch=epoch,
                    args=vars(args), model_ema=model_ema, scaler=scaler, all_ranks=True)
        elif args.rank == 0:  # utils.save_on_master
            torch.save(checkpoint, path)
print(f"[rank {args.rank}] done", force=True)
if ported:
    rt.close()
else:
    dist.destroy_process_group()
