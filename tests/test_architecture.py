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
  ``caches/snapshot.py``, which alone calls it). A name a module defines is one it
  binds; a ``_``-string counts only as an entry of its ``__slots__`` (any other string
  would hide a reach, say into mlx-lm's ``_is_distributed``).
* ``importlib.import_module("…")`` (or ``__import__``) with a literal naming one of our
  modules — absolute, or relative with ``package=__package__`` — is an import like any
  other: it counts for cycles and layers.
* Inside ``serving/`` the parts import one way: ``parsers`` < ``guards`` < ``cache`` < ``engine`` <
  ``routes`` < (``app``, ``seam``, the package itself); a module imports its own part and
  the parts below it.
* Nothing under ``serving/routes/agents/`` subclasses an HTTP handler (the agent routes
  call the typed front door, `serving.engine.answer`).
* ``isinstance`` / ``issubclass`` (or ``type(c) is …``) against a cache kind (our cache
  classes, mlx-lm's ``mlx_lm.models.cache`` classes) happens only in ``caches/`` and the
  modules that convert between the two (`KIND_CHECKS`): anywhere else a kind's rule is a
  member of its class.

Each rule runs on planted source too (``tmp_path`` trees), where it must fail.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path
from typing import Dict, Iterator, List, Set, Tuple

ROOT = Path(__file__).resolve().parent.parent

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
    "_exit",  # os._exit: leave without running atexit hooks (guards/lifecycle.exit_now)
    "_option_string_actions",  # argparse: no public lookup of an option's action
    "_load",  # mlx_lm.server.ModelProvider._load: its source is probed (serving/seam.py)
    "_rank",  # mlx_lm.server.ResponseGenerator._rank (serving/app.py)
    "_generate",  # mlx_lm.server.ResponseGenerator._generate: its source is probed (seam.py)
    "_make_logits_processors",  # mlx_lm.server's, wrapped like its run (serving/seam.py)
    "_decode_image",  # mlx_lm.server's image decoding, for count_tokens (agents/conversation.py)
    "_is_distributed",  # mlx_lm.server.ResponseGenerator._is_distributed: rank 0's log (app.py)
    "_serve_single",  # mlx_lm.server.ResponseGenerator._serve_single: its source is probed (seam.py)
    "_make_sampler",  # mlx_lm.server's, wrapped like _make_logits_processors (serving/seam.py)
}
#: Our marker attributes on mlx-lm's objects (``fn._mlx_kvcache_probe = True``: wrapped
#: once): the module that sets one owns it.
MARKER = "_mlx_kvcache_"


#: The modules that convert between our cache classes and mlx-lm's (or read mlx-lm's
#: batch caches), where ``isinstance`` against a cache kind is their job; with
#: ``caches/`` (every kind's own rules), the only places it may appear.
KIND_CHECKS = {
    "mlx_kvcache.serving.cache.native",  # ours <-> mlx-lm's classes at the server's seam
    "mlx_kvcache.serving.cache.padding",  # which mlx-lm batch rows were padded, per kind
    "mlx_kvcache.serving.cache.restored_merge",  # restored KV merged as mlx-lm's batch cache
    "mlx_kvcache.serving.cache.extract",  # mlx-lm's batch extraction, as views
}
#: Kind checks outside those, each waiting for a change under way (the lead empties it):
#: ``(module, line text)``.
KIND_CHECKS_PENDING: Set[Tuple[str, str]] = set()


def _modules(root: Path = ROOT) -> Dict[str, Path]:
    """Every module of the package under ``root``, by dotted name."""
    out = {}
    for p in sorted((root / "mlx_kvcache").rglob("*.py")):
        parts = list(p.relative_to(root).with_suffix("").parts)
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


def _dynamic(mod: str, path: Path, node: ast.Call) -> List[str]:
    """The module an ``importlib.import_module("…")`` / ``__import__("…")`` call in
    ``mod`` names, when it is a literal (relative names resolved against ``mod``'s
    package, as ``package=__package__`` does); [] for any other call."""
    f = node.func
    called = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
    if called not in ("import_module", "__import__") or not node.args:
        return []
    arg = node.args[0]
    if not (isinstance(arg, ast.Constant) and isinstance(arg.value, str)):
        return []
    name = arg.value
    level = len(name) - len(name.lstrip("."))
    if not level:
        return [name]
    return [_source(mod, path, ast.ImportFrom(module=name[level:] or None, names=[], level=level))]


def _imported(mod: str, path: Path, node: ast.AST,
              modules: Dict[str, Path] = MODULES) -> Iterator[str]:
    """Our modules ``node`` (an import statement in ``mod``, or a call importing a
    literal module name) imports."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom):
        target = _source(mod, path, node)
        names = [f"{target}.{a.name}" if f"{target}.{a.name}" in modules else target
                 for a in node.names]
    elif isinstance(node, ast.Call):
        names = _dynamic(mod, path, node)
    else:
        names = []
    for name in names:
        while name not in modules and "." in name:
            name = name.rsplit(".", 1)[0]
        if name in modules and name != mod and name.startswith("mlx_kvcache"):
            yield name


@functools.lru_cache(maxsize=None)
def _tree(path: Path) -> ast.AST:
    return ast.parse(path.read_text(), str(path))


def _graph(modules: Dict[str, Path] = MODULES) -> Dict[str, Set[str]]:
    graph: Dict[str, Set[str]] = {}
    for mod, path in modules.items():
        tree = _tree(path)
        graph[mod] = {d for n in ast.walk(tree)
                      if isinstance(n, (ast.Import, ast.ImportFrom, ast.Call))
                      for d in _imported(mod, path, n, modules)}
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


def _cycle_report(graph: Dict[str, Set[str]]) -> List[str]:
    return ["  " + " , ".join(f"{a} -> {sorted(graph[a] & set(c))}" for a in c)
            for c in _cycles(graph)]


def test_the_import_graph_has_no_cycles():
    detail = _cycle_report(_graph())
    assert not detail, "import cycles among our modules:\n" + "\n".join(detail)


def _layer_violations(graph: Dict[str, Set[str]]) -> List[str]:
    bad = []
    for mod, deps in graph.items():
        layer = _layer(mod)
        if layer not in ALLOWED:  # the package root, testing/: anywhere
            continue
        for d in sorted(deps):
            dl = _layer(d)
            if dl and dl != "testing" and dl not in ALLOWED[layer]:
                bad.append(f"{mod} imports {d}")
            if dl == "testing":
                bad.append(f"{mod} imports {d} (test support, not the package)")
    return bad


def test_layers_import_one_way():
    bad = _layer_violations(_graph())
    assert not bad, "imports against the layer order:\n" + "\n".join(bad)


#: ``serving/``'s parts, lowest first (docs/design.md, "Layers"): a module may import its
#: own part and the parts below it. The package itself (its ``__init__``), ``app`` and
#: ``seam`` sit on top: they put the parts together.
SERVING_PARTS = ["parsers", "guards", "cache", "engine", "routes"]
_SERVING_TOP = len(SERVING_PARTS)


def _serving_rank(mod: str) -> int:
    """Where ``mod`` (a module under ``mlx_kvcache.serving``) stands in the order; -1
    for a module outside ``serving/``."""
    parts = mod.split(".")
    if parts[:2] != ["mlx_kvcache", "serving"]:
        return -1
    if len(parts) > 2 and parts[2] in SERVING_PARTS:
        return SERVING_PARTS.index(parts[2])
    return _SERVING_TOP  # the package, app, seam (and any other top-level module)


def _serving_violations(graph: Dict[str, Set[str]]) -> List[str]:
    bad = []
    for mod, deps in graph.items():
        r = _serving_rank(mod)
        if r < 0:
            continue
        for d in sorted(deps):
            rd = _serving_rank(d)
            if rd > r or (rd == r == _SERVING_TOP and d == "mlx_kvcache.serving"
                          and mod != d):
                bad.append(f"{mod} imports {d}")
    return bad


def test_serving_parts_import_one_way():
    bad = _serving_violations(_graph())
    assert not bad, ("serving/'s parts import one way (parsers < guards < cache < engine < routes < "
                     "app, seam):\n" + "\n".join(bad))


def _defined_names(tree: ast.AST) -> Set[str]:
    """The private names a module defines: its functions and classes (at any depth),
    names it binds, attributes it sets on ``self`` / ``cls`` (and its `MARKER`
    attributes on any object), ``__slots__`` entries
    (the strings of a ``__slots__`` assignment only: a string anywhere else defines
    nothing)."""
    out: Set[str] = set()
    for n in ast.walk(tree):
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(n.name)
        elif isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
            out.add(n.id)
        elif isinstance(n, ast.Attribute) and isinstance(n.ctx, (ast.Store, ast.Del)) \
                and (_is_self(n.value) or n.attr.startswith(MARKER)):
            out.add(n.attr)
        elif isinstance(n, ast.alias):
            out.add((n.asname or n.name).split(".")[0])
        elif isinstance(n, (ast.Assign, ast.AnnAssign)) and n.value is not None and any(
                isinstance(t, ast.Name) and t.id == "__slots__"
                for t in (n.targets if isinstance(n, ast.Assign) else [n.target])):
            out.update(c.value for c in ast.walk(n.value)
                       if isinstance(c, ast.Constant) and isinstance(c.value, str))
    return out


def _is_self(node: ast.AST) -> bool:
    if isinstance(node, ast.Name):
        return node.id in ("self", "cls")
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "super"


def _private_reaches(modules: Dict[str, Path] = MODULES) -> List[Tuple[str, int, str]]:
    out = []
    for mod, path in modules.items():
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
            out.append((_rel(path), n.lineno, name))
        for n in ast.walk(tree):  # ``from .other import _name``
            if not isinstance(n, ast.ImportFrom):
                continue
            src = _source(mod, path, n)
            if not src.startswith("mlx_kvcache"):
                continue
            out.extend((_rel(path), n.lineno, a.name) for a in n.names
                       if a.name.startswith("_") and not a.name.startswith("__")
                       and f"{src}.{a.name}" not in modules)  # (a module: the package's own)
    return out


def _rel(path: Path) -> str:
    """``path`` inside its ``mlx_kvcache`` folder."""
    parts = path.parts
    return "/".join(parts[len(parts) - parts[::-1].index("mlx_kvcache"):])


def test_no_module_reaches_into_another_modules_private_names():
    found = _private_reaches()
    bad = [f"{p}:{line}: ._{name[1:]}" for p, line, name in found]
    assert not bad, "private names of another module:\n" + "\n".join(bad)


# -- isinstance against cache kinds: only in caches/ and the conversion modules -------------
def _aliases(mod: str, path: Path, tree: ast.AST) -> Dict[str, str]:
    """What each imported local name stands for, dotted (``mlc`` -> ``mlx_lm.models.cache``)."""
    out: Dict[str, str] = {}
    for n in ast.walk(tree):
        if isinstance(n, ast.Import):
            for a in n.names:
                if a.asname:
                    out[a.asname] = a.name
                else:
                    top = a.name.split(".")[0]
                    out[top] = top
        elif isinstance(n, ast.ImportFrom):
            src = _source(mod, path, n)
            for a in n.names:
                out[a.asname or a.name] = f"{src}.{a.name}"
    return out


def _dotted(node: ast.AST, aliases: Dict[str, str]) -> str:
    if isinstance(node, ast.Name):
        return aliases.get(node.id, node.id)
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value, aliases)
        return f"{base}.{node.attr}" if base else ""
    return ""


def _kind_names(modules: Dict[str, Path]) -> Set[str]:
    """Our cache kinds' names: the ``…Cache`` classes of ``caches/`` and of the
    conversion modules, and ``LEAF_TYPES`` (the tuple of them)."""
    out = {"LEAF_TYPES"}
    for mod, path in modules.items():
        if mod.startswith("mlx_kvcache.caches") or mod in KIND_CHECKS:
            out.update(n.name for n in ast.walk(_tree(path))
                       if isinstance(n, ast.ClassDef) and n.name.endswith("Cache"))
    return out


def _is_kind(dotted: str, kinds: Set[str]) -> bool:
    if dotted.startswith("mlx_lm.models.cache."):
        return True
    home, _, name = dotted.rpartition(".")
    return name in kinds and (home.startswith("mlx_kvcache.caches") or home in KIND_CHECKS)


def _kind_checks(modules: Dict[str, Path] = MODULES) -> List[Tuple[str, int, str]]:
    """``(module, line, kind)`` of every ``isinstance`` / ``issubclass`` against a cache
    kind (or ``type(c) is …`` / ``in (…)``) outside ``caches/`` and `KIND_CHECKS`."""
    kinds = _kind_names(modules)
    out = []
    for mod, path in modules.items():
        if mod.startswith(("mlx_kvcache.caches", "mlx_kvcache.testing")) or mod in KIND_CHECKS:
            continue
        tree = _tree(path)
        aliases = _aliases(mod, path, tree)
        for n in ast.walk(tree):
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) \
                    and n.func.id in ("isinstance", "issubclass") and len(n.args) == 2:
                against = [n.args[1]]
            elif isinstance(n, ast.Compare) and _is_type_call(n.left):  # type(c) is K
                against = n.comparators
            else:
                continue
            for arg in against:
                for t in arg.elts if isinstance(arg, (ast.Tuple, ast.List, ast.Set)) else [arg]:
                    t = t.value if isinstance(t, ast.Starred) else t
                    d = _dotted(t, aliases)
                    if _is_kind(d, kinds):
                        out.append((mod, n.lineno, d.rsplit(".", 1)[-1]))
    return out


def _is_type_call(node: ast.AST) -> bool:
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
            and node.func.id == "type" and len(node.args) == 1)


def test_cache_kinds_are_told_apart_only_in_caches_and_the_conversions():
    found = [(m, line, k) for m, line, k in _kind_checks() if (m, k) not in KIND_CHECKS_PENDING]
    bad = [f"{m}:{line}: isinstance(…, {k})" for m, line, k in found]
    assert not bad, ("a cache kind's rule belongs to its class in caches/ (or a conversion "
                     "module, KIND_CHECKS):\n" + "\n".join(bad))
    still = {(m, k) for m, _, k in _kind_checks()}
    assert KIND_CHECKS_PENDING <= still, f"done, remove: {KIND_CHECKS_PENDING - still}"


# -- caching off is a value: the manager is never None -------------------------------------
#: ``manager is None`` checks waiting for a change under way (the lead empties it).
NONE_MANAGER_PENDING: Set[str] = set()


def _none_managers(modules: Dict[str, Path] = MODULES) -> List[Tuple[str, int]]:
    """``(module, line)`` of every ``manager is None`` / ``mgr is not None`` /
    ``x.manager is None``: `CacheCore` always holds a manager (`prefix.null.NullManager`
    when caching is off), so such a test is always false — the off path it meant to
    guard would run as if caching were on."""
    out = []
    for mod, path in modules.items():
        for n in ast.walk(_tree(path)):
            if not (isinstance(n, ast.Compare) and len(n.ops) == 1
                    and isinstance(n.ops[0], (ast.Is, ast.IsNot))):
                continue
            sides = [n.left, n.comparators[0]]
            if not any(isinstance(x, ast.Constant) and x.value is None for x in sides):
                continue
            if any((isinstance(x, ast.Name) and x.id in ("manager", "mgr"))
                   or (isinstance(x, ast.Attribute) and x.attr == "manager") for x in sides):
                out.append((mod, n.lineno))
    return out


def test_no_module_asks_whether_the_manager_is_none():
    found = [(m, line) for m, line in _none_managers() if m not in NONE_MANAGER_PENDING]
    assert not found, ("caching off is a NullManager, never None (read why_not where the "
                       "off path must differ):\n" + "\n".join(f"{m}:{line}" for m, line in found))
    still = {m for m, _ in _none_managers()}
    assert NONE_MANAGER_PENDING <= still, f"done, remove: {NONE_MANAGER_PENDING - still}"


# -- each rule fails on planted source -----------------------------------------------------
def _plant(root: Path, files: Dict[str, str]) -> Dict[str, Path]:
    """A package tree under ``root`` (``files``: path inside ``mlx_kvcache/`` -> source,
    every folder's ``__init__.py`` made empty) and its modules."""
    pkg = root / "mlx_kvcache"
    for rel, text in files.items():
        (pkg / rel).parent.mkdir(parents=True, exist_ok=True)
        (pkg / rel).write_text(text)
    for d in [pkg, *(d for d in pkg.rglob("*") if d.is_dir())]:
        (d / "__init__.py").touch()
    return _modules(root)


def test_a_planted_importlib_reach_up_the_serving_parts_fails(tmp_path):
    mods = _plant(tmp_path, {
        "serving/app.py": "from .guards import admin\n",
        "serving/guards/admin.py": (
            "import importlib\n"
            "def late():\n"
            "    return importlib.import_module('mlx_kvcache.serving.app')\n"),
        "serving/cache/store.py": (
            "from importlib import import_module\n"
            "H = import_module('..routes.handler', package=__package__)\n"),
        "serving/routes/handler.py": "from ..cache import store\n",
        "caches/kv.py": "import importlib\nimportlib.import_module('mlx_kvcache.serving.app')\n",
    })
    graph = _graph(mods)
    assert "mlx_kvcache.serving.app" in graph["mlx_kvcache.serving.guards.admin"]
    assert graph["mlx_kvcache.serving.cache.store"] == {"mlx_kvcache.serving.routes.handler"}
    assert _serving_violations(graph) == [
        "mlx_kvcache.serving.cache.store imports mlx_kvcache.serving.routes.handler",
        "mlx_kvcache.serving.guards.admin imports mlx_kvcache.serving.app"]
    assert _layer_violations(graph) == ["mlx_kvcache.caches.kv imports mlx_kvcache.serving.app"]
    assert len(_cycle_report(graph)) == 2  # app <-> guards.admin, store <-> routes.handler


def test_a_planted_private_string_reach_fails(tmp_path):
    mods = _plant(tmp_path, {
        "serving/app.py": (
            "from mlx_lm import server\n"
            "NAMES = ('_hidden_rank',)  # a string names nothing this module defines\n"
            "def rank(gen):\n"
            "    return gen._hidden_rank\n"),
        "caches/kv.py": (
            "class Slotted:\n"
            "    __slots__ = ('_rows',)\n"
            "def rows(c):\n"
            "    return c._rows  # its own slot\n"),
    })
    assert _private_reaches(mods) == [("serving/app.py", 4, "_hidden_rank")]


def test_a_planted_kind_check_outside_caches_fails(tmp_path):
    mods = _plant(tmp_path, {
        "caches/kv.py": "class KVCache:\n    pass\n",
        "caches/__init__.py": "from .kv import KVCache\n",
        "generation/decode.py": (
            "from mlx_lm.models import cache as mlc\n"
            "from ..caches import KVCache\n"
            "def f(c):\n"
            "    return isinstance(c, mlc.ArraysCache) or isinstance(c, (int, KVCache))\n"
            "def k(c):\n"
            "    return type(c) in (mlc.RotatingKVCache, str)\n"),
        "serving/cache/native.py": (
            "import mlx_lm.models.cache as mc\n"
            "def g(c):\n"
            "    return isinstance(c, mc.KVCache)  # a conversion module's job\n"),
        "caches/rollback.py": (
            "from mlx_lm.models.cache import ArraysCache\n"
            "def h(c):\n"
            "    return isinstance(c, ArraysCache)\n"),
    })
    assert sorted(_kind_checks(mods)) == [("mlx_kvcache.generation.decode", 4, "ArraysCache"),
                                          ("mlx_kvcache.generation.decode", 4, "KVCache"),
                                          ("mlx_kvcache.generation.decode", 6, "RotatingKVCache")]


def test_a_planted_manager_is_none_check_fails(tmp_path):
    mods = _plant(tmp_path, {
        "serving/cache/late.py": (
            "def ahead(st, mgr):\n"
            "    if st is None or st.manager is None:\n"
            "        return\n"
            "    return mgr is not None and st.why_not is None\n"),
    })
    assert _none_managers(mods) == [("mlx_kvcache.serving.cache.late", 2),
                                    ("mlx_kvcache.serving.cache.late", 4)]


#: The HTTP handler classes (mlx-lm's, the standard library's, ours): the agent routes reach
#: generation through the typed front door (`serving.engine.answer`), never by running a
#: handler of their own on a made-up request.
HANDLERS = {"BaseHTTPRequestHandler", "APIHandler", "CacheAPIHandler"}


def _handler_subclasses(modules: Dict[str, Path] = MODULES) -> List[Tuple[str, int, str]]:
    """Classes under ``serving/routes/agents/`` that subclass an HTTP handler: (module,
    line, base)."""
    out = []
    for mod, path in modules.items():
        if not mod.startswith("mlx_kvcache.serving.routes.agents"):
            continue
        tree = _tree(path)
        aliases = _aliases(mod, path, tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                for base in node.bases:
                    name = _dotted(base, aliases).rsplit(".", 1)[-1]
                    if name in HANDLERS:
                        out.append((mod, node.lineno, name))
    return out


def test_nothing_under_the_agent_routes_subclasses_the_http_handler():
    bad = _handler_subclasses()
    assert not bad, ("the agent routes call the front door (serving/engine/answer.py); a "
                     "handler subclass under routes/agents/:\n"
                     + "\n".join(f"{m}:{n} subclasses {b}" for m, n, b in bad))


def test_a_planted_handler_subclass_under_the_agent_routes_fails(tmp_path):
    mods = _plant(tmp_path, {
        "serving/routes/agents/run.py": (
            "from mlx_lm.server import APIHandler\n"
            "from .. import handler as h\n"
            "class Run(APIHandler):\n"
            "    pass\n"
            "class Again(h.CacheAPIHandler):\n"
            "    pass\n"
            "class Fine(dict):\n"
            "    pass\n"),
        "serving/routes/handler.py": (
            "from mlx_lm.server import APIHandler\n"
            "class CacheAPIHandler(APIHandler):  # the handler itself lives here\n"
            "    pass\n"),
    })
    assert _handler_subclasses(mods) == [("mlx_kvcache.serving.routes.agents.run", 3,
                                          "APIHandler"),
                                         ("mlx_kvcache.serving.routes.agents.run", 5,
                                          "CacheAPIHandler")]
