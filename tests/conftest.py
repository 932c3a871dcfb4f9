"""Shared fixtures: GPU skipping, env hygiene, thread settings, a private lease directory and the CLI
in a subprocess (used by the distributed and bench tests)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch

# set by pytest, or by torch itself on a lazy import (torch._dynamo sets the inductor cache dir)
# KMP_*: set at import by libraries that load Intel's OpenMP (transformers' dependencies on the GPU machine)
_NOT_OURS = {"PYTEST_CURRENT_TEST", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "KMP_DUPLICATE_LIB_OK",
             "KMP_INIT_AT_FORK"}


@pytest.fixture(autouse=True)
def _no_env_leaks():
    """Fail a test that leaks an environment variable change (Lightning's habit, kept)."""
    before = {k: v for k, v in os.environ.items() if k not in _NOT_OURS}
    yield
    after = {k: v for k, v in os.environ.items() if k not in _NOT_OURS}
    if before != after:
        changed = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))
        for key in changed:
            if key in before:
                os.environ[key] = before[key]
            else:
                os.environ.pop(key, None)
        pytest.fail(f"test leaked environment changes: {changed}")


# Threads that outlive a test by design, matched by name prefix, with the reason.
_LONG_LIVED_THREADS: dict[str, str] = {
    "torchplace-copy-": "the host-copy helpers (placement/_hostcopy.py, a shared/threads.py kept_pool): started "
                        "by the first large pack of a process, daemons that live until exit (none under 4 cores)",
    "torchplace-load-": "the load readers (shared/threads.py kept_pool): started by the first load of a "
                        "process, daemons kept for the next load until exit",
    "tqdm_monitor": "tqdm's monitor, started once per process by its first progress bar (transformers' "
                    "save_pretrained and from_pretrained show one)",
}
_GRACE_S = 120.0  # a thread or child that is finishing gets this long to end (a hang bound: the wait ends when they do)


def _alive_children(me: psutil.Process) -> list[psutil.Process]:
    """This process's children and their children, without those that have already ended."""
    alive = []
    for child in me.children(recursive=True):
        try:
            if child.status() != psutil.STATUS_ZOMBIE:
                alive.append(child)
        except psutil.NoSuchProcess:
            pass
    return alive


def _describe(child: psutil.Process) -> str:
    try:
        return f"pid {child.pid} ({child.name()}): {' '.join(child.cmdline())[:160]}"
    except psutil.Error:
        return f"pid {child.pid}"


@pytest.fixture(autouse=True)
def _no_thread_or_process_leaks():
    """Fail a test that leaves a thread or a child process running (children are killed, so the
    next test starts clean); threads that live as long as the process by design are allowed by
    name (_LONG_LIVED_THREADS). torch itself left none behind in the CPU suite."""
    me = psutil.Process()
    threads_before = set(threading.enumerate())
    children_before = {c.pid for c in _alive_children(me)}
    yield
    deadline = time.monotonic() + _GRACE_S
    while True:
        threads = [t for t in threading.enumerate() if t not in threads_before and t.is_alive()
                   and not t.name.startswith(tuple(_LONG_LIVED_THREADS))]
        children = [c for c in _alive_children(me) if c.pid not in children_before]
        if not (threads or children) or time.monotonic() > deadline:
            break
        time.sleep(0.02)
    for child in children:
        with contextlib.suppress(psutil.Error):
            child.kill()
    if threads or children:
        left = [f"thread {t.name!r} (target {getattr(t, '_target', None)!r})" for t in threads]
        pytest.fail("test left running: " + "; ".join(left + [_describe(c) for c in children]))


def _share_wide_fixtures_in_one_worker(config, items) -> None:
    """Under pytest-xdist (`make test` runs `-n auto --dist loadgroup`), tests that use one module- or
    session-scoped fixture (a reference job, a crafted corpus, a block server) go to one worker, so the
    fixture is built once rather than once in each worker; the other tests spread over all workers."""
    if not config.pluginmanager.hasplugin("xdist"):
        return
    for item in items:
        info = getattr(item, "_fixtureinfo", None)
        if info is None:
            continue
        shared = sorted(f"{defs[-1].baseid}::{name}" for name, defs in info.name2fixturedefs.items()
                        if defs and defs[-1].baseid and defs[-1].scope in ("module", "package", "session")
                        and not _autouse(defs[-1]))  # baseid "": pytest's own (tmp_path_factory), cheap
        if shared:
            item.add_marker(pytest.mark.xdist_group(shared[0]))


def _autouse(fixturedef) -> bool:
    """Whether a fixture applies to every test below it (cheap set-ups, not worth grouping by)."""
    return bool(getattr(fixturedef, "_autouse", getattr(fixturedef, "autouse", False)))


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups (loadgroup)
def pytest_collection_modifyitems(config, items):
    """Group tests that share a wide fixture (for xdist); skip gpu-marked tests cleanly on a machine without CUDA."""
    _share_wide_fixtures_in_one_worker(config, items)
    if not any("gpu" in item.keywords for item in items):
        return
    try:
        import torch

        has_cuda = torch.cuda.is_available()
        count = torch.cuda.device_count() if has_cuda else 0
    except Exception:
        has_cuda, count = False, 0
    for item in items:
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
        elif "multigpu" in item.keywords and count < 2:
            item.add_marker(pytest.mark.skip(reason="needs two CUDA GPUs"))


@pytest.fixture
def restore_threads():
    """Give torch and the environment back their thread settings after the test."""
    env = {name: os.environ.get(name) for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)
    for name, value in env.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@pytest.fixture
def lease_dir(tmp_path, monkeypatch) -> Path:
    """A private lease directory for this test, also set as $TORCHPLACE_LEASE_DIR."""
    path = tmp_path / "leases"
    monkeypatch.setenv("TORCHPLACE_LEASE_DIR", str(path))
    yield path
    from torchplace.distributed.leases import release_all

    release_all()


def child_env(**extra: str) -> dict[str, str]:
    """os.environ for a subprocess, without launcher or GPU variables from outside, plus `extra`."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                        "MASTER_PORT", "CUDA_VISIBLE_DEVICES") and not k.startswith(("TORCHELASTIC_", "SLURM_"))}
    env.update(extra)
    return env


def run_cli(args: list[str], env: dict[str, str] | None = None, timeout: float = 120,
            **kwargs) -> subprocess.CompletedProcess:
    """`python -m torchplace ARGS` in a subprocess; `timeout` only guards against a hang."""
    return subprocess.run([sys.executable, "-m", "torchplace", *args], capture_output=True, text=True,
                          env=env if env is not None else child_env(), timeout=timeout, **kwargs)


@pytest.fixture(name="child_env")
def _child_env_fixture():
    """The `child_env` helper, for tests (conftest functions are not importable by name)."""
    return child_env


@pytest.fixture(name="run_cli")
def _run_cli_fixture():
    """The `run_cli` helper."""
    return run_cli


@pytest.fixture
def strict_leaves_nothing_behind():
    """Every test must leave torch as it found it: no patches, hooks or default device left over."""
    from torchplace.checks import deferred
    from torchplace.shared import strict_switch

    yield
    leftovers = []
    if "to" in vars(torch.Tensor) or "cuda" in vars(torch.Tensor):
        leftovers.append("torch.Tensor.to/cuda still wrapped")
    if torch.nn.Module.__call__ is not torch.nn.Module._wrapped_call_impl:
        leftovers.append("nn.Module.__call__ still wrapped")
    if deferred.pending() or torch.nn.modules.module._global_forward_pre_hooks:
        leftovers.append("a module hook is still registered")
    if strict_switch.active() is not None:
        leftovers.append("strict mode still active")
    if torch.get_default_device() != torch.device("cpu"):
        torch.set_default_device(None)
        leftovers.append("the default device was left changed")
    if leftovers:
        pytest.fail("; ".join(leftovers))
