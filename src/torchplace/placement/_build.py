"""Rebuild a packed batch in one call: a function made once per batch structure.

`PackedBatch.rebuild` used to walk the skeleton (a call and a type test per container and per
leaf) and hand out views one at a time. When batches have the same structure (the same
containers, keys and leaf kinds) and the same layout, that walk decides the same things every
time, so it is done once: `builder` turns the structure into a Python function that makes each
group's views in one `split` (or `unbind`) call and returns the batch as one nested literal of
dicts, lists and tuples, its views indexed straight out of the split results. Leaves that are not
packed (values, large tensors, objects with their own `.to()`) are read from the batch's own
skeleton, so values that change from batch to batch (a step number, a file name) are the batch's.

The worker that packs a batch names its structure (`Names.key`: a short string, cheap to send
and to look up); the training process keeps one builder per name. Structures with containers
other than plain dict, list and tuple get no name and are rebuilt by the walk, as before.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import os
import secrets
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any

import torch

from ..shared.tree import ATOMIC, has_to, walk

# Views made below torch's view tracking cost about a quarter less (64 views: 22 µs instead of 29
# on this host); they share the buffer's storage without being recorded as its views, like tensors
# a collate made one by one (their own version counters, no `_base`), which is what the batch was.
_UNTRACKED = getattr(torch._C, "_AutoDispatchBelowADInplaceOrView", contextlib.nullcontext)
_CACHE_SIZE = 256  # builders kept in the training process; ever-changing structures start it over
_builders: dict[str, Callable[..., Any] | None] = {}
_Tensor = torch.Tensor


class Names:
    """Short names for (structure, layout) pairs, unique across processes (one `Names` per process)."""

    def __init__(self) -> None:
        self._pid = -1
        self._known: dict[tuple, str] = {}
        self._prefix = ""
        self._count = itertools.count()

    def key(self, skeleton: Any, slot: torch.Tensor, layout_key: tuple) -> str | None:
        """The name of SKELETON's structure with this layout, or None when a builder cannot serve it."""
        sig = signature(skeleton, slot)
        if sig is None:
            return None
        if self._pid != os.getpid():  # a forked worker starts its own names (its parent's could collide)
            self._pid, self._known, self._count = os.getpid(), {}, itertools.count()
            self._prefix = secrets.token_hex(6)
        full = (sig, layout_key)
        name = self._known.get(full)
        if name is None:
            if len(self._known) >= _CACHE_SIZE:
                self._known.clear()
            name = self._known[full] = f"{self._prefix}.{next(self._count)}"
        return name


def signature(x: Any, slot: torch.Tensor) -> Any:
    """A hashable description of X's structure (containers, keys, kinds of leaves), or None when
    X holds a container a builder does not make (mapping or sequence subclasses, dataclasses, attrs
    classes, sets, deques)."""
    if isinstance(x, _Tensor):
        return "s" if x is slot else "t"
    cls = type(x)
    if cls in ATOMIC:
        return "v"
    if cls is dict:
        items = [signature(v, slot) for v in x.values()]
        # key types too: 1, 1.0 and True are one dict key, but the builder writes the first it saw
        return None if None in items else ("d", tuple(x), tuple(map(type, x)), tuple(items))
    if cls is list or cls is tuple:
        items = [signature(v, slot) for v in x]
        return None if None in items else (cls.__name__, tuple(items))
    if has_to(x):
        return "o"
    if isinstance(x, (dict, list, tuple)) or _container(x):
        return None
    return "v"  # an object without tensors: kept as it is, like the walk keeps it


def slot_count(skeleton: Any, slot: torch.Tensor) -> int:
    """How many SLOTs SKELETON holds: fewer than the tensors packed where a set held several, as
    their slots are one object (a set of tensors is rare; `pack` leaves such a batch unpacked)."""
    count = 0

    def fn(t: torch.Tensor) -> torch.Tensor:
        nonlocal count
        count += t is slot
        return t

    walk(skeleton, fn, lambda x: x)
    return count


def _container(x: Any) -> bool:
    """Whether the walk (`shared.tree.walk`) enters X: a builder would keep it whole, tensors and all."""
    if isinstance(x, type):
        return False
    return (isinstance(x, (Mapping, set, frozenset, deque)) or dataclasses.is_dataclass(x)
            or hasattr(type(x), "__attrs_attrs__"))


def builder(key: str, skeleton: Any, slot: torch.Tensor, plan: tuple) -> Callable[..., Any] | None:
    """The (cached) function `fn(buf, skeleton, tensor, other)` that rebuilds batches named KEY."""
    fn = _builders.get(key, False)
    if fn is False:
        if len(_builders) >= _CACHE_SIZE:
            _builders.clear()
        fn = _builders[key] = _make(skeleton, slot, plan)
    return fn  # type: ignore[return-value]


def _make(skeleton: Any, slot: torch.Tensor, plan: tuple) -> Callable[..., Any] | None:
    """Write the builder's source from one batch of the structure, and compile it."""
    _, _, groups = plan
    where: dict[int, str] = {}  # position in the batch -> the expression of its view
    lines = ["def build(buf, s, T, O):", "    with U():"]
    consts: dict[str, Any] = {}
    for g, (dtype, rows, offset, nbytes, sizes, positions) in enumerate(groups):
        consts[f"D{g}"], consts[f"R{g}"], consts[f"S{g}"] = dtype, rows, sizes
        cut = "unbind(0)" if sizes is None else f"split_with_sizes(S{g})"  # not Tensor.split's Python wrapper
        lines.append(f"        g{g} = buf[{offset}:{offset + nbytes}].view(D{g}).view(R{g}).{cut}")
        for j, p in enumerate(positions):
            where[p] = f"g{g}[{j}]"
    keys: list[Any] = []
    count = itertools.count()

    def expr(x: Any, path: str) -> tuple[str, bool]:
        """X's expression, and whether it holds anything to rebuild (else the skeleton's own object)."""
        if isinstance(x, _Tensor):
            return (where[next(count)], True) if x is slot else (f"T({path})", True)
        cls = type(x)
        if cls is dict:
            parts, changed = [], False
            for k, v in x.items():
                if type(k) is str or type(k) is int:  # written as a literal: no lookup per key
                    ref = repr(k)
                else:
                    keys.append(k)
                    ref = f"K[{len(keys) - 1}]"
                e, c = expr(v, f"{path}[{ref}]")
                parts.append(f"{ref}: {e}")
                changed = changed or c
            return ("{" + ", ".join(parts) + "}", True) if changed else (path, False)
        if cls is list or cls is tuple:
            made = [expr(v, f"{path}[{i}]") for i, v in enumerate(x)]
            if not any(c for _, c in made):
                return path, False
            body = ", ".join(e for e, _ in made)
            return (f"[{body}]", True) if cls is list else (f"({body}{',' if len(made) == 1 else ''})", True)
        if cls not in ATOMIC and has_to(x):
            return f"O({path})", True
        return path, False

    try:
        body, _ = expr(skeleton, "s")
    except (KeyError, StopIteration):  # the skeleton does not match the layout: walk instead
        return None
    if len(where) != next(count):
        return None
    lines.append(f"    return {body}")
    namespace: dict[str, Any] = {**consts, "K": tuple(keys), "U": _UNTRACKED}
    exec(compile("\n".join(lines), "<torchplace packed batch builder>", "exec"), namespace)  # noqa: S102
    return namespace["build"]
