"""Every code block of the docs marked runnable runs, so the docs cannot rot.

Pages: README.md and every .md under docs/. A fenced block is runnable when its info string says so:

    ```python runnable                  run as a program (like `python example.py`), must exit 0
    ```python runnable file=demo.py     only written to demo.py, for a later console block to run
    ```python runnable as=train.py      run as train.py (default: example.py)
    ```console runnable                 each line "$ torchplace ..." is run, must exit 0
    ```console runnable exit=1          ... must exit 1 (a doctor that finds an error)

Options: `timeout=SECONDS` (default 120 per block: a hang detector). Console lines may start with environment
assignments (`$ CUDA_VISIBLE_DEVICES=1 torchplace map`), end with a `# comment`, and continue on
the next line after a backslash; lines without `$ ` are not compared. Only `torchplace` commands run.

Recorded outputs. A ```` ```text output ```` block right after a runnable block (blank lines between at
most) is what that block prints, and is compared with what it prints now (`normalized`: durations,
torch's own line numbers are masked; a line `...` stands for any lines). A python block runs as
`example.py`, or as the name its `as=train.py` option gives, so its messages name the file a reader
would have saved it as. Write them
only for outputs that are the same on every machine (a shipped snapshot, cpu and meta standing in for
devices); an output of one real machine is a plain ```` ```text ```` block whose page names the machine
and the date. `python tests/test_docs.py --write PAGE` regenerates a page's recorded outputs.

The blocks of one page run in order in one fresh temporary directory (so a block can use a
file an earlier one wrote), with `tests/fixtures` of this repository linked into it: blocks
name fixtures by the same relative path a reader uses from the repository root. The
environment is this one without TORCHPLACE_* variables, with this interpreter's bin directory
first on PATH, TORCHPLACE_LEASE_DIR inside the temporary directory, and a terminal of 80 columns without
colours (COLUMNS=80, TTY_COMPATIBLE=1, NO_COLOR=1, TERM=dumb): rich lays out tables as a reader's terminal
would, at the width of a code block on the docs site.

Each python block runs in a process of its own, forked from a small server process that has
imported torch (about 2.5 s saved per block on a small machine); the block runs as `__main__`
with a fresh module, like `python file.py`. TORCHPLACE_DOCS_SPAWN=1 runs every block with a
fresh interpreter instead (`python file.py`), for full fidelity at a few seconds more each.

Run one page by hand, printing each block's output (to refresh the outputs shown in the docs):

    .venv/bin/python tests/test_docs.py docs/checkpoints.md
    .venv/bin/python tests/test_docs.py --write docs/doctor.md    # and rewrite its recorded outputs
"""

from __future__ import annotations

import difflib
import json
import os
import re
import select
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures"
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
DEFAULT_TIMEOUT = 120.0
_FENCE = re.compile(r"^(`{3,})(.*)$")
_LANGS = {"python", "console"}
_OPTIONS = {"file", "exit", "timeout", "as"}
COLUMNS = 80  # what a code block of the docs site shows at 1280 px (tools/check_site.py measures it)


@dataclass
class Block:
    page: Path
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    options: dict[str, str] = field(default_factory=dict)
    recorded: str | None = None  # the ```text output block after it, when there is one
    recorded_lines: tuple[int, int] = (0, 0)  # its body's first and last+1 line, 0-based

    @property
    def where(self) -> str:
        return f"{_rel(self.page)}:{self.line}"

    @property
    def timeout(self) -> float:
        return float(self.options.get("timeout", DEFAULT_TIMEOUT))


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else str(path)


def blocks_of(page: Path) -> list[Block]:
    """The runnable blocks of PAGE, in order; a malformed runnable info string raises ValueError."""
    found: list[Block] = []
    lines = page.read_text().splitlines()
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, info = m.group(1), m.group(2).split()
        body: list[str] = []
        j = i + 1
        while j < len(lines) and not lines[j].startswith(fence):
            body.append(lines[j])
            j += 1
        if any(w.startswith("runna") or w.startswith("runable") for w in info):
            where = f"{_rel(page)}:{i + 1}"
            if "runnable" not in info[1:2]:
                raise ValueError(f"{where}: write the info string as '<lang> runnable [key=value ...]', got {info}")
            lang = info[0]
            options = dict(w.split("=", 1) for w in info[2:] if "=" in w)
            unknown = [w for w in info[2:] if "=" not in w or w.split("=", 1)[0] not in _OPTIONS]
            if lang not in _LANGS or unknown:
                raise ValueError(f"{where}: runnable blocks are python or console, with options "
                                 f"{sorted(_OPTIONS)}; got {info}")
            found.append(Block(page, i + 1, lang, "\n".join(body) + "\n", options))
            k = j + 1
            while k < len(lines) and not lines[k].strip():
                k += 1
            m = _FENCE.match(lines[k]) if k < len(lines) else None
            if m and m.group(2).split() == ["text", "output"]:
                end = next((e for e in range(k + 1, len(lines)) if lines[e].startswith(m.group(1))), len(lines))
                found[-1].recorded = "\n".join(lines[k + 1:end]) + "\n"
                found[-1].recorded_lines = (k + 1, end)
                j = end
        elif info[:2] == ["text", "output"]:
            raise ValueError(f"{_rel(page)}:{i + 1}: a recorded output (```text output) follows the runnable block "
                             "it records, with only blank lines between")
        i = j + 1
    return found


_MASKS = [
    (re.compile(r"\b\d+(\.\d+)? ?(ms|µs|us|s)\b"), "<time>"),  # durations
    (re.compile(r"(torch/[\w/]+\.py):\d+"), r"\1:<n>"),  # torch's own lines move between versions
]


def normalized(text: str) -> str:
    """TEXT with what differs between runs masked, trailing spaces and blank lines at either end dropped."""
    for pattern, replacement in _MASKS:
        text = pattern.sub(replacement, text)
    return "\n".join(line.rstrip() for line in text.strip("\n").splitlines())


def matches(recorded: str, printed: str) -> bool:
    """Whether PRINTED is RECORDED once both are normalized, a recorded line `...` standing for any lines."""
    parts = [r"(?:[^\n]*\n)*?" if line == "..." else re.escape(line) + r"\n"
             for line in normalized(recorded).splitlines()]
    return re.fullmatch("".join(parts), normalized(printed) + "\n") is not None


def console_commands(block: Block) -> list[tuple[dict[str, str], list[str]]]:
    """(environment assignments, argv) for each `$ ` line of a console block."""
    commands = []
    lines = block.code.splitlines()
    k = 0
    while k < len(lines):
        line = lines[k]
        k += 1
        if not line.startswith("$ "):
            continue
        text = line[2:]
        while text.rstrip().endswith("\\") and k < len(lines):
            text = text.rstrip()[:-1] + " " + lines[k].strip()
            k += 1
        words = shlex.split(text, comments=True)
        env = {}
        while words and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", words[0]):
            name, value = words.pop(0).split("=", 1)
            env[name] = value
        if not words or words[0] != "torchplace":
            raise ValueError(f"{block.where}: console blocks run only `torchplace ...` commands, got {text!r}")
        commands.append((env, words))
    if not commands:
        raise ValueError(f"{block.where}: a runnable console block needs at least one `$ torchplace ...` line")
    return commands


# --------------------------------------------------------------------------- running

_ZYGOTE = r'''
import atexit, json, os, signal, sys, time, traceback, types
import torch  # preloaded, so each block's process starts with it imported
# warm up torch's lazily built meta kernels (1.5 s on first use); meta ops run no threads
torch.nn.Linear(2, 2, device="meta")(torch.ones(1, 2, device="meta")).relu()

def run(job):
    os.setpgrp()  # the block's own children die with it on a timeout
    os.chdir(job["cwd"])
    os.environ.clear()
    os.environ.update(job["env"])
    fd = os.open(job["out"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.argv = [job["path"]]
    sys.path[0] = job["cwd"]
    main = types.ModuleType("__main__")
    main.__file__ = job["path"]
    sys.modules["__main__"] = main
    code = 0
    try:
        with open(job["path"]) as f:
            exec(compile(f.read(), job["path"], "exec"), main.__dict__)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:
        traceback.print_exc()
        code = 1
    try:
        atexit._run_exitfuncs()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)

for line in sys.stdin:
    job = json.loads(line)
    sys.stdout.flush()
    pid = os.fork()
    if pid == 0:
        run(job)
    deadline = time.monotonic() + job["timeout"]
    status = None
    while status is None:
        done, raw = os.waitpid(pid, os.WNOHANG)
        if done:
            status = {"rc": os.waitstatus_to_exitcode(raw), "timed_out": False}
        elif time.monotonic() > deadline:
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            os.waitpid(pid, 0)
            status = {"rc": -9, "timed_out": True}
        else:
            time.sleep(0.01)
    print(json.dumps(status), flush=True)
'''


class Runner:
    """Runs python blocks in processes forked from a torch-preloaded server (or spawned fresh)."""

    def __init__(self, spawn: bool = False) -> None:
        self.spawn = spawn
        self.proc: subprocess.Popen | None = None

    def _server(self) -> subprocess.Popen:
        if self.proc is None or self.proc.poll() is not None:
            self.proc = subprocess.Popen([sys.executable, "-c", _ZYGOTE], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, text=True, env=base_env(Path(tempfile.gettempdir())))
        return self.proc

    def python(self, path: Path, cwd: Path, env: dict[str, str], timeout: float) -> tuple[int, str, bool]:
        out = path.with_suffix(".out")
        if self.spawn:
            try:
                done = subprocess.run([sys.executable, str(path)], cwd=cwd, env=env, timeout=timeout,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            except subprocess.TimeoutExpired as exc:
                return -9, str(exc.output or ""), True
            return done.returncode, done.stdout, False
        server = self._server()
        assert server.stdin is not None and server.stdout is not None
        job = {"path": str(path), "cwd": str(cwd), "env": env, "out": str(out), "timeout": timeout}
        server.stdin.write(json.dumps(job) + "\n")
        server.stdin.flush()
        ready, _, _ = select.select([server.stdout], [], [], timeout + 30)
        if not ready:
            raise RuntimeError("the docs' block server stopped answering")
        status = json.loads(server.stdout.readline())
        return status["rc"], out.read_text() if out.exists() else "", status["timed_out"]

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            self.proc.wait(timeout=120)


def base_env(workdir: Path) -> dict[str, str]:
    # LINES: set in pytest-xdist's workers; with COLUMNS it would give rich a fixed size, not the 80 columns below
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("TORCHPLACE_") and k not in ("PYTEST_CURRENT_TEST", "LINES")}
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env["TORCHPLACE_LEASE_DIR"] = str(workdir / ".leases")
    env.update(COLUMNS=str(COLUMNS), TTY_COMPATIBLE="1", NO_COLOR="1", TERM="dumb")
    return env


def prepare(workdir: Path) -> None:
    (workdir / "tests").mkdir(exist_ok=True)
    (workdir / "tests" / "fixtures").symlink_to(FIXTURES, target_is_directory=True)
    # the test accelerator (docs/backends.md imports it as a reader does: sys.path "tests", backends.npu)
    (workdir / "tests" / "backends").symlink_to(ROOT / "tests" / "backends", target_is_directory=True)


def _shown(extra: dict[str, str], argv: list[str]) -> str:
    return shlex.join([f"{k}={v}" for k, v in extra.items()] + argv)


def run_page(page: Path, workdir: Path, runner: Runner, echo: bool = False,
             outputs: dict[int, str] | None = None) -> list[str]:
    """Run PAGE's runnable blocks in order in WORKDIR; return the failures (empty when all pass).
    OUTPUTS, when given, receives what each block with a recorded output printed, by the block's line."""
    prepare(workdir)
    env = base_env(workdir)
    failures: list[str] = []
    script = Path(sys.executable).parent / "torchplace"  # the console script, where installed
    torchplace = [str(script)] if script.exists() else [sys.executable, "-m", "torchplace"]
    for _n, block in enumerate(blocks_of(page)):
        started = time.monotonic()
        if block.lang == "python":
            path = workdir / block.options.get("file", block.options.get("as", "example.py"))
            path.write_text(block.code)
            if "file" in block.options:
                continue
            rc, output, timed_out = runner.python(path, workdir, env, block.timeout)
            results = [("python", rc, output, timed_out)]
        else:
            results = []
            for extra, argv in console_commands(block):
                try:
                    done = subprocess.run([*torchplace, *argv[1:]], cwd=workdir, env={**env, **extra},
                                          timeout=block.timeout, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                          text=True)
                    results.append((_shown(extra, argv), done.returncode, done.stdout, False))
                except subprocess.TimeoutExpired as exc:
                    results.append((_shown(extra, argv), -9, str(exc.output or ""), True))
        expected = int(block.options.get("exit", 0))
        for what, rc, output, timed_out in results:
            if echo:
                print(f"--- {block.where} ({what}): exit {rc}, {time.monotonic() - started:.1f} s\n{output}")
            if timed_out:
                failures.append(f"{block.where}: {what} ran past its {block.timeout:.0f} s timeout\n{output[-3000:]}")
            elif rc != expected or "Traceback (most recent call last)" in output and block.lang == "console":
                failures.append(f"{block.where}: {what} exited {rc}, expected {expected}\n{output[-3000:]}")
        if block.recorded is not None:
            printed = "".join(output for _what, _rc, output, _t in results)
            if outputs is not None:
                outputs[block.line] = printed
            if not matches(block.recorded, printed):
                diff = difflib.unified_diff(normalized(block.recorded).splitlines(), normalized(printed).splitlines(),
                                            "recorded on the page", "printed now", lineterm="", n=1)
                failures.append(f"{block.where}: the output recorded below the block is not what it prints "
                                f"(`python tests/test_docs.py --write {_rel(page)}` rewrites it):\n"
                                + "\n".join(list(diff)[:60]))
    return failures


def write_outputs(page: Path, outputs: dict[int, str]) -> int:
    """Put OUTPUTS (by block line) into PAGE's recorded-output blocks that no longer match; return how many."""
    lines = page.read_text().splitlines()
    changed = 0
    for block in reversed(blocks_of(page)):  # from the end, so earlier line numbers stay valid
        if block.recorded is None or block.line not in outputs or matches(block.recorded, outputs[block.line]):
            continue  # an abridged output (`...` lines) that still matches stays as it was written
        new = [line.rstrip() for line in outputs[block.line].strip("\n").splitlines()]
        start, end = block.recorded_lines
        lines[start:end] = new
        changed += 1
    page.write_text("\n".join(lines) + "\n")
    return changed


# --------------------------------------------------------------------------- tests


@pytest.fixture(scope="module")
def runner():
    """One block server for the module, started here so no test is blamed for leaving it running."""
    r = Runner(spawn=os.environ.get("TORCHPLACE_DOCS_SPAWN") == "1" or sys.platform != "linux")
    if not r.spawn:
        r._server()
    yield r
    r.close()


def _runnable_pages() -> list[Path]:
    return [p for p in PAGES if blocks_of(p)]


def test_runnable_blocks_are_found_and_well_formed():
    counts = {p.relative_to(ROOT).as_posix(): len(blocks_of(p)) for p in PAGES}
    for page in PAGES:
        for block in blocks_of(page):
            if block.lang == "console":
                console_commands(block)  # raises on a command that is not torchplace's
    assert sum(counts.values()) >= 20, counts  # a broken info-string parser would find none


@pytest.mark.parametrize("page", _runnable_pages(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_page_blocks_run(page: Path, runner: Runner, tmp_path: Path):
    failures = run_page(page, tmp_path, runner)
    assert not failures, "\n\n".join(failures)


def test_a_failing_block_is_reported(runner: Runner, tmp_path: Path):
    """The harness itself: a raising block, a wrong exit code and a block that hangs all fail."""
    page = tmp_path / "page.md"
    page.write_text("```python runnable\nraise ValueError('boom')\n```\n\n"
                    "```python runnable timeout=1\nimport time\ntime.sleep(30)\n```\n\n"
                    "```console runnable\n$ torchplace doctor --snapshot no-such-file.json\n```\n\n"
                    "```python\nraise SystemExit('plain blocks are not run')\n```\n")
    work = tmp_path / "work"
    work.mkdir()
    failures = run_page(page, work, runner)
    assert len(failures) == 3, failures
    assert "ValueError: boom" in failures[0] and "timeout" in failures[1] and "expected 0" in failures[2]


def test_recorded_outputs_are_compared(runner: Runner, tmp_path: Path):
    """A `text output` block must be what its block prints (durations masked, `...` for any lines)."""
    page = tmp_path / "page.md"
    page.write_text("```python runnable\nprint('one'); print('two'); print('took 12 ms')\n```\n\n"
                    "```text output\none\n...\ntook 3 s\n```\n\n"
                    "```python runnable\nprint('what it prints now')\n```\n```text output\nwhat it printed once\n```\n")
    work = tmp_path / "work"
    work.mkdir()
    printed: dict[int, str] = {}
    failures = run_page(page, work, runner, outputs=printed)
    assert len(failures) == 1 and "page.md:11" in failures[0] and "+what it prints now" in failures[0], failures
    assert write_outputs(page, printed) == 1 and "```text output\nwhat it prints now\n```" in page.read_text()
    with pytest.raises(ValueError, match="follows the runnable block"):
        page.write_text("text\n\n```text output\nalone\n```\n")
        blocks_of(page)


def test_results_table_is_up_to_date():
    """docs/results/README.md shows the table tools/summarize_results.py makes from the JSON files."""
    done = subprocess.run([sys.executable, str(ROOT / "tools" / "summarize_results.py"), "--check"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_links_between_pages_resolve():
    """Every relative link, and every path into docs/results, in README.md and docs/ names a file that exists."""
    link = re.compile(r"\]\(([^)\s]+)\)|((?:docs/)?results/[\w./-]+\.(?:txt|json|md))")
    broken = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        for linked, mentioned in link.findall(page.read_text()):
            target = (linked or mentioned).split("#")[0]
            if not target or re.match(r"^[a-z]+:", target):
                continue
            base = ROOT if target.startswith("docs/") else page.parent
            if not (base / target).exists() and not (ROOT / "docs" / target).exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert not broken, broken


if __name__ == "__main__":  # print every block's output of the pages given (default: all); --write records them
    args = sys.argv[1:]
    write = "--write" in args
    chosen = [Path(a).resolve() for a in args if a != "--write"] or _runnable_pages()
    r = Runner(spawn=os.environ.get("TORCHPLACE_DOCS_SPAWN") == "1" or sys.platform != "linux")
    bad = []
    try:
        for page_path in chosen:
            printed: dict[int, str] = {}
            with tempfile.TemporaryDirectory() as tmp:
                failed = run_page(page_path, Path(tmp), r, echo=not write, outputs=printed)
            if write:
                print(f"{_rel(page_path)}: {write_outputs(page_path, printed)} recorded output(s) rewritten")
                failed = [f for f in failed if "recorded below the block" not in f]
            bad += failed
    finally:
        r.close()
    print("\n\n".join(bad) if bad else "all blocks ran")
    sys.exit(1 if bad else 0)
