"""Fork server for the SIGKILL test: imports torch once, then forks one save loop per command.

Reads lines from stdin:
    fork PATH START MODE   fork a writer saving generations START+1, START+2, ... forever
                           (MODE "file": always PATH; "dir": PATH/step-N.safetensors with keep_last=2;
                           "async": always PATH, through save_async, the next call changing the
                           tensors while the previous save is written);
                           answers with the writer's pid
    reap PID               wait for the (killed) writer; answers "reaped"
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile

import torch

import torchplace

torch.set_num_threads(1)  # no OpenMP pool in the parent: a forked child's parallel kernels would deadlock

# 1 MB more to write in every save, so most of a writer's time is spent in the middle of one;
# made before forking, so writers start saving at once
PAD = torch.arange(250_000, dtype=torch.float32)


def _writer(path: str, start: int, mode: str) -> None:
    gen = start
    w, b = torch.empty(50_000), torch.empty(3)
    while True:
        gen += 1
        n = 20_000 + (gen % 5) * 7_000  # sizes vary, so a torn file would show
        state = {"w": w[:n].fill_(float(gen)), "b": b.fill_(float(gen)), "pad": PAD}
        if mode == "async":
            torchplace.save_async(path, model=state, extra={"gen": gen}, rng_state=False)
        elif mode == "file":
            torchplace.save(path, model=state, extra={"gen": gen}, rng_state=False)
        else:
            torchplace.save(os.path.join(path, f"step-{gen:09d}.safetensors"), model=state, extra={"gen": gen},
                            rng_state=False, keep_last=2)


def main() -> None:
    scratch = tempfile.mkdtemp()  # one warm-up save, so forked writers start with everything imported
    torchplace.save(os.path.join(scratch, "warm"), model={"w": torch.zeros(3)}, rng_state=False, keep_last=1)
    torchplace.save_async(os.path.join(scratch, "warm"), model={"w": PAD}, rng_state=False).result()
    shutil.rmtree(scratch)
    for line in sys.stdin:
        cmd, *args = line.split()
        if cmd == "fork":
            pid = os.fork()
            if pid == 0:
                try:
                    _writer(args[0], int(args[1]), args[2])
                finally:
                    os._exit(1)
            print(pid, flush=True)
        elif cmd == "reap":
            os.waitpid(int(args[0]), 0)
            print("reaped", flush=True)


if __name__ == "__main__":
    main()
