"""The planner's report: the projection as a table (:func:`format_table`), the ``--diloco-x*`` flags of
the run it projects (:func:`training_flags`), and the per-GPU memory with the outer state on the GPU
or on the host (:func:`outer_state_options`)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from megatron_diloco.plan.config import PlanConfig
from megatron_diloco.plan.model import Plan, plan
from megatron_diloco.plan.sites import BY_NAME_TRANSFER_GIB


def _fmt_bytes(b: float) -> str:
    for unit, k in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if b >= k:
            return f"{b / k:.3g} {unit}"
    return f"{b:.0f} B"


def _h(c: PlanConfig, p: Plan) -> str:
    """H as the report states it: the number, or ``auto -> N`` (what the run would choose)."""
    return f"auto -> {p.local_steps}" if c.local_steps == "auto" else str(p.local_steps)


def _fmt_s(s: float) -> str:
    if s >= 3600:
        return f"{s / 3600:.3g} h"
    if s >= 1:
        return f"{s:.4g} s"
    return f"{s * 1e3:.3g} ms"


def format_table(p: Plan) -> str:
    """A readable two-column table of the projection."""
    c = p.config
    m = p.memory_gib
    fits = "" if c.gpu_memory_gib is None else (
        f"  ({'fits' if m['total'] <= c.gpu_memory_gib else 'does NOT fit'} {c.gpu_memory_gib:g} GiB)")
    rows = [
        ("model", f"{p.params / 1e9:.4g} B params; {p.params_per_gpu / 1e9:.4g} B per GPU; "
                  f"outer shard {p.shard_params / 1e6:.4g} M per rank"),
        ("layout", f"{c.replicas} replicas x (TP {c.tp} x PP {c.pp} x DP {c.dp}) = "
                   f"{c.replicas * c.gpus_per_replica} GPUs; link {c.link_mbps:g} Mbit/s per {c.link_scope}"),
        ("memory / GPU, DiLoCoX", f"{m['total']:.2f} GiB = inner {m['inner']:.2f} (params {m['params']:.2f}, "
                                  f"grads {m['main_grads']:.2f}, optimizer {m['inner_optimizer']:.2f}) + outer "
                                  f"{m['outer']:.2f} + activations "
                                  + (f"{m['activations']:.2f}" if p.activations_estimated else "not estimated")
                                  + fits + f"; outer state on the {c.outer_state}"
                                  + (f" ({p.host_memory_gib:.2f} GiB host memory per GPU)"
                                     if c.outer_state == "host" else "")),
        ("memory / GPU, AllReduce job", f"{p.baseline_memory_gib:.2f} GiB"),
        ("inner step", _fmt_s(p.compute_step_s) + ("  (measured)" if c.step_time_s is not None else
                                                   f"  ({p.config.gpu_tflops:g} TFLOP/s per GPU)")),
        ("codec", f"{c.codec}, {p.compression_ratio:.4g}x vs fp32 ({p.ratio_source})"),
        ("exchange / round", f"{_fmt_bytes(p.bytes_sent_per_rank_per_round)} per rank, "
                             f"{_fmt_bytes(p.bytes_per_link_per_round)} per link -> {_fmt_s(p.exchange_s)}"),
        ("exposed / round", f"{_fmt_s(p.exposed_s)} ({c.overlap}; H = {_h(c, p)}, "
                            f"hidden from H = {p.min_hidden_local_steps}; run with --diloco-x-bandwidth-mbps "
                            f"{p.bandwidth_flag_mbps:.4g})"),
        ("round", f"{_fmt_s(p.round_s)} = {p.local_steps} x {_fmt_s(p.compute_step_s)} + boundary "
                  f"{_fmt_s(p.boundary_s)} + exposed"),
        ("warm-up (once)", "none" if not p.warmup[1] else
         f"{p.warmup[1]} steps in rounds of {p.warmup[0]}"
         + (f", tau_w {p.warmup_overlap_steps}" if c.overlap == "partial" else "")
         + (f", {p.warmup_codec} exchanges of {_fmt_s(p.warmup_exchange_s)}" if p.warmup_codec != c.codec else "")
         + f": {_fmt_s(p.warmup_exposed_s)} exposed in all"
         + (f" ({100 * p.warmup_share:.2g}% of the {c.train_iters}-step run's compute)" if p.warmup_share is not None
            else " (give --train-iters for its share of the run)")),
        ("AllReduce step", f"{_fmt_s(p.allreduce_step_s)} = compute + {_fmt_s(p.allreduce_comm_s)} comm "
                           f"({_fmt_bytes(p.allreduce_bytes_per_link_per_step)} per link, {c.baseline_algo})"),
        ("tokens/s", f"DiLoCoX {p.dilocox_tokens_per_s:,.0f}; AllReduce {p.allreduce_tokens_per_s:,.1f}"
                     + (" (replicas alike at the modelled step; the sites below)" if p.sites else "")),
        ("speedup vs AllReduce", f"{p.speedup_vs_allreduce:.1f}x"),
        *_site_rows(p),
    ]
    w = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{w}}  {v}" for k, v in rows)



def _site_rows(p: Plan) -> list[tuple[str, str]]:
    """``--sites``: one row per site, then each policy's round, tokens/s and idle share."""
    s = p.sites
    if s is None:
        return []
    sharded = p.memory_gib["inner_optimizer"] + p.memory_gib["outer"]  # (per GPU: scales with the site's shard)

    def memory(m: int) -> str:
        ratio = s.shard_ratio[m] if s.shard_ratio else 1.0
        if ratio == 1.0:
            return ""
        host = f", host {p.host_memory_gib * ratio:.1f} GiB" if p.host_memory_gib else ""
        return (f"; its GPUs: {ratio:g}x the shard per rank (--diloco-x-exchange-slots), "
                f"{p.memory_gib['total'] + sharded * (ratio - 1):.1f} GiB per GPU{host}")

    rows = [(f"site {m}", f"step {_fmt_s(t)}, alone {solo:,.0f} tokens/s; as given: idle "
                          f"{100 * s.equal_h.idle_fraction[m]:.1f}%, weight {s.equal_h.weights[m]:.3f}; balanced: "
                          f"{s.balanced_tokens_per_step[m]:,.0f} tokens per step, weight "
                          f"{s.balanced_batch.weights[m]:.3f}; H per site: --diloco-x-local-steps "
                          f"{s.per_site_h.local_steps[m]}, idle {100 * s.per_site_h.idle_fraction[m]:.1f}%{memory(m)}")
            for m, (t, solo) in enumerate(zip(s.step_s, s.solo_tokens_per_s))]
    g = p.config.gpus_per_replica
    staging = [4 * p.params * (s.shard_ratio[m] if s.shard_ratio else 1.0) / g / 2**30 for m in range(len(s.step_s))]
    rows.append(("exchange by name", "for sites of other TP / PP (--diloco-x-exchange-chunks) each GPU adds a staging "
                 "buffer, 4 B per parameter of its share: " + ", ".join(f"site {m} {gib:.2f} GiB" for m, gib in
                                                                      enumerate(staging))
                 + f", and up to {BY_NAME_TRANSFER_GIB:g} GiB while it pulls or pushes at a boundary; its parameters, "
                 "gradients and inner optimizer follow its own TP x PP"))
    for name, pol in (("sites as given (equal H)", s.equal_h),
                      ("sites, batch by speed", s.balanced_batch), ("sites, H per site", s.per_site_h)):
        rows.append((name, f"round {_fmt_s(pol.round_s)}, {pol.tokens_per_s:,.0f} tokens/s = "
                           f"{100 * pol.throughput_vs_solo_sum:.1f}% of the sites' solo sum; the fast site idle "
                           f"{100 * pol.fast_site_idle_fraction:.1f}%"))
    rows.append(("H per site, to run it", "give each site its --diloco-x-local-steps above, and its warm-up "
                 "(--diloco-x-warmup-local-steps, --diloco-x-warmup-iters), --train-iters and --lr-warmup-iters / "
                 "--lr-decay-iters in the same proportion: the jobs must have the same rounds (docs/federation.md)"))
    ratio = max(s.step_s) / min(s.step_s)  # the fastest site's steps per step of the slowest
    pace = min(16.0, math.ceil(10 * ratio) / 10)
    rows.append(("or H per site at run time", f"every site the same flags and --diloco-x-site-pace {pace:g} or more (the "
                 f"fastest site steps {ratio:.2f}x as often as the slowest): each runs the steps that fit the slowest "
                 "site's round, from the step times measured at every boundary"
                 + (" (16 is the most: the fastest site waits for the rest)" if ratio > 16 else "")))
    return rows


def training_flags(cfg: PlanConfig, p: Plan) -> str:
    """The ``--diloco-x*`` flags of the run this plan projects (the auto rules left to the run)."""
    flags = ["--diloco-x", f"--diloco-x-replicas {cfg.replicas}", f"--diloco-x-local-steps {cfg.local_steps}",
             f"--diloco-x-compression {cfg.codec}", f"--diloco-x-overlap {cfg.overlap}",
             f"--diloco-x-bandwidth-mbps {p.bandwidth_flag_mbps:g}"]
    if cfg.outer_momentum:
        flags.append(f"--diloco-x-outer-momentum {cfg.outer_momentum:g}")
    if cfg.outer_state != "device":
        flags.append(f"--diloco-x-outer-state {cfg.outer_state}")
    for name, flag in (("warmup_local_steps", "--diloco-x-warmup-local-steps"),
                       ("warmup_iters", "--diloco-x-warmup-iters"),
                       ("warmup_overlap_steps", "--diloco-x-warmup-overlap-steps"),
                       ("warmup_codec", "--diloco-x-warmup-compression")):
        if getattr(cfg, name) is not None:
            flags.append(f"{flag} {getattr(cfg, name)}")
    return " ".join(flags)


def outer_state_options(cfg: PlanConfig) -> list[dict[str, Any]]:
    """Per-GPU memory of ``cfg`` with the outer state on the GPU and on the host, and whether each fits
    ``gpu_memory_gib`` (None when it is not given): ``[{"outer_state", "gpu_gib", "host_gib", "fits"}]``."""
    out = []
    for where in ("device", "host"):
        p = plan(dataclasses.replace(cfg, outer_state=where))
        total = p.memory_gib["total"]
        out.append({"outer_state": where, "gpu_gib": total, "host_gib": p.host_memory_gib,
                    "host_gib_per_node": p.host_memory_gib * cfg.gpus_per_node,
                    "fits": None if cfg.gpu_memory_gib is None else total <= cfg.gpu_memory_gib})
    return out


def format_outer_state_options(cfg: PlanConfig, options: list[dict[str, Any]]) -> str:
    """The options of :func:`outer_state_options` as lines, ending with which layout fits."""
    lines = []
    for o in options:
        counted = "" if plan(cfg).activations_estimated else " (activations not counted: give --layers, --heads, ...)"
        fit = ("" if o["fits"] is None else
               f"  {'fits' if o['fits'] else 'does NOT fit'} {cfg.gpu_memory_gib:g} GiB{counted}")
        host = (f" + {o['host_gib']:.2f} GiB host ({o['host_gib_per_node']:.0f} GiB per {cfg.gpus_per_node}-GPU node)"
                if o["outer_state"] == "host" else "")
        lines.append(f"  --diloco-x-outer-state {o['outer_state']}: {o['gpu_gib']:.2f} GiB GPU{host}{fit}")
    if cfg.gpu_memory_gib is not None:
        fitting = [o["outer_state"] for o in options if o["fits"]]
        lines.append("  -> fits: " + (", ".join(f"outer state on the {w}" for w in fitting) if fitting else
                                       "neither layout (the inner state alone is "
                                       f"{plan(cfg).memory_gib['inner']:.2f} GiB; activations not counted)"))
    return "\n".join(lines)

