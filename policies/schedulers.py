"""Scheduling policies: the hooks that make fcfs, chunked, priority, sjf and static differ.

The step algorithm itself is one (vLLM V1's, in ``policies.engine``): serve running requests
under one token budget, preempting when a request cannot get a block, then admit waiting
ones if nothing was preempted. A policy only decides orders, the preemption victim, whether
prefills may be chunked and when admission is open, from a read-only view of the engine
(``EngineView``: its queues, KV pool, configuration and clock).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable

from kvsim.policies.registry import register_scheduler
from kvsim.policies.request import Request
from kvsim.policies.view import EngineView


class SchedulerPolicy:
    """Base policy = vLLM V1 ``fcfs``: list order, victim = most recently admitted."""

    registered_name = "?"

    def __init__(self, chunked_prefill: bool = True) -> None:
        self.chunked_prefill = chunked_prefill

    queue_key: Callable[[Request], tuple] | None = None  # static service order of the queues; None = FIFO

    def running_order(self, view: EngineView) -> Iterable[Request]:
        """The order running requests get their next tokens in this step."""
        return view.running

    def waiting_order(self, queue: Collection[Request], view: EngineView) -> Iterable[Request]:
        """Admission order of ``queue`` (``view.waiting`` or ``view.swapped``): as kept (by ``queue_key``)."""
        return queue

    def pick_victim(self, view: EngineView) -> Request:
        """The running request to preempt when one cannot get a block (it may be the one asking)."""
        return view.running[-1]

    def admission_open(self, view: EngineView) -> bool:
        """May this step admit anyone (swapped requests first, then waiting ones)?"""
        return True

    def admission_limit(self, view: EngineView) -> int:
        """How many sequences may run at once."""
        return view.config.max_num_seqs


@register_scheduler("fcfs")
class FCFSPolicy(SchedulerPolicy):
    """Continuous batching, first come first served (vLLM V1 defaults, chunked prefill on)."""


@register_scheduler("chunked")
class ChunkedPrefillPolicy(SchedulerPolicy):
    """Sarathi-style: every decode first, then prefill chunks fill what is left of the budget."""

    def __init__(self) -> None:
        super().__init__(chunked_prefill=True)

    def running_order(self, view: EngineView) -> Iterable[Request]:
        decodes = [r for r in view.running if not r.is_prefill]
        return decodes + [r for r in view.running if r.is_prefill]


@register_scheduler("priority")
class PriorityPolicy(SchedulerPolicy):
    """Lower ``priority`` value first, then arrival, with aging; the victim is the worst by the same key.

    A request's effective priority improves by ``aging_per_s`` levels per second it has waited,
    so a low-priority request cannot starve behind a steady stream of higher-priority ones: with
    the default 0.1, one level is worth 10 s of waiting. 0 gives strict priority.
    """

    def __init__(self, aging_per_s: float = 0.1, chunked_prefill: bool = True) -> None:
        super().__init__(chunked_prefill=chunked_prefill)
        if aging_per_s < 0:
            raise ValueError(f"priority: aging_per_s must be >= 0, not {aging_per_s}")
        self.aging = aging_per_s

    def queue_key(self, r: Request) -> tuple:
        """``priority - aging * (now - arrival)`` orders requests as ``priority + aging * arrival``
        does (the ``now`` term is common to all), so the key is static and the queue stays sorted."""
        return (r.priority + self.aging * r.arrival_s, r.arrival_s, r.order)

    def pick_victim(self, view: EngineView) -> Request:
        return max(view.running, key=self.queue_key)


@register_scheduler("sjf")
class ShortestJobFirstPolicy(SchedulerPolicy):
    """Shortest prompt first (or shortest known output with ``oracle``), with aging.

    A request's key is its length in tokens minus ``aging_tokens_per_s`` times how long it has
    waited, so a long request's key falls until it reaches the head: nothing starves.
    """

    def __init__(self, oracle: bool = False, aging_tokens_per_s: float = 100.0, chunked_prefill: bool = True) -> None:
        super().__init__(chunked_prefill=chunked_prefill)
        if aging_tokens_per_s < 0:
            raise ValueError(f"sjf: aging_tokens_per_s must be >= 0, not {aging_tokens_per_s}")
        self.oracle = oracle
        self.aging = aging_tokens_per_s

    def job_length(self, r: Request) -> int:
        return r.remaining_output if self.oracle else r.prompt_tokens

    def queue_key(self, r: Request) -> tuple:
        """``length - aging * (now - arrival)`` orders requests as ``length + aging * arrival`` does
        (the ``now`` term is common to all), so the key is static and the queue stays sorted."""
        return (self.job_length(r) + self.aging * r.arrival_s, r.arrival_s, r.order)

    def pick_victim(self, view: EngineView) -> Request:
        return max(view.running, key=lambda r: (self.job_length(r), r.arrival_s, r.order))


@register_scheduler("static")
class StaticBatchingPolicy(SchedulerPolicy):
    """Form a batch of up to ``batch_size`` requests and run it to completion before admitting more."""

    def __init__(self, batch_size: int = 8) -> None:
        super().__init__(chunked_prefill=True)
        if batch_size < 1:
            raise ValueError(f"static: batch_size must be >= 1, not {batch_size}")
        self.batch_size = batch_size

    def admission_open(self, view: EngineView) -> bool:
        return not view.running

    def admission_limit(self, view: EngineView) -> int:
        return min(self.batch_size, view.config.max_num_seqs)
