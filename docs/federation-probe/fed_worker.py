"""One rank of one replica group, driven by a torchft Manager (probe, not project code).

Each round ("DiLoCo boundary"): optional compute sleep -> start_quorum (sync) -> our own collectives on the
Manager's reconfigured ProcessGroupGloo (all_gather_into_tensor of uint8 payloads + all_reduce) -> should_commit.
Writes one JSON line per event to --log (append), wall clock times so processes can be aligned.
"""
import argparse
import json
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

p = argparse.ArgumentParser()
p.add_argument("--lighthouse", required=True)
p.add_argument("--replica", required=True)           # replica name, e.g. "A"
p.add_argument("--rank", type=int, default=0)         # group rank inside the replica
p.add_argument("--world", type=int, default=1)        # ranks per replica
p.add_argument("--store-port", type=int, required=True)
p.add_argument("--rounds", type=int, default=10)
p.add_argument("--compute-s", type=float, default=0.5)
p.add_argument("--state-mb", type=float, default=1.0)
p.add_argument("--payload-kb", type=float, default=64)
p.add_argument("--timeout-s", type=float, default=10)
p.add_argument("--quorum-timeout-s", type=float, default=60)
p.add_argument("--init-sync", type=int, default=1)
p.add_argument("--async-quorum", type=int, default=0)
p.add_argument("--transport", default="http", choices=["http", "pg"])
p.add_argument("--log", required=True)
p.add_argument("--coll-delay-s", type=float, default=0.0)  # sleep between quorum and collective (a slow exchange)
p.add_argument("--verbose", type=int, default=1)
a = p.parse_args()

from torchft import Manager, ProcessGroupGloo  # noqa: E402

T0 = time.time()
if a.verbose:
    import logging
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")


def log(**kw):
    kw.update(t=round(time.time(), 4), replica=a.replica, rank=a.rank, pid=os.getpid())
    with open(a.log, "a") as f:
        f.write(json.dumps(kw) + "\n")


store = None
if a.rank == 0:  # the replica group's own store (torchrun's would do): Manager is a client of it
    store = dist.TCPStore("127.0.0.1", a.store_port, is_master=True, wait_for_workers=False)

n = int(a.state_mb * 2**20 / 4)
state = {"theta": torch.zeros(n), "round": 0, "replica_of_origin": a.replica}
loaded = []


def state_dict():
    return {"theta": state["theta"], "round": state["round"], "replica_of_origin": state["replica_of_origin"]}


def load_state_dict(sd):
    state["theta"].copy_(sd["theta"])
    state["round"] = sd["round"]
    loaded.append(sd["replica_of_origin"])


timeout = timedelta(seconds=a.timeout_s)
pg = ProcessGroupGloo(timeout=timeout)
transport = None
if a.transport == "pg":
    from torchft.checkpointing.pg_transport import PGTransport
    transport = PGTransport(pg, timeout=timeout, device=torch.device("cpu"))
t = time.time()
m = Manager(pg=pg, load_state_dict=load_state_dict, state_dict=state_dict, min_replica_size=1,
            use_async_quorum=bool(a.async_quorum), timeout=timeout,
            quorum_timeout=timedelta(seconds=a.quorum_timeout_s), connect_timeout=timedelta(seconds=10),
            rank=a.rank, world_size=a.world, store_addr="127.0.0.1", store_port=a.store_port,
            lighthouse_addr=a.lighthouse, replica_id=a.replica, hostname="127.0.0.1",
            init_sync=bool(a.init_sync), checkpoint_transport=transport)
log(ev="manager_up", s=round(time.time() - t, 3), import_s=round(t - T0, 2))

P = int(a.payload_kb * 1024)
rid = ord(a.replica[0])
for r in range(a.rounds):
    time.sleep(a.compute_s)
    t0 = time.time()
    try:
        m.start_quorum()
        if a.async_quorum:
            m.wait_quorum()
    except Exception as e:
        log(ev="quorum_error", err=repr(e)[:300])
        raise
    t1 = time.time()
    n_part = m.num_participants()
    prank = m.participating_rank()
    healed = loaded[:]
    loaded.clear()
    err = None
    members = None
    if m.errored() is None:
        try:
            # our own collectives on the reconfigured group: who is in it? (replica id byte, group rank)
            time.sleep(a.coll_delay_s)
            ws = pg.size()
            payload = torch.full((P,), 0, dtype=torch.uint8)
            payload[0], payload[1] = rid, a.rank
            out = torch.empty(ws * P, dtype=torch.uint8)
            w = pg.allgather_into_tensor_coalesced([out], [payload], dist.distributed_c10d.AllgatherOptions())
            w.wait()
            members = [(chr(int(out[i * P])), int(out[i * P + 1])) for i in range(ws)]
            x = torch.full((4,), float(state["round"]))
            opts = dist.distributed_c10d.AllreduceOptions(); opts.reduceOp = dist.ReduceOp.SUM
            pg.allreduce([x], opts).wait()
        except Exception as e:
            err = repr(e)[:300]
            m.report_error(e)
    t2 = time.time()
    ok = m.should_commit()
    t3 = time.time()
    if ok:
        state["round"] += 1
        state["theta"].add_(1.0)
    log(ev="round", r=r, quorum_id=m._quorum_id, step=m.current_step(), participants=n_part, prank=prank,
        pg_size=pg.size() if m.errored() is None or members else None, members=members, healed_from=healed,
        theta0=float(state["theta"][0]), round_state=state["round"], commit=ok, err=err,
        quorum_ms=round(1e3 * (t1 - t0), 2), coll_ms=round(1e3 * (t2 - t1), 2), commit_ms=round(1e3 * (t3 - t2), 2))
log(ev="done")
m.shutdown(wait=False)
os._exit(0)
