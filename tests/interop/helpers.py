"""Fingerprints of batches: what a call may not change, and what its result must equal bit for bit."""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Mapping
from typing import Any

import torch


def tensor_print(t: torch.Tensor, ids: bool = True) -> tuple:
    """T's class, layout, dtype, shape, device, metadata and (on the host) bytes."""
    meta = tuple(sorted((k, repr(v)) for k, v in vars(t).items())) if type(t) is not torch.Tensor else ()
    head = (type(t).__name__, str(t.layout), t.dtype, tuple(t.shape) if not t.is_nested else None, meta,
            t.requires_grad)
    if t.is_meta:
        body: Any = "meta"
    elif t.is_nested:
        body = tuple(tensor_print(u, False) for u in t.unbind())
    elif t.is_quantized:
        body = (t.int_repr().numpy().tobytes(), t.q_scale(), t.q_zero_point())
    elif t.layout is not torch.strided:
        body = tensor_print(t.to_dense(), False)
    else:
        plain = t.detach().as_subclass(torch.Tensor).contiguous().reshape(-1)
        body = plain.view(torch.uint8).numpy().tobytes() if plain.numel() else b""
    return (*head, body, (id(t), str(t.device)) if ids else ())


def fingerprint(x: Any, ids: bool = True) -> Any:
    """X as nested tuples: each container's class (and id, with IDS), each tensor's `tensor_print`."""
    key = (type(x).__name__, id(x)) if ids else (type(x).__name__,)
    if isinstance(x, torch.Tensor):
        return tensor_print(x, ids)
    if isinstance(x, Mapping):
        return (*key, tuple((repr(k), fingerprint(v, ids)) for k, v in x.items()), dict(vars(x)) if ids and
                hasattr(x, "__dict__") and not isinstance(x, dict) else None)
    if isinstance(x, (list, tuple, deque)):
        return (*key, tuple(fingerprint(v, ids) for v in x), getattr(x, "maxlen", None))
    if isinstance(x, (set, frozenset)):
        return (*key, tuple(sorted(repr(fingerprint(v, ids)) for v in x)))
    names = ([f.name for f in dataclasses.fields(x)] if dataclasses.is_dataclass(x) else
             [a.name for a in getattr(type(x), "__attrs_attrs__", ())])
    if names:
        return (*key, tuple((n, fingerprint(getattr(x, n), ids)) for n in names))
    return (*key, repr(x)) if not ids else (*key,)


def on_host(x: Any) -> Any:
    """X's fingerprint without ids or devices: what a move to the host must reproduce exactly."""
    return fingerprint(x, ids=False)
