"""Convergence at equal tokens, replicas sharing one GPU: validation loss vs tokens and vs bytes.

The regime (issue 12): a >= 85M-parameter GPT, single epoch of the environment corpus
(``examples/stdlib_corpus.py --environment``: every .py / .rst / .md of the installed Python
environment, deduplicated, split by document), H = 30, >= 100 outer rounds, 2 replicas.

Every DiLoCo(X) run is the Megatron path itself: the unmodified example under the harness, one
single-rank world per replica joined through ``--diloco-x-outer-store`` (NCCL refuses two ranks of
one world on one GPU; ``tests/test_separate_worlds.py`` shows the separate launches train bit for
bit as one world does). ``allreduce`` is one world of one rank with twice the per-replica batch: the
same samples per step as data parallelism over the 2 replicas. Several runs share the GPU at once.
``--one-world`` launches each run as a multi-GPU user does instead: one ``torchrun`` world of R ranks,
one GPU each, the replicas joined over NCCL (``allreduce``: data parallelism over the R ranks).

Figures per run: Megatron's validation loss at every ``--eval-interval`` (a multiple of H) and after
training (after the drain), averaged over the replicas (each evaluates its half of the same
batches, as data-parallel ranks do); bytes sent per rank from the DiLoCoX summary (the package's
own count: 2 (R-1)/R of the fp32 payload for ``none``, R - 1 payloads for the all-gather codecs),
for ``allreduce`` the modelled ring bytes of Megatron's distributed-optimizer step, (R - 1) / R x
(4 B fp32 gradient reduce-scatter + 2 B bf16 parameter all-gather) per parameter per step.

    python benchmarks/convergence.py --out DIR [--methods a,b] [--seeds 1] [--parallel 8] [--budget-s 500]
    python benchmarks/convergence.py --out DIR --report-only --from DIR2 ...   # merge into DIR/convergence.json
    python benchmarks/convergence.py --out DIR --cpu-smoke                    # tiny, CPU, gloo
    python benchmarks/convergence.py --out DIR --one-world --methods ...      # R GPUs per run, NCCL
    python benchmarks/convergence.py --out DIR --one-world --call-s 540 ...   # the same, again: it goes on

Writes ``DIR/convergence.json`` (the shape issue 12 gives) and, with matplotlib,
``DIR/convergence.png`` (validation loss vs tokens; final loss vs bytes).

Runs longer than one device call (issue 39): with ``--call-s S`` every run saves into and loads from
``DIR/<run>/ckpt`` and stops, saved, before S seconds from this script's start are up; the same command
again into DIR continues the runs not finished (``DIR/manifest.json``; each call's logs in
``DIR/<run>/call<k>/``, read in order by the report; only each run's latest checkpoint is kept). One world only (``--one-world``, or allreduce /
single): separate worlds cannot checkpoint. How, and a machine given back between calls:
``harness/continued.py``; the device calls: ``benchmarks/README.md``.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from pathlib import Path

_STARTED = time.monotonic()  # what --call-s counts from

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # run from a checkout, uninstalled
from harness.continued import Call, Manifest, call_dirs, checkpoint_flags, last_done  # noqa: E402
from harness.runner import FAST_PATH, VALIDATION_LINE, ExampleJob, Job, replica_worlds_job, run_jobs  # noqa: E402
from megatron_diloco.algorithm.config import BLOCKWISE  # noqa: E402
from megatron_diloco.summary import parse_summaries  # noqa: E402

H = 30
REPLICAS = 2  # the default of --replicas
#: ``--model``: the GPTs' shapes (RESULTS §2.4, §9): 85.2M (the default) and 302.4M parameters
SHAPES = {"85M": "--num-layers 12 --hidden-size 768 --ffn-hidden-size 3072 --num-attention-heads 12".split(),
          "302M": "--num-layers 24 --hidden-size 1024 --ffn-hidden-size 4096 --num-attention-heads 16".split()}
#: every model's other flags (the lr: a sweep's methods set their own)
COMMON = """
    --seq-length 512 --max-position-embeddings 512 --micro-batch-size 4
    --bf16 --transformer-impl local --lr 1e-3 --min-lr 1e-4 --lr-warmup-iters 100
    --log-interval 50 --eval-iters 8 --pipeline-model-parallel-size 1
""".split()
MODELS = {name: [*shape, *COMMON] for name, shape in SHAPES.items()}
MODEL = MODELS["85M"]
CPU_MODEL = """
    --num-layers 2 --hidden-size 64 --ffn-hidden-size 256 --num-attention-heads 2
    --seq-length 64 --max-position-embeddings 64 --micro-batch-size 2
    --lr 3e-3 --min-lr 3e-4 --lr-warmup-iters 2 --log-interval 1 --eval-iters 2
    --pipeline-model-parallel-size 1
""".split()
#: Methods: overlap rule, codec, tau (partial), outer lr eta, outer momentum mu; optional tau_w (the
#: warm-up's overlap cap, partial with a warm-up in flags; default 0), wc (the warm-up's codec), H (local
#: steps, default ``--local-steps``), E (adaptive energy) and flags (Megatron flags, e.g. the lr). No overlap: one world (allreduce, single).
#: eta 1, mu 0 unless named: measured best at H = 30 (RESULTS.md §2: momentum amplifies a 30-step
#: Adam trajectory like a larger inner lr; eta 0.7 / mu 0.9 diverged).
_O = dict(eta=1.0, mu=0.0)
METHODS: dict[str, dict] = {
    "allreduce": {},
    # the package default: --diloco-x alone at the run's H (--local-steps), every other DiLoCoX setting
    # as the package resolves it (auto warm-up, tau, tau_w, warm-up codec); only the link is given,
    # the 1 Gbit auto tau is sized for
    "default": {"default": True},
    # the package default with its warm-up named (the warm-up rule across H): rounds of H0 = 10
    # for the first 900 / 1500 steps whatever H is (tau_w and the warm-up codec stay auto: 1, int2)
    **{f"default_w{w}": {"default": True, "flags": ["--diloco-x-warmup-local-steps", "10",
                                                     "--diloco-x-warmup-iters", str(w)]} for w in (900, 1500)},
    # the package default with --diloco-x-overlap none: blocking DiLoCo at the default's H, codecs and
    # auto warm-up (its rounds blocking too, tau_w 0), the reference the default's overlap is judged against
    "default_blocking": {"default": True, "flags": ["--diloco-x-overlap", "none"]},
    # --diloco-x-local-steps auto (the H the modelled link and the measured step time allow, within
    # [30, 300]): at 1 Gbit (the common flags' link) and at 100 Mbit, where it chooses a longer H
    # the outer step at large H: outer momentum at unit gain, eta / (1 - mu) = 1 (the long-run step of
    # eta 1, mu 0; the papers' 0.7 / 0.9 has gain 7 and diverged here): smoothing across rounds without
    # amplifying a repeating pseudo-gradient
    **{f"default_mu{mu}_gain1": {"default": True, "flags": ["--diloco-x-outer-momentum", mu,
                                                            "--diloco-x-outer-lr", f"{1 - float(mu):g}"]}
       for mu in ("0.5", "0.9")},
    # the papers' outer step (Nesterov, eta 0.7, mu 0.9: gain 7), which diverged at 0.58 tokens per parameter
    "default_eta0.7_mu0.9": {"default": True, "flags": ["--diloco-x-outer-lr", "0.7", "--diloco-x-outer-momentum",
                                                         "0.9"]},
    # a larger outer gain for more than 2 replicas (4 replicas at the default: +7.71%, against +2.34% for 2 on the
    # same tokens): eta above 1 at mu 0, and mu 0.5 at eta 1 (gain 2)
    **{f"default_eta{eta}": {"default": True, "flags": ["--diloco-x-outer-lr", eta]} for eta in ("1.5", "2")},
    "default_mu0.5": {"default": True, "flags": ["--diloco-x-outer-momentum", "0.5"]},
    "default_auto_h": {"default": True, "flags": ["--diloco-x-local-steps", "auto"]},
    "default_auto_h_100mbit": {"default": True, "flags": ["--diloco-x-local-steps", "auto",
                                                          "--diloco-x-bandwidth-mbps", "100"]},
    # the default at a fixed H over a 100 Mbit link: auto tau overlaps ~40 steps (how the overlap's cost
    # grows with tau's share of a round, which auto H's rule is sized from)
    "default_100mbit": {"default": True, "flags": ["--diloco-x-bandwidth-mbps", "100"]},
    # the inner-lr sweep for a fair baseline: the default at the lrs AllReduce is swept at
    # (allreduce_lr5e-4 / allreduce_lr2e-3 below; 1e-3 is the common flags' lr)
    **{f"default_lr{lr}": {"default": True, "flags": ["--lr", lr, "--min-lr", f"{float(lr) / 10:g}"]}
       for lr in ("5e-4", "2e-3")},
    # one replica alone (its own batch, no partner): the floor any R-replica method must beat
    "single": {"alone": True},
    "diloco": dict(overlap="none", codec="none", **_O),
    "diloco_mu0.5": dict(overlap="none", codec="none", eta=1.0, mu=0.5),
    "diloco_eta0.7_mu0.9": dict(overlap="none", codec="none", eta=0.7, mu=0.9),
    "diloco_int4": dict(overlap="none", codec="int4", **_O),
    "diloco_int8": dict(overlap="none", codec="int8", **_O),
    "delayed": dict(overlap="delayed", codec="none", **_O),
    "delayed_eta0.5": dict(overlap="delayed", codec="none", eta=0.5, mu=0.0),
    "eager": dict(overlap="eager", codec="none", **_O),
    "partial_tau1": dict(overlap="partial", codec="none", tau=1, **_O),
    "partial_tau5": dict(overlap="partial", codec="none", tau=5, **_O),
    "partial_tau15": dict(overlap="partial", codec="none", tau=15, **_O),
    "partial_tau30": dict(overlap="partial", codec="none", tau=30, **_O),
    "partial_mix_tau5": dict(overlap="partial", codec="none", tau=5, merge="mix", **_O),
    "partial_auto": dict(overlap="partial", codec="none", tau="auto", **_O),
    "partial_tau5_int4": dict(overlap="partial", codec="int4", tau=5, **_O),
    "partial_tau15_int4": dict(overlap="partial", codec="int4", tau=15, **_O),
    "partial_auto_int4": dict(overlap="partial", codec="int4", tau="auto", **_O),
    # eta > 1 at mu 0: Adam's per-replica steps on half the batch carry less signal than data
    # parallelism's (noise-dominated: by ~1/sqrt(R)); the outer step scales it back
    "partial_auto_int4_eta1.2": dict(overlap="partial", codec="int4", tau="auto", eta=1.2, mu=0.0),
    "partial_auto_int4_eta1.4": dict(overlap="partial", codec="int4", tau="auto", eta=1.4, mu=0.0),
    "partial_auto_int8": dict(overlap="partial", codec="int8", tau="auto", **_O),
    # int8 at twice H: the bytes of int4 at H (codecs compared at equal bytes)
    "partial_auto_int8_h60": dict(overlap="partial", codec="int8", tau="auto", H=60, **_O),
    "partial_auto_adaptive_e0.99": dict(overlap="partial", codec="adaptive", tau="auto", E=0.99, **_O),
    "partial_tau5_int4_mu0.5": dict(overlap="partial", codec="int4", tau=5, eta=1.0, mu=0.5),
    # the levers left for the gap to AllReduce (RESULTS §2.1): H = 20 (int4 still >= 100x fewer
    # bytes), and the inner lr (every run above shares AllReduce's 1e-3; a fair test tunes both)
    "diloco_int4_h20": dict(overlap="none", codec="int4", H=20, **_O),
    "partial_auto_int4_h20": dict(overlap="partial", codec="int4", tau="auto", H=20, **_O),
    "allreduce_lr2e-3": dict(flags=["--lr", "2e-3", "--min-lr", "2e-4"]),
    "allreduce_lr5e-4": dict(flags=["--lr", "5e-4", "--min-lr", "5e-5"]),
    # below the sweep's grid: AllReduce was best at its lowest lr, 5e-4 (RESULTS.md §2.3), so its optimum is not bracketed
    "allreduce_lr2.5e-4": dict(flags=["--lr", "2.5e-4", "--min-lr", "2.5e-5"]),
    "diloco_int4_lr2e-3": dict(overlap="none", codec="int4", flags=["--lr", "2e-3", "--min-lr", "2e-4"], **_O),
    "diloco_int4_lr5e-4": dict(overlap="none", codec="int4", flags=["--lr", "5e-4", "--min-lr", "5e-5"], **_O),
    "partial_auto_int4_lr5e-4": dict(overlap="partial", codec="int4", tau="auto",
                                     flags=["--lr", "5e-4", "--min-lr", "5e-5"], **_O),
    # a warm-up of shorter rounds (H0 = 10 for the first 300 steps, then H): the gap forms early
    # (+10% at step 300, then flat) and H = 20 halved blocking's; 120 rounds, ~146x fewer bytes
    "diloco_int4_hwarm": dict(overlap="none", codec="int4",
                              flags=["--diloco-x-warmup-local-steps", "10", "--diloco-x-warmup-iters", "300"], **_O),
    # partial: the warm-up's rounds block (tau 0); they were overlapped at 87e15c7, where tau 4 of 10
    # gave back the warm-up's gain: seed 1 0.7938 vs 0.7945 without it
    "partial_auto_int4_hwarm": dict(overlap="partial", codec="int4", tau="auto",
                                    flags=["--diloco-x-warmup-local-steps", "10", "--diloco-x-warmup-iters", "300"],
                                    **_O),
    # a longer warm-up (600 steps of H0 = 10, where the gap was still +5%): 140 rounds, ~125x fewer bytes
    "diloco_int4_hwarm600": dict(overlap="none", codec="int4",
                                 flags=["--diloco-x-warmup-local-steps", "10", "--diloco-x-warmup-iters", "600"], **_O),
    "partial_auto_int4_hwarm600": dict(overlap="partial", codec="int4", tau="auto",
                                       flags=["--diloco-x-warmup-local-steps", "10", "--diloco-x-warmup-iters", "600"],
                                       **_O),
    "diloco_int4_hwarm900": dict(overlap="none", codec="int4",
                                 flags=["--diloco-x-warmup-local-steps", "10", "--diloco-x-warmup-iters", "900"], **_O),
    # 900 steps of H0 = 10: 160 rounds, ~109x fewer bytes; the package's auto warm-up at H = 30 over
    # 3000 steps (min(H // 3, 10) for min(30 H, 3000 / 2) steps), its rounds blocking (tau_w 0)
    "partial_auto_int4_hwarm900": dict(overlap="partial", codec="int4", tau="auto",
                                       flags=["--diloco-x-warmup-local-steps", "10", "--diloco-x-warmup-iters", "900"],
                                       **_O),
    # fewer, longer warm-up rounds over the same 900 steps: 59 / 44 blocked exchanges instead of 89
    # (the exposure blocking warm-up rounds cost: 9.9% of this run's compute at 1 Gbit)
    "partial_auto_int4_hwarm900_h0_15": dict(overlap="partial", codec="int4", tau="auto",
                                             flags=["--diloco-x-warmup-local-steps", "15",
                                                    "--diloco-x-warmup-iters", "900"], **_O),
    "partial_auto_int4_hwarm900_h0_20": dict(overlap="partial", codec="int4", tau="auto",
                                             flags=["--diloco-x-warmup-local-steps", "20",
                                                    "--diloco-x-warmup-iters", "900"], **_O),
    # the warm-up's rounds overlapped, at most tau_w of their 10 steps (--diloco-x-warmup-overlap-steps):
    # tau_w 1 / 2 / 3 take the 89 exchanges' exposure at 1 Gbit from 9.9% to 6.9 / 4.0 / 1.0% of this
    # run's compute in the plan model; auto tau (4) gave the warm-up's gain back. tau_w 1 (H0 // 10) is
    # the package default
    **{f"partial_auto_int4_hwarm900_wtau{k}": dict(
        overlap="partial", codec="int4", tau="auto", tau_w=k,
        flags=["--diloco-x-warmup-local-steps", "10", "--diloco-x-warmup-iters", "900"], **_O) for k in (1, 2, 3)},
    # the warm-up's exchanges as int2 (--diloco-x-warmup-compression; wc): 1.9x fewer bytes each, so
    # that tau_w 1 hides more of them (plan model at 1 Gbit: 2.1% of this run exposed instead of 6.9%)
    "partial_auto_int4_hwarm900_wtau1_w2": dict(
        overlap="partial", codec="int4", tau="auto", tau_w=1, wc="int2",
        flags=["--diloco-x-warmup-local-steps", "10", "--diloco-x-warmup-iters", "900"], **_O),
    "diloco_int4_hwarm900_w2": dict(overlap="none", codec="int4", wc="int2",
                                    flags=["--diloco-x-warmup-local-steps", "10", "--diloco-x-warmup-iters", "900"],
                                    **_O),
}
#: The package default (``--diloco-x`` alone) at whatever H the run uses: no copy of its settings
#: (``tests/test_convergence_jobs.py::test_the_default_method_is_the_package_default``).
DEFAULT_METHOD = "default"
#: The rows that measured the package default at H = 30 over 3000 steps before the harness ran
#: ``--diloco-x`` alone (the same resolved flags at that H; RESULTS §2.1)
MEASURED_AS_DEFAULT = ("partial_auto_int4_hwarm900_wtau1_w2",)
#: RESULTS §2.1's headline rows: the default ``--methods``, and the curves of the plot's left panel
HEADLINE_METHODS = ("allreduce", DEFAULT_METHOD, "diloco_int4_hwarm900_w2", "partial_auto_int4", "diloco_int4")
#: The link the auto tau and the adaptive byte budget are sized for (Mbit/s): the issue's 1 Gbit.
LINK_MBPS = 1000
_PARAMS = re.compile(r"number of parameters on \([^)]*\) model parallel rank \([^)]*\): (\d+)")


def communicates(method: dict) -> bool:
    """Whether a method definition (an entry of :data:`METHODS`) is DiLoCo(X): R replicas joined by
    the outer groups (else one world: allreduce, single)."""
    return "overlap" in method or bool(method.get("default"))


def method_flags(name: str, replicas: int = REPLICAS) -> list[str]:
    m = METHODS[name]
    if not communicates(m):
        return ["--no-diloco-x", *m.get("flags", [])]
    if m.get("default"):  # H comes with the common flags (--local-steps)
        return ["--diloco-x", "--diloco-x-replicas", str(replicas), "--diloco-x-bandwidth-mbps", str(LINK_MBPS),
                *m.get("flags", [])]
    flags = ["--diloco-x", "--diloco-x-replicas", str(replicas), "--diloco-x-overlap", m["overlap"],
             "--diloco-x-compression", m["codec"], "--diloco-x-outer-lr", str(m["eta"]),
             "--diloco-x-outer-momentum", str(m["mu"])]
    named = [f for f in m.get("flags", []) if f.startswith("--diloco-x-warmup")]
    if not named:
        flags += ["--diloco-x-warmup-iters", "0"]  # the rows measured before the auto warm-up was the default
    elif m["overlap"] == "partial":  # tau_w: 0 in the rows measured before the warm-up overlapped (auto)
        flags += ["--diloco-x-warmup-overlap-steps", str(m.get("tau_w", 0))]
    if named and m["codec"] in BLOCKWISE:  # wc: the main codec in the rows measured before int2 warm-ups
        flags += ["--diloco-x-warmup-compression", m.get("wc", m["codec"])]
    if "tau" in m:
        flags += ["--diloco-x-overlap-steps", str(m["tau"]), "--diloco-x-merge", m.get("merge", "exact")]
    if m["codec"] == "adaptive" or m.get("tau") == "auto":
        flags += ["--diloco-x-bandwidth-mbps", str(LINK_MBPS)]
    if "E" in m:
        flags += ["--diloco-x-energy", str(m["E"])]
    if "H" in m:
        flags += ["--diloco-x-local-steps", str(m["H"])]
    return flags + m.get("flags", [])  # Megatron flags of the method: after the common ones, so they win


def run_args(name: str, seed: int, a: argparse.Namespace, data: str) -> tuple[list[str], list[str]]:
    """The example's flags of method ``name`` at ``seed``: (those every method shares, all). All: the shared
    ones (with ``--call-s`` the run's checkpoint), the world's global batch (all R replicas' samples, but
    for a replica in a world of its own) and the method's (last: its Megatron flags win)."""
    method = METHODS[name]
    common = [*(CPU_MODEL if a.cpu_smoke else MODELS[getattr(a, "model", "85M")]),
              *(FAST_PATH if getattr(a, "fast_path", False) else []),
              "--micro-batch-size", str(a.micro_batch),
              *(["--eval-iters", str(a.eval_iters)] if a.eval_iters else []),
              "--train-iters", str(a.steps), "--eval-interval", str(a.eval_interval),
              "--seed", str(seed), "--data-path", data, "--split", "98,1,1",
              "--diloco-x-local-steps", str(a.local_steps), "--lr-decay-style", "cosine",
              *(["--distributed-backend", "gloo"] if a.cpu_smoke else [])]
    if a.call_s is not None:
        common += checkpoint_flags(a.out / f"{name}_seed{seed}", a.steps, load_rng=not a.cpu_smoke)
    replicas = a.replicas if a.one_world or not (communicates(method) or method.get("alone")) else 1
    return common, [*common, "--global-batch-size", str(a.micro_batch * a.accum * replicas),
                    *method_flags(name, a.replicas)]


def job_for(name: str, seed: int, a: argparse.Namespace, data: str, call: Call | None = None) -> Job | ExampleJob:
    """The run of method ``name`` at ``seed``: R single-rank worlds sharing one GPU (DiLoCo), one
    world of one rank (allreduce, single); with ``a.one_world``, one ``torchrun`` world of R ranks on R
    GPUs over NCCL (DiLoCo: one rank per replica; allreduce: data parallelism over the R ranks).
    ``call``: its launch in that call of continued runs (``--call-s``: it checkpoints, so one world)."""
    run, method = f"{name}_seed{seed}", METHODS[name]
    if a.one_world and method.get("alone"):
        raise SystemExit(f"--one-world: method {name!r} is one replica alone; run it without --one-world")
    if call is not None and communicates(method) and not a.one_world:  # (arguments.py refuses them a save)
        raise SystemExit(f"--call-s: {name!r} runs R separate worlds joined by --diloco-x-outer-store, which "
                         "cannot save or load a checkpoint; continue it as one world of R ranks: add --one-world")
    common, args = run_args(name, seed, a, data)
    job, estimate_s, timeout_s, env = run, a.estimate_s, a.timeout_s, None
    if call is not None:
        job, args, estimate_s, timeout_s = call.job_name(run), [*args, *call.flags()], call.run_s, call.timeout_s
        env = call.env()
    if a.one_world:
        return ExampleJob(job, args, a.replicas, env=env or {}, estimate_s=estimate_s, timeout_s=timeout_s,
                          record=["losses"], meta={"method": method, "common": common})
    return replica_worlds_job(job, a.out, args, a.replicas if communicates(method) else 1, ["losses"],
                              diloco=communicates(method), env=env, estimate_s=estimate_s, timeout_s=timeout_s,
                              fingerprint={"method": method, "common": common})


# --- analysis -------------------------------------------------------------------------------------

def analyze(d: Path, tokens_per_step: int) -> dict:
    """One run folder: validation curve (mean over the replicas' halves), final loss, bytes. The
    logs: ``replica{r}.log`` of R separate worlds, or one world's ``log.txt`` (``--one-world``: its
    last rank prints Megatron's evaluations); of a run continued across calls, each log is the calls'
    logs of that name in call order (``DIR/<run>/call<k>/``). The summary is the last call's: rounds and
    bytes of the whole run (checkpointed) but for an exchange in flight at a save, which no call counts;
    wall seconds of that call."""
    calls = call_dirs(d)
    names = sorted({p.name for c in calls for p in c.glob("replica*.log")}) or \
        sorted({p.name for c in calls for p in c.glob("log.txt")})
    per_log = []
    for name in names:
        text = "".join((c / name).read_text(errors="replace") for c in calls if (c / name).exists())
        curve, final = {}, None
        for mt in VALIDATION_LINE.finditer(text):
            if mt[2]:
                final = float(mt[3])
            else:
                curve[int(mt[1])] = float(mt[3])
        params = _PARAMS.search(text)
        per_log.append({"curve": curve, "final": final, "summary": (parse_summaries(text) or [None])[-1],
                        "params": int(params[1]) if params else None})
    if not per_log:
        return {"error": "no logs"}
    its = sorted(set.intersection(*(set(p["curve"]) for p in per_log)))
    curve = [[it * tokens_per_step, statistics.mean(p["curve"][it] for p in per_log)] for it in its]
    finals = [p["final"] for p in per_log]
    info = last_done(d) or {}
    out = {"ok": bool(info.get("ok")), "params": per_log[0]["params"],
           "final_val_loss": statistics.mean(finals) if all(f is not None for f in finals) else None,
           "final_val_loss_per_log": finals,
           "curve": curve, "last_iteration": its[-1] if its else 0}
    s = per_log[0]["summary"]
    if s:
        out.update(bytes_total=s["bytes_sent_per_rank"], rounds=s["rounds"],
                   replicas_identical=all(p["summary"] and p["summary"]["replicas_identical"] for p in per_log),
                   exposed_comm_s=s["exposed_comm_s"], train_wall_s=s["train_wall_s"],
                   compression_ratio=s.get("compression_ratio"), last_overlap_steps=s.get("last_overlap_steps"))
    return out


def _canonical(m: dict) -> dict:
    """A method definition as :data:`METHODS` writes it today: runs launched at 1d9f745-7ed5dad gave
    tau_w as a flag (``--diloco-x-warmup-overlap-steps k``) rather than the ``tau_w`` key."""
    flags = list(m.get("flags", []))
    if "--diloco-x-warmup-overlap-steps" not in flags:
        return m
    i = flags.index("--diloco-x-warmup-overlap-steps")
    return {**m, "tau_w": int(flags[i + 1]), "flags": flags[:i] + flags[i + 2:]}


def report(dirs: list[Path], a: argparse.Namespace) -> dict:
    per_seed: dict[str, dict[int, dict]] = {}
    defs: dict[str, dict] = {}
    for d in dirs:
        for run in sorted(p for p in d.glob("*_seed*") if p.is_dir()):
            name, seed = run.name.rsplit("_seed", 1)
            # the definition the run was launched with (its done.json), else today's of that name
            m = (last_done(run) or {}).get("method", METHODS.get(name))
            if m is not None:
                m = _canonical(m)
                defs.setdefault(name, m)
                tokens_per_step = a.tokens_per_step // (a.replicas if m.get("alone") else 1)
                per_seed.setdefault(name, {})[int(seed)] = analyze(run, tokens_per_step)
    params = next((r["params"] for runs in per_seed.values() for r in runs.values() if r.get("params")), None)
    methods = {}
    for name, runs in per_seed.items():
        ok = {s: r for s, r in sorted(runs.items()) if r.get("final_val_loss") is not None}
        m = defs[name]
        kind = "alone" if m.get("alone") else "package default" if m.get("default") else "allreduce"
        row = {"overlap": m.get("overlap", kind), "codec": m.get("codec"), "tau": m.get("tau"),
               "merge": m.get("merge", "exact") if m.get("overlap") == "partial" else None,
               "warmup_overlap_steps": m.get("tau_w", 0) if m.get("overlap") == "partial" else None,
               "warmup_codec": m.get("wc"),  # the warm-up's exchanges' codec where it is not ``codec``
               "outer_lr": m.get("eta"), "outer_momentum": m.get("mu"),
               "local_steps": m.get("H", a.local_steps) if communicates(m) else None,
               "energy": m.get("E"),
               "final_val_loss_per_seed": [r["final_val_loss"] for r in ok.values()], "seeds": list(ok),
               # each replica's own evaluation (its half of the batches), per seed
               "final_val_loss_per_replica": [r["final_val_loss_per_log"] for r in ok.values()],
               "incomplete": {s: {"last_iteration": r.get("last_iteration"), "ok": r.get("ok"),
                                  "curve": r.get("curve")}
                              for s, r in runs.items() if s not in ok}}
        if ok:
            finals = row["final_val_loss_per_seed"]
            row["final_val_loss"] = statistics.mean(finals)
            if len(finals) > 1:
                row["seed_spread"] = max(finals) - min(finals)
            first = next(iter(ok.values()))
            row["curve"] = first["curve"]
            row["curve_per_seed"] = {str(s): r["curve"] for s, r in ok.items()}  # the plot's band over seeds
            if communicates(m):
                row["bytes_total"] = statistics.mean(r["bytes_total"] for r in ok.values())
                for k in ("rounds", "replicas_identical", "exposed_comm_s", "train_wall_s", "compression_ratio",
                          "last_overlap_steps"):
                    row[k] = first.get(k)
            elif m.get("alone"):
                row["bytes_total"] = 0.0
            elif params:
                row["bytes_total"] = a.steps * params * (a.replicas - 1) / a.replicas * (4 + 2)
        methods[name] = row
    ref = methods.get("allreduce", {})
    ran = {n: defs[n] for n, row in methods.items() if row.get("final_val_loss")}
    for name, row in methods.items():
        if not row.get("final_val_loss"):
            continue
        if ref.get("final_val_loss"):
            row["gap_vs_allreduce"], row["gap_vs_allreduce_seeds"] = paired_gap(row, ref)
            if row.get("bytes_total"):
                row["fewer_bytes_than_allreduce"] = ref.get("bytes_total", 0) / row["bytes_total"]
        for key, changes in REFERENCES.items():
            other = counterpart(name, ran, **changes)
            if other is not None:
                row[f"{key}_reference"] = other
                row[f"gap_vs_{key}"], row[f"gap_vs_{key}_seeds"] = paired_gap(row, methods[other])
    tokens = a.steps * a.tokens_per_step
    return {"regime": {"params": params, "tokens": tokens, "epochs": tokens / a.corpus_train_tokens
                       if a.corpus_train_tokens else None, "rounds": a.steps // a.local_steps,
                       "local_steps": a.local_steps, "replicas": a.replicas,
                       "seeds": sorted({s for r in per_seed.values() for s in r}),
                       "tokens_per_step": a.tokens_per_step, "corpus": a.corpus_desc,
                       "fast_path": FAST_PATH if getattr(a, "fast_path", False) else None,
                       "launch": f"one torchrun world of {a.replicas} ranks, one GPU each (NCCL)" if a.one_world
                       else "one single-rank world per replica, sharing one GPU"},
            "card": a.card, "default_method": a.default_method, "methods": methods}


def paired_gap(row: dict, ref: dict) -> tuple[float, list[int]]:
    """``row``'s final validation loss relative to ``ref``'s, minus 1, over the seeds both ran (a
    seed's data order and initialisation are shared by every method, so unpaired means would mix
    seed effects into the gap); over all seeds of each when they share none. Returns the gap and
    the seeds it is over (empty: unpaired)."""
    mine = dict(zip(row["seeds"], row["final_val_loss_per_seed"]))
    theirs = dict(zip(ref["seeds"], ref["final_val_loss_per_seed"]))
    common = sorted(set(mine) & set(theirs))
    if not common:
        return row["final_val_loss"] / ref["final_val_loss"] - 1, []
    return statistics.mean(mine[s] for s in common) / statistics.mean(theirs[s] for s in common) - 1, common


def counterpart(name: str, defs: dict[str, dict], **changes) -> str | None:
    """The method that ran whose definition is ``defs[name]`` with ``changes`` (a value of None drops
    the key): e.g. the blocking DiLoCo at the same codec and H of an overlapped rule (issue 12: "the
    default overlap rule within 1% of blocking DiLoCo at the same codec and H"), or the uncompressed
    run of a codec. None when it is ``name`` itself or did not run."""
    want = {k: v for k, v in {**defs[name], **changes}.items() if v is not None}
    for other, d in defs.items():
        if other != name and d == want:
            return other
    return None


#: What a row is judged against besides AllReduce: (JSON key, the changes to its definition).
REFERENCES = {"blocking": dict(overlap="none", tau=None, tau_w=None, merge=None, eta=1.0, mu=0.0),
              "uncompressed": dict(codec="none", E=None)}


def _tau(row: dict) -> str:
    """tau as configured; for ``auto`` also the tau of the last round (``auto (5)``)."""
    if row.get("tau") is None:
        return "-"
    return f"auto ({row.get('last_overlap_steps')})" if row["tau"] == "auto" else str(row["tau"])


def markdown_table(result: dict) -> str:
    """The RESULTS.md table: one row per method, best final loss first; gaps over the seeds both
    rows ran (:func:`paired_gap`)."""
    rows = ["| method | overlap | codec | tau | eta / mu | final val loss (per seed) | vs AllReduce | vs blocking, "
            "same codec | vs uncompressed | bytes/rank | fewer bytes | rounds |", "|---" * 12 + "|"]
    pct = lambda v: f"{100 * v:+.2f}%" if v is not None else "-"  # noqa: E731
    for name, r in sorted(result["methods"].items(), key=lambda kv: kv[1].get("final_val_loss") or 9):
        seeds = ", ".join(f"{v:.4f}" for v in r.get("final_val_loss_per_seed", []))
        final = f"**{r['final_val_loss']:.4f}** ({seeds})" if r.get("final_val_loss") else "incomplete"
        codec = r.get("codec") or "-"
        if r.get("warmup_codec"):
            codec += f" ({r['warmup_codec']} warm-up)"
        rows.append(f"| {name} | {r['overlap']} | {codec} | {_tau(r)} | "
                    f"{r.get('outer_lr', '-')} / {r.get('outer_momentum', '-')} | {final} | {pct(r.get('gap_vs_allreduce'))} | "
                    f"{pct(r.get('gap_vs_blocking'))} | {pct(r.get('gap_vs_uncompressed'))} | "
                    f"{r.get('bytes_total', 0) / 1e9:.2f} GB | "
                    f"{r.get('fewer_bytes_than_allreduce', 0):.0f}x | {r.get('rounds') or '-'} |")
    return "\n".join(rows)


def plot(result: dict, path: Path) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 5))
    # curves of the headline rows only (all when none of them was run): ~20 curves are unreadable
    headline = [n for n in (*HEADLINE_METHODS, *MEASURED_AS_DEFAULT) if n in result["methods"]] or \
        list(result["methods"])
    for name, row in sorted(result["methods"].items()):
        if row.get("curve") and name in headline:
            xs, ys = zip(*row["curve"])
            ax1.plot([x / 1e6 for x in xs], ys, label=name, lw=2.5 if name == "allreduce" else 1.2)
        if row.get("final_val_loss") and row.get("bytes_total"):
            main = name in headline
            ax2.scatter(row["bytes_total"] / 1e9, row["final_val_loss"], color=None if main else "0.6",
                        zorder=2 if main else 1)
            ax2.annotate(name, (row["bytes_total"] / 1e9, row["final_val_loss"]), fontsize=7 if main else 5,
                         color="black" if main else "0.45")
    ax1.set(xlabel="tokens (M)", ylabel="validation loss",
            title="validation loss vs tokens" + (" (headline rows)" if len(headline) < len(result["methods"]) else ""))
    ax1.set_ylim(top=min(3.0, ax1.get_ylim()[1]))
    ax1.legend(fontsize=7)
    ax2.set(xscale="log", xlabel="bytes sent per rank (GB)", ylabel="final validation loss",
            title="final loss vs bytes")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def continue_runs(runs: list[tuple[str, int]], a: argparse.Namespace, data: str) -> dict[str, dict]:
    """One call of continued runs (``--call-s``, ``harness/continued.py``): the runs (method, seed) not
    finished in ``a.out`` (no evaluation after training in their logs), each from its last checkpoint,
    all stopping within the call; the manifest written before and after. Returns the runner's
    ``{job: done info}`` of the launches."""
    manifest = Manifest(a.out)
    call = manifest.next_call(a.call_s - (time.monotonic() - _STARTED), a.exit_interval)
    jobs = {f"{n}_seed{s}": job_for(n, s, a, data, call) for n, s in runs}  # (refusals before any launch)
    finished = lambda d: analyze(d, 1).get("final_val_loss") is not None  # noqa: E731
    todo = manifest.begin(call, {f"{n}_seed{s}": (run_args(n, s, a, data)[1], a.steps) for n, s in runs}, finished)
    try:
        return run_jobs([jobs[r] for r in todo], a.out, parallel=a.parallel, budget_s=call.budget_s, resume=False,
                        jobs_per_gpu=a.jobs_per_gpu)
    finally:
        manifest.end(finished)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--methods", default=None,
                   help="comma-separated names of METHODS (default: the headline rows of benchmarks/RESULTS.md "
                        "§2.1; with --cpu-smoke, whose H is 4, allreduce,partial_auto_int4,diloco_int4)")
    p.add_argument("--seeds", default="1")
    p.add_argument("--steps", type=int, default=None, help="default 3000 (--cpu-smoke: 8)")
    p.add_argument("--local-steps", type=int, default=None, help=f"H, default {H} (--cpu-smoke: 4)")
    p.add_argument("--eval-interval", type=int, default=None, help="default 300 (--cpu-smoke: 4)")
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--eval-iters", type=int, default=None, help="validation micro-batches per evaluation")
    p.add_argument("--accum", type=int, default=1, help="micro-batches per replica per step")
    p.add_argument("--corpus-mb", type=int, default=None, help="default 40 (--cpu-smoke: 8)")
    p.add_argument("--parallel", type=int, default=8)
    p.add_argument("--jobs-per-gpu", type=int, default=3, help="runs sharing one GPU at a time")
    p.add_argument("--budget-s", type=float, default=None)
    p.add_argument("--estimate-s", type=float, default=400.0)
    p.add_argument("--timeout-s", type=float, default=None)
    p.add_argument("--default-method", default=DEFAULT_METHOD)
    p.add_argument("--report-only", action="store_true")
    p.add_argument("--from", dest="more", type=Path, nargs="*", default=[])
    p.add_argument("--cpu-smoke", action="store_true")
    p.add_argument("--card", default=None, help="report-only: the card the runs were measured on")
    p.add_argument("--replicas", type=int, default=REPLICAS,
                   help="R, the replicas of every DiLoCo run (AllReduce: data parallelism over R, as R x the batch); "
                        "without --one-world the R replicas share one GPU as separate worlds (R = 4 on one GPU: the "
                        "4-replica point without 4 GPUs)")
    p.add_argument("--one-world", action="store_true",
                   help="each run one torchrun world of R ranks on R GPUs (NCCL; the multi-GPU user's path)")
    p.add_argument("--call-s", type=float, default=None,
                   help="seconds this call may use, from its start: every run checkpoints, stops in time and is "
                        "continued by the next call of the same command (DIR/manifest.json; replaces --budget-s)")
    p.add_argument("--model", choices=sorted(MODELS), default="85M",
                   help="the GPT: 85M (12 x 768, the default) or 302M (24 x 1024); GPU runs only")
    p.add_argument("--fast-path", action="store_true",
                   help="train on the one-GPU fast path (RESULTS.md §9: SDPA, fused RoPE, loader workers); GPU only")
    p.add_argument("--exit-interval", type=int, default=None,
                   help="with --call-s: this call's runs also stop at a multiple of this iteration (a split by steps)")
    a = p.parse_args()
    if a.model != "85M" and a.cpu_smoke:
        p.error("--model: GPU runs only (--cpu-smoke trains its own small model)")
    if a.fast_path and a.cpu_smoke:
        p.error("--fast-path: GPU only (its fused RoPE needs a GPU); drop it with --cpu-smoke")
    if a.replicas < 2:
        p.error("--replicas: at least 2 (one replica alone is the method 'single')")
    if a.exit_interval is not None and a.call_s is None:
        p.error("--exit-interval: only with --call-s (it stops a continued run, which saves)")
    for key, full, smoke in (("steps", 3000, 8), ("local_steps", H, 4), ("eval_interval", 300, 4), ("corpus_mb", 40, 8)):
        if getattr(a, key) is None:  # given: kept, also with --cpu-smoke
            setattr(a, key, smoke if a.cpu_smoke else full)
    if a.methods is None:  # the warm-up rows' H0 10 does not fit the smoke's H 4
        a.methods = ("allreduce,partial_auto_int4,diloco_int4" if a.cpu_smoke else
                     ",".join(HEADLINE_METHODS))
    a.out = a.out.resolve()
    seq = 64 if a.cpu_smoke else 512
    a.tokens_per_step = a.replicas * a.micro_batch * a.accum * seq
    earlier = [json.loads(p.read_text())["regime"] for d in [a.out, *a.more]
               for p in [d / "convergence.json"] if p.exists()]
    if a.report_only and earlier:  # the corpus of the machine that ran them
        a.corpus_desc, a.corpus_train_tokens = earlier[0]["corpus"], earlier[0]["tokens"] / earlier[0]["epochs"]
    else:
        sys.path.insert(0, str(HERE.parent / "examples"))
        import stdlib_corpus

        data = stdlib_corpus.build_environment(a.corpus_mb)
        n_tokens = Path(f"{data}.bin").stat().st_size // 2  # uint16 byte tokens
        a.corpus_train_tokens = 0.98 * n_tokens
        a.corpus_desc = (f"environment corpus ({a.corpus_mb} MB cap): {n_tokens / 1e6:.1f}M byte tokens, "
                         "split 98/1/1 by document")
    if a.card is None:
        import torch

        a.card = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu (gloo)"
    launched: dict[str, dict] = {}
    if not a.report_only:
        names = [m.strip() for m in a.methods.split(",") if m.strip()]
        unknown = [n for n in names if n not in METHODS]
        if unknown:
            raise SystemExit(f"unknown method(s) {unknown}; choose among {', '.join(METHODS)}")
        runs = [(n, int(s)) for s in a.seeds.split(",") for n in names]
        if a.call_s is None:
            launched = run_jobs([job_for(n, s, a, data) for n, s in runs], a.out, parallel=a.parallel,
                                budget_s=a.budget_s, jobs_per_gpu=a.jobs_per_gpu)
        else:
            launched = continue_runs(runs, a, data)
    result = report([a.out, *a.more], a)
    a.out.mkdir(parents=True, exist_ok=True)  # --report-only into a new folder
    (a.out / "convergence.json").write_text(json.dumps(result, indent=1))
    plot(result, a.out / "convergence.png")
    print(markdown_table(result), flush=True)
    for name, row in sorted(result["methods"].items(), key=lambda kv: kv[1].get("final_val_loss") or 9):
        print(f"{name:24s} final {row.get('final_val_loss')} gap {row.get('gap_vs_allreduce')} "
              f"bytes {row.get('bytes_total')} fewer {row.get('fewer_bytes_than_allreduce')} "
              f"incomplete {row.get('incomplete')}", flush=True)
    failed = sorted(name for name, info in launched.items() if not info["ok"])
    if failed:  # the report is written; the exit status says that a launch of this invocation failed
        raise SystemExit(f"failed: {', '.join(failed)} (their logs: {a.out}/<run>/...); a continued run goes on from "
                         "its last checkpoint at the next call")


if __name__ == "__main__":
    main()
