"""A run's requests as columns: what requests.csv, the summary and the warnings read of them.

A finished run's ``Request`` objects and its token-time dicts take about a kilobyte a request
(tracemalloc, 20,000 synthetic requests); a million-request cluster's workers send their
instances' runs back to the router as these columns instead (17 numbers and four string
references a request, and its id), and the router's summary and files read nothing else. A
single run's summary reads the same columns, so every run computes it one way.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, fields

import numpy as np

from kvsim.policies.request import Request, Status

REQUEST_COLUMNS = (
    "request_id",
    "trace_index",
    "parent",
    "status",
    "reject_reason",
    "arrival_s",
    "prompt_tokens",
    "output_tokens",
    "generated_tokens",
    "first_scheduled_s",
    "first_token_s",
    "finish_s",
    "queue_s",
    "ttft_s",
    "tpot_s",
    "e2e_s",
    "max_itl_s",
    "preemptions",
    "prefix_hit_tokens",
)

NAN = float("nan")


@dataclass
class RequestRecords:
    """One row a sequence (samples of n > 1 requests are rows of their own), in the run's order.

    Times not reached (never scheduled, no token, not finished, no inter-token gap) are NaN;
    strings are ``""`` where a request has none, as requests.csv writes them. A root request's
    ``family_*`` columns fold in its samples (what users see of a request with n > 1): every one
    finished, when the last did (NaN until all have), and the worst time per output token among
    them (NaN while one has not finished)."""

    request_id: np.ndarray  # str objects
    trace_index: np.ndarray
    parent: np.ndarray  # the root's request_id, "" for a root
    status: np.ndarray  # Status values (str objects)
    reject_reason: np.ndarray  # str objects
    arrival_s: np.ndarray
    prompt_tokens: np.ndarray
    output_tokens: np.ndarray
    generated_tokens: np.ndarray
    first_scheduled_s: np.ndarray
    first_token_s: np.ndarray
    finish_s: np.ndarray
    max_itl_s: np.ndarray
    preemptions: np.ndarray
    prefix_hit_tokens: np.ndarray
    family_done: np.ndarray
    family_finish_s: np.ndarray
    family_tpot_s: np.ndarray

    @classmethod
    def of(cls, requests: Iterable[Request], first_scheduled: dict[str, float], max_gap: dict[str, float]) -> RequestRecords:
        """The columns of ``requests`` with their first-scheduled times and largest gaps (TokenTimes')."""
        requests = list(requests)

        def column(values, dtype) -> np.ndarray:
            return np.fromiter(values, dtype=dtype, count=len(requests))

        def strings(values) -> np.ndarray:
            out = np.empty(len(requests), dtype=object)
            out[:] = list(values)
            return out

        def when(value: float | None) -> float:
            return NAN if value is None else value

        finished = Status.FINISHED
        return cls(
            request_id=strings(r.request_id for r in requests),
            trace_index=column((r.trace_index for r in requests), np.int64),
            parent=strings("" if r.parent is None else r.parent.request_id for r in requests),
            status=strings(r.status.value for r in requests),
            reject_reason=strings(r.reject_reason or "" for r in requests),
            arrival_s=column((r.arrival_s for r in requests), np.float64),
            prompt_tokens=column((r.prompt_tokens for r in requests), np.int64),
            output_tokens=column((r.output_tokens for r in requests), np.int64),
            generated_tokens=column((r.num_output_tokens for r in requests), np.int64),
            first_scheduled_s=column((when(first_scheduled.get(r.request_id)) for r in requests), np.float64),
            first_token_s=column((when(r.first_token_s) for r in requests), np.float64),
            finish_s=column((when(r.finish_s) for r in requests), np.float64),
            max_itl_s=column((when(max_gap.get(r.request_id)) for r in requests), np.float64),
            preemptions=column((r.num_preemptions for r in requests), np.int64),
            prefix_hit_tokens=column((r.prefix_hit_tokens for r in requests), np.int64),
            family_done=column((r.status is finished and all(c.status is finished for c in r.children)
                                for r in requests), np.bool_),
            family_finish_s=column(map(_family_finish_s, requests), np.float64),
            family_tpot_s=column(map(_family_tpot_s, requests), np.float64),
        )

    @classmethod
    def concat(cls, parts: list[RequestRecords]) -> RequestRecords:
        """The rows of ``parts``, one after another (a cluster's instances in order)."""
        return cls(**{f.name: np.concatenate([getattr(p, f.name) for p in parts]) if parts else np.empty(0)
                      for f in fields(cls)})

    def take(self, rows: np.ndarray) -> RequestRecords:
        return RequestRecords(**{f.name: getattr(self, f.name)[rows] for f in fields(self)})

    def __len__(self) -> int:
        return len(self.request_id)

    @property
    def is_root(self) -> np.ndarray:
        return self.parent == ""

    def is_status(self, status: Status) -> np.ndarray:
        return self.status == status.value

    def tpot_s(self, part: slice = slice(None)) -> np.ndarray:
        """Time per output token after the first, of rows ``part``: NaN for one token or a time not reached."""
        generated = self.generated_tokens[part]
        tpot = np.full(len(generated), NAN)
        np.divide(self.finish_s[part] - self.first_token_s[part], generated - 1, out=tpot, where=generated > 1)
        return tpot

    def tuples(self, start: int = 0, stop: int | None = None) -> list[tuple]:
        """Rows ``start:stop`` in ``REQUEST_COLUMNS`` order, as requests.csv writes them (None: an empty cell)."""
        part = slice(start, stop)
        arrival, first, finish = self.arrival_s[part], self.first_token_s[part], self.finish_s[part]
        sched, generated = self.first_scheduled_s[part], self.generated_tokens[part]
        return list(zip(
            self.request_id[part].tolist(),
            self.trace_index[part].tolist(),
            self.parent[part].tolist(),
            self.status[part].tolist(),
            self.reject_reason[part].tolist(),
            arrival.tolist(),
            self.prompt_tokens[part].tolist(),
            self.output_tokens[part].tolist(),
            generated.tolist(),
            _or_none(sched),  # first_scheduled_s
            _or_none(first),  # first_token_s
            _or_none(finish),  # finish_s
            _or_none(sched - arrival),  # queue_s
            _or_none(first - arrival),  # ttft_s
            _or_none(self.tpot_s(part)),
            _or_none(finish - arrival),  # e2e_s
            _or_none(self.max_itl_s[part]),
            self.preemptions[part].tolist(),
            self.prefix_hit_tokens[part].tolist(),
        ))  # fmt: skip

    def rows(self) -> list[dict]:
        """:meth:`tuples` keyed by ``REQUEST_COLUMNS``."""
        return [dict(zip(REQUEST_COLUMNS, row)) for row in self.tuples()]


def _family_finish_s(request: Request) -> float:
    ends = [request.finish_s, *(c.finish_s for c in request.children)]
    return NAN if None in ends else max(ends)


def _family_tpot_s(request: Request) -> float:
    worst = 0.0
    for one in (request, *request.children):
        if one.finish_s is None or one.first_token_s is None:
            return NAN
        if one.num_output_tokens > 1:
            worst = max(worst, (one.finish_s - one.first_token_s) / (one.num_output_tokens - 1))
    return worst


def _or_none(values: np.ndarray) -> list:
    """Plain floats, None where NaN (a time not reached)."""
    return [None if v != v else v for v in values.tolist()]
