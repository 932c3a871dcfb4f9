"""SIGKILL at random moments of a save loop: the path always loads as the old or the new checkpoint."""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import torchplace
from torchplace.checkpoint import Checkpoint, latest

HELPER = Path(__file__).parent / "helpers" / "kill_zygote.py"


class Zygote:
    """One long-lived process with torch imported that forks a fresh writer for every kill."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, str(HELPER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True)

    def ask(self, line: str) -> str:
        assert self.proc.stdin and self.proc.stdout
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        answer = self.proc.stdout.readline().strip()
        assert answer, f"the fork server died (exit code {self.proc.poll()})"
        return answer

    def close(self) -> None:
        if self.proc.stdin:
            self.proc.stdin.close()
        self.proc.wait(timeout=120)


@pytest.fixture(scope="module")
def zygote():
    z = Zygote()
    try:
        yield z
    finally:
        z.close()


@pytest.fixture
def kill_dir(tmp_path: Path):
    """A directory on /dev/shm when there is one: saves without a slow fsync, so kills land in every
    phase of a save (rename atomicity is the file system's namespace, the same on tmpfs and disk)."""
    if not os.path.isdir("/dev/shm"):
        yield tmp_path
        return
    path = Path(tempfile.mkdtemp(prefix="tp-kill-", dir="/dev/shm"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _gen(ck: Checkpoint) -> int:
    """The generation a loaded checkpoint holds, after checking it is all one generation."""
    gen = ck.extra["gen"]
    model = ck["model"]
    assert torch.all(model["w"] == gen) and torch.all(model["b"] == gen) and model["pad"][-1] == 249_999
    assert model["w"].numel() == 20_000 + (gen % 5) * 7_000
    return gen


Coverage = Callable[[list[int], int], bool]


def _kill_loop(zygote: Zygote, target: Path, mode: str, kills: int, load_path: Path, *,
               covered: Coverage | None = None, max_kills: int = 0) -> tuple[list[int], int]:
    """Kill KILLS writers at random moments (and more, up to MAX_KILLS, until COVERED(seen, mid_save)
    holds: on a loaded machine fewer saves finish inside the random windows); return the
    generations seen and how many kills caught a save in the middle (a temporary file was left)."""
    rng = random.Random(1234 + len(mode))
    seen, last, mid_save = [], None, 0
    directory = target if mode == "dir" else target.parent
    for i in range(max(kills, max_kills)):
        if i >= kills and (covered is None or covered(seen, mid_save)):
            break
        start = (i + 1) * 1_000_000
        pid = int(zygote.ask(f"fork {target} {start} {mode}"))
        time.sleep(rng.uniform(0.0, 0.03))
        os.kill(pid, signal.SIGKILL)
        assert zygote.ask(f"reap {pid}") == "reaped"
        mid_save += any(".tmp-" in name for name in os.listdir(directory))
        if not os.path.exists(load_path) or (mode == "dir" and latest(load_path) is None):
            assert last is None, f"kill {i}: the checkpoint vanished"
            continue
        gen = _gen(torchplace.load(load_path))
        assert gen == last or start < gen < start + 1_000_000, f"kill {i}: generation {gen} is neither old nor new"
        seen.append(gen)
        last = gen
    return seen, mid_save


def test_200_sigkills_during_saves_never_tear_a_file(kill_dir: Path, zygote: Zygote) -> None:
    target = kill_dir / "c.safetensors"
    seen, mid_save = _kill_loop(zygote, target, "file", 200, target, max_kills=800,
                                covered=lambda seen, mid: len(set(seen)) > 50 and mid > 50)
    assert len(set(seen)) > 50  # many writers got a save through before the kill
    assert mid_save > 50  # and many kills landed in the middle of a save
    torchplace.save(target, extra={"gen": 0}, model={"w": torch.zeros(20_000)})
    assert sorted(p.name for p in kill_dir.iterdir()) == ["c.safetensors"]  # killed writers' temps swept


def test_sigkills_during_background_saves_never_tear_a_file(kill_dir: Path, zygote: Zygote) -> None:
    target = kill_dir / "c.safetensors"
    seen, mid_save = _kill_loop(zygote, target, "async", 100, target, max_kills=400,
                                covered=lambda seen, mid: len(set(seen)) > 20 and mid > 20)
    assert len(set(seen)) > 20 and mid_save > 20  # kills landed between saves and inside background writes
    torchplace.save_async(target, extra={"gen": 0}, model={"w": torch.zeros(20_000)}).result(timeout=120)
    assert sorted(p.name for p in kill_dir.iterdir()) == ["c.safetensors"]  # killed writers' temps swept


def test_sigkills_during_rotation_keep_a_loadable_newest(kill_dir: Path, zygote: Zygote) -> None:
    seen, mid_save = _kill_loop(zygote, kill_dir, "dir", 100, kill_dir)
    assert seen and seen == sorted(seen) and mid_save > 10  # resuming never goes back in time
    torchplace.save(kill_dir / "step-999999999.safetensors", model={"w": torch.zeros(20_000)}, extra={"gen": 0},
                    keep_last=2)
    names = sorted(p.name for p in kill_dir.iterdir())
    assert len(names) == 3 and names[-1] == "step-999999999.safetensors" and "latest" in names
