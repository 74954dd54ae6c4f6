"""Every Megatron-Core function that megatron-diloco replaces, in one catalogue, and the check that the
installed Megatron still calls each one where the patch expects it.

megatron-diloco changes no Megatron file. It replaces functions at their module (or class) attributes,
which works only because Megatron looks them up there at call time: ``train`` calls the module global
``train_step``, ``parse_and_validate_args`` calls the module global ``parse_args``, and so on. Each
:class:`Patch` below names what it replaces, the Megatron function(s) that call it and how they find it
(:class:`CallSite`), why DiLoCoX needs it, the parameters its replacement relies on, who applies it and
the megatron-core versions it was checked against. :func:`check` compares the catalogue with the
installed Megatron by reading the callers' source and fails with :class:`MegatronMoved` (a
``RuntimeError`` naming the patch, the call site and the installed version) when a target or a call
moved; ``install()`` runs it before it changes anything, and ``tests/test_megatron_patches.py`` runs it
for every entry.

:func:`replace` (for good) and :func:`swapped` (for the duration of a ``with`` block) are the one way
:class:`~megatron_diloco.megatron_adapter.integration._Installation` applies its entries
(:data:`INSTALL`). The other entries are applied by the modules named in ``applied_by``.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import functools
import importlib
import inspect
import logging
import os
import sys
import textwrap
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

logger = logging.getLogger(__name__)

#: megatron-core versions every entry below was checked against (the pin in requirements.txt)
CHECKED = ("0.19.2",)

# How a call site finds the function it calls (CallSite.lookup)
GLOBAL = "module global"  # a name in the target's module (or ``alias.name`` with ``alias`` that module)
LOCAL_IMPORT = "imported in the function"  # ``from <target module> import name`` inside the caller
ATTRIBUTE = "attribute of an object"  # ``self.name(...)`` / ``obj.name(...)``: the class attribute
ARGUMENT = "passed by name"  # ``calls(..., name, ...)``: the module global handed to another function


@dataclass(frozen=True)
class CallSite:
    """Where Megatron calls a patched function: ``function`` (a qualified name in ``module``) calls
    ``calls`` (the callee as written there), found as ``lookup`` says, after each of ``after``."""

    module: str
    function: str
    calls: str
    lookup: str = GLOBAL
    after: tuple[str, ...] = ()  # callees (as written) that the function must call before ``calls``

    @property
    def where(self) -> str:
        return f"{self.module.replace('.', '/')}.py, {self.function}()"


@dataclass(frozen=True)
class Patch:
    """One replacement of a Megatron attribute (see the module docstring)."""

    name: str
    module: str
    attribute: str  # ``function`` or ``Class.method``
    called_from: tuple[CallSite, ...]
    why: str
    replacement: str  # for INSTALL: the ``_Installation`` method that wraps the original
    applied_by: str
    when: str = "always"  # a key of CONDITIONS
    parameters: tuple[str, ...] = ()  # the target's leading parameters the replacement relies on, in order
    keywords: tuple[str, ...] = ()  # parameters it passes by name
    temporary: bool = False  # swapped for the duration of one call only (:func:`swapped`)
    checked: tuple[str, ...] = CHECKED

    @property
    def target(self) -> str:
        return f"{self.module}.{self.attribute}"


class MegatronMoved(RuntimeError):
    """The installed Megatron no longer has a function, or a call, that a patch relies on."""


def megatron_version() -> str:
    from megatron.core import package_info

    return package_info.__version__


def _separate_worlds(args: argparse.Namespace) -> bool:
    return getattr(args, "diloco_x_outer_store", None) is not None or _separate_jobs(args)


def _separate_jobs(args: argparse.Namespace) -> bool:
    return getattr(args, "diloco_x_lighthouse", None) is not None


def _cpu(args: argparse.Namespace) -> bool:
    from megatron_diloco.compat.cpu import cpu_mode

    return cpu_mode()


def _launcher(args: argparse.Namespace) -> bool:
    from megatron.training import arguments

    return getattr(arguments.parse_args, "_diloco_x_launch", False)


def _helpers_not_built(args: argparse.Namespace) -> bool:
    """compat.wheel's condition (no Makefile next to Megatron's dataset helpers), or the CPU shim's."""
    from megatron.core.datasets import utils

    return _cpu(args) or not os.path.exists(os.path.join(os.path.dirname(utils.__file__), "Makefile"))


def _rope_fusion_without_te(args: argparse.Namespace) -> bool:
    """``--rope-fusion`` on CUDA where Transformer Engine's fused RoPE is absent (``fused_rope.install``'s
    condition; the global is None, or already the package's kernel)."""
    if not getattr(args, "apply_rope_fusion", False) or _cpu(args):
        return False
    from megatron.core.models.common.embeddings import rope_utils

    fused = rope_utils.fused_apply_rotary_pos_emb
    return fused is None or getattr(fused, "__module__", None) == "megatron_diloco.megatron_adapter.fused_rope"


_MULTI_TENSOR = "megatron_diloco.megatron_adapter.multi_tensor"
_MULTI_TENSOR_INSTALL = f"{_MULTI_TENSOR}.install"


def local_multi_tensor_fallbacks(args: argparse.Namespace | None = None) -> bool:
    """Megatron's gradient clipping on its own multi-tensor fallbacks (neither Transformer Engine nor Apex
    installed: ``clip_grads.l2_norm_impl`` is ``local_multi_tensor_l2_norm``, or already the package's
    kernel) on CUDA (``multi_tensor.install``'s condition)."""
    if _cpu(args):
        return False
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads

    impl = clip_grads.l2_norm_impl
    return impl is utils.local_multi_tensor_l2_norm or getattr(impl, "__module__", None) == _MULTI_TENSOR


#: when an entry applies, from the run's arguments (``Patch.when``)
CONDITIONS: dict[str, Callable[[argparse.Namespace], bool]] = {
    "always": lambda args: True,
    "sgd": lambda args: getattr(args, "optimizer", None) == "sgd",
    "separate worlds or jobs": _separate_worlds,
    "separate jobs": _separate_jobs,
    "data micro-batch": lambda args: (_separate_worlds(args)
                                      and getattr(args, "diloco_x_data_micro_batch", None) is not None),
    "cpu": _cpu,
    "launcher": _launcher,
    "wheel or cpu": _helpers_not_built,
    "rope fusion on CUDA without Transformer Engine": _rope_fusion_without_te,
    "CUDA without Apex or Transformer Engine": local_multi_tensor_fallbacks,
}


def _resolve(module: str, qualname: str) -> tuple[Any, str, Any]:
    """(owner, last name, value) of ``module.qualname``; raises AttributeError/ImportError."""
    owner: Any = importlib.import_module(module)
    *path, last = qualname.split(".")
    for part in path:
        owner = getattr(owner, part)
    value = owner.__dict__[last] if isinstance(owner, type) and last in owner.__dict__ else getattr(owner, last)
    return owner, last, value


def _unwrapped(value: Any) -> Any:
    """Megatron's own function behind ``value`` (behind an earlier :func:`replace` or ``functools.wraps``)."""
    return inspect.unwrap(value) if callable(value) else value


@functools.lru_cache(maxsize=64)
def _syntax(function: Any) -> ast.AST | None:
    """The syntax tree of ``function``'s source (parsed once per function), or None without source."""
    try:
        return ast.parse(textwrap.dedent(inspect.getsource(function)))
    except (OSError, TypeError, SyntaxError):
        return None


def _calls(tree: ast.AST, site: CallSite) -> list[int]:
    """Line numbers of the calls in ``tree`` that match ``site.calls``."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            callee = ast.unparse(node.func)
            if callee == site.calls or (site.lookup == ATTRIBUTE and callee.rsplit(".", 1)[-1]
                                        == site.calls.rsplit(".", 1)[-1]):
                lines.append(node.lineno)
    return lines


def _found_in(scope: dict, callee: str, patch: Patch) -> Any:
    """The object that holds the patched attribute (its module or class) if the caller, whose globals are
    ``scope``, reaches it through ``callee`` at call time; else None."""
    owner, last, _ = _resolve(patch.module, patch.attribute)
    prefix, _, name = callee.rpartition(".")
    try:
        if name == last:  # calls the attribute itself: f(), alias.f()
            found = scope[prefix.split(".")[0]] if prefix else sys.modules.get(scope.get("__name__", ""))
            for part in prefix.split(".")[1:] if prefix else ():
                found = getattr(found, part)
        else:  # calls the class whose attribute is patched (its constructor)
            found = scope[callee.split(".")[0]]
            for part in callee.split(".")[1:]:
                found = getattr(found, part)
    except (KeyError, AttributeError):
        return None
    return found if found is owner else None


def _call_site_problem(patch: Patch, site: CallSite) -> str | None:
    try:
        _, _, caller = _resolve(site.module, site.function)
    except (ImportError, AttributeError, KeyError):
        return f"{site.where} no longer exists"
    caller = _unwrapped(caller)
    tree = _syntax(caller)
    if tree is None:
        return f"the source of {site.where} cannot be read, so its call of {site.calls}() cannot be checked"
    lines = _calls(tree, site)
    if not lines:
        return f"{site.where} no longer calls {site.calls}()"
    if site.lookup == GLOBAL and _found_in(getattr(caller, "__globals__", {}), site.calls, patch) is None:
        return (f"{site.where} no longer finds {site.calls} in {patch.module}, so replacing it there would not "
                "reach that call")
    elif site.lookup == ARGUMENT:
        name = patch.attribute
        if not any(isinstance(n, ast.Call) and ast.unparse(n.func) == site.calls
                   and any(isinstance(a, ast.Name) and a.id == name for a in n.args) for n in ast.walk(tree)):
            return f"{site.where} no longer passes {name} to {site.calls}()"
        if getattr(caller, "__globals__", {}).get("__name__") != patch.module:
            return f"{site.where} no longer reads {name} from {patch.module}"
    elif site.lookup == LOCAL_IMPORT:
        name = site.calls.rsplit(".", 1)[-1]
        if not any(isinstance(n, ast.ImportFrom) and n.module == patch.module and any(a.name == name for a in n.names)
                   for n in ast.walk(tree)):
            return f"{site.where} no longer imports {name} from {patch.module} when it runs"
    for earlier in site.after:
        before = _calls(tree, CallSite(site.module, site.function, earlier, site.lookup))
        if not before or min(before) > min(lines):
            return f"{site.where} no longer calls {earlier}() before {site.calls}(), which the patch relies on"
    return None


def problems(patch: Patch) -> list[str]:
    """What no longer holds of ``patch`` on the installed Megatron (empty when it all holds)."""
    try:
        _, _, value = _resolve(patch.module, patch.attribute)
    except (ImportError, AttributeError, KeyError):
        return [f"{patch.target} no longer exists"]
    found = []
    if patch.parameters or patch.keywords:
        try:
            names = list(inspect.signature(_unwrapped(value)).parameters)
        except (TypeError, ValueError):
            names = []
        if names[:len(patch.parameters)] != list(patch.parameters):
            found.append(f"{patch.target} now takes ({', '.join(names)}), not ({', '.join(patch.parameters)}, ...)")
        missing = [k for k in patch.keywords if k not in names]
        if missing:
            found.append(f"{patch.target} no longer takes {', '.join(missing)}")
    for site in patch.called_from:
        problem = _call_site_problem(patch, site)
        if problem is not None:
            found.append(problem)
    return found


def verify(patch: Patch) -> None:
    """Raise :class:`MegatronMoved` when ``patch`` no longer fits the installed Megatron."""
    found = problems(patch)
    if found:
        version = megatron_version()
        raise MegatronMoved(
            f"megatron-diloco cannot run on the installed megatron-core {version}: its patch {patch.name!r} "
            f"replaces {patch.target} ({patch.why}), and " + "; ".join(found) + ". This patch was checked "
            f"against megatron-core {', '.join(patch.checked)}: install megatron-core=={CHECKED[-1]} "
            "(requirements.txt), or update the patch in megatron_diloco/megatron_adapter/patches.py.")


def applying_to(args: argparse.Namespace, entries: Iterable[Patch] | None = None) -> list[Patch]:
    """The entries (all of :data:`CATALOGUE` by default) that a run with ``args`` applies."""
    return [p for p in (CATALOGUE if entries is None else entries) if CONDITIONS[p.when](args)]


def check(args: argparse.Namespace) -> None:
    """Verify every entry this run applies, before anything is patched (``install()`` calls it)."""
    entries = applying_to(args)
    for patch in entries:
        verify(patch)
    version = megatron_version().split("+", 1)[0]
    unchecked = [p.name for p in entries if version not in p.checked]
    if unchecked:
        logger.warning("megatron-core %s: DiLoCoX's patches %s were checked against other versions (%s); their "
                       "call sites are in place", version, ", ".join(unchecked), ", ".join(CHECKED))


def replace(patch: Patch, wrap: Callable[[Any], Any]) -> Any:
    """Verify ``patch``, then set its target to ``wrap(current value)`` for good; returns the new value."""
    verify(patch)
    owner, last, value = _resolve(patch.module, patch.attribute)
    new = wrap(value)
    if callable(value) and not hasattr(new, "__wrapped__"):
        new.__wrapped__ = value  # later checks read Megatron's own source and signature behind it
    setattr(owner, last, new)
    return new


@contextlib.contextmanager
def swapped(*replacements: tuple[Patch, Callable[[Any], Any]]) -> Iterator[None]:
    """Within the block, each ``(patch, wrap)``'s target is ``wrap(current value)``; restored after it
    (verified once by :func:`check` at install, not at every swap)."""
    saved = []
    try:
        for patch, wrap in replacements:
            owner, last, value = _resolve(patch.module, patch.attribute)
            saved.append((owner, last, value))
            setattr(owner, last, wrap(value))
        yield
    finally:
        for owner, last, value in reversed(saved):
            setattr(owner, last, value)


# ------------------------------------------------------------------------------------------ catalogue
_T = "megatron.training.training"
_INSTALL = "megatron_diloco.megatron_adapter.integration._Installation.patch"
_LOCAL = "megatron_diloco.megatron_adapter.replica_local.install_replica_local_collectives"
_DISTOPT = "megatron.core.optimizer.distrib_optimizer"
_INIT = "megatron.training.initialize"
_RSM = "megatron.core.rerun_state_machine"

#: what ``_Installation.patch()`` applies, in this order (and the two temporary swaps of its data loader)
INSTALL: tuple[Patch, ...] = (
    Patch("load_checkpoint", _T, "load_checkpoint",
          (CallSite(_T, "setup_model_and_optimizer", "load_checkpoint", after=("get_optimizer_param_scheduler",)),),
          "after Megatron's checkpoint load, the DiLoCoX optimizer restarts its outer loop when weights were "
          "loaded without DiLoCoX state", "wrap_load_checkpoint", _INSTALL),
    Patch("get_optimizer_param_scheduler", _T, "get_optimizer_param_scheduler",
          (CallSite(_T, "setup_model_and_optimizer", "get_optimizer_param_scheduler", after=("get_megatron_optimizer",)),),
          "the DiLoCoX optimizer keeps its replica's LR-schedule position; --train-samples resolves the "
          "warm-up here, before the first step and the checkpoint load", "wrap_get_optimizer_param_scheduler",
          _INSTALL, parameters=("optimizer",)),
    Patch("get_megatron_optimizer", _T, "get_megatron_optimizer",
          (CallSite(_T, "setup_model_and_optimizer", "get_megatron_optimizer"),),
          "wraps Megatron's optimizer in DiLoCoXOptimizer, keeps the gradient reduction inside the replica and "
          "installs the replica-local collectives; its mark tells that DiLoCoX is installed",
          "wrap_get_megatron_optimizer", _INSTALL, parameters=("config", "model_chunks")),
    Patch("train_step", _T, "train_step", (CallSite(_T, "train", "train_step"),),
          "the logged loss is reduced inside the replica, and recorded for the summary",
          "wrap_train_step", _INSTALL, parameters=("forward_step_func", "data_iterator", "model")),
    Patch("train", _T, "train", (CallSite(_T, "pretrain", "train", after=("setup_model_and_optimizer",)),),
          "the per-token-loss divisor is summed inside the replica; at the end the last exchange is drained "
          "and the DILOCOX SUMMARY printed", "wrap_train", _INSTALL,
          parameters=("forward_step_func", "model", "optimizer", "opt_param_scheduler", "train_data_iterator",
                      "valid_data_iterator", "process_non_loss_data_func", "config")),
    Patch("setup_model_and_optimizer", _T, "setup_model_and_optimizer",
          (CallSite(_T, "pretrain", "setup_model_and_optimizer"),),
          "a job of separate jobs meets the run once its model, optimizer and scheduler (the third result) "
          "exist and its checkpoint is loaded", "wrap_setup_model_and_optimizer", _INSTALL, when="separate jobs"),
    Patch("build_pretraining_data_loader", _T, "build_pretraining_data_loader",
          (CallSite(_T, "build_train_valid_test_data_loaders", "build_pretraining_data_loader"),),
          "each separate world reads its replica's share of the samples", "wrap_build_pretraining_data_loader",
          _INSTALL, when="separate worlds or jobs", parameters=("dataset", "consumed_samples")),
    Patch("get_train_valid_test_num_samples", _T, "get_train_valid_test_num_samples",
          (CallSite(_T, "build_train_valid_test_datasets", "get_train_valid_test_num_samples"),),
          "separate worlds size the datasets for all replicas' samples", "wrap_get_train_valid_test_num_samples",
          _INSTALL, when="separate worlds or jobs"),
)
_SAMPLERS = CallSite("megatron.training.datasets.data_samplers", "build_pretraining_data_loader",
                     "mpu.get_data_parallel_rank")
DATA_PARALLEL_RANK = Patch(
    "data_parallel_rank", "megatron.core.parallel_state", "get_data_parallel_rank", (_SAMPLERS,),
    "while a separate world builds its data loaders, its rank is replica x dp + dp_rank of R x dp",
    "wrap_build_pretraining_data_loader", _INSTALL, when="separate worlds or jobs", temporary=True)
DATA_PARALLEL_SIZE = Patch(
    "data_parallel_world_size", "megatron.core.parallel_state", "get_data_parallel_world_size",
    (CallSite(_SAMPLERS.module, _SAMPLERS.function, "mpu.get_data_parallel_world_size"),),
    "while a separate world builds its data loaders, its data-parallel size is R x dp",
    "wrap_build_pretraining_data_loader", _INSTALL, when="separate worlds or jobs", temporary=True)
PRETRAINING_SAMPLER = Patch(
    "pretraining_sampler", _SAMPLERS.module, "MegatronPretrainingSampler",
    (CallSite(_SAMPLERS.module, _SAMPLERS.function, "MegatronPretrainingSampler"),),
    "with --diloco-x-data-micro-batch U, while a separate world builds its data loaders, its sampler deals the "
    "samples in micro-batches of U and each of its own micro-batches is m / U of them in a row",
    "wrap_build_pretraining_data_loader", _INSTALL, when="data micro-batch", temporary=True,
    keywords=("total_samples", "consumed_samples", "micro_batch_size", "data_parallel_rank", "data_parallel_size"))

#: the replica-local collectives (``replica_local.install_replica_local_collectives``, at the optimizer's build)
REPLICA_LOCAL: tuple[Patch, ...] = (
    Patch("rerun_reduce_any", _RSM, "RerunStateMachine._reduce_any",
          (CallSite(_RSM, "RerunStateMachine.should_run_forward_backward", "self._reduce_any", ATTRIBUTE),),
          "the rerun state machine's per-step all-reduce over the world stays inside the replica",
          "replica_local._reduce_any", _LOCAL, parameters=("self", "value")),
    Patch("rerun_should_checkpoint_and_exit", _RSM, "RerunStateMachine.should_checkpoint_and_exit",
          (CallSite(_T, "train_step", "rerun_state_machine.should_checkpoint_and_exit", ATTRIBUTE),),
          "a checkpoint asked for by one replica's validation failure would be collective over all replicas",
          "replica_local.should_checkpoint_and_exit", _LOCAL, parameters=("self",)),
    Patch("timers_all_ranks", "megatron.core.timers", "Timers._get_elapsed_time_all_ranks",
          (CallSite("megatron.core.timers", "Timers._get_global_min_max_time", "self._get_elapsed_time_all_ranks",
                    ATTRIBUTE),),
          "the timers' barrier and all-gather at --log-interval stay inside the replica",
          "replica_local._get_elapsed_time_all_ranks", _LOCAL, parameters=("self", "names", "reset", "barrier")),
    Patch("timer_barrier_group", "megatron.core.timers", "Timer.__init__",
          (CallSite("megatron.core.timers", "Timers.__call__", "Timer"),),
          "new timers take the replica group as their barrier group", "replica_local.timer_init", _LOCAL),
    Patch("checkpoint_and_decide_exit", _T, "checkpoint_and_decide_exit",
          (CallSite(_T, "train", "checkpoint_and_decide_exit"),),
          "the world-wide exit decisions (--exit-duration-in-mins, --exit-signal-handler) are taken at outer "
          "boundaries only", "replica_local.checkpoint_and_decide_exit", _LOCAL),
    Patch("evaluate_exit_duration", _T, "evaluate",
          (CallSite(_T, "evaluate_and_print_results", "evaluate"),),
          "an evaluation does not take the exit itself: with the exit waiting for a boundary, its dropped "
          "evaluation would leave Megatron's evaluate timer running and fail the next one",
          "replica_local.evaluate", _LOCAL),
)

_LAUNCH = "megatron_diloco.launch"
#: ``python -m megatron_diloco.launch SCRIPT``: before the script runs
LAUNCHER: tuple[Patch, ...] = (
    Patch("launch_parse_args", "megatron.training.arguments", "parse_args",
          (CallSite("megatron.training.arguments", "parse_and_validate_args", "parse_args"),),
          "every parse of an unmodified script sees the --diloco-x* flags", "launch.parse_args", _LAUNCH,
          when="launcher", parameters=("extra_args_provider", "ignore_unknown_args")),
    Patch("launch_parse_and_validate_args", "megatron.training.arguments", "parse_and_validate_args", (),
          "install() right after an unmodified script parsed its flags (the script calls it: no Megatron "
          "call site)", "launch.parse_and_validate_args", _LAUNCH, when="launcher"),
    Patch("launch_install_check", _T, "setup_model_and_optimizer",
          (CallSite(_T, "pretrain", "setup_model_and_optimizer"),),
          "a DiLoCoX-aware script that never called install() stops before the model is built",
          "launch.setup_model_and_optimizer", _LAUNCH, when="launcher"),
)

_COMPAT = "megatron_diloco.compat"
#: Megatron fixes and the CPU shim (``megatron_diloco.compat``)
COMPAT: tuple[Patch, ...] = (
    Patch("distopt_state_dict", _DISTOPT, "DistributedOptimizer.state_dict",
          (CallSite(_DISTOPT, "DistributedOptimizer.sharded_state_dict", "self.state_dict", ATTRIBUTE),),
          "torch's Adam has no state before its first step, which the checkpoint-load template reads",
          "distopt_resume.state_dict", f"{_COMPAT}.distopt_resume", parameters=("self",)),
    Patch("distopt_load_state_dict", _DISTOPT, "DistributedOptimizer.load_state_dict",
          (CallSite("megatron.core.optimizer.optimizer", "ChainedOptimizer.load_state_dict",
                    "optimizer.load_state_dict", ATTRIBUTE),),
          "torch's Adam shares one step tensor between parameters after a load", "distopt_resume.load_state_dict",
          f"{_COMPAT}.distopt_resume", parameters=("self", "state_dict")),
    Patch("distopt_set_states", _DISTOPT, "DistributedOptimizer._set_main_param_and_optimizer_states",
          tuple(CallSite(_DISTOPT, f"DistributedOptimizer.load_parameter_state_from_{kind}",
                         "self._set_main_param_and_optimizer_states", ATTRIBUTE)
                for kind in ("dp_reshardable", "fully_reshardable")),
          "fp32 main params are views of leaf params (restored under no_grad), and the template's step must not "
          "overwrite the loaded one", "distopt_resume._set_main_param_and_optimizer_states",
          f"{_COMPAT}.distopt_resume", parameters=("self", "model_param", "tensors")),
    Patch("distopt_sgd", _DISTOPT, "DistributedOptimizer.__init__",
          (CallSite("megatron.core.optimizer", "_get_megatron_optimizer_based_on_param_groups",
                    "DistributedOptimizer"),),
          "torch's SGD under the distributed optimizer needs an init_state_fn", "distopt_sgd.__init__",
          f"{_COMPAT}.distopt_sgd", when="sgd",
          parameters=("self", "optimizer", "config", "grad_scaler", "init_state_fn")),
    Patch("compile_helpers", "megatron.core.datasets.utils", "compile_helpers",
          (CallSite(_INIT, "_compile_dependencies", "compile_helpers", LOCAL_IMPORT),),
          "a megatron-core wheel ships the dataset helpers built and no Makefile (make would sys.exit(1))",
          "lambda: None", f"{_COMPAT}.wheel, {_COMPAT}.cpu", when="wheel or cpu"),
    Patch("cpu_initialize_megatron", _T, "initialize_megatron",
          (CallSite(_T, "pretrain", "initialize_megatron"),),
          "pretrain() asserts CUDA unless allow_no_cuda", "cpu.initialize_megatron", f"{_COMPAT}.cpu", when="cpu",
          keywords=("allow_no_cuda",)),
    Patch("cpu_initialize_megatron_module", _INIT, "initialize_megatron", (),
          "scripts that call initialize_megatron themselves (no Megatron call site)", "cpu.initialize_megatron",
          f"{_COMPAT}.cpu", when="cpu", keywords=("allow_no_cuda",)),
    Patch("cpu_initialize_distributed", _INIT, "_initialize_distributed",
          (CallSite(_INIT, "initialize_megatron", "_initialize_distributed"),),
          "gloo instead of nccl, and the parallel groups built without a GPU", "cpu._initialize_distributed",
          f"{_COMPAT}.cpu", when="cpu",
          parameters=("get_embedding_ranks", "get_position_embedding_ranks", "store", "skip_model_parallel_init")),
    Patch("cpu_set_random_seed", _INIT, "_set_random_seed",
          (CallSite(_INIT, "initialize_megatron", "_set_random_seed"),),
          "the tensor-parallel RNG tracker without CUDA generators", "cpu._set_random_seed", f"{_COMPAT}.cpu",
          when="cpu"),
    Patch("cpu_warmup_jit", _INIT, "_warmup_jit_function",
          (CallSite(_INIT, "set_jit_fusion_options", "_warmup_jit_function"),),
          "no torch.compile of fused kernels at every CPU start", "lambda tp_size=None: None", f"{_COMPAT}.cpu",
          when="cpu", keywords=("tp_size",)),
    Patch("cpu_device_arch", "megatron.training.arguments", "get_device_arch_version",
          (CallSite("megatron.training.arguments", "validate_args", "get_device_arch_version"),),
          "no GPU architecture to read", "lambda: 0", f"{_COMPAT}.cpu", when="cpu"),
)

#: an instance attribute: the scheduler that Megatron builds (``restart.py``, on that object only)
INSTANCE: tuple[Patch, ...] = (
    Patch("lr_schedule_restore", "megatron.core.optimizer_param_scheduler", "OptimizerParamScheduler.load_state_dict",
          (CallSite("megatron.training.checkpointing", "load_checkpoint", "opt_param_scheduler.load_state_dict",
                    ATTRIBUTE),),
          "after Megatron restored replica 0's LR schedule, this replica's own position is set",
          "restart.load_state_dict", "megatron_diloco.megatron_adapter.restart (the scheduler instance)",
          parameters=("self", "state_dict")),
)

_ROPE = "megatron.core.models.common.embeddings.rope_utils"
#: a kernel Megatron takes from Transformer Engine, filled in without it (``megatron_adapter.fused_rope.install``,
#: called by ``examples/pretrain_gpt_diloco.py`` after its flags are parsed)
FUSED_ROPE = Patch(
    "fused_rope", _ROPE, "fused_apply_rotary_pos_emb",
    (CallSite(_ROPE, "apply_rotary_pos_emb", "fused_apply_rotary_pos_emb"),),
    "Megatron's --rope-fusion (on unless --no-rope-fusion) calls Transformer Engine's fused RoPE, None without "
    "it (TransformerConfig then refuses the flag); the unfused RoPE was a quarter of a GPT's step on one H200",
    "fused_rope.fused_apply_rotary_pos_emb", "megatron_diloco.megatron_adapter.fused_rope.install",
    when="rope fusion on CUDA without Transformer Engine")

_CLIP = "megatron.core.optimizer.clip_grads"
#: the multi-tensor kernels Megatron takes from Transformer Engine or Apex, its host-synchronizing fallbacks
#: replaced without them (``megatron_adapter.multi_tensor.install``, called where ``fused_rope.install`` is)
MULTI_TENSOR_L2_NORM = Patch(
    "multi_tensor_l2_norm", _CLIP, "l2_norm_impl",
    (CallSite(_CLIP, "get_grad_norm_fp32", "multi_tensor_applier", ARGUMENT),),
    "without Transformer Engine or Apex the gradient norm reads each tensor's norm back to the host (a device "
    "synchronization per tensor at every step); the package's kernel keeps it on the device",
    "multi_tensor.multi_tensor_l2_norm", _MULTI_TENSOR_INSTALL, when="CUDA without Apex or Transformer Engine",
    parameters=("chunk_size", "noop_flag", "tensor_lists", "per_tensor"))
MULTI_TENSOR_SCALE = Patch(
    "multi_tensor_scale", _CLIP, "multi_tensor_scale_impl",
    (CallSite(_CLIP, "clip_grad_by_total_norm_fp32", "multi_tensor_applier", ARGUMENT),),
    "without Transformer Engine or Apex gradient clipping launches two kernels per tensor; the package's "
    "scales them with one multi-tensor kernel", "multi_tensor.multi_tensor_scale", _MULTI_TENSOR_INSTALL,
    when="CUDA without Apex or Transformer Engine",
    parameters=("chunk_size", "noop_flag", "tensor_lists", "scale"))

CATALOGUE: tuple[Patch, ...] = (*INSTALL, DATA_PARALLEL_RANK, DATA_PARALLEL_SIZE, PRETRAINING_SAMPLER, *REPLICA_LOCAL,
                                *LAUNCHER, *COMPAT, *INSTANCE, FUSED_ROPE, MULTI_TENSOR_L2_NORM, MULTI_TENSOR_SCALE)
