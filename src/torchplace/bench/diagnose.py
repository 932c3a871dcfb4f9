"""`torchplace bench diagnose`: how many device mistakes strict(), watch() and explain() name.

Runs the corpus of torchplace/bench/_corpus (device mistakes from public issues, and legal
patterns) on one device pair and scores each tool per case:

- named: the report names the culprit (every culprit string of the case appears in it);
- full: it also shows the module path and the user's line (`corpus.py:LINE`);
- false alarm (legal cases): strict()/watch() raised or warned, or explain() listed an error or
  a warning.

Pairs: cpu-meta (CI), cuda-cpu (one GPU), cuda1-cuda0 (two GPUs); by default every pair this
machine has. torch is imported only inside run(): the CLI imports this module for its parser.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..progress import advance, begin
from .common import BenchResult, Row, Target

TOOLS = ("strict", "watch", "explain")
# issue 16: on the GPU machine, strict names >= 95% with path, tensor and line, explain >= 90%, watch >= 80%
_TARGETS = {"strict": 0.95, "explain": 0.90, "watch": 0.80}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--pairs", default=None,
                        help="device pairs, comma-separated: cpu-meta,cuda-cpu,cuda1-cuda0 (default: all this "
                             "machine has)")
    parser.add_argument("--corpus", default=None,
                        help="a corpus module file of your own (default: the one shipped with torchplace)")
    parser.add_argument("--cases", default=None, help="only these case names, comma-separated")
    parser.add_argument("--quick", action="store_true",
                        help="the cpu-meta pair only, on any machine: a smoke test of the corpus (seconds)")
    parser.add_argument("--fake-gpu", action="store_true",
                        help="also score the cuda-cpu pair where this machine has no GPU: the cases are built and "
                             "judged on a fake cuda:0 (torch's fake tensors)")


@dataclass
class Outcome:
    """One tool on one case on one pair."""

    case: str
    kind: str
    pair: str
    tool: str
    named: bool = False
    full: bool = False
    alarm: bool = False
    text: str = ""
    missing: list[str] = field(default_factory=list)
    unjudged: str = ""  # why the case could not be judged (an op a fake cuda:0 cannot run, a case that broke)

    def to_dict(self) -> dict[str, Any]:
        return {"case": self.case, "kind": self.kind, "pair": self.pair, "tool": self.tool, "named": self.named,
                "full": self.full, "alarm": self.alarm, "missing": self.missing, "text": self.text,
                "unjudged": self.unjudged}


def load_corpus(path: str | Path | None = None) -> Any:
    """The corpus module: the one shipped in the package, or one imported from the file PATH."""
    from ..errors import TorchplaceError

    if path is None:
        from . import _corpus

        return _corpus
    file = Path(path)
    if not file.is_file():
        raise TorchplaceError(f"bench diagnose --corpus {file}: no such file. Fix: leave --corpus out to run the "
                              f"corpus shipped with torchplace, or name a corpus module file.")
    name = "torchplace_diagnose_corpus"
    if name in sys.modules and getattr(sys.modules[name], "__file__", None) == str(file):
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, file)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def available_pairs() -> list[str]:
    import torch

    pairs = ["cpu-meta"]
    if torch.cuda.is_available():
        pairs.append("cuda-cpu")
        if torch.cuda.device_count() > 1:
            pairs.append("cuda1-cuda0")
    return pairs


def score(case: Any, pair: str, tool: str, corpus: Any) -> Outcome:
    """Build CASE for PAIR and judge TOOL on it. The cuda-cpu pair without a GPU: built and judged on a fake
    cuda:0 (checks/_dry_run.py's fake_cuda())."""
    import contextlib

    import torch

    from ..checks._dry_run import fake_cuda

    fake = pair == _FAKE_PAIR and not torch.cuda.is_available()
    world = fake_cuda() if fake else contextlib.nullcontext()
    main, other = (torch.device(d) for d in corpus.PAIRS[pair])
    if torch.cuda.is_available():
        torch.cuda.set_device(0)
    out = Outcome(case.name, case.kind, pair, tool)
    torch.manual_seed(0)
    try:
        with world:
            _build_and_judge(case, main, other, tool, out)
    except Exception as exc:  # what fake tensors cannot run, or a case that breaks: a miss that says why, not a stop
        out.unjudged = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''}"
    if case.kind == "mistake":
        wanted = list(case.culprit)
        out.missing = [w for w in wanted if w not in out.text]
        out.named = bool(out.text) and not out.missing
        extra = [w for w in (case.module, case.at) if w and w not in out.text]
        out.full = out.named and not extra
        out.missing += extra
    return out


def _build_and_judge(case: Any, main: Any, other: Any, tool: str, out: Outcome) -> None:
    program = case.build(main, other)
    if tool == "explain":
        try:
            result = program.explain() if program.explain else _explain(program)
        except LookupError:  # the step failed before the user's explain() line: explain() is handed the step
            result = _explain(program, step=True)
        found = [p for p in result.problems if p["severity"] in ("error", "warning")]
        out.text = "\n".join(f"[{p['severity']}] {p['kind']} {p['where']}: {p['message']}" for p in found)
        out.alarm = bool(found)
    else:
        out.text, out.alarm = _run_under(tool, program)


def _explain(program: Any, step: bool = False) -> Any:
    """explain() as a user calls it: from their own code, beside the call that runs the model, where their
    variables name the model and what lives beside it (the step's closure: `resampler`, `accuracy`); with STEP,
    handed the step (as its report asks where the step fails before the user's explain() line)."""
    from ..checks.explain import explain

    code, cells = getattr(program.run, "__code__", None), getattr(program.run, "__closure__", None) or ()
    call = "_explain(_p.model, step=_p.run)" if step else "_explain(_p.model, *_p.inputs, optimizer=_p.optimizer)"
    if code is None:
        return eval(call, {"_explain": explain, "_p": program})
    scope = {**dict(zip(code.co_freevars, (c.cell_contents for c in cells))), "_explain": explain, "_p": program}
    exec(compile(f"_report = {call}", code.co_filename, "exec"), program.run.__globals__, scope)
    return scope["_report"]


def _run_under(tool: str, program: Any) -> tuple[str, bool]:
    """Run the program under strict(model=...) or watch(model): (what it reported, whether it did)."""
    from ..checks import _dry_run
    from ..checks.strict import strict
    from ..checks.watch import watch
    from ..errors import TorchplaceError

    context = strict(model=program.model) if tool == "strict" else watch(program.model)
    texts: list[str] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with context:
                program.run()
        except TorchplaceError as exc:
            texts.append(str(exc))
        except _dry_run._NO_FAKE:
            raise  # an op fake tensors cannot run: score() says the case was not judged
        except RuntimeError as exc:  # passed through unconverted: nothing named
            return "", True if "device" in str(exc) else False
    texts += [str(w.message) for w in caught if w.category.__module__.startswith("torchplace")]
    return "\n".join(texts), bool(texts)


_FAKE_PAIR = "cuda-cpu"


def score_all(pairs: list[str], corpus: Any, names: set[str] | None = None, fake: bool = False) -> list[Outcome]:
    """Every tool on every case of PAIRS; with FAKE, on the cuda-cpu pair too (no GPU here: see score())."""
    outcomes = []
    jobs = [(pair, case) for pair in pairs for case in corpus.for_pair(pair) if not names or case.name in names]
    if fake and _FAKE_PAIR not in pairs:
        jobs += [(_FAKE_PAIR, c) for c in corpus.for_pair(_FAKE_PAIR) if not names or c.name in names]
    begin("scoring the corpus", len(jobs) * len(TOOLS))
    for pair, case in jobs:
        for tool in TOOLS:
            outcomes.append(score(case, pair, tool, corpus))
            advance()
    return outcomes


def table(outcomes: list[Outcome]) -> list[tuple[str, dict[str, str]]]:
    """Rows of the score table: (label, {pair: 'n/N'})."""
    pairs = list(dict.fromkeys(o.pair for o in outcomes))
    rows: list[tuple[str, dict[str, str]]] = []
    for tool in TOOLS:
        for label, attr in ((f"{tool}() names the culprit", "named"),
                            (f"{tool}() ... with module path, tensor and user line", "full")):
            cells = {}
            for pair in pairs:
                got = [o for o in outcomes if o.pair == pair and o.tool == tool and o.kind == "mistake"]
                cells[pair] = f"{sum(getattr(o, attr) for o in got)}/{len(got)}"
            rows.append((label, cells))
    cells = {}
    for pair in pairs:
        legal = [o for o in outcomes if o.pair == pair and o.kind == "legal"]
        counts = [sum(o.alarm for o in legal if o.tool == t) for t in TOOLS]
        cells[pair] = " / ".join(map(str, counts)) + f" (of {len(legal) // len(TOOLS)})"
    rows.append(("false alarms on legal code: strict / watch / explain", cells))
    return rows


def run(args: argparse.Namespace) -> BenchResult:
    corpus = load_corpus(args.corpus)
    pairs = [p.strip() for p in args.pairs.split(",")] if args.pairs else available_pairs()
    if args.quick:
        pairs = [p for p in pairs if p == "cpu-meta"] or ["cpu-meta"]
    names = {n.strip() for n in args.cases.split(",")} if args.cases else None
    outcomes = score_all(pairs, corpus, names, fake=getattr(args, "fake_gpu", False))
    if getattr(args, "fake_gpu", False) and _FAKE_PAIR not in pairs:
        pairs.append(_FAKE_PAIR)
    rows: list[Row] = []
    targets: list[Target] = []
    for pair in pairs:
        mistakes = [o for o in outcomes if o.pair == pair and o.kind == "mistake"]
        legal = [o for o in outcomes if o.pair == pair and o.kind == "legal"]
        for tool in TOOLS:
            mine = [o for o in mistakes if o.tool == tool]
            n = len(mine) or 1
            named, full = sum(o.named for o in mine), sum(o.full for o in mine)
            alarms = sum(o.alarm for o in legal if o.tool == tool)
            rows.append(Row(f"{pair}: {tool}() names the culprit", named / n, "fraction",
                            extra={"count": f"{named}/{len(mine)}"}))
            rows.append(Row(f"{pair}: {tool}() with module path, tensor and user line", full / n, "fraction",
                            extra={"count": f"{full}/{len(mine)}",
                                   "missed": [o.case for o in mine if not o.full]}))
            rows.append(Row(f"{pair}: {tool}() false alarms on legal code", float(alarms), "cases",
                            extra={"cases": [o.case for o in legal if o.tool == tool and o.alarm]}))
            if pair != "cpu-meta":
                targets.append(Target(f"{pair}: {tool}() full reports", full / n, _TARGETS[tool], ">="))
            targets.append(Target(f"{pair}: {tool}() false alarms", float(alarms), 0.0))
    notes = [f"{label}: " + ", ".join(f"{p} {c}" for p, c in cells.items()) for label, cells in table(outcomes)]
    notes.append(f"corpus: {len(corpus.CASES)} cases from public issues ({corpus.__file__})")
    result = BenchResult("diagnose", rows, baseline=None, lower_is_better=False, targets=targets, notes=notes,
                         params={"pairs": pairs, "outcomes": [o.to_dict() for o in outcomes]})
    return result
