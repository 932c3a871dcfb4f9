"""The public namespace: one sorted __all__, every name resolves, importing it stays cheap."""

from __future__ import annotations

import subprocess
import sys

import torchplace


def test_all_is_sorted_and_every_name_resolves():
    assert torchplace.__all__ == sorted(torchplace.__all__)
    for name in torchplace.__all__:
        assert getattr(torchplace, name) is not None, name


def test_errors_form_one_tree():
    for name in [n for n in torchplace.__all__ if n.endswith("Error")]:
        assert issubclass(getattr(torchplace, name), torchplace.TorchplaceError), name


def test_import_does_not_import_torch():
    code = "import sys, torchplace; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False", out.stderr


def test_unknown_attribute_is_an_attribute_error():
    try:
        torchplace.nope  # noqa: B018
    except AttributeError as exc:
        assert "nope" in str(exc)
    else:
        raise AssertionError("expected AttributeError")
