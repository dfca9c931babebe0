"""A user's scheduler: admit new requests only while the KV pool keeps some headroom.

FCFS admits whenever the next request's own blocks fit, so under load the pool fills with
prompts and the running requests, which need a new block every ``block_size`` tokens,
preempt each other. This policy reads the engine's view and opens admission only while at
least ``headroom`` (a fraction of the pool) is free: fewer preemptions, at the cost of
requests waiting longer. Load it by path, ``--scheduler headroom_admission:HeadroomAdmission``
with this directory on ``sys.path``; parameters in the run config's ``[scheduler_params]``.
"""

from __future__ import annotations

from kvsim.policies.schedulers import SchedulerPolicy
from kvsim.policies.view import EngineView


class HeadroomAdmission(SchedulerPolicy):
    def __init__(self, headroom: float = 0.25, chunked_prefill: bool = True) -> None:
        super().__init__(chunked_prefill=chunked_prefill)
        if not 0.0 <= headroom < 1.0:
            raise ValueError(f"headroom_admission: headroom must be in [0, 1), not {headroom}")
        self.headroom = headroom

    def admission_open(self, view: EngineView) -> bool:
        return view.num_free_blocks >= self.headroom * view.config.num_blocks
