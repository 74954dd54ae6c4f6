"""``benchmarks/memory/outer_state_memory.py --merge``: passes of the same runs combined, each
overhead and boundary ratio taken side by side within its own pass, not across passes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.memory.outer_state_memory import main, merge


def one_pass(vanilla_ms: float, gpu_boundary: float, cpu_boundary: float, cpu_step: float, peak: float = 30.0) -> dict:
    run = lambda step, boundary, peak_gb: {"params": 10, "peak_gb": peak_gb, "step_ms": step, "step_mean_ms": step,  # noqa: E731
                                           "boundary_ms": boundary, "overhead_bytes_per_param": 1.0,
                                           "step_overhead_pct": 99.0}
    return {"card": "card", "params": 10, "commit": "old", "iters": 70, "local_steps": 20, "model": "m",
            "runs": {"vanilla": run(vanilla_ms, vanilla_ms, 25.0), "gpu-none": run(vanilla_ms, gpu_boundary, 38.0),
                     "cpu-none": run(cpu_step, cpu_boundary, peak), "cpu-int4": {"error": "exit status 1"}}}


def test_merge_pairs_each_ratio_within_its_pass():
    # pass A: everything twice as slow as pass B; the ratios within each pass are 1.1 and 3 / 1.3 and 2
    a, b = one_pass(200.0, 300.0, 900.0, 220.0), one_pass(100.0, 150.0, 300.0, 130.0, peak=30.5)
    m = merge([a, b], commit="new")
    cpu = m["runs"]["cpu-none"]
    assert m["commit"] == "new" and m["passes"] == 2 and cpu["passes"] == 2
    assert cpu["step_ms"] == pytest.approx(175.0) and cpu["step_ms_per_pass"] == [220.0, 130.0]
    assert cpu["step_overhead_pct_per_pass"] == pytest.approx([10.0, 30.0])
    assert cpu["step_overhead_pct"] == pytest.approx(20.0)  # not 175 / 150 - 1 = 16.7%
    assert cpu["boundary_vs_gpu_per_pass"] == pytest.approx([3.0, 2.0]) and cpu["boundary_vs_gpu"] == pytest.approx(2.5)
    assert cpu["peak_gb"] == 30.0 and cpu["peak_gb_per_pass"] == [30.0, 30.5]
    assert "step_overhead_pct" not in m["runs"]["vanilla"] and "boundary_vs_gpu" not in m["runs"]["gpu-none"]
    assert m["runs"]["cpu-int4"] == {"error": "exit status 1"}  # failed in every pass: kept as it was


def test_merge_cli_writes_the_result(tmp_path: Path):
    files = []
    for i, p in enumerate((one_pass(200.0, 300.0, 900.0, 220.0), one_pass(100.0, 150.0, 300.0, 130.0))):
        files.append(tmp_path / f"p{i}.json")
        files[-1].write_text(json.dumps(p))
    out = tmp_path / "memory.json"
    assert main(["--merge", *map(str, files), "--result", str(out), "--commit", "abc1234"]) == 0
    m = json.loads(out.read_text())
    assert m["commit"] == "abc1234" and m["runs"]["cpu-none"]["boundary_vs_gpu"] == pytest.approx(2.5)
