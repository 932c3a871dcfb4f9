"""Which Python containers hold given tensors, and how to name them for a person.

The memory report and the leak detector both answer "who keeps this tensor alive": a list of 60
items bound to the global `history`, a dict entry `cache['step-3']`. The walk over the referrers
and the naming live here, once.
"""

from __future__ import annotations

import gc
from typing import Any

import torch


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
