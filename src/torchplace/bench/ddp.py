"""`torchplace bench ddp`: one GPU vs DataParallel vs DDP launched by `torchplace run`, in one run.

Two models, one after the other in each launch:
- compute-bound: 4 x Linear(2048) with a batch of 32768 per GPU (3.3 TFLOP per step against
  34 MB of gradients), where DDP should scale almost linearly;
- communication-bound: 8 x Linear(4096) (134M parameters) with a batch of 256 per GPU, the
  model of docs/reference-measurements.md, where the gradient all-reduce dominates.
Each variant is a separate launch, as users run it: `torchplace run --gpus 1`, `torchplace run
--gpus 2 --once` (DataParallel in one process), `torchplace run --gpus 2` (DDP through
torchrun and torchplace.dist.init), and, on the communication-bound model, hand-written DDP
(mp.spawn, init_process_group("nccl"), set_device(rank)) on the same two GPUs. Throughput is
samples per second over all GPUs; ratios are against one GPU on the same model.

`--quick` runs the same launches on CPU with gloo and tiny models (2 processes), to check the
code path on a machine without GPUs; its numbers mean nothing.

Run as a module (`python -m torchplace.bench.ddp --worker VARIANT ...`) it is the worker that
the launches start. No torch import at module level.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

from ..progress import begin
from .common import BenchResult, Row, Target

MODELS = ("compute", "comm")
LABELS = {"compute": "compute-bound", "comm": "comm-bound"}
# model -> (layers, width, batch per process)
GPU_SHAPES = {"compute": (4, 2048, 32768), "comm": (8, 4096, 256)}
QUICK_SHAPES = {"compute": (2, 256, 512), "comm": (8, 512, 16)}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true",
                        help="CPU with gloo and tiny models, 2 processes: checks the code path only")
    parser.add_argument("--gpus", type=int, default=2, metavar="N", help="GPUs for DataParallel and DDP (default 2)")
    parser.add_argument("--steps", type=int, metavar="N", help="timed steps per repeat (default 30; quick 3)")
    parser.add_argument("--repeats", type=int, metavar="N", help="timed repeats, median taken (default 5; quick 2)")
    parser.add_argument("--wait", default="2m", metavar="DURATION", help="wait this long for free GPUs (default 2m)")


# --------------------------------------------------------------------------- parent


def run(args: argparse.Namespace) -> BenchResult:
    import subprocess
    import tempfile

    quick = bool(args.quick)
    steps = args.steps or (3 if quick else 30)
    repeats = args.repeats or (2 if quick else 5)
    nproc = 2 if quick else int(args.gpus)
    result = BenchResult(name="ddp", rows=[], baseline=None, lower_is_better=False,
                         params={"quick": quick, "processes": nproc, "steps": steps, "repeats": repeats,
                                 "shapes": QUICK_SHAPES if quick else GPU_SHAPES})
    common = ["--steps", str(steps), "--repeats", str(repeats)] + (["--quick"] if quick else [])
    if quick:
        one, several, once = ["--gpus", "none"], ["--gpus", "none", "--nproc", str(nproc)], ["--gpus", "none", "--once"]
        result.notes.append("--quick: CPU processes with gloo and tiny models; the numbers check the code "
                            "path, not the hardware. DataParallel needs GPUs and is skipped.")
    else:
        from ..distributed.pick import pick

        chosen = pick(nproc, wait=args.wait, lease=False)
        ids = chosen.uuids
        one = ["--gpus", ids[0] + ",", "--wait", str(args.wait)]  # seconds, as the CLI parsed it
        several = ["--gpus", ",".join(ids), "--wait", str(args.wait)]
        once = several + ["--once"]
        result.params["gpus"] = [f"physical {g.physical_index} ({g.uuid})" for g in chosen.gpus]
    with tempfile.TemporaryDirectory(prefix="torchplace-bench-ddp-") as tmp:
        measured: dict[tuple[str, str], dict[str, Any]] = {}

        def launch(variant: str, run_opts: list[str], models: tuple[str, ...]) -> None:
            out = os.path.join(tmp, f"{variant}.jsonl")
            cmd = [sys.executable, "-m", "torchplace", "run", *run_opts, "--",
                   sys.executable, "-m", "torchplace.bench.ddp", "--worker", variant,
                   "--models", ",".join(models), "--out", out, "--nproc", str(nproc), *common]
            begin(f"{variant}: {', '.join(models)}")
            started = time.perf_counter()
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
            wall = time.perf_counter() - started
            if proc.returncode != 0 or not os.path.exists(out):
                from ..errors import TorchplaceError

                tail = (proc.stdout + proc.stderr)[-3000:]
                raise TorchplaceError(f"bench ddp: the {variant} launch failed (exit {proc.returncode}): "
                                      f"{' '.join(cmd)}\n{tail}")
            with open(out) as fh:
                for line in fh:
                    rec = json.loads(line)
                    rec["launch_s"] = round(wall, 1)
                    measured[(variant, rec["model"])] = rec

        launch("single", one, MODELS)
        if nproc > 1:
            if not quick:
                launch("dp", once, MODELS)
            launch("ddp", several, MODELS)
            launch("hand", once, ("comm",))
        else:
            result.notes.append("--gpus 1: only the one-GPU rows are measured.")
    _fill(result, measured, quick, nproc)
    return result


def _fill(result: BenchResult, measured: dict[tuple[str, str], dict[str, Any]], quick: bool, nproc: int) -> None:
    unit_one = "1 CPU process" if quick else "1 GPU"
    names = {"single": unit_one, "dp": f"DataParallel x{nproc}",
             "ddp": f"DDP x{nproc} (torchplace run)", "hand": f"DDP x{nproc} (hand-written)"}
    for model in MODELS:
        base = measured.get(("single", model))
        for variant in ("single", "dp", "ddp", "hand"):
            rec = measured.get((variant, model))
            if rec is None:
                continue
            row = Row(variant=f"{LABELS[model]}: {names[variant]}", value=rec["samples_per_s"], unit="samples/s",
                      extra={k: rec[k] for k in ("step_ms", "batch_per_process", "processes", "params",
                                                  "launch_s", "device", "dtype") if k in rec})
            if base:
                row.ratio = rec["samples_per_s"] / base["samples_per_s"]
            result.rows.append(row)
    result.notes.append("ratio: samples/s against one GPU (or one process) on the same model.")
    if quick or nproc < 2:
        return
    ddp_c, one_c = measured.get(("ddp", "compute")), measured.get(("single", "compute"))
    if ddp_c and one_c:
        result.targets.append(Target(f"DDP x{nproc} via torchplace run / 1 GPU, compute-bound",
                                     ddp_c["samples_per_s"] / one_c["samples_per_s"], 1.9, ">="))
    ddp_m, hand_m = measured.get(("ddp", "comm")), measured.get(("hand", "comm"))
    if ddp_m and hand_m:
        result.targets.append(Target("DDP via torchplace run / hand-written DDP, comm-bound",
                                     ddp_m["samples_per_s"] / hand_m["samples_per_s"], 0.97, ">="))
        result.notes.append("'no slower than hand-written DDP' is checked as >= 0.97: both run the same "
                            "DDP settings, so the difference is launch and set-up, and 3% is run-to-run noise.")


# --------------------------------------------------------------------------- worker


def _build(model: str, quick: bool, device: Any) -> tuple[Any, Any, int]:
    """(module, input batch, batch size) for one model on `device`."""
    import torch

    if device.type == "cpu":
        torch.set_num_threads(1)  # as torchrun's OMP_NUM_THREADS=1, so CPU variants compare fairly
    layers, width, batch = (QUICK_SHAPES if quick else GPU_SHAPES)[model]
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    parts: list[Any] = []
    for _ in range(layers):
        parts += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    torch.manual_seed(0)
    module = torch.nn.Sequential(*parts[:-1]).to(device=device, dtype=dtype)
    data = torch.randn(batch, width, device=device, dtype=dtype)
    return module, data, batch


def _measure(module: Any, data: Any, samples_per_step: int, steps: int, repeats: int, device: Any,
             barrier: Any = None, devices: list[Any] | None = None) -> dict[str, Any]:
    """Median samples/s over `repeats` runs of `steps` training steps (SGD, squared loss).

    Synchronizes `devices` (default: `device` only; a DDP rank must not touch its neighbour's GPU)
    around each timed run.
    """
    import statistics

    import torch

    opt = torch.optim.SGD(module.parameters(), lr=1e-6)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        module(data).float().square().mean().backward()
        opt.step()

    def sync() -> None:
        if device.type == "cuda":
            for each in devices or [device]:
                torch.cuda.synchronize(each)

    for _ in range(max(3, steps // 5)):
        step()
    times = []
    for _ in range(repeats):
        sync()
        if barrier:
            barrier()
        start = time.perf_counter()
        for _ in range(steps):
            step()
        sync()
        times.append(time.perf_counter() - start)
    seconds = statistics.median(times) / steps
    return {"samples_per_s": samples_per_step / seconds, "step_ms": seconds * 1e3}


def _record(out: str, model: str, variant: str, stats: dict[str, Any], module: Any, batch: int,
            processes: int, device: Any) -> None:
    params = sum(p.numel() for p in module.parameters())
    dtype = str(next(module.parameters()).dtype).replace("torch.", "")
    with open(out, "a") as fh:
        fh.write(json.dumps({"model": model, "variant": variant, **stats, "batch_per_process": batch,
                             "processes": processes, "params": params, "device": str(device),
                             "dtype": dtype}) + "\n")


def _worker_single(args: argparse.Namespace) -> None:
    import torch

    device = torch.device("cuda:0") if torch.cuda.is_available() else torch.device("cpu")
    for model in args.models:
        module, data, batch = _build(model, args.quick, device)
        stats = _measure(module, data, batch, args.steps, args.repeats, device)
        _record(args.out, model, "single", stats, module, batch, 1, device)


def _worker_dp(args: argparse.Namespace) -> None:
    import torch

    count = torch.cuda.device_count()
    device = torch.device("cuda:0")
    for model in args.models:
        module, data, batch = _build(model, args.quick, device)
        data = torch.cat([data] * count)  # the same batch per GPU as the other variants
        parallel = torch.nn.DataParallel(module, device_ids=list(range(count)))
        stats = _measure(parallel, data, batch * count, args.steps, args.repeats, device,
                         devices=[torch.device("cuda", i) for i in range(count)])
        _record(args.out, model, "dp", stats, module, batch, count, device)


def _worker_ddp(args: argparse.Namespace) -> None:
    """DDP the torchplace way: launched by `torchplace run`, set up by torchplace.dist.init()."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from ..distributed import group

    with group.session() as me:
        for model in args.models:
            module, data, batch = _build(model, args.quick, me.device)
            wrapped = DDP(module, device_ids=[me.device] if me.device.type == "cuda" else None)
            stats = _measure(wrapped, data, batch * me.world_size, args.steps, args.repeats, me.device,
                             barrier=dist.barrier)
            if me.is_main:
                _record(args.out, model, "ddp", stats, module, batch, me.world_size, me.device)
            del wrapped
            if me.device.type == "cuda":
                torch.cuda.empty_cache()


def _hand_rank(rank: int, world: int, args: argparse.Namespace, port: int) -> None:
    """The boilerplate users write by hand (the articles' setup), for comparison."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    os.environ["MASTER_ADDR"] = "localhost"
    os.environ["MASTER_PORT"] = str(port)
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world)
    if cuda:
        torch.cuda.set_device(rank)
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    try:
        for model in args.models:
            module, data, batch = _build(model, args.quick, device)
            wrapped = DDP(module, device_ids=[rank] if cuda else None)
            stats = _measure(wrapped, data, batch * world, args.steps, args.repeats, device, barrier=dist.barrier)
            if rank == 0:
                _record(args.out, model, "hand", stats, module, batch, world, device)
    finally:
        dist.destroy_process_group()


def _worker_hand(args: argparse.Namespace) -> None:
    import socket

    import torch
    import torch.multiprocessing as mp

    world = torch.cuda.device_count() if torch.cuda.is_available() else args.nproc
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    mp.spawn(_hand_rank, args=(world, args, port), nprocs=world, join=True)


WORKERS = {"single": _worker_single, "dp": _worker_dp, "ddp": _worker_ddp, "hand": _worker_hand}


def worker_main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m torchplace.bench.ddp")
    parser.add_argument("--worker", choices=sorted(WORKERS), required=True)
    parser.add_argument("--models", default="compute,comm")
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    args.models = [m for m in args.models.split(",") if m]
    WORKERS[args.worker](args)
    return 0


if __name__ == "__main__":
    sys.exit(worker_main())
