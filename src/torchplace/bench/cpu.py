"""`torchplace bench cpu`: CPU inference throughput at torch's default threads vs configure_threads.

Four variants of the same real model in one run, each in fresh processes (torch's thread
settings are per process and the inter-op pool can be sized only once):

1. one process, torch's defaults (OMP_NUM_THREADS unset): the baseline;
2. one process after `torchplace.configure_threads()`;
3. P processes at once, each with torch's defaults: P x all-CPUs threads (what several
   workers, servers or ranks launched without torchrun's OMP_NUM_THREADS=1 do);
4. the same P processes with LOCAL_WORLD_SIZE=P and `configure_threads()`: a share each.

Every worker starts and warms up first; then the variants are measured in interleaved rounds
(each a synchronized start and the same wall-clock window), so a burst of load from elsewhere
hits every variant alike. A row is the median over rounds of the samples per second summed
over its processes. The model is torchvision's ResNet (50, or 18 with --quick)
where torchvision is installed, else a built-in transformer encoder (noted in the result).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

from ..progress import advance, begin
from .common import BenchResult, Row

_WORKER = "from torchplace.bench.cpu import _worker; _worker()"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true",
                        help="small model and short runs (a 2-core laptop or CI box)")
    parser.add_argument("--model", choices=("auto", "resnet18", "resnet50", "transformer"), default="auto",
                        help="auto: ResNet-50 (ResNet-18 with --quick) if torchvision is installed, else transformer")
    parser.add_argument("--batch", type=int, default=None, help="samples per inference call")
    parser.add_argument("--seconds", type=float, default=None, help="measured window per variant")
    parser.add_argument("--processes", type=int, default=None,
                        help="processes in the multi-process variants (default: 2 with --quick, else 4)")
    parser.add_argument("--rounds", type=int, default=None,
                        help="interleaved measuring rounds; each row is their median (default: 2 with --quick, else 3)")


def run(args: argparse.Namespace) -> BenchResult:
    from ..hardware.host import read_host

    host = read_host()
    quick = bool(getattr(args, "quick", False))
    procs = args.processes or (2 if quick else 4)
    rounds = args.rounds or (2 if quick else 3)
    spec = {"model": _pick_model(args.model, quick), "model_requested": args.model, "batch": args.batch,
            "quick": quick, "seconds": args.seconds or (1.0 if quick else 5.0)}
    variants = [("1 process, torch default threads", 1, False),
                ("1 process, configure_threads()", 1, True),
                (f"{procs} processes, torch default threads each", procs, False),
                (f"{procs} processes, configure_threads() each", procs, True)]
    groups = [_start_group(spec, count, configured) for _, count, configured in variants]
    try:
        begin("starting workers", len(groups))
        for group in groups:
            _wait_ready(group)
            advance()
        measured: list[list[list[dict[str, Any]]]] = [[] for _ in variants]
        begin("measuring", rounds * len(groups))
        for _ in range(rounds):  # interleaved, so a burst of load elsewhere hits every variant alike
            for i, group in enumerate(groups):
                measured[i].append(_measure(group, spec["seconds"]))
                advance()
    finally:
        for group in groups:
            _stop(group)
    rows = []
    for (name, count, _), results in zip(variants, measured):
        totals = [sum(r["samples"] / r["seconds"] for r in one_round) for one_round in results]
        threads = [r["threads"] for r in results[0]]
        rows.append(Row(f"{name} ({'+'.join(map(str, threads))} threads)", statistics.median(totals), "samples/s",
                        extra={"threads": threads, "interop": [r["interop"] for r in results[0]],
                               "processes": count, "rounds": totals}))
    used = measured[0][0][0]
    result = BenchResult(name="cpu", rows=rows, baseline=rows[0].variant, lower_is_better=False,
                         params={**spec, "model": used["model"], "batch": used["batch"], "processes": procs,
                                 "rounds": rounds, "usable_cpus": host.usable_cpus,
                                 "affinity": len(host.affinity or []), "cgroup_cpu_limit": host.cgroup_cpu_limit})
    if used.get("note"):
        result.notes.append(used["note"])
    over, fixed = rows[2].value, rows[3].value
    result.notes.append(f"with {procs} processes on {host.usable_cpus} usable CPU(s): configure_threads() gives "
                        f"{fixed / over:.2f}x the throughput of the oversubscribed default (median of {rounds} "
                        "interleaved rounds)" if over else "the oversubscribed run measured nothing")
    return result


def _pick_model(requested: str, quick: bool) -> str:
    if requested != "auto":
        return requested
    try:
        import torchvision  # noqa: F401
    except ImportError:
        return "transformer"
    return "resnet18" if quick else "resnet50"


def _start_group(spec: dict[str, Any], count: int, configured: bool) -> list[subprocess.Popen]:
    """COUNT worker processes for one variant, each in the environment that variant needs."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "LOCAL_WORLD_SIZE")}
    if configured and count > 1:
        env["LOCAL_WORLD_SIZE"] = str(count)
    payload = json.dumps({**spec, "configure": configured})
    return [subprocess.Popen([sys.executable, "-c", _WORKER, payload], env=env, text=True,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE) for _ in range(count)]


def _wait_ready(group: list[subprocess.Popen]) -> None:
    for w in group:
        line = w.stdout.readline() if w.stdout else ""
        if line.strip() != "ready":
            raise RuntimeError(f"a benchmark worker did not start (exit code {w.poll()}, said {line!r}); "
                               "run it by hand: python -c 'import torch' must work in this environment.")


def _measure(group: list[subprocess.Popen], seconds: float) -> list[dict[str, Any]]:
    """Release the group's workers together for one window; their results."""
    for w in group:
        assert w.stdin is not None and w.stdout is not None  # set by _start_group
        w.stdin.write("go\n")
        w.stdin.flush()
    return [json.loads(w.stdout.readline()) for w in group if w.stdout is not None]


def _stop(group: list[subprocess.Popen]) -> None:
    for w in group:
        try:
            if w.stdin is not None:
                w.stdin.close()  # end of input: the worker exits
            w.wait(timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            w.kill()
            w.wait()


# --------------------------------------------------------------------------- worker side


def _worker() -> None:
    """One benchmark process: configure (or not), build the model, warm up, wait, measure."""
    spec = json.loads(sys.argv[1])
    import torch

    if spec["configure"]:
        from ..policy.threads import configure_threads

        configure_threads()
    torch.manual_seed(0)
    model, batch, note = _build(spec)
    n = batch.shape[0]
    with torch.inference_mode():
        for _ in range(2):
            model(batch)
        print("ready", flush=True)
        while sys.stdin.readline().strip() == "go":  # one measured window per "go"; end of input ends
            done, start = 0, time.perf_counter()
            while time.perf_counter() - start < spec["seconds"] or done == 0:
                model(batch)
                done += 1
            elapsed = time.perf_counter() - start
            print(json.dumps({"samples": done * n, "seconds": elapsed, "threads": torch.get_num_threads(),
                              "interop": torch.get_num_interop_threads(), "model": spec["model"], "batch": n,
                              "note": note}), flush=True)


def _build(spec: dict[str, Any]) -> tuple[Any, Any, str | None]:
    import torch

    name, quick = spec["model"], spec["quick"]
    if name in ("resnet18", "resnet50"):
        import torchvision

        model = getattr(torchvision.models, name)(weights=None).eval()
        size = spec["batch"] or (4 if quick else 16)
        return model, torch.randn(size, 3, 224, 224), None
    d_model, layers, seq = (128, 2, 64) if quick else (512, 6, 256)
    layer = torch.nn.TransformerEncoderLayer(d_model, nhead=8, dim_feedforward=4 * d_model, batch_first=True)
    model = torch.nn.TransformerEncoder(layer, num_layers=layers, enable_nested_tensor=False).eval()
    size = spec["batch"] or (8 if quick else 16)
    note = (f"torchvision is not installed: a built-in transformer encoder ({layers} layers, d_model {d_model}, "
            f"{seq} tokens) stands in for ResNet") if spec.get("model_requested", "auto") == "auto" else None
    return model, torch.randn(size, seq, d_model), note
