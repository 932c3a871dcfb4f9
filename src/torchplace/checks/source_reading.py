"""The static side of reading the caller's code (caller_code.py): the source of a frame's function
parsed once per file version, its own statements in order, what each name is assigned where.

Nothing here looks at live objects; caller_code.py resolves names to the frame's values.
"""

from __future__ import annotations

import ast
import linecache
from types import FrameType

KEEPS_PLACE = frozenset({"train", "eval", "zero_grad", "step", "backward", "append", "extend", "requires_grad_",
                          "add_", "mul_", "sub_", "div_", "copy_", "zero_", "fill_", "clamp_", "register_forward_hook"})
_TREES: dict[str, tuple[str, ast.Module | None]] = {}  # filename -> (source text, its tree), a few files


def tree_of(frame: FrameType) -> ast.Module | None:
    filename = frame.f_code.co_filename
    text = "".join(linecache.getlines(filename, frame.f_globals))
    if not text:
        return None
    cached = _TREES.get(filename)
    if cached is None or cached[0] != text:
        try:
            tree: ast.Module | None = ast.parse(text)
        except SyntaxError:
            tree = None
        if len(_TREES) > 64:
            _TREES.clear()
        cached = _TREES[filename] = (text, tree)
    return cached[1]


def scope_of(frame: FrameType) -> ast.AST | None:
    """The function (or module) node that FRAME runs."""
    tree = tree_of(frame)
    code = frame.f_code
    if tree is None or code.co_name == "<module>":
        return tree
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == code.co_name:
            if min([node.lineno, *(d.lineno for d in node.decorator_list)]) == code.co_firstlineno:
                return node
        elif isinstance(node, ast.Lambda) and code.co_name == "<lambda>" and node.lineno == code.co_firstlineno:
            return node
    return None


def own_nodes(scope: ast.AST) -> list[ast.AST]:
    """Every node of the function itself (not of functions, lambdas or classes defined in it)."""
    nested = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)
    out: list[ast.AST] = []
    todo = [scope.body] if isinstance(scope, ast.Lambda) else list(getattr(scope, "body", []))
    while todo:
        node = todo.pop()
        if isinstance(node, nested):
            continue
        out.append(node)
        todo.extend(ast.iter_child_nodes(node))
    return sorted((n for n in out if hasattr(n, "lineno")), key=lambda n: (line_of(n), getattr(n, "col_offset", 0)))


def line_of(node: ast.AST) -> int:
    return int(getattr(node, "lineno", 0))


def assignments(nodes: list[ast.AST]) -> dict[str, list[tuple[int, ast.AST | None, ast.AST]]]:
    """name -> [(line, the value assigned, or None when unknown; the statement)]. A statement calling a method
    of a name (`criterion.to(dev)`, `batch.update(...)`) counts as an unknown assignment: it may move it."""
    out: dict[str, list[tuple[int, ast.AST | None, ast.AST]]] = {}
    for node in nodes:
        pairs: list[tuple[ast.AST | None, ast.AST | None]] = []
        if isinstance(node, ast.Assign):
            pairs = [(t, node.value if isinstance(t, ast.Name) else None) for t in node.targets]
        elif isinstance(node, ast.AnnAssign):
            pairs = [(node.target, node.value if isinstance(node.target, ast.Name) else None)]
        elif isinstance(node, (ast.AugAssign, ast.For, ast.AsyncFor, ast.NamedExpr)):
            pairs = [(node.target, None)]
        elif isinstance(node, (ast.With, ast.AsyncWith)):
            pairs = [(i.optional_vars, None) for i in node.items]
        elif isinstance(node, ast.Expr):
            pairs = [(mutated(node.value), None)]
        for target, value in pairs:
            for name in {n.id for n in ast.walk(target) if isinstance(n, ast.Name)} if target else ():
                out.setdefault(name, []).append((line_of(node), value, node))
    return out


def comprehension_names(nodes: list[ast.AST]) -> set[int]:
    """The Name nodes that a comprehension binds itself: whatever the frame holds under that name is not them."""
    out: set[int] = set()
    for node in nodes:
        if isinstance(node, (ast.ListComp, ast.SetComp, ast.GeneratorExp, ast.DictComp)):
            names = {t.id for g in node.generators for t in ast.walk(g.target) if isinstance(t, ast.Name)}
            out |= {id(n) for n in ast.walk(node) if isinstance(n, ast.Name) and n.id in names}
    return out


def root_name(node: ast.AST) -> ast.Name | None:
    while isinstance(node, (ast.Attribute, ast.Subscript, ast.Call)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node if isinstance(node, ast.Name) else None


def mutated(node: ast.AST) -> ast.Name | None:
    """`criterion.to(dev)`, `batch.update(...)`: a method called on a name, as a statement."""
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and isinstance(node.func.value, ast.Name)
            and node.func.attr not in KEEPS_PLACE):
        return node.func.value
    return None
