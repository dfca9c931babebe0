"""Fixtures shared across test files: small engines, a checked step loop, the shared traces."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from kvsim.policies.config import EngineConfig
from kvsim.policies.engine import EngineCore
from kvsim.policies.plan import StepPlan

SHARED_TRACES = Path(__file__).resolve().parents[2] / "shared" / "traces"

# A pool small enough that a handful of requests exhausts it: 16 blocks of 4 tokens.
SMALL_ENGINE = dict(num_blocks=16, block_size=4, max_model_len=64, max_num_seqs=8, max_num_batched_tokens=32)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """``slow`` tests stay out of the default run (the suite's time budget); any ``-m``
    expression decides for itself: ``-m slow`` runs only them, ``-m "slow or not slow"`` all."""
    if config.getoption("markexpr"):
        return
    skip = pytest.mark.skip(reason="slow: select with -m slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@dataclass
class Driver:
    """Steps an engine with a fixed step time, checking every plan's slots and the invariants."""

    engine: EngineCore
    step_time: float = 1.0
    now: float = 0.0
    plans: list[StepPlan] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)  # request ids, in finishing order

    def step(self) -> StepPlan:
        plan = self.engine.schedule(self.now)
        plan.check(self.engine.kv.block_size)
        self.now += self.step_time
        self.finished += [r.request_id for r in self.engine.commit(plan, self.now)]
        self.engine.check_invariants()
        self.plans.append(plan)
        return plan

    def run(self, max_steps: int = 10_000) -> list[StepPlan]:
        """Step until the engine has nothing left; returns this call's plans."""
        start = len(self.plans)
        while self.engine.has_unfinished():
            if len(self.plans) - start >= max_steps:
                raise AssertionError(f"engine did not drain within {max_steps} steps")
            self.step()
        return self.plans[start:]

    @property
    def log(self) -> str:
        """The decision log: one JSON line a step."""
        return "\n".join(p.to_json() for p in self.plans)

    @staticmethod
    def batch(plan: StepPlan) -> list[tuple[str, int, int, str]]:
        """A plan's batch as (request id, first position, tokens, "p"refill or "d"ecode)."""
        return [(e.request_id, e.first_position, e.num_tokens, "p" if e.is_prefill else "d") for e in plan.entries]


@pytest.fixture
def make_engine() -> Callable[..., EngineCore]:
    """``make_engine(**overrides)``: an engine on SMALL_ENGINE's geometry with the overrides applied."""
    return lambda **overrides: EngineCore(EngineConfig(**{**SMALL_ENGINE, **overrides}))


@pytest.fixture
def make_driver(make_engine) -> Callable[..., Driver]:
    """``make_driver(**engine_overrides)``: a Driver around a fresh small engine."""
    return lambda **overrides: Driver(make_engine(**overrides))


@pytest.fixture(scope="session")
def shared_trace() -> Callable:
    """``shared_trace(relative_path, limit=None)``: a trace under ../shared/traces (skips when absent)."""
    from kvsim import traces

    cache: dict[tuple[str, int | None], object] = {}

    def load(relative_path: str, limit: int | None = None):
        path = SHARED_TRACES / relative_path
        if not path.exists():
            pytest.skip(f"{path} is not present")
        key = (relative_path, limit)
        if key not in cache:
            trace = traces.load(path)
            cache[key] = trace if limit is None else traces.first(trace, limit)
        return cache[key]

    return load


def run_to_the_end(engine: EngineCore, workload: list[tuple[int, int, int]], detail, check: bool = False) -> list[StepPlan]:
    """Add (prompt, output, samples) requests at t = 0 and step one second at a time until all end."""
    for i, (prompt, output, n) in enumerate(workload):
        engine.add_request(f"r{i}", 0.0, prompt, output, n_samples=n)
    plans, now = [], 0.0
    while engine.has_unfinished():
        plan = engine.schedule(now, detail)
        now += 1.0
        engine.commit(plan, now)
        if check:
            engine.check_invariants()
        plans.append(plan)
    return plans


@pytest.fixture
def step_all() -> Callable[..., list[StepPlan]]:
    """:func:`run_to_the_end`, for tests that compare the plans of two engines."""
    return run_to_the_end
