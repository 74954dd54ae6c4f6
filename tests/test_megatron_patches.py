"""The catalogue of Megatron patches (``megatron_adapter/patches.py``) holds on the installed Megatron, covers
every Megatron attribute the package replaces, and a Megatron whose call sites moved is refused loudly,
naming the patch, the call site and the installed version, before anything is patched."""

from __future__ import annotations

import argparse
import ast
import importlib
import re
import sys
import textwrap
import types
from pathlib import Path

import pytest

from megatron_diloco.megatron_adapter import patches
from megatron_diloco.megatron_adapter.patches import ATTRIBUTE, CATALOGUE, CallSite, MegatronMoved, Patch

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "megatron_diloco"


@pytest.fixture(scope="module")
def training():
    return importlib.import_module("megatron.training.training")


def test_every_patch_holds_on_the_installed_megatron(training):
    """Each entry's target exists, takes the parameters its replacement relies on, and every call site
    still calls it, the way the patch reaches it (module global, import, attribute) and in the order."""
    found = {p.name: patches.problems(p) for p in CATALOGUE}
    assert {name: f for name, f in found.items() if f} == {}
    assert len({p.name for p in CATALOGUE}) == len(CATALOGUE) >= 30


def test_the_pinned_megatron_is_the_checked_one(training):
    """Each entry was checked against the megatron-core that requirements.txt pins and the venv holds."""
    pin = re.search(r"^megatron-core==(\S+)$", (ROOT / "requirements.txt").read_text(), re.M).group(1)
    assert patches.megatron_version().split("+")[0] == pin
    assert all(pin in p.checked for p in CATALOGUE)


def test_install_applies_its_entries_through_the_catalogue():
    """``_Installation.patch`` has a wrapper method for each INSTALL entry, and replaces nothing itself."""
    from megatron_diloco.megatron_adapter.integration import _Installation

    for p in (*patches.INSTALL, patches.DATA_PARALLEL_RANK, patches.DATA_PARALLEL_SIZE):
        assert callable(getattr(_Installation, p.replacement)), p.name
    source = (PACKAGE / "megatron_adapter" / "integration.py").read_text()
    assert not re.search(r"^\s*(training|ps)\.\w+\s*=", source, re.M)


def _megatron_names(tree: ast.AST) -> set[str]:
    """Names bound in a module to Megatron modules or classes (imports, and ``cls = mod.Class``)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "megatron":
            names |= {a.asname or a.name for a in node.names}
        elif isinstance(node, ast.Import):
            names |= {a.asname for a in node.names if a.asname and a.name.split(".")[0] == "megatron"}
    for node in ast.walk(tree):
        if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Attribute)
                and ast.unparse(node.value).split(".")[0] in names):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    return names


def _resolved(expr: str, tree: ast.AST) -> str:
    """``training.train`` -> ``megatron.training.training.train`` from the module's imports."""
    head, _, rest = expr.partition(".")
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("megatron"):
            for a in node.names:
                if (a.asname or a.name) == head:
                    return f"{node.module}.{a.name}.{rest}"
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.asname == head:
                    return f"{a.name}.{rest}"
        elif isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == head for t in node.targets):
            return _resolved(f"{ast.unparse(node.value)}.{rest}", tree)
    return expr


def test_every_megatron_attribute_the_package_replaces_is_catalogued():
    """An assignment to an attribute of a Megatron module or class anywhere in the package names a catalogue
    entry's target (one place lists them all), and every entry is applied where it says."""
    targets = {p.target for p in CATALOGUE}
    seen, missing = set(), []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "patches.py":
            continue
        tree = ast.parse(path.read_text())
        names = _megatron_names(tree)
        for node in ast.walk(tree):
            for t in node.targets if isinstance(node, ast.Assign) else ():
                for leaf in t.elts if isinstance(t, ast.Tuple) else (t,):
                    if isinstance(leaf, ast.Attribute) and ast.unparse(leaf).split(".")[0] in names:
                        target = _resolved(ast.unparse(leaf), tree)
                        if target in targets:
                            seen.add(target)
                        else:
                            missing.append(f"{path.relative_to(PACKAGE)}: {target}")
    assert missing == []
    # and each entry that another module applies is assigned there (install's go through patches.replace)
    install = {p.target for p in (*patches.INSTALL, patches.DATA_PARALLEL_RANK, patches.DATA_PARALLEL_SIZE,
                                  patches.PRETRAINING_SAMPLER)}
    elsewhere = {p.target for p in CATALOGUE if p.target not in install and p not in patches.INSTANCE}
    assert seen == elsewhere | {"megatron.training.training.setup_model_and_optimizer"}  # (also the launcher's)


# ------------------------------------------------------------------ a Megatron whose call sites moved
FAKE = "fake_megatron_training"


@pytest.fixture
def fake(tmp_path, monkeypatch):
    """A module with a helper and a loop that calls it, from a real file (so its source is readable)."""
    def make(source: str) -> types.ModuleType:
        path = tmp_path / f"{FAKE}.py"
        path.write_text(textwrap.dedent(source))
        monkeypatch.syspath_prepend(str(tmp_path))
        sys.modules.pop(FAKE, None)
        module = importlib.import_module(FAKE)
        monkeypatch.setitem(sys.modules, FAKE, module)
        return module
    return make


def _entry(calls: str = "helper", **kw) -> Patch:
    site = CallSite(FAKE, "loop", calls, **{k: kw.pop(k) for k in ("lookup", "after") if k in kw})
    return Patch("fake_helper", FAKE, "helper", (site,), "a test patch", "wrap", "tests", **kw)


def test_a_patch_that_holds_is_applied_and_swapped(fake):
    module = fake("def helper(x):\n    return x\n\ndef loop():\n    return helper(1)\n")
    with patches.swapped((_entry(), lambda f: lambda x: 2 * f(x))):
        assert module.loop() == 2
    assert module.loop() == 1
    patches.replace(_entry(parameters=("x",)), lambda f: lambda x: f(x) + 10)
    assert module.loop() == 11


@pytest.mark.parametrize("source, entry, says", [
    ("def loop():\n    return 1\n", _entry(), "fake_megatron_training.helper no longer exists"),
    ("def helper():\n    pass\n\ndef loop():\n    return other()\n", _entry(),
     "fake_megatron_training.py, loop() no longer calls helper()"),
    ("def helper():\n    pass\n", _entry(), "fake_megatron_training.py, loop() no longer exists"),
    ("def helper():\n    pass\n\ndef loop():\n    from os import helper\n    return helper()\n",
     _entry(lookup=patches.LOCAL_IMPORT), "no longer imports helper from fake_megatron_training"),
    ("import os as helpers\ndef helper():\n    pass\n\ndef loop():\n    return helpers.helper()\n",
     _entry("helpers.helper"), "no longer finds helpers.helper in fake_megatron_training"),
    ("def helper(y):\n    pass\n\ndef loop():\n    return helper(1)\n", _entry(parameters=("x",)),
     "now takes (y), not (x, ...)"),
    ("def helper():\n    pass\n\ndef first():\n    pass\n\ndef loop():\n    helper()\n    first()\n",
     _entry(after=("first",)), "no longer calls first() before helper()"),
])
def test_a_moved_call_site_is_refused_naming_the_patch_and_the_version(fake, source, entry, says):
    fake(source)
    with pytest.raises(MegatronMoved) as err:
        patches.replace(entry, lambda f: pytest.fail("applied a patch whose call site moved"))
    message = str(err.value)
    assert isinstance(err.value, RuntimeError)
    assert says in message
    assert "'fake_helper'" in message and "fake_megatron_training.helper" in message
    assert f"installed megatron-core {patches.megatron_version()}" in message
    assert "checked against megatron-core 0.19.2" in message


def test_an_attribute_call_site_needs_only_the_method_name(fake):
    fake("class C:\n    def helper(self):\n        pass\n\n    def loop(self, other):\n        other.x.helper()\n")
    site = CallSite(FAKE, "C.loop", "obj.helper", ATTRIBUTE)
    assert patches.problems(Patch("m", FAKE, "C.helper", (site,), "", "", "tests", parameters=("self",))) == []


def _args(**kw) -> argparse.Namespace:
    return argparse.Namespace(**{"diloco_x": True, "optimizer": "adam", "diloco_x_lighthouse": None,
                                 "diloco_x_outer_store": None, "save": None, "load": None, **kw})


def test_the_entries_a_run_applies():
    names = lambda args: {p.name for p in patches.applying_to(args, patches.INSTALL)}  # noqa: E731
    assert names(_args()) == {"load_checkpoint", "get_optimizer_param_scheduler", "get_megatron_optimizer",
                              "train_step", "train"}
    assert names(_args(diloco_x_outer_store="h:1")) == names(_args()) | {
        "build_pretraining_data_loader", "get_train_valid_test_num_samples"}
    assert "setup_model_and_optimizer" in names(_args(diloco_x_lighthouse="h:2"))
    assert "distopt_sgd" in {p.name for p in patches.applying_to(_args(optimizer="sgd"))}
    data = {"data_parallel_rank", "data_parallel_world_size", "pretraining_sampler"}
    assert data & {p.name for p in patches.applying_to(_args(diloco_x_outer_store="h:1"))} == data - {
        "pretraining_sampler"}
    assert data <= {p.name for p in patches.applying_to(_args(diloco_x_lighthouse="h:2", diloco_x_data_micro_batch=2))}
    assert "distopt_sgd" not in {p.name for p in patches.applying_to(_args())}


def test_install_refuses_a_moved_megatron_before_patching_anything(training, monkeypatch):
    """Megatron's ``train`` that no longer calls ``train_step``: ``install()`` stops with the clear error
    and leaves Megatron as it was (no compat fix, no training wrapper)."""
    from megatron.core.optimizer import distrib_optimizer

    from megatron_diloco.megatron_adapter import integration

    def train(forward_step_func, model, optimizer, opt_param_scheduler, train_data_iterator,
              valid_data_iterator, process_non_loss_data_func, config, *rest):
        return step_once(model, optimizer)  # noqa: F821 (never run)

    monkeypatch.setattr(training, "train", train)
    monkeypatch.setattr(integration, "config_from_args", lambda args: object())
    monkeypatch.setattr(integration, "validate_megatron_args", lambda args, config: None)
    before = (training.get_megatron_optimizer, training.train_step, distrib_optimizer.DistributedOptimizer.state_dict)
    with pytest.raises(RuntimeError, match=r"patch 'train_step' replaces megatron\.training\.training\.train_step"
                       r".*megatron/training/training\.py, train\(\) no longer calls train_step\(\)"):
        integration.install(_args())
    assert (training.get_megatron_optimizer, training.train_step,
            distrib_optimizer.DistributedOptimizer.state_dict) == before
    with pytest.raises(MegatronMoved, match="no longer calls train_step"):
        integration._Installation(None, _args()).patch()
    assert training.train_step is before[1]


def test_separate_worlds_read_their_replicas_share(monkeypatch):
    """The data loader wrapper swaps the data-parallel rank and size that Megatron's sampler reads through
    ``mpu`` while it builds, to ``replica x dp + dp_rank`` of ``R x dp``, and restores them after."""
    from megatron.core import parallel_state as ps

    from megatron_diloco.megatron_adapter.integration import _Installation

    monkeypatch.setattr(ps, "get_data_parallel_rank", lambda *a, **k: 1)
    monkeypatch.setattr(ps, "get_data_parallel_world_size", lambda *a, **k: 2)
    installation = _Installation(argparse.Namespace(replicas=3, site_pace=None), _args(diloco_x_replica_index=2))

    def build(dataset, consumed_samples):
        from megatron.core import mpu

        return mpu.get_data_parallel_rank(), mpu.get_data_parallel_world_size(), dataset, consumed_samples

    assert installation.wrap_build_pretraining_data_loader(build)("data", 5) == (2 * 2 + 1, 3 * 2, "data", 3 * 5)
    assert (ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()) == (1, 2)
    assert installation.wrap_get_train_valid_test_num_samples(lambda: (10, None, 3))() == (30, None, 9)
    paced = _Installation(argparse.Namespace(replicas=3, site_pace=2.5), _args(diloco_x_replica_index=2))
    assert paced.wrap_get_train_valid_test_num_samples(lambda: (10, None, 3))() == (90, None, 27)  # x ceil(2.5)


@pytest.mark.parametrize("own_batches", [(8, 8), (16, 8)], ids=["equal", "per-job-global-batch"])
def test_separate_worlds_resume_their_own_samples(monkeypatch, own_batches):
    """Megatron's own sampler under the wrapper: a launch (or job) resumed at iteration i reads the samples its
    uninterrupted self reads from iteration i + 1 on (not those of iteration i / R again), and the R launches
    never read a sample twice, also when each has its own global batch (micro-batch 4, 2 data-parallel ranks,
    2 replicas)."""
    from megatron.core import parallel_state as ps
    from megatron.training.datasets.data_samplers import MegatronPretrainingSampler

    from megatron_diloco.megatron_adapter.integration import _Installation

    R, dp, mbs, total, iters, resume_at = 2, 2, 4, 4096, 12, 5
    monkeypatch.setattr(ps, "get_data_parallel_world_size", lambda *a, **k: dp)

    def build(dataset, consumed_samples):
        from megatron.core import mpu

        return iter(MegatronPretrainingSampler(total, consumed_samples, mbs, mpu.get_data_parallel_rank(),
                                               mpu.get_data_parallel_world_size()))

    def read(replica: int, gbs: int, start_iter: int, dp_rank: int) -> list[list[int]]:
        """What data-parallel rank ``dp_rank`` of ``replica`` reads from iteration ``start_iter`` + 1 on, per
        iteration (its micro-batches concatenated), as a run resumed there builds its loader."""
        monkeypatch.setattr(ps, "get_data_parallel_rank", lambda *a, **k: dp_rank)
        inst = _Installation(argparse.Namespace(replicas=R), _args(diloco_x_replica_index=replica))
        loader = inst.wrap_build_pretraining_data_loader(build)("data", start_iter * gbs)  # consumed_train_samples
        per_iter = gbs // (mbs * dp)
        return [sum((next(loader) for _ in range(per_iter)), []) for _ in range(iters - start_iter)]

    seen: list[int] = []
    for replica, gbs in enumerate(own_batches):
        for dp_rank in range(dp):
            whole = read(replica, gbs, 0, dp_rank)
            assert read(replica, gbs, resume_at, dp_rank) == whole[resume_at:]
            seen += [i for batch in whole for i in batch]
    assert len(seen) == len(set(seen))  # no sample read twice, by any rank of any replica


@pytest.mark.parametrize("flags", [dict(diloco_x_exchange_slots=2),
                                   dict(diloco_x_exchange_chunks=8, diloco_x_data_slots=2)], ids=["slots", "chunks"])
def test_sites_of_different_data_parallel_size_read_disjoint_samples(monkeypatch, flags):
    """``--diloco-x-exchange-slots 2`` (or ``--diloco-x-exchange-chunks 8 --diloco-x-data-slots 2``): job 0 at DP 2
    (global batch 8) and job 1 at DP 1 (global batch 4), micro-batch 4, under Megatron's own sampler: no sample is
    read twice by any rank of either job, and a job resumed at iteration i reads what its uninterrupted self reads
    from i + 1 on; the datasets are sized by the data count, 2, not the chunks. (Without the slots' scaling the
    DP-1 job reads the DP-2 job's samples.)"""
    from megatron.core import parallel_state as ps
    from megatron.training.datasets.data_samplers import MegatronPretrainingSampler

    from megatron_diloco.megatron_adapter.integration import _Installation

    mbs, total, iters, resume_at = 4, 4096, 12, 5

    def build(dataset, consumed_samples):
        from megatron.core import mpu

        return iter(MegatronPretrainingSampler(total, consumed_samples, mbs, mpu.get_data_parallel_rank(),
                                               mpu.get_data_parallel_world_size()))

    def read(replica: int, dp: int, gbs: int, start_iter: int, dp_rank: int) -> list[list[int]]:
        monkeypatch.setattr(ps, "get_data_parallel_rank", lambda *a, **k: dp_rank)
        monkeypatch.setattr(ps, "get_data_parallel_world_size", lambda *a, **k: dp)
        inst = _Installation(argparse.Namespace(replicas=2),
                             _args(diloco_x_replica_index=replica, data_parallel_size=dp, **flags))
        loader = inst.wrap_build_pretraining_data_loader(build)("data", start_iter * gbs)
        per_iter = gbs // (mbs * dp)
        return [sum((next(loader) for _ in range(per_iter)), []) for _ in range(iters - start_iter)]

    seen: list[int] = []
    for replica, dp, gbs in ((0, 2, 8), (1, 1, 4)):
        for dp_rank in range(dp):
            whole = read(replica, dp, gbs, 0, dp_rank)
            assert read(replica, dp, gbs, resume_at, dp_rank) == whole[resume_at:]
            seen += [i for batch in whole for i in batch]
    assert len(seen) == len(set(seen)) == 12 * 12  # every rank its own samples (12 per iteration: 8 + 4)
    inst = _Installation(argparse.Namespace(replicas=2, site_pace=None),
                         _args(diloco_x_replica_index=1, data_parallel_size=1, **flags))
    assert inst.wrap_get_train_valid_test_num_samples(lambda: (10, None, 3))() == (40, None, 12)
    if "diloco_x_exchange_chunks" in flags:  # (without --diloco-x-data-slots: the chunks, 8 / 1 times)
        inst = _Installation(argparse.Namespace(replicas=2, site_pace=None),
                             _args(diloco_x_replica_index=1, data_parallel_size=1, diloco_x_exchange_chunks=8))
        assert inst.wrap_get_train_valid_test_num_samples(lambda: (10, None, 3))() == (160, None, 48)


@pytest.mark.parametrize("sites, flags, disjoint", [
    (((2, 2, None, 8), (2, 4, 2, 8)), {}, True),
    (((2, 2, None, 8), (2, 4, None, 8)), {}, False),
    (((2, 2, None, 8), (1, 4, 2, 4)), dict(diloco_x_exchange_slots=2), True),
], ids=["dealt-in-2", "own-micro-batches", "with-slots"])
def test_sites_of_different_micro_batch_read_disjoint_samples(monkeypatch, sites, flags, disjoint):
    """Per job (DP, micro-batch, ``--diloco-x-data-micro-batch``, global batch): job 0 at micro-batch 2 (no flag: it
    deals in its own) and job 1 at micro-batch 4 dealt in 2 read, under Megatron's own sampler as Megatron's loader
    builds it (a module global, by keyword), no sample twice by any rank of either job, also beside exchange slots
    (job 1 at DP 1); a job resumed at iteration i reads what its uninterrupted self reads from i + 1 on, each
    micro-batch of its own size. Without the flag on job 1 (each job its own micro-batch) the jobs read each
    other's samples."""
    from megatron.core import parallel_state as ps
    from megatron.training.datasets import data_samplers

    from megatron_diloco.megatron_adapter.integration import _Installation

    total, iters, resume_at = 4096, 12, 5

    def read(replica: int, dp: int, mbs: int, unit: int | None, gbs: int, start_iter: int, dp_rank: int) -> list:
        monkeypatch.setattr(ps, "get_data_parallel_rank", lambda *a, **k: dp_rank)
        monkeypatch.setattr(ps, "get_data_parallel_world_size", lambda *a, **k: dp)

        def build(dataset, consumed_samples):  # as build_pretraining_data_loader makes its sampler
            from megatron.core import mpu

            return iter(data_samplers.MegatronPretrainingSampler(
                total_samples=total, consumed_samples=consumed_samples, micro_batch_size=mbs,
                data_parallel_rank=mpu.get_data_parallel_rank(), data_parallel_size=mpu.get_data_parallel_world_size()))

        inst = _Installation(argparse.Namespace(replicas=2), _args(
            diloco_x_replica_index=replica, diloco_x_data_micro_batch=unit, data_parallel_size=dp, **flags))
        loader = inst.wrap_build_pretraining_data_loader(build)("data", start_iter * gbs)
        assert data_samplers.MegatronPretrainingSampler.__name__ == "MegatronPretrainingSampler"  # restored
        per_iter = gbs // (mbs * dp)
        batches = [[next(loader) for _ in range(per_iter)] for _ in range(iters - start_iter)]
        assert all(len(b) == mbs for it in batches for b in it)
        return [sum(it, []) for it in batches]

    seen: list[int] = []
    for replica, (dp, mbs, unit, gbs) in enumerate(sites):
        for dp_rank in range(dp):
            whole = read(replica, dp, mbs, unit, gbs, 0, dp_rank)
            assert read(replica, dp, mbs, unit, gbs, resume_at, dp_rank) == whole[resume_at:]
            seen += [i for batch in whole for i in batch]
    assert len(seen) == iters * sum(gbs for *_, gbs in sites)
    assert (len(set(seen)) == len(seen)) == disjoint  # without the flag: the reason for it
    if disjoint:
        with pytest.raises(ValueError, match="--diloco-x-data-micro-batch 2 does not divide the micro-batch 3"):
            read(1, 2, 3, 2, 6, 0, 0)
