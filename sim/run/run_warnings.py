"""Warnings a user needs about a finished run: what its headline figures do not say.

Each warning is a dict (``kind``, ``message`` and the figures behind it) kept in
``summary.json`` under ``warnings`` and printed by the commands. They flag results that are
easy to misread: requests silently rejected, a run so overloaded it outlasts its trace,
queueing delay that keeps growing, swap asked for with no swap space.
"""

from __future__ import annotations

import numpy as np

from kvsim.sim.run.config import ResolvedRun
from kvsim.sim.run.request_records import RequestRecords
from kvsim.traces.schema import Trace

OVERLOAD_FACTOR = 2.0  # the run lasts this many times the trace's span, or more
OVERLOAD_MIN_EXTRA_S = 10.0  # ... and at least this much longer
QUEUE_SLOPE = 0.05  # queueing delay grows by this many seconds per second of arrivals, or more
QUEUE_MIN_S = 5.0  # ... and the last quarter of arrivals waits this long on average


def run_warnings(resolved: ResolvedRun, trace: Trace, summary: dict, requests: RequestRecords) -> list[dict]:
    found = [
        _rejected(summary),
        _overload(trace, summary),
        _unbounded_queue(requests),
        _swap_without_space(resolved, summary),
    ]
    return [w for w in found if w is not None]


def format_warnings(warnings: list[dict]) -> list[str]:
    return [f"warning: {w['message']}" for w in warnings]


def _rejected(summary: dict) -> dict | None:
    rejected = summary["requests_rejected"]
    if not rejected:
        return None
    total = rejected + summary["requests_completed"]
    reasons = summary.get("rejection_reasons", {})
    why = ", ".join(f"{n} {reason}" for reason, n in reasons.items())
    return {
        "kind": "rejected",
        "message": f"{rejected} of {total} requests ({100 * rejected / total:.1f} %) were rejected: {why}",
        "count": rejected,
        "share": rejected / total,
        "reasons": reasons,
    }


def _overload(trace: Trace, summary: dict) -> dict | None:
    span = float(trace.arrival_s[-1] - trace.arrival_s[0]) if len(trace) else 0.0
    duration = summary["duration_s"]
    if duration < OVERLOAD_FACTOR * span or duration - span < OVERLOAD_MIN_EXTRA_S:
        return None
    return {
        "kind": "overload",
        "message": f"the run lasted {duration:,.0f} s for arrivals spanning {span:,.0f} s "
        f"({duration / max(span, 1e-9):.1f}x): this configuration cannot keep up with the traffic",
        "duration_s": duration,
        "trace_span_s": span,
    }


def _unbounded_queue(requests: RequestRecords) -> dict | None:
    """Queueing delay (arrival to first schedule) that rises steadily with arrival time."""
    scheduled = requests.is_root & ~np.isnan(requests.first_scheduled_s)
    if scheduled.sum() < 8:
        return None
    arrival = requests.arrival_s[scheduled]
    delay = requests.first_scheduled_s[scheduled] - arrival
    if np.ptp(arrival) <= 0:
        return None
    slope = float(np.polyfit(arrival, delay, 1)[0])
    tail = float(delay[arrival >= np.quantile(arrival, 0.75)].mean())
    if slope < QUEUE_SLOPE or tail < QUEUE_MIN_S:
        return None
    return {
        "kind": "unbounded_queue",
        "message": f"queueing delay grows without bound: +{slope:.2f} s per second of arrivals, "
        f"{tail:,.1f} s on average for the last quarter of arrivals",
        "slope_s_per_s": slope,
        "last_quarter_queue_s": tail,
    }


def _swap_without_space(resolved: ResolvedRun, summary: dict) -> dict | None:
    if resolved.config.preemption_mode != "swap" or resolved.engine_config.num_host_blocks > 0:
        return None
    return {
        "kind": "swap_without_space",
        "message": f"preemption mode swap with swap space {resolved.config.swap_space_gb:g} GiB: no host block, so every "
        f"preemption recomputes instead ({summary['preemptions']} in this run)",
        "preemptions": summary["preemptions"],
    }
