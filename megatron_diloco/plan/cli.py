"""The planner's command line: ``python -m megatron_diloco.plan [--preset NAME] [--json] [FLAGS] [-- TRAINING
FLAGS]``. One ``--flag`` per :class:`~megatron_diloco.plan.config.PlanConfig` field (its docstring is the
help); a pretraining command line after ``--`` is read by Megatron's and the package's own parsers
(:func:`from_training_command`)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
from typing import Any

from megatron_diloco.plan.config import PlanConfig, flag_name
from megatron_diloco.plan.model import plan
from megatron_diloco.plan.presets import PAPER_ASSUMPTIONS, PRESETS
from megatron_diloco.plan.report import format_outer_state_options, format_table, outer_state_options, training_flags

#: ``--help``'s description (the first paragraph of :mod:`megatron_diloco.plan`).
DESCRIPTION = ("Analytic projection of a DiLoCoX run: memory per GPU, time per step and per round, exchange and\n"
               "exposed time, and speedup over data-parallel AllReduce over the same slow link.")


def _field_docs() -> dict[str, str]:
    """The docstring under each PlanConfig field (first sentence), for ``--help``."""
    import ast
    import inspect

    body = ast.parse(inspect.getsource(PlanConfig)).body[0].body
    docs = {}
    for a, b in zip(body, body[1:]):
        if isinstance(a, ast.AnnAssign) and isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant):
            text = " ".join(str(b.value.value).split())
            text = re.sub(r":[a-z]+:`~?(?:[\w.]+\.)?([\w]+)`", r"\1", text).replace("``", "")  # no Sphinx markup
            docs[a.target.id] = text.replace("%", "%%")
    return docs


def build_parser() -> argparse.ArgumentParser:
    docs = _field_docs()
    p = argparse.ArgumentParser(prog="python -m megatron_diloco.plan", description=DESCRIPTION,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS), help="start from a preset (flags given override it)")
    p.add_argument("--json", action="store_true", help="print the projection as JSON")
    p.add_argument("training", nargs=argparse.REMAINDER, metavar="-- TRAINING FLAGS",
                   help="your pretraining command line after `--`: Megatron's model, batch and parallelism flags "
                        "and the --diloco-x* flags set the corresponding values (this tool's own flags, given "
                        "before `--`, override them); what it cannot know (--dp, --gpu-tflops or --step-time-s, "
                        "--link-mbps without --diloco-x-bandwidth-mbps) comes from this tool's flags")
    defaults = {f.name: f.default for f in dataclasses.fields(PlanConfig)}
    for f in dataclasses.fields(PlanConfig):
        flag = flag_name(f.name)
        doc = docs.get(f.name, "")
        default = defaults[f.name]
        doc = f"{doc} (default: {'not set' if default is None else default})" if doc else doc
        if f.type in ("bool",):
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=doc or None)
        else:
            conv = {"int": int, "int | None": int, "float | None": float, "float": float}.get(f.type, str)
            if f.name == "params":
                conv = lambda v: float(v)  # noqa: E731 (accepts 107e9)
            if f.name == "local_steps":
                conv = lambda v: v if v == "auto" else int(v)  # noqa: E731
            if f.name == "tokens_per_step":
                conv = lambda v: int(float(v))  # noqa: E731
            p.add_argument(flag, type=conv, default=None, help=doc or None)
    return p


def from_training_command(argv: list[str]) -> dict[str, Any]:
    """PlanConfig values from a pretraining command line: Megatron's own flags (parsed by Megatron's
    parser: the same names and defaults as your run) and the ``--diloco-x*`` flags (the package's
    parser). Only what the command line determines; flags Megatron does not know are ignored.
    Imports Megatron (a few seconds)."""
    from megatron.training.arguments import add_megatron_arguments

    from megatron_diloco import add_diloco_x_args

    parser = add_diloco_x_args(add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False)))
    a, _ = parser.parse_known_args([x for x in argv if x != "--"])
    auto = lambda v: None if v == "auto" else v  # noqa: E731 (the package's auto rules run in plan())
    values: dict[str, Any] = {
        "layers": a.num_layers, "hidden": a.hidden_size, "ffn_hidden": a.ffn_hidden_size,
        "heads": a.num_attention_heads, "seq_length": a.seq_length, "vocab": a.vocab_size,
        "micro_batch": a.micro_batch_size, "tp": a.tensor_model_parallel_size, "pp": a.pipeline_model_parallel_size,
        "train_iters": a.train_iters, "swiglu": bool(a.swiglu), "tied_embeddings": not a.untie_embeddings_and_output_weights,
        "recompute": a.recompute_granularity or "none", "param_bytes": 2 if (a.bf16 or a.fp16) else 4,
        "replicas": a.diloco_x_replicas, "local_steps": a.diloco_x_local_steps, "codec": a.diloco_x_compression,
        "overlap": a.diloco_x_overlap, "outer_momentum": a.diloco_x_outer_momentum,
        "outer_state": a.diloco_x_outer_state, "outer_chunk_mb": a.diloco_x_outer_chunk_mb,
        "rank": a.diloco_x_rank, "energy": a.diloco_x_energy,
        "warmup_local_steps": auto(a.diloco_x_warmup_local_steps), "warmup_iters": auto(a.diloco_x_warmup_iters),
        "warmup_overlap_steps": auto(a.diloco_x_warmup_overlap_steps),
        "warmup_codec": auto(a.diloco_x_warmup_compression),
    }
    if a.global_batch_size and a.seq_length:  # the replica's: --global-batch-size is the sum over replicas
        values["tokens_per_step"] = a.global_batch_size // a.diloco_x_replicas * a.seq_length
    if a.diloco_x_bandwidth_mbps is not None:  # the site's link, shared by the replica's ranks
        values.update(link_mbps=a.diloco_x_bandwidth_mbps, link_scope="cluster")
    return {k: v for k, v in values.items() if v is not None}


def config_from_args(args: argparse.Namespace) -> PlanConfig:
    """The PlanConfig of parsed CLI arguments: preset values, then the training command line's
    (after ``--``), overridden by this tool's flags given."""
    values = dict(PRESETS[args.preset]) if args.preset else {}
    if getattr(args, "training", None):
        values.update(from_training_command(args.training))
    for f in dataclasses.fields(PlanConfig):
        v = getattr(args, f.name)
        if v is not None:
            values[f.name] = v
    return PlanConfig(**values)



def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        cfg = config_from_args(args)
        p = plan(cfg)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    options = outer_state_options(cfg)
    if args.json:
        out = p.to_dict()
        out["outer_state_options"] = options
        out["training_flags"] = training_flags(cfg, p)
        if args.preset == "paper":
            out["assumptions"] = list(PAPER_ASSUMPTIONS)
        print(json.dumps(out, indent=1))
    else:
        print(format_table(p))
        print("\ntraining flags this plan implies:\n  " + training_flags(cfg, p))
        print("\nwhere the outer state lives (memory per GPU):")
        print(format_outer_state_options(cfg, options))
        if args.preset == "paper":
            bf16 = dataclasses.replace(cfg, grad_bytes=2)
            print("with bf16 main gradients (--grad-bytes 2; Megatron --grad-reduce-in-bf16):")
            print(format_outer_state_options(bf16, outer_state_options(bf16)))
            print("\nassumptions (not stated in the material available here):")
            print("\n".join(f"  - {a}" for a in PAPER_ASSUMPTIONS))
    return 0

