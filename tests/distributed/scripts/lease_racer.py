"""One of many concurrent pickers: pick and lease one GPU from a snapshot, hold it briefly, log.

argv: SNAPSHOT LOG HOLD_SECONDS. Appends "ACQ uuid pid t" and "REL uuid pid t" lines
(t = CLOCK_MONOTONIC, comparable across processes) with single O_APPEND writes.
"""

import os
import sys
import time

from torchplace.distributed.pick import pick

snapshot, log, hold = sys.argv[1], sys.argv[2], float(sys.argv[3])
fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
picked = pick(1, snapshot=snapshot, wait=90, on_wait=lambda text: None)
uuid = picked.uuids[0]
os.write(fd, f"ACQ {uuid} {os.getpid()} {time.monotonic():.6f}\n".encode())
time.sleep(hold)
os.write(fd, f"REL {uuid} {os.getpid()} {time.monotonic():.6f}\n".encode())
picked.release()
