"""Which allocation takes the one extra 256 MiB block in `bench loader`'s memory check, and when?
(#3: memory_reserved() grew by one batch, once, in some runs: at epoch 2, 12 or 19; never in
loader_mem.py's 720 epochs outside the bench.)

Runs the bench itself (one timed round, 100 epochs of the memory check) with the CUDA caching
allocator's history recorded during the memory check. At every epoch whose reserved memory grew,
prints each new segment: its stream (the loader's side stream or the default one), the Python
stack that asked for it, and the allocator events just before it.
"""

from __future__ import annotations

import argparse

import torch

from torchplace.bench import loader as bench_loader

_original = bench_loader._reserved_per_epoch_mib


def traced(loader, step, epochs, env):
    torch.cuda.memory._record_memory_history(max_entries=200_000, stacks="python")
    side = None
    reserved = []
    for epoch in range(epochs):
        for batch in loader:
            step(batch)
        env.sync()
        side = side or loader.stream.cuda_stream
        reserved.append(torch.cuda.memory_reserved(env.device) / 2**20)
        if epoch and reserved[-1] > reserved[-2]:
            report(epoch + 1, side, reserved)
        if epoch % 2:  # clear every second epoch: a report shows this epoch and, mostly, the one before
            torch.cuda.memory._record_memory_history(enabled=None)
            torch.cuda.memory._record_memory_history(max_entries=200_000, stacks="python")
    torch.cuda.memory._record_memory_history(enabled=None)
    print("reserved MiB per epoch:", reserved, flush=True)
    return reserved


def report(epoch, side, reserved):
    """Every 256 MiB allocator event of the epochs recorded, in order (the segment taken among them)."""
    snap = torch.cuda.memory._snapshot()
    trace = snap["device_traces"][0]
    print(f"== epoch {epoch}: reserved {reserved[-2]:g} -> {reserved[-1]:g} MiB; side stream {side:#x}", flush=True)
    names: dict[int, str] = {}
    t0 = trace[0].get("time_us", 0) if trace else 0
    for e in trace:
        if e["size"] < 2**28:
            continue
        name = names.setdefault(e["addr"], "block" + "ABCDEFGH"[len(names) % 8])
        where = "side" if e["stream"] == side else f"{e['stream']:#x}"
        frames = " < ".join(f"{f['filename'].split('/')[-1]}:{f['line']} {f['name']}" for f in e.get("frames", [])[:3])
        print(f"  {(e.get('time_us', 0) - t0) / 1e3:9.2f} ms  {e['action']:15s} {name} ({where})  {frames}")
    print(flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    bench_loader.add_arguments(parser)
    args = parser.parse_args(["--epochs", "100", "--rounds", "1"])
    bench_loader._reserved_per_epoch_mib = traced
    for run in range(2):
        result = bench_loader.run(args)
        print(f"run {run + 1}:", [f"{t.name}: {t.measured:.4g}" for t in result.targets], flush=True)


if __name__ == "__main__":
    main()
