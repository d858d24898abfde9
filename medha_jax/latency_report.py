"""Latency summaries of a run: TTFT of short and long requests, TPOT, throughput.

One record type, `LatencyRecord`, comes out of both the simulator (via
`records_from_requests`) and live trace replay (serving.replay), so the convoy benchmark
and the serving demo report the same numbers the same way:

    records = records_from_requests(result.requests, long_ids=long_ids)
    print(format_table({"lars": summarize(records), ...}))

Definitions (seconds, on the clock the run used):
    ttft = first token - arrival;  e2e = finish - arrival
    tpot = (finish - first token) / max(output tokens - 1, 1)   (as RequestMetrics)
TTFT percentiles cover the requests that got a first token (a run cut short leaves the
rest out, so always read them beside the completed/total counts); TPOT percentiles cover
completed requests with at least two output tokens (tpot_* all of them, short_tpot_* and
long_tpot_* one class).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Collection, Mapping, Sequence

import numpy as np

from medha_jax.request import FinishReason, Request


@dataclasses.dataclass(frozen=True)
class LatencyRecord:
    """What happened to one request of a run."""

    request_id: str
    arrival_s: float             # when it arrived, seconds from the start of the run
    prompt_tokens: int
    output_tokens: int           # tokens actually generated
    is_long: bool
    completed: bool              # finished normally (length or stop)
    ttft_s: float | None = None  # None: no first token
    tpot_s: float | None = None
    e2e_s: float | None = None   # None: did not finish
    finish_reason: str | None = None
    error: str | None = None     # why it failed, when it did
    num_preemptions: int = 0
    num_cached_tokens: int = 0   # prompt tokens the prefix cache served
    replica: int = 0             # the replica that served it

    @property
    def finish_s(self) -> float | None:
        """When it finished, seconds from the start of the run."""
        return None if self.e2e_s is None else self.arrival_s + self.e2e_s


def tpot(first_token_s: float, finish_s: float, num_output_tokens: int) -> float:
    """Mean time per output token after the first."""
    return (finish_s - first_token_s) / max(num_output_tokens - 1, 1)


def records_from_requests(requests: Sequence[Request], *, long_ids: Collection[str] = (),
                          start_time: float = 0.0) -> list[LatencyRecord]:
    """Records of requests a controller ran (e.g. `simulate(...).requests`).

    long_ids: ids of the long-context class (a Request does not know its class).
    start_time: the run's start on the requests' clock, subtracted from arrivals.
    """
    long_ids = set(long_ids)
    records = []
    for r in requests:
        n_out = len(r.output_token_ids)
        completed = r.finish_reason in (FinishReason.LENGTH, FinishReason.STOP)
        ttft = None if r.first_token_time is None else r.first_token_time - r.arrival_time
        finished = r.finish_time is not None
        records.append(LatencyRecord(
            request_id=r.request_id, arrival_s=r.arrival_time - start_time,
            prompt_tokens=r.prompt_len, output_tokens=n_out,
            is_long=r.request_id in long_ids, completed=completed, ttft_s=ttft,
            tpot_s=(tpot(r.first_token_time, r.finish_time, n_out)
                    if finished and r.first_token_time is not None else None),
            e2e_s=r.finish_time - r.arrival_time if finished else None,
            finish_reason=None if r.finish_reason is None else r.finish_reason.value,
            error=r.error, num_preemptions=r.num_preemptions))
    return records


def _percentile(values: Sequence[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if len(values) else None


def summarize(records: Sequence[LatencyRecord]) -> dict[str, float | int | None]:
    """The figures of one run (one policy at one load). Times in seconds; None = no data."""
    short = [r for r in records if not r.is_long]
    long = [r for r in records if r.is_long]
    short_ttft = [r.ttft_s for r in short if r.ttft_s is not None]
    long_ttft = [r.ttft_s for r in long if r.ttft_s is not None]
    def tpots(rs):
        return [r.tpot_s for r in rs
                if r.completed and r.output_tokens >= 2 and r.tpot_s is not None]

    done = [r for r in records if r.completed]
    # Throughput over the span from the first arrival to the last completion.
    span = (max(r.finish_s for r in done) - min(r.arrival_s for r in records)) if done else 0.0
    generated = sum(r.output_tokens for r in done)
    return {
        "num_requests": len(records),
        "num_completed": len(done),
        "num_failed": sum(1 for r in records if r.error is not None),
        "short_total": len(short),
        "short_completed": sum(1 for r in short if r.completed),
        "short_ttft_p50": _percentile(short_ttft, 50),
        "short_ttft_p90": _percentile(short_ttft, 90),
        "short_ttft_p99": _percentile(short_ttft, 99),
        "long_total": len(long),
        "long_completed": sum(1 for r in long if r.completed),
        "long_ttft_p50": _percentile(long_ttft, 50),
        "long_ttft_p90": _percentile(long_ttft, 90),
        "long_ttft_p99": _percentile(long_ttft, 99),
        "tpot_p50": _percentile(tpots(records), 50),
        "tpot_p99": _percentile(tpots(records), 99),
        "short_tpot_p50": _percentile(tpots(short), 50),
        "short_tpot_p99": _percentile(tpots(short), 99),
        "long_tpot_p50": _percentile(tpots(long), 50),
        "long_tpot_p99": _percentile(tpots(long), 99),
        "throughput_tok_s": generated / span if span > 0 else None,
        "makespan_s": span,
    }


# (summary key, column header with its unit) for `format_table`.
TABLE_COLUMNS: tuple[tuple[str, str], ...] = (
    ("short_ttft_p50", "short_ttft_p50_s"),
    ("short_ttft_p90", "short_ttft_p90_s"),
    ("short_ttft_p99", "short_ttft_p99_s"),
    ("long_ttft_p50", "long_ttft_p50_s"),
    ("long_completed", "long_done"),
    ("long_total", "long_total"),
    ("tpot_p50", "tpot_p50_s"),
    ("tpot_p99", "tpot_p99_s"),
    ("throughput_tok_s", "out_tok_per_s"),
    ("num_completed", "completed"),
    ("num_requests", "requests"),
)


def _cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, str):
        return value
    if isinstance(value, (int, np.integer)):
        return str(int(value))
    value = float(value)
    if math.isinf(value) or math.isnan(value):
        return str(value)
    if value == 0 or 1e-3 <= abs(value) < 1e5:
        return f"{value:.4g}"
    return f"{value:.3e}"


def format_table(summaries: Mapping[str, Mapping[str, object]], *, label: str = "policy",
                 columns: Sequence[tuple[str, str]] = TABLE_COLUMNS) -> str:
    """A fixed-width text table: one row per entry of `summaries` (e.g. per policy),
    one column per (key, header) of `columns`, units in the headers."""
    header = [label] + [title for _, title in columns]
    rows = [[name] + [_cell(summary.get(key)) for key, _ in columns]
            for name, summary in summaries.items()]
    widths = [max(len(row[i]) for row in [header] + rows) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) if i == 0 else cell.rjust(w)
                       for i, (cell, w) in enumerate(zip(row, widths)))
             for row in [header] + rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
