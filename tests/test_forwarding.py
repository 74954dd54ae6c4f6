"""``DiLoCoXOptimizer`` forwards to Megatron's optimizer exactly the names of ``forwarding.FORWARDED``.

* the list covers every name Megatron's training package reads from the optimizer it is handed (a scan
  of the installed Megatron's syntax trees: a Megatron whose call sites changed fails here);
* a forwarded name reads ``inner``'s (``param_groups`` also writes it); any other name raises
  ``AttributeError`` naming the list; the class has no abstract method left.

That a real run reads nothing outside the list is checked by the real-Megatron tests: the training
recorder (``harness/recorders/training.py``) records every name the wrapper refused (``refused_attrs``), which they
require empty.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

from megatron_diloco.megatron_adapter.forwarding import FORWARDED, NOT_FORWARDED, SETTABLE
from megatron_diloco.megatron_adapter.optimizer import DiLoCoXOptimizer


def _names_read_from_the_optimizer() -> dict[str, list[str]]:
    """``name -> [file:line]`` for every ``optimizer.<name>`` (and ``getattr`` / ``hasattr(optimizer,
    "<name>")``) in ``megatron/training/``, and ``self.optimizer.<name>`` in
    ``megatron/core/optimizer_param_scheduler.py``."""
    import megatron.core
    import megatron.training

    found: dict[str, list[str]] = {}

    def scan(path: Path, holder: str) -> None:
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            target = None
            if isinstance(node, ast.Attribute) and ast.unparse(node.value) == holder:
                target = node.attr
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                  and node.func.id in ("getattr", "hasattr", "setattr") and len(node.args) >= 2
                  and ast.unparse(node.args[0]) == holder and isinstance(node.args[1], ast.Constant)):
                target = node.args[1].value
            if target is not None:
                found.setdefault(target, []).append(f"{path.name}:{node.lineno}")

    for path in sorted(Path(megatron.training.__file__).parent.rglob("*.py")):
        scan(path, "optimizer")
    scan(Path(megatron.core.__file__).parent / "optimizer_param_scheduler.py", "self.optimizer")
    return found


def test_forwarded_names_cover_what_megatrons_training_reads():
    """Every name Megatron's training package reads from its optimizer is the wrapper's own, forwarded,
    or deliberately not forwarded (with the reason); and every forwarded name exists on Megatron's
    ``ChainedOptimizer`` (as a class attribute or one its ``__init__`` sets)."""
    from megatron.core.optimizer import ChainedOptimizer

    found = _names_read_from_the_optimizer()
    assert {"param_groups", "zero_grad", "is_stub_optimizer", "sharded_state_dict"} <= set(found), found
    own = {name for name in vars(DiLoCoXOptimizer) if name not in FORWARDED}
    unknown = {name: where for name, where in found.items()
               if name not in FORWARDED and name not in own and name not in NOT_FORWARDED}
    assert not unknown, f"Megatron reads these from the optimizer; add them to forwarding.FORWARDED: {unknown}"
    assert not set(FORWARDED) & set(NOT_FORWARDED)
    init = inspect.getsource(ChainedOptimizer.__init__)
    missing = [n for n in FORWARDED if not hasattr(ChainedOptimizer, n) and f"self.{n} =" not in init]
    assert not missing, missing


class _Inner:
    """A stand-in for Megatron's optimizer: the forwarded names it has, nothing else."""

    def __init__(self):
        self.param_groups = [{"lr": 1.0}]
        self.config = "config"
        self.is_stub_optimizer = False
        self.zeroed = []

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.zeroed.append(set_to_none)


def _wrapper(inner) -> DiLoCoXOptimizer:
    opt = DiLoCoXOptimizer.__new__(DiLoCoXOptimizer)  # no __init__: no process groups needed
    opt.inner = inner
    return opt


def test_forwarded_names_read_inner_and_nothing_else_gets_through():
    assert not DiLoCoXOptimizer.__abstractmethods__
    inner = _Inner()
    opt = _wrapper(inner)
    assert opt.param_groups is inner.param_groups and opt.config == "config" and opt.is_stub_optimizer is False
    opt.zero_grad(False)
    assert inner.zeroed == [False]
    opt.param_groups = [{"lr": 2.0}]  # settable: written to inner
    assert inner.param_groups == [{"lr": 2.0}] and SETTABLE == {"param_groups"}
    with pytest.raises(AttributeError, match="set it on .inner"):
        opt.config = "other"
    with pytest.raises(AttributeError, match=r"'model_chunks'.*forwarding\.FORWARDED \(param_groups, "):
        opt.model_chunks
    assert not hasattr(opt, "model_chunks") and getattr(opt, "optimizer", None) is None
    with pytest.raises(AttributeError, match="legacy checkpoint format.*FORWARDED"):
        opt.save_parameter_state("/tmp/x")
    with pytest.raises(AttributeError, match=r"Megatron's optimizer \(_Inner.*has no attribute 'get_loss_scale'"):
        opt.get_loss_scale()  # forwarded, but this inner lacks it: the error names inner
