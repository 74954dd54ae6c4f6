"""The benchmarks' job runner (``harness/runner.py``) on tiny Python commands: a job of
several commands, done.json and skip-if-done, the budget, timeouts and a failing command ending its
siblings, the line watcher, and the example job's harness command line."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from harness.runner import (
    HARNESS, Command, ExampleJob, Job, bench_recorders, done, load_ranks, replica_worlds_job, run_job, run_jobs,
    summary_of)
from megatron_diloco.summary import format_summary


def py(code: str, **env: str) -> Command:
    return Command([sys.executable, "-c", code], env=dict(env))


WRITE_RECORD = ("import json, os; print('hello', os.environ['X'], flush=True); "
                "open(os.path.join(os.environ['OUT'], 'rank' + os.environ['X'] + '.json'), 'w')"
                ".write(json.dumps({'x': int(os.environ['X'])}))")


def test_a_job_of_several_commands_writes_records_logs_and_done(tmp_path: Path):
    out = tmp_path / "out"
    job = Job("two", [py(WRITE_RECORD, X="0"), py(WRITE_RECORD, X="1")], env={"OUT": str(out / "two")},
              expect_records=2)
    info = run_job(job, out)
    assert info["ok"] and info["returncodes"] == [0, 0] and info["rank_files"] == 2
    assert done(out, "two") == info and info["logs"] == ["log0.txt", "log1.txt"]
    assert [r["x"] for r in load_ranks(out, "two")] == [0, 1]
    assert (out / "two" / "log1.txt").read_text() == "hello 1\n"
    assert len((out / "two" / "cmd.txt").read_text().splitlines()) == 4  # a line and its env per command


def test_a_rank_that_died_writing_its_record_fails_the_job_not_the_harness(tmp_path: Path):
    """A rank killed while writing ``rank1.json`` leaves it empty (seen: a checkpoint save that failed on a full
    disk): the job is reported failed, with the record it has, and the harness goes on."""
    out = tmp_path / "out"
    died = "import os, sys; open(os.path.join(os.environ['OUT'], 'rank1.json'), 'w'); sys.exit(1)"
    job = Job("cut", [py(WRITE_RECORD, X="0"), py(died)], env={"OUT": str(out / "cut")})
    info = run_job(job, out)
    assert not info["ok"] and info["returncodes"] == [0, 1] and info["rank_files"] == 1
    assert [r["x"] for r in load_ranks(out, "cut")] == [0]


def test_done_jobs_are_skipped_with_the_same_flags_only(tmp_path: Path):
    marker = tmp_path / "ran"
    code = f"open({str(marker)!r}, 'a').write('x')"
    run_jobs([Job("j", [py(code)])], tmp_path)
    run_jobs([Job("j", [py(code)])], tmp_path)  # same flags: skipped
    assert marker.read_text() == "x"
    run_jobs([Job("j", [py(code, Y="1")])], tmp_path)  # other environment: runs again
    assert marker.read_text() == "xx"
    run_jobs([Job("j", [py(code, Y="1")])], tmp_path, resume=False)
    assert marker.read_text() == "xxx"


def test_budget_timeout_and_a_failing_command_ending_the_others(tmp_path: Path):
    t0 = time.perf_counter()
    results = run_jobs([
        Job("slow", [py("import time; time.sleep(60)")], timeout_s=1.0),
        Job("failing", [py("import sys; sys.exit(3)"), py("import time; time.sleep(60)")], term_grace_s=1.0),
        Job("over_budget", [py("pass")], estimate_s=1e6),
    ], tmp_path, parallel=2, budget_s=100)
    assert time.perf_counter() - t0 < 30
    assert results["slow"]["timed_out"] and not results["slow"]["ok"]
    assert results["failing"]["returncodes"][0] == 3 and results["failing"]["returncode"] == 3
    assert results["failing"]["returncodes"][1] != 0  # ended by the runner
    assert "over_budget" not in results and done(tmp_path, "over_budget") is None


def test_watch_sees_every_line_and_the_summary_is_read_from_the_logs(tmp_path: Path):
    seen: list[str] = []
    line = format_summary({"rounds": 2})
    code = f"import time; print('a', flush=True); time.sleep(0.7); print('b'); print({line!r})"
    run_job(Job("w", [py(code)], watch=seen.append), tmp_path)
    assert seen == ["a\n", "b\n", line + "\n"]
    assert summary_of(tmp_path, "w") == {"rounds": 2}


def test_example_job_runs_the_harness_under_torchrun(tmp_path: Path):
    env = {"BENCH_LINK_MBPS": "inf", "BENCH_FIXED_EVAL": "1"}
    assert bench_recorders(env) == ["timers", "losses", "rounds", "fixed_eval", "link"]
    assert bench_recorders({"BENCH_CHECK_BOUNDARIES": "1"}) == ["timers", "losses", "rounds", "boundary_check"]
    ej = ExampleJob("run", ["--train-iters", "4"], 2, env)
    job = ej.job(tmp_path)
    (cmd,) = job.commands
    assert cmd.argv[1:3] == ["-m", "torch.distributed.run"] and "--nproc-per-node" in cmd.argv
    rest = cmd.argv[cmd.argv.index(str(HARNESS)) + 1:]
    assert rest == ["--record", "timers,losses,rounds,fixed_eval,link", "--out", str(tmp_path / "run"),
                    "--fast-exit", "--", "--train-iters", "4", "--data-cache-path",
                    str(tmp_path / "run" / "dataset_cache")]
    assert job.gpus == 2 and job.expect_records == 2 and job.fingerprint == {"args": ["--train-iters", "4"],
                                                                               "env": env}
    assert json.loads(json.dumps(job.fingerprint)) == job.fingerprint  # stored in done.json as is


def test_replica_worlds_job_joins_single_rank_launches_through_one_store(tmp_path: Path):
    """R launches, each a world of one rank on the job's one GPU, with their own record folder and log;
    DiLoCoX ones share one ``--diloco-x-outer-store`` and get their replica index; the fingerprint
    holds the flags, not the ports."""
    job = replica_worlds_job("r", tmp_path, ["--train-iters", "4"], 2, ["timers"], env={"E": "1"})
    assert job.gpus == 1 and job.logs == ["replica0.log", "replica1.log"] and job.env["E"] == "1"
    stores = set()
    for r, cmd in enumerate(job.commands):
        rest = cmd.argv[cmd.argv.index(str(HARNESS)) + 1:]
        assert rest[:4] == ["--record", "timers", "--out", str(tmp_path / "r" / f"replica{r}")]
        assert rest[rest.index("--") + 1:][:2] == ["--train-iters", "4"]
        assert rest[-2:] == ["--diloco-x-replica-index", str(r)]
        stores.add(rest[rest.index("--diloco-x-outer-store") + 1])
        assert cmd.env["WORLD_SIZE"] == "1" and cmd.env["RANK"] == "0"
    assert len(stores) == 1
    assert job.fingerprint == replica_worlds_job("r", tmp_path, ["--train-iters", "4"], 2, ["timers"],
                                                 env={"E": "1"}).fingerprint
    vanilla = replica_worlds_job("v", tmp_path, ["--no-diloco-x"], 2, ["timers"], diloco=False)
    assert all("--diloco-x-outer-store" not in c.argv for c in vanilla.commands)
