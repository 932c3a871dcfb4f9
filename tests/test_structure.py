"""The shape of the house, read from the source with `ast` (the library is never imported here).

Three rules (issue 30; docs/architecture.md):
1. no import cycle among torchplace modules, lazy (function-level) imports counted;
2. the layering: each layer imports only the layers below it, and an action package reaches
   another action package only through its face (its __init__), never `pkg.internal_module`;
3. no library file opens anything under tests/.

What counts as an import of module M: `import M`, `from M import name` (M.name when that is a module:
`from pkg import sub` depends on pkg.sub), relative imports resolved, at any depth (inside functions
too), and a string constant naming M in a module that calls `importlib.import_module` (the lazy
tables of torchplace/__init__, cli and doctor). The cycle test adds the pkg/__init__.py that importing
pkg.sub runs first, unless the importer is inside pkg. Imports under `if TYPE_CHECKING:` never run, so
they make no cycle and the cycle test leaves them out; the layering test counts them (an annotation is
a dependency too).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
ROOT = SRC / "torchplace"

# The layers, bottom up. A module may import its own package freely (cycles aside) and any layer below its
# own; within a layer: leaves may import leaves, faces may import faces, and an action package may import
# another action package's face (the package itself: `from torchplace.memory import track_memory`) only.
LEAF, SHARED, FACTS, DECISIONS, ACTION, FACE = "leaf", "shared", "facts", "decisions", "action", "face"
ORDER = [LEAF, SHARED, FACTS, DECISIONS, ACTION, FACE]
LAYERS = {  # top-level module or package under torchplace/ -> its layer
    "_version": LEAF,      # the version string
    "errors": LEAF,        # the one error tree
    "units": LEAF,         # bytes and durations, parsed and printed
    "safeio": LEAF,        # reading files that other users may have written
    "progress": LEAF,      # progress lines on stderr
    "shared": SHARED,      # torch-side plumbing every layer may use: tree walk, wrappers, frames, setters, ...
    "hardware": FACTS,     # what exists: GPUs, the visible map, host, launch environment, snapshots
    "policy": DECISIONS,   # request + facts -> a choice: devices, ranking, resume, precision, threads, determinism
    "placement": ACTION,   # scopes, transfer, split, DeviceLoader
    "checks": ACTION,      # strict mode, watch, explain
    "checkpoint": ACTION,  # save, save_async, load, series, inspect, convert
    "distributed": ACTION,  # tp.dist group, join, health, failures, leases, pick, run
    "memory": ACTION,      # memory report, leak tracker, OOM diagnosis
    "doctor": ACTION,      # the findings of `torchplace doctor`
    "amp": ACTION,         # precision_for, autocast, GradScaler
    "__init__": FACE,      # `import torchplace`: the flat public API
    "__main__": FACE,      # `python -m torchplace`
    "runtime": FACE,       # setup(): the layers tied together at a program's entry
    "cli": FACE,           # the torchplace command
    "bench": FACE,         # torchplace bench
}
SHARED_MAY_IMPORT = {"torchplace.errors", "torchplace.units"}  # shared/ is torch-side plumbing over the error tree


@dataclass(frozen=True)
class Import:
    source: str  # importing module, dotted
    target: str  # imported module, dotted
    line: int
    lazy: bool  # inside a function
    typing_only: bool = False  # under `if TYPE_CHECKING:`
    via_package: bool = False  # the package __init__ that importing one of its modules runs first

    def where(self) -> str:
        how = " (lazy)" if self.lazy else " (TYPE_CHECKING)" if self.typing_only else ""
        return f"{_path(self.source)}:{self.line}{how}{' (its package)' if self.via_package else ''}"


def _modules() -> dict[str, Path]:
    """Dotted module name -> file, for every .py file of the library (a package is its __init__)."""
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _path(module: str) -> str:
    return str(MODULES[module].relative_to(SRC.parent))


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _package_of(module: str) -> str:
    """The package that relative imports in `module` start from."""
    return module if MODULES[module].name == "__init__.py" else module.rpartition(".")[0]


def _resolve(module: str, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    base = _package_of(module).split(".")
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _imports_of(module: str) -> list[Import]:
    """Every torchplace module that `module` imports at run time, at any depth."""
    tree = ast.parse(MODULES[module].read_text(), filename=str(MODULES[module]))
    found: list[Import] = []
    dynamic = False

    def add(target: str, node: ast.stmt | ast.expr, lazy: bool, typing_only: bool) -> None:
        if target in MODULES and target != module:
            found.append(Import(module, target, node.lineno, lazy, typing_only))

    def visit(node: ast.AST, lazy: bool, typing_only: bool) -> None:
        nonlocal dynamic
        if isinstance(node, ast.If) and _is_type_checking(node.test):  # the body runs only under a type checker
            for child in node.body:
                visit(child, lazy, True)
            for child in node.orelse:
                visit(child, lazy, typing_only)
            return
        if isinstance(node, ast.If) and isinstance(node.test, ast.UnaryOp) and isinstance(node.test.op, ast.Not) \
                and _is_type_checking(node.test.operand):
            for child in node.body:
                visit(child, lazy, typing_only)
            for child in node.orelse:
                visit(child, lazy, True)
            return
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name, node, lazy, typing_only)
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(module, node)
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                add(sub if sub in MODULES else base, node, lazy, typing_only)
        elif isinstance(node, ast.Attribute) and node.attr == "import_module":
            dynamic = True
        elif isinstance(node, ast.Name) and node.id == "import_module":
            dynamic = True
        inner = lazy or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        for child in ast.iter_child_nodes(node):
            visit(child, inner, typing_only)

    visit(tree, False, False)
    if dynamic:  # dotted names handed to importlib.import_module: lazy by construction
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and "." in node.value:
                add(node.value, node, True, False)
    return found


IMPORTS = [imp for module in MODULES for imp in _imports_of(module)]


def _with_packages(imports: list[Import]) -> list[Import]:
    """IMPORTS plus the package __init__ each import runs first: importing torchplace.memory.leaks from
    outside memory/ runs memory/__init__.py, which may import more (a package's own modules are left out:
    their package is already being imported)."""
    out = list(imports)
    for imp in imports:
        parts = imp.target.split(".")
        for end in range(2, len(parts)):
            package = ".".join(parts[:end])
            if package in MODULES and not (imp.source == package or imp.source.startswith(package + ".")):
                out.append(Import(imp.source, package, imp.line, imp.lazy, via_package=True))
    return out


RUNTIME_IMPORTS = _with_packages([imp for imp in IMPORTS if not imp.typing_only])


def _top(module: str) -> str:
    """The entry of LAYERS a module belongs to: torchplace.checks.strict -> 'checks', torchplace -> '__init__'."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _cycles(imports: list[Import]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    graph: dict[str, set[str]] = {m: set() for m in MODULES}
    for imp in imports:
        graph[imp.source].add(imp.target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def connect(v: str) -> None:  # recursion depth is bounded by the module count (~200)
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return sorted(out)


def test_every_module_has_a_layer():
    unknown = sorted({_top(m) for m in MODULES} - set(LAYERS))
    assert not unknown, f"add these to LAYERS in {Path(__file__).name}, with their layer: {unknown}"


def test_no_import_cycles():
    report = []
    for component in _cycles(RUNTIME_IMPORTS):
        members = set(component)
        edges = sorted({f"    {imp.source} -> {imp.target}  ({imp.where()})" for imp in RUNTIME_IMPORTS
                        if imp.source in members and imp.target in members})
        report.append(f"cycle among {len(component)} modules: {', '.join(component)}\n" + "\n".join(edges))
    assert not report, "import cycles (lazy imports count: a cycle hidden in a function is still one):\n" + \
        "\n".join(report)


def _violation(imp: Import) -> str | None:
    """Why `imp` breaks the layering, or None."""
    src, dst = _top(imp.source), _top(imp.target)
    if src == dst:
        return None
    have, want = LAYERS.get(src), LAYERS.get(dst)
    if have is None or want is None:
        return None  # test_every_module_has_a_layer names it
    if have == SHARED and imp.target not in SHARED_MAY_IMPORT:
        return f"shared/ imports only {sorted(SHARED_MAY_IMPORT)}"
    rank, other = ORDER.index(have), ORDER.index(want)
    if other < rank:
        return None
    if other > rank:
        return f"{have} ({src}) imports {want} ({dst}), a layer above it"
    if have in (LEAF, FACE):
        return None
    if have == ACTION and imp.target == f"torchplace.{dst}":
        return None  # the other action package's face
    if have == ACTION:
        return f"action {src} reaches into {dst}'s internals; import from its face `torchplace.{dst}`"
    return f"{have} {src} imports {dst}, beside it in the same layer"


def test_layering():
    found = sorted({f"{imp.where()}: {imp.source} -> {imp.target}: {why}"
                    for imp in IMPORTS if (why := _violation(imp))})
    assert not found, f"{len(found)} imports break the layering (table: LAYERS in {Path(__file__).name}):\n" + \
        "\n".join(found)


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of the docstring constants of a module and of its classes and functions (prose, not paths)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                out.add(id(first.value))
    return out


def _names_tests(text: str) -> bool:
    parts = text.replace("\\", "/").split("/")
    return "tests" in parts


def test_the_library_reads_nothing_under_tests():
    found = []
    for module, path in MODULES.items():
        tree = ast.parse(path.read_text())
        prose = _docstrings(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in prose \
                    and _names_tests(node.value) and (node.value == "tests" or " " not in node.value):
                found.append(f"{_path(module)}:{node.lineno}: {node.value!r}")
    assert not found, "library files name a path under tests/ (a wheel has no tests/; move the file into " \
        "the package):\n" + "\n".join(found)


def test_the_rules_catch_what_they_are_for():
    """The checker itself, on made-up imports: each rule flags its case and lets the allowed ones pass."""
    def imp(source: str, target: str) -> Import:
        return Import(source, target, 1, False)

    refused = [imp("torchplace.hardware.facts", "torchplace.policy.devices"),  # facts -> decisions
               imp("torchplace.policy.devices", "torchplace.placement.scope"),  # decisions -> actions
               imp("torchplace.shared.tree", "torchplace.hardware.facts"),  # shared -> facts
               imp("torchplace.checks.strict", "torchplace.checkpoint.state_dicts"),  # another action's internals
               imp("torchplace.memory.leaks", "torchplace"),  # an action -> the face
               imp("torchplace.errors", "torchplace.shared.tree")]  # a leaf -> shared
    allowed = [imp("torchplace.checks.strict", "torchplace.checkpoint"),  # another action's face
               imp("torchplace.checks.strict", "torchplace.checks.frames"),  # its own package
               imp("torchplace.placement.scope", "torchplace.policy.devices"),
               imp("torchplace.policy.devices", "torchplace.hardware.launch"),
               imp("torchplace.hardware.facts", "torchplace.safeio"),
               imp("torchplace.shared.tree", "torchplace.errors"),
               imp("torchplace.cli.map", "torchplace.checkpoint.loading")]  # a face may reach anywhere
    assert all(_violation(i) for i in refused), [i for i in refused if not _violation(i)]
    assert not any(_violation(i) for i in allowed), [(i, _violation(i)) for i in allowed if _violation(i)]
    ring = [imp("torchplace.hardware.facts", "torchplace.hardware.host"),
            imp("torchplace.hardware.host", "torchplace.hardware.facts")]
    assert _cycles(ring) == [["torchplace.hardware.facts", "torchplace.hardware.host"]]
    assert _cycles(ring[:1]) == []
