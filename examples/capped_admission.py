"""A user's scheduling policy: cap new admissions per step, and preempt the biggest KV holder.

Load it by path, ``scheduler = "capped_admission:CappedAdmission"``, with this directory on
``sys.path`` (``PYTHONPATH=examples``); ``capped_admission.toml`` is a run config using it.

Why these two rules: after a burst, FCFS admits as many new prompts as the token budget
allows, and the prefill-heavy steps that follow stall every running decode; admitting at most
``max_new_per_step`` requests a step spreads a burst's prefills out. And when blocks run out,
preempting the request that holds the most KV frees the most memory for one preemption,
where FCFS would evict the newest request, which holds the least.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from itertools import islice

from kvsim.policies.request import Request
from kvsim.policies.schedulers import SchedulerPolicy
from kvsim.policies.view import EngineView


class CappedAdmission(SchedulerPolicy):
    def __init__(self, max_new_per_step: int = 2, chunked_prefill: bool = True) -> None:
        super().__init__(chunked_prefill=chunked_prefill)
        if max_new_per_step < 1:
            raise ValueError(f"capped_admission: max_new_per_step must be >= 1, not {max_new_per_step}")
        self.max_new_per_step = max_new_per_step

    def waiting_order(self, queue: Collection[Request], view: EngineView) -> Iterable[Request]:
        """The queue in its order (preempted requests at the front), cut to the step's cap."""
        return islice(queue, self.max_new_per_step)

    def pick_victim(self, view: EngineView) -> Request:
        return max(view.running, key=lambda r: (r.num_computed_tokens, r.arrival_s, r.order))
