"""Software versions read from installed metadata, without importing torch or starting CUDA.

Importing torch takes seconds; doctor must answer in well under one. torch's own version file
(torch/version.py) is parsed as text, and cuDNN/NCCL versions come from the wheels that ship
them (nvidia-cudnn-*, nvidia-nccl-*). The driver's versions come from NVML (see topology).
"""

from __future__ import annotations

import ast
import importlib.metadata as md
import importlib.util
import platform
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from .._version import __version__


@dataclass
class Versions:
    """Versions of the stack; None where not installed or not determinable."""

    python: str | None = None
    torch: str | None = None
    torch_cuda: str | None = None  # the CUDA torch was built with; None for a CPU build
    torch_hip: str | None = None
    cudnn: str | None = None
    nccl: str | None = None
    nvidia_ml_py: str | None = None
    torchplace: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Versions:
        known = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in data.items() if k in known})


def _dist_version(*names: str) -> str | None:
    for name in names:
        try:
            return md.version(name)
        except md.PackageNotFoundError:
            continue
    return None


def _torch_version_file() -> dict[str, Any]:
    """Assignments in torch/version.py, read as text (finding the spec does not import torch)."""
    try:
        spec = importlib.util.find_spec("torch")
    except (ImportError, ValueError):
        return {}
    if spec is None or not spec.submodule_search_locations:
        return {}
    path = Path(list(spec.submodule_search_locations)[0]) / "version.py"
    try:
        tree = ast.parse(path.read_text())
    except (OSError, SyntaxError):
        return {}
    out: dict[str, Any] = {}
    for node in tree.body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                if isinstance(target, ast.Name):
                    try:
                        out[target.id] = ast.literal_eval(node.value)  # type: ignore[arg-type]
                    except ValueError:
                        pass
    return out


def read_versions() -> Versions:
    """Versions of Python, torch and its CUDA libraries as installed; never raises."""
    vfile = _torch_version_file()
    return Versions(
        python=platform.python_version(),
        torch=vfile.get("__version__") or _dist_version("torch"),
        torch_cuda=vfile.get("cuda"),
        torch_hip=vfile.get("hip"),
        cudnn=_dist_version("nvidia-cudnn-cu13", "nvidia-cudnn-cu12", "nvidia-cudnn-cu11"),
        nccl=_dist_version("nvidia-nccl-cu13", "nvidia-nccl-cu12", "nvidia-nccl-cu11"),
        nvidia_ml_py=_dist_version("nvidia-ml-py"),
        torchplace=__version__,
    )
