"""Capacity search: the highest request rate a configuration serves within its latency SLOs.

For each configuration, the trace's arrival process is scaled to a request rate (the
trace's shape kept, as ``request_rate`` does) and simulated. The search gallops from the
trace's own rate (steps of ``1 + tolerance``, squared after each probe) until one rate
meets the SLOs and another misses, then bisects geometrically until they are within
``tolerance``. (A first pass on the trace's first fifth to pick the starting rate was
measured slower on the Azure conversation trace: its answers were 5-15 % off the whole
trace's, so the full-trace probes were not saved.)

A rate meets the SLOs when, at ``percentile``, TTFT, TPOT and end-to-end latency are within
their objectives (those given). Requests rejected for their size (longer than
``max_model_len``, ...) would be rejected at any rate and are left out; requests rejected
for load (``queue_full``, ``unschedulable``) count as misses. A run that has already missed
its TTFT or end-to-end objective for more requests than the percentile allows stops early:
overloaded probes, the slowest to simulate, end as soon as their answer is certain.

Goodput at the capacity is the rate of requests meeting every objective, per second of the
run (as in ``kvsim report compare``).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import asdict, dataclass, field

import numpy as np

from kvsim.policies.request import Request, Status
from kvsim.sim.cluster.runner import run_cluster
from kvsim.sim.perf.cost_model import CostModelTimer
from kvsim.sim.run.config import RunConfig, load_run_trace, resolve
from kvsim.sim.run.request_records import RequestRecords
from kvsim.sim.run.simulator import simulate
from kvsim.traces.schema import Trace

LOAD_REJECTIONS = frozenset({"queue_full", "unschedulable"})  # a lighter load would have served them
MAX_RANGE = 4096.0  # the search gives up beyond 4096x its starting rate (or 1/4096 of it)


@dataclass(frozen=True)
class Slo:
    """Latency objectives at a percentile; an objective left None is not checked."""

    ttft_s: float | None = None
    tpot_s: float | None = None
    e2e_s: float | None = None
    percentile: float = 99.0

    def __post_init__(self) -> None:
        if self.ttft_s is None and self.tpot_s is None and self.e2e_s is None:
            raise ValueError("capacity needs at least one SLO: ttft_s, tpot_s or e2e_s")
        for name in ("ttft_s", "tpot_s", "e2e_s"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value > 0):
                raise ValueError(f"SLO {name} = {value!r}: must be a finite number of seconds > 0")
        if not 0 < self.percentile <= 100:
            raise ValueError(f"SLO percentile = {self.percentile!r}: must be in (0, 100]")

    def describe(self) -> str:
        goals = [f"{name} <= {value:g} s" for name, value in (("TTFT", self.ttft_s), ("TPOT", self.tpot_s), ("E2E", self.e2e_s))
                 if value is not None]
        return f"p{self.percentile:g} " + ", ".join(goals)


@dataclass
class Probe:
    """One simulation at one rate: whether it met the SLOs, and what it measured."""

    rate: float
    met: bool
    stopped_early: bool = False
    latencies: dict[str, float | None] = field(default_factory=dict)  # metric -> value at the percentile
    goodput_rps: float | None = None
    completed: int = 0
    rejected_for_load: int = 0


@dataclass
class Capacity:
    """A configuration's capacity: the highest rate that met the SLOs (0.0 if none did)."""

    name: str
    settings: dict
    capacity_rps: float
    bracket: tuple[float, float | None]  # (met, missed); missed None when even the highest rate met
    trace_rate_rps: float
    probes: list[Probe]
    error: str = ""

    @property
    def at_capacity(self) -> Probe | None:
        met = [p for p in self.probes if p.met and p.rate == self.capacity_rps]
        return met[0] if met else None

    def row(self) -> dict:
        best = self.at_capacity
        out = {"name": self.name, **self.settings, "capacity_rps": self.capacity_rps,
               "missed_at_rps": self.bracket[1], "trace_rate_rps": self.trace_rate_rps, "probes": len(self.probes),
               "goodput_rps": best.goodput_rps if best else None}
        for metric, value in (best.latencies if best else {}).items():
            out[f"{metric}_at_capacity"] = value
        out["error"] = self.error
        return out

    def to_dict(self) -> dict:
        return {**asdict(self), "bracket": list(self.bracket)}


class SloMissed(Exception):
    """Raised from inside a run once its answer is certainly "missed"."""


class SloWatch:
    """A step timer wrapper that stops a run once too many requests have missed a deadline.

    It sees every request as it arrives and every step. A request misses TTFT (or E2E) once
    its first token (or last) is later than arrival + objective, or, still without one, once
    a lower bound of the engine's clock (the latest arrival admitted, the busy time so far)
    passes that deadline. More misses than the percentile allows of all the trace's requests
    decide the run; counting against the whole trace keeps the early answer conservative.
    """

    def __init__(self, inner: CostModelTimer, slo: Slo, num_requests: int) -> None:
        self.inner = inner
        self.deadlines = {k: v for k, v in (("first_token_s", slo.ttft_s), ("finish_s", slo.e2e_s)) if v is not None}
        # np.percentile (linear) exceeds the objective once misses k >= N - (N-1) p/100; one more for safety
        self.allowed = num_requests - (num_requests - 1) * slo.percentile / 100.0 + 1
        self.pending = {key: deque() for key in self.deadlines}
        self.misses = dict.fromkeys(self.deadlines, 0)
        self.latest_arrival = 0.0
        self.busy_s = 0.0
        self.plan_detail = inner.plan_detail  # it reads what the cost model reads, and requests

    def add_request(self, request: Request) -> None:
        self.inner.add_request(request)
        self.latest_arrival = max(self.latest_arrival, request.arrival_s)
        for queue in self.pending.values():
            queue.append(request)

    def step(self, plan):
        timing = self.inner.step(plan)
        self.busy_s += timing.duration_s
        now = max(self.latest_arrival, self.busy_s)
        for key, objective in self.deadlines.items():
            queue = self.pending[key]
            while queue:
                r = queue[0]
                if r.status is Status.REJECTED:
                    self.misses[key] += r.reject_reason in LOAD_REJECTIONS
                elif getattr(r, key) is not None:
                    self.misses[key] += getattr(r, key) - r.arrival_s > objective
                elif now - r.arrival_s > objective:
                    self.misses[key] += 1
                else:
                    break
                queue.popleft()
            if self.misses[key] >= self.allowed:
                raise SloMissed(key)
        return timing


def evaluate(requests: RequestRecords, summary: dict, slo: Slo) -> Probe:
    """Latencies at the percentile, whether they meet the SLOs, and goodput, from a finished run's
    requests (a cluster's as users see them) and its summary; a latency not reached counts as
    infinite (a request of n > 1 samples: its worst sample's)."""
    roots = requests.is_root
    rejected = roots & requests.is_status(Status.REJECTED)
    for_load = rejected & np.isin(requests.reject_reason, sorted(LOAD_REJECTIONS))
    served = roots & (~rejected | for_load)
    arrival = requests.arrival_s[served]
    per_request = {"ttft_s": requests.first_token_s[served] - arrival,
                   "tpot_s": requests.family_tpot_s[served],
                   "e2e_s": requests.family_finish_s[served] - arrival}
    latencies: dict[str, float | None] = {}
    met = bool(served.any())
    good = np.ones(int(served.sum()), dtype=bool)
    for name, objective in (("ttft_s", slo.ttft_s), ("tpot_s", slo.tpot_s), ("e2e_s", slo.e2e_s)):
        if objective is None:
            continue
        values = np.where(np.isnan(per_request[name]), math.inf, per_request[name])
        at = float(np.percentile(values, slo.percentile)) if len(values) else math.inf
        latencies[name] = at if math.isfinite(at) else None
        met = met and at <= objective
        good &= values <= objective
    duration = summary["duration_s"]
    return Probe(
        rate=0.0, met=met, latencies=latencies,
        goodput_rps=float(good.sum()) / duration if duration > 0 else 0.0,
        completed=summary["requests_completed"],
        rejected_for_load=int(for_load.sum()),
    )


def probe(config: RunConfig, rate: float, slo: Slo) -> Probe:
    """Simulate ``config`` with its trace scaled to ``rate`` req/s and judge it against ``slo``.

    A cluster (instances behind a router, P/D pools) runs as ``kvsim simulate`` runs it, to the
    end: the early stop watches one engine's steps."""
    at_rate = config.updated(request_rate=rate)
    resolved = resolve(at_rate)
    trace = load_run_trace(at_rate)
    if config.is_cluster:
        cluster, summary = run_cluster(resolved, trace, None, decisions="off")
        result = evaluate(cluster.user_records(), summary, slo)
    else:
        watch = SloWatch(CostModelTimer(resolved.cost_model()), slo, len(trace))
        try:
            run = simulate(trace, resolved.new_engine(), watch)
        except SloMissed as missed:
            return Probe(rate=rate, met=False, stopped_early=True, latencies={str(missed): None})
        result = evaluate(run.records.requests, run.summary(), slo)
    result.rate = rate
    return result


def trace_rate(config: RunConfig) -> float:
    """The mean request rate of the configuration's trace as the run would see it."""
    trace: Trace = load_run_trace(config.updated(request_rate=None))
    span = float(trace.arrival_s[-1] - trace.arrival_s[0])
    if len(trace) < 2 or span <= 0:
        raise ValueError(f"{config.trace}: capacity search needs arrivals spread over time")
    return (len(trace) - 1) / span


def search(name: str, settings: dict, config: RunConfig, slo: Slo, tolerance: float = 0.02) -> Capacity:
    """Bracket, then bisect, the highest rate meeting ``slo``; a failure is recorded, not raised."""
    try:
        return _search(name, settings, config, slo, tolerance)
    except Exception as exc:  # one bad configuration must not lose the others' answers
        return Capacity(name, settings, 0.0, (0.0, None), 0.0, [], f"{type(exc).__name__}: {' '.join(str(exc).split())}")


def _search(name: str, settings: dict, config: RunConfig, slo: Slo, tolerance: float) -> Capacity:
    if config.rate_scale != 1.0:
        raise ValueError("capacity scales the trace itself: leave rate_scale at 1 (request_rate sets the first probe)")
    base = trace_rate(config)
    probes: list[Probe] = []
    met, missed = gallop(lambda rate: _record(probes, probe(config, rate, slo)), config.request_rate or base, tolerance)
    return Capacity(name, settings, met or 0.0, (met or 0.0, missed), base, probes)


def _record(probes: list[Probe], result: Probe) -> bool:
    probes.append(result)
    return result.met


def gallop(meets, start: float, tolerance: float) -> tuple[float | None, float | None]:
    """(highest rate found meeting, lowest rate found missing), within ``1 + tolerance`` of
    each other, for a ``meets(rate)`` that holds below some rate and fails above it.

    From ``start`` it steps up (or down) by ``1 + tolerance``, squaring the step after each
    probe, until the answer flips, then bisects geometrically. Either side is None when the
    search reached ``MAX_RANGE`` times (or 1/``MAX_RANGE`` of) ``start`` without a flip.
    """
    met, missed = (start, None) if meets(start) else (None, start)
    step = 1.0 + tolerance
    while met is None or missed is None:
        if missed is None:
            if met >= start * MAX_RANGE:
                return met, None
            rate = min(met * step, start * MAX_RANGE)
            met, missed = (rate, None) if meets(rate) else (met, rate)
        else:
            if missed <= start / MAX_RANGE:
                return None, missed
            rate = max(missed / step, start / MAX_RANGE)
            met, missed = (rate, missed) if meets(rate) else (None, rate)
        step *= step
    while missed > met * (1.0 + tolerance):
        rate = math.sqrt(met * missed)
        met, missed = (rate, missed) if meets(rate) else (met, rate)
    return met, missed
