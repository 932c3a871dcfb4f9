"""A sweep of bad `torchplace` invocations: each ends in a line or two, a non-zero exit, no traceback.

Issue 14 item 7 found 30 of 133 bad invocations printing a traceback and 2 hanging. Every case
below is one thing a user (or an attacker) can type: bad types, Unicode digits, odd paths,
special files, hostile snapshots, bad environment variables. Most run in this process through
`torchplace.cli.main` with stdout/stderr captured (fast on 2 cores); the ones that need their own
environment, a closed pipe or a file that could block (a FIFO) run as real subprocesses, in
parallel. Each must return within 10 s.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from snapshots import snapshot_path

from torchplace.cli import main

X2 = str(snapshot_path("h200x2"))
PT = str(Path(__file__).parents[1] / "fixtures" / "checkpoints" / "gpu1-job.pt")
LIMIT_S = 120.0  # a hang detector: only a real hang reaches it (each case takes 1-3 s idle, ~10 s on a loaded machine)
MAX_LINES = 2
MAX_CHARS = 1500


@dataclass(frozen=True)
class Case:
    id: str
    argv: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)
    subprocess: bool = False  # needs its own environment or could block this process
    may_succeed: bool = False  # odd but valid: only "no traceback, short, in time" is asserted


def _c(id_: str, *argv: str, env: dict[str, str] | None = None, sub: bool = False, ok: bool = False) -> Case:
    return Case(id_, tuple(argv), env or {}, sub or bool(env), ok)


CASES: list[Case] = [
    # --- the top level
    _c("no-such-command", "frobnicate"),
    _c("unknown-option", "--frobnicate"),
    _c("unicode-command", "d\u043etor"),
    _c("empty-command", ""),
    # --- pick
    _c("pick-count-superscript", "pick", "--count", "\u00b2", "--snapshot", X2),
    _c("pick-count-fullwidth", "pick", "--count", "\uff12", "--snapshot", X2),
    _c("pick-count-arabic", "pick", "--count", "\u0662", "--snapshot", X2),
    _c("pick-count-zero", "pick", "--count", "0", "--snapshot", X2),
    _c("pick-count-negative", "pick", "--count", "-1", "--snapshot", X2),
    _c("pick-count-float", "pick", "--count", "1.5", "--snapshot", X2),
    _c("pick-count-huge", "pick", "--count", "9" * 400, "--snapshot", X2),
    _c("pick-count-underscore", "pick", "--count", "1_0", "--snapshot", X2),
    _c("pick-count-too-many", "pick", "--count", "3", "--snapshot", X2),
    _c("pick-min-free-huge", "pick", "--min-free-memory", "9" * 400 + "GiB", "--snapshot", X2),
    _c("pick-min-free-1e308", "pick", "--min-free-memory", "1e308", "--snapshot", X2),
    _c("pick-min-free-garbage", "pick", "--min-free-memory", "lots", "--snapshot", X2),
    _c("pick-min-free-negative", "pick", "--min-free-memory", "-5GiB", "--snapshot", X2),
    _c("pick-min-free-fullwidth", "pick", "--min-free-memory", "\uff12GiB", "--snapshot", X2),
    _c("pick-min-free-unit", "pick", "--min-free-memory", "20parsecs", "--snapshot", X2),
    _c("pick-min-free-too-much", "pick", "--min-free-memory", "1TiB", "--snapshot", X2),
    _c("pick-utilization-fullwidth", "pick", "--max-utilization", "\uff15", "--snapshot", X2),
    _c("pick-utilization-negative", "pick", "--max-utilization", "-5", "--snapshot", X2),
    _c("pick-utilization-over-100", "pick", "--max-utilization", "500", "--snapshot", X2),
    _c("pick-wait-garbage", "pick", "--wait", "forever", "--snapshot", X2),
    _c("pick-wait-negative", "pick", "--wait", "-1m", "--snapshot", X2),
    _c("pick-wait-huge", "pick", "--wait", "9" * 400, "--snapshot", X2),
    _c("pick-wait-arabic", "pick", "--wait", "\u0661m", "--snapshot", X2),
    _c("pick-snapshot-missing", "pick", "--snapshot", "/nonexistent/snap.json"),
    _c("pick-snapshot-dir", "pick", "--snapshot", "/"),
    _c("pick-snapshot-deep", "pick", "--snapshot", "{deep}"),
    # --- run
    _c("run-gpus-superscript", "run", "--dry-run", "--snapshot", X2, "--gpus", "\u00b2", "--", "true"),
    _c("run-gpus-arabic-list", "run", "--dry-run", "--snapshot", X2, "--gpus", "\u0660,\u0661", "--", "true"),
    _c("run-gpus-fullwidth", "run", "--dry-run", "--snapshot", X2, "--gpus", "\uff11", "--", "true"),
    _c("run-gpus-garbage", "run", "--dry-run", "--snapshot", X2, "--gpus", "lots", "--", "true"),
    _c("run-gpus-zero", "run", "--dry-run", "--snapshot", X2, "--gpus", "0x", "--", "true"),
    _c("run-gpus-too-many", "run", "--dry-run", "--snapshot", X2, "--gpus", "5", "--", "true"),
    _c("run-gpus-missing-index", "run", "--dry-run", "--snapshot", X2, "--gpus", "0,7", "--", "true"),
    _c("run-gpus-repeated", "run", "--dry-run", "--snapshot", X2, "--gpus", "1,1", "--", "true"),
    _c("run-gpus-empty", "run", "--dry-run", "--snapshot", X2, "--gpus", "", "--", "true"),
    _c("run-gpus-huge", "run", "--dry-run", "--snapshot", X2, "--gpus", "9" * 400, "--", "true"),
    _c("run-gpus-unknown-uuid", "run", "--dry-run", "--snapshot", X2, "--gpus", "GPU-ffff", "--", "true"),
    _c("run-empty-command", "run", "--dry-run", "--snapshot", X2, "--", ""),
    _c("run-no-command", "run", "--dry-run", "--snapshot", X2),
    _c("run-only-dashes", "run", "--dry-run", "--snapshot", X2, "--"),
    _c("run-nproc-superscript", "run", "--dry-run", "--gpus", "none", "--nproc", "\u00b2", "--", "true"),
    _c("run-nproc-zero", "run", "--dry-run", "--gpus", "none", "--nproc", "0", "--", "true"),
    _c("run-nproc-huge", "run", "--dry-run", "--gpus", "none", "--nproc", "9" * 30, "--", "true"),
    _c("run-wait-garbage", "run", "--dry-run", "--snapshot", X2, "--wait", "soon", "--", "true"),
    _c("run-min-free-huge", "run", "--dry-run", "--snapshot", X2, "--min-free-memory", "9" * 400, "--", "true"),
    _c("run-utilization-fullwidth", "run", "--dry-run", "--snapshot", X2, "--max-utilization", "\uff15", "--",
       "true"),
    _c("run-snapshot-binary", "run", "--dry-run", "--snapshot", "{binary}", "--", "true"),
    _c("run-master-port-garbage", "run", "--dry-run", "--snapshot", X2, "--gpus", "2", "--master-port", "http",
       "--", "true"),
    _c("run-missing-program", "run", "--snapshot", X2, "--gpus", "none", "--", "/nonexistent/program-xyz"),
    _c("run-not-executable", "run", "--snapshot", X2, "--gpus", "none", "--", "{text}"),
    _c("run-command-nul", "run", "--dry-run", "--snapshot", X2, "--gpus", "none", "--", "a\x00b"),
    # --- leases
    _c("leases-dir-is-file", "leases", "--dir", "{text}", "--no-gpu-names"),
    _c("leases-dir-fifo", "leases", "--dir", "{fifo}", "--no-gpu-names", sub=True),
    _c("leases-dir-missing-parent", "leases", "--dir", "/nonexistent/a/b", "--no-gpu-names", ok=True),
    _c("leases-dir-nul", "leases", "--dir", "a\x00b", "--no-gpu-names"),
    _c("leases-dir-proc", "leases", "--dir", "/proc/self/fd/0", "--no-gpu-names"),
    _c("leases-snapshot-missing", "leases", "--snapshot", "/nonexistent.json", "--dir", "{leasedir}"),
    _c("leases-snapshot-deep", "leases", "--snapshot", "{deep}", "--dir", "{leasedir}"),
    _c("leases-unknown-option", "leases", "--everything"),
    # --- ckpt
    _c("ckpt-no-subcommand", "ckpt"),
    _c("ckpt-inspect-missing-arg", "ckpt", "inspect"),
    _c("ckpt-inspect-root", "ckpt", "inspect", "/"),
    _c("ckpt-inspect-dev-zero", "ckpt", "inspect", "/dev/zero"),
    _c("ckpt-inspect-dev-null", "ckpt", "inspect", "/dev/null"),
    _c("ckpt-inspect-dev-urandom", "ckpt", "inspect", "/dev/urandom"),
    _c("ckpt-inspect-proc-file", "ckpt", "inspect", "/proc/self/status"),
    _c("ckpt-inspect-missing", "ckpt", "inspect", "/nonexistent/model.pt"),
    _c("ckpt-inspect-empty", "ckpt", "inspect", "{empty}"),
    _c("ckpt-inspect-text", "ckpt", "inspect", "{text}"),
    _c("ckpt-inspect-binary", "ckpt", "inspect", "{binary}"),
    _c("ckpt-inspect-json", "ckpt", "inspect", "{deep}"),
    _c("ckpt-inspect-empty-dir", "ckpt", "inspect", "{emptydir}"),
    _c("ckpt-inspect-symlink-loop", "ckpt", "inspect", "{loop}"),
    _c("ckpt-inspect-nul", "ckpt", "inspect", "a\x00b"),
    _c("ckpt-inspect-unicode-name", "ckpt", "inspect", "/nonexistent/\u043c\u043e\u0434\u0435\u043b\u044c.pt"),
    _c("ckpt-inspect-verify-text", "ckpt", "inspect", "--verify", "{text}"),
    _c("ckpt-inspect-pickle-untrusted", "ckpt", "inspect", "{pickle}"),
    _c("ckpt-convert-missing", "ckpt", "convert", "/nonexistent.pt", "{out}"),
    # never /dev/null: root would replace it
    _c("ckpt-convert-onto-a-fifo", "ckpt", "convert", "{pt}", "{fifo}", sub=True),
    _c("ckpt-convert-into-missing-dir", "ckpt", "convert", PT, "/nonexistent/dir/out.safetensors"),
    _c("ckpt-convert-onto-itself", "ckpt", "convert", "{pt}", "{pt}"),  # a copy: the fixture stays intact
    _c("ckpt-convert-onto-itself-via-link", "ckpt", "convert", "{pt}", "{ptlink}"),
    _c("ckpt-convert-onto-itself-forced", "ckpt", "convert", "{pt}", "{pt}", "--force"),
    _c("ckpt-convert-onto-itself-via-link-forced", "ckpt", "convert", "{pt}", "{ptlink}", "--force"),
    _c("ckpt-convert-onto-a-fifo-forced", "ckpt", "convert", "{pt}", "{fifo}", "--force", sub=True),
    _c("ckpt-convert-dev-zero", "ckpt", "convert", "/dev/zero", "{out}"),
    _c("ckpt-convert-one-arg", "ckpt", "convert", PT),
    _c("ckpt-convert-text", "ckpt", "convert", "{text}", "{out}"),
    _c("ckpt-bogus-subcommand", "ckpt", "explode", PT),
    # --- doctor / map with hostile snapshots
    _c("doctor-snapshot-missing", "doctor", "--snapshot", "/nonexistent.json"),
    _c("doctor-snapshot-dir", "doctor", "--snapshot", "/"),
    _c("doctor-snapshot-dev-zero", "doctor", "--snapshot", "/dev/zero"),
    _c("doctor-snapshot-dev-urandom", "doctor", "--snapshot", "/dev/urandom"),
    _c("doctor-snapshot-dev-null", "doctor", "--snapshot", "/dev/null"),
    _c("doctor-snapshot-empty", "doctor", "--snapshot", "{empty}"),
    _c("doctor-snapshot-text", "doctor", "--snapshot", "{text}"),
    _c("doctor-snapshot-deep", "doctor", "--snapshot", "{deep}"),
    _c("doctor-snapshot-deep-object", "doctor", "--snapshot", "{deepobj}"),
    _c("doctor-snapshot-list", "doctor", "--snapshot", "{list}"),
    _c("doctor-snapshot-number", "doctor", "--snapshot", "{number}"),
    _c("doctor-snapshot-wrong-types", "doctor", "--snapshot", "{wrongtypes}"),
    _c("doctor-snapshot-gpus-garbage", "doctor", "--snapshot", "{badgpus}"),
    _c("doctor-snapshot-future-schema", "doctor", "--snapshot", "{future}"),
    _c("doctor-snapshot-nul", "doctor", "--snapshot", "a\x00b"),
    _c("doctor-json-snapshot-deep", "doctor", "--json", "--snapshot", "{deep}"),
    _c("map-snapshot-missing", "map", "--snapshot", "/nonexistent.json"),
    _c("map-snapshot-deep", "map", "--snapshot", "{deep}"),
    _c("map-snapshot-wrong-types", "map", "--json", "--snapshot", "{wrongtypes}"),
    _c("map-snapshot-binary", "map", "--snapshot", "{binary}"),
    _c("map-snapshot-dev-zero", "map", "--snapshot", "/dev/zero"),
    _c("map-extra-argument", "map", "extra"),
    # --- bench (parse-time checks: nothing is measured)
    _c("bench-no-name", "bench"),
    _c("bench-unknown", "bench", "everything"),
    _c("bench-transfer-shape-letters", "bench", "transfer", "--shape", "12q"),
    _c("bench-transfer-shape-empty", "bench", "transfer", "--shape", ""),
    _c("bench-transfer-shape-zero", "bench", "transfer", "--shape", "0x64"),
    _c("bench-transfer-shape-negative", "bench", "transfer", "--shape", "-4x4"),
    _c("bench-transfer-shape-huge", "bench", "transfer", "--shape", "99999999x99999999"),
    _c("bench-transfer-shape-unicode", "bench", "transfer", "--shape", "\uff12x\uff12"),
    _c("bench-transfer-tensors-superscript", "bench", "transfer", "--tensors", "\u00b2"),
    _c("bench-transfer-tensors-zero", "bench", "transfer", "--tensors", "0"),
    _c("bench-transfer-compute-nan", "bench", "transfer", "--compute-ms", "nan"),
    _c("bench-transfer-compute-inf", "bench", "transfer", "--compute-ms", "inf"),
    _c("bench-transfer-device", "bench", "transfer", "--quick", "--device", "cuda:01"),
    _c("bench-checkpoint-sizes-garbage", "bench", "checkpoint", "--sizes", "garbage"),
    _c("bench-checkpoint-sizes-empty", "bench", "checkpoint", "--sizes", ""),
    _c("bench-checkpoint-sizes-commas", "bench", "checkpoint", "--sizes", ",,,"),
    _c("bench-checkpoint-sizes-zero", "bench", "checkpoint", "--sizes", "0"),
    _c("bench-checkpoint-sizes-huge", "bench", "checkpoint", "--sizes", "9" * 400 + "GiB"),
    _c("bench-checkpoint-sizes-unicode", "bench", "checkpoint", "--sizes", "\u0661GiB"),
    _c("bench-checkpoint-dir-is-file", "bench", "checkpoint", "--quick", "--dir", "{text}"),
    _c("bench-checkpoint-repeats-zero", "bench", "checkpoint", "--repeats", "0"),
    _c("bench-loader-steps-fullwidth", "bench", "loader", "--steps", "\uff11\uff10"),
    _c("bench-loader-size-negative", "bench", "loader", "--size-mib", "-1"),
    _c("bench-doctor-repeat-zero", "bench", "doctor", "--repeat", "0"),
    _c("bench-cpu-seconds-negative", "bench", "cpu", "--seconds", "-1"),
    _c("bench-cpu-model-unknown", "bench", "cpu", "--model", "gpt5"),
    _c("bench-ddp-gpus-superscript", "bench", "ddp", "--gpus", "\u00b2"),
    _c("bench-out-is-file", "bench", "doctor", "--repeat", "1", "--out", "{text}/x"),
    # --- the environment (subprocesses)
    _c("env-strict-bogus-doctor", "doctor", "--snapshot", X2, env={"TORCHPLACE_STRICT": "bogus"}),
    _c("env-strict-bogus-map", "map", "--snapshot", X2, env={"TORCHPLACE_STRICT": "1,nonsense"}),
    _c("env-cvd-5000-digits-map", "map", "--snapshot", X2, env={"CUDA_VISIBLE_DEVICES": "1" * 5000}, ok=True),
    _c("env-cvd-5000-digits-pick", "pick", "--snapshot", X2, "--count", "3",
       env={"CUDA_VISIBLE_DEVICES": "1" * 5000}),
    _c("env-cvd-dash-run", "run", "--dry-run", "--snapshot", X2, "--gpus", "3", "--", "true",
       env={"CUDA_VISIBLE_DEVICES": "-"}),
    _c("env-cvd-unicode-map", "map", "--snapshot", X2, env={"CUDA_VISIBLE_DEVICES": "\u0661,\uff12"}, ok=True),
    _c("env-cvd-unicode-doctor", "doctor", "--snapshot", X2, env={"CUDA_VISIBLE_DEVICES": "\u00b2"}, ok=True),
    _c("env-order-bogus-map", "map", "--snapshot", X2, env={"CUDA_DEVICE_ORDER": "\u00b2"}, ok=True),
    _c("env-lease-dir-file", "leases", "--no-gpu-names", env={"TORCHPLACE_LEASE_DIR": "/etc/hostname"}),
    _c("env-local-rank-unicode-run", "run", "--dry-run", "--snapshot", X2, "--", "true",
       env={"LOCAL_RANK": "\u0661"}, ok=True),
    _c("env-columns-garbage", "map", "--snapshot", X2, "--bogus", env={"COLUMNS": "-5"}),
    _c("fifo-snapshot", "doctor", "--snapshot", "{fifo}", sub=True),
    _c("fifo-checkpoint", "ckpt", "inspect", "{fifo}", sub=True),
    _c("fifo-leases-snapshot", "leases", "--snapshot", "{fifo}", "--dir", "{leasedir}", sub=True),
]


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, str]:
    """The odd files the cases name: {deep}, {fifo}, ... ."""
    d = tmp_path_factory.mktemp("bad-inputs")
    paths = {name: d / name for name in ("empty", "text", "binary", "deep", "deepobj", "list", "number",
                                          "wrongtypes", "badgpus", "future", "pickle", "fifo", "loop")}
    paths["empty"].write_bytes(b"")
    paths["text"].write_text("not a checkpoint, not JSON\n")
    paths["binary"].write_bytes(bytes(range(256)) * 64)
    paths["deep"].write_text("[" * 200_000 + "]" * 200_000)
    paths["deepobj"].write_text('{"gpus": ' + '{"a": ' * 50_000 + "1" + "}" * 50_000 + "}")
    paths["list"].write_text("[1, 2, 3]")
    paths["number"].write_text("1e999999")
    paths["wrongtypes"].write_text(json.dumps({"schema": "one", "gpus": "many", "links": 7}))
    paths["badgpus"].write_text(json.dumps({"schema": 1, "gpus": [{"index": "x", "uuid": 5, "memory_total": -1},
                                                                    None, [1]]}))
    paths["future"].write_text(json.dumps({"schema": 999, "gpus": []}))
    paths["pickle"].write_bytes(b"\x80\x04\x95" + b"\x00" * 8 + b"cos\nsystem\n(S'true'\ntR.")
    os.mkfifo(paths["fifo"])
    os.symlink(paths["loop"], paths["loop"])  # points at itself
    emptydir = d / "emptydir"
    emptydir.mkdir()
    leasedir = d / "leases"
    leasedir.mkdir(mode=0o700)
    pt = d / "copy.pt"
    pt.write_bytes(Path(PT).read_bytes())
    (d / "copy-link.pt").symlink_to(pt)
    out = {k: str(v) for k, v in paths.items()}
    out.update(pt=str(pt), ptlink=str(d / "copy-link.pt"))
    out.update(emptydir=str(emptydir), leasedir=str(leasedir), out=str(d / "out.safetensors"))
    return out


def _argv(case: Case, files: dict[str, str]) -> list[str]:
    return [a.format(**files) if "{" in a and "}" in a and "\x00" not in a else a for a in case.argv]


@dataclass
class Outcome:
    code: int | None
    stdout: str
    stderr: str
    seconds: float


def _in_process(argv: list[str]) -> Outcome:
    """main(argv) with stdout/stderr captured, in a thread so that a hang is reported, not waited for."""
    out, err = io.StringIO(), io.StringIO()
    result: dict[str, object] = {}

    def target() -> None:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                result["code"] = main(argv)
            except SystemExit as exc:  # argparse's --help/usage path, if it ever escapes
                result["code"] = exc.code if isinstance(exc.code, int) else 1
            except BaseException as exc:  # escaped main(): the test reports it
                result["escaped"] = exc

    start = time.monotonic()
    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(LIMIT_S)
    seconds = time.monotonic() - start
    if thread.is_alive():
        return Outcome(None, out.getvalue(), err.getvalue() + f"\n[hung for {LIMIT_S} s]", seconds)
    if "escaped" in result:
        exc = result["escaped"]
        return Outcome(None, out.getvalue(), f"Traceback: {type(exc).__name__} escaped main(): {exc}", seconds)
    return Outcome(int(result["code"]), out.getvalue(), err.getvalue(), seconds)  # type: ignore[arg-type]


def _child_env(extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "TORCHPLACE_DEBUG", "TORCHPLACE_STRICT")}
    env["COLUMNS"] = "120"
    env.update(extra)
    return env


def _in_subprocess(argv: list[str], env: dict[str, str]) -> Outcome:
    start = time.monotonic()
    try:
        done = subprocess.run([sys.executable, "-m", "torchplace", *argv], capture_output=True, text=True,
                              env=_child_env(env), timeout=LIMIT_S, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired as exc:
        err = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else (exc.stderr or "")
        return Outcome(None, "", err + f"\n[hung for {LIMIT_S} s]", time.monotonic() - start)
    return Outcome(done.returncode, done.stdout, done.stderr, time.monotonic() - start)


@pytest.fixture(scope="module")
def subprocess_outcomes(files) -> dict[str, Outcome]:
    """Every subprocess case, run in parallel once (the machine has 2 cores; the cases mostly wait)."""
    cases = [c for c in CASES if c.subprocess]
    with ThreadPoolExecutor(max_workers=4) as pool:
        futures = {c.id: pool.submit(_in_subprocess, _argv(c, files), c.env) for c in cases}
        return {key: f.result() for key, f in futures.items()}


def _check(case: Case, outcome: Outcome) -> None:
    lines = [line for line in outcome.stderr.splitlines() if line.strip()]
    shown = f"{case.id}: exit {outcome.code}, {outcome.seconds:.1f} s, stderr:\n{outcome.stderr[-2000:]}"
    assert "Traceback" not in outcome.stderr and "Traceback" not in outcome.stdout, shown
    assert outcome.code is not None, shown  # None: it hung (or escaped main)
    if not case.may_succeed:
        assert outcome.code != 0, shown
        assert lines, shown  # says something
    assert len(lines) <= MAX_LINES and len(outcome.stderr) <= MAX_CHARS, shown


def test_the_sweep_is_broad():
    assert len(CASES) >= 100
    assert len({c.id for c in CASES}) == len(CASES)
    commands = {c.argv[0] for c in CASES if c.argv}
    assert {"doctor", "map", "pick", "leases", "run", "ckpt", "bench"} <= commands


@pytest.mark.parametrize("case", [c for c in CASES if not c.subprocess], ids=lambda c: c.id)
def test_bad_invocation_in_process(case, files, monkeypatch):
    for key in ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "TORCHPLACE_DEBUG", "TORCHPLACE_STRICT"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("TORCHPLACE_LEASE_DIR", files["leasedir"])
    _check(case, _in_process(_argv(case, files)))


@pytest.mark.parametrize("case", [c for c in CASES if c.subprocess], ids=lambda c: c.id)
def test_bad_invocation_in_subprocess(case, subprocess_outcomes):
    _check(case, subprocess_outcomes[case.id])


@pytest.mark.parametrize("argv", [["doctor", "--json"], ["doctor"], ["map"]], ids=" ".join)
def test_closed_pipe_exits_quietly_with_success(argv):
    """`torchplace doctor | head -1`: the reader is gone before the write; no BrokenPipeError traceback, and
    exit 0, since the reader had what it wanted (it was 1, and rich's own exit 1 for its tables)."""
    code = ("import subprocess, sys\n"
            "p = subprocess.Popen([sys.executable, '-m', 'torchplace', *sys.argv[2:], '--snapshot', sys.argv[1]],"
            " stdout=subprocess.PIPE, stderr=subprocess.PIPE)\n"
            "p.stdout.close()\n"  # closed at once, as `| true` or `| head -c1` on a slow start
            "err = p.stderr.read().decode(); rc = p.wait(timeout=120)\n"
            "print(rc); print(err)\n")
    done = subprocess.run([sys.executable, "-c", code, X2, *argv], capture_output=True, text=True, timeout=300,
                          env=_child_env({}))
    rc, _, err = done.stdout.partition("\n")
    assert err.strip() == "", done.stdout  # no traceback, no "Exception ignored ... BrokenPipeError"
    assert int(rc) == 0, done.stdout


def test_an_unexpected_error_is_one_line_saying_it_is_a_bug(monkeypatch, capsys):
    """A failure that is not a TorchplaceError: one line, exit 70, TORCHPLACE_DEBUG=1 for the traceback."""
    import torchplace.cli.map as cli_map

    def broken(args):
        raise ZeroDivisionError("division by zero")

    monkeypatch.setattr(cli_map, "run", broken)  # our own function, not torch's
    monkeypatch.delenv("TORCHPLACE_DEBUG", raising=False)
    assert main(["map", "--snapshot", X2]) == 70
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert "bug" in err and "ZeroDivisionError: division by zero" in err and "TORCHPLACE_DEBUG=1" in err
    monkeypatch.setenv("TORCHPLACE_DEBUG", "1")
    assert main(["map", "--snapshot", X2]) == 70
    assert "Traceback" in capsys.readouterr().err


def test_a_usage_error_is_one_line_with_the_fix(capsys):
    assert main(["pick", "--count", "\u00b2"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "--count" in err and "'\u00b2'" in err and "torchplace pick --help" in err
