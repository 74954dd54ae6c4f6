"""The join handshake of separately launched replicas (``megatron_diloco.megatron_adapter.handshake``): what must agree
is compared, what may differ is not, and a difference is refused by every launch over a real TCP
store, naming the flag and both values. (Two real Megatron launches refused:
``tests/test_separate_worlds.py::test_launches_that_disagree_are_refused_before_training``.)"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import datetime

import pytest
import torch.distributed as dist

from harness.runner import free_port
from megatron_diloco.algorithm.config import DiLoCoXConfig
from megatron_diloco.megatron_adapter.handshake import (BY_NAME, describe_launch, differences, join_launches,
                                                       shard_digest)

#: per rank of a 2-rank launch: (param shape, start, size) of its fp32 main shards
LAYOUT = [[((64, 32), 0, 1024), ((64,), 0, 32)], [((64, 32), 1024, 1024), ((64,), 32, 32)]]


def _args(**overrides) -> argparse.Namespace:
    base = dict(world_size=2, tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                virtual_pipeline_model_parallel_size=None, context_parallel_size=1, data_parallel_size=2,
                train_iters=8, train_samples=None, global_batch_size=4, micro_batch_size=2,
                rampup_batch_size=None, seq_length=64, seed=1234, optimizer="adam", lr=3e-4, min_lr=0.0,
                lr_decay_style="linear", lr_decay_iters=None, lr_warmup_iters=2, lr_warmup_fraction=None,
                lr_warmup_init=0.0, weight_decay=0.01, clip_grad=1.0, adam_beta1=0.9, adam_beta2=0.999,
                adam_eps=1e-8, sgd_momentum=0.9, num_layers=2, hidden_size=64, ffn_hidden_size=256,
                num_attention_heads=2, num_query_groups=None, kv_channels=32, max_position_embeddings=64,
                padded_vocab_size=128)
    return argparse.Namespace(**{**base, **overrides})


def _describe(config: DiLoCoXConfig | None = None, layout=LAYOUT, **args) -> dict:
    config = config or DiLoCoXConfig(local_steps=4, compression="int8")
    return describe_launch(_args(**args), config, [shard_digest(rank) for rank in layout], "0.19.2")


CFG = DiLoCoXConfig(local_steps=4, compression="int8", outer_lr=0.7)


@pytest.mark.parametrize("theirs, phrase", [
    (dict(config=dataclasses.replace(CFG, compression="fp8")),
     '--diloco-x-compression is int8 here, fp8 in replica 1'),
    (dict(config=dataclasses.replace(CFG, outer_lr=1.0)), "--diloco-x-outer-lr is 0.7 here, 1.0 in replica 1"),
    (dict(config=dataclasses.replace(CFG, local_steps=5)), "--diloco-x-local-steps is 4 here, 5 in replica 1"),
    (dict(config=dataclasses.replace(CFG, local_steps=30, local_steps_auto=True)),
     "--diloco-x-local-steps is 4 here, auto in replica 1"),
    (dict(config=dataclasses.replace(CFG, nesterov=False)), "--diloco-x-no-nesterov is off here, on in replica 1"),
    (dict(config=dataclasses.replace(CFG, warmup_local_steps=2, warmup_iters=4)),
     "--diloco-x-warmup-iters is 0 here, 4 in replica 1"),
    (dict(train_iters=10), "--train-iters is 8 here, 10 in replica 1"),
    (dict(global_batch_size=8), "--global-batch-size is 4 here, 8 in replica 1"),
    (dict(tensor_model_parallel_size=2, data_parallel_size=1),
     "--tensor-model-parallel-size is 1 here, 2 in replica 1"),
    (dict(layout=[LAYOUT[0], [((64, 32), 1024, 1000), ((64,), 32, 32)]]),
     "fp32 main shards of rank 1: 1056 elements here, 1032 in replica 1"),
    (dict(layout=[LAYOUT[0], [((64, 32), 1000, 1024), ((64,), 32, 32)]]),
     "fp32 main shards of rank 1: 1056 elements on both, cut differently"),
], ids=["codec", "outer-lr", "H", "H-auto", "nesterov", "warmup", "train-iters", "global-batch", "layout", "shard-size",
        "shard-cut"])
def test_a_difference_names_the_flag_and_both_values(theirs, phrase):
    mine = _describe(CFG)
    found = differences(mine, _describe(**{"config": CFG, **theirs}), 1)
    assert any(phrase in f for f in found), found
    # the other launch states the same difference from its side
    back = differences(_describe(**{"config": CFG, **theirs}), mine, 0)
    assert len(back) == len(found) and back


def test_auto_h_and_its_starting_value_differ():
    """``--diloco-x-local-steps auto`` starts at H 30, but a launch with a fixed 30 is another schedule
    (auto changes H at its boundaries): refused, naming both."""
    fixed = dataclasses.replace(CFG, local_steps=30)
    found = differences(_describe(fixed), _describe(dataclasses.replace(fixed, local_steps_auto=True)), 1)
    assert any("--diloco-x-local-steps is 30 here, auto in replica 1" in f for f in found), found


def test_what_may_differ_or_is_unused_is_not_compared():
    """The outer state's place and chunking, timeouts and the given bandwidth are per launch (same bits,
    or agreed at run time); the low-rank rank and the adaptive energy matter only to their codecs."""
    other = dataclasses.replace(CFG, outer_state="host", outer_chunk_mb=4.0, outer_timeout_minutes=30.0,
                                distributed_timeout_minutes=20.0, bandwidth_mbps=100.0, rank=8, energy=0.5)
    assert differences(_describe(CFG), _describe(other), 1) == []
    lowrank = dataclasses.replace(CFG, compression="lowrank")
    assert "--diloco-x-rank is 4 here, 8 in replica 1" in differences(
        _describe(lowrank), _describe(dataclasses.replace(lowrank, rank=8)), 1)


def test_separate_jobs_may_differ_in_global_batch_given_iterations():
    """Jobs of a run (--diloco-x-lighthouse) may each have their own global batch (the mean weighs them by
    tokens) when the run is given in iterations; launches of one run may not, nor jobs of a run given in
    samples (their iterations, hence their rounds, would differ)."""
    def jobs(**args) -> dict:
        return describe_launch(_args(**args), CFG, [shard_digest(rank) for rank in LAYOUT], "0.19.2", True)

    assert differences(jobs(), jobs(global_batch_size=8), 1) == []
    found = differences(jobs(train_iters=None, train_samples=64),
                        jobs(train_iters=None, train_samples=64, global_batch_size=8), 1)
    assert found == ["--global-batch-size is 4 here, 8 in replica 1"], found
    assert differences(_describe(CFG), _describe(CFG, global_batch_size=8), 1) == [
        "--global-batch-size is 4 here, 8 in replica 1"]
    label = "--micro-batch-size (or, where the sites' differ, --diloco-x-data-micro-batch)"
    assert differences(jobs(), jobs(micro_batch_size=1), 1) == [f"{label} is 2 here, 1 in replica 1"]
    # sites of different micro-batch deal the samples in the same one (data_split): 2 here, 4 there, both in 2
    assert differences(jobs(), jobs(micro_batch_size=4, diloco_x_data_micro_batch=2), 1) == []
    assert differences(jobs(micro_batch_size=4, diloco_x_data_micro_batch=4),
                       jobs(micro_batch_size=4, diloco_x_data_micro_batch=2), 1) == [f"{label} is 4 here, 2 in replica 1"]


def test_separate_jobs_may_differ_in_round_lengths_with_the_same_rounds():
    """Jobs given in iterations may each have their own H, warm-up and --train-iters (a faster site runs more
    inner steps per round) when their rounds agree: the warm-up's, the run's (a shorter last round included) and
    the LR schedule as shares of the run. Anything else is refused, naming the rounds on both sides."""
    def jobs(config=CFG, **args) -> dict:
        return describe_launch(_args(**args), config, [shard_digest(rank) for rank in LAYOUT], "0.19.2", True)

    warm = dataclasses.replace(CFG, warmup_local_steps=2, warmup_iters=4)  # 2 warm-up rounds, then H 4
    double = dataclasses.replace(CFG, local_steps=8, warmup_local_steps=4, warmup_iters=8, warmup_overlap_steps=1)
    assert differences(jobs(warm, train_iters=12), jobs(double, train_iters=24, lr_warmup_iters=4), 1) == []
    assert differences(jobs(warm, train_iters=12), jobs(double, train_iters=20, lr_warmup_iters=4), 1) == [
        "rounds of the run (--train-iters over --diloco-x-local-steps, after the warm-up) is 4 here, 3 and a "
        "shorter last one in replica 1",
        "--lr-warmup-iters / --train-iters is 1/6 here, 1/5 in replica 1"]
    found = differences(jobs(warm, train_iters=12), jobs(dataclasses.replace(double, warmup_iters=4), train_iters=20,
                                                           lr_warmup_iters=4), 1)
    assert "warm-up rounds (--diloco-x-warmup-iters / --diloco-x-warmup-local-steps) is 2 here, 1 in replica 1" in found
    # launches of one world, and jobs given in samples, still compare the flags themselves
    assert "--diloco-x-local-steps is 4 here, 8 in replica 1" in differences(
        _describe(warm, train_iters=12), _describe(double, train_iters=24, lr_warmup_iters=4), 1)


def test_paced_jobs_share_the_runs_rounds_and_may_differ_in_global_batch():
    """With --diloco-x-site-pace the flags are the run's rounds (each job runs its own steps of them at run time):
    the jobs may differ in their global batch only; their H, warm-up, --train-iters and LR iterations, and the
    pace itself, are compared as flags."""
    def jobs(config, **args) -> dict:
        return describe_launch(_args(**args), config, [shard_digest(rank) for rank in LAYOUT], "0.19.2", True)

    paced = dataclasses.replace(CFG, warmup_local_steps=2, warmup_iters=4, site_pace=4.0)
    assert differences(jobs(paced, train_iters=12), jobs(paced, train_iters=12, global_batch_size=8), 1) == []
    double = dataclasses.replace(paced, local_steps=8, warmup_local_steps=4, warmup_iters=8)
    found = differences(jobs(paced, train_iters=12), jobs(double, train_iters=24), 1)
    assert {"--diloco-x-local-steps is 4 here, 8 in replica 1", "--train-iters is 12 here, 24 in replica 1"} <= set(
        found), found
    unpaced = dataclasses.replace(paced, site_pace=None)
    found = differences(jobs(paced, train_iters=12), jobs(unpaced, train_iters=12), 1)
    assert found[0] == "--diloco-x-site-pace is 4.0 here, unset in replica 1", found  # (named first)
    normalized = dataclasses.replace(paced, site_weights="normalized")  # (the decision's slots follow it)
    found = differences(jobs(paced, train_iters=12), jobs(normalized, train_iters=12), 1)
    assert found == ["--diloco-x-site-weights is tokens here, normalized in replica 1"], found


_STORES: list = []  # the launches' stores stay up as a run keeps them (the host's going away ends the others' reads)


def _join(address: str, replica: int, description: dict, replicas: int = 2):
    """One launch of one rank: its store client (replica 0 hosts it), then the handshake."""
    host, port = address.split(":")
    store = dist.TCPStore(host, int(port), replicas, is_master=replica == 0,
                          timeout=datetime.timedelta(seconds=30), wait_for_workers=False)
    _STORES.append(store)
    try:
        join_launches(store, replica, replicas, 0, description, address, timeout_s=30)
        return None
    except ValueError as err:
        return str(err)


def test_launches_that_disagree_refuse_alike_through_the_store():
    """Two launches (threads, each its store client, replica 0 hosting it) with different codecs:
    both refuse, each naming the flag, its own value and the other's; agreeing launches join."""
    address = f"127.0.0.1:{free_port()}"
    # launches of one rank each (the store's host waits for as many reads as the launches have ranks)
    mine = _describe(CFG, layout=LAYOUT[:1], world_size=1, data_parallel_size=1)
    theirs = _describe(dataclasses.replace(CFG, compression="int4"), layout=LAYOUT[:1], world_size=1,
                       data_parallel_size=1)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        errors = list(pool.map(lambda r: _join(address, r, [mine, theirs][r]), range(2)))
    assert errors[0] is not None and errors[1] is not None, errors
    assert '--diloco-x-compression is int8 here, int4 in replica 1' in errors[0], errors[0]
    assert '--diloco-x-compression is int4 here, int8 in replica 0' in errors[1], errors[1]
    assert "--diloco-x-replica-index 1 of --diloco-x-replicas 2" in errors[1]

    address = f"127.0.0.1:{free_port()}"
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        assert list(pool.map(lambda r: _join(address, r, mine), range(2))) == [None, None]


def test_megatron_version_keeps_a_checkouts_commit_only(tmp_path):
    """megatron-core appends the hash of whatever git repository holds its files: a Megatron-LM checkout's
    commit is kept (launches of other Megatron code differ); the hash of an unrelated repository around a
    virtual environment (its own project's commit) is not, so two sites' wheels compare equal."""
    import types

    from megatron_diloco.megatron_adapter.integration import megatron_version

    def info(root, version):
        (root / "megatron" / "core").mkdir(parents=True)
        return types.SimpleNamespace(__version__=version, __file__=str(root / "megatron/core/package_info.py"))

    wheel = info(tmp_path / "site-packages", "0.19.2+3f0c1cb")
    checkout = info(tmp_path / "Megatron-LM", "0.19.2+5edf013")
    (tmp_path / "Megatron-LM" / ".git").mkdir()
    assert megatron_version(wheel) == "0.19.2"
    assert megatron_version(checkout) == "0.19.2+5edf013"
    assert megatron_version(info(tmp_path / "plain", "0.19.2")) == "0.19.2"


def test_the_documented_unequal_sites_have_the_same_rounds():
    """docs/federation.md's two sites (A twice as fast: twice B's H, its warm-up H0, --train-iters and LR iterations)
    describe the same rounds, 40 of which 30 of warm-up, as the handshake compares them; read from the page, so
    the example cannot drift from what a run accepts."""
    from pathlib import Path

    from megatron_diloco.megatron_adapter.arguments import add_diloco_x_args, config_from_args
    from megatron_diloco.megatron_adapter.handshake import describe_rounds

    page = (Path(__file__).resolve().parents[1] / "docs" / "federation.md").read_text()
    block = page.split("# site A\n", 1)[1].split("```", 1)[0]
    described = []
    for site in block.split("# site B\n"):
        words = site.replace("\\\n", " ").split()
        flags = {w: words[i + 1] for i, w in enumerate(words) if w.startswith("--")}
        own = ("--diloco-x-local-steps", "--diloco-x-warmup-local-steps")
        args = add_diloco_x_args(argparse.ArgumentParser()).parse_args(
            ["--diloco-x", *(t for f in own for t in (f, flags[f]))])
        args.train_iters, args.lr_warmup_iters, args.lr_decay_iters = (
            int(flags[f]) for f in ("--train-iters", "--lr-warmup-iters", "--lr-decay-iters"))
        described.append(describe_rounds(args, config_from_args(args)))
    a, b = described
    assert a == b, (a, b)
    assert list(a.values())[:2] == ["40", 30], a  # 40 rounds in all, the first 30 of the warm-up


def test_jobs_exchanging_by_name_may_differ_in_layout_not_in_the_parameters():
    """With ``--diloco-x-exchange-chunks`` jobs may differ in world size, TP, PP and DP (their chunks are the same
    vectors), not in the parameters' names and global shapes (the by-name digest) nor in the chunk count; without
    it a TP difference is refused naming the flag."""
    def jobs(digest: str = "table-1", **args) -> dict:
        return describe_launch(_args(**{"diloco_x_exchange_chunks": 4, **args}), CFG,
                               [shard_digest(r) for r in LAYOUT], "0.19.2", True, by_name=digest)

    other = dict(world_size=4, tensor_model_parallel_size=2, pipeline_model_parallel_size=2, data_parallel_size=1)
    assert differences(jobs(), jobs(**other), 1) == []
    assert differences(jobs(), jobs("table-2", **other), 1) == [
        f"{BY_NAME} is table-1 here, table-2 in replica 1"]
    assert differences(jobs(), jobs(diloco_x_exchange_chunks=8), 1) == [
        "--diloco-x-exchange-chunks is 4 here, 8 in replica 1", "--diloco-x-data-slots is 4 here, 8 in replica 1"]
    assert differences(jobs(diloco_x_data_slots=2), jobs(diloco_x_data_slots=2, **other), 1) == []
    assert differences(jobs(), jobs(diloco_x_data_slots=2), 1) == ["--diloco-x-data-slots is 4 here, 2 in replica 1"]
    plain = describe_launch(_args(), CFG, [shard_digest(r) for r in LAYOUT], "0.19.2", True)
    assert "--tensor-model-parallel-size is 1 here, 2 in replica 1" in differences(
        plain, describe_launch(_args(tensor_model_parallel_size=2, data_parallel_size=1), CFG,
                               [shard_digest(r) for r in LAYOUT], "0.19.2", True), 1)
