"""``benchmarks/memory/outer_state_memory.py --merge``: passes of the same runs combined, each
overhead and boundary ratio taken side by side within its own pass, not across passes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.memory.outer_state_memory import main, merge


def one_pass(vanilla_ms: float, gpu_boundary: float, cpu_boundary: float, cpu_step: float, peak: float = 30.0) -> dict:
    run = lambda step, boundary, peak_gb: {"params": 10, "peak_gb": peak_gb, "step_ms": step, "step_mean_ms": step,  # noqa: E731
                                           "boundary_ms": boundary, "outer_ms": boundary - step,
                                           "overhead_bytes_per_param": 1.0, "step_overhead_pct": 99.0}
    return {"card": "card", "params": 10, "commit": "old", "iters": 70, "local_steps": 20, "model": "m",
            "runs": {"vanilla": run(vanilla_ms, vanilla_ms + 20.0, 25.0), "gpu-none": run(vanilla_ms, gpu_boundary, 38.0),
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
    # outer work net of vanilla's floor (20 ms): pass A 660 / 80, pass B 150 / 30
    assert cpu["outer_net_ms_per_pass"] == pytest.approx([660.0, 150.0])
    assert cpu["outer_vs_gpu_per_pass"] == pytest.approx([8.25, 5.0]) and cpu["outer_vs_gpu"] == pytest.approx(6.625)
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


def test_time_figures_leave_out_the_warm_up_rounds():
    """A run's step, boundary and per-round outer times come from the rounds after the warm-up (the
    first two boundaries carry Triton's compilation and the first landing); ``outer_ms`` counts a
    round's outer work wherever it falls: the boundary and the landing tau steps later."""
    from benchmarks.memory.outer_state_memory import WARM_ROUNDS, figures

    H, n, step, prep, land = 10, 40, 0.3, 0.05, 0.2  # 4 boundaries: 2 warm-up, 2 steady (the median of all 4 is not)
    iter_s = [step] * n
    for i in range(1, n + 1):
        if i % H == 0:
            iter_s[i - 1] += prep if i > WARM_ROUNDS * H else 1.0  # compiling in the warm-up
        elif i % H == 1 and i > WARM_ROUNDS * H:
            iter_s[i - 1] += land  # tau 1: the landing one step after the boundary
    iter_s[4] += 2.0  # a slow early step (warm-up)
    plugin_s = [2e-5 if i % H else 0.05 for i in range(1, n + 1)]
    plugin_s[4] = 1.0  # the warm-up's: left out
    rec = {"params_on_rank": 10, "max_mem_bytes": 2 ** 30, "iter_s": iter_s, "plugin_s": plugin_s}
    f = figures([rec], H)
    assert f["plugin_us"] == pytest.approx(20.0) and f["plugin_pct"] == pytest.approx(100 * 2e-5 / step)
    assert f["step_ms"] == pytest.approx(1e3 * step)
    assert f["boundary_ms"] == pytest.approx(1e3 * (step + prep))  # not the compiling boundaries
    assert f["outer_ms"] == pytest.approx(1e3 * (prep + land)) and f["steady_rounds"] == 1  # boundary 30 (40's is cut)
    assert f["step_mean_ms"] == pytest.approx(1e3 * (step + land * 2 / 18))  # 18 inner steps, 2 landings (21, 31)


def test_a_repeated_run_measures_the_pass_noise():
    """``vanilla.2`` runs vanilla's flags again; its step overhead against ``vanilla`` is the noise of
    the pass, and a repeated ``cpu-<codec>`` is still compared with ``gpu-<codec>``."""
    from benchmarks.memory.outer_state_memory import _within_pass, run_flags

    assert run_flags("vanilla.2", 10) == run_flags("vanilla", 10) == ["--no-diloco-x"]
    assert run_flags("cpu-int4.3", 10) == run_flags("cpu-int4", 10)
    with pytest.raises(SystemExit, match="repeat suffix"):
        run_flags("vanilla-x", 10)
    p = one_pass(100.0, 150.0, 300.0, 130.0)
    p["runs"]["vanilla.2"] = dict(p["runs"]["vanilla"], step_ms=104.0)
    p["runs"]["cpu-none.2"] = dict(p["runs"]["cpu-none"], boundary_ms=450.0)
    ok = _within_pass(p["runs"])
    assert ok["vanilla.2"]["step_overhead_pct"] == pytest.approx(4.0)
    assert ok["cpu-none.2"]["boundary_vs_gpu"] == pytest.approx(3.0) and ok["cpu-none"]["boundary_vs_gpu"] == pytest.approx(2.0)
