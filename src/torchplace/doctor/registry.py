"""The doctor's check registry and its Finding record (`diagnose` loads the check modules and runs them).

A check is `def check_x(facts) -> list[Finding]` decorated with `@check`. It reads facts only,
never raises (the runner turns an exception into an 'internal' finding), and starts no CUDA.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

SEVERITIES = ("error", "warning", "info")

@dataclass(frozen=True)
class Finding:
    """One problem (or fact worth knowing): what is wrong, and how to fix it."""

    id: str
    severity: str  # "error" | "warning" | "info"
    title: str
    detail: str
    fix: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


Check = Callable[[Any], list[Finding]]
CHECKS: list[Check] = []


def check(fn: Check) -> Check:
    """Register a doctor check."""
    CHECKS.append(fn)
    return fn
