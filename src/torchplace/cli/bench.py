"""`torchplace bench NAME`: run one benchmark, print a ratio table, write JSON, draw a plot.

While it runs, a benchmark tells its progress to torchplace.progress; a bar shows it when stderr
is a terminal (cli/progress.py).
"""

from __future__ import annotations

import argparse
import importlib

from .options import add_json, print_json

BENCHES: dict[str, tuple[str, str]] = {
    "doctor": ("torchplace.bench.doctor", "doctor's wall time vs torch.utils.collect_env"),
    "transfer": ("torchplace.bench.transfer", "host->device copies: naive, pinned, accelerate, to_device"),
    "loader": ("torchplace.bench.loader", "training-like loop: naive, pinned, DeviceLoader vs ideal"),
    "strict": ("torchplace.bench.strict", "cost of strict mode and watch on real training steps"),
    "diagnose": ("torchplace.bench.diagnose", "how many corpus device mistakes strict, watch and explain name"),
    "checkpoint": ("torchplace.bench.checkpoint", "save/load vs torch.save/torch.load and a raw write"),
    "ddp": ("torchplace.bench.ddp", "one GPU vs DataParallel vs DDP through torchplace run"),
    "cpu": ("torchplace.bench.cpu", "CPU inference at default vs configured threads"),
}


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("bench", help="measure torchplace against the naive way and common tools")
    benches = parser.add_subparsers(dest="bench", metavar="NAME")
    for name, (module, help_) in BENCHES.items():
        p = benches.add_parser(name, help=help_)
        add_json(p, "print the result as JSON")
        p.add_argument("--out", metavar="DIR", help="also write the JSON result under DIR")
        p.set_defaults(func=_run, bench_module=module)
        importlib.import_module(module).add_arguments(p)  # bench modules import torch lazily
        if not any(action.dest == "plot" for action in p._actions):  # every bench draws its result the same way
            p.add_argument("--plot", metavar="FILE",
                           help="also draw the result into FILE (.png, .svg, .pdf; a log axis where values span "
                                "100x or more; needs matplotlib: pip install 'torchplace[bench]')")
    parser.set_defaults(func=lambda args: _no_name(parser))


def _no_name(parser: argparse.ArgumentParser) -> int:
    from .args import UsageError

    parser.print_help()
    raise UsageError(f"torchplace: error: name a benchmark: {', '.join(BENCHES)}. "
                     "See `torchplace bench --help`.")


def _run(args: argparse.Namespace) -> int:
    from ..bench import plot
    from ..bench.common import machine_info, write_result
    from ..progress import reporting
    from .progress import progress_bar

    if args.plot and not plot.available():  # said before the run, not after minutes of it
        from .args import UsageError

        raise UsageError(f"torchplace: error: {plot.MISSING}.")
    with progress_bar() as bar, reporting(bar):
        result = importlib.import_module(args.bench_module).run(args)
    result.machine = result.machine or machine_info()
    result.fill_ratios()
    path = write_result(result, args.out)
    if args.plot:
        result.notes.append(f"plot written to {plot.draw(result, args.plot)}")
    if args.json:
        print_json(result.to_dict())
    else:
        from .render import bench_table

        bench_table(result)
        if path:
            print(f"wrote {path}")
    return 0
