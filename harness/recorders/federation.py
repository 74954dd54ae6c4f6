"""The separate jobs' recorder (``harness/run.py --record federation``): :class:`FederationRecorder`."""

from __future__ import annotations

import os
import time
from typing import Any

from .base import Recorder, fingerprint_ints, record_losses, wrap


class FederationRecorder(Recorder):
    """Separate jobs (``--diloco-x-lighthouse``), per rank, with no collective of its own (a peer may die
    at any time): ``losses`` (as the training recorder's), ``fed_rounds``: per boundary ``[step_calls,
    theta fingerprint, members, failed, committed rounds, wall time, the meeting's seconds, the
    replica's exchange seconds of the round, the tokens and the weight of the job in the mean launched
    there]`` after the boundary (theta as every member
    must hold it then); ``final_fp``: the fp32 main shards' fingerprint after the end of training (``chunks``:
    with the exchange by name, each chunk's);
    ``heals``: per heal received, its transfer's seconds and the bytes of the tensors in it; ``by_name_s``: with the
    exchange by name, per ``pull`` / ``push`` the calls and their seconds (device-synchronized).
    ``DILOCO_TEST_STEP_SLEEP_S=S``: every iteration S seconds longer (time to kill, stop and restart
    jobs mid-run without more compute); with ``DILOCO_TEST_STEP_SLEEP_UNTIL=PATH`` only until the file PATH
    exists (a test creates it once it has done what the slow steps gave it time for: the rest of the run
    trains at full speed). Faults at named protocol points: ``DILOCO_X_FAULT``
    (:mod:`megatron_diloco.algorithm.faults`)."""

    name = "federation"
    keys = ("losses", "fed_rounds", "final_fp", "heals", "by_name_s")

    def __init__(self, record: dict[str, Any]) -> None:
        super().__init__(record)
        record.update(losses=[], fed_rounds=[])

    def install(self) -> None:
        from megatron.training import training

        from megatron_diloco.megatron_adapter.optimizer import DiLoCoXOptimizer

        record = self.record

        @wrap(DiLoCoXOptimizer, "round_metrics")
        def round_metrics(orig, opt, report):
            out = orig(opt, report)
            fed = opt.federation
            if fed is None:  # one world (the benchmark's comparison runs)
                return out
            record["fed_rounds"].append([opt.step_calls, [int(x) for x in opt.sync.fingerprint([opt.sync.theta]).view(-1)],
                                         fed.members, fed.failed, fed.committed, time.time(),
                                         fed.stats["last_meeting_s"], out.get("replica_exchange_s"),
                                         out.get("tokens"), out.get("weight")])
            return out

        from megatron_diloco.federation.transport import SealedTransport

        @wrap(SealedTransport, "fetch")
        def fetch(orig, transport, *a, **k):  # a heal's transfer: its seconds and bytes
            started = time.perf_counter()
            state = orig(transport, *a, **k)
            tensors = [t for t in (state.get("theta"), state.get("momentum_buffer"), state.get("pending"))
                       if t is not None]
            record.setdefault("heals", []).append({"s": time.perf_counter() - started, "at": time.time(),
                                                   "tensor_bytes": sum(t.numel() * t.element_size() for t in tensors)})
            return state

        @wrap(DiLoCoXOptimizer, "finish")
        def finish(orig, opt):
            orig(opt)
            record["final_fp"] = {"main": fingerprint_ints(opt.view.shards), "steps": opt.step_calls}
            if opt.by_name is not None:  # x by name, chunk by chunk, pulled from the main shards as they ended
                opt.by_name.pull()       # (collective over the job: every rank finishes): comparable between sites
                record["final_fp"]["chunks"] = [fingerprint_ints([c]) for c in opt.by_name.chunk_views()]

        import torch

        from megatron_diloco.megatron_adapter.by_name import ByName

        for name in ("pull", "push"):  # the exchange by name's intra-site all-to-alls: count, seconds (device-synced)
            @wrap(ByName, name)
            def timed(orig, layout, _name=name):
                cuda = layout.device.type == "cuda"
                if cuda:
                    torch.cuda.synchronize(layout.device)
                started = time.perf_counter()
                orig(layout)
                if cuda:
                    torch.cuda.synchronize(layout.device)
                spent = record.setdefault("by_name_s", {}).setdefault(_name, [0, 0.0])
                spent[0], spent[1] = spent[0] + 1, spent[1] + time.perf_counter() - started

        record_losses(training, record["losses"])

        pause = float(os.environ.get("DILOCO_TEST_STEP_SLEEP_S", "0"))
        until = os.environ.get("DILOCO_TEST_STEP_SLEEP_UNTIL")
        if pause > 0:  # longer iterations without more compute (the jobs share two cores)
            slow = [True]

            @wrap(training, "train_step")
            def train_step(orig, *a, **k):
                if slow[0] and until and os.path.exists(until):
                    slow[0] = False
                if slow[0]:
                    time.sleep(pause)
                return orig(*a, **k)
