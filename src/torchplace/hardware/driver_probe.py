"""Ask the CUDA driver itself which devices it enumerates, in a spawned child process.

The parent never loads CUDA: the child calls libcuda through ctypes (cuInit, cuDeviceGetCount,
cuDeviceGetUuid_v2, cuDeviceGetPCIBusId) under the environment given, prints JSON, and exits.
Used to cross-check torchplace's reading of CUDA_VISIBLE_DEVICES against the driver.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass

_CHILD = r"""
import ctypes, json, sys
out = {"ok": False}
try:
    cuda = ctypes.CDLL("libcuda.so.1")
except OSError as exc:
    print(json.dumps({"ok": False, "error": "libcuda.so.1 not loadable: %s" % exc})); sys.exit(0)
rc = cuda.cuInit(0)
if rc != 0:
    # 100 = CUDA_ERROR_NO_DEVICE: the visible list is empty, which is an answer, not a failure
    print(json.dumps({"ok": rc == 100, "error": None if rc == 100 else "cuInit returned %d" % rc,
                      "devices": []})); sys.exit(0)
count = ctypes.c_int()
cuda.cuDeviceGetCount(ctypes.byref(count))
devices = []
for i in range(count.value):
    dev = ctypes.c_int()
    cuda.cuDeviceGet(ctypes.byref(dev), i)
    raw = (ctypes.c_ubyte * 16)()
    getter = getattr(cuda, "cuDeviceGetUuid_v2", None) or cuda.cuDeviceGetUuid
    getter(raw, dev)
    h = bytes(raw).hex()
    uuid = "GPU-%s-%s-%s-%s-%s" % (h[:8], h[8:12], h[12:16], h[16:20], h[20:])
    bus = ctypes.create_string_buffer(64)
    cuda.cuDeviceGetPCIBusId(bus, 64, dev)
    devices.append({"ordinal": i, "uuid": uuid, "pci_bus_id": bus.value.decode()})
print(json.dumps({"ok": True, "devices": devices}))
"""


@dataclass(frozen=True)
class DriverView:
    """What the driver enumerated: UUIDs in CUDA ordinal order, or the error that stopped it."""

    uuids: list[str] | None
    pci_bus_ids: list[str] | None
    error: str | None = None


def probe_driver(env: Mapping[str, str] | None = None, timeout: float = 60.0) -> DriverView:
    """Run the driver probe in a child process with `env` overlaid on this environment.

    A key mapped to None-like absence is not possible in a Mapping[str, str]; pass
    `unset=` semantics by leaving the key out of a copied os.environ instead.
    """
    child_env = dict(os.environ if env is None else env)
    try:
        done = subprocess.run([sys.executable, "-I", "-c", _CHILD], env=child_env, capture_output=True,
                              text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return DriverView(None, None, f"the driver probe did not answer within {timeout:.0f} s")
    try:
        data = json.loads(done.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        return DriverView(None, None, f"the driver probe failed: {done.stderr.strip()[-300:]}")
    if not data.get("ok"):
        return DriverView(None, None, data.get("error") or "unknown driver error")
    devices = data.get("devices", [])
    return DriverView([d["uuid"] for d in devices], [d["pci_bus_id"] for d in devices])
