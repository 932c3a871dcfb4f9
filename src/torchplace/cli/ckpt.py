"""`torchplace ckpt inspect FILE` and `torchplace ckpt convert IN OUT`.

Thin: parse, call torchplace.checkpoint, render with rich (or print JSON). torch is imported
inside the commands only, so building the parser stays fast.
"""

from __future__ import annotations

import argparse
from typing import Any

from ..units import format_bytes
from .options import add_json, print_json

_TENSORS_SHOWN = 40


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("ckpt", help="inspect and convert checkpoints (torchplace, torch.save, Lightning, ...)")
    cmds = parser.add_subparsers(dest="ckpt_command", metavar="COMMAND")

    p = cmds.add_parser("inspect", help="keys, shapes, dtypes, devices saved from, sizes, metadata, tool")
    p.add_argument("file", metavar="FILE", help="a checkpoint file or directory")
    add_json(p, "print everything as JSON")
    p.add_argument("--verify", action="store_true", help="also read the data and check every checksum")
    p.add_argument("--all", action="store_true", help=f"list every tensor (default: the first {_TENSORS_SHOWN})")
    p.add_argument("--trust-pickle", action="store_true",
                   help="open files that need pickle (runs code from the file: only for files you trust)")
    p.set_defaults(func=_inspect)

    p = cmds.add_parser("convert", help="rewrite a torch.save / Lightning / accelerate checkpoint as a torchplace one "
                                        "(on the CPU, torch.compile's _orig_mod. removed)")
    p.add_argument("src", metavar="IN", help="the checkpoint to read")
    p.add_argument("dst", metavar="OUT", help="the torchplace checkpoint to write")
    add_json(p, "print the result as JSON")
    p.add_argument("--trust-pickle", action="store_true",
                   help="open files that need pickle (runs code from the file: only for files you trust)")
    p.add_argument("--weights-only", action="store_true",
                   help="write only the model's state dict: a plain safetensors file that "
                        "model.load_state_dict(safetensors.torch.load_file(OUT)) accepts (HF, timm, vLLM); "
                        "under a .pt/.pth/.bin name, what model.load_state_dict(torch.load(OUT)) takes")
    p.add_argument("--force", action="store_true", help="replace OUT if it exists (default: refuse)")
    p.set_defaults(func=_convert)
    parser.set_defaults(func=lambda args: _no_command(parser))


def _no_command(parser: argparse.ArgumentParser) -> int:
    from .args import UsageError

    parser.print_help()
    raise UsageError("torchplace: error: name a command: inspect FILE, or convert IN OUT. "
                     "See `torchplace ckpt --help`.")


def _inspect(args: argparse.Namespace) -> int:
    from ..checkpoint import inspect
    from .progress import progress_bar

    with progress_bar() as bar:
        info = inspect(args.file, verify=args.verify, trust_pickle=args.trust_pickle, progress=bar)
    if args.json:
        print_json(info.to_dict(), default=str)
        return 0
    _render_info(info, show_all=args.all)
    return 0


def _render_info(info: Any, *, show_all: bool) -> None:
    from .render import console, line, show_table

    console.print(line((info.path, "bold"), "  made by ", (info.tool, "cyan"),
                       f"  {format_bytes(info.size_bytes)} on disk, {len(info.tensors)} tensors "
                       f"({format_bytes(info.tensor_bytes)})"))
    for key, value in info.metadata.items():
        console.print(f"  {key}: {value}")
    if info.contents:
        show_table("contents", ["entry", "summary"], [[str(k), str(v)] for k, v in info.contents.items()],
                   ids=["entry"])
    shown = info.tensors if show_all else info.tensors[:_TENSORS_SHOWN]
    if shown:
        rows = [[t.key, t.dtype, "x".join(map(str, t.shape)) or "scalar", format_bytes(t.nbytes), t.saved_on or "?"]
                for t in shown]
        show_table("tensors", ["key", "dtype", "shape", "size", "saved on"], rows, ids=["key"], right=["size"])
        if len(shown) < len(info.tensors):
            console.print(f"... {len(info.tensors) - len(shown)} more (--all lists them)", style="dim")
    if info.verified:
        console.print("every checksum matches", style="green")
    for note in info.notes:
        console.print(line(("note:", "yellow"), f" {note}"))


def _convert(args: argparse.Namespace) -> int:
    import os

    from ..checkpoint import convert
    from .args import UsageError

    if os.path.lexists(args.dst) and not args.force:
        raise UsageError(f"torchplace: error: {args.dst} exists, and convert would replace it. "
                         "Fix: pass --force to replace it, or name another OUT.")
    from .progress import progress_bar

    with progress_bar() as bar:
        result = convert(args.src, args.dst, trust_pickle=args.trust_pickle, weights_only=args.weights_only,
                         progress=bar)
    if args.json:
        print_json({"path": str(result.path), "source_tool": result.source_tool,
                    "stripped_prefix": result.stripped_prefix, "tensors": result.tensors,
                    "weights_only": result.weights_only, "notes": result.notes})
        return 0
    from ..checkpoint._torchfile import is_torch_name
    from .render import console, line

    stripped = f", stripped {result.stripped_prefix!r}" if result.stripped_prefix else ""
    plain = "a bare torch.save state dict" if is_torch_name(result.path) else "plain safetensors"
    what = f"model weights ({plain})" if result.weights_only else "tensors"
    console.print(f"wrote {result.path}: {result.tensors} {what} from a {result.source_tool} checkpoint, "
                  f"on the CPU{stripped}")
    for note in result.notes:
        console.print(line(("note:", "yellow"), f" {note}"))
    return 0
