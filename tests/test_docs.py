"""The generated flag reference (docs/flags.md) matches the flags the package defines today.

Fast and Megatron-free: docs/gen_flags.py builds a bare ``argparse.ArgumentParser()``, calls
``add_diloco_x_args`` and renders the page; the test compares a fresh rendering with the file.
"""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

from megatron_diloco import add_diloco_x_args

DOCS = Path(__file__).resolve().parents[1] / "docs"


def _gen_flags():
    spec = importlib.util.spec_from_file_location("gen_flags", DOCS / "gen_flags.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_flags_md_is_up_to_date():
    fresh = _gen_flags().render()
    assert (DOCS / "flags.md").read_text() == fresh, "docs/flags.md is stale: run `make docs`"


def test_flags_md_lists_every_flag_of_the_group():
    """Every listed flag (unlisted ones, as ``--help`` hides them, stay out)."""
    parser = argparse.ArgumentParser()
    before = {s for a in parser._actions for s in a.option_strings}
    add_diloco_x_args(parser)
    flags = {s for a in parser._actions for s in a.option_strings if a.help != argparse.SUPPRESS} - before
    assert flags and all(f.startswith("--diloco-x") for f in flags)
    text = (DOCS / "flags.md").read_text()
    missing = [f for f in sorted(flags) if f"| `{f}` |" not in text]
    assert not missing, f"not in docs/flags.md: {missing}"


def test_example_launch_scripts_parse():
    """The launch templates under examples/ are valid bash (they are not run here: no Slurm, no GPUs)."""
    import subprocess

    scripts = sorted((DOCS.parent / "examples").glob("*.sh"))
    assert len(scripts) >= 3
    for script in scripts:
        proc = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, timeout=30)
        assert proc.returncode == 0, (script.name, proc.stderr)


def test_slurm_node_script_takes_its_rank_from_the_node_list(tmp_path):
    """examples/slurm_node.sh, as srun starts it on node ``b`` of ``a b c``: node rank 1 of 3, the
    launcher on pretrain_gpt.py, the training flags passed through (torchrun stubbed)."""
    import os
    import subprocess

    fake = tmp_path / "torchrun"
    fake.write_text('#!/bin/bash\necho "$@"\n')
    fake.chmod(0o755)
    env = dict(os.environ, PATH=f"{tmp_path}:{os.environ['PATH']}", NODELIST="a b c", SLURMD_NODENAME="b",
               GPUS_PER_NODE="8", MASTER_ADDR="a", MASTER_PORT="29500", MEGATRON="/opt/M")
    out = subprocess.run(["bash", str(DOCS.parent / "examples" / "slurm_node.sh"), "--diloco-x", "--lr", "1e-4"],
                         env=env, capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["--nnodes", "3", "--nproc-per-node", "8", "--node-rank", "1", "--master-addr", "a",
                                  "--master-port", "29500", "-m", "megatron_diloco.launch", "/opt/M/pretrain_gpt.py",
                                  "--diloco-x", "--lr", "1e-4"]
    env["SLURMD_NODENAME"] = "z"
    assert subprocess.run(["bash", str(DOCS.parent / "examples" / "slurm_node.sh")], env=env, capture_output=True,
                          text=True, timeout=30).returncode != 0
