"""What a scheduling policy sees of the engine: a live, read-only view.

A policy decides orders, victims and admission from the engine's queues, its KV pool and its
configuration; it must not move requests between queues or touch blocks itself (the engine
does that, in vLLM V1's order, so every policy keeps the same step algorithm). The view
exposes exactly what a decision needs, without copies: the queues are windows onto the
engine's own containers, the configuration is frozen.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator, Sequence
from typing import TYPE_CHECKING, TypeVar, overload

from kvsim.policies.block_manager import KVStats
from kvsim.policies.config import EngineConfig
from kvsim.policies.request import Request

if TYPE_CHECKING:
    from kvsim.policies.engine import EngineCore

T = TypeVar("T")


class ReadOnlySequence(Sequence[T]):
    """A list seen through a window: indexable and iterable, never mutable, never copied."""

    __slots__ = ("_items",)

    def __init__(self, items: list[T]) -> None:
        self._items = items

    @overload
    def __getitem__(self, index: int) -> T: ...
    @overload
    def __getitem__(self, index: slice) -> Sequence[T]: ...
    def __getitem__(self, index):
        return self._items[index]

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[T]:
        return iter(self._items)


class ReadOnlyCollection(Collection[T]):
    """A queue seen through a window, in its service order."""

    __slots__ = ("_items",)

    def __init__(self, items: Collection[T]) -> None:
        self._items = items

    def __contains__(self, item: object) -> bool:
        return any(x is item for x in self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[T]:
        return iter(self._items)


class EngineView:
    """The engine's state as a policy may read it, live (it changes as the step proceeds)."""

    __slots__ = ("_engine", "running", "waiting", "swapped")

    def __init__(self, engine: EngineCore) -> None:
        self._engine = engine
        self.running: Sequence[Request] = ReadOnlySequence(engine.running)  # in admission order
        self.waiting: Collection[Request] = ReadOnlyCollection(engine.waiting)  # in queue order
        self.swapped: Collection[Request] = ReadOnlyCollection(engine.swapped)

    @property
    def config(self) -> EngineConfig:
        return self._engine.config

    @property
    def now(self) -> float:
        """The time the current (or last) step was scheduled at."""
        return self._engine.now

    @property
    def step(self) -> int:
        """The number of the step being scheduled."""
        return self._engine.counters.steps

    @property
    def running_seats(self) -> int:
        """Running slots taken now (``Request.seats`` summed over the running requests)."""
        return self._engine._running_seats

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation could use right now (free plus evictable cached)."""
        return self._engine.kv.num_available_blocks()

    def kv_stats(self) -> KVStats:
        """The pool's occupancy and counters (O(running requests): not for every hook call)."""
        return self._engine.kv_stats()
