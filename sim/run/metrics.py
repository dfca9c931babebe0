"""What a run measures: per-step records, per-request latencies, and the run's summary.

Inter-token gaps are kept as (value, count) pairs because the engine's decode batch gives
every member the same gaps, those of the steps it ran in; expanding them gives the very
multiset a token-by-token record would, so percentiles agree exactly.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field

import numpy as np

from kvsim.policies.plan import StepPlan
from kvsim.policies.request import Status
from kvsim.sim.run.request_records import RequestRecords

PERCENTILES = (50, 90, 99)

STEP_KINDS = ("prefill", "decode", "mixed", "idle")  # StepShape.kind's values, stored by their index
_KIND_CODE = {kind: code for code, kind in enumerate(STEP_KINDS)}
MEASURED_STEP_COLUMNS = ("device_s", "host_s", "memory_bytes")  # real runs only: NaN stored, None (an empty cell) read
# One step's record: 94 bytes, where a tuple of boxed values took about 350 (4.7 million steps in a
# million-request cluster run). Counts of blocks, tokens and sequences fit 32 bits many times over.
STEP_DTYPE = np.dtype([
    ("step", "i8"), ("start_s", "f8"), ("duration_s", "f8"), ("timed", "i1"), ("kind", "i1"),
    ("batch_size", "i4"), ("prefill_tokens", "i4"), ("decode_tokens", "i4"),
    ("kv_used", "i4"), ("kv_cached", "i4"), ("kv_free", "i4"), ("kv_waste_slots", "i8"),
    ("preempted", "i4"), ("swap_blocks", "i4"), ("copy_blocks", "i4"),
    ("device_s", "f8"), ("host_s", "f8"), ("memory_bytes", "f8"),
])
STEP_COLUMNS: tuple[str, ...] = STEP_DTYPE.names


class StepLog:
    """Per-step records in ``STEP_COLUMNS`` order, kept as columns: a step appends a tuple, and every
    ``CHUNK_STEPS`` of them become one record array (``STEP_DTYPE``), so a long run holds 94 bytes a
    step rather than a tuple of boxed values, at about 0.6 us a step."""

    CHUNK_STEPS = 4096

    def __init__(self, table: np.ndarray | None = None) -> None:
        """``table``: steps recorded already, as a record array of ``STEP_DTYPE`` (kept, not copied)."""
        self._chunks: list[np.ndarray] = [] if table is None else [table]
        self._tail: list[tuple] = []
        self._sealed = sum(map(len, self._chunks))

    def add_rows(self, rows) -> None:
        """Steps as :meth:`rows` gives them (a kind by name, None where not measured)."""
        for row in rows:
            self._append((*row[:4], _KIND_CODE[row[4]], *row[5:]))

    def add_step(self, plan: StepPlan, start_s: float, duration_s: float, counts: tuple[int, int, int, int], timing) -> None:
        measured = timing is not None
        shape = plan.shape
        self._append((
            plan.step,
            start_s,
            duration_s,
            int(measured),  # timed: 0 when there was nothing to run (only rejections)
            _KIND_CODE[shape.kind],
            shape.num_seqs,
            shape.prefill_tokens,
            shape.decode_tokens,
            *counts,  # kv_used, kv_cached, kv_free, kv_waste_slots
            len(plan.preempted),
            len(plan.swap_out) + len(plan.swap_in),
            len(plan.copies),
            # measured figures exist only in real runs; None (stored as NaN) elsewhere
            timing.device_s if measured else None,
            timing.host_s if measured else None,
            timing.memory_bytes if measured else None,
        ))  # fmt: skip

    def _append(self, row: tuple) -> None:
        self._tail.append(row)
        if len(self._tail) >= self.CHUNK_STEPS:
            self._seal()

    def _seal(self) -> None:
        """The tail's rows into a chunk of their own."""
        self._chunks.append(np.array(self._tail, dtype=STEP_DTYPE))
        self._sealed += len(self._tail)
        self._tail = []

    def table(self) -> np.ndarray:
        """Every step as one record array (``STEP_DTYPE``); the chunks are merged into it once asked."""
        if self._tail:
            self._seal()
        if len(self._chunks) != 1:
            self._chunks = [np.concatenate(self._chunks) if self._chunks else np.empty(0, dtype=STEP_DTYPE)]
        return self._chunks[0]

    def __len__(self) -> int:
        return self._sealed + len(self._tail)

    def array(self, name: str) -> np.ndarray:
        """One column as stored (a kind by its index in ``STEP_KINDS``, NaN where not measured), as
        an array of its own: numpy sums a strided field in buffered blocks, which rounds otherwise
        than the pairwise sum of a contiguous array (summary figures would move in the last digit)."""
        return np.ascontiguousarray(self.table()[name])

    def column(self, name: str) -> list:
        """One column as plain values: a kind by name, None where not measured."""
        return plain_step_values(name, self.array(name))

    @property
    def columns(self) -> dict[str, list]:
        """Every column as :meth:`column` gives it (built on each call)."""
        return {name: self.column(name) for name in STEP_COLUMNS}

    def rows(self) -> list[tuple]:
        """Every step as a tuple of plain values, in ``STEP_COLUMNS`` order (what steps.csv holds)."""
        return list(zip(*self.columns.values()))


def plain_step_values(name: str, values: np.ndarray) -> list:
    """A stored step column as Python values: kinds named, NaN as None, whole byte counts as ints."""
    if name == "kind":
        return [STEP_KINDS[code] for code in values.tolist()]
    if name in MEASURED_STEP_COLUMNS:
        as_int = name == "memory_bytes"
        return [None if v != v else int(v) if as_int else v for v in values.tolist()]
    return values.tolist()


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

    def compact_gaps(self) -> GapCounts:
        """Every inter-token gap, as distinct step gaps with how many sequences saw each."""
        self._fold_runs()
        return GapCounts(np.concatenate(self.gap_values + [np.frombuffer(self._pending_gaps, dtype=np.float64)]),
                         np.concatenate(self.gap_counts + [np.ones(len(self._pending_gaps), dtype=np.int64)]))

    def all_gaps(self) -> np.ndarray:
        """Every inter-token gap."""
        gaps = self.compact_gaps()
        return np.repeat(gaps.values, gaps.counts)


@dataclass
class GapCounts:
    """Inter-token gaps as values and how often each occurs: a run's gaps without the repeats
    (a decode batch's members share their steps' gaps), what a cluster's workers send back."""

    values: np.ndarray
    counts: np.ndarray

    @classmethod
    def concat(cls, parts: list[GapCounts]) -> GapCounts:
        if not parts:
            return cls(np.empty(0), np.empty(0, dtype=np.int64))
        return cls(np.concatenate([p.values for p in parts]), np.concatenate([p.counts for p in parts]))


def distribution(values) -> dict[str, float | None]:
    """``{mean, p50, p90, p99}`` of ``values`` (None entries when empty)."""
    arr = np.sort(np.asarray(values, dtype=np.float64))  # sorted: the mean does not depend on order
    if arr.size == 0:
        return {"mean": None, **{f"p{p}": None for p in PERCENTILES}}
    mean = float(arr.mean())  # before the percentiles reorder the copy
    pct = np.percentile(arr, PERCENTILES, overwrite_input=True)
    return {"mean": mean, **{f"p{p}": float(v) for p, v in zip(PERCENTILES, pct)}}


def distribution_of_counts(values: np.ndarray, counts: np.ndarray) -> dict[str, float | None]:
    """:func:`distribution` of ``values`` each repeated ``counts`` times, without repeating them:
    every inter-token gap of a million requests is 200 million floats (1.6 GB), their distinct
    values a few million. The percentiles are numpy's linear ones on the repeated sorted values,
    read where numpy reads them (the two neighbours of each percentile's position, weighed as
    numpy weighs them), so they are the same to the last bit. The mean is the sum over distinct
    values of value times count, over the total: it may round otherwise than a sum of the repeats
    in the last digit, but not otherwise for the same gaps grouped otherwise (a decode batch's
    runs against one gap at a time)."""
    distinct, where = np.unique(values, return_inverse=True)
    counts = np.bincount(where, weights=counts, minlength=len(distinct)).astype(np.int64)
    n = int(counts.sum())
    if n == 0:
        return distribution([])
    ends = np.cumsum(counts)  # repeat k of the sorted whole is distinct[first end > k]
    position = (n - 1) * np.true_divide(PERCENTILES, 100)
    below = np.minimum(np.floor(position), n - 1)
    low = distinct[np.searchsorted(ends, below.astype(np.int64), side="right")]
    high = distinct[np.searchsorted(ends, np.minimum(below + 1, n - 1).astype(np.int64), side="right")]
    weight = position - below
    step = high - low
    pct = low + step * weight
    np.subtract(high, step * (1 - weight), out=pct, where=weight >= 0.5)
    mean = float((distinct * counts).sum() / n)
    return {"mean": mean, **{f"p{p}": float(v) for p, v in zip(PERCENTILES, pct)}}


def summarize(requests: RequestRecords, gaps: GapCounts, steps, num_blocks: int, kv_stats) -> dict:
    """The run's headline figures (the ``summary.json`` keys, less config and wall time); ``steps``:
    a StepLog, or anything giving its columns by ``array(name)`` in the order of their end times."""
    roots = requests.is_root
    finished = requests.is_status(Status.FINISHED)
    done = roots & requests.family_done
    rejected = roots & requests.is_status(Status.REJECTED)
    arrival = requests.arrival_s
    durations = steps.array("duration_s")
    starts = steps.array("start_s")
    end = float(starts[-1] + durations[-1]) if len(durations) else 0.0
    first_arrival = float(arrival[roots].min()) if roots.any() else 0.0
    makespan = max(end - first_arrival, 0.0)
    output_tokens = int(requests.generated_tokens[finished].sum())
    used = steps.array("kv_used")
    busy = float(durations.sum()) if len(durations) else 0.0
    first_token = requests.first_token_s
    answered = roots & ~np.isnan(first_token)
    streamed = finished & (requests.generated_tokens > 1)
    completed = int(done.sum())
    return {
        "requests_completed": completed,
        "requests_rejected": int(rejected.sum()),
        "duration_s": makespan,
        "throughput_tok_s": output_tokens / makespan if makespan > 0 else 0.0,
        "request_rate_rps": completed / makespan if makespan > 0 else 0.0,
        "ttft_s": distribution(first_token[answered] - arrival[answered]),
        "tpot_s": distribution(requests.tpot_s()[streamed]),
        "itl_s": distribution_of_counts(gaps.values, gaps.counts),
        "e2e_s": distribution(requests.family_finish_s[done] - arrival[done]),
        "preemptions": int(requests.preemptions.sum()),
        "prefix_hit_rate": kv_stats.prefix_hit_tokens / kv_stats.prefix_query_tokens if kv_stats.prefix_query_tokens else 0.0,
        "resume_hit_blocks": kv_stats.resume_hit_blocks,  # blocks re-admitted preempted requests found cached
        "num_kv_blocks": num_blocks,
        "peak_kv_blocks_used": int(used.max()) if len(used) else 0,
        "mean_kv_usage": float((used * durations).sum() / busy / num_blocks) if busy > 0 else 0.0,
        "output_tokens": output_tokens,
        "steps": len(steps),
        "rejection_reasons": _count(requests.reject_reason[rejected].tolist()),
    }


def _count(items) -> dict[str, int]:
    out: dict[str, int] = {}
    for item in items:
        out[item] = out.get(item, 0) + 1
    return dict(sorted(out.items()))
