"""`torchplace bench strict`: what strict mode and watch cost on real training steps.

The two steps docs/reference-measurements.md measured run-time checks on: torchvision ResNet-50 (batch 64,
bf16 autocast, SGD) and a GPT-2-sized transformers model built from its config, no download
(8x512 tokens, bf16 autocast, AdamW). Each step runs bare, under `watch(model)` entered every
step, under `strict()` around the loop and entered every step, under the environment switch
(TORCHPLACE_STRICT=1), and with the switch unset (the control: the same code as bare, so its
spread is the bench's noise). After a warm-up of WARMUP_S seconds of bare steps (clocks, allocator,
autotuning), single steps of each variant alternate with bare ones, B v1 B v2 ... B v5 B (the order
rotating from cycle to cycle), each step timed with device events; a variant step's ratio is its time
over the mean of the two bare steps beside it, so drift slower than a step cancels. Cycles go on for
SECONDS per model (or --steps per round) with the collector's generations frozen (its pauses are noise),
split into MIN_ROUNDS rounds (--rounds), each judged by the median of its ratios; rows show the
median and the quartiles, and each target is judged at its worse quartile (a cost within noise is not
a pass).
Before timing, each model trains a few steps from a DataLoader and runs inference under
`strict()` with every report turned into a count: the false alarms (target 0).

`--quick` uses tiny built-in models (so it runs on a laptop CPU in seconds); without torchvision
or transformers the full run falls back to the same built-in models and says so. torch,
torchvision and transformers are imported only inside run(): the CLI imports this module to
build its parser.
"""

from __future__ import annotations

import argparse
import contextlib
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from ..progress import advance, begin
from .common import BenchResult, Row, Target, judged, median, row

# issue 4: strict <= 3%, watch <= 1%; issue 34: off reads within 0.5% of bare
_TARGETS = {"strict() around the loop": 1.03, "strict() entered every step": 1.03,
            "TORCHPLACE_STRICT=1 (whole program)": 1.03, "watch(model) every step": 1.01,
            "strict off (env unset)": 1.005}
SECONDS = 25.0  # of timed steps per model: with imports, building and the false-alarm pass, about 90 s for both
MIN_ROUNDS = 8  # rounds the paired steps are split into (the spread targets are judged on)
WARMUP_S = 3.0  # of bare steps before timing: clocks and power settle, cudnn autotunes, the allocator fills


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default=None, help="where to train (default: cuda:0 if there is a GPU, else cpu)")
    parser.add_argument("--rounds", type=int, default=None,
                        help=f"rounds the paired steps are judged in (default {MIN_ROUNDS})")
    parser.add_argument("--steps", type=int, default=None,
                        help=f"paired steps per variant and round (default: as many as fit in {SECONDS:g} s per "
                             "model)")
    parser.add_argument("--models", default="resnet50,gpt2", help="which of resnet50,gpt2 to run (default both)")
    parser.add_argument("--quick", action="store_true", help="tiny built-in models, few steps (CPU, CI)")


@dataclass
class Case:
    """One model's training step, its fixed on-device batch, and CPU data for the DataLoader pass."""

    label: str
    model: Any
    step: Callable[[Any], None]
    infer: Callable[[Any], None]
    batch: Any
    dataset: Any
    note: str | None = None


def run(args: argparse.Namespace) -> BenchResult:
    import torch

    from ..policy.devices import device as resolve_device

    dev = resolve_device(args.device or "auto")
    quick = args.quick
    rounds, steps = args.rounds or (2 if quick else None), args.steps or (3 if quick else None)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)  # the process's device, chosen before strict mode looks
        torch.backends.cudnn.benchmark = True
    names = [n.strip() for n in args.models.split(",") if n.strip()]
    builders = {"resnet50": _resnet, "gpt2": _gpt2}
    unknown = [n for n in names if n not in builders]
    if unknown:
        from ..errors import TorchplaceError

        raise TorchplaceError(f"--models {args.models!r}: unknown {unknown}; choose from {sorted(builders)}.")
    rows: list[Row] = []
    targets: list[Target] = []
    notes = [f"ratio column: bare step time / variant step time (1.00 = no cost; 0.97 = 3% slower); each "
             "variant's step alternates with a bare step (B v1 B v2 ... B v5 B, order rotating; each step timed "
             "with device events) and is divided by the mean of the bare steps on either side; targets: per round "
             f"the median of those ratios, {rounds or MIN_ROUNDS} rounds of "
             f"{steps or f'as many steps as fit in {SECONDS:g} s'}; values: median [quartiles]; targets judged at "
             "the worse quartile; 'strict off' runs the same code as bare: its spread is the noise."]
    for name in names:
        begin(f"{name}: building the model")
        case = builders[name](torch, dev, quick)
        if case.note:
            notes.append(case.note)
        alarms = _false_alarms(torch, case, dev, quick)
        targets.append(Target(f"{case.label}: false alarms under strict() (DataLoader, autocast, optimizer, "
                              f"inference)", float(len(alarms)), 0.0))
        notes += [f"{case.label}: false alarm: {a}" for a in alarms[:3]]
        timed, paired, pairs = _time_variants(torch, case, dev, rounds, steps, quick)
        n_steps = len(pairs["strict off (env unset)"])
        notes.append(f"{case.label}: {len(paired['strict off (env unset)'])} rounds of "
                     f"{n_steps // max(1, len(paired['strict off (env unset)']))} paired steps per variant")
        for variant, ms in timed.items():
            per_round = paired.get(variant, [1.0] * len(ms))
            rows.append(row(f"{case.label}: {variant}", ms, "ms/step", 1 / median(per_round),
                            {"step_time_ratio": median(per_round), "round_ratios": per_round,
                             "step_ratios": pairs.get(variant, [])}))
            if variant in _TARGETS:
                targets.append(judged(f"{case.label}: {variant} step time / bare", per_round, _TARGETS[variant],
                                      not_here="--quick: tiny models, set for the real ones" if quick else None))
        targets.append(Target(f"{case.label}: strict off leaves torch's functions in place (1 = yes)",
                              1.0 if _untouched(torch) else 0.0, 1.0, ">="))
        del case
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    if quick:
        notes.append("quick: tiny built-in models; per-step Python costs weigh far more on them than on the real "
                     "models, so these ratios do not measure the targets (run without --quick on a GPU).")
    return BenchResult("strict", rows, baseline=None, targets=targets, notes=notes,
                       params={"device": str(dev), "rounds": rounds, "steps": steps, "quick": quick,
                               "models": names, **_versions()})


def _time_variants(torch: Any, case: Case, dev: Any, rounds: int | None, steps: int | None, quick: bool
                   ) -> tuple[dict[str, list[float]], dict[str, list[float]], dict[str, list[float]]]:
    """(each variant's ms per timed step, bare's every step; each variant's ratio per round: the median of
    its steps' ratios to the mean of the bare steps on either side; every step's ratio). Cycles of
    B v1 B v2 ... B v5 B (single steps, the order rotating) run STEPS per round for ROUNDS rounds, or as
    many as fit in SECONDS, split into ROUNDS rounds."""
    import gc
    import time

    from ..checks.strict import strict
    from ..checks.watch import watch
    from .common import time_device

    model, batch = case.model, case.batch

    def bare() -> None:
        case.step(batch)

    def watched() -> None:
        with watch(model):
            case.step(batch)

    def strict_each_step() -> None:
        with strict(model=model):
            case.step(batch)

    # (context entered untimed around the timed step, the timed step): "around the loop" and the environment
    # switch are on for the step as they are for every step of a loop; "entered every step" times its entry
    variants: dict[str, tuple[Callable[[], Any], Callable[[], None]]] = {
        "watch(model) every step": (contextlib.nullcontext, watched),
        "strict() around the loop": (lambda: strict(model=model), bare),
        "strict() entered every step": (contextlib.nullcontext, strict_each_step),
        "TORCHPLACE_STRICT=1 (whole program)": (lambda: _env_strict("1"), bare),
        "strict off (env unset)": (lambda: _env_strict(None), bare),
    }

    def timed(context: Callable[[], Any], fn: Callable[[], None]) -> float:
        with context():
            return time_device(fn, dev, warmup=0, iters=1)[0]

    warm_until = time.perf_counter() + (0.0 if quick else WARMUP_S)
    bare()
    bare()  # at least two: cudnn autotuning, allocator, lazy optimizer state
    while time.perf_counter() < warm_until:
        bare()
    rounds = rounds or MIN_ROUNDS
    times: dict[str, list[float]] = {"bare": [], **{name: [] for name in variants}}
    pairs: dict[str, list[float]] = {name: [] for name in variants}
    names = list(variants)
    gc.collect()
    gc.freeze()  # the models' and torch's objects out of the collector's way: its pauses are noise here
    start = time.perf_counter()
    begin(f"{case.label}: timing")
    cycle = 0
    try:
        while (cycle < rounds * steps) if steps else (cycle < rounds or time.perf_counter() - start < SECONDS):
            before = timed(contextlib.nullcontext, bare)
            times["bare"].append(before)
            for name in names[cycle % len(names):] + names[:cycle % len(names)]:  # rotated: none always first
                ms = timed(*variants[name])
                after = timed(contextlib.nullcontext, bare)
                times[name].append(ms)
                times["bare"].append(after)
                pairs[name].append(ms / ((before + after) / 2))
                before = after
            cycle += 1
            advance()
    finally:
        gc.unfreeze()
    per = max(1, cycle // rounds)
    paired = {name: [median(r[i * per:(i + 1) * per]) for i in range(min(rounds, cycle))] for name, r in pairs.items()}
    return times, paired, pairs


@contextlib.contextmanager
def _env_strict(value: str | None) -> Iterator[None]:
    """What `import torchplace` does with TORCHPLACE_STRICT=value, undone afterwards."""
    from ..checks.strict import disable, enable_from_env

    config = enable_from_env({"TORCHPLACE_STRICT": value} if value else {})
    try:
        yield
    finally:
        if config is not None:
            disable()


def _untouched(torch: Any) -> bool:
    """Strict mode off: torch's own Tensor.to/cuda, Module.__call__/to/cuda and autocast are in place."""
    from ..shared import strict_switch

    return (strict_switch.active() is None and "to" not in vars(torch.Tensor) and "cuda" not in vars(torch.Tensor)
            and torch.nn.Module.__call__ is torch.nn.Module._wrapped_call_impl
            and not torch.nn.modules.module._global_forward_pre_hooks)


def _false_alarms(torch: Any, case: Case, dev: Any, quick: bool) -> list[str]:
    """Train from a DataLoader and run inference under strict(); every report is a false alarm here."""
    from ..checks.strict import strict
    from ..errors import TorchplaceError

    loader = torch.utils.data.DataLoader(case.dataset, batch_size=_batch_size(case.batch), shuffle=True,
                                         num_workers=0 if quick else 2, pin_memory=dev.type == "cuda")
    alarms: list[str] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with strict(model=case.model):
                for batch in loader:
                    case.step([t.to(dev, non_blocking=True) for t in batch])
                case.model.eval()
                with torch.no_grad():
                    case.infer(case.batch)
        except TorchplaceError as exc:
            alarms.append(f"{type(exc).__name__}: {str(exc).splitlines()[0]}")
        finally:
            case.model.train()
    alarms += [f"{w.category.__name__}: {str(w.message).splitlines()[0]}" for w in caught
               if w.category.__module__.startswith("torchplace")]
    return alarms


def _batch_size(batch: list[Any]) -> int:
    return int(batch[0].shape[0])


def _autocast(torch: Any, dev: Any) -> Any:
    return torch.autocast(dev.type, dtype=torch.bfloat16)


def _resnet(torch: Any, dev: Any, quick: bool) -> Case:
    import torch.nn.functional as F

    note = None
    try:
        if quick:
            raise ImportError("quick")
        import torchvision

        model, size, classes, label = torchvision.models.resnet50(), (64, 3, 224, 224), 1000, "ResNet-50"
    except ImportError as exc:
        model, size, classes, label = _TinyCNN(torch), (4, 3, 16, 16) if quick else (64, 3, 64, 64), 10, "tiny CNN"
        if str(exc) != "quick":
            note = ("torchvision is not installed: measured a small built-in CNN instead of ResNet-50 "
                    "(pip install torchvision for the real model).")
    model = model.to(dev)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    def step(batch: list[Any]) -> None:
        x, y = batch
        optimizer.zero_grad(set_to_none=True)
        with _autocast(torch, dev):
            loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()

    def infer(batch: list[Any]) -> None:
        with _autocast(torch, dev):
            model(batch[0])

    n = size[0]
    data = torch.utils.data.TensorDataset(torch.randn(3 * n, *size[1:], device="cpu"),
                                          torch.randint(0, classes, (3 * n,), device="cpu"))
    batch = [torch.randn(*size, device=dev), torch.randint(0, classes, (n,), device=dev)]
    return Case(f"{label} (batch {n}, bf16 autocast, SGD)", model, step, infer, batch, data, note)


def _gpt2(torch: Any, dev: Any, quick: bool) -> Case:
    note = None
    batch_size, seq = (4, 32) if quick else (8, 512)
    try:
        if quick:
            raise ImportError("quick")
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(use_cache=False)
        model, vocab, label = GPT2LMHeadModel(config), config.vocab_size, "GPT-2 124M (transformers)"

        def loss_of(ids: Any) -> Any:
            return model(input_ids=ids, labels=ids).loss
    except ImportError as exc:
        vocab = 256 if quick else 1000
        model, label = _TinyLM(torch, vocab, quick), "tiny transformer LM"
        if str(exc) != "quick":
            note = ("transformers is not installed: measured a small built-in transformer LM instead of GPT-2 "
                    "(pip install transformers for the real model).")

        def loss_of(ids: Any) -> Any:
            logits = model(ids)
            return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), ids.flatten())
    model = model.to(dev)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step(batch: list[Any]) -> None:
        optimizer.zero_grad(set_to_none=True)
        with _autocast(torch, dev):
            loss = loss_of(batch[0])
        loss.backward()
        optimizer.step()

    def infer(batch: list[Any]) -> None:
        with _autocast(torch, dev):
            loss_of(batch[0])

    data = torch.utils.data.TensorDataset(torch.randint(0, vocab, (3 * batch_size, seq), device="cpu"))
    batch = [torch.randint(0, vocab, (batch_size, seq), device=dev)]
    return Case(f"{label} ({batch_size}x{seq} tokens, bf16 autocast, AdamW)", model, step, infer, batch, data, note)


def _TinyCNN(torch: Any) -> Any:
    nn = torch.nn
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                         nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10))


def _TinyLM(torch: Any, vocab: int, quick: bool) -> Any:
    nn = torch.nn
    width, layers = (32, 2) if quick else (256, 4)

    class TinyLM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(vocab, width)
            layer = nn.TransformerEncoderLayer(width, 4, 4 * width, batch_first=True, norm_first=True)
            self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
            self.head = nn.Linear(width, vocab)

        def forward(self, ids: Any) -> Any:
            return self.head(self.blocks(self.embed(ids), is_causal=False))

    return TinyLM()


def _versions() -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in ("torchvision", "transformers"):
        try:
            out[name] = __import__(name).__version__
        except ImportError:
            out[name] = None
    return out
