"""A cluster's instances partitioned over worker processes that meet the router at an interval.

The one event loop (cluster.py) runs every instance's steps on one core. Here the instances are
dealt out to workers, each running its share (an event loop an instance), and the router (in
the calling process) meets them every ``interval_s``, the router's staleness: at a meeting each
worker reports its instances' state and the requests that ended since the last one, the router
routes every arrival up to the next meeting, and the workers run their instances on to it.
Instances touch one another only through the router, so which worker runs which instance
changes nothing: one worker and eight give the same decisions, byte for byte (a test).

What differs from the one loop, by design: the router's view is the scrape of the last meeting
(stale by at most ``interval_s``, as the one loop's with the same staleness), and its own
in-flight counters learn of ended requests at the next meeting rather than at once. A router
that reads neither (round-robin) routes exactly as in the one loop (a test).

Workers are forked processes joined by pipes (one worker: this process), or Ray actors
(``backend="ray"``, ``pip install 'kvsim[dist]'``), which may sit on other nodes of a Ray cluster.
"""

from __future__ import annotations

import gc
import math
import multiprocessing
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import simpy

from kvsim.policies.request import Request
from kvsim.sim.cluster.cluster import ClusterRun, checked_choice, ended_rows, instance_state, route_request
from kvsim.sim.cluster.routers import ClusterView, InstanceState, Router
from kvsim.sim.perf.cost_model import CostModelTimer
from kvsim.sim.run.config import CLUSTER_BACKENDS, ResolvedRun
from kvsim.sim.run.decisions import DecisionLog
from kvsim.sim.run.distributed import connected_ray
from kvsim.sim.run.simulator import RunRecords, SimOptions, Simulation, cyclic_gc_paused
from kvsim.traces.schema import Trace

Routed = list[tuple[int, int]]  # (trace row, instance), in arrival order


@dataclass(frozen=True)
class Outputs:
    """What each instance records: ``--check``, and its decision log under ``out_dir/instances/<i>``."""

    check: bool = False
    decisions: str = "off"
    out_dir: Path | None = None

    def decision_log(self, instance: int, block_size: int) -> DecisionLog | None:
        if self.out_dir is None or self.decisions == "off":
            return None
        where = self.out_dir / "instances" / str(instance)
        where.mkdir(parents=True, exist_ok=True)
        return DecisionLog(self.decisions, block_size, where)


@dataclass
class Report:
    """A worker at a meeting: its instances' states and what ended since the last meeting."""

    states: dict[int, InstanceState]
    ended: list[tuple[float, int, int, int]] = field(default_factory=list)  # (time, instance, order, row)


class InstanceGroup:
    """A worker's share of the instances. Each runs in its own SimPy environment, one instance after
    another between meetings: they cannot meet before the next one, and an instance run for a
    stretch keeps its engine's data in the CPU's caches (64 instances interleaved step by step
    in one environment took 1.9x the time a step of the same instances run one by one)."""

    def __init__(self, trace: Trace, resolved: ResolvedRun, instances: list[int], outputs: Outputs) -> None:
        self.trace = trace
        block_size = resolved.engine_config.block_size
        self.logs = {i: outputs.decision_log(i, block_size) for i in instances}
        self.sims = {i: Simulation(trace, resolved.new_engine(), CostModelTimer(resolved.cost_model()),
                                   SimOptions(check=outputs.check, decisions=self.logs[i]), env=simpy.Environment())
                     for i in instances}
        self.ended: list[tuple[float, int, int, int]] = []
        for i, sim in self.sims.items():
            sim.on_ended = self._ended_on(i)
        self.done = {i: sim.start() for i, sim in self.sims.items()}

    def _ended_on(self, instance: int) -> Callable[[list[Request], list[tuple[str, str]]], None]:
        env = self.sims[instance].env

        def ended(finished: list[Request], rejected: list[tuple[str, str]]) -> None:
            self.ended.extend((env.now, instance, len(self.ended), row) for row in ended_rows(finished, rejected))
        return ended

    def advance(self, routed: Routed, until: float) -> Report:
        """Hand each routed row to its instance at its arrival, and run every instance to ``until``."""
        self._feed(routed, last=False)
        for sim in self.sims.values():
            if until > sim.env.now:
                sim.env.run(until=until)
        report = Report({i: instance_state(sim) for i, sim in self.sims.items()}, self.ended)
        self.ended = []
        return report

    def finish(self, routed: Routed) -> dict[int, RunRecords]:
        """The last arrivals, then every instance to its end; each instance's run as columns."""
        return dict(self.finish_one_by_one(routed))

    def finish_one_by_one(self, routed: Routed) -> Iterator[tuple[int, RunRecords]]:
        """:meth:`finish`, each instance's engine let go of once its columns are given out: a worker
        process sends them one at a time, so neither side holds a whole share at once."""
        self._feed(routed, last=True)
        for i, sim in self.sims.items():
            sim.env.run(until=self.done[i])
        for log in self.logs.values():
            if log is not None:
                log.close()
        for i in list(self.sims):
            yield i, self.sims.pop(i).result(0.0).records  # the router's process times the run

    def _feed(self, routed: Routed, last: bool) -> None:
        rows: dict[int, list[int]] = {i: [] for i in self.sims}
        for row, instance in routed:
            rows[instance].append(row)
        for i, sim in self.sims.items():
            if rows[i] or last:
                sim.env.process(self._feeder(sim, rows[i], last))

    def _feeder(self, sim: Simulation, rows: list[int], last: bool):
        env, arrivals = sim.env, self.trace.arrival_s
        for row in rows:
            arrival = float(arrivals[row])
            if arrival > env.now:
                yield env.timeout(arrival - env.now)
            sim.hand(row)
        if last:
            sim.feeding_over()


def process_context():
    """Forked workers where the platform forks (they share the trace and the run without a copy),
    spawned ones elsewhere (macOS, Windows: the trace and the run pickled over)."""
    return multiprocessing.get_context("fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn")


class _LocalWorker:
    """A group in this process, behind the same calls as a worker process."""

    def __init__(self, group: InstanceGroup) -> None:
        self.group, self.reply = group, None

    def send(self, kind: str, routed: Routed, until: float) -> None:
        self.reply = self.group.advance(routed, until) if kind == "advance" else self.group.finish(routed)

    def receive(self):
        return self.reply

    def runs(self) -> dict[int, RunRecords]:
        return self.reply

    def close(self, finished: bool) -> None:
        pass


class _ProcessWorker:
    """A group in a forked process, asked over a pipe; a failure there is raised here."""

    def __init__(self, context, trace: Trace, resolved: ResolvedRun, instances: list[int], outputs: Outputs,
                 siblings: list[_ProcessWorker]) -> None:
        self.conn, child = context.Pipe()
        self.instances = instances
        router_ends = [*(w.conn for w in siblings), self.conn]  # a forked worker closes its copies of these
        self.process = context.Process(target=_serve, args=(child, router_ends, trace, resolved, instances, outputs),
                                       daemon=True)
        self.process.start()
        child.close()

    def send(self, kind: str, routed: Routed, until: float) -> None:
        self.conn.send((kind, routed, until))

    def receive(self):
        try:
            ok, reply = self.conn.recv()
        except (EOFError, ConnectionResetError):
            raise RuntimeError(f"a cluster worker (pid {self.process.pid}) died: exit code {self.process.exitcode}") from None
        if not ok:
            raise reply
        return reply

    def runs(self) -> dict[int, RunRecords]:
        """The finish's runs, as the worker sends them: one instance at a time."""
        return dict(self.receive() for _ in self.instances)

    def close(self, finished: bool) -> None:
        """After the finish the worker has returned; after a failure elsewhere it is stopped, as its
        share of the run is of no use (it may be in the middle of a stretch, or blocked on a pipe
        that its forked siblings also hold open)."""
        self.conn.close()
        if finished:
            self.process.join(timeout=5)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()


class _GroupActor(InstanceGroup):
    """An instance group in a Ray actor's process, which it has to itself: the cycle collector off
    for its life, as in a worker process."""

    def __init__(self, *args) -> None:
        gc.disable()
        super().__init__(*args)


class _RayWorker:
    """A group in a Ray actor, asked by remote calls; a failure there is raised here by ``ray.get``."""

    def __init__(self, ray, actor_class, trace: Trace, resolved: ResolvedRun, instances: list[int], outputs: Outputs) -> None:
        self.ray, self.pending = ray, None
        self.actor = actor_class.remote(trace, resolved, instances, outputs)

    def send(self, kind: str, routed: Routed, until: float) -> None:
        self.pending = self.actor.advance.remote(routed, until) if kind == "advance" else self.actor.finish.remote(routed)

    def receive(self):
        return self.ray.get(self.pending)

    def runs(self) -> dict[int, RunRecords]:
        return self.receive()

    def close(self, finished: bool) -> None:
        self.ray.kill(self.actor)


def _serve(conn, router_ends: list, trace: Trace, resolved: ResolvedRun, instances: list[int], outputs: Outputs) -> None:
    """A worker process: build the group, then answer the router's meetings until the finish.

    It first closes the router's ends of every pipe it inherited, so that a router's process that
    dies leaves the worker reading the end of its pipe rather than waiting forever."""
    for end in router_ends:
        end.close()
    try:
        with cyclic_gc_paused():
            group = InstanceGroup(trace, resolved, instances, outputs)
            while True:
                try:
                    kind, routed, until = conn.recv()
                except EOFError:  # the router's process is gone: nothing to answer
                    return
                if kind == "advance":
                    conn.send((True, group.advance(routed, until)))
                else:
                    for one in group.finish_one_by_one(routed):
                        conn.send((True, one))
                    return
    except Exception as exc:  # sent to the router's process, which raises it
        _send_failure(conn, exc)
    finally:
        conn.close()


def _send_failure(conn, exc: Exception) -> None:
    try:
        conn.send((False, exc))
    except OSError:  # the router's process is gone
        pass
    except Exception:  # an exception that does not pickle: its words
        conn.send((False, RuntimeError(f"{type(exc).__name__}: {exc}")))


class PartitionedCluster:
    """``resolved.config.instances`` instances dealt out to ``workers`` workers (instance i to
    worker i mod workers) that meet ``router`` every ``interval_s``."""

    def __init__(self, trace: Trace, resolved: ResolvedRun, router: Router, workers: int, interval_s: float,
                 outputs: Outputs | None = None, backend: str = "processes") -> None:
        instances = resolved.config.instances
        if not 1 <= workers <= instances:
            raise ValueError(f"cluster_workers must be in [1, instances = {instances}], got {workers}")
        if not interval_s > 0:
            raise ValueError(f"partitioned instances meet the router every router_staleness_s, which must be > 0 (got {interval_s})")
        if backend not in CLUSTER_BACKENDS:
            raise ValueError(f"cluster_backend must be one of {', '.join(CLUSTER_BACKENDS)}, got {backend!r}")
        self.trace, self.resolved, self.router, self.backend = trace, resolved, router, backend
        self.workers, self.interval_s, self.size = workers, interval_s, instances
        self.outputs = outputs or Outputs()
        self.in_flight = [0] * instances
        self.states: tuple[InstanceState, ...] = ()

    def _worker_of(self, instance: int) -> int:
        return instance % self.workers

    def _start_workers(self) -> list:
        shares = [[i for i in range(self.size) if self._worker_of(i) == w] for w in range(self.workers)]
        if self.backend == "ray":
            ray = connected_ray()
            actor_class = ray.remote(_GroupActor)
            return [_RayWorker(ray, actor_class, self.trace, self.resolved, share, self.outputs) for share in shares]
        if self.workers == 1:
            return [_LocalWorker(InstanceGroup(self.trace, self.resolved, shares[0], self.outputs))]
        context = process_context()
        workers: list[_ProcessWorker] = []
        for share in shares:
            workers.append(_ProcessWorker(context, self.trace, self.resolved, share, self.outputs, workers))
        return workers

    def run(self) -> ClusterRun:
        started = time.perf_counter()
        trace, interval = self.trace, self.interval_s
        arrivals = trace.arrival_s.tolist()
        placement = np.full(len(trace), -1, dtype=np.int64)
        workers = self._start_workers()
        finished = False
        try:
            with cyclic_gc_paused():
                self._meet(workers, [[] for _ in workers], 0.0)
                row, meeting = 0, 0
                while True:
                    scraped_at = meeting * interval
                    next_meeting = meeting + 1
                    batches: list[Routed] = [[] for _ in workers]
                    while row < len(arrivals) and arrivals[row] < next_meeting * interval:
                        chosen = self._route(row, scraped_at)
                        placement[row] = chosen
                        batches[self._worker_of(chosen)].append((row, chosen))
                        row += 1
                    if row >= len(arrivals):
                        break
                    # nothing arrives before the meeting ahead of the next arrival: meet there directly
                    meeting = max(next_meeting, math.floor(arrivals[row] / interval))
                    self._meet(workers, batches, meeting * interval)
                for worker, batch in zip(workers, batches):
                    worker.send("finish", batch, 0.0)
                runs: dict[int, RunRecords] = {}
                for worker in workers:
                    runs.update(worker.runs())
                finished = True
        finally:
            for worker in workers:
                worker.close(finished)
        wall = time.perf_counter() - started
        ordered = [runs[i] for i in range(self.size)]
        for run in ordered:
            run.wall_s = wall
        return ClusterRun([], placement, wall, [0.0] * self.size, [None] * self.size, [(0.0, self.size)], sent_records=ordered)

    def _meet(self, workers: list, batches: list[Routed], until: float) -> None:
        """Every worker runs to ``until``; their states become the view, their ended requests lower
        the router's counters in time order (ties: by instance, then as the instance ended them)."""
        for worker, batch in zip(workers, batches):
            worker.send("advance", batch, until)
        states: dict[int, InstanceState] = {}
        ended: list[tuple[float, int, int, int]] = []
        for worker in workers:
            report = worker.receive()
            states.update(report.states)
            ended.extend(report.ended)
        self.states = tuple(states[i] for i in range(self.size))
        for _, instance, _, row in sorted(ended):
            self.in_flight[instance] -= 1
            self.router.ended(row, instance)

    def _route(self, row: int, scraped_at: float) -> int:
        request = route_request(self.trace, row)
        chosen = checked_choice(self.router, request, ClusterView(self.states, tuple(self.in_flight), scraped_at))
        self.in_flight[chosen] += 1
        self.router.routed(request, chosen)
        return chosen
