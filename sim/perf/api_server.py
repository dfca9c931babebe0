"""The API server in front of a served engine: one process whose time every request in it shares.

vLLM's OpenAI server runs in a single Python process. It admits each request (parsing, chat
template, tokenisation, the engine request: ``admit_s``) and, on vLLM's V1 engine, turns every
token the engine samples into a streamed chunk (detokenisation in the ``OutputProcessor`` of
``vllm/v1/engine/output_processor.py``, then the server-sent event: ``stream_s`` per token).
The engine itself does not wait for the server (V1's engine core runs in its own process).

Admissions share the server, they do not queue for it. Each request is a coroutine on one event
loop that yields in the middle of its admission (the prompt is tokenised on a worker thread the
handler awaits: ``_tokenize_prompt_input_async`` in ``vllm/entrypoints/openai/serving_engine.py``),
and the loop serves whatever is ready in turn. So under a burst every request advances together
and they reach the engine close together, late, rather than one every ``admit_s``: the engine then
has the whole burst queued and runs full chunked-prefill steps, which is what the published
bursts show (a 128-token prompt's 4 tokens one full prefill step apart, docs/fidelity.md).
Streaming is one lane, first come first served (the output handler takes one step's outputs after
another), that takes one share of the server beside the admissions in progress; a client sees
each token when the lane has sent its step, not when the engine sampled it.
"""

from __future__ import annotations

import heapq
from collections import deque

import numpy as np


def serve_queue(
    sent: np.ndarray, step_end: np.ndarray, step_tokens: np.ndarray, admit_s: float, stream_s: float
) -> tuple[np.ndarray, np.ndarray]:
    """(when each request's admission ends, when each step's tokens reach the clients).

    ``sent``: the clients' send times; ``step_end``, ``step_tokens``: when each engine step ended
    and how many tokens it sampled (in time order). The server's time is shared equally by the
    admissions in progress (``admit_s`` of work each) and, while it has a step to send, the
    streaming lane (``stream_s`` of work per token, one step after another): processor sharing,
    so a lone job runs at full speed and k jobs each at 1/k.
    """
    stream_work = np.asarray(step_tokens, dtype=np.float64) * stream_s
    times = np.concatenate([sent, step_end])
    kinds = np.concatenate([np.zeros(len(sent), dtype=np.int8), np.ones(len(step_end), dtype=np.int8)])
    index = np.concatenate([np.arange(len(sent)), np.arange(len(step_end))])
    order = np.lexsort((kinds, times))  # at one instant, the admission first

    admitted = np.empty(len(sent))
    visible = np.empty(len(step_end))
    admitting: list[tuple[float, int]] = []  # (the shared clock's value when it is done, request)
    lane: deque[int] = deque()  # steps waiting to be sent, the first one being sent
    lane_left = 0.0  # work left on the step being sent
    now = shared = 0.0  # wall clock; the work each job in progress has received since the start

    def advance(wall: float, jobs: int) -> None:  # every job in progress gets wall / jobs of work
        nonlocal now, shared, lane_left
        now += wall
        shared += wall / jobs
        lane_left -= wall / jobs if lane else 0.0

    def run_until(until: float) -> None:
        nonlocal now, lane_left
        while admitting or lane:
            jobs = len(admitting) + (1 if lane else 0)
            to_admission = max(admitting[0][0] - shared, 0.0) * jobs if admitting else np.inf
            to_stream = lane_left * jobs if lane else np.inf
            wall = min(to_admission, to_stream)
            if now + wall > until:
                advance(until - now, jobs)
                break
            advance(wall, jobs)
            if to_admission <= to_stream:
                admitted[heapq.heappop(admitting)[1]] = now
            else:
                visible[lane.popleft()] = now
                lane_left = stream_work[lane[0]] if lane else 0.0
        if np.isfinite(until):
            now = until  # idle until then, or already there

    for j in order:
        run_until(times[j])
        if kinds[j] == 0:
            heapq.heappush(admitting, (shared + admit_s, int(index[j])))
        else:
            if not lane:
                lane_left = stream_work[index[j]]
            lane.append(int(index[j]))
    run_until(np.inf)
    return admitted, visible
