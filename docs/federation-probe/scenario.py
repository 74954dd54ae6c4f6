"""Driver: lighthouse + replica jobs (each rank its own process, own process group), timed events.

usage: scenario.py NAME [--replicas A,B,C] [--world 2] [--rounds N] [--events 't:kill:C,t:start:C,t:stop:C,t:cont:C']
Every process is started in its own session and killed (process group, SIGKILL) at the end."""
import argparse, os, signal, subprocess, sys, time

p = argparse.ArgumentParser()
p.add_argument("name")
p.add_argument("--replicas", default="A,B,C")
p.add_argument("--world", type=int, default=2)
p.add_argument("--rounds", type=int, default=30)
p.add_argument("--compute-s", type=float, default=0.5)
p.add_argument("--events", default="")
p.add_argument("--duration", type=float, default=60)
p.add_argument("--lh-args", default="--join_timeout_ms 1000 --heartbeat_timeout_ms 5000")
p.add_argument("--port", type=int, default=29710)
p.add_argument("--worker-args", default="")
p.add_argument("--late", default="")  # replica:worker-args overrides "C=--coll-delay-s 1"
a = p.parse_args()
os.chdir(os.path.dirname(os.path.abspath(__file__)))
log = f"logs/{a.name}.jsonl"
if os.path.exists(log):
    os.remove(log)
procs = {}
extra = dict(kv.split("=", 1) for kv in a.late.split(";") if kv)


def spawn(key, cmd, out):
    f = open(out, "w")
    procs.setdefault(key, []).append(subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True))


def start(rep):
    i = "ABCDEFGH".index(rep)
    for k in range(a.world):
        cmd = ["timeout", "-s", "KILL", str(int(a.duration) + 30), "venv/bin/python", "fed_worker.py",
               "--lighthouse", f"http://127.0.0.1:{a.port}", "--replica", rep, "--rank", str(k),
               "--world", str(a.world), "--store-port", str(a.port + 10 + i), "--rounds", str(a.rounds),
               "--compute-s", str(a.compute_s), "--log", log] + a.worker_args.split() + extra.get(rep, "").split()
        spawn(rep, cmd, f"logs/{a.name}_{rep}{k}_{len(procs.get(rep, []))}.txt")


def signal_rep(rep, sig):
    for pr in procs.get(rep, []):
        if pr.poll() is None:
            try:
                os.killpg(pr.pid, sig)
            except ProcessLookupError:
                pass


t0 = time.time()
try:
    spawn("lh", ["timeout", "-s", "KILL", str(int(a.duration) + 40), "venv/bin/torchft_lighthouse", "--min_replicas", "1",
                 "--bind", f"127.0.0.1:{a.port}"] + a.lh_args.split(), f"logs/{a.name}_lighthouse.txt")
    time.sleep(0.5)
    for rep in a.replicas.split(","):
        start(rep)
    # the clock of the events starts when every initial rank has logged its first round
    need = len(a.replicas.split(",")) * a.world
    while time.time() - t0 < 120:
        seen = set()
        if os.path.exists(log):
            for line in open(log):
                if '"ev": "round"' in line:
                    import json
                    d = json.loads(line); seen.add((d["replica"], d["rank"]))
        if len(seen) >= need:
            break
        time.sleep(0.2)
    t0 = time.time()
    print(f"all ranks in their first round; events clock starts (wall {t0:.3f})", flush=True)
    events = sorted((float(t), act, rep) for t, act, rep in (e.split(":") for e in a.events.split(",") if e))
    for t, act, rep in events:
        time.sleep(max(0.0, t - (time.time() - t0)))
        print(f"{time.time() - t0:7.2f} {act} {rep} (wall {time.time():.3f})", flush=True)
        with open(log, "a") as f:
            f.write('{"ev": "driver_%s", "replica": "%s", "rank": -1, "t": %.4f}\n' % (act, rep, time.time()))
        if act == "kill":
            signal_rep(rep, signal.SIGKILL)
        elif act == "stop":
            signal_rep(rep, signal.SIGSTOP)
        elif act == "cont":
            signal_rep(rep, signal.SIGCONT)
        elif act == "start":
            start(rep)
    while time.time() - t0 < a.duration and any(pr.poll() is None for k, v in procs.items() if k != "lh" for pr in v):
        time.sleep(0.5)
finally:
    for k, v in procs.items():
        for pr in v:
            if pr.poll() is None:
                try:
                    os.killpg(pr.pid, signal.SIGCONT)
                    os.killpg(pr.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
    for v in procs.values():
        for pr in v:
            pr.wait()
    print(f"all {sum(len(v) for v in procs.values())} processes ended", flush=True)
