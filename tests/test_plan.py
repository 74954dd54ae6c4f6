"""The analytic planner: hand-computed memory, byte counts equal to the codecs' real payloads, exposed
time, speedup, CLI, and flag-naming validation."""

from __future__ import annotations

import io
import json
import math
import subprocess
import sys
from contextlib import redirect_stdout
from pathlib import Path

import pytest
import torch

from megatron_diloco.algorithm.link import ring_allreduce_bytes
from megatron_diloco.algorithm.compression import get_codec
from megatron_diloco.algorithm.compression.codecs import payload_bytes
from megatron_diloco.algorithm.outer_store import SLOTS
import megatron_diloco.plan as plan_mod
from megatron_diloco.plan import PlanConfig, main, plan
from megatron_diloco.plan.report import _site_rows

REPO = Path(__file__).resolve().parent.parent


def cfg(**kw) -> PlanConfig:
    base = dict(params=1e9, step_time_s=1.0, tokens_per_step=1000, replicas=2, local_steps=10,
                link_mbps=8000.0, link_efficiency=1.0, boundary_s=0.0, codec="none", overlap="delayed")
    base.update(kw)
    return PlanConfig(**base)


def test_memory_hand_computed():
    # 8e9 params, TP 2 x PP 2 -> 2e9 per GPU; DP 4 -> outer shard 0.5e9.
    p = plan(cfg(params=8e9, tp=2, pp=2, dp=4, codec="none", outer_momentum=0.9))
    gib = 2**30
    assert p.params_per_gpu == 2e9 and p.shard_params == 0.5e9
    assert p.memory_gib["inner"] * gib == pytest.approx(2 * 2e9 + 4 * 2e9 + 12 * 0.5e9)  # 18e9
    assert p.memory_gib["outer"] * gib == pytest.approx(12 * 0.5e9)  # theta, momentum, buffer
    assert p.memory_gib["total"] * gib == pytest.approx(24e9)
    assert p.baseline_memory_gib * gib == pytest.approx(4e9 + 8e9 + 12 * 2e9 / 8)  # optimizer over R dp
    assert not p.activations_estimated and p.memory_gib["activations"] == 0
    # mu = 0 drops the momentum; a lossy codec adds the residual and the payload + gather buffers.
    q = plan(cfg(params=8e9, tp=2, pp=2, dp=4, codec="int8", outer_momentum=0.0))
    payload = payload_bytes("int8", 500_000_000)
    assert q.memory_gib["outer"] * gib == pytest.approx(12 * 0.5e9 + 3 * payload)
    # partial (the package default) keeps the launch point x_L: 4 B more per shard element; its
    # exposure is the delayed one (auto tau <= H)
    r = plan(cfg(params=8e9, tp=2, pp=2, dp=4, codec="int8", outer_momentum=0.0, overlap="partial"))
    assert r.memory_gib["outer"] * gib == pytest.approx(16 * 0.5e9 + 3 * payload)
    assert r.exposed_s == q.exposed_s


def test_host_outer_state_memory_hand_computed():
    """--outer-state host: theta, momentum, residual, eager anchor and the quantized codecs' exchange
    buffer leave the GPU for the host, and so does ``none``'s all-reduce buffer (its all-reduce runs
    in host memory over gloo); the quantized payload buffers and the fixed staging stay."""
    gib, shard = 2**30, 0.5e9
    payload = payload_bytes("int8", 500_000_000)
    kw = dict(params=8e9, tp=2, pp=2, dp=4, codec="int8", outer_momentum=0.9, overlap="eager")
    on_gpu, on_host = plan(cfg(**kw)), plan(cfg(**kw, outer_state="host", outer_chunk_mb=16.0))
    assert on_gpu.memory_gib["outer"] * gib == pytest.approx(20 * shard + 3 * payload)  # 5 vectors + anchor
    assert on_gpu.host_memory_gib == 0
    assert on_host.memory_gib["outer"] * gib == pytest.approx(SLOTS * 5 * 16 * 2**20 + 3 * payload)
    assert on_host.host_memory_gib * gib == pytest.approx(20 * shard)
    assert on_host.memory_gib["inner"] == on_gpu.memory_gib["inner"]
    # none: the fp32 all-reduce buffer is held on the host with theta and momentum; only staging on the GPU
    raw = plan(cfg(params=8e9, tp=2, pp=2, dp=4, codec="none", outer_state="host", outer_momentum=0.9))
    assert raw.host_memory_gib * gib == pytest.approx(12 * shard)  # theta, momentum, the all-reduce buffer
    assert raw.memory_gib["outer"] * gib == pytest.approx(SLOTS * 5 * 16 * 2**20)


def test_paper_preset_prints_both_outer_states_and_which_fits(capsys):
    assert main(["--preset", "paper"]) == 0
    text = capsys.readouterr().out
    assert "--diloco-x-outer-state device: 113.41 GiB GPU  does NOT fit 80 GiB" in text
    assert "--diloco-x-outer-state host: 93.72 GiB GPU + 19.93 GiB host" in text
    assert "-> fits: neither layout" in text  # fp32 main grads: the inner state alone is 89.69 GiB
    assert "--diloco-x-outer-state host: 68.80 GiB GPU + 19.93 GiB host (159 GiB per 8-GPU node)  fits 80 GiB" in text
    assert "-> fits: outer state on the host" in text  # bf16 main grads: only the host layout fits
    assert main(["--preset", "paper", "--json"]) == 0
    options = json.loads(capsys.readouterr().out)["outer_state_options"]
    assert [(o["outer_state"], o["fits"]) for o in options] == [("device", False), ("host", False)]


@pytest.mark.parametrize("fmt, numel", [("int8", 1000), ("int8", 4096), ("int4", 1001), ("int4", 300),
                                       ("int2", 1003)])
@pytest.mark.parametrize("replicas", [2, 3])
def test_exchange_bytes_equal_the_codec_payload(fmt, numel, replicas):
    """The planner counts a payload with the codec registry's arithmetic, which the codec's own count
    and its real encoded payload agree with."""
    codec = get_codec(fmt)
    residual = torch.zeros(numel)
    payload = codec.encode(residual, pseudo_grad=torch.randn(numel), residual_out=residual)
    assert plan_mod.payload_bytes(fmt, numel) == payload_bytes(fmt, numel) == payload.numel() == \
        codec.payload_bytes(numel)
    p = plan(cfg(params=numel, replicas=replicas, codec=fmt))
    assert p.bytes_sent_per_rank_per_round == (replicas - 1) * payload.numel()  # all-gather accounting
    assert p.compression_ratio == pytest.approx(4 * numel / payload.numel())


@pytest.mark.parametrize("replicas", [2, 4])
def test_uncompressed_exchange_is_the_ring_allreduce(replicas):
    numel = 12_000
    raw = get_codec("none").encode(pseudo_grad=torch.randn(numel))
    assert raw.numel() == payload_bytes("none", numel) == get_codec("none").payload_bytes(numel) == 4 * numel
    p = plan(cfg(params=numel, replicas=replicas, codec="none"))
    assert p.bytes_sent_per_rank_per_round == ring_allreduce_bytes(4 * numel, replicas)


def test_per_link_bytes_and_time_follow_the_scope():
    # TP 2 x PP 2 x DP 2 = 8 ranks per replica, 4 per node; 1 byte/s per link (8e-6 Mbit/s).
    kw = dict(params=8e6, tp=2, pp=2, dp=2, gpus_per_node=4, codec="none", link_mbps=8e-6)
    per_rank = plan(cfg(**kw, link_scope="gpu")).bytes_sent_per_rank_per_round  # 4 B x 1e6 elements
    assert per_rank == 4e6
    for scope, ranks in (("gpu", 1), ("node", 4), ("cluster", 8)):
        p = plan(cfg(**kw, link_scope=scope))
        assert p.bytes_per_link_per_round == ranks * per_rank
        assert p.exchange_s == pytest.approx(ranks * per_rank)


def test_exposed_time():
    # int8 exchange of 1e9 elements at 1 GB/s payload: about 1.016 s.
    exch = plan(cfg(codec="int8")).exchange_s
    assert 1.0 < exch < 1.02
    assert plan(cfg(codec="int8", overlap="delayed", local_steps=2)).exposed_s == 0.0  # fits in H steps
    assert plan(cfg(codec="int8", overlap="eager", local_steps=2)).exposed_s == 0.0
    assert plan(cfg(codec="int8", overlap="none", local_steps=2)).exposed_s == pytest.approx(exch)
    short = plan(cfg(codec="int8", overlap="delayed", step_time_s=0.25, local_steps=2))
    assert short.exposed_s == pytest.approx(exch - 0.5)
    assert short.min_hidden_local_steps == math.ceil(exch / 0.25)
    assert short.round_s == pytest.approx(0.5 + short.exposed_s)


def test_auto_local_steps_is_the_runs_rule_on_the_modelled_exchange(capsys):
    """``--local-steps auto``: the H a run would choose for the modelled exchange and step time (the
    run's own rule, :func:`schedule.auto_local_steps`), its round and exposure computed at that H, an
    auto warm-up lengthened to that H's, as the run lengthens it (a given one kept); the report says
    ``auto -> H`` and the flags it implies keep ``auto``."""
    from megatron_diloco.algorithm.schedule import auto_local_steps

    for step in (0.5, 0.25, 0.02):  # ~1.016 s int8 exchange: 3 steps (x 8 -> 30), 5 (-> 40), 51 (-> 300)
        p = plan(cfg(codec="int8", overlap="partial", local_steps="auto", step_time_s=step, train_iters=100000))
        assert p.local_steps == auto_local_steps(p.exchange_s, step) == min(300, max(30, 8 * math.ceil(p.exchange_s / step)))
        assert p.round_s == pytest.approx(p.local_steps * step + p.exposed_s)
        assert p.warmup == (10, 30 * p.local_steps)  # the auto warm-up of the H chosen (30 -> 900 steps)
    assert plan(cfg(codec="int8", local_steps="auto", step_time_s=0.02, warmup_iters=600)).warmup == (10, 600)  # as given
    assert [plan(cfg(codec="int8", local_steps="auto", step_time_s=s)).local_steps for s in (0.5, 0.25, 0.02)] == [30, 40, 300]
    assert plan(cfg(codec="int8", local_steps="auto", step_time_s=0.02)).exposed_s == 0.0
    assert main(["--preset", "paper", "--local-steps", "auto"]) == 0
    out = capsys.readouterr().out
    assert "H = auto -> " in out and "--diloco-x-local-steps auto" in out


def test_warmup_exposed_time():
    """The warm-up's one-time exposed exchange time, with the package's own resolution of the flags:
    each of partial's warm-up exchanges but the last (which lands in a round of H) hides behind
    min(tau_w, the steps that hide it) steps (tau_w auto: H0 // 10; 0 blocks), the delayed modes hide
    up to H0 steps of each, none blocks them all."""
    exch = plan(cfg(codec="int8")).exchange_s
    auto = plan(cfg(codec="int8", overlap="partial", local_steps=30, train_iters=3000, step_time_s=0.25))
    assert auto.warmup == (10, 900) and auto.warmup_overlap_steps == 1 and auto.min_hidden_local_steps == 5
    assert auto.warmup_exposed_s == pytest.approx(89 * (exch - 0.25))
    assert auto.warmup_share == pytest.approx(89 * (exch - 0.25) / (3000 * 0.25))
    blocking = plan(cfg(codec="int8", overlap="partial", local_steps=30, train_iters=3000, step_time_s=0.25,
                        warmup_overlap_steps=0))
    assert blocking.warmup_exposed_s == pytest.approx(89 * exch)
    capped = plan(cfg(codec="int8", overlap="partial", local_steps=30, train_iters=3000, step_time_s=0.25,
                      warmup_overlap_steps=2))
    assert capped.warmup_exposed_s == pytest.approx(89 * (exch - 0.5))
    fast = plan(cfg(codec="int8", overlap="partial", local_steps=30, train_iters=3000, warmup_overlap_steps=2))
    assert fast.min_hidden_local_steps <= 2 and fast.warmup_exposed_s == 0.0  # 1 s steps: 2 hide it
    none = plan(cfg(codec="int8", overlap="none", local_steps=30, train_iters=3000))
    assert none.warmup_overlap_steps == 0 and none.warmup_exposed_s == pytest.approx(90 * exch)
    slow = plan(cfg(codec="int8", overlap="delayed", local_steps=6, warmup_iters=20, step_time_s=0.25))
    assert slow.warmup == (2, 20) and slow.warmup_share is None
    assert slow.warmup_exposed_s == pytest.approx(10 * (exch - 0.5))
    for unmeasured in ("delayed", "eager"):  # the auto warm-up applies where it was measured only
        assert plan(cfg(codec="int8", overlap=unmeasured, local_steps=30, train_iters=3000)).warmup == (None, 0)
    off = plan(cfg(codec="int8", overlap="partial", local_steps=30, warmup_iters=0))
    assert off.warmup == (None, 0) and off.warmup_overlap_steps == 0 and off.warmup_exposed_s == 0.0
    # --warmup-codec int2 (int8's codec): the warm-up's exchanges but the last carry int2 payloads,
    # a quarter of the bytes but the scales
    from megatron_diloco.algorithm.compression.reference import payload_layout

    shard = int(auto.shard_params)
    quarter = payload_layout(shard, "int2").total_bytes / payload_layout(shard, "int8").total_bytes
    assert 0.25 < quarter < 0.27
    int2 = plan(cfg(codec="int8", overlap="partial", local_steps=30, train_iters=3000, step_time_s=0.25,
                    warmup_codec="int2"))
    assert int2.warmup_exchange_s == pytest.approx(quarter * exch, rel=1e-6) and auto.warmup_exchange_s == exch
    assert int2.exchange_s == exch  # rounds of H keep the codec
    assert int2.warmup_exposed_s == pytest.approx(89 * max(0.0, quarter * exch - 0.25), rel=1e-6)
    none2 = plan(cfg(codec="int8", overlap="none", local_steps=30, train_iters=3000, warmup_codec="int2"))
    assert none2.warmup_exposed_s == pytest.approx(89 * quarter * exch + exch, rel=1e-6)
    with pytest.raises(ValueError, match="--warmup-codec"):
        cfg(codec="adaptive", warmup_codec="int2")
    with pytest.raises(ValueError, match="--warmup-codec"):
        cfg(codec="int8", warmup_codec="lowrank")


def test_speedup_hand_computed():
    # AllReduce: (R-1)/R x (4 + 2) B x 1e9 params = 3e9 B at 1e9 B/s -> 3 s comm + 1 s compute = 4 s/step.
    # DiLoCoX: H = 10 steps of 1 s per round, exchange (1 s) hidden: 1 s/step. Speedup 4.
    p = plan(cfg(codec="int8"))
    assert p.allreduce_comm_s == pytest.approx(3.0)
    assert p.allreduce_step_s == pytest.approx(4.0)
    assert p.speedup_vs_allreduce == pytest.approx(4.0)
    assert plan(cfg(codec="int8", baseline_overlap=True)).speedup_vs_allreduce == pytest.approx(3.0)
    # Flat ring over R dp = 4 ranks (dp 2): the edge leaving a replica carries (n-1)/n of the group.
    ring = plan(cfg(dp=2, baseline_algo="ring"))
    assert ring.allreduce_bytes_per_link_per_step == pytest.approx(0.75 * 6e9)


def test_flops_step_time_and_activation_estimate():
    p = plan(PlanConfig(layers=2, hidden=64, vocab=100, heads=4, seq_length=32, micro_batch=2, pp=2,
                        tokens_per_step=256, gpu_tflops=1e-6, codec="none"))
    n = 2 * (4 * 64 * 64 + 2 * 64 * 256 + 2 * 64) + 2 * 100 * 64 + 64
    assert p.params == n
    assert p.compute_step_s == pytest.approx((6 * n + 12 * 2 * 64 * 32) * 256 / (2 * 1e6))
    # 4 micro-batches of 2 x 32 tokens; stage 0 holds pp = 2 of them; 1 layer per stage.
    per_layer = 32 * 2 * 64 * (34 + 5 * 4 * 32 / 64)
    assert p.activations_estimated and p.memory_gib["activations"] * 2**30 == pytest.approx(2 * per_layer)


def test_cli_prints_json_and_table():
    buf = io.StringIO()
    with redirect_stdout(buf):
        assert main(["--preset", "paper", "--json"]) == 0
    out = json.loads(buf.getvalue())
    assert out["config"]["params"] == 107e9 and out["config"]["pp"] == 8
    assert out["speedup_vs_allreduce"] > 1 and out["memory_gib"]["total"] > 0 and out["assumptions"]
    proc = subprocess.run([sys.executable, "-m", "megatron_diloco.plan", "--params", "1e9",
                           "--tokens-per-step", "4096", "--gpu-tflops", "100", "--link-mbps", "100",
                           "--local-steps", "50", "--codec", "lowrank-int8", "--compression-ratio", "100"], cwd=REPO, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "speedup vs AllReduce" in proc.stdout and "lowrank-int8, 100x" in proc.stdout


@pytest.mark.parametrize("kw, flag", [
    (dict(layers=30, hidden=64, pp=4, params=None), "--pp"),
    (dict(link_mbps=0.0), "--link-mbps"),
    (dict(link_mbps=float("inf")), "--link-mbps"),
    (dict(tp=0), "--tp"),
    (dict(codec="zip"), "--codec"),
    (dict(link_scope="rack"), "--link-scope"),
    (dict(step_time_s=None, gpu_tflops=None), "--gpu-tflops"),
    (dict(step_time_s=-1.0), "--step-time-s"),
    (dict(tokens_per_step=0), "--tokens-per-step"),
    (dict(params=None), "--params"),
    (dict(compression_ratio=0.5), "--compression-ratio"),
    (dict(local_steps=0), "--local-steps"),
    (dict(link_scope="node", dp=3, gpus_per_node=8), "--gpus-per-node"),
    (dict(sites="1,0.5,2"), "--sites"),
    (dict(sites="1,0"), "--sites"),
    (dict(sites="1,fast"), "--sites"),
    (dict(sites="1:0,1"), "--sites"),
    (dict(sites="1:1000:0,1"), "--sites"),
    (dict(sites="1:1000:8:2,1"), "--sites"),
])
def test_bad_input_names_the_flag(kw, flag):
    with pytest.raises(ValueError, match=flag):
        cfg(**kw)


def test_cli_bad_input_exits_2_naming_the_flag(capsys):
    assert main(["--preset", "paper", "--link-mbps", "0"]) == 2
    assert "--link-mbps" in capsys.readouterr().err


def test_validation_reader_on_a_wan_bench_shaped_result():
    """benchmarks/planning/plan_validate.py reads wan_bench.py's JSON: bytes rows follow the plan's formula,
    failed runs become notes (guards the reader until the real wan.json lands)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("plan_validate", REPO / "benchmarks" / "planning" / "plan_validate.py")
    pv = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pv)
    n, h = 10_000, 4
    summary = {"rounds": 3, "local_steps": h, "replicas": 2, "overlap": "none", "compression": "none",
               "bytes_sent_per_rank": 3 * 4 * n}
    runs = [{"link_mbps": 10.0, "method": "allreduce", "tokens_per_s": 100.0, "step_s": 0.1, "inner_step_s": 0.05},
            {"link_mbps": 10.0, "method": "diloco", "tokens_per_s": 400.0, "inner_step_s": 0.05, "window_s": 1.0,
             "rounds_in_window": 2, "exchange_per_round_s": 0.03, "exposed_comm_per_round_s": 0.03,
             "boundary_per_round_s": 0.04, "speedup_vs_allreduce": 4.0, "summary": summary},
            {"link_mbps": 10.0, "method": "dilocox", "error": "timeout"}]
    data = {"config": {"local_steps": h, "replicas": 2, "ranks_per_replica": 1},
            "model": {"params": n, "tokens_per_iter": 64}, "links": [], "runs": runs}
    rows, notes = pv.link_rows(data, "wan.json")
    got = {r["quantity"]: r for r in rows}
    assert got["bytes sent per rank per round"]["predicted"] == 4 * n == got["bytes sent per rank per round"]["measured"]
    assert {"AllReduce step time", "exchange time per round", "speedup vs AllReduce (tokens/s ratio)"} <= set(got)
    assert len(notes) == 1 and "timeout" in notes[0]

    # gpu_throughput.py's gpu.json: 2 replicas x PP 2 of the 85.5M GPT, one modelled link per GPU.
    n_rank = pv.SMOKE_PARAMS[2] / 2
    gpu = {"link_model": {"share": "rank"}, "runs": [
        {"gpus": 4, "link_mbps": 1000.0, "method": "allreduce", "tokens_per_step": 65536, "compute_step_s": 0.17,
         "step_s_mean": 1.2, "tokens_per_s": 5e4, "bytes_per_rank_per_round": 4 * n_rank},
        {"gpus": 4, "link_mbps": 1000.0, "method": "dilocox", "tokens_per_step": 65536, "compute_step_s": 0.17,
         "step_s_mean": 0.18, "tokens_per_s": 3e5, "bytes_per_rank_per_round": 4.4e7, "exposed_s_per_round": 0.0,
         "local_steps": 20, "speedup_vs_allreduce": 6.0},
        {"gpus": 4, "link_mbps": 1000.0, "method": "diloco"}]}
    rows, notes = pv.gpu_rows(gpu, "gpu.json")
    got = {(r["run"], r["quantity"]): r for r in rows}
    ar = got[("gpu 4x 1000 Mbit allreduce", "AllReduce bytes per rank per step")]
    # plain DDP (gpu_throughput.py's baseline): ring all-reduce of fp32 grads, 2(n-1)/n x 4 B, n = 2
    assert ar["predicted"] == pytest.approx(ar["measured"])
    assert ("gpu 4x 1000 Mbit dilocox", "speedup vs AllReduce (tokens/s ratio)") in got
    assert len(notes) == 1 and "diloco" in notes[0]


def test_calibration_travels_with_the_package_and_matches_the_benchmark():
    """The planner needs no file outside the package (an installed package has no benchmarks/), and
    its embedded low-rank/adaptive ratios are the ones benchmarks/codecs/codecs_bench.py measured (to the
    4 digits kept): re-running the benchmark without updating the table fails here."""
    measured = json.loads((REPO / "benchmarks" / "results" / "codecs.json").read_text())["codecs"]
    assert set(plan_mod.MEASURED_RATIOS) == {k for k in measured if k.startswith(("lowrank", "adaptive"))}
    for key, ratio in plan_mod.MEASURED_RATIOS.items():
        assert ratio == pytest.approx(measured[key]["compression_ratio"], rel=5e-4), key
    assert plan_mod.measured_ratio("lowrank-int8", rank=4) == plan_mod.MEASURED_RATIOS["lowrank-int8-r4"]
    with pytest.raises(ValueError, match="--compression-ratio"):
        plan_mod.measured_ratio("lowrank", rank=7)


def test_plan_reads_a_training_command_line():
    """``python -m megatron_diloco.plan <its flags> -- <pretraining flags>``: Megatron's model, batch and
    parallelism flags and the --diloco-x* flags give the same projection as this tool's own flags for
    the same run (a subprocess: it imports Megatron); the flags the plan implies are printed."""
    import json
    import subprocess
    import sys

    train = ["--num-layers", "24", "--hidden-size", "2048", "--num-attention-heads", "16", "--seq-length", "2048",
             "--global-batch-size", "512", "--micro-batch-size", "1", "--tensor-model-parallel-size", "2",
             "--pipeline-model-parallel-size", "2", "--bf16", "--train-iters", "20000", "--vocab-size", "50304",
             "--diloco-x", "--diloco-x-replicas", "2", "--diloco-x-local-steps", "50", "--diloco-x-compression", "int8",
             "--diloco-x-bandwidth-mbps", "500", "--untie-embeddings-and-output-weights"]
    out = subprocess.run([sys.executable, "-m", "megatron_diloco.plan", "--dp", "4", "--gpu-tflops", "300",
                          "--json", "--", *train], capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout)
    native = plan_mod.plan(plan_mod.PlanConfig(
        layers=24, hidden=2048, heads=16, seq_length=2048, tokens_per_step=512 // 2 * 2048, micro_batch=1, tp=2, pp=2,
        dp=4, param_bytes=2, train_iters=20000, vocab=50304, replicas=2, local_steps=50, codec="int8",
        link_mbps=500, link_scope="cluster", gpu_tflops=300))
    assert got["params"] == native.params and got["exchange_s"] == native.exchange_s
    assert got["speedup_vs_allreduce"] == native.speedup_vs_allreduce and got["warmup"] == list(native.warmup)
    assert "--diloco-x-local-steps 50" in got["training_flags"] and "--diloco-x-compression int8" in got["training_flags"]


def test_plan_help_shows_defaults_without_markup():
    text = plan_mod.build_parser().format_help()
    assert "(default: int4)" in text and "(default: 500)" in text
    assert "``" not in text and ":data:" not in text and ":func:" not in text


def test_sites_that_differ_hand_computed():
    """Site 1 half as fast, site 2 at half the tokens per step (so its step takes half as long): with equal H
    the slowest (site 1) sets the round and the others wait; with a global batch in proportion to speed, or an H
    per site, each fills the round."""
    p = plan(cfg(replicas=3, sites="1,0.5,1:500", boundary_s=0.5, local_steps=10))  # step 1 s at 1000 tokens
    s = p.sites
    assert s.step_s == [1.0, 2.0, 0.5] and s.solo_tokens_per_s == [1000.0, 500.0, 1000.0]
    exposed = max(0.0, p.exchange_s - 10 * 2.0)  # delayed: the exchange hides under the slowest round
    round_s = 10 * 2.0 + 0.5 + exposed
    eq = s.equal_h
    assert eq.local_steps == [10, 10, 10] and eq.round_s == pytest.approx(round_s)
    assert eq.idle_fraction == pytest.approx([(round_s - 10.5) / round_s, (round_s - 20.5) / round_s,
                                              (round_s - 5.5) / round_s])
    assert eq.weights == pytest.approx([3 * 1000 / 2500, 3 * 1000 / 2500, 3 * 500 / 2500])
    assert eq.tokens_per_s == pytest.approx(10 * 2500 / round_s)
    assert eq.throughput_vs_solo_sum == pytest.approx(eq.tokens_per_s / 2500)
    assert eq.fast_site_idle_fraction == max(eq.idle_fraction)
    assert s.balanced_tokens_per_step == pytest.approx([2000, 1000, 2000])
    bal = s.balanced_batch
    assert bal.local_steps == [10, 10, 10] and bal.idle_fraction == pytest.approx([exposed / round_s] * 3)
    assert bal.weights == pytest.approx([3 * 2000 / 5000, 3 * 1000 / 5000, 3 * 2000 / 5000])
    assert bal.tokens_per_s == pytest.approx(10 * 5000 / round_s)
    per = s.per_site_h
    assert per.local_steps == [20, 10, 40]  # floor(10 x 2 s / t_m)
    assert per.idle_fraction == pytest.approx([(round_s - 20.5) / round_s] * 3)
    tokens = [20 * 1000, 10 * 1000, 40 * 500]
    assert per.weights == pytest.approx([3 * k / sum(tokens) for k in tokens])
    assert per.tokens_per_s == pytest.approx(sum(tokens) / round_s)
    assert plan(cfg()).sites is None
    rows = dict(_site_rows(p))  # at run time: a pace of at least the fastest site's steps per step of the slowest
    assert "--diloco-x-site-pace 4 or more (the fastest site steps 4.00x" in rows["or H per site at run time"]


def test_sites_of_different_gpu_counts():
    """SPEED:TOKENS:GPUS: the planned replica on 8 GPUs (DP 8) steps 1 s at 1000 tokens; a site of 4 GPUs at the
    same tokens per GPU (500) steps as long, and is balanced as given; at the planned 1000 tokens it takes 2 s, and
    an H per site gives the site of 8 GPUs twice its H."""
    same = plan(cfg(dp=8, sites="1:1000:8,1:500:4", boundary_s=0.5, local_steps=10)).sites
    assert same.step_s == [1.0, 1.0] and same.equal_h.fast_site_idle_fraction == pytest.approx(
        max(same.equal_h.idle_fraction)) and same.equal_h.idle_fraction[0] == pytest.approx(
        same.equal_h.idle_fraction[1])
    assert same.equal_h.weights == pytest.approx([4 / 3, 2 / 3])
    assert same.shard_ratio == [1.0, 2.0]  # the site of 4 GPUs: two exchange slots per rank
    p = plan(cfg(dp=8, sites="1:1000:8,1:500:4", boundary_s=0.5, local_steps=10))
    sharded = p.memory_gib["inner_optimizer"] + p.memory_gib["outer"]
    rows = dict(_site_rows(p))
    assert "shard" not in rows["site 0"] and f"{p.memory_gib['total'] + sharded:.1f} GiB per GPU" in rows["site 1"]
    # exchanging by name: a staging buffer of 4 B per parameter of the GPU's share (the model over the site's GPUs)
    share = [4 * p.params / gpus / 2**30 for gpus in (8, 4)]
    assert f"site 0 {share[0]:.2f} GiB, site 1 {share[1]:.2f} GiB" in rows["exchange by name"], rows


def test_the_planners_transfer_buffers_are_the_exchange_by_names():
    from megatron_diloco.megatron_adapter.by_name import PIECE_ELEMENTS
    from megatron_diloco.plan.sites import BY_NAME_TRANSFER_GIB

    assert BY_NAME_TRANSFER_GIB * 2**30 == 2 * 4 * PIECE_ELEMENTS  # a send and a receive buffer, fp32
    full = plan(cfg(dp=8, sites="1:1000:8,1:1000:4", boundary_s=0.5, local_steps=10)).sites
    assert full.step_s == [1.0, 2.0] and full.per_site_h.local_steps == [20, 10]
    assert plan(cfg(dp=8, sites="1,1:1000:8")).sites.step_s == [1.0, 1.0]  # GPUS defaults to TP x PP x DP


def test_cli_prints_the_sites(capsys):
    assert main(["--params", "85e6", "--tokens-per-step", "65536", "--step-time-s", "0.2", "--local-steps", "30",
                 "--sites", "1,0.5"]) == 0
    out = capsys.readouterr().out
    assert "sites as given (equal H)" in out and "the fast site idle 50.0%" in out, out
    assert main(["--params", "85e6", "--tokens-per-step", "65536", "--step-time-s", "0.2", "--sites", "1,0.5",
                 "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["sites"]["per_site_h"]["local_steps"] == [1000, 500]
