"""Every crafted file, through every reader: success or CheckpointError naming the file, nothing else.

The corpus (crafting.CASES) is written once per session; each reader entry runs on every case:
`load` of the file (with and without a model), `load` of a folder holding it, `inspect` with and
without `verify`, and `convert`. FIFOs and devices must be refused at once (the timeout is the test).
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import torchplace
from torchplace.checkpoint import convert, inspect
from torchplace.errors import CheckpointError

from .crafting import CASES, MUST_LOAD

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="session")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("corpus")
    out = {}
    for name, craft in CASES.items():
        folder = root / name
        folder.mkdir()
        out[name] = craft(folder)
    return out


def _model() -> torch.nn.Module:
    return torch.nn.Linear(4, 3)


def _load_with_everything(path: Path) -> Any:
    model = _model()
    opt = torch.optim.Adam(model.parameters())
    return torchplace.load(path, model=model, optimizer=opt, strict=True)


def _load_folder(path: Path) -> Any:
    if not path.is_file():
        pytest.skip("not a file: nothing to put in a folder")
    folder = path.parent / "as_folder"
    folder.mkdir(exist_ok=True)
    shutil.copy(path, folder / "step-00000001.pt")
    return torchplace.load(folder)


READERS: dict[str, Callable[[Path], Any]] = {
    "load": lambda p: torchplace.load(p),
    "load_model_optimizer": _load_with_everything,
    "load_folder": _load_folder,
    "inspect": lambda p: inspect(p),
    "inspect_verify": lambda p: inspect(p, verify=True),
    "convert": lambda p: convert(p, p.parent / "converted.pt"),
}


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("reader", list(READERS))
@pytest.mark.parametrize("name", list(CASES))
def test_a_crafted_file_loads_or_raises_checkpoint_error(corpus: dict[str, Path], name: str, reader: str) -> None:
    path = corpus[name]
    try:
        READERS[reader](path)
    except CheckpointError as exc:
        ours = not name.startswith("torch_")  # a folder load reads torchplace checkpoints only
        assert name not in MUST_LOAD or reader == "load_model_optimizer" or (reader == "load_folder" and not ours), \
            f"{name} must load: {exc}"
        assert str(path) in str(exc) or str(path.parent) in str(exc), f"the message does not name the file: {exc}"
    except Exception as exc:  # noqa: BLE001 - the point of the test
        pytest.fail(f"{name} via {reader} raised {type(exc).__name__}: {exc}")
