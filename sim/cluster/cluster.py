"""Instances behind a router, in one event loop.

Every instance is a whole engine (its own EngineCore, block pool and step timer, the same
model, device and layout) driven by sim/run/simulator.py's engine process in one SimPy
environment. A router process replays the trace's arrivals: at each arrival it reads the
cluster view, as scraped at most ``staleness_s`` ago (0: live), and its own in-flight counters,
picks an instance, and hands it the request, which that instance admits at its next step as a
single engine admits an arrival. Counters fall when the instance finishes or rejects the request.

The run's figures are the cluster's (every request of every instance); ``instances`` in the
summary holds each instance's own summary. The KV figures add up: ``num_kv_blocks`` and
``peak_kv_blocks_used`` are sums over instances (the peaks need not coincide), ``mean_kv_usage``
the busy-time-weighted mean of the instances'.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from functools import cached_property, partial
from pathlib import Path

import numpy as np
import simpy

from kvsim.policies.kv_store import share_store
from kvsim.policies.request import Request
from kvsim.policies.trace_feed import request_id_of
from kvsim.sim.cluster.autoscaler import Autoscaler
from kvsim.sim.cluster.routers import ClusterView, InstanceState, Router, RouteRequest, RouterError
from kvsim.sim.perf.step_timer import StepTimer
from kvsim.sim.run.config import ResolvedRun
from kvsim.sim.run.metrics import STEP_DTYPE, GapCounts, StepLog, summarize
from kvsim.sim.run.outputs import write_requests, write_steps
from kvsim.sim.run.request_records import RequestRecords
from kvsim.sim.run.simulator import RunRecords, SimOptions, SimRun, Simulation, cyclic_gc_paused
from kvsim.traces.schema import Trace


@dataclass(frozen=True)
class Scaling:
    """An autoscaler and its bounds (sim/cluster/autoscaler.py)."""

    autoscaler: Autoscaler
    min_instances: int
    max_instances: int
    interval_s: float = 10.0
    cold_start_s: float = 0.0  # weights read + engine start-up

    def __post_init__(self) -> None:
        if not 1 <= self.min_instances <= self.max_instances:
            raise ValueError(f"autoscaler bounds: need 1 <= min_instances ({self.min_instances}) <= max_instances "
                             f"({self.max_instances})")
        if self.interval_s <= 0 or self.cold_start_s < 0:
            raise ValueError("autoscaler interval_s must be > 0 and cold_start_s >= 0")


@dataclass
class ScaledPool:
    """One pool's instances under its autoscaler: which serve, and when each was launched and retired."""

    scaling: Scaling | None  # None: the pool keeps its size
    serving: list[bool]
    launched_s: list[float | None]  # None: never launched (a spare)
    retired_s: list[float | None]  # None: serving to the end

    @classmethod
    def of(cls, scaling: Scaling | None, size: int, first: int) -> ScaledPool:
        """``size`` instances the pool may run, the first ``first`` serving from the start."""
        if not 1 <= first <= size:
            raise ValueError(f"initial instances {first} must be in [1, {size}]")
        return cls(scaling, [i < first for i in range(size)], [0.0 if i < first else None for i in range(size)], [None] * size)

    def decide(self, view: ClusterView, now: float) -> tuple[str, int] | None:
        """Ask the autoscaler about the instances in service: ("launch", a spare that serves once
        its cold start is over, :meth:`serve`), ("retire", the newest, taking no new request now),
        or None, within the bounds."""
        live = [i for i, on in enumerate(self.serving) if on]
        in_service = ClusterView(tuple(view.instances[i] for i in live), tuple(view.in_flight[i] for i in live),
                                 view.scraped_at_s)
        change = self.scaling.autoscaler.decide(in_service)
        started = sum(1 for i, t in enumerate(self.launched_s) if t is not None and self.retired_s[i] is None)
        if change > 0 and started < self.scaling.max_instances:
            spare = next((i for i, t in enumerate(self.launched_s) if t is None), None)
            if spare is not None:
                self.launched_s[spare] = now
                return "launch", spare
        elif change < 0 and len(live) > self.scaling.min_instances:
            newest = max(live, key=lambda i: self.launched_s[i])
            self.serving[newest] = False
            self.retired_s[newest] = now
            return "retire", newest
        return None


@dataclass
class ClusterRun:
    runs: list[SimRun]  # one per instance (every instance an autoscaler could launch); empty when workers ran them
    placement: np.ndarray  # trace row -> instance
    wall_s: float
    launched_s: list[float | None]  # when each instance was launched (None: never)
    retired_s: list[float | None]  # when each was scaled down (None: served to the end)
    timeline: list[tuple[float, int]]  # (time, instances serving) at every change
    sent_records: list[RunRecords] | None = None  # the instances' runs as workers sent them back (partitioned.py)

    @cached_property
    def records(self) -> list[RunRecords]:
        """Each instance's run as columns: all the summary and the files read."""
        return self.sent_records if self.sent_records is not None else [run.records for run in self.runs]

    @cached_property
    def steps_by_end(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Every instance's steps as one record array, each step's instance, and the steps' order by end
        time (ties: by instance, then step). Each instance's log becomes a view of that array, so a
        million-request run's 4.7 million steps are held once."""
        tables = [one.steps.table() for one in self.records]
        table = np.concatenate(tables) if tables else np.empty(0, dtype=STEP_DTYPE)
        bounds = np.cumsum([0] + [len(t) for t in tables])
        for one, first, stop in zip(self.records, bounds[:-1], bounds[1:]):
            one.steps = StepLog(table[first:stop])
        instance = np.repeat(np.arange(len(tables)), np.diff(bounds))
        return table, instance, np.argsort(table["start_s"] + table["duration_s"], kind="stable")

    def user_records(self) -> RequestRecords:
        """The requests as users see them: every instance's (a P/D cluster's: one a trace row)."""
        return RequestRecords.concat([one.requests for one in self.records])

    def prefix_stats(self) -> _SummedStats:
        return _SummedStats([one.kv_stats for one in self.records])

    def routed_to(self, instance: int) -> int:
        return int((self.placement == instance).sum())

    def summary(self) -> dict:
        per_instance = [one.summary() for one in self.records]
        stores = [s.pop("kv_store") for s in per_instance if "kv_store" in s]  # one store, shared
        requests = self.user_records()
        table, _, order = self.steps_by_end
        total_blocks = sum(one.num_blocks for one in self.records)
        gaps = GapCounts.concat([one.gaps for one in self.records])
        out = summarize(requests, gaps, _StepsInOrder(table, order), total_blocks, self.prefix_stats())
        busy = [float(one.steps.array("duration_s").sum()) for one in self.records]
        out["peak_kv_blocks_used"] = sum(s["peak_kv_blocks_used"] for s in per_instance)
        out["mean_kv_usage"] = (sum(b * s["mean_kv_usage"] for b, s in zip(busy, per_instance)) / sum(busy)) if sum(busy) else 0.0
        out["wall_s"] = self.wall_s
        out["instances"] = [{"instance": i, "requests_routed": self.routed_to(i), **s}
                            for i, s in enumerate(per_instance) if self.launched_s[i] is not None]
        end = out["duration_s"] + (float(requests.arrival_s.min()) if len(requests) else 0.0)
        seconds = sum(self._stopped(i, end) - start for i, start in enumerate(self.launched_s) if start is not None)
        out["instance_seconds"] = seconds
        out["completed_per_instance_hour"] = out["requests_completed"] / (seconds / 3600) if seconds > 0 else 0.0
        out["instances_over_time"] = [list(point) for point in self.timeline]
        if stores:
            out["kv_store"] = stores[0]
        return out

    def _stopped(self, i: int, end: float) -> float:
        """An instance runs until the run's end, or, once scaled down, until its last step ends."""
        retired = self.retired_s[i]
        if retired is None:
            return end
        steps = self.records[i].steps
        last = float(steps.array("start_s")[-1] + steps.array("duration_s")[-1]) if len(steps) else retired
        return max(retired, last)

    def write_files(self, out_dir: Path) -> None:
        """requests.csv and steps.csv, each row with its instance, last; the steps by end time."""
        self.write_request_rows(out_dir)
        write_steps(out_dir, *self.steps_by_end)

    def write_request_rows(self, out_dir: Path) -> None:
        """requests.csv: every instance's requests in turn, the instance last."""
        served_by = np.repeat(np.arange(len(self.records)), [len(one.requests) for one in self.records])
        write_requests(out_dir, self.user_records(), served_by)


@dataclass
class _StepsInOrder:
    """The instances' step columns in the order of their end times, read as summarize reads a StepLog's."""

    table: np.ndarray
    order: np.ndarray

    def array(self, name: str) -> np.ndarray:
        return self.table[name][self.order]

    def __len__(self) -> int:
        return len(self.order)


@dataclass
class _SummedStats:
    """The prefix-cache counters summarize reads, summed over instances."""

    prefix_query_tokens: int
    prefix_hit_tokens: int
    resume_hit_blocks: int

    def __init__(self, stats: list) -> None:
        self.prefix_query_tokens = sum(s.prefix_query_tokens for s in stats)
        self.prefix_hit_tokens = sum(s.prefix_hit_tokens for s in stats)
        self.resume_hit_blocks = sum(s.resume_hit_blocks for s in stats)


def instance_state(sim: Simulation) -> InstanceState:
    """A scrape of one instance's queue and KV usage."""
    engine = sim.engine
    return InstanceState(len(engine.waiting), len(engine.running), engine.kv_counts()[0] / engine.config.num_blocks)


class Scrape:
    """The instances' states as a metrics scraper last read them: read again once ``staleness_s`` has
    passed (0: on every look), as real routers see scraped metrics.

    A read recomputes only the instances whose engine ran since the last read (each instance's
    ``on_state_change`` marks it): a live view over 64 instances would otherwise cost 64 engine
    scrapes an arrival, most of them of engines that had not moved."""

    def __init__(self, staleness_s: float, instances: list[Simulation]) -> None:
        self.staleness_s = staleness_s
        self.instances = instances
        self.at_s = -np.inf
        self.changed = set(range(len(instances)))
        self._states: list[InstanceState] = [InstanceState(0, 0, 0.0)] * len(instances)
        self._view: tuple[InstanceState, ...] = ()
        for i, sim in enumerate(instances):
            sim.on_state_change = partial(self.changed.add, i)

    def read(self, now: float) -> tuple[tuple[InstanceState, ...], float]:
        """(the states, when they were scraped) as of ``now``."""
        if now - self.at_s >= self.staleness_s:
            self.at_s = now
            if self.changed:
                for i in self.changed:
                    self._states[i] = instance_state(self.instances[i])
                self.changed.clear()
                self._view = tuple(self._states)
        return self._view, self.at_s


def route_request(trace: Trace, row: int) -> RouteRequest:
    hashes = trace.hashes_of(row)
    return RouteRequest(row, float(trace.arrival_s[row]), int(trace.prompt_tokens[row]),
                        () if hashes is None else tuple(hashes.tolist()),
                        None if trace.session_id is None else int(trace.session_id[row]))


def ended_rows(finished: list[Request], rejected: list[tuple[str, str]]) -> list[int]:
    """The trace rows a step ended: its finished requests (not their parallel samples) and rejections."""
    rows = [r.trace_index for r in finished if r.parent is None]
    rows += [int(rid) for rid, _ in rejected if rid.isdigit()]
    return rows


def checked_choice(router: Router, request: RouteRequest, view: ClusterView) -> int:
    """The router's choice, a plug-in's failure (it raised, or named no instance) as a RouterError."""
    name = type(router).__name__
    try:
        chosen = router.choose(request, view)
    except Exception as exc:  # a plug-in's failure, named as such
        raise RouterError(f"router {name} raised {type(exc).__name__}: {exc} (request {request_id_of(request.index)})") from None
    if not (isinstance(chosen, (int, np.integer)) and 0 <= chosen < view.size):
        raise RouterError(f"router {name} chose {chosen!r} for request {request_id_of(request.index)}: "
                          f"not an instance index in [0, {view.size})")
    return int(chosen)


class ClusterSimulation:
    def __init__(self, trace: Trace, resolved: ResolvedRun, timers: list[StepTimer], router: Router,
                 staleness_s: float = 0.0, options: list[SimOptions] | None = None, scaling: Scaling | None = None,
                 initial_instances: int | None = None) -> None:
        """``timers``: one per instance that may run (an autoscaler's maximum); ``initial_instances``
        of them serve from the start (all without an autoscaler)."""
        if not timers:
            raise ValueError("a cluster needs at least one instance")
        if staleness_s < 0:
            raise ValueError(f"router staleness must be >= 0 s, got {staleness_s}")
        self.trace, self.router = trace, router
        self.env = simpy.Environment()
        options = options or [SimOptions() for _ in timers]
        self.instances = [Simulation(trace, resolved.new_engine(), timer, opts, env=self.env)
                          for timer, opts in zip(timers, options)]
        share_store([sim.engine.kv_tiers for sim in self.instances])
        self.in_flight = [0] * len(timers)
        self.placement = np.full(len(trace), -1, dtype=np.int64)
        first = len(timers) if initial_instances is None else initial_instances
        self.pool = ScaledPool.of(scaling, len(timers), first)
        self.timeline: list[tuple[float, int]] = [(0.0, first)]
        self._routing_done = False
        for i, sim in enumerate(self.instances):
            sim.on_ended = self._ended_on(i)
        self.scrape = Scrape(staleness_s, self.instances)

    def _ended_on(self, instance: int):
        def ended(finished: list[Request], rejected: list[tuple[str, str]]) -> None:
            for row in ended_rows(finished, rejected):
                self.in_flight[instance] -= 1
                self.router.ended(row, instance)
        return ended

    def view(self) -> ClusterView:
        states, scraped_at = self.scrape.read(self.env.now)
        serving = self.pool.serving
        return ClusterView(states, tuple(self.in_flight), scraped_at, () if all(serving) else tuple(serving))

    def _route_process(self):
        trace, env = self.trace, self.env
        arrivals = trace.arrival_s.tolist()
        for row, arrival in enumerate(arrivals):
            if arrival > env.now:
                yield env.timeout(arrival - env.now)
            request = route_request(trace, row)
            chosen = checked_choice(self.router, request, self.view())
            if not self.pool.serving[chosen]:
                raise RouterError(f"router {type(self.router).__name__} chose instance {chosen} for request "
                                  f"{request_id_of(row)}, which takes no new requests (ClusterView.candidates lists those that do)")
            self.placement[row] = chosen
            self.in_flight[chosen] += 1
            self.router.routed(request, chosen)
            self.instances[chosen].hand(row)
        self._routing_done = True
        for sim in self.instances:
            sim.feeding_over()

    def _scale_process(self):
        """Every interval: ask the autoscaler; launch (serving after the cold start) or retire one."""
        scaling, env = self.pool.scaling, self.env
        while not self._routing_done:
            yield env.timeout(scaling.interval_s)
            decision = self.pool.decide(self.view(), env.now)
            if decision is not None and decision[0] == "launch":
                env.process(self._serve_after(decision[1], scaling.cold_start_s))
            elif decision is not None:
                self.timeline.append((env.now, sum(self.pool.serving)))

    def _serve_after(self, instance: int, delay_s: float):
        yield self.env.timeout(delay_s)
        self.pool.serving[instance] = True
        self.timeline.append((self.env.now, sum(self.pool.serving)))

    def run(self) -> ClusterRun:
        started = time.perf_counter()
        self.env.process(self._route_process())
        if self.pool.scaling is not None:
            self.env.process(self._scale_process())
        done = [sim.start() for sim in self.instances]
        with cyclic_gc_paused():
            self.env.run(until=simpy.AllOf(self.env, done))
        wall = time.perf_counter() - started
        return ClusterRun([sim.result(wall) for sim in self.instances], self.placement, wall, self.pool.launched_s,
                          self.pool.retired_s, self.timeline)
