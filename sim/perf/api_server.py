"""The API server in front of a served engine: one process, one request or token at a time.

vLLM's OpenAI server runs in a single Python process. It admits each request (parsing, chat
template, tokenisation: ``admit_s``) and, on vLLM's V1 engine, turns every token the engine
samples into a streamed chunk (detokenisation in the ``OutputProcessor`` of
``vllm/v1/engine/output_processor.py``, then the server-sent event: ``stream_s`` per token). Both
run on that one event loop, first come first served: a request sent while tokens wait is admitted
after them, and a client sees each token when the server has sent it, not when the engine sampled
it (under a burst every admission is queued first, and the run's tokens then queue behind them).
The engine itself does not wait for the server (V1's engine core runs in its own process).
"""

from __future__ import annotations

import numpy as np


def serve_queue(
    sent: np.ndarray, step_end: np.ndarray, step_tokens: np.ndarray, admit_s: float, stream_s: float
) -> tuple[np.ndarray, np.ndarray]:
    """(when each request's admission ends, when each step's tokens reach the clients).

    ``sent``: the clients' send times; ``step_end``, ``step_tokens``: when each engine step ended
    and how many tokens it sampled. Jobs are served in the order they arrive (an admission and a
    step at the same instant: the admission first), ``admit_s`` per request and ``stream_s`` per token.
    """
    times = np.concatenate([sent, step_end])
    kinds = np.concatenate([np.zeros(sent.size, dtype=np.int8), np.ones(step_end.size, dtype=np.int8)])
    index = np.concatenate([np.arange(sent.size), np.arange(step_end.size)])
    costs = np.concatenate([np.full(sent.size, admit_s), np.asarray(step_tokens, dtype=np.float64) * stream_s])
    order = np.lexsort((kinds, times))
    done = np.empty(times.size)
    free = -np.inf
    for j in order:  # a single server, first come first served
        free = max(free, times[j]) + costs[j]
        done[j] = free
    admitted = np.empty(sent.size)
    visible = np.empty(step_end.size)
    admitted[index[kinds == 0]] = done[kinds == 0]
    visible[index[kinds == 1]] = done[kinds == 1]
    return admitted, visible
