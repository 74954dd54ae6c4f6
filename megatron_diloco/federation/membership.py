"""Who is present at a boundary, on torchft 0.2.0 (pinned: the calls into it are all here).

One torchft ``Manager`` per rank of a job (``rank`` = the rank in the job, ``world_size`` = the job's
world, ``replica_id`` = the job's ``--diloco-x-replica-id`` and ``#w<world size>``: a quorum holding a job
of another world size is refused before torchft builds a group over it, :func:`other_worlds`): rank 0 runs
the job's manager server, which heartbeats the lighthouse (``--diloco-x-lighthouse``) every 100 ms and asks it for a quorum once
every rank of the job reached the boundary. The quorum's members are the jobs that asked and still
heartbeat. Each rank's reconfigurable gloo group then spans rank k of every member: exactly this
rank's outer group (the jobs sorted by replica id). When the members changed, they authenticate and
compare each other (:mod:`megatron_diloco.federation.handshake`). A job whose progress is below the most
advanced member's receives, per rank from rank k of an up-to-date job, the state the algorithm gives
(:meth:`megatron_diloco.algorithm.federated.FederatedRounds.state_dict`), sealed with the run's key
(:mod:`megatron_diloco.federation.transport`; no pickle crosses between jobs).

A meeting is bounded (``meeting_timeout_s``): a lighthouse that is down or a member stuck in it costs
this job the meeting, and it trains the round alone (a failed round, as in a partition); it meets again
at the next boundary. After ``alone_timeout_s`` without a meeting the job stops with an error naming the
lighthouse.

A rank that holds k exchange slots (sites of different data-parallel size, ``segments``) sits in the run as k
*virtual ranks* of a job of ``world x k`` ranks (numbered alike in every job: the adapter gives
``tp + TP (pp + PP slot)``): one Manager, one outer group and one heal server
per slot (:class:`_Seat`), so that the members of slot j's group are the ranks of every job that hold slot j.
Their quorums are asynchronous and their commits vote on a thread each (one process casts k of its job's votes,
which torchft waits for together); everything else runs slot by slot, in slot order, on every rank.

Ports: the lighthouse's; on rank 0 of each job the federation store (``--diloco-x-federation-port``,
0: any free one) and the manager server (``TORCHFT_MANAGER_PORT``, default any), both bound on every
interface by torch / torchft; on every rank a gloo port per outer group and the heal server (bound to
the rank's advertised address). ``docs/federation.md`` has the threat model.
"""

from __future__ import annotations

import dataclasses
import datetime
import http.client
import logging
import os
import socket
import threading
import time
from typing import Callable

import torch
import torch.distributed as dist

from megatron_diloco.algorithm import faults
from megatron_diloco.algorithm.federated import Meeting
from megatron_diloco.algorithm.link import bounded_all_reduce, job_reduce
from megatron_diloco.algorithm.groups import register_group, retire_group
from megatron_diloco.algorithm.slot_exchange import joined_state, slot_state

logger = logging.getLogger(__name__)

#: the name under which torch's group tables list a federation group (one per quorum)
GROUP_NAME = "diloco_x_federation_{quorum}_{rank}"


def reconfigurable_gloo(timeout: datetime.timedelta):
    """torchft's reconfigurable gloo group, except that a superseded group is never aborted in place: torchft
    0.2.0 aborts it inside ``configure`` (on the quorum thread the training thread waits for), and a gloo
    abort waits for a collective still queued on it up to its timeout. It is retired instead
    (:func:`retire_group`): its destructor waits on a daemon thread."""
    from torchft import ProcessGroupGloo

    class RetiringGloo(ProcessGroupGloo):
        def abort(self, errored: bool = True) -> None:
            old, self._pg = self._pg, None
            retire_group(old)

    return RetiringGloo(timeout=timeout)


@dataclasses.dataclass
class _Seat:
    """One virtual rank of this job in the run's torchft replica group (module doc): a rank holding one exchange
    slot has one, a rank holding k has k."""

    v: int
    """The virtual rank (of ``world x k``; module doc)."""
    lo: int
    hi: int
    """Its slot's elements of the rank's flat shard."""
    pg: object
    transport: object
    manager: object = None
    group: dist.ProcessGroup | None = None
    """This meeting's outer group of the slot (rank v of every member job)."""


class TorchftMembership:
    """A :class:`megatron_diloco.algorithm.federated.Membership` on torchft (module doc). Construct on
    every rank of the job, at the same point (collective over the job's world: rank 0 starts the
    federation store and shares its port).

    Args:
        lighthouse: ``HOST:PORT`` of ``torchft_lighthouse``.
        replica_id: this job's name (``--diloco-x-replica-id``), unique in the run.
        advertise_host: the address other jobs reach this job's rank 0 at (its federation store and
            manager); None: rank 0's fully qualified name, shared with the job's ranks.
        store_port: the federation store's port (0: any free one).
        key: the run's key (:class:`megatron_diloco.federation.auth.RunKey`): heals and handshakes are sealed.
        timeout_s: bound on a collective or a heal (``--diloco-x-outer-timeout-minutes``).
        meeting_timeout_s: bound on one meeting (the quorum, the handshake and a heal).
        alone_timeout_s: how long the job trains without meeting anyone (the lighthouse unreachable, or every
            meeting failing) before it stops with an error.
        min_replicas: meet only when at least this many jobs are present.
        job_group: this job's world (gloo; None with one rank).
        state_dict / load_state_dict: what a behind job receives, and how it takes it.
        heal_bytes: the largest heal body this rank accepts.
        segments: the bounds of the exchange slots this rank holds (``[k + 1]``, sites of different data-parallel
            size); None: one. ``virtual_ranks``: slot j's rank in the run's jobs (``[k]``, the same number for
            the same slot of the same model shard in every job; default ``rank x k + j``) of ``virtual_world``
            (default ``world x k``): k virtual ranks (module doc).
    """

    def __init__(self, lighthouse: str, replica_id: str, advertise_host: str | None, store_port: int,
                 key, timeout_s: float, meeting_timeout_s: float, alone_timeout_s: float, min_replicas: int,
                 job_group: dist.ProcessGroup | None, state_dict: Callable[[], dict],
                 load_state_dict: Callable[[dict], None], heal_bytes: Callable[[], int],
                 segments: tuple[int, ...] | None = None, virtual_ranks: tuple[int, ...] | None = None,
                 virtual_world: int | None = None) -> None:
        os.environ.setdefault("RUST_LOG", "warn")  # torchft's manager server logs every quorum at info
        for name in ("torchft", "torchft_commits", "torchft_quorums", "torchft_errors"):
            logging.getLogger(name).setLevel(logging.CRITICAL)  # its failures are reported here, once
        from torchft import Manager

        from megatron_diloco.federation.transport import SealedTransport

        self.job_group = job_group
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.replica_id = replica_id
        self.lighthouse = lighthouse
        self.timeout_s = timeout_s
        self.meeting_timeout_s = meeting_timeout_s
        self.alone_timeout_s = alone_timeout_s
        self._store = None
        where = [advertise_host, store_port]
        if self.rank == 0:  # the federation store: torchft's manager keys and the outer groups' rendezvous
            warn_if_unreachable(lighthouse)
            self._store = dist.TCPStore("0.0.0.0", store_port, is_master=True, wait_for_workers=False,
                                        timeout=datetime.timedelta(seconds=timeout_s))
            where = [advertise_host or default_advertise_host(), self._store.port]
        if self.world > 1:  # rank 0's address and port, as every rank of the job must use them
            dist.broadcast_object_list(where, src=0, group=job_group)  # inside the job: not between jobs
        advertise_host, port = where
        timeout = datetime.timedelta(seconds=timeout_s)
        own_host = advertise_host if self.rank == 0 else os.environ.get("DILOCO_X_RANK_HOST", advertise_host)
        self.key = key
        bounds = tuple(segments) if segments is not None else (0, 0)
        k = len(bounds) - 1
        #: the job's world in the run: its ranks x the slots each holds (the same in every job)
        self.virtual_world = virtual_world or self.world * k
        ranks = virtual_ranks or tuple(self.rank * k + j for j in range(k))
        if len(ranks) != k:
            raise ValueError(f"{len(ranks)} virtual ranks for {k} exchange slots")
        self.seats = [_Seat(ranks[j], bounds[j], bounds[j + 1], reconfigurable_gloo(timeout),
                            SealedTransport(key, own_host, ranks[j], timeout=timeout)) for j in range(k)]
        self.state_dict, self.load_state_dict, self.heal_bytes = state_dict, load_state_dict, heal_bytes
        connect_s = max(60.0, meeting_timeout_s)
        try:
            for seat in self.seats:  # torchft heals nothing itself (allow_heal=False): the heal follows the handshake
                seat.manager = Manager(
                    pg=seat.pg, load_state_dict=lambda _: None, state_dict=lambda: {},
                    min_replica_size=min_replicas, use_async_quorum=k > 1, timeout=timeout,
                    quorum_timeout=datetime.timedelta(seconds=meeting_timeout_s),
                    connect_timeout=datetime.timedelta(seconds=connect_s),
                    rank=seat.v, world_size=self.virtual_world, store_addr=advertise_host, store_port=int(port),
                    lighthouse_addr=_lighthouse_url(lighthouse),
                    replica_id=f"{replica_id}{WORLD_TAG}{self.virtual_world}", hostname=advertise_host,
                    init_sync=False, checkpoint_transport=seat.transport)
        except RuntimeError as err:  # rank 0's manager server connects to the lighthouse once, at its start
            if "failed to connect" not in str(err):
                raise
            raise SystemExit(f"megatron-diloco: error: this job could not reach the lighthouse at {lighthouse} "
                             f"within {connect_s:.0f} s of its start (--diloco-x-meeting-timeout-minutes); start "
                             "torchft_lighthouse there (or fix --diloco-x-lighthouse), then restart the job") from None
        #: set by the quorum check when the quorum holds jobs of another world size: (this job leaves, why)
        self._other_worlds: tuple[bool, str] | None = None
        for seat in self.seats:
            seat.manager._client = _CheckedClient(seat.manager._client, self._check_quorum)
        self._quorum_id: int | None = None
        self._broken_quorum: int | None = None
        self._met_at = time.monotonic()
        self.meetings = 0
        #: the outer round this job is in (set by the rounds it serves: the fault drills' clock)
        self.rounds: Callable[[], int] = lambda: 0
        #: ``handshake(group, progress, quorum, heal_url, first) -> Agreement``: whether every member is verified
        #: and agrees, and who heals from whom; raises SystemExit on the member that leaves, HandshakeBroken
        #: when the group breaks (:func:`megatron_diloco.federation.handshake.agree`)
        self.handshake: Callable[..., object] | None = None

    @property
    def manager(self):
        """The torchft Manager of this rank's first slot."""
        return self.seats[0].manager

    @property
    def transport(self):
        return self.seats[0].transport

    @property
    def group(self) -> dist.ProcessGroup | None:
        """This meeting's outer group (the first slot's; None: none)."""
        return self.seats[0].group

    def _check_quorum(self, quorum) -> None:
        """(torchft's quorum thread, each rank) The quorum torchft fetched, before it builds a group over it: one
        with a job of another world size is refused here (:func:`other_worlds`)."""
        self._other_worlds = other_worlds(quorum.replica_ids, self.virtual_world)
        if self._other_worlds is not None:
            raise RuntimeError(self._other_worlds[1])

    def meet(self, progress: int) -> Meeting:
        """The quorum at this boundary (module doc; blocking but bounded, collective over this job's ranks).
        When the members changed, they authenticate and compare each other
        (:mod:`megatron_diloco.federation.handshake`): a job that is refused or differs leaves, the others
        meet again without it. A meeting that does not succeed within ``meeting_timeout_s`` returns this job
        alone (``Meeting.met`` False)."""
        from megatron_diloco.federation.handshake import HandshakeBroken

        started = time.perf_counter()
        deadline = started + self.meeting_timeout_s
        changed = False
        why = "no meeting within the bound"
        while True:
            left = deadline - time.perf_counter()
            if left <= 0:
                return self._alone(started, why)
            self._other_worlds = None
            err = self._quorum(progress, left)
            # every rank saw the same quorum. Only a job that has not met the run yet leaves: the ids are not
            # authenticated, and a job already in the run must not be sent away by strangers (it fails the meeting)
            if self._other_worlds is not None and self._other_worlds[0] and self.meetings == 0:
                raise SystemExit(f"megatron-diloco: error: {self._other_worlds[1]}. This job leaves the run; the "
                                 "others go on. Give it as many ranks as theirs (with --diloco-x-exchange-slots: "
                                 "the same TP x PP x --diloco-x-exchange-slots).")
            if self._job_any(err is not None):  # (a configure may fail on one rank only)
                why = _reason(err) if err is not None else "another rank of this job could not join the quorum"
                self._reset_after_failure()
                logger.warning("DiLoCoX: the meeting at the lighthouse %s failed (%s); %s", self.lighthouse, why,
                               "trying again" if deadline - time.perf_counter() > 1.0 else "training this round alone")
                time.sleep(min(1.0, max(0.0, deadline - time.perf_counter())))
                continue
            quorum = self.manager._quorum_id  # torchft 0.2.0 has no public getter (the same on every seat)
            if quorum == self._quorum_id:
                break
            if quorum == self._broken_quorum:  # never again a collective on a group that broke: wait for a new quorum
                why = "the meeting's group broke and no new quorum formed"
                time.sleep(min(0.5, max(0.0, deadline - time.perf_counter())))
                continue
            changed = True
            self._retire()
            for seat in self.seats:
                parent = seat.pg.parent
                labels = [i * self.virtual_world + seat.v for i in range(parent.size())]
                seat.group = register_group(parent, GROUP_NAME.format(quorum=quorum, rank=seat.v), labels)
            self._quorum_id = quorum
            try:
                ok = self._agree_and_heal(progress, quorum)
                broken = False
            except HandshakeBroken as e:
                logger.warning("DiLoCoX: %s; meeting again", e)
                ok, broken, why = False, True, str(e)
            ok, broken = not self._job_any(not ok), self._job_any(broken)
            if broken:  # never again a collective on this quorum's groups
                self._broken_quorum = quorum
            if ok:
                logger.warning("DiLoCoX: %d job%s present (quorum %d); this job is member %d",
                               self.group.size(), "s" if self.group.size() > 1 else "", quorum, self.group.rank())
                break
            self.commit(False)  # a member was refused, differs or broke the group: meet again without it
            self._quorum_id = None
        self.meetings += 1
        self._met_at = time.monotonic()
        slots = tuple(seat.group for seat in self.seats) if len(self.seats) > 1 else None
        return Meeting(self.group, changed, self.group.size(), time.perf_counter() - started, slot_groups=slots)

    def _quorum(self, progress: int, left: float) -> BaseException | None:
        """Every seat's quorum at this boundary (k seats: started together, then waited for); the first error."""
        err = None
        try:
            for seat in self.seats:
                seat.manager.load_state_dict({"step": int(progress), "batches_committed": 0})
                seat.manager.start_quorum(allow_heal=False, timeout=datetime.timedelta(seconds=left))
            if len(self.seats) > 1:
                for seat in self.seats:
                    seat.manager.wait_quorum()
                if len({seat.manager._quorum_id for seat in self.seats}) > 1:
                    raise RuntimeError("the slots of this rank were given different quorums")
        except Exception as e:  # the lighthouse unreachable, the quorum timed out
            err = e
        return err or next((e for e in (seat.manager.errored() for seat in self.seats) if e is not None), None)

    def _agree_and_heal(self, progress: int, quorum: int) -> bool:
        """The members' handshake, then the heal of the members behind the most advanced one: its rank k offers
        a snapshot, rank k of each member behind fetches it (sealed, checked, :meth:`load_state_dict`); a
        bounded all-reduce over the group tells the source when every fetch is done. A rank holding several
        slots does each step slot by slot (each over its slot's group and heal server) and takes the slots'
        parts as one state. Raises :class:`HandshakeBroken` when a group breaks or a heal fails."""
        from megatron_diloco.federation.handshake import HandshakeBroken

        if self.handshake is None or self.group.size() <= 1:
            return True
        faults.point("handshake", self.rounds())
        agreements = [self.handshake(seat.group, progress, quorum, seat.transport.url, self.meetings == 0)
                      for seat in self.seats]
        agreement = agreements[0]
        if not all(a.ok for a in agreements) or not agreement.behind:
            return all(a.ok for a in agreements)
        if any((a.source, a.behind, a.source_progress) != (agreement.source, agreement.behind,
                                                           agreement.source_progress) for a in agreements):
            raise HandshakeBroken("the slots of this rank agreed on different heals")
        me = self.group.rank()
        ok = True
        try:
            if me == agreement.source:
                state = self.state_dict()
                for seat in self.seats:
                    seat.transport.offer(quorum, agreement.source_progress,
                                         state if len(self.seats) == 1 else slot_state(state, seat.lo, seat.hi))
                faults.point("heal-source", self.rounds())
            for seat in self.seats:  # the offers are up before anyone fetches them
                bounded_all_reduce(torch.zeros(1, dtype=torch.float64), dist.ReduceOp.SUM, seat.group, self.timeout_s)
            if me in agreement.behind:
                faults.point("heal-target", self.rounds())
                try:
                    parts = [seat.transport.fetch(a.source_url, quorum, a.source_progress, self.heal_bytes())
                             for seat, a in zip(self.seats, agreements)]
                    self.load_state_dict(parts[0] if len(parts) == 1 else joined_state(parts))
                except (OSError, ValueError, http.client.HTTPException) as err:  # the source went, or sent what
                    # this rank refuses (another identity, length, dtype, a non-finite value)
                    logger.warning("DiLoCoX: the heal from member %d failed: %s", agreement.source, err)
                    ok = False
            flags = []
            for seat in self.seats:
                flag = torch.tensor([1.0 if ok else 0.0], dtype=torch.float64)
                bounded_all_reduce(flag, dist.ReduceOp.MIN, seat.group, self.timeout_s)
                flags.append(bool(flag.item()))
        except (RuntimeError, TimeoutError) as err:
            raise HandshakeBroken(f"the heal's group broke ({err})") from err
        finally:
            for seat in self.seats:
                seat.transport.withdraw()
        if not all(flags):
            raise HandshakeBroken("a member's heal failed")
        return True

    def _job_any(self, flag: bool) -> bool:
        """Whether ``flag`` holds on any rank of this job (a bounded MAX over the job's world): every rank of
        the job leaves each step of a meeting the same way, though its ranks sit in different outer groups,
        whose quorum configuration, handshake and heal may end differently."""
        return bool(job_reduce(flag, dist.ReduceOp.MAX, self.job_group, self.timeout_s))

    def _alone(self, started: float, why: str) -> Meeting:
        """A meeting that failed: this job trains the round alone (its round fails: nothing to commit with)."""
        alone_s = time.monotonic() - self._met_at
        if alone_s > self.alone_timeout_s:
            raise SystemExit(
                f"megatron-diloco: error: this job met no other job for {alone_s / 60:.1f} minutes (the last "
                f"meeting at the lighthouse {self.lighthouse} failed: {why}); it stops with its state intact "
                "(--diloco-x-alone-timeout-minutes). Check that the lighthouse runs at that address and that "
                "this host reaches it, then restart the job (--load resumes it).")
        changed = self.group is not None
        self._retire()
        self._quorum_id = None
        self._broken_quorum = None  # a restarted lighthouse numbers its quorums from 1 again
        for seat in self.seats:
            seat.manager.report_error(RuntimeError(f"the meeting failed: {why}"))
        self.meetings += 1
        return Meeting(None, changed, 1, time.perf_counter() - started, met=False)

    def _reset_after_failure(self) -> None:
        """After a failed quorum torchft keeps the failed future and re-raises it at the next quorum: drop it."""
        for seat in self.seats:
            seat.manager._quorum_future = None

    def _retire(self) -> None:
        """Retire the current groups (:func:`retire_group`; torchft has already configured the next ones)."""
        for seat in self.seats:
            group, seat.group = seat.group, None
            retire_group(group)

    def abandon(self) -> None:
        """A round failed on this job: the current group is retired at once (torchft's wrapper lets it go to the
        reaper, :func:`reconfigurable_gloo`), and the next meeting configures a new one even if the coordinator
        repeats the quorum's number."""
        if self.group is None:
            return
        for seat in self.seats:
            seat.pg.abort()
        self._retire()
        self._quorum_id = None
        for seat in self.seats:
            seat.manager._quorum_id = -1  # torchft 0.2.0 reconfigures only when the number changes

    def commit(self, ok: bool, mean: bytes | None = None) -> bool:
        """Job-wide AND (torchft's ``should_commit``) of ``ok`` and, ``mean`` given (the digest of the mean
        this rank is about to apply), of every member of the outer group having landed the same mean, each
        digest sealed with the run's key (:func:`megatron_diloco.federation.handshake.means_agree`)."""
        from megatron_diloco.federation.handshake import HandshakeBroken, means_agree

        why = "the exchange failed on this rank"
        if ok and mean is not None and self.group is not None and self.group.size() > 1:
            size = len(mean) // len(self.seats)  # one fingerprint per slot, each checked over its slot's group
            for j, seat in enumerate(self.seats):
                try:
                    agree, why_j = means_agree(seat.group, self.key, self._quorum_id or 0, self.rounds(),
                                               mean[j * size:(j + 1) * size], self.timeout_s)
                except HandshakeBroken as err:
                    agree, why_j = False, str(err)
                if ok and not agree:
                    ok, why = False, why_j
            if not ok:
                logger.warning("DiLoCoX round %d: not committed: %s", self.rounds(), why)
        if not ok:
            for seat in self.seats:
                seat.manager.report_error(RuntimeError(why))
        # every rank of the job votes; a rank may still be in its exchange's wait and then the means' check, each
        # bounded by timeout_s: wait for it past both (with torchft's default, its own timeout_s, a rank that
        # finished first raised TimeoutError while another waited out a failing exchange)
        timeout = datetime.timedelta(seconds=3 * self.timeout_s + 60)
        if len(self.seats) == 1:
            return bool(self.manager.should_commit(timeout=timeout))
        votes: list = [None] * len(self.seats)  # k votes of this job at once: torchft waits for all of them

        def vote(j: int) -> None:
            try:
                votes[j] = bool(self.seats[j].manager.should_commit(timeout=timeout))
            except Exception as err:  # noqa: BLE001 - a vote that failed is a no
                logger.warning("DiLoCoX round %d: slot %d's commit failed: %s", self.rounds(), j, err)
                votes[j] = False

        threads = [threading.Thread(target=vote, args=(j,), name=f"diloco_x_commit{j}") for j in range(len(votes))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return all(votes)

    def shutdown(self) -> None:
        """Leave the run (end of training): stop heartbeating."""
        for seat in self.seats:
            try:
                seat.manager.shutdown(wait=False)
            except Exception as err:  # leaving must not fail the run that just ended
                logger.warning("DiLoCoX: leaving the run: %s", err)
        self._retire()


class _CheckedClient:
    """torchft 0.2.0's manager client (a native object) with its quorum checked before the manager builds the
    group over it (``Manager._async_quorum`` fetches the quorum, then configures the group)."""

    def __init__(self, client, check) -> None:
        self._client, self._check = client, check

    def _quorum(self, *args, **kwargs):
        quorum = self._client._quorum(*args, **kwargs)
        self._check(quorum)
        return quorum

    def __getattr__(self, name: str):
        return getattr(self._client, name)


#: what the job's torchft replica id carries after its name: its world size (compared before any group is built)
WORLD_TAG = "#w"


def other_worlds(replica_ids: list[str], world: int) -> tuple[bool, str] | None:
    """None when every member of a quorum (torchft replica ids ``NAME#wWORLD:uuid``) runs ``world`` ranks;
    else ``(this job leaves, why)``: the jobs of the most common world size stay (a tie: the size of the first
    member in the quorum's order), the others leave. Every rank of every member reads the same ids, so they all
    decide alike."""
    worlds = []
    for rid in replica_ids:
        tag = rid.split(":")[0].rpartition(WORLD_TAG)[2]
        worlds.append(int(tag) if tag.isdigit() else -1)
    if all(w == world for w in worlds):
        return None
    count = {w: worlds.count(w) for w in worlds}
    stay = max(count, key=lambda w: (count[w], -worlds.index(w)))
    why = (f"the jobs of this run have {stay} ranks each, this one has {world}" if world != stay else
           f"a job with another number of ranks ({', '.join(str(w) for w in sorted(set(worlds)) if w != stay)}) "
           f"met this run's jobs ({stay} ranks each); it is told to leave")
    return world != stay, why


def _reason(err: BaseException) -> str:
    """A one-line reason for a failed meeting (torchft wraps its errors with their tracebacks)."""
    inner = getattr(err, "original_exception", None) or err
    text = str(inner).strip().splitlines()
    return f"{type(inner).__name__}: {text[0] if text else ''}"[:300]


def warn_if_unreachable(lighthouse: str) -> None:
    """Say at once, naming the address, when nothing listens at the lighthouse's address (the job still
    starts: meetings fail until it comes up)."""
    url = _lighthouse_url(lighthouse).split("://", 1)[1].rstrip("/")
    host, _, port = url.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=5.0):
            return
    except (OSError, ValueError) as err:
        logger.warning("DiLoCoX: cannot reach the lighthouse at %s (%s); this job trains alone until it can "
                       "(--diloco-x-alone-timeout-minutes bounds how long)", lighthouse, err)
        print(f"megatron-diloco: warning: cannot reach the lighthouse at {lighthouse} ({err})", flush=True)


def _lighthouse_url(address: str) -> str:
    """``HOST:PORT`` (or an ``http://`` URL) as torchft's manager expects it."""
    return address if "://" in address else f"http://{address}"


def default_advertise_host() -> str:
    """This host's name as other sites would resolve it (``--diloco-x-advertise-host``'s default)."""
    return socket.getfqdn()
