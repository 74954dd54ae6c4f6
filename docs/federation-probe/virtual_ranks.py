"""One process hosting several ranks of its replica group, each a torchft Manager (probe, not project code).

What sites of different data-parallel size need: a rank of a site of DP d serves G / d exchange slots (the ranks a
site of DP G would have), each its own Manager of rank v in a replica group of world G. Quorums are asynchronous
(every Manager starts its quorum, then waits on each): a synchronous start would wait for the others' requests,
which this same process makes. The collectives and ``should_commit`` (which waits for every rank of the replica
group) run on a thread per Manager.

    torchft_lighthouse --bind 127.0.0.1:29811 --min_replicas 2 --join_timeout_ms 3000 &
    python virtual_ranks.py --lighthouse http://127.0.0.1:29811 --replica A --ranks 0 --store-port 29821 --log L &
    python virtual_ranks.py --lighthouse http://127.0.0.1:29811 --replica A --ranks 1 --store-port 29821 --log L &
    python virtual_ranks.py --lighthouse http://127.0.0.1:29811 --replica B --ranks 0,1 --store-port 29822 --log L
"""
import argparse, json, os, sys, time, threading
from datetime import timedelta
import torch, torch.distributed as dist

p = argparse.ArgumentParser()
p.add_argument("--lighthouse", required=True)
p.add_argument("--replica", required=True)
p.add_argument("--ranks", required=True)      # virtual ranks hosted here, e.g. "0,1"
p.add_argument("--world", type=int, default=2)
p.add_argument("--store-port", type=int, required=True)
p.add_argument("--rounds", type=int, default=5)
p.add_argument("--log", required=True)
a = p.parse_args()
from torchft import Manager, ProcessGroupGloo

ranks = [int(r) for r in a.ranks.split(",")]
def log(**kw):
    kw.update(t=round(time.time(), 3), replica=a.replica, pid=os.getpid())
    with open(a.log, "a") as f:
        f.write(json.dumps(kw) + "\n")

store = None
if 0 in ranks:
    store = dist.TCPStore("127.0.0.1", a.store_port, is_master=True, wait_for_workers=False)
timeout = timedelta(seconds=20)
mgrs, pgs = [], []
def make(v):
    pg = ProcessGroupGloo(timeout=timeout)
    m = Manager(pg=pg, load_state_dict=lambda sd: None, state_dict=lambda: {}, min_replica_size=1,
                use_async_quorum=True, timeout=timeout, quorum_timeout=timedelta(seconds=60),
                connect_timeout=timedelta(seconds=20), rank=v, world_size=a.world, store_addr="127.0.0.1",
                store_port=a.store_port, lighthouse_addr=a.lighthouse, replica_id=a.replica, hostname="127.0.0.1",
                init_sync=False)
    return m, pg
for v in ranks:
    m, pg = make(v)
    mgrs.append(m); pgs.append(pg)
log(ev="up", ranks=ranks)
rid = ord(a.replica[0])
for r in range(a.rounds):
    time.sleep(0.3)
    for m in mgrs:
        m.start_quorum()
    for m in mgrs:
        m.wait_quorum()
    res = {}
    def coll(i, v):
        x = torch.tensor([float(rid), float(v), 1.0])
        opts = dist.distributed_c10d.AllreduceOptions(); opts.reduceOp = dist.ReduceOp.SUM
        pgs[i].allreduce([x], opts).wait()
        res[v] = x.tolist() + [pgs[i].size()]
    th = [threading.Thread(target=coll, args=(i, v)) for i, v in enumerate(ranks)]
    [t.start() for t in th]; [t.join() for t in th]
    ok = {}
    def commit(i, v):
        ok[v] = mgrs[i].should_commit()
    th = [threading.Thread(target=commit, args=(i, v)) for i, v in enumerate(ranks)]
    [t.start() for t in th]; [t.join() for t in th]
    log(ev="round", r=r, res=res, ok=ok, participants=mgrs[0].num_participants())
log(ev="done")
for m in mgrs:
    m.shutdown(wait=False)
os._exit(0)
