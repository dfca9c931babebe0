"""What a run measures: per-step records, per-request latencies, and the run's summary.

Inter-token gaps are kept as (value, count) pairs because the engine's decode batch gives
every member the same gaps, those of the steps it ran in; expanding them gives the very
multiset a token-by-token record would, so percentiles agree exactly.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from operator import itemgetter

import numpy as np

from kvsim.policies.plan import StepPlan
from kvsim.policies.request import Request, Status

PERCENTILES = (50, 90, 99)

STEP_COLUMNS = (
    "step",
    "start_s",
    "duration_s",
    "timed",
    "kind",
    "batch_size",
    "prefill_tokens",
    "decode_tokens",
    "kv_used",
    "kv_cached",
    "kv_free",
    "kv_waste_slots",
    "preempted",
    "swap_blocks",
    "copy_blocks",
    "device_s",
    "host_s",
    "memory_bytes",
)


_STEP_COLUMN_INDEX = {name: i for i, name in enumerate(STEP_COLUMNS)}


@dataclass
class StepLog:
    """Per-step records: a row a step, in ``STEP_COLUMNS`` order (one append a step); columns on demand."""

    rows: list[tuple] = field(default_factory=list)

    def add_step(self, plan: StepPlan, start_s: float, duration_s: float, counts: tuple[int, int, int, int], timing) -> None:
        measured = timing is not None
        shape = plan.shape
        self.rows.append((
            plan.step,
            start_s,
            duration_s,
            int(measured),  # timed: 0 when there was nothing to run (only rejections)
            shape.kind,
            shape.num_seqs,
            shape.prefill_tokens,
            shape.decode_tokens,
            *counts,  # kv_used, kv_cached, kv_free, kv_waste_slots
            len(plan.preempted),
            len(plan.swap_out) + len(plan.swap_in),
            len(plan.copies),
            # measured figures exist only in real runs; None (an empty CSV cell) elsewhere
            timing.device_s if measured else None,
            timing.host_s if measured else None,
            timing.memory_bytes if measured else None,
        ))  # fmt: skip

    @property
    def columns(self) -> dict[str, list]:
        """Every column as a list (built on each call)."""
        return {name: self.column(name) for name in STEP_COLUMNS}

    def column(self, name: str) -> list:
        return list(map(itemgetter(_STEP_COLUMN_INDEX[name]), self.rows))

    def __len__(self) -> int:
        return len(self.rows)

    def array(self, name: str) -> np.ndarray:
        return np.asarray(self.column(name))


@dataclass
class TokenTimes:
    """First-scheduled time, last token time and largest inter-token gap per sequence, plus all gaps.

    The engine reports tokens one by one (``token``) or, for its persistent decode batch, as
    runs of consecutive steps (``batch_tokens``): a run's gaps are the steps' own, read from
    every step's end time (``step_ended``) once, when the gaps are asked for, not a call a token.
    """

    first_scheduled: dict[str, float] = field(default_factory=dict)
    last_token: dict[str, float] = field(default_factory=dict)
    gap_values: list[np.ndarray] = field(default_factory=list)
    gap_counts: list[np.ndarray] = field(default_factory=list)
    _max_gap: dict[str, float] = field(default_factory=dict)
    # Gaps recorded one by one (tokens outside the batch, each batch run's first gap), unboxed:
    # a list of floats took 32 bytes a gap, this 8.
    _pending_gaps: array = field(default_factory=lambda: array("d"))
    _step_ends: array = field(default_factory=lambda: array("d"))  # every step's end time, by step number
    _runs: list[tuple[str, int, int]] = field(default_factory=list)  # batch runs whose inner gaps are not yet folded

    def scheduled(self, request_id: str, now: float) -> None:
        self.first_scheduled.setdefault(request_id, now)

    def token(self, request_id: str, now: float) -> None:
        last = self.last_token.get(request_id)
        if last is not None:
            gap = now - last
            self._pending_gaps.append(gap)
            if gap > self._max_gap.get(request_id, 0.0):
                self._max_gap[request_id] = gap
        self.last_token[request_id] = now

    def step_ended(self, now: float) -> None:
        self._step_ends.append(now)

    def batch_tokens(self, request_id: str, first_step: int, last_step: int) -> None:
        """A token at the end of each step from ``first_step`` to ``last_step`` (their ends recorded already)."""
        ends = self._step_ends
        self.token(request_id, ends[first_step])
        if last_step > first_step:
            self.last_token[request_id] = ends[last_step]
            self._runs.append((request_id, first_step, last_step))

    @property
    def max_gap(self) -> dict[str, float]:
        """Each sequence's largest inter-token gap."""
        self._fold_runs()
        return self._max_gap

    def _fold_runs(self) -> None:
        """Batch runs' inner gaps (step i's end minus step i-1's, for i after a run's first step) into the stores."""
        if not self._runs:
            return
        runs, self._runs = self._runs, []
        ends = np.array(self._step_ends, dtype=np.float64)
        step_gaps = np.append(np.diff(ends, prepend=ends[:1]), 0.0)  # [i] = end i - end i-1; a tail for reduceat
        firsts = np.fromiter((f + 1 for _, f, _ in runs), dtype=np.int64, count=len(runs))
        stops = np.fromiter((last + 1 for _, _, last in runs), dtype=np.int64, count=len(runs))
        bounds = np.empty(2 * len(runs), dtype=np.int64)
        bounds[0::2], bounds[1::2] = firsts, stops
        maxima = np.maximum.reduceat(step_gaps, bounds)[0::2].tolist()
        max_gap = self._max_gap
        for (rid, _, _), worst in zip(runs, maxima):
            if worst > max_gap.get(rid, 0.0):
                max_gap[rid] = worst
        cover = np.zeros(len(step_gaps) + 1, dtype=np.int64)
        np.add.at(cover, firsts, 1)
        np.add.at(cover, stops, -1)
        cover = np.cumsum(cover)[: len(step_gaps)]
        covered = cover > 0
        self.gap_values.append(step_gaps[covered])
        self.gap_counts.append(cover[covered])

    def all_gaps(self, ascending: bool = False) -> np.ndarray:
        """Every inter-token gap; ``ascending``: sorted, as ``np.sort`` of them gives, but sorting the
        distinct step gaps before repeating each (a step's gap counts once per sequence in it)."""
        self._fold_runs()
        values = np.concatenate(self.gap_values + [np.frombuffer(self._pending_gaps, dtype=np.float64)])
        counts = np.concatenate(self.gap_counts + [np.ones(len(self._pending_gaps), dtype=np.int64)])
        if ascending:
            order = np.argsort(values)
            values, counts = values[order], counts[order]
        return np.repeat(values, counts)


def distribution(values, ascending: bool = False, consume: bool = False) -> dict[str, float | None]:
    """``{mean, p50, p90, p99}`` of ``values`` (None entries when empty); ``ascending``: they are sorted already.

    ``consume``: the caller hands its array over, so the percentiles may partition it in place
    rather than copy it (every inter-token gap of a long run: 150 MB at 100,000 requests).
    """
    arr = np.asarray(values, dtype=np.float64)
    if not ascending:
        arr = np.sort(arr)  # sorted: the mean does not depend on order
    if arr.size == 0:
        return {"mean": None, **{f"p{p}": None for p in PERCENTILES}}
    mean = float(arr.mean())  # before the percentiles may reorder it
    pct = np.percentile(arr, PERCENTILES, overwrite_input=consume or arr is not values)
    return {"mean": mean, **{f"p{p}": float(v) for p, v in zip(PERCENTILES, pct)}}


REQUEST_COLUMNS = (
    "request_id",
    "trace_index",
    "parent",
    "status",
    "reject_reason",
    "arrival_s",
    "prompt_tokens",
    "output_tokens",
    "generated_tokens",
    "first_scheduled_s",
    "first_token_s",
    "finish_s",
    "queue_s",
    "ttft_s",
    "tpot_s",
    "e2e_s",
    "max_itl_s",
    "preemptions",
    "prefix_hit_tokens",
)


def request_rows(requests: list[Request], times: TokenTimes) -> list[dict]:
    """One row per sequence (samples of n > 1 requests are rows of their own), keyed by ``REQUEST_COLUMNS``."""
    return [dict(zip(REQUEST_COLUMNS, row)) for row in request_tuples(requests, times)]


def request_tuples(requests: list[Request], times: TokenTimes) -> list[tuple]:
    """:func:`request_rows` as tuples in ``REQUEST_COLUMNS`` order: what requests.csv writes, without a dict a row."""
    first_scheduled, max_gap = times.first_scheduled, times.max_gap
    rows = []
    for r in requests:
        rid, arrival = r.request_id, r.arrival_s
        sched = first_scheduled.get(rid)
        first, fin = r.first_token_s, r.finish_s
        rows.append((
            rid,
            r.trace_index,
            r.parent.request_id if r.parent is not None else "",
            r.status.value,
            r.reject_reason or "",
            arrival,
            r.prompt_tokens,
            r.output_tokens,
            r.num_output_tokens,  # generated_tokens
            sched,  # first_scheduled_s
            first,  # first_token_s
            fin,  # finish_s
            None if sched is None else sched - arrival,  # queue_s
            None if first is None else first - arrival,  # ttft_s
            (fin - first) / (r.num_output_tokens - 1)  # tpot_s
            if fin is not None and first is not None and r.num_output_tokens > 1
            else None,
            None if fin is None else fin - arrival,  # e2e_s
            max_gap.get(rid),  # max_itl_s
            r.num_preemptions,
            r.prefix_hit_tokens,
        ))  # fmt: skip
    return rows


def summarize(requests: list[Request], times: TokenTimes, steps: StepLog, num_blocks: int, kv_stats) -> dict:
    """The run's headline figures (the ``summary.json`` keys, less config and wall time)."""
    roots = [r for r in requests if r.parent is None]
    done = [r for r in roots if r.status is Status.FINISHED and all(c.status is Status.FINISHED for c in r.children)]
    rejected = [r for r in roots if r.status is Status.REJECTED]
    finished_seqs = [r for r in requests if r.status is Status.FINISHED]
    durations = steps.array("duration_s")
    starts = steps.array("start_s")
    end = float(starts[-1] + durations[-1]) if len(durations) else 0.0
    first_arrival = min((r.arrival_s for r in roots), default=0.0)
    makespan = max(end - first_arrival, 0.0)
    output_tokens = sum(r.num_output_tokens for r in finished_seqs)
    used = steps.array("kv_used")
    busy = float(durations.sum()) if len(durations) else 0.0
    return {
        "requests_completed": len(done),
        "requests_rejected": len(rejected),
        "duration_s": makespan,
        "throughput_tok_s": output_tokens / makespan if makespan > 0 else 0.0,
        "request_rate_rps": len(done) / makespan if makespan > 0 else 0.0,
        "ttft_s": distribution([r.first_token_s - r.arrival_s for r in roots if r.first_token_s is not None]),
        "tpot_s": distribution(
            [(r.finish_s - r.first_token_s) / (r.num_output_tokens - 1) for r in finished_seqs if r.num_output_tokens > 1]
        ),
        "itl_s": distribution(times.all_gaps(ascending=True), ascending=True, consume=True),
        "e2e_s": distribution([max([r.finish_s] + [c.finish_s for c in r.children]) - r.arrival_s for r in done]),
        "preemptions": sum(r.num_preemptions for r in requests),
        "prefix_hit_rate": kv_stats.prefix_hit_tokens / kv_stats.prefix_query_tokens if kv_stats.prefix_query_tokens else 0.0,
        "resume_hit_blocks": kv_stats.resume_hit_blocks,  # blocks re-admitted preempted requests found cached
        "num_kv_blocks": num_blocks,
        "peak_kv_blocks_used": int(used.max()) if len(used) else 0,
        "mean_kv_usage": float((used * durations).sum() / busy / num_blocks) if busy > 0 else 0.0,
        "output_tokens": output_tokens,
        "steps": len(steps),
        "rejection_reasons": _count(r.reject_reason for r in rejected),
    }


def _count(items) -> dict[str, int]:
    out: dict[str, int] = {}
    for item in items:
        out[item] = out.get(item, 0) + 1
    return dict(sorted(out.items()))
