"""The doctor's check registry and its Finding record.

A check is `def check_x(facts) -> list[Finding]` decorated with `@check`. It reads facts only,
never raises (the runner turns an exception into an 'internal' finding), and starts no CUDA.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

SEVERITIES = ("error", "warning", "info")

# modules whose import registers checks
CHECK_MODULES = (
    "torchplace.doctor.checks_gpu",
    "torchplace.doctor.checks_host",
    "torchplace.doctor.checks_container",
    "torchplace.doctor.checks_launch",
    "torchplace.doctor.checks_policy",
)


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


def load_checks() -> list[Check]:
    for module in CHECK_MODULES:
        importlib.import_module(module)
    return CHECKS


def run_checks(facts: Any) -> list[Finding]:
    """Every registered check over `facts`, errors first. A crashing check becomes a finding."""
    findings: list[Finding] = []
    for fn in load_checks():
        try:
            findings.extend(fn(facts))
        except Exception as exc:  # a check must never take doctor down
            findings.append(Finding(f"internal.{fn.__name__}", "warning", f"check {fn.__name__} failed",
                                    f"{type(exc).__name__}: {exc}", "Report this as a torchplace bug."))
    return sorted(findings, key=lambda f: SEVERITIES.index(f.severity))
