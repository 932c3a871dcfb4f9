"""Reproducible runs: seed every generator, and switch every back end to deterministic kernels.

`seed_everything(seed)` seeds Python's `random`, NumPy's global generator (when installed) and
torch, whose `manual_seed` also seeds every CUDA device (and other accelerators) lazily.
DataLoader workers need nothing more: torch seeds `random`, NumPy and torch in each worker from
the loader's base seed plus the worker id. What does break reproducibility is that the base seed
is drawn from the global torch generator, so any extra random draw shifts it: `loader_kwargs()`
gives a loader its own generator so its shuffling and workers depend on the seed alone.

`deterministic(True)` sets what each back end needs: `torch.use_deterministic_algorithms`,
cuDNN's deterministic flag with autotuning off (benchmark mode picks kernels by timing), and
CUBLAS_WORKSPACE_CONFIG=:4096:8, which cuBLAS needs to be deterministic on CUDA 10.2 and later.
Like `torch.set_grad_enabled`, it applies at once and, used in `with`, restores on exit; inside
the block it names the ops that have no deterministic implementation.
"""

from __future__ import annotations

import os
import random
import re
import sys
import warnings
from dataclasses import dataclass, field
from types import TracebackType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

CUBLAS_ENV = "CUBLAS_WORKSPACE_CONFIG"
CUBLAS_DETERMINISTIC = ":4096:8"
_NONDETERMINISTIC = re.compile(r"^(.*?) does not have a deterministic implementation")


@dataclass
class SeedState:
    """What `seed_everything` seeded, and what it could not make reproducible."""

    seed: int
    seeded: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def generator(self) -> torch.Generator:
        """A fresh CPU generator seeded with this seed (for a DataLoader, a sampler, a split)."""
        import torch

        return torch.Generator().manual_seed(self.seed)

    def loader_kwargs(self) -> dict[str, Any]:
        """Keyword arguments that make a DataLoader's order and worker seeds depend on the seed only."""
        return {"generator": self.generator()}


def seed_everything(seed: int) -> SeedState:
    """Seed Python, NumPy (if installed) and torch on the CPU and every device with SEED.

    CUDA is not started by seeding: torch seeds each GPU when it is first used.

    Args:
        seed: an int in [0, 2**32).

    Returns:
        A `SeedState`: `seeded` (what was seeded), `notes` (what still is not reproducible), and
        `loader_kwargs()` / `generator()` for a DataLoader whose order depends on the seed only.

    Raises:
        ValueError: SEED is not an int in [0, 2**32).

    Example:
        ```python
        import torch
        import torchplace as tp
        from torch.utils.data import DataLoader

        state = tp.seed_everything(0)
        loader = DataLoader(list(range(8)), batch_size=4, shuffle=True, **state.loader_kwargs())
        print(state.seeded, next(iter(loader)))
        ```
    """
    import torch

    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**32:
        raise ValueError(f"seed={seed!r} must be an int in [0, 2**32) (NumPy's limit). Fix: pass e.g. seed=0.")
    state = SeedState(seed)
    random.seed(seed)
    state.seeded.append("python random")
    try:
        import numpy as np
    except ImportError:
        state.notes.append("NumPy is not installed; nothing to seed there")
    else:
        np.random.seed(seed)
        state.seeded.append("numpy global generator")
    torch.manual_seed(seed)  # also seeds every CUDA device (lazily when CUDA is not started) and accelerators
    state.seeded.append("torch (CPU and every device)")
    if sys.flags.hash_randomization and not os.environ.get("PYTHONHASHSEED"):
        state.notes.append("str hashing is randomized per process (PYTHONHASHSEED is unset), so iteration "
                           "order over sets of strings differs between runs; set PYTHONHASHSEED=0 before "
                           "Python starts if your code depends on it")
    return state


@dataclass
class Determinism:
    """The deterministic settings in force; also a context manager that restores the previous ones.

    `settings` says what was set; `nondeterministic_ops` lists the ops without a deterministic
    implementation that ran inside the `with` block (under warn_only) or failed there.
    """

    enabled: bool
    warn_only: bool
    settings: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    nondeterministic_ops: list[str] = field(default_factory=list)
    _previous: dict[str, Any] = field(default_factory=dict, repr=False)
    _catcher: Any = field(default=None, repr=False)
    _log: list[Any] | None = field(default=None, repr=False)

    def __enter__(self) -> Determinism:
        if self.enabled and self.warn_only:
            self._catcher = warnings.catch_warnings(record=True)
            self._log = self._catcher.__enter__()
            warnings.simplefilter("always")
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._catcher is not None:
            self._catcher.__exit__(None, None, None)
            self._replay(self._log or [])
            self._catcher = self._log = None
        if isinstance(exc, RuntimeError):
            match = _NONDETERMINISTIC.match(str(exc))
            if match and hasattr(exc, "add_note"):
                self.nondeterministic_ops.append(match.group(1))
                exc.add_note(f"torchplace: {match.group(1)} has no deterministic implementation on this back end. "
                             "Fix: use a deterministic alternative (e.g. index_put_/scatter with accumulate, "
                             "or another layer; the docstring of torch.use_deterministic_algorithms lists "
                             "every such op), or deterministic(True, warn_only=True) to run it with a warning "
                             "and collect every such op.")
        _restore(self._previous)

    def _replay(self, log: list[Any]) -> None:
        """Re-emit the warnings caught in the block; summarize the non-determinism ones."""
        for item in log:
            match = _NONDETERMINISTIC.match(str(item.message))
            if match:
                if match.group(1) not in self.nondeterministic_ops:
                    self.nondeterministic_ops.append(match.group(1))
                continue
            warnings.warn_explicit(item.message, item.category, item.filename, item.lineno)
        if self.nondeterministic_ops:
            warnings.warn(f"These ops ran without a deterministic implementation, so results may differ "
                          f"between runs: {', '.join(self.nondeterministic_ops)}. Fix: replace them with "
                          "deterministic alternatives, or accept the variation.", UserWarning, stacklevel=3)


def deterministic(enabled: bool = True, *, warn_only: bool = False) -> Determinism:
    """Switch torch, cuDNN and cuBLAS to deterministic behaviour (or back).

    Sets `torch.use_deterministic_algorithms`, cuDNN's deterministic and benchmark flags and
    `CUBLAS_WORKSPACE_CONFIG`. Called plainly, the settings stay; used as a context manager, the
    previous ones come back on exit.

    Args:
        enabled: True to make runs repeatable, False to restore torch's defaults.
        warn_only: run ops that have no deterministic implementation anyway, and list them
            (`nondeterministic_ops`) with one warning at the end of the block.

    Returns:
        A `Determinism`: `settings` made, `notes`, `nondeterministic_ops` found in the block.

    Raises:
        RuntimeError: (torch's) inside the block, an op with no deterministic implementation ran
            without `warn_only`; torchplace adds a note naming the op and the fix.

    Example:
        ```python
        import torch
        import torchplace as tp

        with tp.deterministic(warn_only=True) as det:
            torch.randn(8, 8) @ torch.randn(8, 8)
        print(det.settings, det.nondeterministic_ops)
        ```
    """
    import torch

    previous = {"algorithms": torch.are_deterministic_algorithms_enabled(),
                "warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
                "cudnn_deterministic": torch.backends.cudnn.deterministic,
                "cudnn_benchmark": torch.backends.cudnn.benchmark,
                CUBLAS_ENV: os.environ.get(CUBLAS_ENV)}
    state = Determinism(enabled, warn_only, _previous=previous)
    torch.use_deterministic_algorithms(enabled, warn_only=warn_only)
    torch.backends.cudnn.deterministic = enabled
    state.settings = {"torch.use_deterministic_algorithms": enabled, "warn_only": warn_only,
                      "torch.backends.cudnn.deterministic": enabled}
    if enabled:
        torch.backends.cudnn.benchmark = False
        state.settings["torch.backends.cudnn.benchmark"] = False
        current = os.environ.get(CUBLAS_ENV)
        if current not in (":4096:8", ":16:8"):
            if current:
                state.notes.append(f"{CUBLAS_ENV}={current!r} does not make cuBLAS deterministic; "
                                   f"replaced with {CUBLAS_DETERMINISTIC!r}")
            os.environ[CUBLAS_ENV] = CUBLAS_DETERMINISTIC
            if torch.cuda.is_available() and torch.cuda.is_initialized():  # cuda-only: cuBLAS's workspace setting
                state.notes.append(f"CUDA was already started; cuBLAS handles made before now keep their "
                                   f"workspace. Fix: call deterministic(True) (or export {CUBLAS_ENV}="
                                   f"{CUBLAS_DETERMINISTIC}) before the first CUDA matmul")
        state.settings[CUBLAS_ENV] = os.environ[CUBLAS_ENV]
    return state


def _restore(previous: dict[str, Any]) -> None:
    import torch

    if not previous:
        return
    torch.use_deterministic_algorithms(previous["algorithms"], warn_only=previous["warn_only"])
    torch.backends.cudnn.deterministic = previous["cudnn_deterministic"]
    torch.backends.cudnn.benchmark = previous["cudnn_benchmark"]
    if previous[CUBLAS_ENV] is None:
        os.environ.pop(CUBLAS_ENV, None)
    else:
        os.environ[CUBLAS_ENV] = previous[CUBLAS_ENV]
