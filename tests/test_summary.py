"""The run's reports as a user reads them: the ``[DiLoCoX] round`` line and the summary line."""

from __future__ import annotations

from megatron_diloco.summary import ROUND_METRICS, format_round_line, format_summary, params_digest, parse_summaries


def _metrics(**kw) -> dict:
    m = {name: 0 for name in ROUND_METRICS}
    m.update(round=7, step=70, pseudo_grad_norm=0.5, round_steps=30, overlap_steps=3, **kw)
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
