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
