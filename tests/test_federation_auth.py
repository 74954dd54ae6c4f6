"""What separate jobs accept from each other (``megatron_diloco.federation.auth``, ``handshake``,
``transport``): nothing unpickled, nothing used before its tag verifies with the run's key.

* envelopes: a tag from another secret, another run, another quorum / sender / step (a replay) or over
  altered bytes is refused; secret files that are missing, short or readable by others are refused
  naming the flag;
* the handshake on three gloo ranks (three jobs): all with the run's secret agree; a job with another
  secret is the one that leaves (SystemExit naming the flag) while the others meet again without it; a
  member that sends a pickle whose ``__reduce__`` would run a command is refused and the command never runs;
* heals over HTTP: a sealed body arrives bit for bit; a requester or a source without the secret gets
  nothing / is refused; a pickled body served by a rogue source is refused without being loaded; a body
  larger than the receiver accepts is refused before it is read;
* the heal's content: wrong length, dtype or non-finite theta or momentum are refused by name.
"""

from __future__ import annotations

import os
import pickle
import threading
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from megatron_diloco.federation.auth import AuthenticationError, RunKey
from megatron_diloco.federation.transport import SealedTransport, decode_state, encode_state
from tests.dist_utils import run_world

SECRET = b"0123456789abcdef0123456789abcdef"


class _Boom:
    """A pickle that runs a command when loaded (what a hostile peer would send)."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


# ---------------- envelopes and secret files ----------------
def test_envelopes_verify_only_with_the_same_key_kind_and_context():
    key = RunKey(SECRET, "run")
    ctx = {"quorum": 3, "member": 1, "members": 2}
    sealed = key.seal("hello", ctx, b'{"a":1}')
    assert key.open_json("hello", ctx, sealed) == {"a": 1}
    refusals = [
        (RunKey(SECRET[::-1], "run"), "hello", ctx),  # another secret
        (RunKey(SECRET, "other-run"), "hello", ctx),  # another run
        (key, "verdict", ctx),  # another kind of message
        (key, "hello", {**ctx, "quorum": 4}),  # replayed into another quorum
        (key, "hello", {**ctx, "member": 0}),  # replayed as another sender
    ]
    for other, kind, context in refusals:
        with pytest.raises(AuthenticationError):
            other.open(kind, context, sealed)
    tampered = bytearray(sealed)
    tampered[-2] ^= 1
    with pytest.raises(AuthenticationError):
        key.open("hello", ctx, bytes(tampered))
    with pytest.raises(AuthenticationError):
        key.open("hello", ctx, pickle.dumps({"a": 1}))


def test_secret_files_are_checked_naming_the_flag(tmp_path):
    good = tmp_path / "good"
    good.write_bytes(SECRET + b"\n")
    good.chmod(0o600)
    assert RunKey.from_file(good, "r").key_id == RunKey(SECRET, "r").key_id
    short = tmp_path / "short"
    short.write_bytes(b"abc")
    short.chmod(0o600)
    shared = tmp_path / "shared"
    shared.write_bytes(SECRET)
    shared.chmod(0o644)
    for path, words in ((tmp_path / "missing", "cannot read"), (short, "at least 16"), (shared, "chmod 600")):
        with pytest.raises(ValueError, match="--diloco-x-secret-file") as err:
            RunKey.from_file(path, "r")
        assert words in str(err.value)


# ---------------- the handshake over gloo ----------------
DESCRIPTION = {"--diloco-x-outer-lr": 1.0, "--diloco-x-run": "run"}


def _handshake(rank: int, world: int, out: str, secrets: list[bytes], hostile: int, fresh: bool = False) -> None:
    from megatron_diloco.federation import handshake

    group = dist.new_group(list(range(world)), backend="gloo")
    outcome = "?"
    if rank == hostile:  # sends a pickle where a sealed JSON hello is expected, in both of the handshake's gathers
        bomb = pickle.dumps({"identity": _Boom(f"{out}/pwned")})
        for _ in range(2):
            handshake.gather_bytes(group, bomb, deadline=float("inf"))
        outcome = "sent"
    else:
        try:
            got = handshake.agree(group, RunKey(secrets[rank], "run"), 7, progress=0 if fresh else 10 * (rank + 1),
                                  description=DESCRIPTION, slot=rank, name=f"job{rank}",
                                  heal_url=f"http://h{rank}:1", first_meeting=True, timeout_s=30.0,
                                  fresh_start_heals=fresh)
            outcome = f"agree={got.ok}"
            if got.ok:  # the most advanced verified member is the heal's source
                outcome += f" source={got.source} {got.source_url} {got.source_progress} behind={got.behind}"
        except SystemExit as err:
            outcome = f"left: {err}"
    # then two rounds of the members' check that they landed the same mean: every digest equal, then
    # member 1's differing (a payload altered on its way to it)
    for round_, mine in ((3, b"mean-3"), (4, b"mean-4" if rank != 1 else b"mean-4, changed")):
        if rank == hostile:
            handshake.gather_bytes(group, pickle.dumps({"mean": _Boom(f"{out}/pwned")}), deadline=float("inf"))
            continue
        ok, why = handshake.means_agree(group, RunKey(secrets[rank], "run"), 7, round_, mine, 30.0)
        outcome += f"|{ok}" + (" unverified" if "does not verify" in why else "") + (
            " differs" if "landed another mean" in why else "")
    Path(out, f"rank{rank}").write_text(outcome)


@pytest.mark.parametrize("case", ["same", "wrong-secret", "pickle", "fresh-start"])
def test_handshake_refuses_who_lacks_the_secret_and_never_unpickles(tmp_path, case):
    """The handshake, then the members' check that they landed the same mean (``means_agree``): a member
    without the secret, or sending a pickle, is refused unread; a member whose mean differs fails the round on
    every member. ``fresh-start``: every member at progress 0 with ``fresh_start_heals`` (sites of different
    layouts): the others heal from the first."""
    secrets = [SECRET] * 3
    hostile = -1
    if case == "wrong-secret":
        secrets[2] = b"another secret entirely, 32 bytes"
    if case == "pickle":
        hostile = 1
    run_world(_handshake, 3, str(tmp_path), secrets, hostile, case == "fresh-start")
    got = [(tmp_path / f"rank{r}").read_text() for r in range(3)]
    assert not (tmp_path / "pwned").exists()
    meeting = [g.split("|")[0] for g in got]
    means = [g.split("|")[1:] for g in got]
    if case == "fresh-start":
        assert meeting == ["agree=True source=0 http://h0:1 0 behind=(1, 2)"] * 3, got
    elif case == "same":
        assert meeting == ["agree=True source=2 http://h2:1 30 behind=(1, 0)"] * 3, got
        assert means == [["True", "False differs"]] * 3, got  # the round is refused on every member alike
    elif case == "wrong-secret":
        assert meeting[:2] == ["agree=False"] * 2, got  # the others meet again without it
        assert meeting[2].startswith("left:") and "--diloco-x-secret-file" in meeting[2], got
        assert means == [["False unverified", "False unverified differs"]] * 2 + [
            ["False unverified", "False unverified"]], got
    else:
        assert meeting == ["agree=False", "sent", "agree=False"], got
        assert means[0] == means[2] == ["False unverified", "False unverified"] and means[1] == [], got


# ---------------- heals over HTTP ----------------
def _transport(key: RunKey) -> SealedTransport:
    return SealedTransport(key, "127.0.0.1", 0, timeout=timedelta(seconds=10))


def test_a_sealed_heal_arrives_bit_for_bit_and_only_with_the_secret():
    key = RunKey(SECRET, "run")
    state = {"theta": torch.randn(1000), "momentum_buffer": None,
             "meta": {"rounds": 3, "position": {"steps": 12}, "x": [1.5, "a", True]}}
    src, dst = _transport(key), _transport(key)
    stranger = _transport(RunKey(b"not the run's secret at all, no", "run"))
    try:
        src.offer(5, 12, state)
        got = dst.fetch(src.url, 5, 12, 1 << 20)
        assert got["theta"].dtype == torch.float32 and torch.equal(got["theta"], state["theta"])
        assert got["meta"] == state["meta"] and got["momentum_buffer"] is None
        with pytest.raises(Exception, match="403"):  # a requester without the secret gets nothing
            stranger.fetch(src.url, 5, 12, 1 << 20)
        for quorum, step in ((5, 11), (4, 12)):  # a request for another heal (a replayed request) gets nothing
            with pytest.raises(Exception, match="403"):
                dst.fetch(src.url, quorum, step, 1 << 20)
        stranger.offer(5, 12, state)
        with pytest.raises(Exception):  # a source without the secret: its server refuses, or its body would
            dst.fetch(stranger.url, 5, 12, 1 << 20)
        with pytest.raises(AuthenticationError, match="accepts at most 1000"):
            dst.fetch(src.url, 5, 12, 1000)
        src.withdraw()
        with pytest.raises(Exception, match="404"):
            dst.fetch(src.url, 5, 12, 1 << 20)
    finally:
        for t in (src, dst, stranger):
            t.shutdown()


def test_a_sealed_body_from_another_secret_is_refused(tmp_path):
    """A source that answers any request with a body sealed by another key: refused before it is decoded."""
    key, other = RunKey(SECRET, "run"), RunKey(b"another secret, 32 bytes long!!!", "run")
    body = other.seal("heal", {"quorum": 5, "step": 12, "rank": 0}, encode_state({"theta": torch.zeros(4)}))
    _serve_anything(body, lambda url: pytest.raises(AuthenticationError, match="does not verify"),
                    key)


def _serve_anything(body: bytes, expect, key: RunKey) -> None:
    class Rogue(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Rogue)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    dst = _transport(key)
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        with expect(url):
            dst.fetch(url, 5, 12, 1 << 20)
    finally:
        dst.shutdown()
        server.shutdown()


def test_a_pickled_heal_from_a_rogue_source_is_refused_unloaded(tmp_path):
    marker = tmp_path / "pwned"
    _serve_anything(pickle.dumps({"theta": _Boom(str(marker))}), lambda url: pytest.raises(AuthenticationError),
                    RunKey(SECRET, "run"))
    assert not marker.exists()


def test_malformed_bodies_are_refused():
    good = encode_state({"a": torch.arange(4, dtype=torch.int64)})
    assert torch.equal(decode_state(good)["a"], torch.arange(4))
    for bad in (good[:-1], good + b"x", b"\x00" * 4, b"\xff" * 8 + b"{}"):
        with pytest.raises(ValueError):
            decode_state(bad)
    with pytest.raises(TypeError):
        encode_state({"a": object()})


# ---------------- the heal's content ----------------
def _rounds(momentum: float):
    from megatron_diloco.algorithm.config import DiLoCoXConfig
    from megatron_diloco.algorithm.federated import FederatedRounds
    from megatron_diloco.algorithm.shard_view import ShardView
    from megatron_diloco.algorithm.sync import OuterSync

    params = [torch.nn.Parameter(torch.zeros(16))]
    cfg = DiLoCoXConfig(replicas=2, local_steps=4, overlap="none", compression="none", outer_momentum=momentum)
    sync = OuterSync(ShardView(params), cfg, group=None)
    fed = FederatedRounds(sync, None, lambda: {"steps": 0, "iteration": 0}, lambda p: None)
    fed.identity = "me"
    return fed


@pytest.mark.parametrize("change, words", [
    (lambda s: s.update(theta=torch.zeros(15)), "float32 x 16"),
    (lambda s: s.update(theta=torch.zeros(16, dtype=torch.float64)), "float32 x 16"),
    (lambda s: s["theta"].__setitem__(3, float("nan")), "non-finite theta"),
    (lambda s: s.update(momentum_buffer=None), "without the outer momentum"),
    (lambda s: s["momentum_buffer"].__setitem__(0, float("inf")), "non-finite the outer momentum"),
    (lambda s: s["meta"].update(rounds=-1), "rounds"),
    (lambda s: s["meta"].update(position={"steps": "12"}), "position"),
    (lambda s: s["meta"].pop("round_steps"), "round_steps"),
    (lambda s: s["meta"].update(round_steps=0), "whose round is 0 steps"),
])
def test_a_heal_that_is_not_this_ranks_outer_state_is_refused(change, words):
    fed = _rounds(momentum=0.5)
    state = fed.state_dict()
    state = {**state, "theta": state["theta"].clone(), "momentum_buffer": state["momentum_buffer"].clone(),
             "meta": dict(state["meta"])}
    fed.check_heal(state)  # as sent: accepted
    change(state)
    with pytest.raises(ValueError, match=words):
        fed.check_heal(state)
    theta_before = fed.sync.theta.clone()
    with pytest.raises(ValueError):
        fed.load_state_dict(state)
    assert torch.equal(fed.sync.theta, theta_before)  # nothing taken


def test_a_heal_from_another_run_is_refused():
    from megatron_diloco.algorithm.heal import ForeignStateError

    fed = _rounds(momentum=0.0)
    state = fed.state_dict()
    state["meta"] = {**state["meta"], "identity": "someone else"}
    with pytest.raises(ForeignStateError):
        fed.check_heal(state)


# ---------------- retiring a group off the training thread ----------------
def _retire(rank: int, world: int, out: str) -> None:
    import datetime
    import time

    from megatron_diloco.algorithm.groups import retire_group
    from megatron_diloco.federation.membership import reconfigurable_gloo

    store = dist.PrefixStore("retire", dist.distributed_c10d._get_default_store())
    pg = dist.ProcessGroupGloo(store, rank, world, datetime.timedelta(seconds=6))
    if rank == 1:  # never joins the collective: rank 0's stays queued until the group's timeout
        time.sleep(8)
        return
    work = pg.allreduce([torch.ones(8)])
    wrapper = reconfigurable_gloo(datetime.timedelta(seconds=6))
    wrapper._pg = pg
    started = time.perf_counter()
    wrapper.abort()  # what torchft's configure does to the superseded group
    retire_group(None)
    del pg, work  # the last other holders let go on this thread: the destructor must still not run here
    elapsed = time.perf_counter() - started
    Path(out, "elapsed").write_text(f"{elapsed:.3f}")


def test_a_group_with_a_stale_collective_is_retired_without_waiting(tmp_path):
    """A group whose collective timed out is never aborted in place (gloo would wait for the collective up
    to the group's timeout, 6 s here, on the thread that drops it): torchft's reconfiguration hands it to a
    daemon thread and returns at once. (That a holder dropping it last on the training thread does not run the
    destructor there is shown end to end by test_frozen_job_is_left_behind_and_leaves_cleanly.)"""
    run_world(_retire, 2, str(tmp_path))
    assert float((tmp_path / "elapsed").read_text()) < 2.0


_EXIT_WHILE_A_GROUP_CLOSES = '''
import atexit, datetime, os, sys, time
import torch, torch.distributed as dist
from megatron_diloco.algorithm import groups
rank, port, wait_at_exit = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1"
timeout = datetime.timedelta(seconds=30)
store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timeout)
pg = dist.ProcessGroupGloo(store, rank, 2, timeout)
if rank == 1:  # never joins rank 0's collective; exits while rank 0 finalizes: the collective fails then
    store.wait(["exiting"])
    time.sleep(1.0)
    os._exit(0)
work = pg.allreduce([torch.ones(4)])  # a stale collective, as a frozen peer leaves one
groups.retire_group(pg)
del pg, work
while not groups._destroying.is_set():  # the reaper is inside the group's destructor
    time.sleep(0.01)
if not wait_at_exit:
    atexit.unregister(groups._wait_at_exit)
class SlowTeardown:
    def __del__(self):  # runs while the modules are finalized: holds the window open
        time.sleep(3.0)
slow = SlowTeardown()
store.set("exiting", "1")
sys.exit(3)
'''


@pytest.mark.parametrize("wait_at_exit", [True, False], ids=["as-shipped", "without-the-wait"])
def test_a_job_exiting_while_a_retired_group_closes_exits_with_its_own_status(wait_at_exit):
    """A job leaving the run (e.g. behind it after a freeze) while the reaper destroys a group with a stale
    collective: it exits with its own status. Without the wait at exit, CPython ends the reaper thread
    during finalization inside gloo's destructor and the process aborts (SIGABRT): the control case."""
    import socket
    import subprocess
    import sys
    import time

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = [str(port), "1" if wait_at_exit else "0"]
    rank0 = subprocess.Popen([sys.executable, "-c", _EXIT_WHILE_A_GROUP_CLOSES, "0", *argv],
                             stderr=subprocess.PIPE, text=True)
    time.sleep(0.3)
    rank1 = subprocess.Popen([sys.executable, "-c", _EXIT_WHILE_A_GROUP_CLOSES, "1", *argv])
    try:
        _, err = rank0.communicate(timeout=120)
        code = rank0.returncode
    finally:
        rank1.wait(60)
    if wait_at_exit:
        assert code == 3, (code, err[-2000:])
    else:
        assert code == -6 and "terminate called" in err, (code, err[-2000:])


def test_jobs_of_another_world_size_are_told_apart_before_any_group_is_built():
    """The quorum's replica ids carry each job's world size: the jobs of the most common size stay (a tie: the
    first member's size), the others leave, every member deciding alike from the same ids."""
    from megatron_diloco.federation.membership import other_worlds

    assert other_worlds(["A#w2:u1", "B#w2:u2"], 2) is None
    assert other_worlds(["A#w2:u1", "B#w2:u2", "Z#w1:u3"], 1) == (
        True, "the jobs of this run have 2 ranks each, this one has 1")
    stays, why = other_worlds(["A#w2:u1", "B#w2:u2", "Z#w1:u3"], 2)
    assert not stays and "(1)" in why
    assert other_worlds(["A#w4:u1", "Z#w1:u2"], 1)[0] and not other_worlds(["A#w4:u1", "Z#w1:u2"], 4)[0]
    assert other_worlds(["A:u1", "B#w2:u2", "C#w2:u3"], 2)[0] is False  # an id without the tag: another size


def test_a_heal_whose_tau_exceeds_its_round_is_taken():
    """tau is H until an exchange completes, also in a warm-up round of H0 < H steps: a heal sent then is the
    run's state, not a malformed one (refusing it broke every meeting with a healing member until its bound)."""
    fed = _rounds(momentum=0.5)
    state = fed.state_dict()
    state["meta"] = {**state["meta"], "tau": 16, "round_steps": 2}
    fed.check_heal(state)
