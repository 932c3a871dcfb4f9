"""Catching device mistakes: strict mode, watch, explain.

`strict(...)` (strict.py) reports placement that depends on the current device, leaked device
changes, autocast on the wrong device type, syncs in a hot loop, and names the culprit of a
device mismatch; `watch(model)` (watch.py) only names mismatches; `explain(model, *inputs)`
(explain.py) shows where everything lives and what looks wrong. None of them runs a Python
mode on every op: see each module's docstring for what it costs.
"""

from __future__ import annotations

from ..errors import StrictWarning

__all__ = ["StrictWarning"]
