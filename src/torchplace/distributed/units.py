"""Parse the human units the CLI and API accept: sizes ("20GiB") and durations ("10m")."""

from __future__ import annotations

import re

_SIZE_UNITS = {
    "": 1, "b": 1,
    "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_DURATION_UNITS = {"": 1.0, "s": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0}
_NUMBER_UNIT = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str | int) -> int:
    """Bytes from ``"20GiB"``, ``"500MB"``, ``"1.5G"`` or a plain number of bytes.

    G/GB are powers of ten and GiB powers of two, as the units say.
    """
    if isinstance(text, int):
        return text
    m = _NUMBER_UNIT.match(text)
    unit = m.group(2).lower() if m else None
    if not m or unit not in _SIZE_UNITS:
        raise ValueError(f"size {text!r} is not understood; write a number with an optional unit, "
                         f"e.g. 20GiB, 500MiB, 40GB (units: {', '.join(k for k in _SIZE_UNITS if k)}).")
    return int(float(m.group(1)) * _SIZE_UNITS[unit])


def parse_duration(text: str | float) -> float:
    """Seconds from ``"10m"``, ``"30s"``, ``"1.5h"`` or a plain number of seconds."""
    if isinstance(text, (int, float)):
        return float(text)
    m = _NUMBER_UNIT.match(text)
    unit = m.group(2).lower() if m else None
    if not m or unit not in _DURATION_UNITS:
        raise ValueError(f"duration {text!r} is not understood; write seconds or a number with "
                         "s, m or h, e.g. 90, 30s, 10m, 1h.")
    return float(m.group(1)) * _DURATION_UNITS[unit]


def format_bytes(n: int | None) -> str:
    """``n`` bytes as GiB with one decimal ("?" when unknown)."""
    return "?" if n is None else f"{n / 2**30:.1f} GiB"
