"""What PyTorch's device-mismatch messages say: whether an error is one, the op it names, the device
it expected; and the op an expression calls. Pure text work, read only after an error.
"""

from __future__ import annotations

import ast
import re

from ..errors import DeviceMismatchError
from . import frames as fr

_MISMATCH = re.compile(
    r"Expected all tensors to be on the same device|is not on the expected device|found at least two devices"
    r"|different from other tensors on|Expected object of device type|should be either on cpu or on the same "
    r"device|(?:must|to) be on the same device|are on different devices|is on device \S+ but .* on device"
    r"|tensors are not at the same device|expected to be in the same device|device type for generator but found"
    r"|must have its parameters and buffers on device")
_CONV_TYPES = re.compile(r"Input type \((torch\.[\w.]+)\) and weight type \((torch\.[\w.]+)\) should be the same")
_EXPECTED = re.compile(r"not on the expected device (\S+?)!|different from other tensors on (\S+?)[ ,)]"
                       r"|found at least two devices, (\S+?) and |found input tensor at (\S+) and"
                       r"|but got \(self\) (\S+?),|on device (\S+) \(device_ids\[0\]\)"
                       r"|Expected a '(\w+)' device type for generator")
_METHOD = re.compile(r"in method (?:wrapper_(?:[A-Za-z0-9]+_)?_?)?(\w+)")


def is_device_mismatch(exc: BaseException) -> bool:
    """True for PyTorch's errors about tensors on different devices (not for ours)."""
    if not isinstance(exc, RuntimeError) or isinstance(exc, DeviceMismatchError):
        return False
    text = str(exc)
    if _MISMATCH.search(text):
        return True
    conv = _CONV_TYPES.search(text)
    return bool(conv) and (".cuda." in conv.group(1)) != (".cuda." in conv.group(2))


def device_named_in(text: str) -> str | None:
    """The device PyTorch's message says the op expected ("not on the expected device cuda:0!"), if any."""
    match = _EXPECTED.search(text)
    return next((g for g in match.groups() if g), None) if match else None


def op_from_message(text: str) -> str | None:
    match = _METHOD.search(text)
    return match.group(1) if match else None


_BINOPS = {"Add": "add", "Sub": "sub", "Mult": "mul", "Div": "div", "MatMult": "matmul", "Pow": "pow"}


def op_from_expression(expression: str | None) -> str | None:
    tree = fr.parse_expression(expression) if expression else None
    body = tree.body if isinstance(tree, ast.Expression) else None
    if isinstance(body, ast.Call):
        return ast.unparse(body.func)
    if isinstance(body, ast.BinOp):
        name = type(body.op).__name__
        return _BINOPS.get(name, name.lower())
    return None
