"""Which model the keys of a saved state dict belong to: wrapper prefixes, decided by matching.

Other tools' files name a model's tensors through the objects that wrapped it: DistributedDataParallel
and DataParallel (`module.`), torch.compile (`_orig_mod.`, at the start, or inside when only a
submodule was compiled), a LightningModule holding the model as `self.model` (`model.`), Lightning
Fabric (`_forward_module.`), or any one child holding the whole model (`self.net`, `self.backbone`). The
same names are also real submodules (an EMA wrapper keeps its model as `self.module`), so no prefix is
stripped by name alone:

- `match(file_keys, model)` tries the keys as they are first, then every way of removing those
  names from the file's keys (at the start, or `_orig_mod` / `module` inside) and of removing them
  from the model's keys (a model with compiled submodules, a wrapper given a plain model's file),
  cheapest first, and takes the first under which every saved key names a tensor of the model.
  `select(sd, prefix)` takes the keys under an explicit prefix (load's `prefix=`).
- Without a model, `clean` removes only what is unambiguous: torch.compile's `_orig_mod` at any
  depth (no other code names a module so). A leading `module.` may be DDP's or a real submodule:
  it is kept, and said so.

The state dict's `_metadata` (each module's version, read by BatchNorm, quantization observers and
other modules that migrate old checkpoints) is keyed by module path and is renamed the same way.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from itertools import product
from typing import Any

from torch import nn

WRAPPER_NAMES = ("module", "_orig_mod", "model", "_forward_module")
INNER_NAMES = ("_orig_mod", "module")  # wrappers that also sit inside a model (compiled or DDP'd submodules)
COMPILED = "_orig_mod"

Segments = tuple[str, ...]


@dataclass(frozen=True)
class Rewrite:
    """How saved keys become the model's: segments removed from the file's keys and from the model's."""

    file_lead: Segments = ()
    file_inner: frozenset[str] = frozenset()
    model_lead: Segments = ()
    model_inner: bool = False

    @property
    def cost(self) -> int:
        return len(self.file_lead) + len(self.file_inner) + len(self.model_lead) + int(self.model_inner)

    def describe(self) -> str:
        parts = []
        if self.file_lead:
            parts.append(f"stripped {_dotted(self.file_lead)!r} from the start of the saved keys")
        for name in sorted(self.file_inner):
            parts.append(f"removed {name + '.'!r} inside the saved keys")
        if self.model_lead:
            parts.append(f"added the model's {_dotted(self.model_lead)!r} in front of the saved keys")
        if self.model_inner:
            parts.append("added '_orig_mod.' where the model has compiled submodules")
        return "; ".join(parts) or "keys used as saved"


def _dotted(segments: Segments) -> str:
    return "".join(s + "." for s in segments)


def _split(path: str) -> Segments:
    return tuple(path.split(".")) if path else ()


def _canon(segments: Segments, lead: Segments, inner: frozenset[str] | set[str]) -> Segments | None:
    """SEGMENTS without LEAD (None if they do not start with it) and without the INNER names."""
    if segments[:len(lead)] != lead:
        return None
    rest = segments[len(lead):]
    return tuple(s for s in rest if s not in inner) if inner else rest


def _canon_key(key: str, lead: Segments, inner: frozenset[str] | set[str]) -> str | None:
    *modules, leaf = key.split(".")
    if len(modules) < len(lead):
        return None  # the prefix would swallow the tensor's own name
    kept = _canon(tuple(modules), lead, inner)
    return None if kept is None else ".".join((*kept, leaf))


def _common_lead(keys: list[str], any_child: bool = False) -> Segments:
    """The longest run of wrapper names every key starts with (leaving each key its tensor name); with
    ANY_CHILD, the first may be any name: the one child that holds the model (a LightningModule's
    `self.net`, `self.backbone`)."""
    if not keys:
        return ()
    split = [k.split(".")[:-1] for k in keys]
    run: list[str] = []
    for i, name in enumerate(split[0]):
        named = name in WRAPPER_NAMES or (any_child and i == 0)
        if not named or any(len(s) <= i or s[i] != name for s in split):
            break
        run.append(name)
    return tuple(run)


def _inner_names(keys: list[str], lead: Segments, names: tuple[str, ...]) -> set[str]:
    found: set[str] = set()
    for k in keys:
        found.update(s for s in k.split(".")[len(lead):-1] if s in names)
    return found


@dataclass
class KeyMatch:
    """The chosen rewrite, the saved key -> model key map, and how many saved keys it matched."""

    rewrite: Rewrite
    mapping: dict[str, str]
    matched: int
    total: int
    model_modules: dict[Segments, list[str]] = field(default_factory=dict)

    @property
    def complete(self) -> bool:
        return self.matched == self.total

    @property
    def changed(self) -> bool:
        return self.rewrite != Rewrite()

    @property
    def stripped_prefix(self) -> str:
        return _dotted(self.rewrite.file_lead)

    def note(self) -> str | None:
        if not self.changed:
            return None
        how = "every saved key" if self.complete else f"{self.matched} of {self.total} saved keys"
        return f"model keys: {self.rewrite.describe()} ({how} then named a tensor of the model)"

    def apply(self, sd: Mapping[str, Any], versions: Mapping[str, Any] | None) -> OrderedDict[str, Any]:
        """SD renamed into the model's keys, with `_metadata` renamed the same way (VERSIONS, or SD's own)."""
        out: OrderedDict[str, Any] = OrderedDict((self.mapping.get(k, k), v) for k, v in sd.items())
        meta = versions if versions is not None else getattr(sd, "_metadata", None)
        if meta:
            out._metadata = self.rename_versions(meta)  # type: ignore[attr-defined]
        return out

    def rename_versions(self, versions: Mapping[str, Any]) -> OrderedDict[str, Any]:
        if not self.changed:
            return OrderedDict((k, dict(v)) for k, v in versions.items() if isinstance(v, Mapping))
        rw = self.rewrite
        renamed: OrderedDict[str, Any] = OrderedDict()
        # the shorter path first, so a compiled submodule's inner module (longer) wins over its wrapper
        for path in sorted((p for p in versions if isinstance(p, str)), key=lambda p: len(_split(p))):
            value = versions[path]
            canon = _canon(_split(path), rw.file_lead, rw.file_inner)
            if canon is None or not isinstance(value, Mapping):
                continue  # a wrapper's own entry (e.g. the LightningModule around the model)
            for target in self.model_modules.get(canon, []):
                renamed[target] = dict(value)
        return renamed


def _model_side(keys: list[str], lead: Segments, inner: bool) -> dict[str, str] | None:
    """{canonical key: model key}, or None when the canonical keys collide or a key lacks LEAD."""
    names = frozenset({COMPILED}) if inner else frozenset()
    out: dict[str, str] = {}
    for k in keys:
        c = _canon_key(k, lead, names)
        if c is None or c in out:
            return None
        out[c] = k
    return out


def match(file_keys: list[str], model: nn.Module) -> KeyMatch:
    """How FILE_KEYS (a saved model state dict's keys) map onto MODEL's state-dict keys.

    The keys as saved when they all match; else the cheapest rewrite under which every saved key
    matches; else the rewrite that matches the most (strictly more than as saved), so a partial
    load (strict=False) still gets the prefixes right.
    """
    sd = model.state_dict()
    model_keys = list(sd)
    module_paths = list(getattr(sd, "_metadata", None) or {}) or [n for n, _ in model.named_modules()]
    expected = set(model_keys)
    total = len(file_keys)
    identity = sum(1 for k in file_keys if k in expected)
    best = KeyMatch(Rewrite(), {}, identity, total, {_split(p): [p] for p in module_paths})
    if identity == total:
        return best
    file_lead = _common_lead(file_keys, any_child=True)
    file_inner = sorted(_inner_names(file_keys, (), INNER_NAMES), key=INNER_NAMES.index)
    model_lead = _common_lead(model_keys, any_child=True)
    model_compiled = bool(_inner_names(model_keys, (), (COMPILED,)))
    inner_options = [frozenset(file_inner[:n]) for n in range(len(file_inner) + 1)]
    compiled_options = (False, True) if model_compiled else (False,)
    candidates = [Rewrite(file_lead[:a], inner, model_lead[:b], mi)
                  for a, inner, b, mi in product(range(len(file_lead) + 1), inner_options,
                                                 range(len(model_lead) + 1), compiled_options)]
    for rw in sorted(candidates, key=lambda r: (len(r.file_inner) + r.model_inner, r.cost))[1:]:  # leads first
        side = _model_side(model_keys, rw.model_lead, rw.model_inner)
        if side is None:
            continue
        mapping: dict[str, str] = {}
        taken: set[str] = set()
        for k in file_keys:
            c = _canon_key(k, rw.file_lead, rw.file_inner)
            if c is not None and c in side and side[c] not in taken:
                mapping[k] = side[c]
                taken.add(side[c])
        if len(mapping) > best.matched:
            modules: dict[Segments, list[str]] = {}
            names = frozenset({COMPILED}) if rw.model_inner else frozenset()
            for p in module_paths:
                c = _canon(_split(p), rw.model_lead, names)
                if c is not None:
                    modules.setdefault(c, []).append(p)
            best = KeyMatch(rw, mapping, len(mapping), total, modules)
            if best.complete:
                break
    return best


def select(sd: Mapping[str, Any], prefix: str, versions: Mapping[str, Any] | None = None
           ) -> OrderedDict[str, Any] | None:
    """The entries of SD whose keys start with PREFIX (e.g. 'encoder.'), with PREFIX removed (and the module
    versions, VERSIONS or SD's `_metadata`, likewise), or None when no key does."""
    dotted = prefix if prefix.endswith(".") else prefix + "."
    out: OrderedDict[str, Any] = OrderedDict((k[len(dotted):], v) for k, v in sd.items()
                                             if k.startswith(dotted) and len(k) > len(dotted))
    if not out:
        return None
    meta = versions if versions is not None else getattr(sd, "_metadata", None)
    if isinstance(meta, Mapping):
        out._metadata = OrderedDict(  # type: ignore[attr-defined]
            (k[len(dotted):] if k != dotted[:-1] else "", v) for k, v in meta.items()
            if isinstance(k, str) and (k == dotted[:-1] or k.startswith(dotted)))
    return out


def clean(sd: Mapping[str, Any], versions: Mapping[str, Any] | None = None
          ) -> tuple[OrderedDict[str, Any], OrderedDict[str, Any] | None, int]:
    """SD without torch.compile's `_orig_mod.` at any depth (keys and `_metadata`, or VERSIONS), and how
    many keys changed. Nothing changes when two keys would become one."""
    meta = versions if versions is not None else getattr(sd, "_metadata", None)
    renamed = {k: (_canon_key(k, (), {COMPILED}) or k) if COMPILED in k else k
               for k in sd}  # a key without the name is kept as is, unsplit (most keys: saves time per save)
    changed = sum(1 for k, v in renamed.items() if k != v)
    if changed and len(set(renamed.values())) != len(renamed):
        renamed, changed = {k: k for k in sd}, 0
    out: OrderedDict[str, Any] = OrderedDict((renamed[k], v) for k, v in sd.items())
    new_meta: OrderedDict[str, Any] | None = None
    if meta:
        new_meta = OrderedDict()
        for path in sorted((p for p in meta if isinstance(p, str)), key=lambda p: len(_split(p))):
            if isinstance(meta[path], Mapping):
                name = ".".join(s for s in _split(path) if s != COMPILED) if changed else path
                new_meta[name] = dict(meta[path])
        out._metadata = new_meta  # type: ignore[attr-defined]
    return out, new_meta, changed


def leading_wrapper_note(keys: list[str]) -> str | None:
    """A note when every key starts with a wrapper's name that `clean` keeps (it may be a real submodule)."""
    lead = [s for s in _common_lead(keys) if s != COMPILED]
    if not lead:
        return None
    return (f"every model key starts with {_dotted(tuple(lead))!r}, kept: it is a wrapper's prefix or a real "
            "submodule (an EMA wrapper's `module`, a LightningModule's `model`); torchplace.load(path, model=...) "
            "decides by matching your model's keys")


def versions_of(sd: Any) -> dict[str, dict[str, Any]] | None:
    """A state dict's `_metadata` as plain JSON-able maps, or None."""
    meta = getattr(sd, "_metadata", None)
    if not isinstance(meta, Mapping):
        return None
    return {k: {kk: vv for kk, vv in v.items() if isinstance(kk, str) and isinstance(vv, (int, float, str, bool))}
            for k, v in meta.items() if isinstance(k, str) and isinstance(v, Mapping)}
