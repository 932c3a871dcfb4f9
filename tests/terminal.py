"""Run the `torchplace` command on a pseudo-terminal, as a user at a terminal would see it.

`on_terminal(args, columns=80)` gives the child a pty as stdin, stdout and stderr (sized COLUMNS
wide, TERM=xterm-256color) and returns everything it wrote, with the terminal's escape sequences
removed and carriage-return redraws kept as separate lines; `raw` keeps them.
"""

from __future__ import annotations

import fcntl
import os
import pty
import re
import select
import struct
import subprocess
import sys
import termios
import time
from dataclasses import dataclass

ESCAPES = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x07]*\x07")


@dataclass
class TerminalRun:
    returncode: int
    raw: str

    @property
    def text(self) -> str:
        """What was written, escapes removed, each redraw on its own line."""
        return ESCAPES.sub("", self.raw).replace("\r\n", "\n").replace("\r", "\n")


def on_terminal(args: list[str], env: dict[str, str], *, columns: int = 80, timeout: float = 120) -> TerminalRun:
    """`python -m torchplace ARGS` with a pty for stdin, stdout and stderr."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, columns, 0, 0))
    full = {**env, "TERM": "xterm-256color", "COLUMNS": str(columns)}
    full.pop("NO_COLOR", None)
    proc = subprocess.Popen([sys.executable, "-m", "torchplace", *args], stdin=slave, stdout=slave, stderr=slave,
                            env=full, close_fds=True)
    os.close(slave)
    chunks: list[bytes] = []
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 0.2)
            if ready:
                try:
                    data = os.read(master, 65536)
                except OSError:  # the child closed its side (EIO on Linux)
                    break
                if not data:
                    break
                chunks.append(data)
            elif proc.poll() is not None:
                break
        else:
            proc.kill()
        code = proc.wait(timeout=120)
    finally:
        os.close(master)
    return TerminalRun(code, b"".join(chunks).decode("utf-8", "replace"))
