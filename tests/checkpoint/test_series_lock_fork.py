"""A fork while a rotation save waits for its directory's series lock (a DataLoader worker starting
next to `save_async`) must not give the child the lock: flock belongs to the open file description
that fork shares, so a child holding a copy that is not counted keeps the folder locked after the
parent's save, its own rotation save waits on itself, and the parent's next save waits for it.
Every step waits for the state it needs (the writer waiting, the child running), never for time."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import textwrap
from pathlib import Path

SCRIPT = textwrap.dedent("""
    import fcntl, os, signal, sys, threading, time
    from pathlib import Path
    from torchplace.checkpoint import rotation, series_lock
    folder = Path(sys.argv[1])
    done = threading.Event()
    def save():  # as save_async's writer thread holds the series while it writes
        with series_lock(folder):
            pass
        done.set()
    writer = threading.Thread(target=save)
    writer.start()
    deadline = time.monotonic() + 120
    while not rotation._held:  # the writer has opened the folder: it waits for the lock the test holds
        assert time.monotonic() < deadline, "the writer never asked for the lock"
        time.sleep(0.01)
    ready_r, ready_w = os.pipe()
    child = os.fork()  # a DataLoader worker starting
    if child == 0:  # fork's after-child hooks have run once the child's own code runs
        os.write(ready_w, b"x")
        signal.pause()  # holds whatever it kept until the test kills it
        os._exit(0)
    os.read(ready_r, 1)  # a child not yet scheduled still has every inherited descriptor open
    print("forked", flush=True)
    sys.stdin.readline()  # the test lets go of the lock
    done.wait(120)
    probe = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
        print("free after the save", flush=True)
    except BlockingIOError:
        print("still locked: the forked child holds the series", flush=True)
    os.kill(child, signal.SIGKILL)
    os.waitpid(child, 0)
""")


def test_a_child_forked_during_the_lock_wait_does_not_hold_the_series(tmp_path: Path) -> None:
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)  # another process's save holds the series
    fcntl.flock(fd, fcntl.LOCK_EX)
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT, str(tmp_path)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "forked", proc.stderr.read()
        os.close(fd)  # the other save ends
        out, err = proc.communicate("go\n", timeout=120)  # only a hang reaches the bound
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    assert out.strip() == "free after the save"
