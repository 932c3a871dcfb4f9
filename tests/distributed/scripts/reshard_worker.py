"""A rank of the N -> M tests: `save FOLDER` trains a DDP model and an FSDP (fully_shard) one for 2 steps on
however many ranks the job has and saves each (rt.save, all_ranks: an unsharded file and a DCP folder), with
the full weights beside them; `load FOLDER [ddp,fsdp]` resumes them on this job's ranks and writes, per rank,
KIND-on-M-rankR.json: whether the weights equal the saved ones, and what setup() and rt.resume() said."""

import json
import sys
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import torchplace as tp

mode, out = sys.argv[1], Path(sys.argv[2])
kinds = sys.argv[3].split(",") if len(sys.argv) > 3 else ["ddp", "fsdp"]


def model_of(kind: str, rt: tp.Runtime) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 2))
    if kind == "fsdp" and rt.world_size > 1:  # one process: the plain model, which DCP loads into whole
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (rt.world_size,))
        for layer in (model[0], model[2]):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif rt.world_size > 1:
        model = nn.parallel.DistributedDataParallel(model)
    return model


def full_weights(model: nn.Module) -> dict:
    if not any(type(p).__name__ == "DTensor" for p in model.parameters()):  # DDP or plain: each rank has it all
        return getattr(model, "module", model).state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))


for kind in kinds:
    (out / kind).mkdir(parents=True, exist_ok=True)
    rt = tp.setup("cpu", seed=0, threads=1, checkpoint_dir=out / kind, resume=mode == "load", verbose=False)
    model = model_of(kind, rt)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    if mode == "save":
        data = TensorDataset(torch.randn(48, 4, generator=torch.Generator().manual_seed(1)))
        sampler = DistributedSampler(data, num_replicas=rt.world_size, rank=rt.rank, seed=0)
        for step, (x,) in enumerate(rt.loader(DataLoader(data, batch_size=4, sampler=sampler)), 1):
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
            if step == 2:
                break
        rt.save(out / kind / "step0002.tpck", model=model, optimizer=opt, extra={"step": 2, "epoch": 0},
                keep_last=1, all_ranks=True)
        weights = full_weights(model)
        if rt.is_main:
            torch.save(weights, out / f"{kind}-weights.pt")
    else:
        ck = rt.resume(model=model, optimizer=opt)
        weights, saved = full_weights(model), torch.load(out / f"{kind}-weights.pt")
        said = {"kind": kind, "rank": rt.rank, "world_size": rt.world_size,
                "equal": all(torch.equal(weights[k], saved[k]) for k in saved),
                "optimizer_steps": [int(s["step"]) for s in opt.state_dict()["state"].values()],
                "decisions": rt.decisions}
        (out / f"{kind}-on-{rt.world_size}-rank{rt.rank}.json").write_text(json.dumps(said))
    if kind == kinds[-1] or rt.world_size == 1:
        rt.close()
