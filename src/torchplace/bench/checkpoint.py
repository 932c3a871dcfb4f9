"""`torchplace bench checkpoint`: torchplace.save/load against torch.save/torch.load and a raw write.

For each size (default 1 GiB and 10 GiB of fp32 tensors on the benchmark device), in one run:

- plain write: the same number of bytes, already in host memory, written sequentially + fsync
  (the most a save can hope for on this disk);
- torch.save + fsync, and torchplace.save (which fsyncs, renames and checksums itself);
- torch.load(map_location=device), and torchplace.load(device=device) (checksums verified),
  each synchronized.

Then, on the same state (`checkpoint_async`): the stall of torchplace.save_async against
torch.save, dcp.async_save and a bare copy into pinned host memory; a compute step's time while
a background save writes against without; loads to the device against safetensors and
torch.load(mmap=True) + .to. Loads read the files just written, so they come from the page
cache for every tool. Targets
(issue 5, on the H200 machine): save >= 90% of the plain write speed, load to the GPU >= 4x
torch.load. Files go to --dir (default: a fresh temporary directory on local disk, not tmpfs)
and are removed at the end; the largest size needs about twice its size free there.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from typing import Any

from ..progress import advance, begin, silenced
from ..units import parse_size, size_label
from . import checkpoint_async as background
from .common import BenchResult, Row, Target, median

TENSOR_BYTES = 64 * 2**20


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sizes", default=None,
                        help="comma-separated sizes, e.g. 1GiB,10GiB (the default; a bare number is GiB)")
    parser.add_argument("--dir", default=None, help="directory to write into (default: a temporary one on local disk)")
    parser.add_argument("--device", default=None, help="where the tensors live and load to (default: auto)")
    parser.add_argument("--repeats", type=int, default=None,
                        help="runs per variant, median reported (default: 3 up to 2 GiB, else 2)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes (8MiB,32MiB), one run: a smoke test")


def parse_sizes(text: str) -> list[int]:
    """Bytes for each comma-separated size ('1GiB,10GiB', '512MiB'); a bare number is GiB here ('2' = 2 GiB)."""
    return [parse_size(part, bare="GiB") for part in text.split(",")]


def _local_dir() -> str:
    """A temporary directory root on a real disk: /tmp unless it is a tmpfs (then /var/tmp)."""
    tmp = tempfile.gettempdir()
    try:
        with open("/proc/mounts") as fh:
            mounts = [line.split()[1:3] for line in fh]
        best = max((m for m in mounts if tmp == m[0] or tmp.startswith(m[0].rstrip("/") + "/")),
                   key=lambda m: len(m[0]), default=None)
        if best and best[1] in ("tmpfs", "ramfs") and os.path.isdir("/var/tmp"):
            return "/var/tmp"
    except OSError:
        pass
    return tmp


def _state(nbytes: int, device: Any) -> dict[str, Any]:
    import torch

    out, left, i = {}, nbytes, 0
    while left > 0:
        n = min(TENSOR_BYTES, left) // 4
        out[f"layers.{i}.weight"] = torch.randn(n, device=device)
        left -= n * 4
        i += 1
    return out


def _remover(path: str) -> Callable[[], None]:
    def remove() -> None:
        if os.path.exists(path):
            os.unlink(path)
    return remove


def _host_bytes(state: dict[str, Any], size: int) -> Any:
    """The same bytes as STATE, in one host buffer (what the plain write writes)."""
    import torch

    raw = torch.empty(size, dtype=torch.uint8)
    at = 0
    for t in state.values():
        n = t.numel() * t.element_size()
        raw[at:at + n].copy_(t.reshape(-1).view(torch.uint8))
        at += n
    return raw


Variant = tuple[Callable[[], None], Callable[[], Any], Callable[[], None]]


def _nothing() -> None:
    pass


def _timed(variants: dict[str, Variant], repeats: int, what: str = "timing") -> dict[str, float]:
    """Median seconds of each variant's run over REPEATS rounds; variants take turns within a round
    (so drift on a shared disk hits them all alike). Each is (set-up, timed run, clean-up)."""
    times: dict[str, list[float]] = {name: [] for name in variants}
    begin(what, repeats * len(variants))
    for _ in range(repeats):
        for name, (before, fn, after) in variants.items():
            before()
            with silenced():  # torchplace.save's own chunk reports are not this bench's steps
                start = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - start)
            after()
            advance()
    return {name: median(t) for name, t in times.items()}


def _measure(size: int, dev: Any, root: str, repeats: int, state: dict[str, Any]) -> dict[str, float]:
    """GB/s of every variant for STATE (SIZE bytes of fp32 tensors on DEV), files under ROOT (removed after)."""
    import torch

    from ..checkpoint import load, save

    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    sync()
    host = {"raw": _host_bytes(state, size)}  # a dict, so it can be freed before the loads
    paths = {k: os.path.join(root, f"{k}-{size_label(size)}") for k in ("plain", "torch", "tp")}

    def plain_write(nbytes: int = size) -> None:
        view = memoryview(host["raw"].numpy())
        fd = os.open(paths["plain"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            done = 0
            while done < nbytes:  # sequential writes of up to 256 MiB, as dd would
                done += os.write(fd, view[done:min(nbytes, done + 256 * 2**20)])
            os.fsync(fd)
        finally:
            os.close(fd)

    def torch_save() -> None:
        with open(paths["torch"], "wb") as fh:
            torch.save(state, fh)
            fh.flush()
            os.fsync(fh.fileno())

    def tp_save() -> None:
        save(paths["tp"], model=state, rng_state=False)

    def torch_load() -> None:
        torch.load(paths["torch"], map_location=dev, weights_only=True)
        sync()

    def tp_load() -> None:
        load(paths["tp"], device=dev, restore_rng=False)
        sync()

    try:
        plain_write(min(size, 2**30))  # untimed: the first big write of a process pays one-off kernel costs
        _remover(paths["plain"])()
        seconds = _timed({"plain": (_nothing, plain_write, _remover(paths["plain"])),  # disk space: one file at a time
                          "tsave": (_remover(paths["torch"]), torch_save, _nothing),
                          "save": (_remover(paths["tp"]), tp_save, _nothing)}, repeats,
                         f"{size_label(size)}: saves")
        host.clear()
        seconds.update(_timed({"tload": (sync, torch_load, _nothing), "load": (sync, tp_load, _nothing)}, repeats,
                              f"{size_label(size)}: loads"))
    finally:
        for path in paths.values():
            _remover(path)()
    return {k: size / t / 1e9 for k, t in seconds.items()}


def run(args: argparse.Namespace) -> BenchResult:
    import torch

    from ..policy.devices import device as resolve_device

    dev = resolve_device(args.device or "auto")
    sizes = parse_sizes(args.sizes) if args.sizes else ([8 * 2**20, 32 * 2**20] if args.quick else [2**30, 10 * 2**30])
    root = tempfile.mkdtemp(prefix="torchplace-bench-ckpt-", dir=args.dir or _local_dir())
    rows: list[Row] = []
    targets: list[Target] = []
    notes = [f"files in {root} (removed after); loads read files just written, from the page cache, for every tool",
             "ratio: save rows against the plain write of the same size, load rows against torch.load of the same size",
             "torchplace.save starts each chunk's write-out to disk as soon as it is written (sync_file_range); "
             "the plain write and torch.save leave it all to the final fsync",
             "stall rows: ms the caller waits, ratio against the bare copy (lower is better); step rows: ratio "
             "against the step alone; the load rows of safetensors, torch.load(mmap) and torchplace: ratio is "
             "how many times faster than safetensors load_file"]
    try:
        for size in sizes:
            repeats = args.repeats or (1 if args.quick else 2 if size > 2 * 2**30 else 3)
            label = size_label(size)
            state = _state(size, dev)
            gbs = _measure(size, dev, root, repeats, state)
            extra = {"bytes": size, "repeats": repeats}
            stalls = background.measure_stalls(state, size, dev, root, repeats)
            steps = background.measure_steps(state, dev, root)
            loads = background.measure_loads(state, dev, root, repeats)
            del state
            more_rows, more_targets = background.rows_for(label, size, dev, stalls, steps, loads, extra)
            rows += [
                Row(f"{label} plain write+fsync", gbs["plain"], "GB/s", 1.0, extra),
                Row(f"{label} torch.save+fsync", gbs["tsave"], "GB/s", gbs["tsave"] / gbs["plain"], extra),
                Row(f"{label} torchplace.save", gbs["save"], "GB/s", gbs["save"] / gbs["plain"], extra),
                Row(f"{label} torch.load -> {dev}", gbs["tload"], "GB/s", 1.0, extra),
                Row(f"{label} torchplace.load -> {dev}", gbs["load"], "GB/s", gbs["load"] / gbs["tload"], extra),
            ]
            rows += more_rows
            targets.append(Target(f"{label} save vs plain write", gbs["save"] / gbs["plain"], 0.9, ">="))
            targets += more_targets
            if dev.type == "cuda":
                targets.append(Target(f"{label} load to {dev} vs torch.load", gbs["load"] / gbs["tload"], 4.0, ">="))
                torch.cuda.empty_cache()
        if dev.type != "cuda":
            notes.append(f"no GPU: loads went to {dev}; the load target (>= 4x torch.load) is for loads to a GPU")
        targets = [_judged_here(t, args.quick) for t in targets]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return BenchResult("checkpoint", rows, baseline=None, lower_is_better=False, targets=targets, notes=notes,
                       params={"sizes": [size_label(s) for s in sizes], "device": str(dev), "dir": root,
                               "tensor_bytes": TENSOR_BYTES})



def _judged_here(target: Target, quick: bool) -> Target:
    """TARGET as this run can judge it: the --quick sizes are a smoke test, not a measurement."""
    if quick:
        target.not_here = "--quick sizes are a smoke test; the targets are set for the default sizes"
    return target
