"""The persistent decode batch: running requests that decode one token a step, kept as one.

vLLM V1 keeps a persistent input batch on the worker and sends it only what changed each step
(``CachedRequestData``: new block ids, resumed and finished requests). The engine does the same
on the policy side: a decode that needs nothing from its block manager, is not finishing and is
not cut by the token budget is the same decision every step, so the batch holds such requests
and a step over it costs what changes, not one call per request:

- ``events``: the step at which each member's ``allocate_slots`` next does something (a new
  block, a prefix registration, a copy-on-write), from the manager's ``decode_outlook``; at
  every other step the call would change nothing and answer True, so it is not made;
- ``boundaries`` and ``longest``: running sums of the batch's shape (context tokens, blocks
  touched, the longest context), so the cost model reads totals without a walk;
- ``finishes``: the step at which each member samples its last token.

Members' progress moves in one place, ``advance``, all at once: it moves the batch's
``clock``, and a member's ``num_computed_tokens`` and ``num_output_tokens`` (properties of
``Request``) are what they were when it joined plus the steps committed since. A loop of two
writes a member a step instead cost about a tenth of the run (cProfile, the first 6,000 Azure
conv requests). A member is marked by
``Request.batch_since`` and ``Request.batch`` (``Request.in_decode_batch``); leaving stores
its counters as they stand.
Heaps order by (step, running order) and carry the step the member's run began: an entry of
a request no longer in the batch, or from an earlier run of it, is stale and skipped.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

from kvsim.policies.request import Request

NEVER = 1 << 62  # a step no run reaches


@dataclass
class DecodeBatch:
    block_size: int
    clock: int = 0  # steps committed: members' counters advance with it
    members: set[Request] = field(default_factory=set)
    ctx_sum: int = 0  # sum of members' num_computed_tokens
    blocks_sum: int = 0  # sum of members' blocks touched by their next token: pos // bs + 1
    # (step, run_seq, batch_since, request); longest: (step - pos, ...), whose smallest is the longest context
    events: list[tuple[int, int, int, Request]] = field(default_factory=list)
    boundaries: list[tuple[int, int, int, Request]] = field(default_factory=list)
    finishes: list[tuple[int, int, int, Request]] = field(default_factory=list)
    longest: list[tuple[int, int, int, Request]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.members)

    def add(self, r: Request, step: int, event_in: int) -> None:
        """``r`` decodes from ``step`` on; its manager must act ``event_in`` steps later (NEVER: not before it ends)."""
        assert step == self.clock, f"a request joins the batch at the step it will run next ({self.clock}), not {step}"
        bs, pos, seq = self.block_size, r.num_computed_tokens, r.run_seq
        self.members.add(r)
        r.batch_since, r.batch = step, self
        self.ctx_sum += pos
        self.blocks_sum += pos // bs + 1
        if event_in < NEVER:
            heapq.heappush(self.events, (step + event_in, seq, step, r))
        heapq.heappush(self.boundaries, (step + bs - pos % bs, seq, step, r))
        heapq.heappush(self.finishes, (step + r.output_tokens - r.num_output_tokens - 1, seq, step, r))
        heapq.heappush(self.longest, (step - pos, seq, step, r))

    def schedule_event(self, r: Request, step: int) -> None:
        heapq.heappush(self.events, (step, r.run_seq, r.batch_since, r))

    def advance(self, step: int) -> None:
        """Every member sampled a token at ``step``: the one place their progress moves on, by the clock."""
        self.clock = step + 1
        self.ctx_sum += len(self.members)

    def remove(self, r: Request, advanced: bool) -> None:
        """Take out a member (its counters stored as they stand): between steps, or (``advanced``)
        after its step's commit, before the next ``start_step``."""
        computed, output = r.num_computed_tokens, r.num_output_tokens
        self.members.discard(r)
        r.batch_since, r.batch = -1, None
        r.num_computed_tokens, r.num_output_tokens = computed, output
        self.ctx_sum -= computed
        self.blocks_sum -= (computed - advanced) // self.block_size + 1

    def pop_due(self, heap: list, step: int) -> list[Request]:
        """Members whose entry in ``heap`` falls at ``step`` (or before), in running order."""
        due = []
        while heap and heap[0][0] <= step:
            _, _, since, r = heapq.heappop(heap)
            if r.batch_since == since:
                due.append(r)
        return due

    def start_step(self, step: int) -> None:
        """After the members advanced to ``step``'s positions: count those that open a new block."""
        bs, heap = self.block_size, self.boundaries
        while heap and heap[0][0] <= step:
            _, seq, since, r = heapq.heappop(heap)
            if r.batch_since == since:
                self.blocks_sum += 1
                heapq.heappush(heap, (step + bs, seq, since, r))

    def longest_position(self, step: int) -> int:
        """The largest ``num_computed_tokens`` among members at ``step`` (members advance one a step)."""
        heap = self.longest
        while heap[0][3].batch_since != heap[0][2]:
            heapq.heappop(heap)
        return step - heap[0][0]

    def check(self, step: int) -> None:
        """Raise AssertionError unless the running sums match the members (between steps)."""
        bs = self.block_size
        assert self.ctx_sum == sum(r.num_computed_tokens for r in self.members), "decode batch: context sum"
        assert self.blocks_sum == sum(r.num_computed_tokens // bs + 1 for r in self.members), "decode batch: blocks sum"
        if self.members:
            assert self.longest_position(step) == max(r.num_computed_tokens for r in self.members), "decode batch: longest"
        for r in self.members:
            assert r.is_decode and r.in_decode_batch, f"{r.request_id} is not decoding in the batch"
