"""How replicas in separate worlds or jobs split the run's data: which samples each job's loaders read.

Replicas in separate worlds (``--diloco-x-outer-store``) or jobs (``--diloco-x-lighthouse``): each world's data
loaders take the samples that its ranks would take as data-parallel ranks ``replica x dp + dp_rank`` of
``R x dp`` in one world, so the R launches read disjoint data, sample for sample as one world of R replicas
does (evaluation too: a replica's validation loss covers its share; average the R). Megatron's sampler reads
the two through ``parallel_state``, swapped while it builds them
(:data:`~megatron_diloco.megatron_adapter.patches.DATA_PARALLEL_RANK` and ``_SIZE``).

``consumed_samples`` (Megatron's ``args.consumed_train_samples``: this launch's own samples) is handed to the
sampler as R times that, its position in the R launches' stream: a launch resumed from iteration i goes on with
the samples of iteration i + 1, not those of iteration i / R again. A separate job with its own global batch
reads its slot at its own rate the same way.

Sites of different data-parallel size (``--diloco-x-exchange-slots`` G): every job reads as G data-parallel
ranks would, ``R x G`` in all, so that the slots of jobs of any DP never overlap; a rank of a site of DP d reads
as the first of its G / d (the others' samples are left unread: a site of fewer ranks takes fewer samples per
round of micro-batches) and its position scales by G / d.

The datasets are sized for the run's samples (:func:`num_samples`): datasets sized for one launch would run out
at 1/R of the run (seen: the validation iterator ended at iteration 2100 of 3000).
"""

from __future__ import annotations

import functools
import math
from typing import Callable

from megatron_diloco.megatron_adapter import patches


def build_loader(build: Callable, replicas: int, index: int, slots: int | None) -> Callable:
    """Megatron's ``build_pretraining_data_loader`` for replica ``index`` of ``replicas`` (module doc); ``slots``:
    ``--diloco-x-exchange-slots`` (None: every job the same DP)."""
    from megatron.core import parallel_state as ps

    R, r, G = replicas, index, slots

    @functools.wraps(build)
    def build_pretraining_data_loader(dataset, consumed_samples):
        size = ps.get_data_parallel_world_size
        per = (lambda *a, **k: G // size(*a, **k)) if G else (lambda *a, **k: 1)  # data slots per rank
        with patches.swapped(
                (patches.DATA_PARALLEL_RANK,
                 lambda rank: lambda *a, **k: (r * size(*a, **k) + rank(*a, **k)) * per(*a, **k)),
                (patches.DATA_PARALLEL_SIZE, lambda size_: lambda *a, **k: R * size_(*a, **k) * per(*a, **k))):
            return build(dataset, R * consumed_samples * per())

    return build_pretraining_data_loader


def num_samples(get_num_samples: Callable, replicas: int, slots: int | None, dp: int,
                pace: float | None = None) -> Callable:
    """Megatron's ``get_train_valid_test_num_samples`` sized for the run's samples: R times a job's (with
    ``slots`` G, R G / dp times: module doc; with ``--diloco-x-site-pace`` P, ceil(P) times that again: a job may
    run up to P times the run's iterations, and evaluate as often)."""
    factor = replicas * (slots // dp if slots else 1) * (math.ceil(pace) if pace else 1)

    @functools.wraps(get_num_samples)
    def get_train_valid_test_num_samples():
        return tuple(None if n is None else factor * n for n in get_num_samples())

    return get_train_valid_test_num_samples
