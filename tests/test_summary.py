"""The run's reports as a user reads them: the ``[DiLoCoX] round`` line and the summary line."""

from __future__ import annotations

from megatron_diloco.summary import ROUND_METRICS, format_round_line, format_summary, params_digest, parse_summaries


def _metrics(**kw) -> dict:
    m = {name: 0 for name in ROUND_METRICS}
    m.update({"round": 7, "step": 70, "pseudo_grad_norm": 0.5, "round_steps": 30, "overlap_steps": 3, **kw})
    return m


def test_round_line_says_what_happened_in_the_round():
    """An applied exchange shows the replica's bytes and times and the compression; a round whose
    exchange lands later says so instead of "sent 0.000 MB ... 0.00x"; tau and the next round's length
    are on every line; a skipped round says it sent nothing."""
    applied = format_round_line(_metrics(applied=True, replica_bytes_sent=3e6, replica_bytes_received=3e6,
                                         replica_exchange_s=0.25, compression_ratio=7.8), lossy=True)
    assert "applied | sent 3.000 MB" in applied and "exchange 0.250 s" in applied and "7.80x" in applied
    assert applied.endswith("next round 30 steps, tau 3")
    later = format_round_line(_metrics(applied=False), lossy=True)
    assert "no exchange applied in this round" in later and "MB" not in later and "0.00x" not in later
    assert "tau 3" in later
    assert "SKIPPED" in format_round_line(_metrics(skipped=True), lossy=True)


def test_summary_round_trips_and_digest_tells_models_apart():
    line = format_summary({"rounds": 3, "final_params_fingerprint": params_digest([[1, 2], [3, 4]])})
    assert parse_summaries("noise\n[rank0]: " + line + "\n") == [
        {"rounds": 3, "final_params_fingerprint": params_digest([[1, 2], [3, 4]])}]
    assert params_digest([[1, 2], [3, 4]]) != params_digest([[1, 2], [3, 5]])
    assert params_digest([[1, 2], [3, 4]]) != params_digest([[3, 4], [1, 2]])  # rank order matters


def test_a_warmup_that_does_not_hide_its_exchanges_is_reported():
    """A warm-up round (step <= W) whose exchange kept the replica waiting more than half its compute:
    the warning gives the wait, the compute, the warm-up's total at that rate and the flags; a round of
    H, a wait under half, no warm-up, or a round with nothing applied: no warning."""
    from megatron_diloco.summary import warmup_exposure_warning

    slow = _metrics(applied=True, step=40, replica_exposed_s=9.0, step_s=0.25)  # 10 steps = 2.5 s of compute
    msg = warmup_exposure_warning(slow, 10, 900)
    assert msg is not None and "9.00 s" in msg and "2.50 s of compute" in msg and "90 rounds" in msg
    assert "810 s" in msg and "--diloco-x-warmup-local-steps" in msg and "--diloco-x-warmup-iters 0" in msg
    assert warmup_exposure_warning(_metrics(applied=True, step=930, replica_exposed_s=9.0, step_s=0.25), 10, 900) is None
    assert warmup_exposure_warning(_metrics(applied=True, step=40, replica_exposed_s=1.2, step_s=0.25), 10, 900) is None
    assert warmup_exposure_warning(slow, None, 0) is None
    assert warmup_exposure_warning(_metrics(applied=False, step=40, replica_exposed_s=9.0, step_s=0.25), 10, 900) is None
