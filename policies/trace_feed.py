"""Turning trace rows into engine requests: the one place both worlds do it."""

from __future__ import annotations

from kvsim.policies.engine import EngineCore
from kvsim.policies.request import Request
from kvsim.traces.schema import Trace


def request_id_of(index: int) -> str:
    return str(index)


def add_trace_request(engine: EngineCore, trace: Trace, index: int, arrival_s: float | None = None) -> Request:
    """Hand row ``index`` of ``trace`` to the engine (arriving at ``arrival_s``, default the trace's)."""
    hashes = trace.hashes_of(index)
    tokens = trace.tokens_of(index)
    return engine.add_request(
        request_id_of(index),
        float(trace.arrival_s[index]) if arrival_s is None else arrival_s,
        int(trace.prompt_tokens[index]),
        int(trace.output_tokens[index]),
        priority=trace.priority_of(index),
        n_samples=trace.n_samples_of(index),
        trace_hashes=None if hashes is None else tuple(hashes.tolist()),
        hash_block_size=trace.hash_block_size if hashes is not None else None,
        token_ids=None if tokens is None else tuple(tokens.tolist()),
        trace_index=index,
    )


def drain(engine: EngineCore, trace: Trace, step_time_s: float, check: bool = False, max_steps: int = 10_000_000) -> int:
    """Replay ``trace`` with a fixed step time (the policies-only test loop); returns steps taken.

    Arrivals up to the current time join before each step; an idle engine jumps to the next
    arrival. With ``check`` the invariants are verified after every step.
    """
    now, index, steps = 0.0, 0, 0
    n = len(trace)
    while index < n or engine.has_unfinished():
        if not engine.has_unfinished():
            now = max(now, float(trace.arrival_s[index]))
        while index < n and trace.arrival_s[index] <= now:
            add_trace_request(engine, trace, index)
            index += 1
        plan = engine.schedule(now)
        now += step_time_s
        engine.commit(plan, now)
        steps += 1
        if check:
            engine.check_invariants()
            plan.check(engine.kv.block_size)
        if steps > max_steps:
            raise RuntimeError(f"trace did not drain within {max_steps} steps")
    return steps
