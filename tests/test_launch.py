"""``python -m megatron_diloco.launch``: DiLoCoX in a Megatron script that knows nothing about it.

The script written below is a plain Megatron-Core 0.19 pretraining script: it parses its flags with
``parse_and_validate_args()`` (no ``add_diloco_x_args``) and never calls ``install``. It borrows
the model, data and step functions of ``examples/pretrain_gpt_diloco.py`` (importing that module
applies the CPU shim, which the launcher has already applied: idempotent). Runs are torchrun
subprocesses on CPU: the shim is process-wide.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from harness.launch import REPO, TINY, torchrun
from harness.launch import launch as forked
from tests.megatron_utils import summary

LAUNCHER = REPO / "megatron_diloco" / "launch.py"

PLAIN_SCRIPT = f"""\
import sys

sys.path.insert(0, {str(REPO / "examples")!r})
from pretrain_gpt_diloco import forward_step, model_provider, train_valid_test_datasets_provider

from megatron.core.enums import ModelType
from megatron.training import pretrain
from megatron.training.argument_utils import pretrain_cfg_container_from_args
from megatron.training.arguments import parse_and_validate_args

if __name__ == "__main__":
    args = parse_and_validate_args()
    pretrain(pretrain_cfg_container_from_args(args), train_valid_test_datasets_provider,
             ModelType.encoder_or_decoder, forward_step, model_provider=model_provider)
"""

MEGATRON_FLAGS = TINY + """
    --transformer-impl local --mock-data --tokenizer-type NullTokenizer --vocab-size 256
    --use-distributed-optimizer --lr 1e-3 --num-workers 0
    --attention-dropout 0 --hidden-dropout 0 --no-gradient-accumulation-fusion
    --no-persist-layer-norm --no-masked-softmax-fusion --no-bias-dropout-fusion
    --no-bias-swiglu-fusion --no-rope-fusion
""".split()


def launch(script: Path, *flags: str, nproc: int, timeout: float = 300) -> tuple[int, str]:
    """``torchrun -m megatron_diloco.launch script flags`` from the script's folder: (exit status, output)."""
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    return torchrun(["-m", "megatron_diloco.launch", script, *flags], nproc, env, script.parent, timeout)


def launch_forked(script: Path, *flags: str, nproc: int) -> tuple[int, str]:
    """The launcher on ``script`` with its ranks forked from the tests' pre-imported process (the
    launcher's checks without torchrun's start-up; the run above covers torchrun)."""
    out = script.parent / "forked"
    out.mkdir(exist_ok=True)
    return forked(LAUNCHER, [script, *flags], out, nproc=nproc, timeout=240)


@pytest.fixture
def plain_script(tmp_path: Path) -> Path:
    script = tmp_path / "pretrain_plain.py"
    script.write_text(PLAIN_SCRIPT)
    assert "diloco" not in PLAIN_SCRIPT.replace("pretrain_gpt_diloco", "")
    return script


def test_unmodified_script_trains_with_diloco_x(plain_script):
    code, log = launch(plain_script, *MEGATRON_FLAGS, "--train-iters", "4", "--diloco-x", "--diloco-x-replicas", "2",
                       "--diloco-x-local-steps", "2", nproc=2)  # (2 replicas of 1 rank: torchrun's start-up is the cost)
    assert code == 0, log[-6000:]
    rounds = [line for line in log.splitlines() if line.startswith("[DiLoCoX] round")]
    assert len(rounds) == 2, log[-4000:]
    s = summary(log)
    assert s["rounds"] == 2
    assert s["iterations"] == 4
    assert s["replicas"] == 2 and s["local_steps"] == 2
    assert s["replicas_identical"] is True


@pytest.mark.parametrize("flags, named", [
    (["--diloco-x-local-steps", "0"], "--diloco-x-local-steps"),
    (["--diloco-x-replicas", "3"], "--diloco-x-replicas"),  # DP is 2
])
def test_bad_flag_fails_before_training(plain_script, flags, named):
    # 2 ranks, no pipeline: data-parallel size 2.
    code, log = launch_forked(plain_script, *MEGATRON_FLAGS, "--train-iters", "4", "--diloco-x", *flags, nproc=2)
    assert code != 0, log[-4000:]
    errors = [line for line in log.splitlines() if "megatron-diloco: error:" in line]
    assert errors and all(named in line for line in errors), log[-4000:]
    assert not re.search(r"iteration\s+\d+/\s*\d+ \|", log), log[-4000:]  # no step was logged
    assert "DILOCOX SUMMARY" not in log


def test_rope_fusion_without_a_kernel_fails_before_training(plain_script):
    """Megatron's default rope fusion, RoPE, no Transformer Engine, no GPU: the launcher names the fix."""
    flags = [f for f in MEGATRON_FLAGS if f != "--no-rope-fusion"]
    code, log = launch_forked(plain_script, *flags, "--position-embedding-type", "rope", "--train-iters", "4", nproc=1)
    assert code != 0, log[-4000:]
    errors = [line for line in log.splitlines() if "megatron-diloco: error:" in line]
    assert errors and all("--no-rope-fusion" in line for line in errors), log[-4000:]
    assert not re.search(r"iteration\s+\d+/\s*\d+ \|", log), log[-4000:]


def test_missing_script_is_a_clear_error(tmp_path):
    missing = tmp_path / "no_such_script.py"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, "-m", "megatron_diloco.launch", str(missing), "--diloco-x"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert "training script not found" in proc.stderr and str(missing) in proc.stderr


TEARDOWN_SCRIPT = """
import atexit, sys
import torch.distributed as dist
# registered first, so it runs last (atexit is LIFO): what the interpreter's own teardown would meet
atexit.register(lambda: print("groups at teardown:", dist.is_initialized(), flush=True))
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + sys.argv[2], rank=0, world_size=1)
dist.new_group(backend="gloo")  # like the outer groups and their gloo mirrors
from megatron_diloco.megatron_adapter.integration import destroy_process_groups_at_exit
if sys.argv[1] == "registered":
    destroy_process_groups_at_exit()
    destroy_process_groups_at_exit()  # install() and the example may both call it: once is enough
"""


@pytest.mark.parametrize("mode, left", [("registered", False), ("not registered", True)])
def test_process_groups_are_destroyed_at_exit(mode, left):
    """``destroy_process_groups_at_exit`` (registered by ``install``, so by the launcher, the example
    and a patched script) leaves no gloo group for the interpreter's teardown, where live gloo
    threads aborted finished runs now and then (SIGABRT, "terminate called without an active
    exception"); without it the groups are still there."""
    from harness.runner import free_port

    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, "-c", TEARDOWN_SCRIPT, mode, str(free_port())], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"groups at teardown: {left}" in proc.stdout, proc.stdout + proc.stderr[-3000:]
