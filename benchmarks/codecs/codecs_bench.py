"""Compression ratio and relative error of every pseudo-gradient codec on REAL pseudo-gradients.

    python benchmarks/codecs/codec_capture.py              # once: captures .cache/pseudograds/ (see there)
    python benchmarks/codecs/codecs_bench.py [--cache .cache/pseudograds] [--out benchmarks/results/codecs.json]

Single process. For every captured rank/round of replica 0 (one file = one pipeline stage's full
parameters), the flat fp32 bucket of the stage's parameters (``named_parameters`` order) and its
layout ``[(offset, shape)]`` are built, and each codec runs one round of ``codec.exchange`` with a
fresh codec (cold low-rank basis), a zero residual and a single-replica all-gather
(``t -> t.unsqueeze(0)``, R = 1). Reported per codec:

* ``compression_ratio`` = 4 N / payload bytes (``payload_bytes`` of the codec; the bytes that went
  through the all-gather are counted too and must agree);
* ``rel_error`` = ||decoded - delta|| / ||delta|| (fp64 norms over the whole bucket), per rank/round and
  the mean; ``rel_error_by_kind``: the same pooled over tensors of one kind (1-D norms, embedding, ...);
* ``error_feedback``: the same round's pseudo-gradient fed T times to one persistent codec (residual
  carried, low-rank basis warm-started): ``||sum sent - T delta|| / ||T delta||`` after t = 1..T;
* ``rel_error_R2``: two replicas (replica 0 and 1 of the same stage/round, two threads and an
  in-process all-gather), error of the decoded mean against the true mean of the two deltas.

``fp8`` runs on CUDA sm89+ only: skipped on this CPU benchmark (noted in the JSON).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import re
import sys
import threading
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from megatron_diloco.algorithm.compression import AdaptivePolicy, get_codec  # noqa: E402

#: (label, get_codec name, kwargs for get_codec, description)
CODEC_SPECS = [
    ("none", "none", {}, "exact fp32"),
    ("int8", "int8", {}, "blockwise absmax int8, 256 elements per fp32 scale"),
    ("int4", "int4", {}, "blockwise absmax int4, 256 elements per fp32 scale"),
    ("lowrank-r4", "lowrank", {"rank": 4}, "rank-4 fp32 factors; 1-D/small tensors raw fp32"),
    ("lowrank-r16", "lowrank", {"rank": 16}, "rank-16 fp32 factors; 1-D/small tensors raw fp32"),
    ("lowrank-int8-r4", "lowrank-int8", {"rank": 4}, "rank-4 int8 factors; 1-D/small tensors int8"),
    ("lowrank-int8-r16", "lowrank-int8", {"rank": 16}, "rank-16 int8 factors; 1-D/small tensors int8"),
    ("adaptive-e0.5", "adaptive", {"energy": 0.5}, "adaptive policy, energy target 0.5 (int8 factors)"),
    ("adaptive-e0.9", "adaptive", {"energy": 0.9}, "adaptive policy, energy target 0.9 (default)"),
    ("adaptive-e0.99", "adaptive", {"energy": 0.99}, "adaptive policy, energy target 0.99"),
]


def make_codec(name: str, kw: dict, layout):
    if name == "adaptive":
        return get_codec(name, layout, policy=AdaptivePolicy(energy_target=kw["energy"]))
    return get_codec(name, layout, **kw)


def kind_of(name: str, shape) -> str:
    if len(shape) < 2:
        return "1-D (norm weights)"
    for pat, kind in (("word_embeddings|output_layer", "embedding / output (384x192)"),
                      ("linear_qkv", "attn qkv (576x192)"), ("linear_proj", "attn proj (192x192)"),
                      ("linear_fc1", "mlp fc1 (768x192)"), ("linear_fc2", "mlp fc2 (192x768)")):
        if re.search(pat, name):
            return kind
    return "other 2-D"


def load(cache: Path):
    """{(round, replica, stage): (names, shapes, flat fp32 [N], layout, meta)}"""
    out = {}
    for f in sorted(cache.glob("round*_replica*_stage*.pt")):
        d = torch.load(f)
        names = list(d["delta"])
        tensors = [d["delta"][n].float().contiguous() for n in names]
        layout, off = [], 0
        for t in tensors:
            layout.append((off, tuple(t.shape)))
            off += t.numel()
        flat = torch.cat([t.reshape(-1) for t in tensors])  # (N,) fp32
        m = d["meta"]
        out[(m["round"], m["replica"], m["stage"])] = (names, [t.shape for t in tensors], flat, layout, m)
    return out


class CountingAllGather:
    """R = 1 all-gather (``[k] -> [1, k]``) that counts the bytes it was handed."""

    def __init__(self):
        self.bytes = 0
        self.calls = 0

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        self.bytes += t.numel() * t.element_size()
        self.calls += 1
        return t.unsqueeze(0)


class ThreadGroup:
    """In-process all-gather for R threads (one per simulated replica), rows in replica order.

    The threads take turns (one condition variable, held while computing, released only while
    waiting for the others' contributions): no two threads ever run torch kernels concurrently.
    """

    def __init__(self, r: int):
        self.r = r
        self.cv = threading.Condition()
        self.slots: dict[int, torch.Tensor] = {}
        self.generation = 0
        self.result: torch.Tensor | None = None
        self.failed = False

    def allgather(self, rank: int):
        def ag(t: torch.Tensor) -> torch.Tensor:  # called with self.cv held
            if self.failed:
                raise RuntimeError("another simulated replica failed")
            gen = self.generation
            self.slots[rank] = t.clone()
            if len(self.slots) == self.r:
                self.result = torch.stack([self.slots[i] for i in range(self.r)])  # (R, k)
                self.slots = {}
                self.generation += 1
                self.cv.notify_all()
            else:
                while self.generation == gen and not self.failed:
                    self.cv.wait()
                if self.failed:
                    raise RuntimeError("another simulated replica failed")
            return self.result.clone()
        return ag

    def agree(self, rank: int):
        ag = self.allgather(rank)
        return lambda t: ag(t).amax(dim=0)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in fp64."""
    b64 = b.double()
    den = float(b64.norm())
    return float((a.double() - b64).norm()) / den if den else 0.0


def one_round(label, name, kw, flat, layout):
    codec = make_codec(name, kw, layout)
    ag = CountingAllGather()
    residual = torch.zeros_like(flat)
    t0 = time.perf_counter()
    decoded = codec.exchange(residual, ag, pseudo_grad=flat).clone()
    dt = time.perf_counter() - t0
    payload = codec.payload_bytes(flat.numel()) if name in ("none", "int8", "int4") else codec.payload_bytes()
    extra = {}
    low = codec.lowrank if name == "adaptive" else codec if name.startswith("lowrank") else None
    if name == "adaptive":
        extra["plan"] = [c.rank if c.rank else c.fmt for c in codec.policy.plan]
    if low is not None:
        extra["ranks"] = {i: low.rank_of(i) for i in low.lowranked()}  # low-ranked tensor -> rank
    return decoded, residual, payload, ag, dt, extra


_SVALS: dict = {}


def svd_bound_sq(key, flat, layout, ranks: dict, err: torch.Tensor) -> float:
    """Squared error if every low-ranked tensor were sent as its best rank-r approximation (truncated
    SVD) and the others as the codec sent them: the floor of one low-rank round."""
    total = 0.0
    for i, (off, shape) in enumerate(layout):
        numel = math.prod(shape)
        if i in ranks:
            if (key, i) not in _SVALS:
                _SVALS[key, i] = torch.linalg.svdvals(flat[off: off + numel].view(shape[0], -1).double())
            total += float(_SVALS[key, i][ranks[i]:].square().sum())
        else:
            total += float(err[off: off + numel].square().sum())
    return total


def error_feedback_curve(name, kw, flat, layout, rounds: int) -> list[float]:
    """Feed ``flat`` ``rounds`` times to one codec; ||sum sent - t*delta|| / ||t*delta|| after each."""
    codec = make_codec(name, kw, layout)
    residual = torch.zeros_like(flat)
    sent = torch.zeros_like(flat, dtype=torch.float64)
    curve = []
    for t in range(1, rounds + 1):
        sent += codec.exchange(residual, CountingAllGather(), pseudo_grad=flat).double()
        curve.append(rel(sent, flat.double() * t))
    return curve


def two_replicas(name, kw, flats, layout) -> float:
    """Error of the decoded mean of R = len(flats) replicas against the true mean (threads)."""
    group = ThreadGroup(len(flats))
    outs: list = [None] * len(flats)
    errs: list = []

    def run(r):
        with group.cv:
            try:
                codec = make_codec(name, kw, layout)
                extra = {"agree": group.agree(r)} if name == "adaptive" else {}
                outs[r] = codec.exchange(torch.zeros_like(flats[r]), group.allgather(r), pseudo_grad=flats[r],
                                         **extra)
            except BaseException as e:  # noqa: BLE001
                errs.append(e)
                group.failed = True  # wake the others: they raise too
                group.cv.notify_all()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(len(flats))]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    if errs:
        raise errs[0]
    assert all(torch.equal(outs[0], o) for o in outs), f"{name}: replicas decoded different bits"
    mean = torch.stack([f.double() for f in flats]).mean(0)
    return rel(outs[0], mean)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cache", type=Path, default=REPO / ".cache" / "pseudograds")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "codecs.json")
    p.add_argument("--ef-rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", "0") or 0))
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    data = load(a.cache)
    if not data:
        raise SystemExit(f"no captured pseudo-gradients in {a.cache}: run benchmarks/codecs/codec_capture.py first")
    capture_meta = json.loads((a.cache / "meta.json").read_text()) if (a.cache / "meta.json").exists() else {}
    keys = sorted(k for k in data if k[1] == 0)  # replica 0: (round, 0, stage)
    rounds = sorted({k[0] for k in keys})
    t_start = time.perf_counter()

    results = {}
    for label, name, kw, desc in CODEC_SPECS:
        per, ef, r2 = [], {}, []
        kind_sq: dict[str, list[float]] = {}
        tot_err_sq = tot_ref_sq = 0.0
        for key in keys:
            names, shapes, flat, layout, meta = data[key]
            decoded, residual, payload, ag, dt, extra = one_round(label, name, kw, flat, layout)
            n = flat.numel()
            err = (decoded.double() - flat.double())
            # error feedback bookkeeping: what was sent + the new residual is exactly v (= delta here)
            ef_exact = rel(decoded + residual, flat)
            for (off, shape), nm in zip(layout, names):
                k = kind_of(nm, shape)
                s = kind_sq.setdefault(k, [0.0, 0.0])
                numel = math.prod(shape)
                s[0] += float(err[off: off + numel].square().sum())
                s[1] += float(flat[off: off + numel].double().square().sum())
            tot_err_sq += float(err.square().sum())
            tot_ref_sq += float(flat.double().square().sum())
            ranks = extra.pop("ranks", None)
            if ranks is not None:
                extra["lowranked_tensors"] = len(ranks)
                extra["rel_error_svd_floor"] = math.sqrt(svd_bound_sq(key, flat, layout, ranks, err)) / float(
                    flat.double().norm())
            per.append({
                "round": key[0], "stage": key[2], "numel": n, "payload_bytes": payload,
                "allgather_bytes": ag.bytes, "allgather_calls": ag.calls,
                "compression_ratio": 4 * n / payload, "rel_error": rel(decoded, flat),
                "sent_plus_residual_rel_error": ef_exact, "exchange_s": round(dt, 4), **extra,
            })
            if a.ef_rounds > 1:
                ef[f"round{key[0]}_stage{key[2]}"] = error_feedback_curve(name, kw, flat, layout, a.ef_rounds)
            pair = [(key[0], r, key[2]) for r in (0, 1)]
            if all(k in data for k in pair):
                r2.append(two_replicas(name, kw, [data[k][2] for k in pair], layout))
        payload_total = sum(x["payload_bytes"] for x in per)
        numel_total = sum(x["numel"] for x in per)
        entry = {
            "codec": name, "description": desc, **({"rank": kw["rank"]} if "rank" in kw else {}),
            **({"energy_target": kw["energy"]} if "energy" in kw else {}),
            "compression_ratio": sum(x["compression_ratio"] for x in per) / len(per),
            "rel_error": sum(x["rel_error"] for x in per) / len(per),
            "compression_ratio_pooled": 4 * numel_total / payload_total,
            "rel_error_pooled": math.sqrt(tot_err_sq / tot_ref_sq),
            "rel_error_by_round": {str(r): sum(x["rel_error"] for x in per if x["round"] == r)
                                   / sum(1 for x in per if x["round"] == r) for r in rounds},
            **({"rel_error_svd_floor": sum(x["rel_error_svd_floor"] for x in per) / len(per)}
               if "rel_error_svd_floor" in per[0] else {}),
            "bytes_per_round": sum(x["payload_bytes"] for x in per) / len(per),
            "rel_error_by_kind": {k: math.sqrt(v[0] / v[1]) if v[1] else 0.0 for k, v in sorted(kind_sq.items())},
            "per_rank_round": per,
        }
        if ef:
            entry["error_feedback"] = {
                "rounds_fed": a.ef_rounds,
                "cumulative_rel_error": ef,
                "mean_after_t": [sum(c[t] for c in ef.values()) / len(ef) for t in range(a.ef_rounds)],
            }
        if r2:
            entry["rel_error_R2"] = sum(r2) / len(r2)
        results[label] = entry
        print(f"{label:18s} ratio {entry['compression_ratio']:8.2f}x  rel_error {entry['rel_error']:.4f}  "
              f"(by round {', '.join(f'{r}: {v:.4f}' for r, v in entry['rel_error_by_round'].items())})  "
              f"svd-floor {entry.get('rel_error_svd_floor', float('nan')):.4f}  R2 {entry.get('rel_error_R2', float('nan')):.4f}  "
              f"EF@{a.ef_rounds} {entry['error_feedback']['mean_after_t'][-1] if ef else float('nan'):.4f}",
              flush=True)

    doc = {
        "benchmark": "codecs on real pseudo-gradients (benchmarks/codecs_bench.py)",
        "date": datetime.date.today().isoformat(),
        "machine": {"description": f"CPU only, {os.cpu_count()} cores, no GPU", "platform": platform.platform(),
                    "python": platform.python_version(), "torch": torch.__version__,
                    "torch_threads": torch.get_num_threads()},
        "model": ("demo GPT of examples/pretrain_gpt_diloco.py: byte-level, 4 layers, hidden 192, ffn 768, "
                  "4 heads, seq 256, vocab 384 (padded), tied embeddings, fp32; PP 2 x 2 DiLoCoX replicas "
                  "(4 ranks, CPU/gloo); ~0.96M parameters per stage"),
        "capture": {"command": capture_meta.get("command"), "rounds": rounds,
                    "local_steps": (capture_meta.get("summary") or {}).get("local_steps"),
                    "overlap": (capture_meta.get("summary") or {}).get("overlap"),
                    "first_loss": (capture_meta.get("summary") or {}).get("first_loss"),
                    "final_loss": (capture_meta.get("summary") or {}).get("final_loss"),
                    "buckets": [{"round": k[0], "stage": k[2], "numel": data[k][2].numel(),
                                 "tensors": len(data[k][0]), "delta_norm": data[k][4]["delta_norm"]}
                                for k in keys]},
        "method": {
            "bucket": "per rank: flat fp32 concatenation of the stage's named_parameters, layout [(offset, shape)]",
            "round": "one codec.exchange, fresh codec (cold low-rank basis), zero residual, R=1 all-gather",
            "compression_ratio": "4*N / payload_bytes, mean over rank/rounds (pooled: total bytes)",
            "rel_error": "||decoded - delta|| / ||delta||, fp64 norms, mean over rank/rounds (pooled: over all)",
            "error_feedback": "same delta fed T times to one codec: ||sum sent - T delta|| / ||T delta|| after t",
            "rel_error_svd_floor": "low-rank codecs: the error had every low-ranked tensor been sent as its "
                                   "truncated SVD of the same rank (other tensors as sent): the one-round floor",
            "exchange_s": "wall time of one R=1 codec.exchange (pure-torch reference on CPU); indicative only: "
                          "the 2-core machine was shared with other jobs",
            "payload_bytes": "codec.payload_bytes(); allgather_bytes = what actually went through the all-gather",
            "rel_error_R2": "replicas 0 and 1 of the same stage/round exchanged together (threads); error of "
                            "the decoded mean vs the true mean",
        },
        "skipped": {"fp8": "CUDA sm89+ only (BlockwiseCodec refuses CPU buckets); not measured on this CPU machine"},
        "bench_wall_s": round(time.perf_counter() - t_start, 1),
        "codecs": results,
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {a.out} ({doc['bench_wall_s']} s)")


if __name__ == "__main__":
    main()
