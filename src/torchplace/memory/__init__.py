"""Memory: per-device report, leak detector, OOM diagnosis, largest batch that fits.

- `usage.py`: `memory_report(device)`: allocated/reserved/free/total and the largest live tensors.
- `leaks.py`: `track_memory(...)`: growth across steps and the tensors that keep graphs alive.
- `oom.py`: `diagnose_oom()` and `find_batch_size(fn, start)`.
"""

from __future__ import annotations

from .leaks import LeakReport, MemoryLeakError, MemoryLeakWarning, MemoryTracker, track_memory
from .oom import OomReport, OutOfMemoryDiagnosis, diagnose_oom, find_batch_size, is_oom
from .usage import DeviceMemory, LiveTensor, MemoryReport, memory_report

TensorInfo = LiveTensor  # the name before issue 19 (checkpoint.TensorInfo is a saved tensor)

__all__ = ["DeviceMemory", "LeakReport", "LiveTensor", "MemoryLeakError", "MemoryLeakWarning", "MemoryReport",
           "MemoryTracker", "OomReport", "OutOfMemoryDiagnosis", "diagnose_oom",
           "find_batch_size", "is_oom", "memory_report", "track_memory"]
