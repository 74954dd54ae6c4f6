"""torchft ProcessGroupGloo without a Manager: configure / our collectives / abort / reconfigure (3 processes).

usage: probe_pg.py  (spawns itself 3 times)"""
import os, subprocess, sys, threading, time
from datetime import timedelta

if len(sys.argv) == 1:
    procs = [subprocess.Popen([sys.executable, __file__, str(r)], start_new_session=True) for r in range(3)]
    try:
        for p in procs:
            p.wait(timeout=120)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, 9)
    sys.exit(0)

import torch, torch.distributed as dist
from torch.distributed.distributed_c10d import AllgatherOptions
from torchft import ProcessGroupGloo

rank, PORT = int(sys.argv[1]), 29810
say = lambda *a: print(f"[rank {rank} {time.time() % 100:6.2f}]", *a, flush=True)
store = dist.TCPStore("127.0.0.1", PORT, is_master=(rank == 0), wait_for_workers=False)
pg = ProcessGroupGloo(timeout=timedelta(seconds=5))

t = time.perf_counter()
pg.configure(f"127.0.0.1:{PORT}/q1", "r%d" % rank, rank, 3)
say(f"configure world 3: {1e3 * (time.perf_counter() - t):.1f} ms; size={pg.size()} parent={type(pg.parent).__name__}")

P = 1 << 20
inp = torch.full((P,), rank, dtype=torch.uint8)
out = torch.empty(3 * P, dtype=torch.uint8)
t = time.perf_counter()
pg.allgather_into_tensor_coalesced([out], [inp], AllgatherOptions()).wait()
say(f"pg.allgather_into_tensor_coalesced 1 MiB x3: {1e3 * (time.perf_counter() - t):.1f} ms, rows={out.view(3, P)[:, 0].tolist()}")
try:
    dist.all_gather_into_tensor(out, inp, group=pg)
    say("dist.all_gather_into_tensor(group=torchft pg): OK")
except Exception as e:
    say("dist.all_gather_into_tensor(group=torchft pg) fails:", repr(e)[:160])
try:  # the configured inner c10d group (changes at every configure)
    w = pg.parent._get_backend(torch.device("cpu"))._allgather_base(out, inp)
    w.wait()
    say("parent gloo backend _allgather_base: OK", out.view(3, P)[:, 0].tolist())
except Exception as e:
    say("parent backend fails:", repr(e)[:160])

# an in-flight collective whose peer never joins: rank 2 skips it; rank 0 aborts after 1 s, rank 1 waits for the timeout
if rank < 2:
    x = torch.ones(4)
    t = time.perf_counter()
    work = pg.allreduce([x], dist.distributed_c10d.AllreduceOptions())
    if rank == 0:
        threading.Timer(1.0, lambda: (say("abort()"), pg.abort())).start()
    try:
        work.wait()
        say(f"in-flight allreduce returned?! {time.perf_counter() - t:.2f} s")
    except Exception as e:
        say(f"in-flight allreduce raised after {time.perf_counter() - t:.2f} s: {repr(e)[:150]}")
    say("errored():", pg.errored())
else:
    time.sleep(7)

# reconfigure without rank 2 (a new prefix: a new quorum)
if rank < 2:
    t = time.perf_counter()
    pg.configure(f"127.0.0.1:{PORT}/q2", "r%d" % rank, rank, 2)
    say(f"reconfigure world 2: {1e3 * (time.perf_counter() - t):.1f} ms")
    out2 = torch.empty(2 * P, dtype=torch.uint8)
    pg.allgather_into_tensor_coalesced([out2], [inp], AllgatherOptions()).wait()
    say("after reconfigure rows:", out2.view(2, P)[:, 0].tolist())
    store.set(f"done{rank}", "1")
if rank == 0:
    store.wait(["done1"])
time.sleep(0.5)
os._exit(0)
