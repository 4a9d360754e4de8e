"""The package's structure, read from its source (no models, no MLX work).

* Our import graph — module-level *and* function-level ``import`` / ``from`` of
  ``mlx_kvcache`` modules, ``TYPE_CHECKING`` blocks included — has no cycles, and the
  layers import one way (docs/design.md, "Layers: the folder tree is the architecture").
* No module reaches into another of our modules' private names: ``obj._name`` where
  ``_name`` is not defined in the module that uses it and ``obj`` is not ``self``,
  ``cls`` or ``super()``, nor ``from .other import _name``. A private name is that
  module's business; another module that needs it gets a public verb. A hook a module
  defines on its own class hierarchy and calls there is its own (``Snapshot.from_arrays``
  calls the ``_from_arrays`` each snapshot kind overrides: the hook is defined in
  ``caches/snapshot.py``, which alone calls it).
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path
from typing import Dict, Iterator, List, Set, Tuple

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "mlx_kvcache"

#: Each layer (docs/design.md's table: caches 1, prefix 2-3, store 4, generation and
#: serving 5, models and cli 6) may import itself and the layers listed; `testing/` (what
#: tests and benchmarks share) imports anything and nothing in the package imports it.
_BELOW = ["caches", "prefix", "store", "generation", "serving"]
ALLOWED = {
    "caches": {"caches"},
    "prefix": {"prefix", "caches"},
    "store": {"store", "prefix", "caches"},
    "generation": {"generation", "store", "prefix", "caches"},
    "serving": {"serving", "generation", "store", "prefix", "caches"},
    "models": {"models", *_BELOW},
    "cli": {"cli", "models", *_BELOW},
}

#: Private names of the standard library and of mlx-lm, read on purpose (this test cannot
#: tell whose attribute ``obj._name`` is, so each is named here with its owner).
FOREIGN_PRIVATE = {
    "_exit",  # os._exit: leave without running atexit hooks
    "_option_string_actions",  # argparse: no public lookup of an option's action
    "_load",  # mlx_lm.server.ModelProvider._load: its source is probed (serving/seam.py)
    "_rank",  # mlx_lm.server.ResponseGenerator._rank (serving/app.py)
    "_generate",  # mlx_lm.server.ResponseGenerator._generate: its source is probed (seam.py)
    "_make_logits_processors",  # mlx_lm.server's, wrapped like its run (serving/seam.py)
    "_decode_image",  # mlx_lm.server's image decoding, for count_tokens (agents/conversation.py)
}


def _modules() -> Dict[str, Path]:
    out = {}
    for p in sorted(PKG.rglob("*.py")):
        parts = list(p.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


MODULES = _modules()


def _source(mod: str, path: Path, node: ast.ImportFrom) -> str:
    """The module ``from ... import`` names in ``mod`` (relative imports resolved)."""
    if not node.level:
        return node.module or ""
    base = mod.split(".")
    if path.name != "__init__.py":
        base = base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _imported(mod: str, path: Path, node: ast.AST) -> Iterator[str]:
    """Our modules ``node`` (an import statement in ``mod``) imports."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        target = _source(mod, path, node)
        names = [f"{target}.{a.name}" if f"{target}.{a.name}" in MODULES else target
                 for a in node.names]
    for name in names:
        while name not in MODULES and "." in name:
            name = name.rsplit(".", 1)[0]
        if name in MODULES and name != mod and name.startswith("mlx_kvcache"):
            yield name


@functools.lru_cache(maxsize=None)
def _tree(path: Path) -> ast.AST:
    return ast.parse(path.read_text(), str(path))


def _graph() -> Dict[str, Set[str]]:
    graph: Dict[str, Set[str]] = {}
    for mod, path in MODULES.items():
        tree = _tree(path)
        graph[mod] = {d for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))
                      for d in _imported(mod, path, n)}
    return graph


def _cycles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on: Set[str] = set()
    out: List[List[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _layer(mod: str) -> str:
    parts = mod.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in ALLOWED) else ""


def test_the_import_graph_has_no_cycles():
    graph = _graph()
    cycles = _cycles(graph)
    detail = ["  " + " , ".join(f"{a} -> {sorted(graph[a] & set(c))}" for a in c) for c in cycles]
    assert not cycles, "import cycles among our modules:\n" + "\n".join(detail)


def test_layers_import_one_way():
    bad = []
    for mod, deps in _graph().items():
        layer = _layer(mod)
        if layer not in ALLOWED:  # the package root, testing/: anywhere
            continue
        for d in sorted(deps):
            dl = _layer(d)
            if dl and dl != "testing" and dl not in ALLOWED[layer]:
                bad.append(f"{mod} imports {d}")
            if dl == "testing":
                bad.append(f"{mod} imports {d} (test support, not the package)")
    assert not bad, "imports against the layer order:\n" + "\n".join(bad)


def _defined_names(tree: ast.AST) -> Set[str]:
    """The private names a module defines: its functions and classes (at any depth),
    names it binds, attributes it sets on ``self`` / ``cls``, ``__slots__`` entries."""
    out: Set[str] = set()
    for n in ast.walk(tree):
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(n.name)
        elif isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
            out.add(n.id)
        elif isinstance(n, ast.Attribute) and isinstance(n.ctx, (ast.Store, ast.Del)) \
                and _is_self(n.value):
            out.add(n.attr)
        elif isinstance(n, ast.alias):
            out.add((n.asname or n.name).split(".")[0])
        elif isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value.startswith("_"):
            out.add(n.value)  # __slots__
    return out


def _is_self(node: ast.AST) -> bool:
    if isinstance(node, ast.Name):
        return node.id in ("self", "cls")
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "super"


def _private_reaches() -> List[Tuple[str, int, str]]:
    out = []
    for mod, path in MODULES.items():
        if mod.startswith("mlx_kvcache.testing"):
            continue  # test support reads whatever a test would
        tree = _tree(path)
        own = _defined_names(tree)
        for n in ast.walk(tree):
            if not isinstance(n, ast.Attribute):
                continue
            name = n.attr
            if not name.startswith("_") or name.startswith("__") or name in own:
                continue
            if _is_self(n.value) or name in FOREIGN_PRIVATE:
                continue
            out.append((str(path.relative_to(PKG)), n.lineno, name))
        for n in ast.walk(tree):  # ``from .other import _name``
            if not isinstance(n, ast.ImportFrom):
                continue
            src = _source(mod, path, n)
            if not src.startswith("mlx_kvcache"):
                continue
            out.extend((str(path.relative_to(PKG)), n.lineno, a.name) for a in n.names
                       if a.name.startswith("_") and not a.name.startswith("__")
                       and f"{src}.{a.name}" not in MODULES)  # (a module: the package's own)
    return out


def test_no_module_reaches_into_another_modules_private_names():
    found = _private_reaches()
    bad = [f"{p}:{line}: ._{name[1:]}" for p, line, name in found]
    assert not bad, "private names of another module:\n" + "\n".join(bad)
