"""A device mismatch torch.compile found while tracing: the user's frames are not in the traceback
(Dynamo ran the forward symbolically), but its message ends with "from user code:" and the file, line
and function of each frame. The innermost one is the op; the module whose forward holds that line is
found in the model, and the names of the line that read without running anything (`self.scale`, a
registered buffer) are reported with their devices. Runs only after an error.
"""

from __future__ import annotations

import linecache
import re
from types import FrameType, SimpleNamespace
from typing import Any, cast

import torch

from . import frames as fr

_USER_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\w+)')


def user_frames_in_message(text: str) -> list[fr.Site]:
    """The frames after torch.compile's "from user code:", outermost first (empty for other errors)."""
    _, found, tail = text.partition("from user code:")
    if not found:
        return []
    return [fr.Site(name, int(line), function, linecache.getline(name, int(line)).strip().removeprefix("return ")
                    or None) for name, line, function in _USER_FRAME.findall(tail)]


def torch_said(text: str) -> str:
    """The line of torch.compile's message that says what failed ("Expected all tensors to be on the same
    device, but found at least two devices, cpu and meta!"), in place of its title ("Tensor device mismatch")."""
    match = re.search(r"Explanation: (.+)", text)
    return match.group(1).strip() if match else text


def other_device(text: str, present: set[str]) -> str | None:
    """The device the message names that none of the tensors read has: where the op expected them."""
    match = re.search(r"found at least two devices, (\S+) and (\S+?)!", text)
    rest = sorted(set(match.groups() if match else ()) - present)
    return rest[0] if len(rest) == 1 else None


def owner(root: torch.nn.Module | None, site: fr.Site) -> tuple[str, torch.nn.Module] | None:
    """(path under ROOT, module) of the module whose method SITE is in; the innermost such module."""
    if root is None:
        return None
    found = None
    for name, module in root.named_modules():
        code = getattr(getattr(type(module), site.function, None), "__code__", None)
        if code is None or code.co_filename != site.filename:
            continue
        last = max((line for _, _, line in code.co_lines() if line is not None), default=code.co_firstlineno)
        if code.co_firstlineno <= site.lineno <= last:
            found = (name, module)
    return found


def static_frame(module: torch.nn.Module, site: fr.Site) -> FrameType:
    """A stand-in frame for reading SITE's names: `self` is MODULE, globals are its method's module's."""
    method: Any = getattr(type(module), site.function)
    return cast(FrameType, SimpleNamespace(f_locals={"self": module}, f_globals=method.__globals__,
                                           f_code=method.__code__))
