"""pytorch/examples imagenet/main.py's --multiprocessing-distributed path (commit 77f55b9), restated small:
mp.spawn starts one worker per rank, each makes its own gloo group (tcp:// init, no torchrun environment),
trains with a DistributedSampler whose set_epoch it calls every epoch, and rank 0 alone saves
checkpoint.pth.tar and copies it to model_best.pth.tar when best; --resume loads it on every rank.
Ported to torchplace: setup() adopts the group, the loader and save/load are torchplace's.

usage: imagenet_spawn.py PORT EPOCHS [RESUME]"""

import shutil
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import torchplace as tp


def main_worker(rank, world, port, epochs, resume):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=world, rank=rank)
    rt = tp.setup(seed=0)
    net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                        nn.Linear(4, 5))
    model = nn.parallel.DistributedDataParallel(net.to(rt.device))
    opt = torch.optim.SGD(model.parameters(), 0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1)
    start, best = 0, 0.0
    if resume:
        ck = tp.load(resume, model=model, optimizer=opt, scheduler=sched)
        start, best = ck["epoch"], float(ck["best_acc1"])
        print(f"rank {rank} resumed at epoch {start}", flush=True)
    data = TensorDataset(torch.randn(32, 3, 8, 8), torch.randint(0, 5, (32,)))
    loader = rt.loader(DataLoader(data, batch_size=4, sampler=DistributedSampler(data)))
    for epoch in range(start, epochs):
        loader.sampler.set_epoch(epoch)
        for x, y in loader:
            loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
        sched.step()
        acc1 = 10.0 * (epoch + 1)
        is_best, best = acc1 > best, max(acc1, best)
        if rank == 0:
            tp.save("checkpoint.pth.tar", epoch=epoch + 1, arch="tiny", state_dict=model.state_dict(),
                    best_acc1=best, optimizer=opt, scheduler=sched)
            if is_best:
                shutil.copyfile("checkpoint.pth.tar", "model_best.pth.tar")
        dist.barrier()
        assert tp.load("checkpoint.pth.tar")["epoch"] == epoch + 1  # every rank reads what rank 0 wrote
    print(f"rank {rank} done at epoch {epochs}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    port, epochs = int(sys.argv[1]), int(sys.argv[2])
    mp.spawn(main_worker, nprocs=2, args=(2, port, epochs, sys.argv[3] if len(sys.argv) > 3 else None))
