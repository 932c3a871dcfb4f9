"""Argument types for the `torchplace` command: each refuses a bad value at parse time, saying why.

argparse turns an ArgumentTypeError into one usage line naming the option, so `pick --count ²`
says "argument --count: '²' is not a whole number ..." instead of failing deep inside. Numbers are
ASCII only: Python's int() and str.isdigit() accept '²', '١' and '１', which no launcher, driver
or torch.device does.
"""

from __future__ import annotations

import argparse
import math
import re
import unicodedata
from collections.abc import Callable

_ASCII_INT = re.compile(r"[0-9]+")
_ASCII_FLOAT = re.compile(r"(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")
C_INT_MAX = 2**31 - 1
_BYTES_MAX = 2**60  # 1 EiB: more than any machine's memory or disk
_SECONDS_MAX = 10 * 365 * 86400.0


def _fail(text: str, why: str) -> argparse.ArgumentTypeError:
    return argparse.ArgumentTypeError(f"{_shown(text)} {why}")


def _shown(text: str) -> str:
    return repr(text) if len(text) <= 40 else f"{text[:30]!r}... ({len(text)} characters)"


def _ascii_hint(text: str) -> str:
    """' (write 2)' when `text` uses non-ASCII digits that have an ASCII spelling."""
    if text.isascii() or not any(ch.isnumeric() for ch in text):
        return ""
    fixed = "".join(str(unicodedata.digit(ch)) if not ch.isascii() and unicodedata.digit(ch, None) is not None
                    else ch for ch in text)
    return f" (only ASCII digits count: write {fixed!r})"


def whole_number(minimum: int = 0, maximum: int = C_INT_MAX) -> Callable[[str], int]:
    """An ASCII whole number in [minimum, maximum]."""

    def parse(text: str) -> int:
        raw = text.strip()
        if raw.startswith("-") and _ASCII_INT.fullmatch(raw[1:]):
            raise _fail(text, f"is negative; write a whole number from {minimum} to {maximum}.")
        if not _ASCII_INT.fullmatch(raw):
            raise _fail(text, f"is not a whole number{_ascii_hint(raw)}; write e.g. {max(minimum, 1)}.")
        if len(raw) > 12 or int(raw) > maximum:
            raise _fail(text, f"is too large (at most {maximum}).")
        if int(raw) < minimum:
            raise _fail(text, f"is too small (at least {minimum}).")
        return int(raw)

    parse.__name__ = "whole number"
    return parse


def number(minimum: float = 0.0, *, above: bool = False) -> Callable[[str], float]:
    """An ASCII decimal number, finite, at least `minimum` (or above it)."""

    def parse(text: str) -> float:
        raw = text.strip()
        if not _ASCII_FLOAT.fullmatch(raw):
            raise _fail(text, f"is not a number{_ascii_hint(raw)}; write e.g. 2.5.")
        value = float(raw)
        if not math.isfinite(value) or value > 1e15:
            raise _fail(text, "is too large.")
        if value < minimum or (above and value == minimum):
            raise _fail(text, f"must be {'above' if above else 'at least'} {minimum:g}.")
        return value

    parse.__name__ = "number"
    return parse


def count_or_auto(text: str) -> int | str:
    """`pick --count`: a whole number >= 1, or 'auto'."""
    if text.strip().lower() == "auto":
        return "auto"
    try:
        return whole_number(1, 4096)(text)
    except argparse.ArgumentTypeError as exc:
        said = str(exc).replace("; write e.g. 1.", "").replace("; write a whole number from 1 to 4096.", "")
        raise argparse.ArgumentTypeError(f"{said.rstrip('.')}: give a number of GPUs (1 or more) or 'auto'.") from None


def percent(text: str) -> int:
    """`--max-utilization`: a whole number 0..100, with or without a trailing '%'."""
    raw = text.strip()
    try:
        return whole_number(0, 100)(raw[:-1] if raw.endswith("%") else raw)
    except argparse.ArgumentTypeError as exc:
        raise argparse.ArgumentTypeError(str(exc).replace("write e.g. 1.", "write a percentage, e.g. 80.")) from None


def size(text: str) -> int:
    """Bytes from '20GiB', '500MB', '1.5G' or a bare number of bytes (units.parse_size), at most 1 EiB."""
    from ..units import parse_size

    try:
        value = parse_size(text)
    except (ValueError, OverflowError) as exc:
        raise argparse.ArgumentTypeError(f"{str(exc).rstrip('.')}{_ascii_hint(text)}") from None
    if value > _BYTES_MAX:
        raise _fail(text, "is more memory than any machine has (at most 1 EiB).")
    return value


def duration(text: str) -> float:
    """Seconds from '90', '30s', '10m', '1h' (units.parse_duration), at most 10 years."""
    from ..units import parse_duration

    try:
        value = parse_duration(text)
    except (ValueError, OverflowError) as exc:
        raise argparse.ArgumentTypeError(f"{str(exc).rstrip('.')}{_ascii_hint(text)}") from None
    if not math.isfinite(value) or value > _SECONDS_MAX:
        raise _fail(text, "is too long (at most 10 years); write e.g. 10m or 2h.")
    return value


def gpus(text: str) -> str:
    """`run --gpus`: checked now by the same parser `torchplace run` uses, kept as text."""
    from ..distributed.run import GpuRequest
    from ..errors import TorchplaceError

    try:
        GpuRequest.parse(text)
    except TorchplaceError as exc:
        raise argparse.ArgumentTypeError(f"{str(exc).rstrip('.')}{_ascii_hint(text)}") from None
    return text


def port(text: str) -> str:
    """A TCP port 1..65535, kept as text for torchrun."""
    return str(whole_number(1, 65535)(text))


def whole_number_text(text: str) -> str:
    """A whole number >= 0, kept as text for torchrun."""
    return str(whole_number(0)(text))


class UsageError(Exception):
    """A command line that cannot work: `main` prints it as one line and exits 2."""


def path(text: str) -> str:
    """A file or folder name: not empty, no NUL byte (no system call takes one)."""
    if text == "":
        raise argparse.ArgumentTypeError("an empty path names no file; give a file or folder name.")
    if "\x00" in text:
        raise _fail(text, "contains a NUL byte, which no file name can.")
    return text


def out_dir(text: str) -> str:
    """A folder to write results into: it, or its nearest existing parent, must be a folder."""
    import os

    path(text)
    probe = os.path.abspath(text)
    while not os.path.lexists(probe) and os.path.dirname(probe) != probe:
        probe = os.path.dirname(probe)
    if os.path.lexists(probe) and not os.path.isdir(probe):
        where = "is" if probe == os.path.abspath(text) else f"is inside {probe!r}, which is"
        raise _fail(text, f"{where} not a folder; give a folder to write results into.")
    return text


def shape(text: str) -> str:
    """A tensor shape such as '256x64': positive ASCII whole numbers joined by 'x', at most 2**31 elements.

    Checked here, kept as text for the benchmark."""
    parts = text.strip().lower().split("x")
    if not text.strip() or not all(_ASCII_INT.fullmatch(p) for p in parts):
        raise _fail(text, f"is not a shape{_ascii_hint(text)}; write sizes joined by x, e.g. 256x64.")
    dims = tuple(int(p) if len(p) <= 12 else 2**62 for p in parts)
    if any(d < 1 for d in dims):
        raise _fail(text, "has a zero size; every size must be at least 1.")
    if math.prod(dims) > 2**31:
        raise _fail(text, f"has {math.prod(dims):.3g} elements; at most 2**31 fit in a benchmark tensor.")
    return text


def sizes(text: str) -> str:
    """Comma-separated sizes for `bench checkpoint --sizes` (bench.checkpoint.parse_sizes), each 1 byte..1 EiB.

    Checked here, kept as text for the benchmark."""
    from ..bench.checkpoint import parse_sizes

    try:
        values = parse_sizes(text)
    except (ValueError, OverflowError) as exc:
        raise argparse.ArgumentTypeError(f"{str(exc).rstrip('.')}{_ascii_hint(text)}") from None
    if (not values and text.strip() != "none") or any(v < 1 for v in values):  # 'none': layouts only
        raise _fail(text, "has a size of zero; write e.g. 1GiB,10GiB.")
    if any(v > _BYTES_MAX for v in values):
        raise _fail(text, "has a size over 1 EiB; write e.g. 1GiB,10GiB.")
    return text


def command(argv: list[str]) -> list[str]:
    """The command after `--` for `run`: present, with a non-empty program and no NUL byte."""
    cmd = argv[1:] if argv[:1] == ["--"] else list(argv)
    if not cmd:
        raise argparse.ArgumentTypeError("no command to run; put it after --, e.g. "
                                         "`torchplace run --gpus 2 -- python train.py`.")
    if not cmd[0].strip():
        raise argparse.ArgumentTypeError(f"the program to run is {cmd[0]!r}, an empty name; put the command "
                                         "after --, e.g. `-- python train.py`.")
    bad = next((a for a in cmd if "\x00" in a), None)
    if bad is not None:
        raise argparse.ArgumentTypeError(f"the argument {_shown(bad)} contains a NUL byte, which no program "
                                         "can receive; remove it.")
    return cmd
