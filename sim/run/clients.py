"""The benchmark clients and the API server around one simulated engine: what ``vllm bench serve`` measures.

``kvsim simulate --api-server`` and ``--max-concurrency`` run a trace through this module, and so
does every served row of ``kvsim fidelity`` (sim/studies/fidelity.py): one code path, so a fidelity
row's figure is what the equivalent ``kvsim simulate`` command prints.

- Clients send each request at its trace arrival (``--request-rate inf``: all at 0), at most
  ``max_concurrency`` in flight: a request waits for the first client free, as the benchmark's
  semaphore makes it. A closed loop depends on latencies that depend on the sends, so it is solved
  as a fixed point: each round sends with the previous round's latencies (the first: each request
  alone), until the send times settle.
- The API server (the device's ``[engine]``: ``admit_s`` per request, ``request_s`` on to the
  engine, ``stream_s`` per streamed token on vLLM's V1) is one process whose time the admissions
  and the token stream share (sim/perf/api_server.py), also solved as a fixed point: admissions from the previous
  round's steps, the engine from those admissions. Clients see a token when the server has sent it.
- Latencies count from the client's send; throughput over the benchmark's span (first send to last
  token); ITL is the engine's gaps (the server streams a step's tokens together).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from kvsim.sim.perf.api_server import serve_queue
from kvsim.sim.perf.cost_model import CostModelTimer
from kvsim.sim.perf.engine_overhead import EngineProfile
from kvsim.sim.run.config import ResolvedRun
from kvsim.sim.run.runner import run_trace
from kvsim.traces.schema import Ragged, Trace

FIXED_POINT_ROUNDS = 6  # simulations until the send (or admission) times settle
# vLLM bench serve's figures, by kvsim's names (tokens/s, requests/s and seconds).
METRICS = (
    "ttft_mean", "ttft_median", "ttft_p99", "tpot_mean", "tpot_median", "itl_median", "e2e_mean", "batch_latency",
    "output_throughput", "total_throughput", "request_throughput",
)  # fmt: skip


@dataclass
class Replay:
    """A simulated run, requests in the trace's order: when each one's first and last token reached
    its client (absolute seconds), every inter-token gap, each engine step's end and the tokens it
    sampled, and the engine run itself (its arrivals were ``engine_arrival``)."""

    rows: list[dict]
    first: np.ndarray
    finish: np.ndarray
    gaps: np.ndarray
    step_end: np.ndarray
    step_tokens: np.ndarray  # every entry of a step samples a token (whole prompts; a chunk counts one)
    engine_arrival: np.ndarray


def retimed(trace: Trace, arrivals: np.ndarray) -> tuple[Trace, np.ndarray]:
    """``trace`` with request ``i`` arriving at ``arrivals[i]`` (rows re-sorted by arrival, the first at 0),
    and the order: row ``k`` of the result is row ``order[k]`` of ``trace``."""
    order = np.argsort(arrivals, kind="stable")
    columns = {}
    for name in trace.columns:
        column = getattr(trace, name)
        columns[name] = column.take(order) if isinstance(column, Ragged) else column[order]
    columns["arrival_s"] = arrivals[order] - arrivals[order[0]]
    return dataclasses.replace(trace, **columns), order


def simulate_requests(resolved: ResolvedRun, trace: Trace, arrivals: np.ndarray) -> Replay:
    """The engine alone, with request ``i`` of ``trace`` arriving at ``arrivals[i]`` (absolute seconds)."""
    moved, order = retimed(trace, arrivals)
    run, _ = run_trace(resolved, moved, CostModelTimer(resolved.cost_model()), None)
    rows = sorted(run.request_rows(), key=lambda r: r["trace_index"])
    start = float(arrivals[order[0]])
    back = np.empty_like(order)
    back[order] = np.arange(order.size)
    rows = [{**rows[back[i]], "arrival_s": float(arrivals[i]), "start": start} for i in range(order.size)]
    steps = run.steps.columns
    def when(key: str) -> np.ndarray:  # NaN where the engine rejected the request
        return np.array([np.nan if r[key] is None else r[key] for r in rows], dtype=np.float64) + start

    return Replay(
        rows=rows,
        first=when("first_token_s"),
        finish=when("finish_s"),
        gaps=run.times.all_gaps(),
        step_end=np.add(steps["start_s"], steps["duration_s"]) + start,
        step_tokens=np.asarray(steps["batch_size"], dtype=np.float64),
        engine_arrival=np.asarray(arrivals, dtype=np.float64),
    )


def serve(resolved: ResolvedRun, trace: Trace, sent: np.ndarray, server: EngineProfile | None, stream_s: float) -> Replay:
    """Requests sent at ``sent`` through the API server ``server`` and the engine (None: straight into
    the engine, as offline tests run). With ``stream_s`` > 0 the server also streams every token, in
    the same queue (module docstring). Inter-token gaps stay the engine's."""
    if server is None:
        return simulate_requests(resolved, trace, sent)
    admitted, _ = serve_queue(sent, np.empty(0), np.empty(0), server.admit_s, 0.0)
    for _ in range(FIXED_POINT_ROUNDS):
        replay = simulate_requests(resolved, trace, admitted + server.request_s)
        if stream_s <= 0:
            return replay
        again, visible = serve_queue(sent, replay.step_end, replay.step_tokens, server.admit_s, stream_s)
        settled = np.max(np.abs(again - admitted)) < 1e-3
        admitted = again
        if settled:
            break

    def sent_at(engine_time: np.ndarray) -> np.ndarray:  # a token leaves with its step's batch
        return visible[np.minimum(np.searchsorted(replay.step_end, engine_time - 1e-9), visible.size - 1)]

    return dataclasses.replace(replay, first=sent_at(replay.first), finish=sent_at(replay.finish))


def closed_loop(
    resolved: ResolvedRun, trace: Trace, clients: int, server: EngineProfile | None, stream_s: float
) -> tuple[np.ndarray, Replay]:
    """Send times of the trace's requests with at most ``clients`` in flight, and the simulated run (module docstring)."""
    n, arrivals = len(trace), trace.arrival_s
    alone = np.arange(n) * 1e4  # far apart: each request alone
    replay = serve(resolved, trace, alone, server, stream_s)
    latency = replay.finish - alone
    sent, nxt = np.zeros(n), np.zeros(n)
    for _ in range(FIXED_POINT_ROUNDS):
        free = np.zeros(clients)
        nxt = np.zeros(n)
        for k in range(n):
            c = int(np.argmin(free))
            nxt[k] = max(arrivals[k], free[c])
            free[c] = nxt[k] + latency[k]
        replay = serve(resolved, trace, nxt, server, stream_s)
        latency = replay.finish - nxt
        if np.max(np.abs(nxt - sent)) < 1e-4:
            break
        sent = nxt
    return nxt, replay


def bench_run(resolved: ResolvedRun, trace: Trace, api_server: bool, max_concurrency: int) -> tuple[np.ndarray, Replay]:
    """The trace as ``vllm bench serve`` would send it: each request's send time and the simulated run.

    ``api_server``: through the device's API server (its ``[engine]``; V1 also streams through it,
    V0 detokenises in the engine, its ``v0_seq_s``); ``max_concurrency`` 0: no limit."""
    server = resolved.device.engine if api_server else None
    stream_s = server.stream_s if server is not None and resolved.config.engine_core == "v1" else 0.0
    if max_concurrency:
        return closed_loop(resolved, trace, max_concurrency, server, stream_s)
    sent = np.asarray(trace.arrival_s, dtype=np.float64)
    return sent, serve(resolved, trace, sent, server, stream_s)


def run_with_clients(resolved: ResolvedRun, trace: Trace, timer: CostModelTimer, out_dir, **options) -> tuple:
    """The run's clients (its config's ``api_server``, ``max_concurrency``), then :func:`run_trace` of the engine's
    arrivals they make (``options`` are its keywords): outputs as usual, plus summary.json's ``bench`` block."""
    config = resolved.config
    sent, replay = bench_run(resolved, trace, config.api_server, config.max_concurrency)
    bench = bench_summary(replay, trace, sent, config.api_server, config.max_concurrency)
    engine_trace, _ = retimed(trace, replay.engine_arrival)
    return run_trace(resolved, engine_trace, timer, out_dir, summary_extras=lambda _: {"bench": bench}, **options)


def bench_metric(metric: str, replay: Replay, prompts: np.ndarray, outputs: np.ndarray, sent: np.ndarray) -> float:
    """One of :data:`METRICS`, by vLLM's benchmark definitions (module docstring), over the requests
    that completed (the benchmark's successful ones; a rejected request has NaN times)."""
    done = ~np.isnan(replay.finish)
    first, finish, sent, prompts, outputs = replay.first[done], replay.finish[done], sent[done], prompts[done], outputs[done]
    ttft, e2e = first - sent, finish - sent
    tpot = (finish - first)[outputs > 1] / (outputs[outputs > 1] - 1)
    span = finish.max() - sent.min()
    values = {
        "ttft_mean": lambda: ttft.mean(), "ttft_median": lambda: np.median(ttft), "ttft_p99": lambda: np.percentile(ttft, 99),
        "tpot_mean": lambda: tpot.mean(), "tpot_median": lambda: np.median(tpot), "itl_median": lambda: np.median(replay.gaps),
        "e2e_mean": lambda: e2e.mean(), "batch_latency": lambda: span,
        "output_throughput": lambda: outputs.sum() / span,
        "total_throughput": lambda: (outputs.sum() + prompts.sum()) / span,
        "request_throughput": lambda: done.sum() / span,
    }  # fmt: skip
    return float(values[metric]())


def bench_summary(replay: Replay, trace: Trace, sent: np.ndarray, api_server: bool, max_concurrency: int) -> dict:
    """Every figure of :data:`METRICS` (seconds, tokens/s, requests/s), as summary.json's ``bench`` block."""
    figures = {m: bench_metric(m, replay, trace.prompt_tokens, trace.output_tokens, sent) for m in METRICS}
    done = int((~np.isnan(replay.finish)).sum())
    return {"api_server": api_server, "max_concurrency": max_concurrency, "successful_requests": done, **figures}


def format_bench(bench: dict) -> str:
    """The bench block as ``vllm bench serve`` prints its result (latencies in ms)."""
    lines = [f"benchmark clients: {'through the API server' if bench['api_server'] else 'straight into the engine'}, "
             f"max concurrency {bench['max_concurrency'] or 'none'}",
             f"  successful requests        {bench['successful_requests']}",
             f"  benchmark duration (s)     {bench['batch_latency']:.2f}",
             f"  request throughput (req/s) {bench['request_throughput']:.2f}",
             f"  output token throughput    {bench['output_throughput']:.2f} tok/s",
             f"  total token throughput     {bench['total_throughput']:.2f} tok/s"]
    for name, key in (("TTFT", "ttft"), ("TPOT", "tpot")):
        lines.append(f"  {name} mean / median (ms)    {1e3 * bench[key + '_mean']:.2f} / {1e3 * bench[key + '_median']:.2f}")
    lines.append(f"  TTFT p99 (ms)              {1e3 * bench['ttft_p99']:.2f}")
    lines.append(f"  ITL median (ms)            {1e3 * bench['itl_median']:.2f}")
    return "\n".join(lines)
