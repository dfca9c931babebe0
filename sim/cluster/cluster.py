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

import numpy as np
import simpy

from kvsim.policies.request import Request
from kvsim.policies.trace_feed import request_id_of
from kvsim.sim.cluster.routers import ClusterView, InstanceState, Router, RouteRequest, RouterError
from kvsim.sim.perf.step_timer import StepTimer
from kvsim.sim.run.config import ResolvedRun
from kvsim.sim.run.metrics import StepLog, summarize
from kvsim.sim.run.simulator import SimOptions, SimRun, Simulation, cyclic_gc_paused
from kvsim.traces.schema import Trace


@dataclass
class ClusterRun:
    runs: list[SimRun]  # one per instance
    placement: np.ndarray  # trace row -> instance
    wall_s: float

    def summary(self) -> dict:
        per_instance = [run.summary() for run in self.runs]
        requests = [r for run in self.runs for r in run.requests]
        steps = StepLog(sorted((row for run in self.runs for row in run.steps.rows), key=lambda row: row[1] + row[2]))
        stats = [run.engine.kv_stats() for run in self.runs]
        total_blocks = sum(run.engine.config.num_blocks for run in self.runs)
        out = summarize(requests, _Gaps(self.runs), steps, total_blocks, _SummedStats(stats))
        busy = [float(run.steps.array("duration_s").sum()) if len(run.steps) else 0.0 for run in self.runs]
        out["peak_kv_blocks_used"] = sum(s["peak_kv_blocks_used"] for s in per_instance)
        out["mean_kv_usage"] = (sum(b * s["mean_kv_usage"] for b, s in zip(busy, per_instance)) / sum(busy)) if sum(busy) else 0.0
        out["wall_s"] = self.wall_s
        out["instances"] = [{"instance": i, "requests_routed": int((self.placement == i).sum()), **s}
                            for i, s in enumerate(per_instance)]
        return out

    def request_tuples(self) -> list[tuple]:
        """requests.csv rows with the instance that served each, last."""
        return [(*row, i) for i, run in enumerate(self.runs) for row in run.request_tuples()]


class _Gaps:
    """Every instance's inter-token gaps, as summarize reads a run's (TokenTimes.all_gaps)."""

    def __init__(self, runs: list[SimRun]) -> None:
        self.runs = runs

    def all_gaps(self, ascending: bool = False) -> np.ndarray:
        gaps = np.concatenate([run.times.all_gaps() for run in self.runs]) if self.runs else np.empty(0)
        return np.sort(gaps) if ascending else gaps


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


class ClusterSimulation:
    def __init__(self, trace: Trace, resolved: ResolvedRun, timers: list[StepTimer], router: Router,
                 staleness_s: float = 0.0, options: list[SimOptions] | None = None) -> None:
        if not timers:
            raise ValueError("a cluster needs at least one instance")
        if staleness_s < 0:
            raise ValueError(f"router staleness must be >= 0 s, got {staleness_s}")
        self.trace, self.router, self.staleness_s = trace, router, staleness_s
        self.env = simpy.Environment()
        options = options or [SimOptions() for _ in timers]
        self.instances = [Simulation(trace, resolved.new_engine(), timer, opts, env=self.env)
                          for timer, opts in zip(timers, options)]
        self.in_flight = [0] * len(timers)
        self.placement = np.full(len(trace), -1, dtype=np.int64)
        self._scrape: tuple[InstanceState, ...] = ()
        self._scraped_at = -np.inf
        for i, sim in enumerate(self.instances):
            sim.serve_routed()
            sim.on_ended = self._ended_on(i)

    def _ended_on(self, instance: int):
        def ended(finished: list[Request], rejected: list[tuple[str, str]]) -> None:
            rows = [r.trace_index for r in finished if r.parent is None]
            rows += [int(rid) for rid, _ in rejected if rid.isdigit()]
            for row in rows:
                self.in_flight[instance] -= 1
                self.router.ended(row, instance)
        return ended

    def view(self) -> ClusterView:
        now = self.env.now
        if now - self._scraped_at >= self.staleness_s or not self._scrape:
            self._scrape = tuple(
                InstanceState(len(sim.engine.waiting), len(sim.engine.running),
                              sim.engine.kv_counts()[0] / sim.engine.config.num_blocks)
                for sim in self.instances)
            self._scraped_at = now
        return ClusterView(self._scrape, tuple(self.in_flight), self._scraped_at)

    def _route_process(self):
        trace, env = self.trace, self.env
        arrivals = trace.arrival_s.tolist()
        for row, arrival in enumerate(arrivals):
            if arrival > env.now:
                yield env.timeout(arrival - env.now)
            hashes = trace.hashes_of(row)
            request = RouteRequest(row, arrival, int(trace.prompt_tokens[row]),
                                   () if hashes is None else tuple(int(h) for h in hashes),
                                   None if trace.session_id is None else int(trace.session_id[row]))
            name = type(self.router).__name__
            try:
                chosen = self.router.choose(request, self.view())
            except Exception as exc:  # a plug-in's failure, named as such
                raise RouterError(f"router {name} raised {type(exc).__name__}: {exc} (request {request_id_of(row)})") from None
            if not (isinstance(chosen, (int, np.integer)) and 0 <= chosen < len(self.instances)):
                raise RouterError(f"router {name} chose {chosen!r} for request {request_id_of(row)}: "
                                  f"not an instance index in [0, {len(self.instances)})")
            chosen = int(chosen)
            self.placement[row] = chosen
            self.in_flight[chosen] += 1
            self.router.routed(request, chosen)
            self.instances[chosen].hand(row)
        for sim in self.instances:
            sim.feeding_over()

    def run(self) -> ClusterRun:
        started = time.perf_counter()
        self.env.process(self._route_process())
        done = [sim.start() for sim in self.instances]
        with cyclic_gc_paused():
            self.env.run(until=simpy.AllOf(self.env, done))
        wall = time.perf_counter() - started
        return ClusterRun([sim.result(wall) for sim in self.instances], self.placement, wall)
