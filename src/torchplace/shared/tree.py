"""`map_tensors`: the one traversal of nested batches, for moving, pinning and `record_stream`;
`tensors_with_paths`: the same containers read, each tensor with its path, for reports.

One function serves every caller, so a container kind or a keyword is never handled in one of
them and forgotten in another (torchtnt's recursive helper forgot to forward `stream`, and its
nested tensors never got `record_stream`). It never changes its input: every container that
holds a changed tensor is rebuilt as a new object.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import itertools
import sys
from collections import OrderedDict, UserDict, defaultdict, deque
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

# types that never hold a tensor: returned as they are without any further check
ATOMIC = frozenset({str, bytes, bytearray, int, float, bool, complex, type(None), type(...),
                     torch.device, torch.dtype, torch.layout, torch.memory_format})
_Tensor = torch.Tensor


def map_tensors(obj: Any, fn: Callable[[torch.Tensor], Any],
                other: Callable[[Any], Any] | None = None) -> Any:
    """Rebuild OBJ with `fn(t)` for each tensor and `other(x)` for each object with its own `.to()`.

    Handles dict, OrderedDict, defaultdict (factory kept), other mappings, list, tuple,
    namedtuple and other tuple subclasses, set, frozenset, deque (maxlen kept), dataclasses and
    attrs classes (frozen ones and init=False fields included); anything else (a generator, an
    object of another kind) is returned as it is. With OTHER, an object that defines `.to()`
    is handed to OTHER whole, even when it is also a mapping, tuple or dataclass (a
    PackedSequence is a namedtuple whose `batch_sizes` must stay on the CPU); without OTHER,
    such containers are walked into, so a traversal for side effects (`record_stream`) still
    reaches their tensors.

    The input is never changed: a container with a changed item is rebuilt as a new object (see
    `_rebuild_mapping`, `_rebuild_sequence`, `_rebuild_collection`, `_rebuild_fields`). A container whose items all
    come back unchanged is returned itself, like `Tensor.to` returns self, so a traversal for
    side effects allocates nothing. Like a loop of `.to()` calls, a tensor that appears twice is
    visited twice (a memo cost more per tensor than accelerate's whole per-tensor overhead).

    The recursion is a module-level function, not a closure that calls itself: such a closure
    is a reference cycle that keeps FN, OTHER and whatever they hold (a whole batch of device
    tensors, for DeviceLoader) alive until the garbage collector happens to run.
    """
    try:
        return walk(obj, fn, other)
    except RecursionError:
        raise depth_error(obj, "map_tensors") from None


def depth_error(obj: Any, caller: str) -> Exception:
    """The error for a walk of OBJ that hit Python's recursion limit: the cycle it holds (ValueError), or a
    RecursionError that says the batch is nested too deep and what to do (never the bare one of the stack)."""
    cyclic = cycle_error(obj, caller)
    if cyclic is not None:
        return cyclic
    return RecursionError(
        f"{caller}: the batch is nested deeper than Python's recursion limit ({sys.getrecursionlimit()} levels), "
        "so its containers cannot be walked. Fix: flatten it in the dataset or collate_fn "
        "(stack the tensors into one, or keep a list of tensors rather than lists inside lists).")


def cycle_error(obj: Any, caller: str) -> ValueError | None:
    """The error for OBJ when it holds itself (a container reachable from its own items), or None.

    Called only once a walk has hit Python's recursion limit, so batches without a cycle pay
    nothing for the check; a batch that is merely very deep gets None (its RecursionError stands).
    """
    path = _find_cycle(obj)
    if path is None:
        return None
    where, back = path
    return ValueError(
        f"{caller}: the batch holds itself ({where} is {back}), so walking it never ends. Fix: break the "
        "cycle before moving the batch (keep the back-reference outside it, or give the object a .to() "
        "method that moves its own tensors).")


def _children(x: Any) -> list[tuple[str, Any]]:
    """X's items as (how to reach it from X, item), in the containers `walk` enters."""
    return list(_steps(x))


def _steps(x: Any) -> Iterator[tuple[str, Any]]:
    """X's items as (how to reach it from X, item), one at a time, in the containers `walk` enters."""
    if isinstance(x, _Tensor) or type(x) in ATOMIC:
        return
    if isinstance(x, Mapping):
        yield from ((f"[{k!r}]", v) for k, v in x.items())
    elif isinstance(x, (list, tuple, deque)):
        yield from ((f"[{i}]", v) for i, v in enumerate(x))
    elif isinstance(x, (set, frozenset)):
        yield from (("{...}", v) for v in x)
    else:
        names: list[str] = []
        if dataclasses.is_dataclass(x) and not isinstance(x, type):
            names = [f.name for f in dataclasses.fields(x)]
        elif hasattr(type(x), "__attrs_attrs__") and not isinstance(x, type):
            names = [a.name for a in type(x).__attrs_attrs__]
        yield from ((f".{n}", getattr(x, n)) for n in names if hasattr(x, n))


def tensors_with_paths(obj: Any, path: str = "", *, depth: int | None = None,
                       items: int | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(path, tensor) for each tensor in OBJ and the containers `walk` enters, in order: `batch['x'][0]`.

    PATH names OBJ itself. DEPTH: how many container levels to enter (None: all); ITEMS: how many
    items of each container to look at (None: all), so reading a report off a huge batch stays cheap.
    A container that holds itself is entered once on each path.
    """
    yield from _with_paths(obj, path, depth, items, set())


def _with_paths(x: Any, path: str, depth: int | None, items: int | None,
                on_path: set[int]) -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(x, _Tensor):
        yield path, x
        return
    if depth == 0 or id(x) in on_path or type(x) in ATOMIC:
        return
    on_path.add(id(x))
    try:
        for step, item in itertools.islice(_steps(x), items):
            yield from _with_paths(item, path + step, None if depth is None else depth - 1, items, on_path)
    finally:
        on_path.discard(id(x))


def _find_cycle(obj: Any) -> tuple[str, str] | None:
    """(path to a container, path it already had on the way there) for the first cycle in OBJ, else None.

    Iterative, so it works where the recursive walk ran out of stack.
    """
    on_path: dict[int, str] = {}
    stack: list[tuple[Any, str, bool]] = [(obj, "batch", False)]
    while stack:
        x, where, leaving = stack.pop()
        if leaving:
            on_path.pop(id(x), None)
            continue
        kids = _children(x)
        if not kids:
            continue
        if id(x) in on_path:
            return where, on_path[id(x)]
        on_path[id(x)] = where
        stack.append((x, where, True))
        stack.extend((v, where + step, False) for step, v in reversed(kids))
    return None


def walk(x: Any, fn: Callable[[torch.Tensor], Any], other: Callable[[Any], Any] | None) -> Any:
    if isinstance(x, _Tensor):
        return fn(x)
    cls = type(x)
    if cls in ATOMIC:
        return x
    if cls is dict:  # the common containers first, each tensor item without a call to walk
        new = {k: fn(v) if isinstance(v, _Tensor) else walk(v, fn, other) for k, v in x.items()}
        return x if unchanged(x.values(), new.values()) else new
    if cls is list or cls is tuple:
        items = [fn(v) if isinstance(v, _Tensor) else walk(v, fn, other) for v in x]
        return x if unchanged(x, items) else cls(items)
    if other is not None and has_to(x):
        return other(x)
    if isinstance(x, Mapping):
        return _rebuild_mapping(x, {k: walk(v, fn, other) for k, v in x.items()})
    if isinstance(x, (list, tuple)):
        items = [walk(v, fn, other) for v in x]
        return x if unchanged(x, items) else _rebuild_sequence(x, items)
    if isinstance(x, (set, frozenset, deque)):
        items = [walk(v, fn, other) for v in x]
        return x if unchanged(x, items) else _rebuild_collection(x, items)
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return _rebuild_fields(x, [f.name for f in dataclasses.fields(x)], fn, other)
    fields = getattr(cls, "__attrs_attrs__", None)  # an attrs class (attrs.define, attr.s)
    if fields is not None and not isinstance(x, type):
        return _rebuild_fields(x, [a.name for a in fields], fn, other)
    return x


def leaves(tree: Any, kinds: type | tuple[type, ...] = _Tensor,
           path: tuple[Any, ...] = ()) -> Iterator[tuple[tuple[Any, ...], Any]]:
    """(path, leaf) for each leaf of KINDS in TREE's dicts, lists and tuples, depth first and in order: the
    walk that enumerates a state tree (the path is its keys and indices), where `map_tensors` rebuilds one."""
    if isinstance(tree, kinds):
        yield path, tree
    elif isinstance(tree, dict):
        for k, v in tree.items():
            yield from leaves(v, kinds, path + (k,))
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            yield from leaves(v, kinds, path + (i,))


def has_to(x: Any) -> bool:
    """True for an object (not a class) with a callable `.to`: it is moved by that method."""
    return callable(getattr(x, "to", None)) and not isinstance(x, type)


def unchanged(old: Any, new: Any) -> bool:
    return all(a is b for a, b in zip(old, new))


def _rebuild_mapping(x: Mapping, new: dict) -> Any:
    """A new mapping like X holding NEW's items; X itself is never written to.

    A dict subclass is copied (a copy has its own item storage; type and attributes are kept)
    and the copy updated; a UserDict's copy copies its inner dict, so it is treated the same.
    Any other mapping (a custom MutableMapping may share its inner dict with a shallow copy) is
    made by its constructor from a dict. What cannot be rebuilt either way (a dict subclass that
    refuses item assignment, a constructor that wants other arguments) becomes the constructor's
    result when that holds exactly the new items, else a plain dict.
    """
    if unchanged(x.values(), new.values()):
        return x
    cls = type(x)
    if cls is OrderedDict:
        return OrderedDict(new)
    if cls is defaultdict:
        return defaultdict(x.default_factory, new)  # type: ignore[attr-defined]
    if isinstance(x, (dict, UserDict)):
        try:
            out = copy.copy(x)
            for key, value in new.items():
                out[key] = value
            return out
        except Exception:  # noqa: BLE001 - the items are moved already; try the constructor
            pass
    try:
        built: Any = cls(new)  # type: ignore[call-arg]
    except Exception:  # noqa: BLE001 - a constructor with other arguments: a plain dict below
        return new
    if type(built) is cls and len(built) == len(new) and all(built[k] is v for k, v in new.items()):
        return built
    return new


def _rebuild_sequence(x: list | tuple, items: list) -> Any:
    """A new sequence like X holding ITEMS; X itself is never written to.

    A namedtuple is rebuilt with `_make` (which bypasses a custom `__new__`); another tuple
    subclass with `cls(items)` (torch.Size, torch.return_types.*) or, when that does not give
    back exactly ITEMS, `cls(*items)` (a constructor taking separate arguments); failing both,
    a plain tuple. A list subclass is copied (type and attributes kept) and the copy filled.
    """
    cls = type(x)
    if isinstance(x, tuple):
        if hasattr(cls, "_fields") and hasattr(cls, "_make"):
            try:
                return cls._make(items)
            except Exception:  # noqa: BLE001 - a namedtuple-like class with its own _make
                pass
        for args in ((items,), items):
            try:
                out = cls(*args)
            except Exception:  # noqa: BLE001 - the other form, then a plain tuple
                continue
            if type(out) is cls and len(out) == len(items) and unchanged(out, items):
                return out
        return tuple(items)
    try:
        out = copy.copy(x)
        out[:] = items
        return out
    except Exception:  # noqa: BLE001 - a list subclass that refuses to change
        return list(items)


def _rebuild_collection(x: set | frozenset | deque, items: list) -> Any:
    """A new set, frozenset or deque like X holding ITEMS; X itself is never written to.

    A deque keeps its maxlen; a subclass is copied (type and attributes kept) and the copy
    refilled, or, if it refuses, built by its constructor; failing both, the plain kind.
    """
    cls = type(x)
    if cls is deque:
        return deque(items, maxlen=x.maxlen)  # type: ignore[union-attr]
    if cls is set or cls is frozenset:
        return cls(items)
    try:
        if isinstance(x, frozenset):
            out: Any = cls(items)
        else:
            out = copy.copy(x)
            out.clear()
            if isinstance(out, deque):
                out.extend(items)
            else:
                out.update(items)
        if type(out) is cls and len(out) == len(items):
            return out
    except Exception:  # noqa: BLE001 - a subclass that refuses to change: the plain kind below
        pass
    if isinstance(x, deque):
        return deque(items, maxlen=x.maxlen)
    return frozenset(items) if isinstance(x, frozenset) else set(items)


def _rebuild_fields(x: Any, names: list[str], fn: Callable[[torch.Tensor], Any],
                    other: Callable[[Any], Any] | None) -> Any:
    """Copy X (a dataclass or attrs instance) with its moved fields NAMES set directly: no
    __init__, __post_init__ or attrs validator runs again.

    Values that `functools.cached_property` stored on X were computed from the old fields (on
    the old device): the copy drops them, so they are computed again from the moved fields.
    """
    changed = {}
    for name in names:
        try:
            value = getattr(x, name)
        except AttributeError:  # an init=False field that was never set
            continue
        moved = walk(value, fn, other)
        if moved is not value:
            changed[name] = moved
    if not changed:
        return x
    out = copy.copy(x)
    for name, value in changed.items():
        object.__setattr__(out, name, value)  # works on frozen dataclasses and attrs classes too
    cached = _cached_properties(type(x))
    state = getattr(out, "__dict__", None) if cached else None  # copy.copy gave the copy its own
    if state is not None:
        for name in cached:
            state.pop(name, None)
    return out


_cached: dict[type, tuple[str, ...]] = {}


def _cached_properties(cls: type) -> tuple[str, ...]:
    """The attribute names under which CLS's cached_property values are stored (per class, once)."""
    names = _cached.get(cls)
    if names is None:
        names = _cached[cls] = tuple(
            value.attrname or name for klass in cls.__mro__ for name, value in vars(klass).items()
            if isinstance(value, functools.cached_property))
    return names
