"""Doctor's report: facts + findings as one dict (which is also a valid snapshot), and its exit code."""

from __future__ import annotations

import importlib
import time
from dataclasses import dataclass, field
from typing import Any

from ..hardware.driver_probe import probe_driver
from ..hardware.facts import Facts, read_facts
from .registry import CHECKS, SEVERITIES, Check, Finding

# modules whose import registers checks
CHECK_MODULES = (
    "torchplace.doctor.checks_gpu",
    "torchplace.doctor.checks_host",
    "torchplace.doctor.checks_container",
    "torchplace.doctor.checks_launch",
    "torchplace.doctor.checks_policy",
)


def load_checks() -> list[Check]:
    """Import every check module (each registers its checks with `@check`) and return the registered checks."""
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


@dataclass
class Report:
    facts: Facts
    findings: list[Finding] = field(default_factory=list)
    elapsed_s: float = 0.0

    @property
    def exit_code(self) -> int:
        return 1 if any(f.severity == "error" for f in self.findings) else 0

    def to_dict(self) -> dict[str, Any]:
        return {**self.facts.to_dict(), "visible": self.facts.visible.to_dict(),
                "findings": [f.to_dict() for f in self.findings], "exit_code": self.exit_code,
                "elapsed_s": round(self.elapsed_s, 3)}


def driver_check(facts: Facts) -> list[Finding]:
    """Ask the driver (in a child process) what it enumerates and compare with our mapping."""
    import os

    env = dict(os.environ)
    for key in ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER"):
        if key in facts.env:
            env[key] = facts.env[key]
    view = probe_driver(env)
    ours = [d.mig_uuid or d.uuid for d in facts.visible.visible]
    if view.uuids is None and facts.visible.duplicates and "returned 101" in (view.error or ""):
        return [Finding("driver.agrees", "info", "The driver refuses this CUDA_VISIBLE_DEVICES, as torchplace predicts",
                        f"cuInit failed with error 101 (invalid device) because of the repeated entries "
                        f"{facts.visible.duplicates}.")]
    if view.uuids is None:
        return [Finding("driver.probe_failed", "info", "The driver cross-check could not run", view.error or "",
                        "Run on the GPU machine itself, with the NVIDIA driver installed.")]
    if view.uuids == ours:
        return [Finding("driver.agrees", "info", "The driver enumerates exactly what torchplace maps",
                        f"{len(ours)} device(s), same order.")]
    return [Finding("driver.disagrees", "error", "The driver's device list differs from torchplace's mapping",
                    f"driver: {view.uuids}; torchplace: {ours}.",
                    "Please report this with `torchplace doctor --json` attached; trust the driver meanwhile.")]


def diagnose(snapshot: str | None = None, check_driver: bool = False) -> Report:
    """Read facts (live or from a snapshot) and run every check."""
    start = time.perf_counter()
    facts = read_facts(snapshot)
    findings = run_checks(facts)
    if check_driver and snapshot is None:
        findings = sorted(findings + driver_check(facts), key=lambda f: ("error", "warning", "info").index(f.severity))
    return Report(facts, findings, time.perf_counter() - start)
