"""Run an unmodified Megatron-LM pretraining script with DiLoCoX.

Usage (one process per rank, e.g. under torchrun)::

    torchrun --nproc-per-node 8 -m megatron_diloco.launch pretrain_gpt.py \\
        <Megatron flags> --diloco-x --diloco-x-replicas 2 --diloco-x-local-steps 500

    python -m torch.distributed.run --nproc-per-node 4 -m megatron_diloco.launch SCRIPT [ARGS...]

``SCRIPT`` is any Megatron-Core 0.19 training script that parses its flags with
``megatron.training.arguments.parse_and_validate_args`` (Megatron-LM's ``pretrain_gpt.py`` at tag
``core_v0.19.0``, for instance). Before the script's ``__main__`` block runs, the launcher

1. applies ``megatron_diloco.compat.cpu`` when the process has no GPU (Megatron over gloo on CPU),
   and ``megatron_diloco.compat.distopt_resume`` (Megatron fixes for resuming the distributed
   optimizer without TE/Apex or in fp32; no effect on training steps);
2. chains :func:`megatron_diloco.add_diloco_x_args` after the script's own ``extra_args_provider``
   (``megatron.training.arguments.parse_args`` is wrapped, so every parse sees the ``--diloco-x*``
   flags, including Megatron's own ``parse_args(ignore_unknown_args=True)`` calls);
3. right after ``parse_and_validate_args`` returns, gives Megatron's rope fusion (its default with
   RoPE) the package's Triton kernel where Transformer Engine is absent
   (:func:`megatron_diloco.megatron_adapter.fused_rope.install`; on a machine without a GPU it exits
   naming ``--no-rope-fusion``) and, without Apex or Transformer Engine on a GPU, gradient clipping a norm
   computed without host synchronizations (:func:`megatron_diloco.megatron_adapter.multi_tensor.install`),
   then calls :func:`megatron_diloco.install`, which validates the flags
   (exiting with a message naming the flag) and wires DiLoCoX into Megatron's training loop; without
   ``--diloco-x`` it changes nothing.

Then it runs the script like ``python SCRIPT ARGS...`` would: ``sys.argv = [SCRIPT, *ARGS]``, the
script's folder first on ``sys.path`` before ``megatron`` is first imported (Megatron-LM's scripts
import their neighbours, e.g. ``gpt_builders.py``, ``model_provider.py``, and a Megatron-LM checkout
uses its own ``megatron`` package) and ``runpy.run_path(SCRIPT, run_name="__main__")``.

The patches are made on the module attributes before the script is executed, so a script that
does ``from megatron.training.arguments import parse_and_validate_args`` gets the wrapped function.

Scripts that already know DiLoCoX (their ``extra_args_provider`` adds ``--diloco-x`` itself and they
call ``megatron_diloco.install(args)``, such as ``examples/pretrain_gpt_diloco.py`` or a script
patched with ``patches/pretrain_gpt_core_v0.19.patch``) can be launched the same way: the launcher
then only applies the compat patches and leaves the flags and ``install`` to the script. If such a
script parses ``--diloco-x`` but never calls ``install``, the run stops before the model is built.
"""

from __future__ import annotations

import functools
import logging
import os
import runpy
import sys

logger = logging.getLogger(__name__)

USAGE = """\
usage: python -m megatron_diloco.launch SCRIPT [ARGS...]

Run the Megatron pretraining script SCRIPT (one process per rank, e.g. under torchrun) with the
--diloco-x* flags added to its arguments and DiLoCoX installed when --diloco-x is given; on a
machine without a GPU, Megatron-Core is first patched to run on CPU over gloo.

example:
  torchrun --nproc-per-node 4 -m megatron_diloco.launch pretrain_gpt.py <megatron flags> \\
      --diloco-x --diloco-x-replicas 2 --diloco-x-local-steps 100
"""


class _State:
    """What the wrapped argument parsing learned about the running script."""

    def __init__(self) -> None:
        self.script_adds_flags = False  # the script's extra_args_provider defines --diloco-x itself


def _resolve_script(path: str) -> str:
    script = os.path.abspath(path)
    if os.path.isdir(script):
        if not os.path.isfile(os.path.join(script, "__main__.py")):
            raise SystemExit(f"megatron_diloco.launch: error: {path!r} is a directory without "
                             "__main__.py; give the training script, e.g. pretrain_gpt.py")
    elif not os.path.isfile(script):
        raise SystemExit(f"megatron_diloco.launch: error: training script not found: {path!r} "
                         f"(resolved to {script!r}, working directory {os.getcwd()!r})")
    return script


def _patch_argument_parsing(state: _State) -> None:
    """Wrap ``parse_args`` / ``parse_and_validate_args`` at their module attributes."""
    from megatron.training import arguments

    from megatron_diloco.megatron_adapter.arguments import add_diloco_x_args

    if getattr(arguments.parse_args, "_diloco_x_launch", False):
        return
    original_parse_args = arguments.parse_args
    original_parse_and_validate = arguments.parse_and_validate_args

    @functools.wraps(original_parse_args)
    def parse_args(extra_args_provider=None, ignore_unknown_args=False):
        def provider(parser):
            if extra_args_provider is not None:
                parser = extra_args_provider(parser)
            if "--diloco-x" in parser._option_string_actions:
                state.script_adds_flags = True  # a DiLoCoX-aware script: it installs itself
                return parser
            return add_diloco_x_args(parser)

        return original_parse_args(provider, ignore_unknown_args)

    @functools.wraps(original_parse_and_validate)
    def parse_and_validate_args(*args, **kwargs):
        # Megatron's parse_and_validate_args calls the module-global parse_args: the wrapper above.
        parsed = original_parse_and_validate(*args, **kwargs)
        from megatron_diloco.megatron_adapter import fused_rope, multi_tensor

        try:
            fused_rope.install(parsed)  # rope fusion without Transformer Engine (idempotent)
            multi_tensor.install(parsed)  # the gradient norm without host syncs, without Apex / TE (idempotent)
        except ValueError as err:
            raise SystemExit(f"megatron-diloco: error: {err}") from None
        if not state.script_adds_flags:
            import megatron_diloco

            megatron_diloco.install(parsed)  # exits naming the flag on a bad setting; no-op if off
        return parsed

    parse_args._diloco_x_launch = True
    parse_and_validate_args._diloco_x_launch = True
    arguments.parse_args = parse_args
    arguments.parse_and_validate_args = parse_and_validate_args


def _check_installed_before_training() -> None:
    """Stop a DiLoCoX-aware script that parsed ``--diloco-x`` but never called ``install``."""
    from megatron.training import training

    original = training.setup_model_and_optimizer

    @functools.wraps(original)
    def setup_model_and_optimizer(*args, **kwargs):
        from megatron.training.global_vars import get_args

        if getattr(get_args(), "diloco_x", False) and not getattr(
                training.get_megatron_optimizer, "_diloco_x", False):
            raise SystemExit("megatron_diloco.launch: error: --diloco-x is set but the script never "
                             "called megatron_diloco.install(args) after parse_and_validate_args")
        return original(*args, **kwargs)

    training.setup_model_and_optimizer = setup_model_and_optimizer


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, end="", file=sys.stdout if argv else sys.stderr)
        raise SystemExit(0 if argv else 2)
    script = _resolve_script(argv[0])
    # Like `python SCRIPT`: the script's folder first on sys.path, before anything imports megatron,
    # so a script inside a Megatron-LM checkout uses that checkout's megatron package, and finds
    # its neighbours (gpt_builders.py, model_provider.py).
    sys.path.insert(0, script if os.path.isdir(script) else os.path.dirname(script))

    from megatron_diloco import compat

    compat.apply_all()  # before Megatron builds anything: CPU shim (no CUDA), resume + wheel fixes
    state = _State()
    _patch_argument_parsing(state)
    _check_installed_before_training()

    sys.argv = [script, *argv[1:]]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
