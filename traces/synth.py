"""Synthetic traces: arrival processes, length distributions, shared prompts, conversations.

Everything draws from one seeded ``numpy.random.Generator`` in a fixed order, so a trace is
fixed by its parameters and seed. Prefix hashes are small integers handed out in order:
equal leading ids mean equal leading token blocks, exactly as in the Mooncake trace.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from itertools import count
from typing import Protocol

import numpy as np

from kvsim.traces.schema import Ragged, Trace

# ---------------------------------------------------------------- arrival processes


def poisson_arrivals(rate: float, *, n: int | None = None, duration_s: float | None = None, rng=None) -> np.ndarray:
    """Arrival times of a Poisson process (exponential gaps), the first at 0."""
    rng = np.random.default_rng(rng)
    return _renewal(lambda size: rng.exponential(1.0 / rate, size), rate, n, duration_s)


def gamma_arrivals(
    rate: float, cv: float, *, n: int | None = None, duration_s: float | None = None, rng=None
) -> np.ndarray:
    """Arrival times with gamma-distributed gaps of mean ``1/rate`` and coefficient of
    variation ``cv`` (shape ``1/cv**2``): cv = 1 is Poisson, cv > 1 bursty, cv < 1 regular."""
    if not cv > 0:
        raise ValueError(f"cv must be > 0, got {cv}")
    rng = np.random.default_rng(rng)
    shape = 1.0 / cv**2
    return _renewal(lambda size: rng.gamma(shape, 1.0 / (rate * shape), size), rate, n, duration_s)


def _renewal(gaps, rate: float, n: int | None, duration_s: float | None) -> np.ndarray:
    if not rate > 0:
        raise ValueError(f"rate must be > 0, got {rate}")
    if (n is None) == (duration_s is None):
        raise ValueError("give exactly one of n and duration_s")
    if n is not None:
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        return np.concatenate([[0.0], np.cumsum(gaps(n - 1))])
    if not duration_s > 0:
        raise ValueError(f"duration_s must be > 0, got {duration_s}")
    times = np.zeros(1)
    while times[-1] < duration_s:  # draw in chunks sized to the expected count
        chunk = times[-1] + np.cumsum(gaps(int(rate * duration_s * 1.1) + 16))
        times = np.concatenate([times, chunk])
    return times[times < duration_s]


# ---------------------------------------------------------------- length distributions


class LengthDist(Protocol):
    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """``n`` int64 lengths, each >= 1."""
        ...


@dataclass(frozen=True)
class Fixed:
    value: int

    def __post_init__(self) -> None:
        if self.value < 1:
            raise ValueError(f"fixed length must be >= 1, got {self.value}")

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return np.full(n, self.value, dtype=np.int64)


@dataclass(frozen=True)
class Uniform:
    """Integers in ``[low, high]``, both included."""

    low: int
    high: int

    def __post_init__(self) -> None:
        if not 1 <= self.low <= self.high:
            raise ValueError(f"uniform lengths need 1 <= low <= high, got {self.low}, {self.high}")

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return rng.integers(self.low, self.high + 1, size=n, dtype=np.int64)


@dataclass(frozen=True)
class LogNormal:
    """Lognormal lengths given by their ``mean`` and coefficient of variation ``cv`` (the
    figures trace papers report), rounded to integers and floored at 1."""

    mean: float
    cv: float

    def __post_init__(self) -> None:
        if not (self.mean >= 1 and self.cv >= 0):
            raise ValueError(f"lognormal lengths need mean >= 1 and cv >= 0, got {self.mean}, {self.cv}")

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        sigma2 = math.log1p(self.cv**2)
        draws = rng.lognormal(math.log(self.mean) - sigma2 / 2, math.sqrt(sigma2), size=n)
        return np.maximum(np.rint(draws), 1).astype(np.int64)


@dataclass(frozen=True, eq=False)
class Empirical:
    """Lengths resampled (with replacement) from observed ones, e.g. a real trace's column."""

    values: np.ndarray = field(repr=False)
    origin: str = ""

    def __post_init__(self) -> None:
        if len(self.values) == 0 or np.min(self.values) < 1:
            raise ValueError("empirical lengths need at least one value, all >= 1")

    @classmethod
    def from_trace(cls, trace: Trace, column: str) -> Empirical:
        """``column`` is ``prompt_tokens`` or ``output_tokens``."""
        return cls(np.asarray(getattr(trace, column), dtype=np.int64), f"{trace.source} {column}")

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return rng.choice(self.values, size=n, replace=True)

    def __repr__(self) -> str:
        return f"Empirical({self.origin or f'{len(self.values)} values'})"


# ---------------------------------------------------------------- whole traces


def synthesize(
    *,
    rate: float,
    n_requests: int | None = None,
    duration_s: float | None = None,
    arrival_cv: float = 1.0,
    prompt: LengthDist = Fixed(512),
    output: LengthDist = Fixed(128),
    system_prompt_tokens: int = 0,
    turns: int = 1,
    think_time_s: float = 30.0,
    n_samples: int = 1,
    hash_block_size: int = 16,
    seed: int = 0,
) -> Trace:
    """A synthetic trace of ``rate`` requests per second (turns included), on average.

    Conversations start by a Poisson (``arrival_cv`` = 1) or gamma renewal process at
    ``rate / turns`` per second, so requests arrive at ``rate`` overall; turn k+1 follows turn
    k after an exponential think time of mean ``think_time_s`` (measured between arrivals).
    With several turns the trace is a window of that process in its steady state:
    conversations start from a warm-up before time 0 (see :func:`_warmup_s`), so the window
    holds later turns of conversations begun before it, as a cut of a real trace does, and
    the realised rate is ``rate`` from the first second (starting every conversation at 0
    would ramp up over the first turns and let later turns fall past the end).
    Turn 1's prompt is the shared system prompt plus ``prompt`` user tokens; turn k+1's prompt
    is turn k's prompt, its ``output`` answer and new user tokens, so its prefix hashes begin
    with every full block of turn k's prompt and answer. Requests are kept while they arrive
    before ``duration_s``, or the first ``n_requests`` are kept. ``n_samples`` > 1 asks for
    parallel samples of every request. Prefix hashes (over ``hash_block_size`` tokens) are
    present when requests share something: a system prompt or earlier turns.
    """
    if turns < 1 or n_samples < 1 or system_prompt_tokens < 0 or hash_block_size < 1 or think_time_s < 0:
        raise ValueError("need turns >= 1, n_samples >= 1, system_prompt_tokens >= 0, hash_block_size >= 1, think_time_s >= 0")
    if (n_requests is None) == (duration_s is None):
        raise ValueError("give exactly one of n_requests and duration_s")
    warmup = _warmup_s(turns, think_time_s)
    if n_requests is None:
        starts, user, answer, arrival = _conversations(
            seed, rate, arrival_cv, None, duration_s + warmup, prompt, output, turns, think_time_s, warmup)
    else:
        if n_requests < 1:
            raise ValueError(f"n_requests must be >= 1, got {n_requests}")
        # the first n requests from time 0 of the endless process: add conversations until
        # none that starts later could still arrive among the first n
        n_sessions = -(-n_requests // turns) + math.ceil(rate / turns * warmup)
        while True:
            starts, user, answer, arrival = _conversations(
                seed, rate, arrival_cv, n_sessions, None, prompt, output, turns, think_time_s, warmup)
            inside = np.sort(arrival[arrival >= 0])
            if len(inside) >= n_requests and (turns == 1 or starts[-1] > inside[n_requests - 1]):
                break
            n_sessions *= 2
    # prompt of turn k = system + all earlier (user + answer) + this turn's user tokens
    earlier = np.cumsum(user + answer, axis=1) - (user + answer)
    prompt_tokens = system_prompt_tokens + earlier + user
    shares = system_prompt_tokens > 0 or turns > 1
    hashes = _conversation_hashes(prompt_tokens, answer, system_prompt_tokens, hash_block_size) if shares else None
    n_sessions = len(starts)

    order = np.argsort(arrival.ravel(), kind="stable")
    order = order[arrival.ravel()[order] >= 0]
    if duration_s is not None:
        order = order[arrival.ravel()[order] < duration_s]
    else:
        order = order[:n_requests]
    process = "poisson" if arrival_cv == 1.0 else f"gamma cv={arrival_cv:g}"
    size = f"n={n_requests}" if n_requests is not None else f"duration={duration_s:g}s"
    return Trace(
        arrival_s=arrival.ravel()[order] - arrival.ravel()[order[0]],
        prompt_tokens=prompt_tokens.ravel()[order],
        output_tokens=answer.ravel()[order],
        source=(
            f"synth(rate={rate:g}/s {process}, {size}, prompt={prompt!r}, output={output!r}, "
            f"system={system_prompt_tokens}, turns={turns}, think={think_time_s:g}s, n_samples={n_samples}, "
            f"block={hash_block_size}, seed={seed})"
        ),
        prefix_hashes=None if hashes is None else hashes.take(order),
        hash_block_size=hash_block_size if shares else None,
        session_id=np.repeat(np.arange(n_sessions, dtype=np.int64), turns)[order] if turns > 1 else None,
        n_samples=np.full(len(order), n_samples, dtype=np.int64) if n_samples > 1 else None,
    )


def _warmup_s(turns: int, think_time_s: float) -> float:
    """How long before time 0 conversations start: a conversation's span (the sum of
    ``turns - 1`` exponential think times) exceeds it with probability below 1e-9."""
    if turns == 1 or think_time_s == 0:
        return 0.0
    k = turns - 1
    return think_time_s * (k + 10 * math.sqrt(k) + 25)


def _conversations(seed, rate, cv, n_sessions, duration_s, prompt, output, turns, think_time_s, warmup=0.0):
    """Start times, user tokens, answer tokens and arrival times (sessions x turns), drawn in
    a fixed order from a generator seeded with ``seed``; the first start is at ``-warmup``."""
    rng = np.random.default_rng(seed)
    if cv == 1.0:
        starts = poisson_arrivals(rate / turns, n=n_sessions, duration_s=duration_s, rng=rng)
    else:
        starts = gamma_arrivals(rate / turns, cv, n=n_sessions, duration_s=duration_s, rng=rng)
    starts = starts - warmup
    shape = (len(starts), turns)
    user = prompt.sample(rng, shape[0] * turns).reshape(shape)
    answer = output.sample(rng, shape[0] * turns).reshape(shape)
    think = rng.exponential(think_time_s, (shape[0], turns - 1)) if think_time_s > 0 else np.zeros((shape[0], turns - 1))
    arrival = starts[:, None] + np.concatenate([np.zeros((shape[0], 1)), np.cumsum(think, axis=1)], axis=1)
    return starts, user, answer, arrival


def _conversation_hashes(prompt: np.ndarray, answer: np.ndarray, system: int, block: int) -> Ragged:
    """Prefix hashes, session-major. A conversation carries the ids of the full blocks of its
    history (system prompt, then every prompt and answer so far); each turn's prompt reuses
    them and takes fresh ids for the blocks after them. Blocks that only an answer completes
    hold new content and also get fresh ids."""
    ids = count()
    system_ids = [next(ids) for _ in range(system // block)]
    rows: list[list[int]] = []
    for session_prompts, session_answers in zip(prompt.tolist(), answer.tolist()):
        history = list(system_ids)  # ids of the full blocks of the conversation so far
        for p, a in zip(session_prompts, session_answers):
            row = history + [next(ids) for _ in range(-(-p // block) - len(history))]
            rows.append(row)
            history = row[: p // block]
            history += [next(ids) for _ in range((p + a) // block - len(history))]
    return Ragged.from_rows(rows)


_LENGTH_SPECS = "fixed:N, uniform:LOW,HIGH, lognormal:MEAN,CV or empirical:TRACE"


def parse_length(spec: str, column: str = "prompt_tokens") -> LengthDist:
    """A length distribution from text: ``fixed:512``, ``uniform:100,2000``,
    ``lognormal:1000,1.5`` (mean, cv) or ``empirical:TRACE`` (a trace file or bundled sample
    name whose ``column``, ``prompt_tokens`` or ``output_tokens``, is resampled)."""
    kind, _, args = spec.partition(":")
    try:
        if kind == "empirical" and args:
            from kvsim.traces.bundled import load_named

            return Empirical.from_trace(load_named(args), column)
        numbers = [float(a) for a in args.split(",")] if args else []
        if kind == "fixed" and len(numbers) == 1 and numbers[0].is_integer():
            return Fixed(int(numbers[0]))
        if kind == "uniform" and len(numbers) == 2 and all(x.is_integer() for x in numbers):
            return Uniform(int(numbers[0]), int(numbers[1]))
        if kind == "lognormal" and len(numbers) == 2:
            return LogNormal(numbers[0], numbers[1])
    except ValueError as exc:
        raise ValueError(f"bad length spec {spec!r}: {exc}") from None
    raise ValueError(f"bad length spec {spec!r}; use {_LENGTH_SPECS}")
