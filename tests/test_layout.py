"""The package's layout keeps its promises: the algorithm imports nothing from Megatron, the federation
nothing from the Megatron adapter, and no module or class grows past what one reading holds."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "megatron_diloco"
ALGORITHM = PACKAGE / "algorithm"
MODULE_LINES, CLASS_LINES = 600, 400


def _imports(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
    return names


def _imports_nothing_from(folder: Path, forbidden: tuple[str, ...]) -> list[Path]:
    """Assert that no module under ``folder`` imports (also inside functions) a module named or under
    ``forbidden``, and that importing them all loads none; returns the modules."""
    modules = sorted(folder.rglob("*.py"))
    hit = lambda n: any(n == f or n.startswith(f + ".") for f in forbidden)  # noqa: E731
    for path in modules:
        bad = [n for n in _imports(path) if hit(n)]
        assert not bad, (path, bad)
    names = [".".join(p.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__") for p in modules]
    code = ("import sys\n" + "".join(f"import {n}\n" for n in names)
            + f"print(sorted(m for m in sys.modules if any(m == f or m.startswith(f + '.') for f in {forbidden!r})))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=PACKAGE.parent)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout
    return modules


def test_the_algorithm_imports_nothing_from_megatron():
    """No ``import megatron...`` anywhere under ``megatron_diloco/algorithm`` (also inside functions),
    nor of the adapter; and importing every algorithm module loads neither."""
    assert len(_imports_nothing_from(ALGORITHM, ("megatron", "megatron_diloco.megatron_adapter"))) > 10


def test_the_federation_depends_on_the_algorithm_only():
    """``megatron_diloco/federation`` imports nothing from the Megatron adapter (nor Megatron): it stands on
    the algorithm, torch and torchft; importing it loads neither."""
    _imports_nothing_from(PACKAGE / "federation", ("megatron", "megatron_diloco.megatron_adapter"))


def test_no_module_or_class_past_one_reading():
    """No module over 600 lines and no class over 400."""
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text()
        assert len(text.splitlines()) <= MODULE_LINES, (path, len(text.splitlines()))
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef):
                assert node.end_lineno - node.lineno + 1 <= CLASS_LINES, (path, node.name)


def _private_reaches(path: Path) -> list[str]:
    """Underscored (not dunder) attributes that ``path`` reads, writes or calls on anything but ``self`` / ``cls``
    or a module it imports (``torch._foreach_*``): another object's private state."""
    tree = ast.parse(path.read_text())
    modules = {(a.asname or a.name).split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
               for a in node.names}
    return [f"{path.name}:{node.lineno}: {ast.unparse(node)}" for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
            and not (isinstance(node.value, ast.Name) and node.value.id in {"self", "cls", *modules})]


def test_one_seam_between_rounds_and_membership():
    """The boundary protocols reach the federation only through the round rules (``algorithm/rounds.py``):
    no algorithm module but the federation's own imports ``algorithm/federated.py`` (``sync.py`` included);
    the protocols never branch on the federation; and the protocols, the rules and the federation use each
    other's public methods only (no ``sync._...`` anywhere across the seam)."""
    federated = "megatron_diloco.algorithm.federated"
    for path in sorted(ALGORITHM.rglob("*.py")):
        if path.name != "federated.py":
            assert federated not in _imports(path), path
    for name in ("protocols.py", "rounds.py"):
        attrs = {n.attr for n in ast.walk(ast.parse((ALGORITHM / name).read_text())) if isinstance(n, ast.Attribute)}
        assert "federated" not in attrs, name
    for name in ("federated.py", "rounds.py", "protocols.py"):
        assert not _private_reaches(ALGORITHM / name), _private_reaches(ALGORITHM / name)


ADAPTER = PACKAGE / "megatron_adapter"
#: the optimizer and its parts (the checkpoint codec, the restart rules, the forwarded names, the shard table)
OPTIMIZER_MODULES = ("optimizer", "checkpoint", "restart", "forwarding", "shard_layout")
#: import edges the circle rule leaves aside, each with the change that removes it (the test fails once it is
#: gone, so that the exception goes with it)
CIRCLE_EXCEPTIONS: set[tuple[str, str]] = set()


def _module_name(path: Path) -> str:
    return ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")


def _import_graph() -> dict[str, set[str]]:
    """Package module -> the package modules it imports: every import statement, at the top, inside
    functions and under ``TYPE_CHECKING`` alike (``from pkg import name`` counts as ``pkg.name`` when
    that is a module, else as ``pkg``)."""
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                edges |= {a.name for a in node.names if a.name in modules}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(parts + ([node.module] if node.module else []))
                for alias in node.names:
                    full = f"{base}.{alias.name}"
                    edges.add(full if full in modules else base)
        graph[name] = {m for m in edges if m in modules and m != name}
    return graph


def _circles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(component)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_circle():
    """No import circle in the package, ``TYPE_CHECKING`` and function-level imports included (the
    :data:`CIRCLE_EXCEPTIONS` edges aside, each of which must still exist)."""
    graph = _import_graph()
    for source, target in CIRCLE_EXCEPTIONS:
        assert target in graph[source], f"{source} no longer imports {target}: drop it from CIRCLE_EXCEPTIONS"
        graph[source].discard(target)
    circles = _circles(graph)
    assert not circles, circles


def test_the_optimizer_is_a_composition():
    """``DiLoCoXOptimizer`` is composed, not mixed in: its only base is Megatron's ``MegatronOptimizer``;
    its parts import neither it nor the installer (they get what they need as arguments); no module of
    the optimizer reads an object's ``__dict__``, and no ``__getattr__`` there returns anything (what it
    forwards to Megatron's optimizer is the explicit list ``forwarding.FORWARDED``)."""
    graph = _import_graph()
    adapter = "megatron_diloco.megatron_adapter"
    for part in OPTIMIZER_MODULES[1:]:
        back = {m for m in graph[f"{adapter}.{part}"] if m in (f"{adapter}.optimizer", f"{adapter}.integration")}
        assert not back, (part, back)
    for module in OPTIMIZER_MODULES:
        tree = ast.parse((ADAPTER / f"{module}.py").read_text())
        reads = [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr == "__dict__"]
        assert not reads, (module, reads)
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and node.name == "__getattr__":
                returns = [r.lineno for r in ast.walk(node) if isinstance(r, ast.Return) and r.value is not None]
                assert not returns, (module, returns)
    tree = ast.parse((ADAPTER / "optimizer.py").read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "DiLoCoXOptimizer")
    assert [ast.unparse(b) for b in cls.bases] == ["MegatronOptimizer"]


def test_tests_and_benchmarks_share_the_harness_only():
    """What runs jobs for both lives in ``harness/``: it imports nothing from ``tests`` or ``benchmarks``; the
    benchmarks import nothing from ``tests``; the tests import from ``benchmarks`` only the scripts they test
    (a module that is itself a benchmark, never a helper folder); ``benchmarks/`` holds no shared helpers."""
    root = PACKAGE.parent
    imports = lambda folder: {p: _imports(p) for p in sorted((root / folder).rglob("*.py"))}  # noqa: E731
    for path, names in imports("harness").items():
        assert not [n for n in names if n.split(".")[0] in ("tests", "benchmarks")], path
    for path, names in imports("benchmarks").items():
        assert not [n for n in names if n.split(".")[0] == "tests"], path
    for path in sorted((root / "tests").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "benchmarks":
                where = root / Path(*node.module.split("."))
                for alias in node.names:  # a script: the module itself, or one imported from its folder
                    script = where.with_suffix(".py") if where.with_suffix(".py").is_file() else where / f"{alias.name}.py"
                    assert script.is_file(), (path, node.module, alias.name)
    assert not (root / "benchmarks" / "common").exists()
