"""The example script on 4 CPU ranks: proves the CPU shim (compat.cpu) carries Megatron's training path.

Each run launches ``examples/pretrain_gpt_diloco.py`` (the shim is process-wide) with a tiny model,
pipeline-parallel 2 x data-parallel 2, Megatron's partial distributed optimizer with 2 instances (the
topology DiLoCoX builds on) and WITHOUT DiLoCoX. The reference run is launched by torchrun, as a user
runs the example; the runs compared with it fork their ranks from the tests' pre-imported process
(``harness/zygote.py``), so the comparisons also hold across the two launchers. Megatron may exit 0
without training (e.g. an unloadable RNG state), so the tests count logged iterations instead of
trusting the exit code.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from harness.launch import launch, torchrun

SCRIPT = Path(__file__).resolve().parent.parent / "examples" / "pretrain_gpt_diloco.py"
TINY = """
    --no-diloco-x --num-layers 2 --hidden-size 64 --ffn-hidden-size 256 --num-attention-heads 2
    --seq-length 64 --max-position-embeddings 64 --micro-batch-size 2 --global-batch-size 8
    --train-iters 5 --lr-warmup-iters 1 --log-interval 1 --eval-iters 1
    --use-distributed-optimizer --num-distributed-optimizer-instances 2 --use-tp-pp-dp-mapping
""".split()
_ITERATION = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?lm loss: (\S+) \|.*?grad norm: (\S+) \|")
_VALIDATION = re.compile(r"on validation set \| lm loss value: (\S+) \|")


@dataclass
class Run:
    loss: dict[int, float] = field(default_factory=dict)  # iteration -> logged lm loss
    grad_norm: dict[int, float] = field(default_factory=dict)
    valid_loss: float | None = None


def run_example(*flags: str, out: Path | None = None, timeout: float = 240) -> Run:
    """Run the example on 4 ranks and parse its log. Fails on a non-zero exit. With ``out`` (a folder
    for the ranks' logs) the ranks are forked from the pre-imported process, else torchrun starts them."""
    if out is None:
        code, output = torchrun([SCRIPT, *TINY, *flags], timeout=timeout)
    else:
        out.mkdir(parents=True, exist_ok=True)
        code, output = launch(SCRIPT, [*TINY, *flags], out, nproc=4, timeout=timeout)
    assert code == 0, output[-6000:]
    run = Run()
    for m in _ITERATION.finditer(output):
        run.loss[int(m[1])], run.grad_norm[int(m[1])] = float(m[2]), float(m[3])
    if (m := _VALIDATION.search(output)) is not None:
        run.valid_loss = float(m[1])
    return run


@pytest.fixture(scope="module")
def reference() -> Run:
    return run_example()


def test_trains_pp2_dp2_partial_distributed_optimizer(reference):
    assert sorted(reference.loss) == [1, 2, 3, 4, 5]
    assert all(math.isfinite(v) for v in reference.loss.values())
    assert reference.loss[1] > 5.0  # ~ln(257): an untrained byte model
    assert reference.loss[5] < reference.loss[1]
    assert reference.valid_loss is not None and math.isfinite(reference.valid_loss)


def test_save_and_resume_torch_dist_matches_uninterrupted_run(reference, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    first = run_example("--exit-interval", "3", "--save", ckpt, "--save-interval", "100", out=tmp_path / "first")
    assert sorted(first.loss) == [1, 2, 3]
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "3"
    # The CPU shim's RNG tracker has no state to restore: resume with --no-load-rng.
    resumed = run_example("--load", ckpt, "--no-load-rng", out=tmp_path / "resumed")
    assert sorted(resumed.loss) == [4, 5]
    # Same parameters and optimizer state as the uninterrupted run (compat.distopt_resume).
    # (Megatron's first log line after a resume averages over 2 iterations: compare grad norms.)
    assert resumed.loss[4] == reference.loss[4]
    assert resumed.grad_norm == {k: reference.grad_norm[k] for k in (4, 5)}
    assert resumed.valid_loss == reference.valid_loss


def test_attention_sdpa_trains_as_the_local_spec(reference, tmp_path):
    """``--attention-sdpa`` (SDPA core attention, ``megatron_adapter/sdpa_attention.py``) on the same
    run: the same losses within fp32 rounding (the attention differs in summation order only)."""
    sdpa = run_example("--attention-sdpa", out=tmp_path)
    assert sorted(sdpa.loss) == sorted(reference.loss)
    for it, loss in reference.loss.items():
        assert sdpa.loss[it] == pytest.approx(loss, rel=1e-4), it
    assert sdpa.valid_loss == pytest.approx(reference.valid_loss, rel=1e-4)


def test_transformer_impl_picks_the_layers_and_te_is_refused_where_absent(monkeypatch):
    """``--transformer-impl transformer_engine`` builds Megatron's Transformer Engine spec (the example used to
    build local layers whatever the flag said), ``local`` the local or SDPA spec; without Transformer Engine
    installed the TE choice is refused naming the fix, before anything is built."""
    import argparse
    import importlib.util

    from megatron.core.models.gpt import gpt_layer_specs

    monkeypatch.syspath_prepend(str(SCRIPT.parent))  # (its stdlib_corpus beside it, as when run as a script)
    spec = importlib.util.spec_from_file_location("pretrain_gpt_diloco_under_test", SCRIPT)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    te = argparse.Namespace(transformer_impl="transformer_engine", attention_sdpa=False, normalization="RMSNorm")
    from megatron.core.extensions import transformer_engine as te_extension

    monkeypatch.setattr(te_extension, "HAVE_TE", False)  # (as on CPU; a GPU machine may have it)
    with pytest.raises(SystemExit, match="needs Transformer Engine.*give --transformer-impl local"):
        example.check_transformer_impl(te)
    example.check_transformer_impl(argparse.Namespace(transformer_impl="local"))
    monkeypatch.setattr(gpt_layer_specs, "get_gpt_layer_with_transformer_engine_spec", lambda **k: ("te", k))
    assert example.layer_spec(te) == ("te", {"qk_layernorm": False})
    local = example.layer_spec(argparse.Namespace(transformer_impl="local", attention_sdpa=False,
                                                  normalization="RMSNorm"))
    sdpa = example.layer_spec(argparse.Namespace(transformer_impl="local", attention_sdpa=True,
                                                 normalization="RMSNorm"))
    attention = [s.submodules.self_attention.submodules.core_attention for s in (local, sdpa)]
    assert attention[0] is not attention[1] and "te" not in (local, sdpa)
