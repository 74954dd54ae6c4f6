"""``--help`` lists Megatron's flags and the DiLoCoX ones (megatron-core 0.19.2 ships a help string
argparse cannot format, which made ``--help`` raise before any help was printed)."""

from __future__ import annotations

import argparse
import subprocess
import sys

from harness.launch import REPO
from megatron_diloco.compat.help import escape_unformattable_help


def test_unformattable_help_strings_are_escaped_and_the_rest_kept():
    parser = argparse.ArgumentParser()
    parser.add_argument("--broken", type=float, default=1.1, help="headroom (e.g. 1.10 = 10%).")
    parser.add_argument("--ok", type=int, default=3, help="kept as is: %(default)s, 100%% sure")
    parser.add_argument("--mixed", type=int, default=4, help="%(default)s or 5%, 100%% sure")
    assert escape_unformattable_help(parser) == ["--broken", "--mixed"]
    text = parser.format_help()
    assert "1.10 = 10%)." in text and "kept as is: 3, 100% sure" in text and "4 or 5%, 100% sure" in text


def test_example_help_lists_the_diloco_x_flags():
    proc = subprocess.run([sys.executable, str(REPO / "examples/pretrain_gpt_diloco.py"), "--help"], cwd=REPO,
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "--diloco-x-local-steps" in proc.stdout and "--moe-paged-stash-buffer-size-factor-cuda" in proc.stdout


def test_flag_help_says_what_a_flag_does_not_what_was_measured():
    """Help strings state behaviour and defaults; measurements (loss gaps, commits, report sections)
    live in docs/tuning.md and benchmarks/RESULTS.md, which a help string may name."""
    import re

    from megatron_diloco import add_diloco_x_args

    parser = add_diloco_x_args(argparse.ArgumentParser())
    offenders = {}
    for action in parser._actions:
        text = (action.help or "") if action.help is not argparse.SUPPRESS else ""
        found = [p for p in (r"\d%", r"\bseeds?\b", r"RESULTS\.md \d|§", r"\b[0-9a-f]{7,}\b", r"\bmeasured:", r"H[12]00\b")
                 if re.search(p, text.replace("%%", "%"), re.IGNORECASE)]
        if found:
            offenders[action.option_strings[0]] = found
    assert not offenders, offenders
