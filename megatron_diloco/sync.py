"""Round-boundary logic of DiLoCoX on one rank's shard: blocking (``none``) or one-step delay.

Notation (DESIGN.md section 1): ``theta`` outer params, ``x`` the replica's local params (the fp32
main-parameter shards of the inner optimizer), ``Delta`` the replicas' mean pseudo-gradient.

``overlap="none"`` (plain DiLoCo), at each boundary::

    delta  = theta - x ;  Delta = mean_r delta_r  (blocking)
    theta  = OuterStep(theta, Delta) ;  x <- theta

``overlap="delayed"`` (DiLoCoX), at the boundary ending round t::

    delta_t = theta_{t-1} - x       (against the params round t started from)
    wait for Delta_{t-1}            (launched one boundary ago; had all of round t to finish)
    theta_t = OuterStep(theta_{t-1}, Delta_{t-1})   (nothing to apply at the first boundary)
    launch the exchange of delta_t  (runs during round t+1)
    x <- theta_t

so every replica starts every round from the same ``theta_t``, bit for bit, and staleness is exactly
one outer step. :meth:`OuterSync.drain` applies the last exchange at the end of training.

``overlap="eager"`` (Kale, Douillard, Donchev 2025, "Eager updates for overlapped communication and
computation in DiLoCo"): as ``delayed``, but each replica also takes its own fresh pseudo-gradient
into account at once, instead of waiting a round for it::

    delta_{r,t} = a_r - x           (a_r: the point replica r started round t from)
    wait for Delta_{t-1};  theta_t = OuterStep(theta_{t-1}, Delta_{t-1})     (shared, as delayed)
    launch the exchange of delta_{r,t}
    a_r <- theta_t - c w * delta_{r,t} ;  x <- a_r
    c = eta * (1 + mu) with Nesterov, eta with heavy ball (the weight one outer step gives a fresh
    pseudo-gradient); w = 1 / R (the paper's rule, default) or ``--diloco-x-eager-weight``

The eager term is a look-ahead that the next boundary replaces by the real thing: ``Delta_t``
(which holds delta_{r,t} / R) enters ``theta_{t+1}``, and a_r is rebuilt from ``theta_{t+1}``. With
mu = 0 this is exactly the paper's update (its per-replica outer params equal theta_t minus
eta / R * delta_{r,t}: own fresh pseudo-gradient + the others' one-round-stale ones); with momentum
the paper keeps one outer momentum per replica, which drifts apart, where this keeps the one shared
momentum, so ``theta`` and ``m`` stay bit-identical across replicas and checkpoint as shared state.
With w = 1 (``--diloco-x-eager-weight 1``) the look-ahead takes the replica's own pseudo-gradient as
the estimate of the mean: when all replicas' pseudo-gradients agree, a_r equals blocking DiLoCo's
theta after the same round exactly (mu = 0), i.e. the overlap then costs nothing in the parameters;
with 1 / R the own progress of the round enters at 1 / R at once and the rest one round late.
Replicas' local params differ by their look-ahead between boundaries (by design); the drain at the
end of training sets x <- theta on every replica. Cost: the per-replica start point ``a_r``
(fp32, 4 B per shard element), checkpointed with the replica's own state.
"""

from __future__ import annotations

import dataclasses
import logging
import math

import torch
import torch.distributed as dist
from torch.profiler import record_function

from megatron_diloco.collectives import (
    ExchangeHandle, ExchangeStats, measure_link_bandwidth, start_compressed_exchange, start_exchange,
    start_threaded_exchange,
)
from megatron_diloco.config import DiLoCoXConfig
from megatron_diloco.outer import OuterNesterov, ShardView

logger = logging.getLogger(__name__)

#: Codecs that need tensor (matrix) shapes and several dependent collectives per round.
MATRIX_CODECS = ("lowrank", "lowrank-int8", "adaptive")


def _build_codec(config: DiLoCoXConfig, view: ShardView, shapes: list[tuple[int, ...]] | None):
    """The codec of ``config.compression`` over the shard bucket. ``shapes``: per shard, a matrix
    shape ``(rows, cols)`` where the shard is whole rows of a >= 2-D parameter, else ``(numel,)``
    (defaults to 1-D shapes: the low-rank codecs then quantize or send everything raw)."""
    from megatron_diloco.compression import AdaptivePolicy, get_codec

    shapes = shapes or [(v.numel(),) for v in view.flat_views]
    if len(shapes) != len(view.flat_views) or any(
            math.prod(sh) != v.numel() for sh, v in zip(shapes, view.flat_views)):
        raise ValueError("shard shapes do not match the shards")
    offsets = [0]
    for v in view.flat_views:
        offsets.append(offsets[-1] + v.numel())
    layout = [(off, tuple(sh)) for off, sh in zip(offsets, shapes)]
    policy = AdaptivePolicy(energy_target=config.energy) if config.compression == "adaptive" else None
    return get_codec(config.compression, layout, rank=config.rank, policy=policy)


@dataclasses.dataclass
class RoundReport:
    """What happened at one boundary, on this rank (sums over the shard; not reduced across ranks)."""

    round: int
    """1-based index of the boundary."""
    applied: bool
    """Whether an outer step was applied at this boundary (False at the first delayed boundary)."""
    launched: ExchangeStats
    """The exchange launched at this boundary (bytes; times filled when it completes)."""
    completed: ExchangeStats | None
    """The exchange whose result was applied here (the same one for ``none``, the previous for
    ``delayed``), with its exchange and exposed times."""
    pseudo_grad_sq: float
    """Squared L2 norm of this rank's shard of the local pseudo-gradient ``theta - x``."""
    skipped: bool = False
    """True when some replica's pseudo-gradient held a NaN/Inf: nothing was sent this round, on
    every replica alike; the round's local progress was dropped and the residual kept."""


class OuterSync:
    """Owns the outer state of one rank's shard and runs the boundary protocol.

    Args:
        view: the rank's fp32 main-parameter shards (``x``), modified in place at each boundary.
        config: DiLoCoX hyperparameters (eta, mu, nesterov, overlap).
        group: the outer process group (one rank per replica, same shard). Every boundary, drain
            and checkpoint call is collective over it: all its ranks must call them in the same order.
    """

    def __init__(self, view: ShardView, config: DiLoCoXConfig, group: dist.ProcessGroup | None,
                 shapes: list[tuple[int, ...]] | None = None,
                 host_group: dist.ProcessGroup | None = None) -> None:
        self.view = view
        self.config = config
        self.group = group
        # the worker thread's group (low-rank / adaptive): the gloo mirror of ``group`` when given
        # (GPU tensors travel as host copies; megatron_diloco.topology.host_mirror_of_outer_groups)
        self.worker_group = host_group if host_group is not None else group
        self.codec = None  # None: exact fp32 all-reduce
        self._executor = None  # worker thread of the multi-collective (low-rank) exchanges
        if config.compression != "none":
            self.codec = _build_codec(config, view, shapes)
            if config.compression in MATRIX_CODECS:
                from concurrent.futures import ThreadPoolExecutor

                self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="diloco_x")
        theta = torch.empty(view.numel, dtype=torch.float32, device=view.device)  # (N,) fp32
        view.gather(theta)
        self.outer = OuterNesterov(theta, config.outer_lr, config.outer_momentum, config.nesterov)
        # The one exchange buffer: pseudo-gradient out, averaged pseudo-gradient in.
        self.buffer = torch.empty_like(theta)  # (N,) fp32
        # e: what the lossy codec did not send yet (per replica; fp32, one per shard element).
        self.residual = torch.zeros_like(theta) if self.codec is not None else None  # (N,) fp32
        # a_r: the point this replica started the round from (eager only; per replica, fp32).
        self.anchor = theta.clone() if config.overlap == "eager" else None  # (N,) fp32
        self.pending: ExchangeHandle | None = None
        self.rounds = 0
        self.skipped_rounds = 0
        #: bytes/s of the outer link: --diloco-x-bandwidth-mbps, else measured at the first boundary
        #: (adaptive only; None until then, or without an outer link)
        self.link_bytes_per_s: float | None = (config.bandwidth_mbps * 1e6 / 8
                                               if config.bandwidth_mbps is not None else None)
        self._link_measured = False

    @property
    def theta(self) -> torch.Tensor:
        return self.outer.theta

    @property
    def start_point(self) -> torch.Tensor:
        """The params every round starts from: ``theta`` (shared), or ``a_r`` (eager, per replica)."""
        return self.anchor if self.anchor is not None else self.outer.theta

    def _pseudo_gradient_into_x(self) -> float:
        """x <- start - x on the shards, in place; returns the squared norm (a host sync)."""
        xs = self.view.flat_views
        if not xs:
            return 0.0
        torch._foreach_neg_(xs)
        torch._foreach_add_(xs, self.view.split(self.start_point))
        return float(torch.stack(torch._foreach_norm(xs, 2)).double().square().sum())

    def _any_replica_nonfinite(self, sq: float) -> bool:
        """Whether any replica's pseudo-gradient shard holds a NaN/Inf.

        ``sq`` is this rank's squared norm of it (already on the host, no extra pass over the shard):
        non-finite when the shard holds a NaN/Inf, or when its fp32 norm overflows (entries near
        1e19: a diverged round, skipped as well). A 1-element MAX all-reduce over the outer group
        (blocking) makes every replica take the same decision before anything is sent."""
        flag = torch.tensor([0.0 if math.isfinite(sq) else 1.0], dtype=torch.float32, device=self.view.device)
        if self.group is not None and dist.get_world_size(self.group) > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        return bool(flag.item())

    def _complete(self, handle: ExchangeHandle) -> torch.Tensor:
        """Wait for ``handle`` and, with a lossy codec, record the squared norm of the residual it
        left (what was not sent): relative compression error = sqrt(residual_sq / input_sq)."""
        delta = handle.wait()
        if self.residual is not None and handle.stats.input_sq:
            handle.stats.residual_sq = float(torch.dot(self.residual, self.residual))
        return delta

    def _launch(self) -> ExchangeHandle:
        if self.codec is None:
            return start_exchange(self.buffer, self.group)
        # ||pseudo-gradient + residual||^2: the codec's input, without materializing it
        b, e = self.buffer, self.residual
        input_sq = float(torch.dot(b, b) + 2 * torch.dot(b, e) + torch.dot(e, e))
        if self._executor is not None:
            # (start_threaded_exchange refuses a non-gloo group for GPU tensors)
            handle = start_threaded_exchange(self.buffer, self.residual, self.codec, self.worker_group,
                                             self._executor)
        else:
            handle = start_compressed_exchange(self.buffer, self.residual, self.codec, self.group)
        handle.stats.input_sq = input_sq
        return handle

    def set_step_time(self, step_time_s: float) -> None:
        """Inner-step time measured by the caller, before each boundary: sets the adaptive codec's
        byte budget to link bandwidth x H x step time (no-op unless adaptive).

        Without ``--diloco-x-bandwidth-mbps`` the first call measures the link
        (:func:`megatron_diloco.collectives.measure_link_bandwidth`: collective over the outer group,
        run at the first boundary, when no exchange is in flight)."""
        policy = getattr(self.codec, "policy", None)
        if policy is None:
            return
        if self.link_bytes_per_s is None and not self._link_measured:
            if self.pending is not None:  # the worker thread owns the group; measure next time
                return
            self._link_measured = True
            self.link_bytes_per_s = measure_link_bandwidth(self.group, self.view.device)
            if self.link_bytes_per_s is not None:
                logger.info("DiLoCoX: measured outer link %.1f Mbit/s (all-gather, per rank); adaptive "
                            "byte budget = that x H x step time (set --diloco-x-bandwidth-mbps to fix it)",
                            self.link_bytes_per_s * 8 / 1e6)
        if self.link_bytes_per_s is None:
            return
        from megatron_diloco.compression import byte_budget

        policy.budget_bytes = byte_budget(self.link_bytes_per_s, self.config.local_steps, step_time_s)

    @torch.no_grad()
    def boundary(self) -> RoundReport:
        """Run the boundary ending the current round (collective over the outer group)."""
        self.rounds += 1
        if self.config.overlap == "none":
            with record_function("megatron_diloco::prepare"):
                sq = self._pseudo_gradient_into_x()
                self.view.gather(self.buffer)
                if self._any_replica_nonfinite(sq):
                    return self._skip(sq, completed=None)
                handle = self._launch()
            with record_function("megatron_diloco::perform"):
                delta = self._complete(handle)
                self.outer.step(delta)
                self.view.scatter_(self.theta)
            return RoundReport(self.rounds, True, handle.stats, handle.stats, sq)

        # delayed / eager: x holds delta_t after this; the buffer still holds Delta_{t-1} (in flight).
        with record_function("megatron_diloco::prepare"):
            sq = self._pseudo_gradient_into_x()
        completed = None
        with record_function("megatron_diloco::perform"):
            if self.pending is not None:
                delta_prev = self._complete(self.pending)
                completed = self.pending.stats
                self.outer.step(delta_prev)
                self.pending = None
        with record_function("megatron_diloco::launch"):
            self.view.gather(self.buffer)
            if self._any_replica_nonfinite(sq):
                return self._skip(sq, completed)
            if self.anchor is not None:  # before the launch: the exchange owns the buffer after it
                self._eager_start()
            self.pending = self._launch()
            self.view.scatter_(self.start_point)
        return RoundReport(self.rounds, completed is not None, self.pending.stats, completed, sq)

    def _eager_start(self) -> None:
        """a_r <- theta_t - c w * delta_{r,t}, with delta_{r,t} in ``buffer`` (gathered, not yet
        launched; see the module doc)."""
        c = self.config.outer_lr * ((1.0 + self.config.outer_momentum) if self.config.nesterov else 1.0)
        w = self.config.eager_weight
        if w is None:
            w = 1.0 / (dist.get_world_size(self.group) if self.group is not None else 1)
        torch.mul(self.buffer, -c * w, out=self.anchor).add_(self.theta)

    def _skip(self, sq: float, completed: ExchangeStats | None) -> RoundReport:
        """Drop this round's pseudo-gradient everywhere: x <- theta, residual untouched."""
        self.skipped_rounds += 1
        logger.warning("DiLoCoX round %d: non-finite pseudo-gradient on some replica; round skipped on "
                       "every replica (local progress of this round dropped, outer state unchanged)",
                       self.rounds)
        if self.anchor is not None:  # eager: no fresh pseudo-gradient to look ahead with
            self.anchor.copy_(self.theta)
        self.view.scatter_(self.theta)
        return RoundReport(self.rounds, completed is not None, ExchangeStats(), completed, sq, skipped=True)

    @torch.no_grad()
    def drain(self) -> ExchangeStats | None:
        """Wait for the exchange in flight (if any), apply it, and set x <- theta. Collective."""
        if self.pending is None:
            return None
        with record_function("megatron_diloco::drain"):
            delta = self._complete(self.pending)
            stats = self.pending.stats
            self.outer.step(delta)
            self.pending = None
            if self.anchor is not None:  # the look-ahead is now part of theta
                self.anchor.copy_(self.theta)
            self.view.scatter_(self.theta)
        return stats

    # ---------------- checkpointing ----------------
    def state_dict(self) -> dict:
        """Outer state, identical on every replica (the in-flight exchange is completed, not applied).
        The error-feedback ``residual`` and the eager start point ``anchor`` differ per replica and
        are checkpointed by the owner of the per-replica state
        (:class:`megatron_diloco.optimizer.DiLoCoXOptimizer`).

        Completing the exchange keeps the trajectory unchanged: a resumed run applies it at the next
        boundary exactly as the uninterrupted run does.
        """
        has_pending = self.pending is not None
        if has_pending:
            self._complete(self.pending)
        return {
            "rounds": self.rounds,
            "skipped_rounds": self.skipped_rounds,
            "theta": self.outer.theta,
            "momentum_buffer": self.outer.momentum_buffer,
            "pending_delta": self.buffer if has_pending else None,
            # low-rank bases / adaptive plan: identical on every replica
            "codec": self.codec.state_dict() if hasattr(self.codec, "state_dict") else None,
        }

    def load_state_dict(self, state: dict) -> None:
        if state["theta"].numel() != self.theta.numel():
            raise ValueError(
                f"DiLoCoX checkpoint holds an outer shard of {state['theta'].numel()} elements, this rank "
                f"owns {self.theta.numel()}: resume with the same TP/PP/DP layout and --diloco-x-replicas"
            )
        self.rounds = int(state["rounds"])
        self.skipped_rounds = int(state.get("skipped_rounds", 0))
        self.outer.load_state_dict(state)
        if hasattr(self.codec, "load_state_dict"):
            if state.get("codec") is None:
                raise ValueError(f"checkpoint has no state for --diloco-x-compression "
                                 f"{self.config.compression}: resume with the codec it was written with")
            self.codec.load_state_dict(state["codec"])
        self.pending = None
        if state.get("pending_delta") is not None:
            self.buffer.copy_(state["pending_delta"])
            self.pending = ExchangeHandle.completed(self.buffer)
