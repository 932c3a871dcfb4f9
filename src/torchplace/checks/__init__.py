"""Catching device mistakes: strict mode, watch, explain.

`strict(...)` (strict.py) reports placement that depends on the current device (implicit_device.py),
leaked device changes (device_leaks.py), autocast on the wrong device type (autocast.py), syncs in a
hot loop, and names the culprit of a device mismatch (mismatch.py); `watch(model)` (watch.py) only
names mismatches; `explain(model, *inputs)` (explain.py) shows where everything lives and what looks
wrong. None of them runs a Python mode on every op: see each module's docstring for what it costs.

The face other packages use: amp's first-step check of a precision policy's autocast.
"""

from __future__ import annotations

from ..errors import StrictWarning
from .autocast import AutocastCheck, FirstStepCheck, report_first_step

__all__ = ["AutocastCheck", "FirstStepCheck", "StrictWarning", "report_first_step"]
