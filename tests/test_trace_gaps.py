"""benchmarks/throughput/trace_gaps.py: device idle time in a profiler trace, charged to the host op that
launched the kernel each gap waited for."""

from __future__ import annotations

import gzip
import json

import pytest

from benchmarks.throughput.trace_gaps import gaps, load


def _trace() -> list[dict]:
    """Two kernels back to back, a 100 us gap, a kernel overlapping the next (no gap), a 50 us gap whose kernel was
    launched inside ``aten::item`` inside ``optimizer.step``, a 10 us gap (idle, not charged), and one host sync."""
    k = lambda ts, dur, c: {"ph": "X", "cat": "kernel", "name": f"k{c}", "ts": ts, "dur": dur,  # noqa: E731
                            "args": {"correlation": c}}
    launch = lambda ts, c: {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": ts, "dur": 5,  # noqa: E731
                            "args": {"correlation": c}}
    op = lambda name, ts, dur: {"ph": "X", "cat": "cpu_op", "name": name, "ts": ts, "dur": dur}  # noqa: E731
    return [k(0, 100, 1), k(100, 50, 2), k(250, 100, 3), k(300, 100, 4), k(450, 20, 5), k(480, 20, 6),
            launch(240, 3), op("aten::mm", 230, 20), launch(440, 5), op("optimizer.step", 400, 60),
            op("aten::item", 435, 10), op("ProfilerStep#12", 0, 600), launch(475, 6),
            {"ph": "X", "cat": "cuda_runtime", "name": "cudaStreamSynchronize", "ts": 420, "dur": 15, "args": {}},
            {"ph": "i", "cat": "kernel", "name": "instant", "ts": 1}]


def test_idle_is_the_time_no_kernel_covers_and_each_long_gap_is_charged_to_its_launching_op(tmp_path):
    r = gaps(_trace(), steps=1, min_us=20)
    assert r["busy_ms"] == pytest.approx(0.34) and r["idle_ms"] == pytest.approx(0.16)  # 100 + 50 + 10 us
    assert r["window_ms"] == pytest.approx(0.5) and r["gaps"] == 2
    assert r["by_inner_op"] == {"aten::mm": [1, 0.1], "aten::item": [1, 0.05]}
    assert r["by_outer_op"] == {"aten::mm": [1, 0.1], "optimizer.step": [1, 0.05]}  # the step's own marker skipped
    assert r["syncs"] == {"cudaStreamSynchronize": [1, 0.015]}
    # each gap where it began, with the host ops its kernel was launched in (outermost first)
    assert r["gap_list"] == [[pytest.approx(0.15), 100, ["aten::mm"]],
                             [pytest.approx(0.4), 50, ["optimizer.step", "aten::item"]]]
    assert r["waits"] == []  # none as long as the default 1 ms
    waits = gaps(_trace(), steps=1, min_us=20, wait_ms=0.01)["waits"]
    assert waits == [[pytest.approx(0.42), pytest.approx(0.015), "cudaStreamSynchronize", ["optimizer.step"]]]
    halves = gaps(_trace(), steps=2, min_us=20)
    assert halves["idle_ms"] == pytest.approx(0.08) and halves["by_inner_op"]["aten::mm"] == [0.5, 0.05]
    path = tmp_path / "trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": _trace()}, f)
    assert len(load(path)) == len(_trace()) - 1  # complete events only


def test_a_trace_without_device_events_is_refused():
    with pytest.raises(SystemExit, match="no device events"):
        gaps([{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 5}])
