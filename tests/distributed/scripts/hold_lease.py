"""Lease one GPU UUID (argv[1]) in $TORCHPLACE_LEASE_DIR, say so on stdout, then sleep until killed."""

import sys
import time

from torchplace.distributed.leases import LeaseDir

lease = LeaseDir().try_acquire(sys.argv[1], command="hold_lease.py test holder")
print("HELD" if lease else "BUSY", flush=True)
if lease:
    time.sleep(3600)
