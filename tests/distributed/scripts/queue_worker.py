"""One job in the GPU queue: wait for 1 GPU (whole, or a memory reservation) from a snapshot, hold it, log.

argv: SNAPSHOT LOG HOLD_SECONDS WAIT_SECONDS MEMORY|whole TAG. Appends single O_APPEND lines
"ACQ tag uid pid bytes t", "REL tag uid pid bytes t" (bytes 0: whole) or "REFUSED tag uid pid t"
(t = CLOCK_MONOTONIC, comparable across processes).
"""

import os
import sys
import time

from torchplace.distributed.pick import pick
from torchplace.errors import LeaseError

snapshot, log, hold, wait, memory, tag = sys.argv[1:7]
fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
me = f"{tag} {os.getuid()} {os.getpid()}"
try:
    picked = pick(1, snapshot=snapshot, wait=float(wait), memory=None if memory == "whole" else memory,
                  on_wait=lambda text: None)
except LeaseError as exc:
    print(exc, file=sys.stderr)
    os.write(fd, f"REFUSED {me} {time.monotonic():.6f}\n".encode())
    sys.exit(3)
nbytes = picked.memory_bytes or 0
os.write(fd, f"ACQ {me} {nbytes} {time.monotonic():.6f}\n".encode())
time.sleep(float(hold))
os.write(fd, f"REL {me} {nbytes} {time.monotonic():.6f}\n".encode())
picked.release()
