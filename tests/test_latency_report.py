"""Latency records, summaries and the table."""

import numpy as np
import pytest

from medha_jax.latency_report import (LatencyRecord, format_table, records_from_requests,
                                      summarize)
from medha_jax.request import FinishReason, Request, RequestState


def _finished_request(rid, arrival, first_token, finish, n_out, reason=FinishReason.LENGTH):
    r = Request(request_id=rid, prompt_len=10, max_new_tokens=n_out, arrival_time=arrival)
    r.output_token_ids = [0] * n_out
    r.first_token_time, r.finish_time = first_token, finish
    r.state, r.finish_reason = RequestState.FINISHED, reason
    return r


def test_records_from_requests_compute_ttft_tpot_e2e():
    done = _finished_request("a", 10.0, 12.0, 20.0, 5)
    waiting = Request(request_id="b", prompt_len=1000, max_new_tokens=3, arrival_time=11.0)
    running = Request(request_id="c", prompt_len=10, max_new_tokens=9, arrival_time=11.0)
    running.output_token_ids, running.first_token_time = [1, 2], 13.0
    rec_a, rec_b, rec_c = records_from_requests([done, waiting, running], long_ids={"b"},
                                                start_time=10.0)
    assert (rec_a.arrival_s, rec_a.ttft_s, rec_a.e2e_s, rec_a.finish_s) == (0.0, 2.0, 10.0, 10.0)
    assert rec_a.tpot_s == pytest.approx(8.0 / 4)
    assert rec_a.completed and not rec_a.is_long and rec_a.finish_reason == "length"
    assert rec_b.is_long and not rec_b.completed
    assert (rec_b.ttft_s, rec_b.tpot_s, rec_b.e2e_s, rec_b.finish_s) == (None, None, None, None)
    assert rec_c.ttft_s == 2.0 and rec_c.e2e_s is None and not rec_c.completed


def test_cancelled_request_is_not_completed():
    r = _finished_request("x", 0.0, 1.0, 2.0, 2, reason=FinishReason.CANCELLED)
    assert not records_from_requests([r])[0].completed


def _record(i, ttft, *, is_long=False, completed=True, n_out=11, decode_s=1.0, error=None):
    return LatencyRecord(
        request_id=f"r{i}", arrival_s=float(i), prompt_tokens=10, output_tokens=n_out,
        is_long=is_long, completed=completed, ttft_s=ttft,
        tpot_s=decode_s / (n_out - 1) if completed else None,
        e2e_s=ttft + decode_s if completed else None, error=error)


def test_summary_percentiles_counts_and_throughput():
    short = [_record(i, float(i + 1)) for i in range(100)]          # ttft 1..100
    long = [_record(100, 50.0, is_long=True),
            _record(101, 70.0, is_long=True, n_out=3, decode_s=0.5),
            _record(102, None, is_long=True, completed=False, error="boom")]
    s = summarize(short + long)
    ttfts = np.arange(1.0, 101.0)
    assert s["short_ttft_p50"] == pytest.approx(np.percentile(ttfts, 50))
    assert s["short_ttft_p90"] == pytest.approx(np.percentile(ttfts, 90))
    assert s["short_ttft_p99"] == pytest.approx(np.percentile(ttfts, 99))
    assert (s["short_total"], s["short_completed"]) == (100, 100)
    assert (s["long_total"], s["long_completed"]) == (3, 2)
    assert s["long_ttft_p50"] == pytest.approx(60.0)
    assert (s["num_requests"], s["num_completed"], s["num_failed"]) == (103, 102, 1)
    # TPOT: 101 requests at 0.1 s/token and one at 0.25 s/token.
    tpots = [0.1] * 101 + [0.25]
    assert s["tpot_p50"] == pytest.approx(0.1)
    assert s["tpot_p99"] == pytest.approx(np.percentile(tpots, 99))
    assert s["short_tpot_p99"] == pytest.approx(0.1)
    assert s["long_tpot_p50"] == pytest.approx(np.percentile([0.1, 0.25], 50))
    assert s["long_ttft_p99"] == pytest.approx(np.percentile([50.0, 70.0], 99))
    # Last finish: short 99 at 99 + 100 + 1 = 200 s; first arrival 0.
    generated = 100 * 11 + 11 + 3
    assert s["makespan_s"] == pytest.approx(200.0)
    assert s["throughput_tok_s"] == pytest.approx(generated / 200.0)


def test_summary_of_a_run_without_long_requests_or_completions():
    s = summarize([_record(0, None, completed=False)])
    assert s["long_total"] == 0 and s["long_ttft_p50"] is None
    assert s["short_ttft_p50"] is None and s["throughput_tok_s"] is None


def test_table_has_units_and_one_row_per_policy():
    fast = summarize([_record(i, 0.5) for i in range(10)])
    slow = summarize([_record(i, 100.0) for i in range(10)] + [_record(10, 1e6, is_long=True)])
    table = format_table({"lars": fast, "fcfs-np": slow})
    lines = table.splitlines()
    assert len(lines) == 4                                   # header, rule, two rows
    assert lines[0].split()[:4] == ["policy", "short_ttft_p50_s", "short_ttft_p90_s",
                                    "short_ttft_p99_s"]
    assert lines[2].split()[0] == "lars" and lines[3].split()[0] == "fcfs-np"
    assert lines[2].split()[1] == "0.5" and lines[3].split()[1] == "100"
    assert lines[2].split()[4] == "-"                        # no long requests: no figure
    assert "1.000e+06" in lines[3]
    assert len({len(line) for line in lines}) == 1           # columns line up
    assert format_table({"x": fast}, label="run").startswith("run")
