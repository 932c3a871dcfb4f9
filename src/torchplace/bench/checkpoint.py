"""`torchplace bench checkpoint`: torchplace.save/load against torch, safetensors, fastsafetensors and
instanttensor, every figure repeated in interleaved rounds, reported as median and spread.

Cases (default: 1 GiB and 10 GiB of bf16 tensors of 64 MiB, and two model-shaped states built from
shapes, no download: a Llama-style 32-layer state of 291 tensors and GPT-2 124M's 148):

- every case: loads to the device from the page cache (ours, safetensors load_file, instanttensor
  buffered; each peer that is missing or fails here is left out with a note) and the save_async
  stall against a bare copy into pinned memory;
- states up to SLOW_PEERS_MAX_BYTES (1 GiB, GPT-2; every case with --full) also load with
  torch.load(mmap) + .to and fastsafetensors without GDS: peers of about 1-6 GB/s, whose standing
  a small state shows as well as a large one, at a fraction of the time;
- the first size (every size with --full) also: cold loads (pages dropped first) against a raw
  O_DIRECT read and instanttensor's direct reads; a plain write + fsync, torch.save + fsync and
  torchplace.save; torch.load and torchplace.load; the stalls of torch.save and dcp.async_save; a
  compute step while save_async writes. The default run, 10 GiB included, is meant to fit in 3
  minutes on an H200 host (disk about 2 GB/s): most of the time is the disk's, writing files.

Each figure runs interleaved rounds (variants take turns, the order rotating), so drift hits all
alike: --repeats, else as many as move about REPEAT_BYTES (3 for 1 GiB and more, 9 for GPT-2's
237 MiB, whose millisecond figures are the noisiest); a peer whose untimed first run takes over
SLOW_S is timed once. Rows show the median and the quartiles; a target is met only if its worse
quartile meets it. Files go to --dir (default:
a fresh temporary directory on local disk, not tmpfs) and are removed at the end; the largest case
needs about four times its size free there and twice in host memory.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..units import parse_size, size_label
from . import checkpoint_async as background
from .common import BenchResult, Row, Target, gbs, judged, plain, ratios, row, spread, timed_rounds

TENSOR_BYTES = 64 * 2**20
SLOW_S = 3.0  # a peer whose first load takes longer is timed once, not every round (it would eat the run's time)
SLOW_PEERS_MAX_BYTES = 2**30  # torch.save/torch.load and fastsafetensors (about 1 GB/s) only for states up to this
REPEAT_BYTES = 3 * 2**30  # default rounds: as many as move about this much (at least 3, at most 9)
DEFAULT_SIZES = "1GiB,10GiB"
DEFAULT_LAYOUTS = "llama,gpt2"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sizes", default=None,
                        help=f"comma-separated sizes of 64 MiB bf16 tensors (default {DEFAULT_SIZES}; a bare number "
                             "is GiB; 'none' for no such case)")
    parser.add_argument("--layouts", default=None,
                        help=f"model-shaped states: {', '.join(LAYOUTS)} (default {DEFAULT_LAYOUTS}; 'none' for none)")
    parser.add_argument("--dir", default=None, help="directory to write into (default: a temporary one on local disk)")
    parser.add_argument("--device", default=None, help="where the tensors live and load to (default: auto)")
    parser.add_argument("--repeats", type=int, default=None,
                        help="interleaved rounds per figure (default: 3 for states of 1 GiB and more, up to 9 "
                             "for smaller ones; --quick 2)")
    parser.add_argument("--full", action="store_true",
                        help="every figure for every case (default: saves, torch.load, dcp, steps and cold loads "
                             "for the first size only; the slow peers, torch.load(mmap) and fastsafetensors, for "
                             "states up to 1 GiB)")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="skip a case whose time, estimated from the largest case of its kind so far, would "
                             "end the run past this many seconds (default: no limit; says which were skipped)")
    parser.add_argument("--quick", action="store_true",
                        help="tiny sizes (8MiB,32MiB; layouts at tiny width): a smoke test")


def parse_sizes(text: str) -> list[int]:
    """Bytes for each comma-separated size ('1GiB,10GiB', '512MiB'); a bare number is GiB here ('2' = 2 GiB)."""
    if text.strip() == "none":
        return []
    return [parse_size(part, bare="GiB") for part in text.split(",")]


Shapes = dict[str, tuple[int, ...]]


def llama_shapes(layers: int = 32, hidden: int = 2048, inner: int = 5632, vocab: int = 32000) -> Shapes:
    """A Llama-style state dict's names and shapes (embedding, 9 a layer, final norm, head): 291 at 32 layers."""
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = (hidden,)
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            out[f"{p}self_attn.{name}.weight"] = (hidden, hidden)
        out[p + "post_attention_layernorm.weight"] = (hidden,)
        out[p + "mlp.gate_proj.weight"] = (inner, hidden)
        out[p + "mlp.up_proj.weight"] = (inner, hidden)
        out[p + "mlp.down_proj.weight"] = (hidden, inner)
    out["model.norm.weight"] = (hidden,)
    out["lm_head.weight"] = (vocab, hidden)
    return out


def gpt2_shapes(width: int = 768, layers: int = 12, vocab: int = 50257, positions: int = 1024) -> Shapes:
    """GPT-2's state dict names and shapes (124M at the defaults; the head is tied to wte): 148 tensors."""
    out: Shapes = {"transformer.wte.weight": (vocab, width), "transformer.wpe.weight": (positions, width)}
    for i in range(layers):
        p = f"transformer.h.{i}."
        for shape_of in (("ln_1.weight", (width,)), ("ln_1.bias", (width,)),
                         ("attn.c_attn.weight", (width, 3 * width)), ("attn.c_attn.bias", (3 * width,)),
                         ("attn.c_proj.weight", (width, width)), ("attn.c_proj.bias", (width,)),
                         ("ln_2.weight", (width,)), ("ln_2.bias", (width,)),
                         ("mlp.c_fc.weight", (width, 4 * width)), ("mlp.c_fc.bias", (4 * width,)),
                         ("mlp.c_proj.weight", (4 * width, width)), ("mlp.c_proj.bias", (width,))):
            out[p + shape_of[0]] = shape_of[1]
    out["transformer.ln_f.weight"] = (width,)
    out["transformer.ln_f.bias"] = (width,)
    return out


LAYOUTS: dict[str, tuple[str, Callable[[bool], dict[str, tuple[int, ...]]]]] = {
    "llama": ("Llama-style 32 layers, hidden 2048, MLP 5632 (291 tensors)",
              lambda quick: llama_shapes(hidden=128, inner=352, vocab=2000) if quick else llama_shapes()),
    "llama7b": ("Llama-2-7B shapes: 32 layers, hidden 4096, MLP 11008 (291 tensors)",
                lambda quick: llama_shapes(hidden=256, inner=688, vocab=2000) if quick
                else llama_shapes(hidden=4096, inner=11008)),
    "gpt2": ("GPT-2 124M (148 tensors)", lambda quick: gpt2_shapes(width=48, vocab=3200) if quick else gpt2_shapes()),
}


@dataclass
class Case:
    """One state the bench measures: its label, what it holds, and which figures it gets."""

    label: str
    shapes: dict[str, tuple[int, ...]]
    full: bool = False  # saves, torch.load, dcp and steps besides the loads and the save_async stall
    cold: bool = False  # cold loads against a raw O_DIRECT read
    what: str = ""
    slow_peers: bool = True  # loads with torch.load(mmap)+.to and fastsafetensors too (about 1 GB/s: time)

    @property
    def nbytes(self) -> int:
        n = 0
        for shape in self.shapes.values():
            k = 2
            for d in shape:
                k *= d
            n += k
        return n


def size_shapes(nbytes: int) -> dict[str, tuple[int, ...]]:
    """NBYTES of bf16 as tensors of TENSOR_BYTES (the last one smaller)."""
    out: Shapes = {}
    left, i = nbytes, 0
    while left > 0:
        n = min(TENSOR_BYTES, left) // 2
        out[f"layers.{i}.weight"] = (n,)
        left -= n * 2
        i += 1
    return out


def cases_for(args: argparse.Namespace) -> list[Case]:
    """The cases this run measures, from --sizes, --layouts, --full and --quick."""
    from ..errors import TorchplaceError

    sizes = parse_sizes(args.sizes) if args.sizes else ([8 * 2**20, 32 * 2**20] if args.quick
                                                        else parse_sizes(DEFAULT_SIZES))
    names = [n.strip() for n in (args.layouts or DEFAULT_LAYOUTS).split(",") if n.strip() and n.strip() != "none"]
    unknown = [n for n in names if n not in LAYOUTS]
    if unknown:
        raise TorchplaceError(f"--layouts {args.layouts!r}: unknown {unknown}; choose from {', '.join(LAYOUTS)} "
                              "or 'none'.")
    cases = [Case(size_label(n), size_shapes(n), full=args.full or i == 0, cold=args.full or i == 0,
                  what=f"bf16 tensors of up to {size_label(TENSOR_BYTES)}")
             for i, n in enumerate(sizes)]
    for name in names:
        what, shapes = LAYOUTS[name]
        cases.append(Case(name, shapes(args.quick), full=args.full, cold=args.full,
                          what=f"{what}{' at tiny width' if args.quick else ''}"))
    if not cases:
        raise TorchplaceError("--sizes none --layouts none: nothing to measure; name a size or a layout.")
    for case in cases:
        case.slow_peers = case.full or args.full or case.nbytes <= SLOW_PEERS_MAX_BYTES
    return sorted(cases, key=lambda c: (not c.full, c.nbytes))  # the full set first, then the rest by size


def repeats_for(nbytes: int, args: argparse.Namespace) -> int:
    """Rounds per figure for a state of NBYTES: --repeats, else as many as move about REPEAT_BYTES (3 to 9):
    small states are cheap to repeat, and their figures (milliseconds) are the noisiest."""
    if args.repeats:
        return int(args.repeats)
    if args.quick:
        return 2
    return max(3, min(9, REPEAT_BYTES // max(nbytes, 1)))


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


def _state(shapes: dict[str, tuple[int, ...]], device: Any) -> dict[str, Any]:
    import torch

    return {name: torch.randn(shape, device=device, dtype=torch.bfloat16) for name, shape in shapes.items()}


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


def _measure(size: int, dev: Any, root: str, repeats: int, state: dict[str, Any], label: str) -> dict[str, list[float]]:
    """Seconds of every save and load variant for STATE (SIZE bytes on DEV) per round, files under ROOT (removed)."""
    import torch

    from ..checkpoint import load, save

    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    sync()
    host = {"raw": _host_bytes(state, size)}  # a dict, so it can be freed before the loads
    paths = {k: os.path.join(root, f"{k}-{label}") for k in ("plain", "torch", "tp")}

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

    def nothing() -> None:
        pass

    try:
        plain_write(min(size, 2**30))  # untimed: the first big write of a process pays one-off kernel costs
        _remover(paths["plain"])()
        seconds = timed_rounds({"plain": (nothing, plain_write, _remover(paths["plain"])),  # one file at a time
                                "tsave": (_remover(paths["torch"]), torch_save, nothing),
                                "save": (_remover(paths["tp"]), tp_save, nothing)}, repeats, f"{label}: saves")
        host.clear()
        seconds.update(timed_rounds({"tload": plain(torch_load), "load": plain(tp_load)}, repeats,
                                    f"{label}: loads", slow_s=SLOW_S))
    finally:
        for path in paths.values():
            _remover(path)()
    return seconds


def _save_rows(label: str, size: int, dev: Any, t: dict[str, list[float]], extra: dict[str, Any]
               ) -> tuple[list[Row], list[Target]]:
    med = spread
    rows = [
        row(f"{label} plain write+fsync", gbs(size, t["plain"]), "GB/s", 1.0, extra),
        row(f"{label} torch.save+fsync", gbs(size, t["tsave"]), "GB/s", med(ratios(t["plain"], t["tsave"]))["median"],
            extra),
        row(f"{label} torchplace.save", gbs(size, t["save"]), "GB/s", med(ratios(t["plain"], t["save"]))["median"],
            extra),
        row(f"{label} torch.load -> {dev}", gbs(size, t["tload"]), "GB/s", 1.0, extra),
        row(f"{label} torchplace.load -> {dev}", gbs(size, t["load"]), "GB/s",
            med(ratios(t["tload"], t["load"]))["median"], extra),
    ]
    targets = [judged(f"{label} save vs plain write", ratios(t["plain"], t["save"]), 0.9, ">=")]
    if dev.type == "cuda":
        targets.append(judged(f"{label} load to {dev} vs torch.load", ratios(t["tload"], t["load"]), 4.0, ">="))
    return rows, targets


def run(args: argparse.Namespace) -> BenchResult:
    import torch

    from ..policy.devices import device as resolve_device

    dev = resolve_device(args.device or "auto")
    cases = cases_for(args)
    root = tempfile.mkdtemp(prefix="torchplace-bench-ckpt-", dir=args.dir or _local_dir())
    rows: list[Row] = []
    targets: list[Target] = []
    started = time.perf_counter()
    notes = [f"ran: {'; '.join(f'{c.label} = {c.what} ({size_label(c.nbytes)})' for c in cases)}; interleaved "
             f"rounds per figure: {', '.join(f'{c.label} {repeats_for(c.nbytes, args)}' for c in cases)}; the full "
             f"set of figures for {', '.join(c.label for c in cases if c.full) or 'no case'}; torch.load(mmap) and "
             f"fastsafetensors loads for {', '.join(c.label for c in cases if c.slow_peers) or 'no case'}",
             "values: median [quartiles] of the rounds; a target is judged at its worse quartile",
             f"files in {root} (removed after); warm loads read files just written, from the page cache, "
             "for every tool",
             "ratio: save rows against the plain write; torchplace.load against torch.load; stall rows: ms the "
             "caller waits, against the bare copy (lower is better); step rows against the step alone; the other "
             "load rows: how many times faster than safetensors load_file"]
    timings: list[str] = []
    left_out: dict[str, list[str]] = {}  # a note on a peer -> the cases it applies to
    try:
        # full or not -> (bytes moved: size x rounds, seconds) of the largest case so far; rounds count, since a
        # small state is repeated up to 9 times and a large one 3 (GPT-2's 9 rounds once skipped a 10 GiB case)
        done: dict[bool, tuple[int, float]] = {}
        for case in cases:
            case_start = time.perf_counter()
            label, size = case.label, case.nbytes
            moved = size * repeats_for(size, args)
            if args.budget_s is not None and case.full in done:
                seen_bytes, seen_s = done[case.full]
                estimate = seen_s * moved / seen_bytes
                if case_start - started + estimate > args.budget_s:
                    notes.append(f"{label}: skipped: about {estimate:.0f} s (scaled from {size_label(seen_bytes)} "
                                 f"moved) would end the run past --budget-s {args.budget_s:g}")
                    continue
            repeats = repeats_for(size, args)
            state = _state(case.shapes, dev)
            extra = {"bytes": size, "tensors": len(state), "repeats": repeats}
            saved = os.path.join(root, f"saved-{label}")  # save_async's last file: the loads read it
            stalls = background.measure_stalls(state, size, dev, root, repeats, full=case.full, label=label,
                                               keep=saved)
            more_rows, more_targets = background.stall_rows(label, dev, stalls, extra, full=case.full)
            notes.append(background.stall_note(label, stalls))
            if case.full:
                seconds = _measure(size, dev, root, repeats, state, label)
                save_rows, save_targets = _save_rows(label, size, dev, seconds, extra)
                rows += save_rows
                targets += save_targets
                steps = background.measure_steps(state, dev, root)
                step_rows, step_targets = background.step_rows(label, dev, steps, extra)
                more_rows += step_rows
                more_targets += step_targets
            loads, load_notes = background.measure_loads(state, dev, root, repeats, cold=case.cold, slow_s=SLOW_S,
                                                         label=label, slow_peers=case.slow_peers, saved=saved)
            del state
            for note in load_notes:
                left_out.setdefault(note, []).append(label)
            load_rows, load_targets = background.load_rows(label, size, dev, loads, extra,
                                                           layout=case.label in LAYOUTS)
            rows += more_rows + load_rows
            targets += more_targets + load_targets
            if dev.type == "cuda":
                torch.cuda.empty_cache()
            took = time.perf_counter() - case_start
            timings.append(f"{label} {took:.0f} s")
            if moved >= done.get(case.full, (0, 0.0))[0]:
                done[case.full] = (moved, took)
        notes += [f"{', '.join(labels)}: {note}" for note, labels in left_out.items()]
        notes.append(f"wall time: {time.perf_counter() - started:.0f} s ({', '.join(timings)})")
        if dev.type != "cuda":
            notes.append(f"no GPU: loads went to {dev}; the load targets are for loads to a GPU")
        targets = [_judged_here(t, args.quick) for t in targets]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return BenchResult("checkpoint", rows, baseline=None, lower_is_better=False, targets=targets, notes=notes,
                       params={"cases": {c.label: {"bytes": c.nbytes, "tensors": len(c.shapes), "full": c.full,
                                                   "cold": c.cold, "what": c.what, "slow_peers": c.slow_peers,
                                                   "repeats": repeats_for(c.nbytes, args)} for c in cases},
                               "device": str(dev), "dir": root, "tensor_bytes": TENSOR_BYTES,
                               "slow_s": SLOW_S})


def _judged_here(target: Target, quick: bool) -> Target:
    """TARGET as this run can judge it: the --quick sizes are a smoke test, not a measurement."""
    if quick:
        target.not_here = "--quick sizes are a smoke test; the targets are set for the default sizes"
    return target
