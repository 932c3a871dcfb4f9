"""The user's frame: the first frame outside torch and torchplace, where a report points.

Strict's checks, `guard` and the memory tracker all name the user's line that did something; they
find it with `outside`, skipping the frames of torch, of torchplace (but its corpus of user
programs, which `bench diagnose` runs as the user's), and of whatever else they pass in SKIP.
"""

from __future__ import annotations

import os
import sys
import sysconfig
from collections.abc import Iterator
from types import FrameType

import torch

TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # torchplace's own code
STDLIB_DIR = sysconfig.get_paths()["stdlib"] + os.sep
SITE_DIRS = tuple(p + os.sep for p in {sysconfig.get_paths()[k] for k in ("purelib", "platlib")})
# bench diagnose's corpus: programs written as users write them, shipped in the package to be read as theirs
SPECIMENS = os.path.join(PACKAGE_DIR, "bench", "_corpus") + os.sep
LIBRARY = (TORCH_DIR, PACKAGE_DIR)


def is_user(filename: str) -> bool:
    """The user's code: neither torch nor any part of torchplace (but its corpus of user programs)."""
    return filename.startswith(SPECIMENS) or not filename.startswith(LIBRARY)


def is_installed(filename: str) -> bool:
    """An installed package's code (site-packages), not the user's: the corpus of user programs excepted."""
    return filename.startswith(SITE_DIRS) and not filename.startswith(SPECIMENS)


def outside(frame: FrameType | None, skip: tuple[str, ...] = LIBRARY) -> Iterator[FrameType]:
    """FRAME and its callers, innermost first, without those whose file lies under a folder of SKIP
    (default: torch and torchplace); the corpus of user programs is never skipped."""
    while frame is not None:
        filename = frame.f_code.co_filename
        if filename.startswith(SPECIMENS) or not filename.startswith(skip):
            yield frame
        frame = frame.f_back


def user_frame(frame: FrameType | None = None, skip: tuple[str, ...] = LIBRARY) -> FrameType | None:
    """The first frame outside SKIP (torch and torchplace) from FRAME (default: the caller's) outwards."""
    return next(outside(frame if frame is not None else sys._getframe(1), skip), None)


def site(frame: FrameType | None) -> str:
    """'file:line in function' of FRAME, as a report names a place."""
    if frame is None:
        return "unknown location"
    return f"{frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}"
