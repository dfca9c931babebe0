"""Prefill/decode disaggregation: a prefill pool and a decode pool in one event loop.

As vLLM's and vllm-ascend's P/D proxies run it (vLLM's ``toy_proxy_server.py``, vllm-ascend's
``load_balance_proxy_server_example.py``): at a request's arrival the proxy picks a prefill
instance (``router``) and a decode instance (``decode_router``); the prefill instance runs the
prompt with ``max_tokens = 1``, so it produces the first token, which the user sees (TTFT); then
the prompt's KV moves to the decode instance (sim/cluster/kv_transfer.py: bytes, link, connector),
which generates the rest. While its KV is on the way the prefill instance keeps the request's
blocks (vLLM's connectors free them once the decode side has read them; with prefix caching they
stay cached afterwards). The decode instance admits the request once its KV has arrived and it has
free blocks for the prompt and the next token (``Request.external_tokens``: delivered, not
computed); a recompute preemption there starts over from the prompt, locally.

Simplified: transfers out of one prefill instance queue on its link (one send at a time), as do
transfers into one decode instance (one receive at a time: two prefill instances sending to one
decode instance take turns on its card rather than sharing it, which ends the pair at the same time
but the first sooner); the layerwise overlap is credited from the request's first scheduled step even
where it waited for a link; the decode side allocates at admission, after
the KV arrived, so KV that waits there for blocks is counted in neither pool (vLLM's pull connectors
allocate first and leave it on the prefill instance meanwhile). The decode router defaults to ``least-requests``, not ``least-kv``:
it chooses at arrival, when a decode instance's KV usage does not yet show the requests routed to it
that are still prefilling or on the link, so least-kv sends a burst to one instance; the router's own
in-flight counters count them from the start, as proxies count them: vLLM's toy proxy round-robins,
vllm-ascend's ``load_balance_proxy_server_example.py`` (``select_decoder``) takes the decoder with the
fewest active tokens by its own count, raised at selection.
A request with one output token ends on its prefill instance (nothing to decode, no transfer).
With an autoscaler each pool scales on its own (the cluster autoscaler's policy and bounds, per
pool, with that pool's cold start), as llm-d's and Dynamo's planners size prefill and decode apart.
"""

from __future__ import annotations

import csv
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import simpy

from kvsim.policies.blocks import cdiv
from kvsim.policies.engine import EngineCore
from kvsim.policies.kv_store import share_store
from kvsim.policies.request import Request, Status
from kvsim.policies.trace_feed import add_trace_request, request_id_of
from kvsim.sim.cluster.cluster import (
    ClusterRun,
    ScaledPool,
    Scaling,
    Scrape,
    _SummedStats,
    checked_choice,
    route_request,
)
from kvsim.sim.cluster.kv_transfer import KVMover, PoolPlacement, PricedMover
from kvsim.sim.cluster.routers import ClusterView, Router, RouterError
from kvsim.sim.perf.step_timer import StepTimer
from kvsim.sim.run.config import ResolvedRun
from kvsim.sim.run.metrics import TokenTimes, distribution
from kvsim.sim.run.outputs import REQUESTS, atomic_open
from kvsim.sim.run.request_records import REQUEST_COLUMNS, RequestRecords
from kvsim.sim.run.simulator import SimOptions, Simulation, cyclic_gc_paused
from kvsim.traces.schema import Trace

PD_REQUEST_COLUMNS = (*REQUEST_COLUMNS, "prefill_instance", "decode_instance", "kv_transfer_s")
POOLS = ("prefill", "decode")
_COL = {name: i for i, name in enumerate(REQUEST_COLUMNS)}


@dataclass(frozen=True)
class Transfer:
    """One prompt's KV, prefill instance to decode instance."""

    row: int
    prefill: int
    decode: int
    link: str  # intra | inter
    nbytes: int  # every rank's
    prefill_end_s: float  # the first token: the KV is ready to go (after-prefill) or mostly gone (layerwise)
    wire_s: float  # the whole transfer, nothing overlapped (latency + bytes / effective bandwidth)
    exposed_s: float  # what the connector leaves after the prefill's end
    arrived_s: float  # queueing on the link included

    @property
    def delay_s(self) -> float:
        return self.arrived_s - self.prefill_end_s


@dataclass(frozen=True)
class PDSetup:
    """The two pools' shape and the transfer's parameters."""

    prefill: ResolvedRun
    decode: ResolvedRun
    placement: PoolPlacement
    connector: str

    @property
    def block_bytes_rank(self) -> int:
        """The larger of the two layouts' per-rank bytes of a KV block (kv_transfer module docstring)."""
        return max(self.prefill.memory.bytes_per_block, self.decode.memory.bytes_per_block)

    def blocks(self, tokens: int) -> int:
        """The blocks a prompt of ``tokens`` fills: a connector moves whole blocks."""
        return cdiv(tokens, self.prefill.config.block_size)

    def total_bytes(self, tokens: int) -> int:
        layout = self.prefill.layout
        return self.prefill.memory.bytes_per_block * self.blocks(tokens) * layout.tensor_parallel_size * layout.pipeline_parallel_size


@dataclass
class PDRun(ClusterRun):
    """A P/D run: ``runs`` holds the prefill instances' then the decode instances'."""

    num_prefill: int = 0
    decode_of: np.ndarray | None = None  # trace row -> decode instance (-1: none)
    transfers: dict[int, Transfer] | None = None  # by trace row
    trace: Trace | None = None

    def user_records(self) -> RequestRecords:
        """The requests as users see them, one a trace row in trace order: the decode instance's where it got there."""
        every = RequestRecords.concat([one.requests for one in self.records])
        order = np.argsort(every.trace_index, kind="stable")  # a row's prefill record, then its decode one
        rows = every.trace_index[order]
        last = np.append(rows[1:] != rows[:-1], True) if len(rows) else np.empty(0, dtype=bool)
        return every.take(order[last])

    def prefix_stats(self) -> _SummedStats:
        """The prompts' prefix hits where prompts are computed: the prefill pool."""
        return _SummedStats([one.kv_stats for one in self.records[: self.num_prefill]])

    def routed_to(self, instance: int) -> int:
        if instance < self.num_prefill:
            return int((self.placement == instance).sum())
        return int((self.decode_of == instance - self.num_prefill).sum())

    def summary(self) -> dict:
        out = super().summary()
        for entry in out["instances"]:
            entry["pool"] = POOLS[entry["instance"] >= self.num_prefill]
        transfers = list(self.transfers.values())
        out["pd"] = {
            "prefill_instances": self.num_prefill,
            "decode_instances": len(self.runs) - self.num_prefill,
            "transfers": len(transfers),
            "transfer_bytes": sum(t.nbytes for t in transfers),
            "intra_node_transfers": sum(t.link == "intra" for t in transfers),
            "transfer_s": distribution([t.wire_s for t in transfers]),  # the whole KV over the link
            "exposed_s": distribution([t.exposed_s for t in transfers]),  # left after the prefill by the connector
            "delay_s": distribution([t.delay_s for t in transfers]),  # ... plus waiting for the link
        }
        return out

    def request_tuples(self) -> list[tuple]:
        """requests.csv rows, one a trace row in trace order: the decode instance's request with the
        prefill side's queueing, prefix hits and preemptions folded in."""
        prefill_rows = {row[_COL["trace_index"]]: row for one in self.records[: self.num_prefill] for row in one.requests.tuples()}
        decode_rows = {row[_COL["trace_index"]]: row for one in self.records[self.num_prefill:] for row in one.requests.tuples()}
        out = []
        for index, first in sorted(prefill_rows.items()):
            final = list(decode_rows.get(index, first))
            final[_COL["output_tokens"]] = int(self.trace.output_tokens[index])
            for name in ("first_scheduled_s", "queue_s", "prefix_hit_tokens"):
                final[_COL[name]] = first[_COL[name]]
            if index in decode_rows:
                final[_COL["preemptions"]] += first[_COL["preemptions"]]
            transfer = self.transfers.get(index)
            decode = int(self.decode_of[index]) if index in decode_rows else None
            out.append((*final, int(self.placement[index]), decode, None if transfer is None else transfer.delay_s))
        return out

    def write_request_rows(self, out_dir: Path) -> None:
        """requests.csv: :meth:`request_tuples`, under ``PD_REQUEST_COLUMNS``."""
        with atomic_open(out_dir / REQUESTS) as fh:
            writer = csv.writer(fh)
            writer.writerow(PD_REQUEST_COLUMNS)
            writer.writerows(self.request_tuples())


class PDClusterSimulation:
    """The prefill pool behind ``router``, the decode pool behind ``decode_router``, KV moving between."""

    def __init__(self, trace: Trace, setup: PDSetup, prefill_timers: list[StepTimer], decode_timers: list[StepTimer],
                 router: Router, decode_router: Router, staleness_s: float = 0.0,
                 prefill_options: list[SimOptions] | None = None, decode_options: list[SimOptions] | None = None,
                 scaling: tuple[Scaling, Scaling] | None = None, initial: tuple[int, int] | None = None,
                 mover: KVMover | None = None) -> None:
        """``*_timers``: one per instance each pool may run (its autoscaler's maximum); ``initial``
        of them serve from the start (all without ``scaling``, one autoscaler a pool). ``mover``: what
        moves a prompt's KV and how long it takes (None: the link model's price, ``PricedMover``)."""
        if not prefill_timers or not decode_timers:
            raise ValueError("a P/D cluster needs at least one prefill and one decode instance")
        if trace.has_parallel_samples:
            raise ValueError(f"{trace.source}: P/D disaggregation serves one sample a request (the trace has n_samples > 1)")
        self.trace, self.setup = trace, setup
        self.mover = mover or PricedMover(setup.connector, setup.prefill.model.num_layers)
        self.routers = (router, decode_router)
        self.env = simpy.Environment()
        prefill_trace = replace(trace, output_tokens=np.ones(len(trace), dtype=np.int64))  # the proxy's max_tokens = 1
        prefill_options = prefill_options or [SimOptions() for _ in prefill_timers]
        decode_options = decode_options or [SimOptions() for _ in decode_timers]
        self.prefill = [Simulation(prefill_trace, setup.prefill.new_engine(), t, o, env=self.env)
                        for t, o in zip(prefill_timers, prefill_options)]
        self.decode = [Simulation(trace, setup.decode.new_engine(), t, o, env=self.env)
                       for t, o in zip(decode_timers, decode_options)]
        share_store([sim.engine.kv_tiers for sim in self.prefill])
        self.in_flight = ([0] * len(self.prefill), [0] * len(self.decode))
        self.prefill_of = np.full(len(trace), -1, dtype=np.int64)
        self.decode_of = np.full(len(trace), -1, dtype=np.int64)
        self.transfers: dict[int, Transfer] = {}
        self.first_token_s: dict[int, float] = {}
        # Each prefill instance sends, and each decode instance receives, one prompt's KV at a time.
        self.links = [simpy.Resource(self.env, capacity=1) for _ in self.prefill]
        self.receiving = [simpy.Resource(self.env, capacity=1) for _ in self.decode]
        self._settled = 0  # rows whose prefill side is over (rejected, ended there, or KV delivered)
        self._routing_done = False
        sizes = (len(self.prefill), len(self.decode))
        first = sizes if initial is None else initial
        self.pools = tuple(ScaledPool.of(None if scaling is None else scaling[pool], sizes[pool], first[pool])
                           for pool in range(2))
        self.timeline: list[tuple[float, int]] = [(0.0, sum(first))]
        for i, sim in enumerate(self.prefill):
            sim.engine.hold_finished_kv = True
            sim.on_ended = self._prefill_ended(i)
        for i, sim in enumerate(self.decode):
            sim.add_row = self._decode_adder(sim.times)
            sim.on_ended = self._decode_ended(i)
        self.scrapes = (Scrape(staleness_s, self.prefill), Scrape(staleness_s, self.decode))

    # --- routing ---------------------------------------------------------------------------
    def _view(self, pool: int) -> ClusterView:
        states, scraped_at = self.scrapes[pool].read(self.env.now)
        serving = self.pools[pool].serving
        return ClusterView(states, tuple(self.in_flight[pool]), scraped_at, () if all(serving) else tuple(serving))

    def _route_process(self):
        env = self.env
        for row, arrival in enumerate(self.trace.arrival_s.tolist()):
            if arrival > env.now:
                yield env.timeout(arrival - env.now)
            request = route_request(self.trace, row)
            chosen = [checked_choice(router, request, self._view(pool)) for pool, router in enumerate(self.routers)]
            for pool, instance in enumerate(chosen):
                if not self.pools[pool].serving[instance]:
                    raise RouterError(f"router {type(self.routers[pool]).__name__} chose {POOLS[pool]} instance {instance} "
                                      f"for request {request_id_of(row)}, which takes no new requests "
                                      "(ClusterView.candidates lists those that do)")
            for pool, (router, instance) in enumerate(zip(self.routers, chosen)):
                self.in_flight[pool][instance] += 1
                router.routed(request, instance)
            self.prefill_of[row], self.decode_of[row] = chosen
            self.prefill[chosen[0]].hand(row)
        self._routing_done = True
        for sim in self.prefill:
            sim.feeding_over()
        self._maybe_decode_fed()

    def _ended(self, pool: int, instance: int, row: int) -> None:
        self.in_flight[pool][instance] -= 1
        self.routers[pool].ended(row, instance)

    # --- the prefill side ----------------------------------------------------------------------
    def _prefill_ended(self, instance: int):
        def ended(finished: list[Request], rejected: list[tuple[str, str]]) -> None:
            for request in finished:
                row = request.trace_index
                self._ended(0, instance, row)
                self.first_token_s[row] = request.first_token_s
                if self.trace.output_tokens[row] > 1:
                    self.env.process(self._transfer(instance, request))
                else:  # the first token was the last: nothing to decode
                    self.prefill[instance].release_kv(request.request_id)
                    self._settle(row, delivered=False)
            for rid, _ in rejected:
                self._ended(0, instance, int(rid))
                self._settle(int(rid), delivered=False)
        return ended

    def _transfer(self, instance: int, request: Request):
        env, setup, row = self.env, self.setup, request.trace_index
        decode = int(self.decode_of[row])
        link = setup.placement.link(instance, decode)
        tokens = request.prompt_tokens
        nbytes_rank = setup.block_bytes_rank * setup.blocks(tokens)
        started = self.prefill[instance].times.first_scheduled[request.request_id]
        ended = env.now
        with self.links[instance].request() as sending:
            yield sending
            # asked for once the send link is held, never the other way round: no two transfers wait on each other
            with self.receiving[decode].request() as receiving:
                yield receiving
                wire, exposed = self.mover.move(request, instance, decode, link, nbytes_rank, ended - started)
                yield env.timeout(exposed)
        self.prefill[instance].release_kv(request.request_id)
        self.transfers[row] = Transfer(row, instance, decode, link.kind, setup.total_bytes(tokens), ended,
                                       wire, exposed, env.now)
        self.decode[decode].hand(row, at_s=env.now)
        self._settle(row, delivered=True)

    def _settle(self, row: int, delivered: bool) -> None:
        """The row's prefill side is over; without a delivery its decode instance will not see it."""
        if not delivered:
            self._ended(1, int(self.decode_of[row]), row)
        self._settled += 1
        self._maybe_decode_fed()

    def _maybe_decode_fed(self) -> None:
        if self._routing_done and self._settled == len(self.trace):
            for sim in self.decode:
                sim.feeding_over()

    # --- the decode side -----------------------------------------------------------------------
    def _decode_adder(self, times: TokenTimes):
        def add_decode_row(engine: EngineCore, trace: Trace, row: int) -> Request:
            """The row as its decode instance takes it: the prompt's KV delivered, the first token sampled."""
            request = add_trace_request(engine, trace, row)
            if request.status is Status.WAITING:
                request.external_tokens = request.prompt_tokens
                request.num_output_tokens = 1
                request.first_token_s = self.first_token_s[row]
                times.last_token[request.request_id] = request.first_token_s  # the next gap carries the transfer
            return request
        return add_decode_row

    def _decode_ended(self, instance: int):
        def ended(finished: list[Request], rejected: list[tuple[str, str]]) -> None:
            for request in finished:
                self._ended(1, instance, request.trace_index)
            for rid, _ in rejected:
                self._ended(1, instance, int(rid))
        return ended

    # --- scaling ----------------------------------------------------------------------------
    def _scale_process(self, pool: int):
        """Every interval: the pool's autoscaler on the pool's instances in service (ScaledPool.decide)."""
        scaled, env = self.pools[pool], self.env
        while not self._routing_done:
            yield env.timeout(scaled.scaling.interval_s)
            decision = scaled.decide(self._view(pool), env.now)
            if decision is not None and decision[0] == "launch":
                env.process(self._serve_after(pool, decision[1], scaled.scaling.cold_start_s))
            elif decision is not None:
                self.timeline.append((env.now, self._serving()))

    def _serve_after(self, pool: int, instance: int, delay_s: float):
        yield self.env.timeout(delay_s)
        self.pools[pool].serving[instance] = True
        self.timeline.append((self.env.now, self._serving()))

    def _serving(self) -> int:
        return sum(sum(scaled.serving) for scaled in self.pools)

    def run(self) -> PDRun:
        started = time.perf_counter()
        self.env.process(self._route_process())
        for pool, scaled in enumerate(self.pools):
            if scaled.scaling is not None:
                self.env.process(self._scale_process(pool))
        sims = self.prefill + self.decode
        done = [sim.start() for sim in sims]
        with cyclic_gc_paused():
            self.env.run(until=simpy.AllOf(self.env, done))
        wall = time.perf_counter() - started
        prefill, decode = self.pools
        return PDRun([sim.result(wall) for sim in sims], self.prefill_of, wall, [*prefill.launched_s, *decode.launched_s],
                     [*prefill.retired_s, *decode.retired_s], self.timeline,
                     num_prefill=len(self.prefill), decode_of=self.decode_of, transfers=self.transfers, trace=self.trace)
