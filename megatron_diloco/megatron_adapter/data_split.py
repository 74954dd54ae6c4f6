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

Sites of different micro-batch (``--diloco-x-data-micro-batch`` U, the same on every job): Megatron's sampler hands
data-parallel rank v of N the samples ``[v m, (v + 1) m)`` of every ``m N`` in a row, so jobs whose micro-batches m
differ would cut the stream differently and read each other's samples. Each job's sampler is built at micro-batch
U instead, the stream cut alike everywhere, and each of its micro-batches of m is m / U of its U-sample pieces in a
row (:class:`Dealt`): disjoint for any m that U divides, and a job's position is the same count of samples.

The datasets are sized for the run's samples (:func:`num_samples`): datasets sized for one launch would run out
at 1/R of the run (seen: the validation iterator ended at iteration 2100 of 3000).
"""

from __future__ import annotations

import functools
import math
from typing import Callable, Iterable, Iterator

import torch.distributed as dist

from megatron_diloco.megatron_adapter import patches


class Dealt:
    """A batch sampler whose batches are ``k`` of ``inner``'s in a row, concatenated (a partial group at the end
    is dropped, as Megatron's sampler drops a partial batch)."""

    def __init__(self, inner: Iterable[list[int]], k: int) -> None:
        self.inner, self.k = inner, k

    def __len__(self) -> int:
        return len(self.inner)  # Megatron's sampler's length: its total samples

    def __iter__(self) -> Iterator[list[int]]:
        batch, count = [], 0
        for piece in self.inner:
            batch, count = batch + list(piece), count + 1
            if count == self.k:
                yield batch
                batch, count = [], 0


def dealt_in(unit: int, told: set[int] | None = None) -> Callable[[type], Callable[..., Dealt]]:
    """The replacement of Megatron's ``MegatronPretrainingSampler`` (while a loader is built) that deals the
    samples in micro-batches of ``unit`` (module doc): the sampler of micro-batch m becomes m / unit of them.
    ``told``: the micro-batches said on stdout already (rank 0 says each once)."""
    def wrap(sampler: type) -> Callable[..., Dealt]:
        def make(**kwargs) -> Dealt:
            m = kwargs["micro_batch_size"]
            if m % unit:
                raise ValueError(f"--diloco-x-data-micro-batch {unit} does not divide the micro-batch {m} of a data "
                                 "loader (--micro-batch-size, --eval-micro-batch-size): give a divisor of both")
            if told is not None and m not in told:
                told.add(m)
                if not dist.is_initialized() or dist.get_rank() == 0:
                    print(f"megatron-diloco: this job's micro-batches of {m} read {m // unit} of the run's "
                          f"micro-batches of {unit} each (--diloco-x-data-micro-batch {unit})", flush=True)
            return Dealt(sampler(**{**kwargs, "micro_batch_size": unit}), m // unit)
        return make
    return wrap


def build_loader(build: Callable, replicas: int, index: int, slots: int | None, unit: int | None = None) -> Callable:
    """Megatron's ``build_pretraining_data_loader`` for replica ``index`` of ``replicas`` (module doc); ``slots``:
    ``--diloco-x-exchange-slots`` (None: every job the same DP); ``unit``: ``--diloco-x-data-micro-batch`` (None:
    every job the same micro-batch)."""
    from megatron.core import parallel_state as ps

    R, r, G = replicas, index, slots
    told: set[int] = set()

    @functools.wraps(build)
    def build_pretraining_data_loader(dataset, consumed_samples):
        size = ps.get_data_parallel_world_size
        per = (lambda *a, **k: G // size(*a, **k)) if G else (lambda *a, **k: 1)  # data slots per rank
        swaps = [(patches.DATA_PARALLEL_RANK,
                  lambda rank: lambda *a, **k: (r * size(*a, **k) + rank(*a, **k)) * per(*a, **k)),
                 (patches.DATA_PARALLEL_SIZE, lambda size_: lambda *a, **k: R * size_(*a, **k) * per(*a, **k))]
        if unit is not None:
            swaps.append((patches.PRETRAINING_SAMPLER, dealt_in(unit, told)))
        with patches.swapped(*swaps):
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
