"""The pure parts of the WAN benchmark (``benchmarks/throughput/wan_bench.py``,
``harness/netns.py``): namespace / tc command generation, the runner jobs it launches,
window metrics and the speedup bound on synthetic rank records with exact arithmetic, and the
progress lines. No namespace is created and nothing is run."""

from __future__ import annotations

import io
import ipaddress
from pathlib import Path

import pytest

from benchmarks.throughput import wan_bench
from harness import netns
from harness.runner import HARNESS

# ------------------------------------------------------------------ namespaces


def test_topology_names_and_addresses():
    topo = netns.WanTopology(replicas=3, prefix="wt")
    assert topo.namespaces == ["wt-hub", "wt-r0", "wt-r1", "wt-r2"]
    bench_range = ipaddress.ip_network("198.18.0.0/15")
    addrs = [topo.address(r) for r in range(3)]
    assert len(set(addrs)) == 3 and all(ipaddress.ip_address(a) in bench_range for a in addrs)
    with pytest.raises(ValueError):
        netns.WanTopology(replicas=0)
    with pytest.raises(ValueError):
        netns.WanTopology(prefix="bad name;rm")


def test_setup_creates_everything_inside_namespaces():
    topo = netns.WanTopology(replicas=2)
    cmds = netns.setup_commands(topo)
    adds = [c[-1] for c in cmds if c[:3] == ["ip", "netns", "add"]]
    assert adds == topo.namespaces
    assert cmds[:len(adds)] == [["ip", "netns", "add", ns] for ns in adds]  # namespaces first
    for c in cmds[len(adds):]:  # every link/addr command names its namespace: nothing in the root one
        assert c[:2] == ["ip", "-n"] and c[2] in topo.namespaces, c
    for r in range(2):
        veth = [c for c in cmds if "veth" in c and c[2] == topo.namespace(r)]
        assert len(veth) == 1 and veth[0][-2:] == ["netns", topo.hub]
        assert topo.iface in veth[0] and topo.hub_port(r) in veth[0]
        assert ["ip", "-n", topo.namespace(r), "addr", "add", f"{topo.address(r)}/24", "dev",
                topo.iface] in cmds
        assert ["ip", "-n", topo.hub, "link", "set", topo.hub_port(r), "master", "br0"] in cmds


@pytest.mark.parametrize("rate, burst", [(1000, "256kb"), (100, "64kb"), (10, "64kb")])
def test_shaping_both_ends_of_every_link(rate, burst):
    topo = netns.WanTopology(replicas=2)
    cmds = netns.shape_commands(topo, rate)
    ends = {(c[3], c[c.index("dev") + 1]) for c in cmds}
    assert ends == {(topo.namespace(0), "eth0"), (topo.hub, "h0"), (topo.namespace(1), "eth0"), (topo.hub, "h1")}
    for c in cmds:
        assert c[:4] == ["ip", "netns", "exec", c[3]] and c[4:7] == ["tc", "qdisc", "replace"]
        tbf = c[c.index("tbf"):]
        assert tbf == ["tbf", "rate", f"{rate}mbit", "burst", burst, "latency", "5ms"]
    with pytest.raises(ValueError):
        netns.shape_commands(topo, 0)


def test_teardown_deletes_by_name():
    topo = netns.WanTopology(replicas=2, prefix="wt")
    assert netns.teardown_commands(topo) == [["ip", "netns", "del", ns] for ns in ("wt-r1", "wt-r0", "wt-hub")]


# ------------------------------------------------------------------ metrics


def _iters(steps, step_s, sync_s=0.0, boundary_every=0, boundary_s=0.0, exposed_s=0.0,
           tx_per_step=0, tx_per_boundary=0, sent_per_boundary=0, own_cpu=0.0, host_busy=0.0):
    """Synthetic ``wan_worker`` iterations, back to back from t = 0 (exact binary fractions);
    ``own_cpu`` / ``host_busy``: CPU seconds per second of this rank / of the whole machine."""
    out, t, tx = [], 0.0, 0
    for i in range(1, steps + 1):
        bnd = boundary_every and i % boundary_every == 0
        dur = step_s + (boundary_s if bnd else 0.0)
        tx += tx_per_step + (tx_per_boundary if bnd else 0)
        out.append({"t0": t, "t1": t + dur, "dp_sync_s": sync_s, "boundary_s": boundary_s if bnd else 0.0,
                    "exposed_s": exposed_s if bnd else 0.0, "exchange_s": 1.0 if bnd else 0.0,
                    "bytes_sent": sent_per_boundary if bnd else 0, "tx_bytes": tx, "rx_bytes": tx,
                    "proc_cpu_s": own_cpu * (t + dur), "host_busy_s": 100.0 + host_busy * (t + dur)})
        t += dur
    return out


def _ranks(iters, tokens=1024):
    return [{"iters": iters, "tokens_per_iter": tokens}, {"iters": iters, "tokens_per_iter": tokens}]


def test_allreduce_window_and_bound():
    # step 1.0 s of which 0.75 s blocked in the all-reduce: t_step 0.25, t_allreduce 0.75, bound 4
    # each rank busy 0.25 of the time, the machine 1.0 core: other processes used 0.5 core
    ar = wan_bench.window_metrics(_ranks(_iters(6, 1.0, sync_s=0.75, tx_per_step=2048, own_cpu=0.25,
                                                host_busy=1.0)), warmup=2, sync_crosses_link=True)
    assert ar["window_iterations"] == 4 and ar["window_s"] == 4.0
    assert ar["tokens_per_s"] == 1024.0
    assert ar["compute_utilization"] == 0.25 and ar["inner_step_s"] == 0.25
    assert ar["bytes_per_rank_per_token"] == 2.0
    assert ar["rounds_in_window"] == 0 and "exposed_comm_per_round_s" not in ar
    assert ar["other_cpu_cores"] == 0.5
    assert wan_bench.speedup_bound(ar["inner_step_s"], ar["step_s"] - ar["inner_step_s"]) == 4.0
    with pytest.raises(ValueError):
        wan_bench.speedup_bound(0.0, 1.0)


def test_diloco_window_counts_boundaries_not_replica_local_sync():
    # H = 4: steps of 0.25 s (0.125 s of replica-local sync, which counts as inner step) and a
    # 1.0 s boundary every 4 steps (0.5 s of it exposed); warm-up = the first round
    recs = _ranks(_iters(12, 0.25, sync_s=0.125, boundary_every=4, boundary_s=1.0, exposed_s=0.5,
                         tx_per_boundary=4096, sent_per_boundary=2048))
    dx = wan_bench.window_metrics(recs, warmup=4, sync_crosses_link=False)
    assert dx["window_iterations"] == 8 and dx["window_s"] == 8 * 0.25 + 2 * 1.0
    assert dx["rounds_in_window"] == 2
    assert dx["compute_utilization"] == 0.5 and dx["inner_step_s"] == 0.25
    assert dx["exposed_comm_per_round_s"] == 0.5 and dx["boundary_per_round_s"] == 1.0
    assert dx["exchange_per_round_s"] == 1.0
    assert dx["bytes_per_rank_per_token"] == 2 * 4096 / (8 * 1024)
    assert dx["accounted_bytes_per_rank_per_token"] == 2 * 2048 / (8 * 1024)


def test_partial_landings_are_boundary_work_but_not_rounds():
    """partial: the exchange lands tau steps after the boundary (boundary work, the exchange's
    figures) without ending a round: per-round figures divide by the rounds (``round_end``)."""
    iters = _iters(12, 0.25, boundary_every=4, boundary_s=1.0)
    for i, it in enumerate(iters, start=1):
        it["round_end"] = 1 if i % 4 == 0 else 0
        if i % 4 == 2:  # the landing: 0.5 s of work, the exchange it completes
            it.update(boundary_s=0.5, exchange_s=1.0, bytes_sent=2048)
        elif i % 4 == 0:
            it.update(exchange_s=0.0, bytes_sent=0)
    dx = wan_bench.window_metrics(_ranks(iters), warmup=4, sync_crosses_link=False)
    assert dx["rounds_in_window"] == 2  # not 4: two boundaries and two landings in the window
    assert dx["exchange_per_round_s"] == 1.0 and dx["boundary_per_round_s"] == 1.5
    assert dx["accounted_bytes_per_rank_per_token"] == 2 * 2048 / (8 * 1024)


def test_window_uses_the_slowest_rank_and_needs_iterations():
    fast, slow = _iters(4, 0.5), _iters(4, 1.0)
    m = wan_bench.window_metrics([{"iters": fast, "tokens_per_iter": 8}, {"iters": slow, "tokens_per_iter": 8}],
                                 warmup=2, sync_crosses_link=True)
    assert m["window_s"] == 2.0 and m["tokens_per_s"] == 8.0
    assert m["bytes_per_rank_per_token"] == 0.0
    with pytest.raises(ValueError):
        wan_bench.window_metrics(_ranks(_iters(2, 1.0)), warmup=2, sync_crosses_link=True)


def test_compare_to_allreduce_speedup_bound_and_target():
    runs = [
        {"link_mbps": 10.0, "method": "allreduce", "tokens_per_s": 100.0, "step_s": 1.0, "inner_step_s": 0.25,
         "compute_utilization": 0.25},
        {"link_mbps": 10.0, "method": "dilocox", "tokens_per_s": 380.0, "step_s": 1 / 3.8, "inner_step_s": 0.25,
         "compute_utilization": 0.95, "exchange_per_round_s": 3.0},
        {"link_mbps": 10.0, "method": "diloco", "tokens_per_s": 200.0, "step_s": 0.5, "inner_step_s": 0.25,
         "compute_utilization": 0.5, "exchange_per_round_s": 5.0},
        # no allreduce run at this link: no speedup
        {"link_mbps": 100.0, "method": "dilocox", "tokens_per_s": 50.0, "compute_utilization": 0.9},
        {"link_mbps": 10.0, "method": "allreduce-distopt", "error": "failed"},
    ]
    wan_bench.compare_to_allreduce(runs, local_steps=16)
    ar, dx, dl, lone, failed = runs
    assert ar["speedup_vs_allreduce"] == 1.0 and ar["speedup_bound"] == 4.0
    assert ar["t_step_s"] == 0.25 and ar["t_allreduce_s"] == 0.75
    assert ar["exposed_comm_per_round_s"] == 0.75 * 16
    assert dx["speedup_vs_allreduce"] == 3.8 and dx["fraction_of_bound"] == pytest.approx(0.95)
    assert dx["exchange_fits_in_H"] is True and dx["target_met"] is True
    assert dl["speedup_vs_allreduce"] == 2.0 and "target_met" not in dl
    assert "speedup_bound" not in lone and "speedup_bound" not in failed
    table = wan_bench.markdown_table(runs)
    assert "| 10 Mbit | dilocox | 380 | 95.0% |" in table and "failed: failed" in table


def test_one_pass_per_link_and_fractions_by_pass():
    """Ratios come from one pass per link: the least disturbed pass where every method ran, even if
    a single method was quieter in another pass (the old per-method choice mixed passes)."""
    def run(link, m, p, tps, other, step=None, inner=None):
        return {"link_mbps": link, "method": m, "pass": p, "tokens_per_s": tps, "other_cpu_cores": other,
                "compute_utilization": 0.9, "step_s": step, "inner_step_s": inner}
    repeats = {
        (100.0, "allreduce"): [run(100.0, "allreduce", 1, 10.0, 0.10, 1.0, 0.2),
                               run(100.0, "allreduce", 2, 11.0, 0.30, 1.0, 0.25)],
        (100.0, "dilocox"): [run(100.0, "dilocox", 1, 48.0, 0.20), run(100.0, "dilocox", 2, 40.0, 0.05)],
        (10.0, "allreduce"): [run(10.0, "allreduce", 1, 1.0, 0.0, 10.0, 0.2),
                              {"pass": 2, "error": "rank 1 exited 1", "link_mbps": 10.0, "method": "allreduce"}],
        (10.0, "dilocox"): [run(10.0, "dilocox", 1, 45.0, 0.9), run(10.0, "dilocox", 2, 49.0, 0.0)],
    }
    runs = wan_bench.select_pass(repeats)
    chosen = {(r["link_mbps"], r["method"]): r["pass"] for r in runs}
    # 100 Mbit: pass 1's worst disturbance 0.20 < pass 2's 0.30 -> pass 1 for both methods
    assert chosen[(100.0, "allreduce")] == chosen[(100.0, "dilocox")] == 1
    # 10 Mbit: pass 2 lacks allreduce -> pass 1 although dilocox was quieter in pass 2
    assert chosen[(10.0, "allreduce")] == chosen[(10.0, "dilocox")] == 1
    dx = next(r for r in runs if r["link_mbps"] == 100.0 and r["method"] == "dilocox")
    assert [x["pass"] for x in dx["repeats"]] == [1, 2]
    wan_bench.fractions_by_pass(runs)
    by = {x["pass"]: x for x in dx["by_pass"]}
    assert by[1]["speedup_vs_allreduce"] == pytest.approx(4.8) and by[1]["speedup_bound"] == pytest.approx(5.0)
    assert by[2]["fraction_of_bound"] == pytest.approx((40.0 / 11.0) / 4.0)
    lone = next(r for r in runs if r["link_mbps"] == 10.0 and r["method"] == "dilocox")
    assert [x["pass"] for x in lone["by_pass"]] == [1]  # pass 2 has no allreduce to compare with


def test_ring_bytes_and_run_plan():
    assert wan_bench.ring_allreduce_bytes_per_token(1000, 2, 1000) == 4.0
    assert wan_bench.iterations_for("allreduce", 10, 16, 5, {1000: 32, 10: 8}) == (10, 2)
    assert wan_bench.iterations_for("allreduce-distopt", 12, 16, 5, {1000: 32, 10: 8}) == (10, 2)
    assert wan_bench.iterations_for("dilocox", 10, 16, 5, {10: 8}) == (80, 16)
    # the default's auto warm-up: rounds of 16 // 3 = 5 for 40 of the 80 steps; the window from the end of the first
    assert wan_bench.iterations_for("dilocox-warmup", 10, 16, 5, {10: 8}) == (80, 5)
    assert wan_bench.iterations_for("dilocox-warmup", 10, 2, 5, {10: 8}) == (10, 2)  # H < 3: no warm-up
    with pytest.raises(ValueError):
        wan_bench.iterations_for("diloco", 10, 16, 1, {10: 8})
    assert wan_bench.method_args("allreduce", 16, 10) == ["--no-diloco-x"]
    assert wan_bench.method_recorders("allreduce") == ["wan", "plain_ddp"]
    assert wan_bench.method_recorders("allreduce-distopt") == wan_bench.method_recorders("dilocox") == ["wan"]
    # dilocox is the default mode: H, and the steady rounds (no warm-up); every other DiLoCoX flag
    # left to the package's defaults
    assert wan_bench.method_args("dilocox", 16, 10) == ["--diloco-x-local-steps", "16", "--diloco-x-warmup-iters", "0"]
    assert wan_bench.method_args("dilocox-warmup", 16, 10) == ["--diloco-x-local-steps", "16"]  # the auto warm-up
    dl = wan_bench.method_args("diloco", 16, 10)
    assert dl[dl.index("--diloco-x-overlap") + 1] == "none" and dl[dl.index("--diloco-x-compression") + 1] == "none"
    assert "--diloco-x-bandwidth-mbps" in wan_bench.method_args("dilocox-adaptive", 16, 10)
    with pytest.raises(ValueError):
        wan_bench.method_args("gossip", 16, 10)


def test_rank_job_runs_the_harness_in_each_namespace(tmp_path: Path):
    topo = netns.WanTopology(replicas=2, prefix="wt")
    job = wan_bench.rank_job(topo, "run", tmp_path / "run", ["--train-iters", "4"], ["wan"], 29511, 60.0, "x")
    assert [c.prefix for c in job.commands] == [["ip", "netns", "exec", "wt-r0"], ["ip", "netns", "exec", "wt-r1"]]
    for rank, c in enumerate(job.commands):
        harness = c.argv.index(str(HARNESS))
        assert c.argv[harness + 1:] == ["--record", "wan", "--out", str(tmp_path / "run"), "--", "--train-iters", "4"]
        assert c.env["RANK"] == str(rank) and c.env["WORLD_SIZE"] == "2" and c.log == f"rank{rank}.log"
        assert c.env["MASTER_ADDR"] == topo.address(0) and c.env["WAN_IFACE"] == c.env["GLOO_SOCKET_IFNAME"]
    assert job.logs == ["rank0.log", "rank1.log"] and job.term_grace_s == 10.0


def test_progress_lines_with_eta():
    out = io.StringIO()
    progress = wan_bench.Progress("10 Mbit allreduce", interval=1e9, out=out)
    progress.feed("WANBENCH step 1/4 2.000 s elapsed 2.0 s\n")  # first line always shows
    progress.feed("WANBENCH step 2/4 2.000 s elapsed 4.0 s\n")  # throttled
    progress.feed("unrelated megatron output\n")
    progress.feed("WANBENCH step 4/4 2.000 s elapsed 8.0 s\n")  # the last one always shows
    lines = out.getvalue().splitlines()
    assert len(lines) == 2
    assert "step    1/4" in lines[0] and "ETA     6 s" in lines[0] and "2.000 s/step" in lines[0]
    assert "step    4/4" in lines[1] and "ETA     0 s" in lines[1]


def test_requirements_demand_root(monkeypatch):
    monkeypatch.setattr(netns.os, "geteuid", lambda: 1000)
    with pytest.raises(SystemExit, match="needs root"):
        netns.check_requirements(install=False)
    monkeypatch.setattr(netns.os, "geteuid", lambda: 0)
    monkeypatch.setattr(netns.shutil, "which", lambda tool: None)
    with pytest.raises(SystemExit, match="iproute2"):
        netns.check_requirements(install=False)
