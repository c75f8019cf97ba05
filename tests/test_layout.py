"""The package's layout holds: no import cycles, and no import runs back up the layers.

docs/design.md §2 orders the packages; a module imports its own layer or lower
ones, never a higher one, and no two modules import each other, directly or
round a loop. Every import counts, function-local and ``TYPE_CHECKING`` ones
included: a lazy import that runs back up is still a dependency the wrong way.

    api, cli -> protocol -> engine -> constrain -> models -> chat -> backends

The shared vocabulary (``types``, ``errors``, the Rust wrappers ``text``,
``kv``, ``sse``, ``heavy`` and the tool-family table) is importable from every
layer and imports only itself. ``testing`` (helpers for tests) may import
anything, and nothing else imports it.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "python" / "mlx_cairn"

#: Layers from the top; a module may import its own layer or any below it.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("api", "cli"),
    ("protocol",),
    ("engine",),
    ("constrain",),
    ("models",),
    ("chat",),
    ("backends",),
)
#: Modules at the root every layer may import; they import only each other.
SHARED = frozenset({"types", "errors", "text", "kv", "sse", "heavy", "tool_families", "_core"})
#: Helpers for tests: may import anything; nothing in the package imports them.
TESTING = "testing"


def modules(package: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` file (and the extension's stub) under ``package``."""
    root = package.parent
    out: dict[str, Path] = {}
    stubs = [p for p in package.rglob("*.pyi") if not p.with_suffix(".py").exists()]
    for path in sorted([*package.rglob("*.py"), *stubs]):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def imports(name: str, path: Path, known: Iterable[str]) -> set[str]:
    """The package's modules that module ``name`` imports anywhere in its body."""
    known = set(known)
    top = name.split(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                base = base[: len(base) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            # `from pkg import mod` imports the module pkg.mod where there is one.
            targets = [
                f"{module}.{a.name}" if f"{module}.{a.name}" in known else module
                for a in node.names
            ]
        else:
            continue
        for target in targets:
            # `import a.b.c` depends on the deepest module of that name that exists.
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target.split(".")[0] == top and target != name:
                found.add(target)
    return found


def graph(package: Path) -> dict[str, set[str]]:
    mods = modules(package)
    return {name: imports(name, path, mods) for name, path in mods.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == node:
                        break
                if len(group) > 1:
                    found.append(sorted(group))
    return found


def _place(module: str) -> str | int | None:
    """A module's layer index, "shared", "testing", or None for the package root."""
    parts = module.split(".")
    if len(parts) == 1:
        return None
    head = parts[1]
    if head == TESTING:
        return "testing"
    if head in SHARED and len(parts) == 2:
        return "shared"
    for i, layer in enumerate(LAYERS):
        if head in layer:
            return i
    raise AssertionError(f"{module} belongs to no layer: add it to LAYERS or SHARED")


def violations(edges: dict[str, set[str]]) -> list[str]:
    """Every import that breaks the layer order, as ``"a -> b"`` lines."""
    bad = []
    for source, targets in sorted(edges.items()):
        src = _place(source)
        for target in sorted(targets):
            dst = _place(target)
            if src is None or src == "testing" or dst is None:
                continue  # the root facade, and test helpers, may import anything
            if dst == "testing":
                ok = False
            elif src == "shared":
                ok = dst == "shared"
            elif dst == "shared":
                ok = True
            else:
                ok = isinstance(src, int) and isinstance(dst, int) and dst >= src
            if not ok:
                bad.append(f"{source} -> {target}")
    return bad


def test_no_import_cycles() -> None:
    assert cycles(graph(PACKAGE)) == []


def test_imports_follow_the_layers() -> None:
    assert violations(graph(PACKAGE)) == []


def test_every_package_has_a_layer() -> None:
    for module in graph(PACKAGE):
        _place(module)  # raises for a module outside every layer


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    package = tmp_path / "mlx_cairn"
    for rel, text in files.items():
        path = package / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return package


def test_the_checks_see_a_cycle_an_upward_import_and_a_testing_import(tmp_path: Path) -> None:
    package = _tree(
        tmp_path,
        {
            "__init__.py": "",
            "types.py": "",
            "engine/__init__.py": "",
            "engine/a.py": "from mlx_cairn.engine import b\n",
            "engine/b.py": "def f():\n    import mlx_cairn.engine.a\n",
            "models/__init__.py": "",
            "models/m.py": (
                "from typing import TYPE_CHECKING\n"
                "from mlx_cairn.types import X\n"
                "if TYPE_CHECKING:\n    from mlx_cairn.engine.a import Y\n"
            ),
            "chat/__init__.py": "",
            "chat/c.py": "from mlx_cairn.testing.tiny_models import tiny\n",
            "testing/__init__.py": "",
            "testing/tiny_models.py": "from mlx_cairn.engine import a\n",
        },
    )
    edges = graph(package)
    assert cycles(edges) == [["mlx_cairn.engine.a", "mlx_cairn.engine.b"]]
    assert violations(edges) == [
        "mlx_cairn.chat.c -> mlx_cairn.testing.tiny_models",
        "mlx_cairn.models.m -> mlx_cairn.engine.a",
    ]


def test_a_shared_module_imports_only_shared_ones(tmp_path: Path) -> None:
    package = _tree(
        tmp_path,
        {
            "__init__.py": "",
            "errors.py": "",
            "types.py": "from mlx_cairn.errors import E\nfrom mlx_cairn.chat import t\n",
            "chat/__init__.py": "",
            "chat/t.py": "",
        },
    )
    assert violations(graph(package)) == ["mlx_cairn.types -> mlx_cairn.chat.t"]
