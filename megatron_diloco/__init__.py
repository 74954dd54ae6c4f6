"""megatron-diloco: DiLoCoX (arXiv 2506.21263) for Megatron-Core.

Public API::

    from megatron_diloco import DiLoCoXConfig, add_diloco_x_args, install, DiLoCoXOptimizer

``add_diloco_x_args`` is a Megatron ``extra_args_provider``; ``install(args)`` (after Megatron's
argument parsing, before ``pretrain``) turns the flags into a running DiLoCoX setup.
"""

from megatron_diloco.algorithm.config import DiLoCoXConfig
from megatron_diloco.version import __version__

__all__ = ["DiLoCoXConfig", "add_diloco_x_args", "install", "DiLoCoXOptimizer", "__version__"]


def __getattr__(name: str):
    # The adapter is imported lazily, so that the algorithm and the federation load without it.
    if name == "add_diloco_x_args":
        from megatron_diloco.megatron_adapter.arguments import add_diloco_x_args

        return add_diloco_x_args
    if name == "install":
        from megatron_diloco.megatron_adapter.integration import install

        return install
    if name == "DiLoCoXOptimizer":
        from megatron_diloco.megatron_adapter.optimizer import DiLoCoXOptimizer

        return DiLoCoXOptimizer
    raise AttributeError(name)
