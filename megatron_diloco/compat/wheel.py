"""Megatron-Core installed from its wheel: the dataset helpers are prebuilt, nothing to compile.

``megatron.training.initialize._compile_dependencies`` calls
``megatron.core.datasets.utils.compile_helpers``, which runs ``make`` in the package folder and
``sys.exit(1)``s on failure. The wheel ships ``helpers_cpp*.so`` but no Makefile, so on any machine
(GPU or CPU) a pip-installed megatron-core exits there. :func:`apply` makes the compile step a
no-op only when the compiled helpers import and there is no Makefile to build them from (a source
checkout of Megatron-LM keeps its own behaviour).
"""

from __future__ import annotations

import importlib
import logging
import os

logger = logging.getLogger(__name__)


def apply() -> bool:
    """Skip the dataset-helper compilation when the prebuilt helpers are present. Returns whether
    it did."""
    from megatron.core.datasets import utils as dataset_utils

    folder = os.path.dirname(dataset_utils.__file__)
    if os.path.exists(os.path.join(folder, "Makefile")):
        return False
    try:
        importlib.import_module("megatron.core.datasets.helpers_cpp")
    except ImportError:
        return False  # let Megatron's own error surface
    dataset_utils.compile_helpers = lambda: None
    logger.info("megatron-core wheel: using its prebuilt dataset helpers (no Makefile to compile)")
    return True
