"""pytorch/examples dcgan/main.py (commit 77f55b912142e11fcfdf5b530231fb9c52f181e8), CPU-sized, as its author
wrote it (MODE original) and ported to torchplace the way the docs say (MODE ported).

Kept from the original: a generator and a discriminator, each with its own Adam; `weights_init`
applied to both; a `fixed_noise` tensor made once and fed to the generator in train mode at every
100th batch (its BatchNorm statistics move); `torch.full(..., device=device)` labels filled in
place; `fake.detach()` for D's step and `fake` again for G's; a DataLoader with 2 workers over a
FakeData-like set; `--netG`/`--netD` continuing from the per-epoch `netG_epoch_%d.pth` files, read
with `netG.load_state_dict(torch.load(path))`. The sample images become a printed sum (no torchvision).

The port: `tp.setup(seed=..., checkpoint_dir=..., resume="auto")` replaces the seeds and device choice;
`rt.loader` moves the batches; the per-epoch weights go through `tp.save` and `--netG`/`--netD` through
`tp.load` (which reads the pre-port files too); new, a `save_async` of the whole state at each epoch's
end (both models, both optimizers, the fixed noise) that `rt.resume` continues from after torchrun
restarts a killed run, and `tp.explain(netG, fixed_noise, optimizer=optimizerG)` printed once. With
KILL_AT=E:I the first attempt SIGKILLs itself before batch I of epoch E.

Each batch prints `step E I <errD> <errG> <D_x> <D_G_z1> <D_G_z2>` as float reprs.

Usage: dcgan.py original|ported OUTF [NITER] [KILL_AT|-] [--netG PATH] [--netD PATH]
"""

from __future__ import annotations

import argparse
import os
import random
import signal

import torch
from torch import nn, optim
from torch.utils.data import DataLoader, Dataset

parser = argparse.ArgumentParser()
parser.add_argument("mode", choices=["original", "ported"])
parser.add_argument("outf")
parser.add_argument("niter", type=int, nargs="?", default=3)
parser.add_argument("kill_at", nargs="?", default="-")
parser.add_argument("--netG", default="")
parser.add_argument("--netD", default="")
opt = parser.parse_args()
opt.manualSeed, opt.batchSize, opt.imageSize, opt.nz, opt.ngf, opt.ndf, opt.lr, opt.beta1 = \
    999, 8, 16, 8, 4, 4, 0.0002, 0.5
opt.workers, nc, sample_every = 2, 3, 3
kill_at = tuple(int(n) for n in opt.kill_at.split(":")) if opt.kill_at != "-" else None
ported = opt.mode == "ported"

if ported:
    import torchplace as tp

    rt = tp.setup(seed=opt.manualSeed, checkpoint_dir=os.path.join(opt.outf, "ckpt"), resume="auto")
    device = rt.device
else:
    random.seed(opt.manualSeed)
    torch.manual_seed(opt.manualSeed)
    device = torch.device("cpu")


class FakeData(Dataset):
    """torchvision's FakeData, in short: image i is drawn from a generator seeded with i."""

    def __len__(self) -> int:
        return 32

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        g = torch.Generator().manual_seed(index)
        return torch.rand(nc, opt.imageSize, opt.imageSize, generator=g), 0


dataloader = DataLoader(FakeData(), batch_size=opt.batchSize, shuffle=True, num_workers=opt.workers)
if ported:
    dataloader = rt.loader(dataloader)
nz, ngf, ndf = opt.nz, opt.ngf, opt.ndf


def weights_init(m: nn.Module) -> None:
    classname = m.__class__.__name__
    if classname.find("Conv") != -1:
        torch.nn.init.normal_(m.weight, 0.0, 0.02)
    elif classname.find("BatchNorm") != -1:
        torch.nn.init.normal_(m.weight, 1.0, 0.02)
        torch.nn.init.zeros_(m.bias)


class Generator(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.main = nn.Sequential(
            nn.ConvTranspose2d(nz, ngf * 2, 4, 1, 0, bias=False), nn.BatchNorm2d(ngf * 2), nn.ReLU(True),
            nn.ConvTranspose2d(ngf * 2, ngf, 4, 2, 1, bias=False), nn.BatchNorm2d(ngf), nn.ReLU(True),
            nn.ConvTranspose2d(ngf, nc, 4, 2, 1, bias=False), nn.Tanh())

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return self.main(input)


class Discriminator(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.main = nn.Sequential(
            nn.Conv2d(nc, ndf, 4, 2, 1, bias=False), nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(ndf, ndf * 2, 4, 2, 1, bias=False), nn.BatchNorm2d(ndf * 2), nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(ndf * 2, 1, 4, 1, 0, bias=False), nn.Sigmoid())

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return self.main(input).view(-1, 1).squeeze(1)


netG = Generator().to(device)
netG.apply(weights_init)
if opt.netG != "":
    if ported:
        tp.load(opt.netG, model=netG)
    else:
        netG.load_state_dict(torch.load(opt.netG))
netD = Discriminator().to(device)
netD.apply(weights_init)
if opt.netD != "":
    if ported:
        tp.load(opt.netD, model=netD)
    else:
        netD.load_state_dict(torch.load(opt.netD))

criterion = nn.BCELoss()
fixed_noise = torch.randn(opt.batchSize, nz, 1, 1, device=device)
real_label, fake_label = 1, 0
optimizerD = optim.Adam(netD.parameters(), lr=opt.lr, betas=(opt.beta1, 0.999))
optimizerG = optim.Adam(netG.parameters(), lr=opt.lr, betas=(opt.beta1, 0.999))

first_epoch, pending = 0, None
if ported:
    problems = tp.explain(netG, fixed_noise, optimizer=optimizerG).problems
    print("explain:", [p["kind"] for p in problems if p["severity"] != "note"], flush=True)
    ck = rt.resume(model=netG, optimizer=optimizerG, netD=netD, optimizerD=optimizerD)
    if ck is not None:
        fixed_noise = ck["fixed_noise"]
        first_epoch = ck.extra["epoch"] + 1
        print(f"resumed after epoch {ck.extra['epoch']}", flush=True)

for epoch in range(first_epoch, opt.niter):
    for i, data in enumerate(dataloader, 0):
        if kill_at == (epoch, i) and os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0":
            if pending is not None:  # the crash comes once the last checkpoint is durable: the test knows which
                pending.result()
            os.kill(os.getpid(), signal.SIGKILL)
        # (1) Update D: maximize log(D(x)) + log(1 - D(G(z)))
        netD.zero_grad()
        real_cpu = data[0].to(device)
        batch_size = real_cpu.size(0)
        label = torch.full((batch_size,), real_label, dtype=real_cpu.dtype, device=device)
        output = netD(real_cpu)
        errD_real = criterion(output, label)
        errD_real.backward()
        D_x = output.mean().item()
        noise = torch.randn(batch_size, nz, 1, 1, device=device)
        fake = netG(noise)
        label.fill_(fake_label)
        output = netD(fake.detach())
        errD_fake = criterion(output, label)
        errD_fake.backward()
        D_G_z1 = output.mean().item()
        errD = errD_real + errD_fake
        optimizerD.step()
        # (2) Update G: maximize log(D(G(z)))
        netG.zero_grad()
        label.fill_(real_label)
        output = netD(fake)
        errG = criterion(output, label)
        errG.backward()
        D_G_z2 = output.mean().item()
        optimizerG.step()
        print(f"step {epoch} {i} {errD.item()!r} {errG.item()!r} {D_x!r} {D_G_z1!r} {D_G_z2!r}", flush=True)
        if i % sample_every == 0:  # the original writes real_samples.png and fake_samples_epoch_%03d.png here
            fake = netG(fixed_noise)
            print(f"sample {epoch} {fake.detach().sum().item()!r}", flush=True)
    # do checkpointing
    if ported:
        tp.save(os.path.join(opt.outf, f"netG_epoch_{epoch}.pth"), model=netG)
        tp.save(os.path.join(opt.outf, f"netD_epoch_{epoch}.pth"), model=netD)
        pending = rt.save_async(os.path.join(opt.outf, "ckpt", f"epoch-{epoch:03d}.safetensors"), model=netG,
                                optimizer=optimizerG, netD=netD, optimizerD=optimizerD, fixed_noise=fixed_noise,
                                extra={"epoch": epoch}, keep_last=2)
    else:
        torch.save(netG.state_dict(), os.path.join(opt.outf, f"netG_epoch_{epoch}.pth"))
        torch.save(netD.state_dict(), os.path.join(opt.outf, f"netD_epoch_{epoch}.pth"))
if pending is not None:
    print(f"saved {pending.result().name}", flush=True)
if ported:
    rt.close()
