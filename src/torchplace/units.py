"""Bytes and durations: the one place that parses and formats them.

A bare number is bytes for a size and seconds for a duration. A caller that means another unit
for a bare number says so (`parse_size("2", bare="GiB")`) and documents it where the user reads
it, as `bench checkpoint --sizes` does. G/GB are powers of ten and GiB powers of two, as the
units say. Durations are printed inline as seconds ("30 s"), so only sizes have a formatter.
"""

from __future__ import annotations

import re

SIZE_UNITS = {
    "b": 1,
    "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
DURATION_UNITS = {"s": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0}
_BINARY = (("B", 1), ("KiB", 2**10), ("MiB", 2**20), ("GiB", 2**30), ("TiB", 2**40))
_NUMBER_UNIT = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")  # 1.5GiB, 1e3MB


def _refuse_negative(text: str, what: str, example: str) -> None:
    if text.strip().startswith("-") and _NUMBER_UNIT.match(text.strip()[1:]):
        raise ValueError(f"{what} {text!r} is negative; a {what} is 0 or more, e.g. {example}.")


def _number(value: float, what: str, example: str, limit: float) -> float:
    """VALUE given as a number: finite (a duration may be infinite: wait for ever), 0 or more, at most LIMIT."""
    if value != value or value < 0:  # NaN compares false with everything: it would wait, or reserve, nothing known
        raise ValueError(f"{what} {value!r} is {'not a number' if value != value else 'negative'}; "
                         f"a {what} is 0 or more, e.g. {example}.")
    if value > limit or (value == float("inf") and limit != float("inf")):
        raise ValueError(f"{what} {value!r} is larger than any memory or disk; write e.g. {example}.")
    return value


def parse_size(text: str | float, *, bare: str = "B") -> int:
    """Bytes from ``"20GiB"``, ``"500MB"``, ``"1.5G"``, ``"1e3MB"``, or a bare number in the unit `bare` (bytes).

    >>> parse_size("20GiB"), parse_size("4096"), parse_size("2", bare="GiB"), parse_size("1e3MB")
    (21474836480, 4096, 2147483648, 1000000000)
    """
    if isinstance(text, (int, float)) and not isinstance(text, bool):  # bytes given as a number (20e9)
        _number(text, "size", "20GiB", 2.0**80)
        return text if isinstance(text, int) else int(text)
    if not isinstance(text, str):
        raise ValueError(f"size {text!r} is a {type(text).__name__}; write a number of bytes or a size such as 20GiB.")
    _refuse_negative(text, "size", "20GiB")
    m = _NUMBER_UNIT.match(text)
    unit = (m.group(2) or bare).lower() if m else None
    if not m or unit not in SIZE_UNITS:
        meaning = "bytes" if bare.lower() == "b" else bare
        raise ValueError(f"size {text!r} is not understood; write a number with an optional unit, "
                         f"e.g. 20GiB, 500MiB, 40GB; a bare number is {meaning} "
                         f"(units: {', '.join(SIZE_UNITS)}).")
    value = float(m.group(1)) * SIZE_UNITS[unit]
    if value > 2**80:  # 1e400GB is infinite: no int; no memory or disk is within a million times of it
        raise ValueError(f"size {text!r} is larger than any memory or disk; write e.g. 20GiB.")
    return int(value)


def parse_duration(text: str | float) -> float:
    """Seconds from ``"10m"``, ``"30s"``, ``"1.5h"`` or a bare number of seconds.

    >>> parse_duration("10m"), parse_duration("90")
    (600.0, 90.0)
    """
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        return _number(text, "duration", "10m", float("inf"))
    if not isinstance(text, str):
        raise ValueError(f"duration {text!r} is a {type(text).__name__}; write seconds or a duration such as 10m.")
    _refuse_negative(text, "duration", "10m")
    m = _NUMBER_UNIT.match(text)
    unit = (m.group(2) or "s").lower() if m else None
    if not m or unit not in DURATION_UNITS:
        raise ValueError(f"duration {text!r} is not understood; write seconds or a number with "
                         "s, m or h, e.g. 90, 30s, 10m, 1h.")
    value = float(m.group(1)) * DURATION_UNITS[unit]
    if value == float("inf"):
        raise ValueError(f"duration {text!r} is infinite; write seconds or a number with s, m or h, e.g. 10m.")
    return value


def format_bytes(n: int | float | None, unit: str | None = None, digits: int = 1) -> str:
    """`n` bytes for people: in the largest binary unit below it ("1.5 GiB", "512 B"), or in `unit`.

    None (unknown) is "?". A fixed unit keeps a column of numbers comparable ("0.5 GiB").

    >>> format_bytes(3 * 2**29), format_bytes(512), format_bytes(2**29, "GiB"), format_bytes(None)
    ('1.5 GiB', '512 B', '0.5 GiB', '?')
    """
    if n is None:
        return "?"
    if unit is None:
        unit, scale = next(((u, s) for u, s in reversed(_BINARY) if abs(n) >= s), _BINARY[0])
    else:
        scale = dict(_BINARY)[unit]
    if scale == 1:
        return f"{n:.0f} B"
    return f"{n / scale:.{digits}f} {unit}"


def size_label(n: int) -> str:
    """A short label that `parse_size` reads back: "1GiB", "512MiB" (for file and row names)."""
    return f"{n / 2**30:g}GiB" if n >= 2**30 else f"{n / 2**20:g}MiB"
