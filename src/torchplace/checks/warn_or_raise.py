"""How a strict check speaks: a warning pointing at the user's line, or an error."""

from __future__ import annotations

import warnings
from types import FrameType

from ..errors import StrictWarning


def warn_or_raise(action: str, message: str, error: type[Exception], frame: FrameType | None = None,
           lineno: int | None = None, category: type[Warning] = StrictWarning) -> None:
    """Raise `error(message)` when action is "error", else warn as if from `frame`'s line."""
    if action == "error":
        raise error(message)
    if frame is None:
        warnings.warn(message, category, stacklevel=3)
        return
    registry = frame.f_globals.setdefault("__warningregistry__", {})
    warnings.warn_explicit(message, category, frame.f_code.co_filename, lineno or frame.f_lineno,
                           module=frame.f_globals.get("__name__"), registry=registry)
