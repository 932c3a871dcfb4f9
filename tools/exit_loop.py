"""Run 2-process gloo jobs on the CPU N times and count how they exit (issue 28: an abort at exit,
"terminate called without an active exception", exit 134, about one run in ten).

    PYTHONPATH=src python tools/exit_loop.py [--runs 30] [--which both|checkpoint|setup]

checkpoint: the two ranks of tests/checkpoint/helpers/dist_worker.py (DDP, DCP, save_async).
setup: a small training program using `tp.setup()` with torchrun's environment (RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR/PORT, TORCHELASTIC_RUN_ID), DDP over gloo, a save_async, then a normal exit.
Prints one line per run and a summary; exits 1 if any rank of any run exited non-zero.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHECKPOINT_WORKER = ROOT / "tests" / "checkpoint" / "helpers" / "dist_worker.py"
SETUP_PROGRAM = """
import sys, torch, torchplace as tp
from torch import nn
info = tp.setup("cpu", seed=0)
model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2)))
opt = torch.optim.AdamW(model.parameters())
for _ in range(5):
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    opt.zero_grad()
tp.save_async(sys.argv[1] + "/last.safetensors", model=model, optimizer=opt).result()
print("ok", torch.distributed.get_rank(), flush=True)
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def one_run(which: str, folder: Path) -> list[tuple[int, str]]:
    """Start both ranks; (exit code, stderr tail) of each."""
    port = str(free_port())
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "OMP_NUM_THREADS": "1"}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    procs = []
    for rank in (0, 1):
        if which == "checkpoint":
            cmd = [sys.executable, str(CHECKPOINT_WORKER), str(rank), "2", str(folder)]
            rank_env = env
        else:
            cmd = [sys.executable, "-c", SETUP_PROGRAM, str(folder)]
            rank_env = {**env, "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank),
                        "LOCAL_WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "exit-loop", "CUDA_VISIBLE_DEVICES": ""}
        procs.append(subprocess.Popen(cmd, env=rank_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    out = []
    for rank, proc in enumerate(procs):
        try:
            stdout, stderr = proc.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            proc.kill()
            stdout, stderr = proc.communicate()
        ok = f"ok {rank}" in stdout
        out.append((proc.returncode if ok or proc.returncode else -1, stderr[-600:]))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--which", choices=("both", "checkpoint", "setup"), default="both")
    args = parser.parse_args()
    failed = False
    for which in ("checkpoint", "setup") if args.which == "both" else (args.which,):
        codes: Counter[str] = Counter()
        for k in range(args.runs):
            with tempfile.TemporaryDirectory() as tmp:
                results = one_run(which, Path(tmp))
            line = " ".join(f"rank{r}={code}" for r, (code, _) in enumerate(results))
            aborted = any("terminate called" in err for _, err in results)
            print(f"{which} run {k + 1}/{args.runs}: {line}{' ABORT' if aborted else ''}", flush=True)
            for r, (code, err) in enumerate(results):
                codes[str(code)] += 1
                if code != 0:
                    failed = True
                    print(f"  rank {r} stderr: {err.strip()[-400:]}", flush=True)
        print(f"{which}: {args.runs} runs, rank exit codes {dict(codes)}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
