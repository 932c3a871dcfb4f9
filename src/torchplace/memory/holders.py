"""Who keeps tensors alive, named for a person: what holds the live tensors of one device, compared
between two moments, and which Python containers hold given tensors (`containers_of`, `holder_of`:
a list of 60 items bound to the global `history`, a dict entry `cache['step-3']`), for the memory
report and the leak detector.

`holdings(device)` walks the garbage collector's objects once: every tensor on DEVICE (by
storage, so views count once per holder), then every object whose references include one of
them: a dict, list, set, deque or tuple, or an object holding tensors in attributes. Each
holder gets the tensors and bytes it holds. `grown(before, after)` compares two such walks
holder by holder, and `name_holder` turns the few that grew into the user's name for them: a
local or global variable of the user's frames (`seen`), an attribute path (`trainer.cache`,
`model.encoder.cache`), a module attribute, with the line that grows it when its source says.

What holds holders (`cache.append((x, y))`, a dict of objects with tensors, a weak cache of
models) is credited with what they hold, up to `_LEVELS` levels up; `grown` names the nearest, or
a container whose growth is spread over its entries. Tensors held only by local variables of
running frames have no holder here; tensors saved only inside an autograd graph (a running
total summed without `.item()`) are named, when no holder grew, by the tensor at the graph's root
that the user keeps (`graph_roots`, `name_root`): "autograd graph of tensor `total`".

These walks cost a pass over the heap and one per level up (about 0.5 s per 200k objects, 2 cores):
`track_memory` runs them at its baseline and, at the end, only when memory grew.
"""

from __future__ import annotations

import collections
import functools
import gc
import inspect
import linecache
import os
import re
import sys
import types
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch._subclasses.fake_tensor import is_fake

from ..shared import frames as user_code
from ..units import format_bytes

_CONTAINERS = (dict, list, set, frozenset, tuple, collections.deque)
_SKIP = (types.FrameType, types.FunctionType, types.CodeType, types.ModuleType, type)
# torch, torchplace, the standard library and installed packages (a test runner's, a trainer library's)
_FEW = 100  # holders few enough to find what references them with gc.get_referrers (a heap scan per holder)
_LEVELS = 6  # holders above the tensors' own, at most: a dict of objects holding a module holding parameters
_MAX_GRAPH_NODES = 20_000  # an autograd graph is walked this far at most
_LIBRARIES = (*user_code.LIBRARY, user_code.STDLIB_DIR, *user_code.SITE_DIRS)


@dataclass(frozen=True)
class Holding:
    """What one holder held at one moment: its kind ('dict', 'list', 'Trainer'), tensors and bytes."""

    kind: str
    tensors: int
    nbytes: int
    parts: frozenset[int] = frozenset()  # ids of the holders (nearer the tensors) whose tensors it is credited with
    container: bool = True  # a dict, list, set, deque or tuple (else an object, holding in attributes)


@dataclass
class Growth:
    """A holder that holds more tensor memory at the end than at the start."""

    name: str  # "dict `seen`", "list `trainer.outputs`", "Trainer `trainer` attribute .buf"
    where: str | None  # "train.py:42": the line that grows it, when found in the source
    device: str
    growth_bytes: int
    added_tensors: int  # tensors now minus tensors at the start
    tensors: int  # tensors held now
    nbytes: int  # bytes held now

    def describe(self) -> str:
        where = f" ({self.where})" if self.where else ""
        if self.added_tensors > 0:
            each = self.growth_bytes // self.added_tensors
            what = f"{self.added_tensors} tensor(s) of {format_bytes(each)} added" if each else \
                f"{self.added_tensors} tensor(s) added"
        else:
            what = f"its {self.tensors} tensor(s) grew to {format_bytes(self.nbytes)}"
        return f"{self.name}{where} grew by {format_bytes(self.growth_bytes)}: {what} ({self.device})"


def holdings(keep: Callable[[torch.Tensor], bool], own: set[int] = frozenset(),  # type: ignore[assignment]
             objects: dict[int, Any] | None = None) -> dict[int, Holding]:
    """id(holder) -> what it holds, for the live tensors that KEEP accepts (one heap walk).

    OWN: ids of the caller's objects, never holders. OBJECTS, when given, receives id -> holder
    (the caller clears it when done, so that no holder is kept alive by this walk).
    """
    heap = gc.get_objects()
    sizes: dict[int, tuple[int, int]] = {}  # id(tensor) -> (storage address, storage bytes)
    try:
        for obj in heap:
            if not issubclass(type(obj), torch.Tensor):  # type(), not isinstance(): lazy proxies
                continue
            try:
                if not keep(obj) or not (ptr := storage_ptr(obj)):
                    continue
                sizes[id(obj)] = (ptr, int(obj.untyped_storage().nbytes()))
            except Exception:  # tensor subclasses and wrappers without a plain storage
                continue
        skip = {id(heap), id(sizes), *own}
        held: dict[int, dict[int, int]] = {}  # id(holder) -> storage -> bytes
        found: dict[int, Any] = {}
        parts: dict[int, set[int]] = {}
        above: list[Any] = []  # what may hold holders: containers and objects with attributes, not a module's globals
        data: dict[type, bool] = {}
        for obj in heap:
            tp = type(obj)
            if id(obj) in skip or issubclass(tp, (torch.Tensor, *_SKIP)):
                continue
            is_data = data.get(tp)
            if is_data is None:
                is_data = data[tp] = _is_data(tp)
            if is_data and not _is_namespace(obj):
                above.append(obj)
            refs = gc.get_referents(obj)
            if sizes.keys().isdisjoint(map(id, refs)):
                continue
            held[id(obj)] = dict(sizes[id(r)] for r in refs if id(r) in sizes)
            found[id(obj)] = obj
        # levels up: what holds holders ({step: (x, y)}, a dict of objects with tensors, a cache of modules),
        # each credited with what the holders one level nearer the tensors among its references hold (never
        # with what a back-reference reaches); a container of tensors also with the containers beside them
        attribute_dicts: set[int] = set()
        level = dict.fromkeys(found, 0)
        last = list(found.values())
        in_above = set(map(id, above))
        for depth in range(1, _LEVELS + 1):
            if not last:
                break
            new = []
            # what references the holders found last: asked of the collector (in C) when they are few
            nearby = [r for r in gc.get_referrers(*last) if id(r) in in_above] if len(last) <= _FEW else above
            for obj in nearby:
                container = issubclass(type(obj), _CONTAINERS)
                if id(obj) in level and not (depth == 1 and container):
                    continue
                refs = gc.get_referents(obj)
                if level.keys().isdisjoint(map(id, refs)):
                    continue
                below = [r for r in refs if level.get(id(r), depth) < depth and r is not obj
                         and (id(obj) not in level or issubclass(type(r), _CONTAINERS))]
                if not below:
                    continue
                mine = held.setdefault(id(obj), {})
                found.setdefault(id(obj), obj)
                credited = parts.setdefault(id(obj), set())
                for r in below:
                    mine.update(held[id(r)])
                    credited.add(id(r))
                    if type(r) is dict and container and type(obj) not in _CONTAINERS and _attributes(obj) is r:
                        attribute_dicts.add(id(r))
                if id(obj) not in level:
                    new.append(obj)
            level.update((id(obj), depth) for obj in new)
            if nearby is not above:
                nearby.clear()
            last = new
        last.clear()
        above.clear()
        # a container subclass's attributes (a transformers ModelOutput is a dict whose fields are
        # also attributes) are that object's, not a second holder of the same tensors
        for i in attribute_dicts:
            del held[i], found[i]
        for credited in parts.values():
            credited -= attribute_dicts
        out = {i: Holding(_kind(found[i]), len(s), sum(s.values()), frozenset(parts.get(i, ())),
                          issubclass(type(found[i]), _CONTAINERS)) for i, s in held.items()}
        if objects is not None:
            objects.update(found)
        found.clear()
        return out
    finally:
        heap.clear()


def _is_data(tp: type) -> bool:
    """TP's objects may hold data for the user: a container, or an object with attributes (a callback, a cell, a
    descriptor, a weak reference may reference data but do not hold it)."""
    return issubclass(tp, _CONTAINERS) or bool(tp.__dictoffset__) or any("__slots__" in vars(c) for c in tp.__mro__)


def _kind(obj: Any) -> str:
    return type(obj).__name__


def _is_namespace(obj: Any) -> bool:
    """A module's globals: its variables are named one by one, never credited as a whole."""
    return type(obj) is dict and "__name__" in obj and "__builtins__" in obj


def grown(before: dict[int, Holding], after: dict[int, Holding], min_bytes: int) -> list[tuple[int, int, int]]:
    """(id, bytes grown, tensors added) for the holders that grew by MIN_BYTES or more, most first.

    A holder is compared with the one of the same id and kind at the start (ids of dead objects
    are reused), else with nothing. What is credited with parts that grew is left out, and the parts
    named: a container when one part grew half as much (a dict holding the growing list), an object when
    its parts together did (growing lists in its attributes); a container whose growth is spread over
    many entries (a dict gaining an object a step) is named.
    """
    out: dict[int, tuple[int, int, int]] = {}
    for key, now in after.items():
        start = before.get(key)
        if start is None or start.kind != now.kind:
            start = Holding(now.kind, 0, 0)
        growth = now.nbytes - start.nbytes
        if growth >= min_bytes:
            out[key] = (key, growth, now.tensors - start.tensors)
    grew = {key: growth for key, growth, _ in out.values()}
    for key in list(out):
        part_growth = [grew[part] for part in after[key].parts if part in grew]
        if part_growth and (max if after[key].container else sum)(part_growth) * 2 >= grew[key]:
            del out[key]
    return sorted(out.values(), key=lambda item: item[1], reverse=True)


def graph_saved(t: torch.Tensor, keep: Callable[[torch.Tensor], bool] | None = None,
                nodes: set[int] | None = None) -> dict[int, int]:
    """Storage address -> bytes of the tensors T's autograd graph still saves (none once backward freed
    them), those KEEP accepts; NODES, when given, receives the ids of the graph's nodes but its leaves'
    (AccumulateGrad: the parameters' nodes, which the graphs of every step share)."""
    seen: set[int] = set() if nodes is None else nodes
    saved: dict[int, int] = {}
    stack = [t.grad_fn] if t.grad_fn is not None else []
    while stack and len(seen) < _MAX_GRAPH_NODES:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        if type(node).__name__ == "AccumulateGrad":
            continue
        seen.add(id(node))
        for name in dir(node):
            if not name.startswith("_saved_"):
                continue
            try:
                value = getattr(node, name)
            except RuntimeError:  # freed by backward
                continue
            for item in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(item, torch.Tensor) and (keep is None or keep(item)):
                    ptr = storage_ptr(item)
                    if ptr and ptr not in saved:
                        saved[ptr] = _nbytes(item)
        stack.extend(fn for fn, _ in node.next_functions)
    return saved


def graph_roots(keep: Callable[[torch.Tensor], bool], min_bytes: int, own: set[int] = frozenset(),  # type: ignore[assignment]
                top: int = 3) -> list[tuple[torch.Tensor, dict[int, int], set[int]]]:
    """(tensor, what its graph saves) for the TOP live tensors whose autograd graphs save MIN_BYTES or more
    of KEEP's tensors, most first: memory that no Python object holds, only the graph of a tensor the
    user keeps (a running total summed without `.item()`), and the ids of its graph's nodes. A tensor inside
    another one's graph is not a root: the outer one holds it."""
    heap = gc.get_objects()
    try:
        candidates = [o for o in heap if issubclass(type(o), torch.Tensor) and id(o) not in own
                      and o.grad_fn is not None and keep(o)]
    finally:
        heap.clear()
    graphs = []
    for t in candidates:
        nodes: set[int] = set()
        saved = graph_saved(t, keep, nodes)
        graphs.append((t, saved, nodes - {id(t.grad_fn)}))
    inner = set().union(*(nodes for _, _, nodes in graphs))
    roots = [(t, saved, nodes) for t, saved, nodes in graphs
             if id(t.grad_fn) not in inner and sum(saved.values()) >= min_bytes]
    candidates.clear()
    graphs.clear()
    return sorted(roots, key=lambda item: sum(item[1].values()), reverse=True)[:top]


def group_by_holder(roots: list[tuple[torch.Tensor, dict[int, int], set[int]]], holders: dict[int, Any]
                    ) -> list[tuple[Any, list[torch.Tensor], dict[int, int]]]:
    """ROOTS (from `graph_roots`) grouped by the holder among HOLDERS (id -> object, from `holdings`) that keeps
    two or more of them with graphs of their own (no node in common: one kept each step, as a list of losses),
    so that the holder is named for all their graphs; roots whose graphs are one history (a dict of running
    totals made from one output, an LSTM's (h, c)) stand alone. (holder or None, its roots, storage -> bytes
    saved), most saved first."""
    ids = {id(t): (t, saved, nodes) for t, saved, nodes in roots}
    grouped: set[int] = set()
    out: list[tuple[Any, list[torch.Tensor], dict[int, int]]] = []
    for holder in holders.values():
        mine = [ids[id(r)] for r in gc.get_referents(holder) if id(r) in ids and id(r) not in grouped]
        if len(mine) > 1 and sum(len(n) for *_, n in mine) == len(set().union(*(n for *_, n in mine))):
            saved: dict[int, int] = {}
            for _, part, _ in mine:
                saved.update(part)
            out.append((holder, [t for t, *_ in mine], saved))
            grouped.update(id(t) for t, *_ in mine)
    out += [(None, [t], saved) for t, saved, _ in roots if id(t) not in grouped]
    return sorted(out, key=lambda g: sum(g[2].values()), reverse=True)


# --------------------------------------------------------------------------- names


def user_frames(frame: types.FrameType | None) -> list[types.FrameType]:
    """FRAME and its callers, without the frames of torch, torchplace, the standard library and
    installed packages (a test runner's, a trainer library's)."""
    return list(user_code.outside(frame, _LIBRARIES))


def name_holder(obj: Any, frames: list[types.FrameType], ignore: set[int]) -> tuple[str, str | None]:
    """The user's name for holder OBJ ("dict `seen`", "list `trainer.cache`") and the line that
    grows it ("train.py:42"), searched in FRAMES' variables, then in what references OBJ."""
    weak = _weak_owner(obj) if type(obj) in (dict, set) else None
    obj = obj if weak is None else weak  # a weak dict's or set's own dict or set: named by the weak one
    kind = type(obj).__name__
    path, attr, origin = _path(obj, frames, ignore | {id(frames)}, depth=3)
    # an object with tensors in its attributes (a container subclass too: a ModelOutput's fields)
    tensors = {k: v for k, v in _attributes(obj).items() if issubclass(type(v), torch.Tensor)}
    if weak is not None or issubclass(type(obj), _CONTAINERS) and (type(obj) in _CONTAINERS or not tensors):
        if path is None:
            return f"a {kind} of {len(obj)} items", None
        return f"{kind} `{path}`", _growth_line(path.rsplit(".", 1)[-1].split("[")[0], origin, frames)
    # the attribute holding the most
    best = max(tensors, key=lambda k: _nbytes(tensors[k]), default=None)
    owner = f"`{path}`" if path else kind
    if best is None:
        return f"{kind} {owner}", None
    return f"tensor `{path}.{best}`" if path else f"tensor {kind}.{best}", _growth_line(best, type(obj), frames)


def name_root(t: torch.Tensor, frames: list[types.FrameType], ignore: set[int]) -> tuple[str, str | None]:
    """The user's name for the tensor at the root of a graph that holds memory ("autograd graph of tensor
    `total`") and the line that grows it, else one that describes it."""
    path, _, origin = _path(t, frames, ignore | {id(frames)}, depth=3)
    if path is None:
        made = type(t.grad_fn).__name__
        return f"autograd graph of a {str(t.dtype).removeprefix('torch.')} {list(t.shape)} tensor made by {made}", None
    return f"autograd graph of tensor `{path}`", _growth_line(path.rsplit(".", 1)[-1].split("[")[0], origin, frames)


def _path(obj: Any, frames: list[types.FrameType], ignore: set[int], depth: int) -> tuple[str | None, str | None, Any]:
    """(name, last attribute, where to look for its source) of OBJ, or (None, None, None)."""
    for frame in frames:  # variables of the user's frames first: the names the user typed
        for scope in (frame.f_locals, frame.f_globals):
            for key, value in scope.items():
                if value is obj and not key.startswith("__"):
                    return key, None, frame if scope is frame.f_locals else _module(scope) or frame
    for frame in frames:  # attributes of the user's modules (nn.Module trees included)
        for scope in (frame.f_locals, frame.f_globals):
            for key, value in list(scope.items()):
                if issubclass(type(value), torch.nn.Module):
                    for sub_name, sub in value.named_modules():
                        for attr, held in _attributes(sub).items():
                            if held is obj:
                                prefix = f"{key}.{sub_name}" if sub_name else key
                                return f"{prefix}.{attr}", attr, type(sub)
    if depth == 0:
        return None, None, None
    refs = gc.get_referrers(obj)  # one heap scan: only for the few holders a report names
    ignore = ignore | {id(refs), id(obj)}
    try:
        for ref in refs:
            if id(ref) in ignore or issubclass(type(ref), types.FrameType):
                continue
            if type(ref) is dict and "__builtins__" in ref and "__name__" in ref:
                key = next((k for k, v in ref.items() if v is obj), None)
                if key is not None:
                    return f"{ref['__name__']}.{key}", key, _module(ref)
            elif isinstance(ref, dict):  # a plain dict, or a module's hook dict (an OrderedDict)
                owner = _owner(ref)
                key = next((k for k, v in ref.items() if v is obj), None)
                if owner is not None and key is not None:  # an attribute, of an object or of a class
                    cls = owner if isinstance(owner, type) else type(owner)
                    outer, _, _ = _path(owner, frames, ignore | {id(ref)}, depth - 1)
                    return f"{outer or cls.__name__}.{key}", key, cls
                if key is not None:
                    outer, _, origin = _path(ref, frames, ignore | {id(ref)}, depth - 1)
                    if outer:
                        return f"{outer}[{_key_text(key)}]", None, origin
            elif type(ref) is functools._lru_cache_wrapper:  # the cache of a function under @lru_cache / @cache
                return f"@lru_cache of {ref.__qualname__}", None, None
            elif type(ref) is types.MethodType and ref.__self__ is obj:  # a hook or callback bound to OBJ
                outer, _, origin = _path(ref, frames, ignore, depth - 1)
                if outer:
                    return f"{outer}.__self__", None, origin
            elif type(ref) in (tuple, list):  # an entry of a sequence the user keeps: `hidden[0]` of (h, c)
                index = next((i for i, v in enumerate(ref) if v is obj), None)
                outer, _, origin = _path(ref, frames, ignore, depth - 1) if index is not None else (None, None, None)
                if outer:
                    return f"{outer}[{index}]", None, origin
            elif not issubclass(type(ref), _CONTAINERS):
                attr = next((k for k, v in _attributes(ref).items() if v is obj), None)
                if attr is not None:
                    outer, _, _ = _path(ref, frames, ignore, depth - 1)
                    return f"{outer or type(ref).__name__}.{attr}", attr, type(ref)
    finally:
        refs.clear()
    return None, None, None


def _attributes(obj: Any) -> dict[str, Any]:
    attrs = getattr(obj, "__dict__", None)
    return attrs if type(attrs) is dict else {}


def _owner(d: dict) -> Any:
    """The object whose attributes D is (its `__dict__`), or the class whose namespace D is; else None."""
    for o in gc.get_referrers(d):
        if getattr(o, "__dict__", None) is d or isinstance(o, type) and any(r is d for r in gc.get_referents(vars(o))):
            return o
    return None


def _weak_owner(inner: dict | set) -> Any:
    """The WeakKeyDictionary, WeakValueDictionary or WeakSet whose entries INNER holds, else None."""
    weak = (weakref.WeakKeyDictionary, weakref.WeakValueDictionary, weakref.WeakSet)
    return next((r for r in gc.get_referrers(inner) if isinstance(r, weak) and r.data is inner), None)


def _module(namespace: dict) -> types.ModuleType | None:
    """The module whose globals NAMESPACE is: where a global's growth line is searched."""
    module = sys.modules.get(namespace.get("__name__", ""))
    return module if module is not None and vars(module) is namespace else None


def storage_ptr(t: torch.Tensor) -> int:
    """T's storage address; 0 for a tensor without memory of its own: meta, sparse, a fake tensor (explain runs
    steps under FakeTensorMode, and one may still be alive), a wrapper subclass."""
    try:
        if t.device.type == "meta" or t.is_sparse or is_fake(t):
            return 0
        return int(t.untyped_storage().data_ptr())
    except Exception:
        return 0


def _nbytes(t: torch.Tensor) -> int:
    try:
        return int(t.untyped_storage().nbytes())
    except Exception:
        return 0


_GROWS = (r"(\[(?:[^\[\]]|\[[^\]]*\])*\]\s*=[^=]|\.(append|appendleft|add|extend|update|insert|setdefault|put)\("
          r"|\s*\+=|\s*=\s*torch\.(cat|stack))")


def _growth_line(name: str, origin: Any, frames: list[types.FrameType]) -> str | None:
    """'file:line' of the first source line that grows NAME (`name[k] = `, `name.append(`, `name += `, ...),
    searched in ORIGIN (a frame or a class) and then in the user's frames; else where NAME is
    assigned in ORIGIN."""
    grows = re.compile(rf"\b{re.escape(name)}(?:{_GROWS}|\s*=\s*{re.escape(name)}\s*\+)")  # or `total = total + x`
    assigned = re.compile(rf"\b{re.escape(name)}\s*=[^=]")
    places = [*_classes(origin)] if isinstance(origin, type) else [origin]
    places += [f for f in frames if f is not origin]
    for pattern in (grows, assigned):
        for place in places:
            found = _search(pattern, place)
            if found:
                return found
    return None


def _classes(cls: type) -> list[type]:
    """CLS, then its bases and subclasses of the user's code: the methods that may grow `self.NAME` (an attribute
    of the class, or of an instance, grown in a base class's method or a subclass's)."""
    found, stack = [cls, *cls.__mro__[1:]], [cls]
    while stack:
        for sub in type.__subclasses__(stack.pop()):
            if sub not in found:
                found.append(sub)
                stack.append(sub)
    return [c for c in found if _is_users(getattr(sys.modules.get(c.__module__), "__file__", None))]


def _is_users(filename: str | None) -> bool:
    """FILENAME is the user's code: not torch's, torchplace's, the standard library's or an installed package's."""
    return bool(filename) and (filename.startswith(user_code.SPECIMENS) or not filename.startswith(_LIBRARIES))


def _search(pattern: re.Pattern[str], place: Any) -> str | None:
    if place is None:
        return None
    is_frame = issubclass(type(place), types.FrameType)
    try:
        if isinstance(place, types.ModuleType) or is_frame and place.f_code.co_name == "<module>":  # the whole file
            filename = place.__file__ if isinstance(place, types.ModuleType) else place.f_code.co_filename
            lines, first = linecache.getlines(filename, vars(place) if not is_frame else place.f_globals), 1
        else:
            target = place.f_code if is_frame else place
            lines, first = inspect.getsourcelines(target)
            filename = inspect.getsourcefile(target) or "?"
    except (OSError, TypeError):
        return None
    for offset, line in enumerate(lines):
        if pattern.search(line.split("#", 1)[0]):
            return f"{os.path.basename(filename)}:{first + offset}"
    return None


# --------------------------------------------------------------------------- containers of given tensors


def containers_of(targets: list[torch.Tensor], *own_lists: Any, limit: int = 5) -> list[tuple[str, list[torch.Tensor]]]:
    """The Python containers (lists, tuples, sets, dicts) that reference TARGETS, most first, each
    described ('a list of 60 items (global 'history' in __main__)') with the targets it holds.

    One traversal of the heap for all targets together. Targets in no container are
    referenced only by local variables or by autograd graphs (saved activations).
    """
    wanted = {id(t): t for t in targets}
    referrers = gc.get_referrers(*targets)  # one traversal of the heap, in C, for all targets
    own = {id(targets), id(wanted), id(referrers), *map(id, own_lists)}
    found: dict[int, tuple[Any, list[torch.Tensor]]] = {}
    for obj in referrers:
        if id(obj) in own or type(obj) not in (list, tuple, set, dict):
            continue
        values = obj.values() if type(obj) is dict else obj
        try:
            hits = [wanted[id(v)] for v in values if id(v) in wanted]
        except RuntimeError:  # a container changed size while we read it
            continue
        if hits:
            found[id(obj)] = (obj, hits)
    referrers.clear()
    ranked = sorted(found.values(), key=lambda item: len(item[1]), reverse=True)[:limit]
    ignore = own | {id(found), id(ranked)} | {id(item) for item in ranked} | {id(item) for item in found.values()}
    out = [(_describe_container(obj, hits[0], ignore), hits) for obj, hits in ranked]
    found.clear()
    ranked.clear()
    return out


def _describe_container(obj: Any, first: Any, ignore: set[int]) -> str:
    if type(obj) is dict:
        key = next((k for k, v in obj.items() if v is first), None)
        return _dict_entry(obj, key, ignore | {id(obj)})
    what = f"a {type(obj).__name__} of {len(obj)} items"
    outer = holder_of(obj, ignore, depth=1)
    return f"{what} ({outer})" if outer else what


def holder_of(obj: Any, ignore: set[int], depth: int = 2) -> str | None:
    """Name what references OBJ: "global 'x' in m", 'Trainer.x', "Linear._parameters['weight']",
    'a list of N items (...)'. None when only local variables or C++ (autograd) hold it."""
    refs = gc.get_referrers(obj)  # one heap scan per call: only for the few objects a report names
    ignore = ignore | {id(obj), id(refs)}
    # a dict subclass whose entries are also attributes (a transformers ModelOutput): its __dict__
    # is the same reference path as its entry, not a second holder
    ignore |= {id(vars(r)) for r in refs if isinstance(r, dict) and type(r) is not dict and hasattr(r, "__dict__")}
    refs = [r for r in refs if id(r) not in ignore]
    for ref in refs:  # named places first: a global, an attribute, a dict entry
        if isinstance(ref, dict):
            key = next((k for k, v in ref.items() if v is obj), None)
            if key is not None:
                return _dict_entry(ref, key, ignore | {id(ref), id(refs)})
        elif type(ref) not in (list, tuple, set):  # an object whose attributes live inline (3.11+)
            attrs = getattr(ref, "__dict__", None)
            key = next((k for k, v in attrs.items() if v is obj), None) if type(attrs) is dict else None
            if key is not None:
                return f"{type(ref).__name__}.{key}"
    for ref in refs:
        if type(ref) in (list, tuple, set):
            what = f"a {type(ref).__name__} of {len(ref)} items"
            outer = holder_of(ref, ignore | {id(ref), id(refs)}, depth - 1) if depth > 1 else None
            return f"{what} ({outer})" if outer else what
    return None


def _dict_entry(d: dict, key: Any, ignore: set[int]) -> str:
    """Name entry KEY of dict D: a module global, an attribute, or an entry of an attribute dict."""
    key = _key_text(key)
    if "__builtins__" in d and "__name__" in d:
        return f"global {key} in {d['__name__']}"
    refs = gc.get_referrers(d)
    ignore = ignore | {id(refs)}
    for ref in refs:
        if id(ref) in ignore:
            continue
        if getattr(ref, "__dict__", None) is d:
            return f"{type(ref).__name__}.{key.strip(chr(39))}"
        if isinstance(ref, type) and any(r is d for r in gc.get_referents(vars(ref))):  # a class attribute
            return f"{ref.__name__}.{key.strip(chr(39))}"
        if isinstance(ref, dict):  # D is an attribute of an object, e.g. a module's _parameters
            attr = next((k for k, v in ref.items() if v is d), None)
            if attr is None:
                continue
            if "__builtins__" in ref and "__name__" in ref:
                return f"{ref['__name__']}.{attr}[{key}]"
            owner = next((o for o in gc.get_referrers(ref) if getattr(o, "__dict__", None) is ref), None)
            if owner is not None:
                return f"{type(owner).__name__}.{attr}[{key}]"
    if type(d) is not dict:  # a dict subclass (a ModelOutput): its type, then what holds it
        outer = holder_of(d, ignore, depth=1)
        return f"{type(d).__name__}[{key}] ({outer})" if outer else f"{type(d).__name__}[{key}]"
    return f"key {key} of a dict of {len(d)} items"


def _key_text(key: Any) -> str:
    if isinstance(key, torch.Tensor):
        return f"<{type(key).__name__} {list(key.shape)}>"
    text = repr(key)
    return text if len(text) <= 60 else text[:57] + "..."
