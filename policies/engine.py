"""EngineCore: turns request state into one StepPlan per step, and commits its results.

The step algorithm is vLLM V1's (``vllm/v1/core/sched/scheduler.py``), one token budget per
step with no separate prefill and decode phases:

1. Running requests, in the policy's order, each get their next tokens (a decode token, or
   a prefill chunk) if the block manager can make room; when it cannot, the policy's victim
   is preempted (recompute: blocks freed, progress reset; swap: KV moved to the host pool)
   and allocation is retried. If the victim is the request itself, the pass stops.
2. Only in a step without preemption: swapped requests come back first, then waiting ones
   are admitted (with their prefix-cache hits) while the budget, ``max_num_seqs``, the
   watermark and the pool allow; the first that does not fit stops admission (head of line).

Running out of blocks is an outcome: requests queue, are preempted, or are rejected with a
reason at arrival when they could never fit. Nothing in here reads a clock except the
``now`` it is given, so equal inputs give an identical decision log.

``schedule`` decides, ``commit`` applies: a step's progress (``num_computed_tokens``,
``num_output_tokens``) advances in ``commit`` and nowhere else (``schedule`` only sets it where
it starts: the prefix-cache hit at admission, 0 at a recompute preemption). What one step
has decided so far (its budget, the requests it scheduled) is a ``ScheduledStep`` handed from
helper to helper.

Running requests that simply decode are kept in a persistent batch (``decode_batch``) when
the block manager opts in (``DecodeFastPath``) and the policy keeps the running order: when
the step cannot preempt, cut the batch by the budget or reorder it, the batch's decisions are
certain and the step costs what changes (new and finishing requests, manager events), not one
pass per request; otherwise the batch is dissolved and the step is decided request by request.
The helpers of that fast path are named for what they skip (``_visits_skipping_plain_decodes``,
``_plain_decodes_take_tokens``). Both give the same decisions (``benchmarks/decision_identity.py``).
"""

from __future__ import annotations

import bisect
import inspect
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Protocol

from kvsim.policies.block_manager import BlockManager, DecodeFastPath, KVStats
from kvsim.policies.blocks import cdiv, slots_for
from kvsim.policies.config import EngineConfig
from kvsim.policies.decode_batch import NEVER, DecodeBatch
from kvsim.policies.plan import (
    BatchChanges,
    BatchDecodes,
    PlanDetail,
    PlanEntry,
    PlanTotals,
    StepPlan,
)
from kvsim.policies.queue import RequestQueue
from kvsim.policies.registry import resolve_block_manager, resolve_scheduler
from kvsim.policies.request import Request, Status
from kvsim.policies.schedulers import SchedulerPolicy
from kvsim.policies.view import EngineView

KVCounts = tuple[int, int, int, int]  # (used, cached, free) blocks and internal-waste slots


def _first(item: tuple) -> int:
    return item[0]


_run_seq = attrgetter("run_seq")  # the running order's key
_CHANGES, _TABLES, _SLOTS = PlanDetail.CHANGES, PlanDetail.TABLES, PlanDetail.SLOTS  # read each step
_num_computed = attrgetter("num_computed_tokens")
_status = attrgetter("status")
_num_preemptions = attrgetter("num_preemptions")


def _construct(cls: type, kind: str, name: str, params: dict, **given):
    """Instantiate a policy class with the run's parameters, naming any it does not take."""
    accepted = inspect.signature(cls.__init__).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values())
    unknown = [k for k in params if k not in accepted and not takes_any]
    if unknown:
        raise ValueError(f"{kind} {name!r} does not take parameter(s) {unknown}; it takes {sorted(set(accepted) - {'self'})}")
    extra = {k: v for k, v in given.items() if k in accepted or takes_any}
    return cls(**extra, **params)


class TokenSink(Protocol):
    """Who hears of each request's scheduling and tokens as ``commit`` applies them (the simulator's metrics)."""

    def scheduled(self, request_id: str, t: float) -> None:
        """The request ran in a step that started at ``t`` (the first call counts)."""

    def token(self, request_id: str, t: float) -> None:
        """The request sampled a token at ``t``."""

    def batch_tokens(self, request_id: str, first_step: int, last_step: int) -> None:
        """The request sampled a token at the end of every step from ``first_step`` to ``last_step``."""


@dataclass(slots=True)
class ScheduledStep:
    """One step as ``schedule`` decides it: handed to each helper of the step, then kept (the
    step in flight) for ``commit``, which applies it."""

    plan: StepPlan
    budget: int  # tokens the step may still schedule
    # the requests scheduled outside the decode batch: request id -> (request, new tokens), in order
    scheduled: dict[str, tuple[Request, int]] = field(default_factory=dict)
    batch_blocks: int = 0  # sum of scheduled requests' table lengths (see batch_blocks_within_pool)
    due: list[Request] = field(default_factory=list)  # batch members whose manager acted this step
    loose_entries: list[PlanEntry] = field(default_factory=list)  # the entries of ``scheduled``, in its order


@dataclass
class EngineCounters:
    steps: int = 0
    preemptions: int = 0
    recompute_preemptions: int = 0
    swap_preemptions: int = 0
    rejected: int = 0
    finished: int = 0
    aborted: int = 0


class EngineCore:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        policy_cls = resolve_scheduler(config.scheduler)
        self.policy: SchedulerPolicy = _construct(policy_cls, "scheduler", config.scheduler, config.scheduler_params)
        manager_cls = resolve_block_manager(config.block_manager)
        self.kv: BlockManager = _construct(
            manager_cls,
            "block manager",
            config.block_manager,
            config.block_manager_params,
            num_blocks=config.num_blocks,
            block_size=config.block_size,
            num_host_blocks=config.num_host_blocks,
            max_model_len=config.max_model_len,
            kv_tiers=config.kv_tiers,
        )
        # The tiers under the pool (None: off), whose transfers the simulator times each step.
        self.kv_tiers = getattr(self.kv, "tiers", None)
        if config.kv_tiers is not None and self.kv_tiers is None:
            raise ValueError(f"block manager {config.block_manager!r} keeps no KV tiers; KV offloading needs 'prefix'")
        self._watermark_blocks = config.watermark_blocks
        self.requests: dict[str, Request] = {}
        self.waiting = RequestQueue(self.policy.queue_key)
        self.running: list[Request] = []
        self._running_seats = 0  # sum of Request.seats over running, kept as requests join and leave
        self._num_joins = 0  # Request.run_seq: the running order
        self._batch = DecodeBatch(self.kv.block_size)
        self._loose: list[Request] = []  # running requests outside the decode batch, in running order
        # The batch's decisions equal the request-by-request pass only in the running list's order
        # and without the kernel's per-batch block limit, and it needs a manager that can say
        # when its decodes act (the opt-in DecodeFastPath).
        self._batching = (
            isinstance(self.kv, DecodeFastPath)
            and type(self.policy).running_order is SchedulerPolicy.running_order
            and not config.batch_blocks_within_pool
        )
        self._in_flight: ScheduledStep | None = None  # scheduled, not yet committed
        self.token_sink: TokenSink | None = None
        self.swapped = RequestQueue(self.policy.queue_key)
        self.counters = EngineCounters()
        self.now = 0.0  # the time of the step being (or last) scheduled
        self.view = EngineView(self)  # all a policy sees of the engine
        self._num_orders = 0
        self._pending_rejections: list[tuple[str, str]] = []
        self._left: list[str] = []  # requests that left the running set since the last plan was filled
        self._last_ran_all = True  # the last step ran every running request and forked none
        # A P/D prefill instance's finished requests keep their blocks until their KV has left
        # (:meth:`release_kv`), as vLLM's connectors delay freeing (request_finished -> delay_free_blocks).
        self.hold_finished_kv = False
        self.held: dict[str, Request] = {}

    # --- requests in and out -----------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        arrival_s: float,
        prompt_tokens: int,
        output_tokens: int,
        *,
        priority: int = 0,
        n_samples: int = 1,
        trace_hashes: tuple[int, ...] | None = None,
        hash_block_size: int | None = None,
        token_ids: tuple[int, ...] | None = None,
        trace_index: int = -1,
    ) -> Request:
        """Queue a request, or reject it with a reason when it can never run."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in the engine")
        if token_ids is not None and len(token_ids) != prompt_tokens:
            raise ValueError(f"request {request_id!r}: {len(token_ids)} token ids for a {prompt_tokens}-token prompt")
        request = Request(
            request_id=request_id,
            order=self._next_order(),
            arrival_s=arrival_s,
            prompt_tokens=prompt_tokens,
            output_tokens=output_tokens,
            priority=priority,
            n_samples=n_samples,
            trace_hashes=trace_hashes,
            hash_block_size=hash_block_size,
            token_ids=token_ids,
            trace_index=trace_index,
        )
        self.requests[request_id] = request
        reason = self._rejection_reason(request)
        if reason is None:
            self.waiting.add(request)
        else:
            request.status = Status.REJECTED
            request.reject_reason = reason
            self.counters.rejected += 1
            self._pending_rejections.append((request_id, reason))
        return request

    def _next_order(self) -> int:
        self._num_orders += 1
        return self._num_orders

    def _rejection_reason(self, r: Request) -> str | None:
        cfg = self.config
        if r.prompt_tokens < 1 or r.output_tokens < 1 or r.n_samples < 1:
            return "invalid_length"
        if r.prompt_tokens + r.output_tokens > cfg.max_model_len:
            return "exceeds_max_model_len"
        if not self.kv.can_ever_fit(r) or self.kv.blocks_needed(r, r.max_kv_tokens) > cfg.num_blocks - cfg.watermark_blocks:
            return "exceeds_kv_pool"
        step_cap = min(cfg.max_num_batched_tokens, cfg.long_prefill_token_threshold or cfg.max_num_batched_tokens)
        if not self.policy.chunked_prefill and r.max_kv_tokens > step_cap:
            return "exceeds_token_budget"
        if r.n_samples > self.policy.admission_limit(self.view):
            return "exceeds_max_num_seqs"
        if cfg.max_waiting and len(self.waiting) >= cfg.max_waiting:
            return "queue_full"
        return None

    def abort(self, request_id: str) -> bool:
        """Stop a request wherever it is; False if it already ended."""
        request = self.requests.get(request_id)
        if request is None or request.is_finished:
            return False
        if request.status is Status.RUNNING:
            self._leave_running(request)
            self.kv.free(request)
        elif request.status is Status.SWAPPED:
            self.swapped.remove(request)
            self.kv.free(request)
        else:
            self._leave_waiting(request)
        request.status = Status.ABORTED
        self.counters.aborted += 1
        return True

    def _leave_waiting(self, request: Request) -> None:
        """Take a waiting request out for good, with what prefix lookups kept for it (its block hashes)."""
        self.waiting.remove(request)
        self.kv.free(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped or self._pending_rejections)

    # --- the step ----------------------------------------------------------------------
    def schedule(self, now: float, detail: PlanDetail = PlanDetail.SLOTS) -> StepPlan:
        """Decide the next step at time ``now``; its plan spells out what ``detail`` asks for."""
        self.now = now
        step = ScheduledStep(StepPlan(self.counters.steps, rejected=self._pending_rejections),
                             budget=self.config.max_num_batched_tokens)
        self._pending_rejections = []

        preempted = self._schedule_running(step)
        if not preempted and self.policy.admission_open(self.view):
            limit = self.policy.admission_limit(self.view)
            if self.swapped:
                self._admit_swapped(step, limit)
            if not self.swapped:  # a swapped request that cannot come back yet holds the line
                self._admit_waiting(step, limit)
        if not step.scheduled and not self.running and not self.swapped and self.waiting and not self.held:
            self._reject_unschedulable(step.plan)  # (blocks held for a connector come back once sent)

        self._fill_plan(step, detail)
        self._in_flight = step
        self.counters.steps += 1
        return step.plan

    def _num_new_tokens(self, step: ScheduledStep, r: Request, num_hit: int = 0) -> int:
        remaining = r.num_tokens - r.num_computed_tokens - num_hit
        n = remaining
        if self.config.long_prefill_token_threshold:
            n = min(n, self.config.long_prefill_token_threshold)
        n = min(n, step.budget)
        if n < remaining and not self.policy.chunked_prefill:
            return 0
        return n

    def _schedule_running(self, step: ScheduledStep) -> bool:
        """The running pass, request by request in the policy's order; True if it preempted anyone.

        With the decode batch it visits only the requests that need a decision, in running
        order (``_visits_skipping_plain_decodes``). The plain members between them take one
        token each from the budget, as the request-by-request pass gives them, without a call
        each (``_plain_decodes_take_tokens``); members the pass does not reach (the budget ran
        out, or it stopped at a self-preemption) leave the batch unscheduled.
        """
        batching, running = self._batching, self.running
        order = self._visits_skipping_plain_decodes(step) if batching else list(self.policy.running_order(self.view))
        preempted_any = False
        allocate_slots = self.kv.allocate_slots
        kernel_limit = self.config.batch_blocks_within_pool
        status_running = Status.RUNNING
        cursor = 0  # with the batch: running entries before this index are decided
        for request in order:
            if request.status is not status_running:
                continue  # preempted earlier in this step
            if batching:
                at = running.index(request)
                if at > cursor and not self._plain_decodes_take_tokens(step, cursor, at):
                    return preempted_any
                cursor = at
            if step.budget <= 0:
                if batching:
                    self._leave_batch_from(cursor)
                return preempted_any
            if request.is_decode:  # the steady state: one token, which any positive budget and cap admit
                num_new = 1
            else:
                num_new = self._num_new_tokens(step, request)
                if num_new == 0:
                    cursor += 1
                    continue
            if kernel_limit and not self._within_kernel_block_limit(step, request.num_computed_tokens + num_new):
                continue
            while not allocate_slots(request, num_new):
                victim = self.policy.pick_victim(self.view)
                if batching and running.index(victim) < cursor:
                    cursor -= 1
                    if victim.in_decode_batch:  # a member that had taken its token
                        step.budget += 1
                self._preempt(step, victim)
                preempted_any = True
                if victim is request:
                    if batching:
                        self._leave_batch_from(cursor)
                    return True
            if request.in_decode_batch:
                step.budget -= 1
            else:
                self._schedule(step, request, num_new)
            cursor += 1
        if batching and cursor < len(running):
            self._plain_decodes_take_tokens(step, cursor, len(running))
        return preempted_any

    def _visits_skipping_plain_decodes(self, step: ScheduledStep) -> list[Request]:
        """The running requests the batched pass visits, in running order: those outside the
        batch and the members whose manager must act this step (``step.due``); the rest of the
        batch, plain decodes, is not visited."""
        batch = self._batch
        step.due = due = batch.pop_due(batch.events, step.plan.step)
        # two runs in running order (run_seq unique): a C-level sort merges them
        return sorted(self._loose + due, key=_run_seq) if due else list(self._loose)

    def _plain_decodes_take_tokens(self, step: ScheduledStep, start: int, stop: int) -> bool:
        """Batch members ``running[start:stop]``, not visited, each take a token while the budget lasts; False if it ran out."""
        count = stop - start
        if step.budget >= count:
            step.budget -= count
            return True
        taken = step.budget
        step.budget = 0
        self._leave_batch_from(start + taken)
        return False

    def _leave_batch_from(self, index: int) -> None:
        """Members at ``running[index:]`` are not scheduled this step: they leave the batch."""
        for request in self.running[index:]:
            if request.in_decode_batch:
                self._leave_batch(request)
                bisect.insort(self._loose, request, key=_run_seq)

    def _leave_batch(self, request: Request, last_step: int | None = None) -> None:
        """Take a member out of the batch, reporting its batch tokens up to ``last_step`` (default: the step before this one)."""
        advanced = last_step is not None
        last = last_step if advanced else self.counters.steps - 1
        if self.token_sink is not None and request.batch_since <= last:
            self.token_sink.batch_tokens(request.request_id, request.batch_since, last)
        self._batch.remove(request, advanced)

    def _event_in(self, request: Request) -> int:
        """Steps until the manager must act on the request's decodes (0: its next write copies a block first)."""
        outlook = self.kv.decode_outlook(request, NEVER)
        if outlook is None:
            return 0
        growth, bookkeeping = outlook.growth, outlook.bookkeeping
        return min(growth.start if growth else NEVER, bookkeeping.start if bookkeeping else NEVER)

    def _schedule(self, step: ScheduledStep, request: Request, num_new: int) -> None:
        step.scheduled[request.request_id] = (request, num_new)
        step.budget -= num_new
        if self.config.batch_blocks_within_pool:  # only the kernel-limit check reads it
            step.batch_blocks += cdiv(request.num_computed_tokens + num_new, self.kv.block_size)

    def _within_kernel_block_limit(self, step: ScheduledStep, tokens_after: int) -> bool:
        if not self.config.batch_blocks_within_pool:
            return True
        return step.batch_blocks + cdiv(tokens_after, self.kv.block_size) <= self.config.num_blocks

    def _preempt(self, step: ScheduledStep, victim: Request) -> None:
        self._leave_running(victim)
        taken = step.scheduled.pop(victim.request_id, None)
        if taken is not None:
            step.budget += taken[1]
            if self.config.batch_blocks_within_pool:
                step.batch_blocks -= cdiv(victim.num_computed_tokens + taken[1], self.kv.block_size)
        # A victim whose copy-on-write is still pending this step has a block whose content
        # does not exist yet: swapping it out would save garbage, so it is recomputed instead.
        cow_pending = self.kv.cancel_copies(victim)
        swapped = None
        if self.config.preemption_mode == "swap" and not cow_pending:
            swapped = self.kv.swap_out(victim)  # None when the host pool has no room
        plan = step.plan
        if swapped is not None:
            plan.swap_out.extend(swapped)
            victim.status = Status.SWAPPED
            self.swapped.add_front(victim)
            mode = "swap"
            self.counters.swap_preemptions += 1
        else:
            self.kv.free(victim)
            victim.num_computed_tokens = 0
            victim.status = Status.WAITING
            self.waiting.add_front(victim)
            mode = "recompute"
            self.counters.recompute_preemptions += 1
        victim.num_preemptions += 1
        self.counters.preemptions += 1
        plan.preempted.append((victim.request_id, mode))

    def _room_for(self, blocks_needed: int) -> bool:
        return self.kv.num_available_blocks() - blocks_needed >= self._watermark_blocks

    def _admit_swapped(self, step: ScheduledStep, limit: int) -> None:
        for request in list(self.policy.waiting_order(self.view.swapped, self.view)):
            if step.budget <= 0 or self._running_seats + request.seats > limit:
                return
            num_new = self._num_new_tokens(step, request)
            host_blocks = self.kv.swap_in_blocks_needed(request)
            tokens_after = request.num_computed_tokens + num_new
            growth = max(0, cdiv(tokens_after, self.kv.block_size) - host_blocks)
            if num_new == 0 or not self._room_for(host_blocks + growth) or not self._within_kernel_block_limit(step, tokens_after):
                return
            pairs = self.kv.swap_in(request)
            if pairs is None or not self.kv.allocate_slots(request, num_new):
                raise AssertionError(f"swap-in of {request.request_id} failed after the room check")
            step.plan.swap_in.extend(pairs)
            self.swapped.remove(request)
            self._start_running(step, request, num_new)

    def _admit_waiting(self, step: ScheduledStep, limit: int) -> None:
        admitted: list[Request] = []
        for request in self.policy.waiting_order(self.view.waiting, self.view):
            if step.budget <= 0 or self._running_seats + request.seats > limit:
                break
            num_hit = self.kv.lookup(request)
            num_external = max(0, request.external_tokens - num_hit)  # delivered KV: fresh blocks, nothing to compute
            num_new = self._num_new_tokens(step, request, num_hit + num_external)
            if num_new == 0 or not self._within_kernel_block_limit(step, num_hit + num_external + num_new):
                break
            if not self._room_for(self.kv.blocks_needed(request, num_external + num_new, num_hit)):
                break
            if not self.kv.allocate_slots(request, num_external + num_new, num_hit):
                break
            request.num_computed_tokens = num_hit + num_external
            request.external_tokens = 0
            if request.num_preemptions == 0:
                request.prefix_hit_tokens = num_hit
            request.admitted_step = self.counters.steps
            admitted.append(request)
            self._start_running(step, request, num_new)
        if not admitted:
            return
        self.waiting.remove_all(admitted)

    def _start_running(self, step: ScheduledStep, request: Request, num_new: int) -> None:
        request.status = Status.RUNNING
        self._join_running(request)
        self._schedule(step, request, num_new)

    def _join_running(self, request: Request) -> None:
        self._num_joins += 1
        request.run_seq = self._num_joins
        self.running.append(request)
        self._loose.append(request)
        self._running_seats += request.seats

    def _leave_running(self, request: Request, last_step: int | None = None) -> None:
        """``last_step``: the step whose commit this is (a member's last batch token); None: before any member advanced."""
        self.running.remove(request)
        self._left.append(request.request_id)
        if request.in_decode_batch:
            self._leave_batch(request, last_step)
        else:
            self._loose.remove(request)
        self._running_seats -= request.seats

    def waits_for_held_kv(self, plan: StepPlan) -> bool:
        """Nothing ran and nothing could be admitted, with blocks held for a connector: the engine can only
        wait for a held prompt's KV to leave (:meth:`release_kv`)."""
        return bool(self.held) and plan.is_empty and not self.running and not self.swapped

    def _reject_unschedulable(self, plan: StepPlan) -> None:
        """Nothing runs and nothing can be admitted, and no held block will come back: the head of the
        policy's queue can never run."""
        request = next(iter(self.policy.waiting_order(self.view.waiting, self.view)))
        self._leave_waiting(request)
        request.status = Status.REJECTED
        request.reject_reason = "unschedulable"
        self.counters.rejected += 1
        plan.rejected.append((request.request_id, "unschedulable"))

    def _fill_plan(self, step: ScheduledStep, detail: PlanDetail) -> None:
        """Entries of the scheduled requests and their totals in one pass; the batch's from its running sums.

        A whole plan (``detail`` TABLES or SLOTS) has every entry and table (and slot, SLOTS), in
        running order; below that ``entries`` holds only the requests outside the decode batch
        and ``plan.batch`` counts the members' one-token decodes, with what changed (CHANGES) in
        a step the changes can tell, or else the plan is whole after all.
        """
        plan = step.plan
        bs = self.kv.block_size
        block_table = self.kv.block_table
        batch = self._batch
        members = len(batch)
        ran_all = len(step.scheduled) + members == len(self.running)
        with_changes = detail == _CHANGES and self._batching and ran_all and self._last_ran_all
        whole = detail >= _TABLES or (detail == _CHANGES and not with_changes)
        with_slots = detail == _SLOTS
        changed_tables: dict[str, list[int]] = {}
        loose_entries: list[PlanEntry] = []
        loose_tables: dict[str, tuple[list[int], list[int]]] = {}  # request id -> (table, slots), whole
        totals = PlanTotals(bs)
        # The decode path's sums stay in locals (the hot loop); PlanTotals.of is the reference (plan.check).
        num_tokens = sampled = blocks_touched = decode_seqs = decode_ctx = decode_max_blocks = 0
        for request, num_new in step.scheduled.values():
            rid = request.request_id
            first = request.num_computed_tokens
            end = first + num_new
            samples = end == request.prompt_tokens + request.num_output_tokens
            num_tokens += num_new
            sampled += samples
            if request.is_decode:
                entry = PlanEntry(rid, first, 1, False, True)
                blocks = first // bs + 1  # cdiv(end, bs) for end = first + 1
                decode_seqs += 1
                decode_ctx += end
                if blocks > decode_max_blocks:
                    decode_max_blocks = blocks
            else:  # a prefill chunk (one token or more)
                entry = PlanEntry(rid, first, num_new, True, samples)
                blocks = cdiv(end, bs)
                totals.add_prefill(first, num_new, blocks)
            loose_entries.append(entry)
            if whole:
                table = block_table(request)
                loose_tables[rid] = (table[:], slots_for(table, first, end, bs) if with_slots else [])
            elif with_changes:
                changed_tables[rid] = block_table(request)[:]
            blocks_touched += blocks
            if samples and request.n_samples > 1 and request.seats > 1:  # its samples fork now
                plan.forks.append((rid, [f"{rid}#{k}" for k in range(1, request.n_samples)]))
        if members:
            num_tokens += members
            sampled += members
            decode_seqs += members
            decode_ctx += batch.ctx_sum + members
            blocks_touched += batch.blocks_sum
            decode_max_blocks = max(decode_max_blocks, batch.longest_position(plan.step) // bs + 1)
        totals.num_tokens, totals.num_sampled, totals.blocks_touched = num_tokens, sampled, blocks_touched
        totals.decode_seqs = totals.decode_tokens = decode_seqs
        totals.decode_ctx_tokens, totals.decode_max_blocks = decode_ctx, decode_max_blocks
        plan.totals = totals
        plan.copies = self.kv.take_copies()
        step.loose_entries = loose_entries
        self._last_ran_all = ran_all and not plan.forks
        if with_changes:
            for request in step.due:
                if request.in_decode_batch:
                    changed_tables[request.request_id] = block_table(request)[:]
            plan.batch = BatchChanges(members, self._left, changed_tables)
        self._left = []
        if not whole:
            plan.entries = loose_entries
            if not with_changes:
                plan.batch = BatchDecodes(members)
        elif not members:
            plan.entries = loose_entries
            for rid, (table, slots) in loose_tables.items():
                plan.block_tables[rid] = table
                plan.slot_mapping.extend(slots)
        else:
            self._fill_in_running_order(plan, loose_entries, loose_tables, with_slots)
        if not with_slots:
            plan.slot_mapping = None

    def _fill_in_running_order(self, plan: StepPlan, loose_entries: list[PlanEntry],
                               loose_tables: dict[str, tuple[list[int], list[int]]], with_slots: bool) -> None:
        """A whole plan: members' decodes and loose entries in running order (the request-by-request pass's order)."""
        bs = self.kv.block_size
        block_table = self.kv.block_table
        entries, tables, slot_mapping = plan.entries, plan.block_tables, plan.slot_mapping
        loose = {e.request_id: e for e in loose_entries}
        for request in self.running:
            rid = request.request_id
            if request.in_decode_batch:
                pos = request.num_computed_tokens
                entries.append(PlanEntry(rid, pos, 1, False, True))
                table = block_table(request)
                tables[rid] = table[:]
                if with_slots:
                    slot_mapping.append(table[pos // bs] * bs + pos % bs)  # blocks.slot, inlined
            elif rid in loose:
                entries.append(loose[rid])
                table, slots = loose_tables[rid]
                tables[rid] = table
                slot_mapping.extend(slots)

    def commit(self, plan: StepPlan, now: float) -> list[Request]:
        """Apply a step's results at time ``now``: every request's progress moves here; returns the requests that finished.

        ``plan`` must be the one the last ``schedule`` returned.
        """
        step, self._in_flight = self._in_flight, None
        if step is None or step.plan is not plan:
            raise ValueError(f"commit of step {plan.step}: not the plan the last schedule returned")
        number, batch, sink = plan.step, self._batch, self.token_sink
        batch.advance(number)  # every member decoded one token
        sampled: list[Request] = []
        running = Status.RUNNING
        for (request, _), entry in zip(step.scheduled.values(), step.loose_entries):
            request.num_computed_tokens = entry.first_position + entry.num_tokens
            if sink is not None and entry.is_prefill:
                sink.scheduled(entry.request_id, self.now)
            if entry.samples and request.status is running:
                request.num_output_tokens += 1
                if request.first_token_s is None:
                    request.first_token_s = now
                sampled.append(request)
                if sink is not None:
                    sink.token(entry.request_id, now)
        for parent_id, child_ids in plan.forks:
            parent = self.requests[parent_id]
            if parent.status is Status.RUNNING:
                sampled.extend(self._fork(parent, child_ids, now))
            if sink is not None:
                for child_id in child_ids:
                    sink.scheduled(child_id, self.now)
                    sink.token(child_id, now)
        finished = [r for r in sampled if r.num_output_tokens >= r.output_tokens and r.status is Status.RUNNING]
        if batch.members:
            done = batch.pop_due(batch.finishes, number)
            if done:
                finished = sorted(finished + done, key=_run_seq) if finished else done
        for request in finished:
            self._finish(request, now, number)
        if self._batching:
            self._advance_batch(number + 1, step.due)
        return finished

    def _advance_batch(self, number: int, due: list[Request]) -> None:
        """Between steps: members open their new blocks, ``due`` members get their next event, loose decodes join."""
        batch = self._batch
        if batch.members:
            batch.start_step(number)
            for request in due:
                if request.in_decode_batch:
                    event_in = self._event_in(request)
                    if event_in < NEVER:
                        batch.schedule_event(request, number + event_in)
        if self._loose:
            still_loose = []
            for request in self._loose:
                if request.is_decode:
                    batch.add(request, number, self._event_in(request))
                else:
                    still_loose.append(request)
            self._loose = still_loose

    def _fork(self, parent: Request, child_ids: list[str], now: float) -> list[Request]:
        self._running_seats -= parent.seats  # a running parent: its seats become its children's
        parent.forked = True
        self._running_seats += parent.seats
        children = []
        for child_id in child_ids:
            child = Request(
                request_id=child_id,
                order=self._next_order(),
                arrival_s=parent.arrival_s,
                prompt_tokens=parent.prompt_tokens,
                output_tokens=parent.output_tokens,
                priority=parent.priority,
                trace_hashes=parent.trace_hashes,
                hash_block_size=parent.hash_block_size,
                token_ids=parent.token_ids,
                parent=parent,
                content_id=parent.content_id,
                trace_index=parent.trace_index,
                first_token_s=now,
                admitted_step=parent.admitted_step,
                prefix_hit_tokens=parent.prefix_hit_tokens,
            )
            child.num_computed_tokens, child.num_output_tokens = parent.num_computed_tokens, parent.num_output_tokens
            self.requests[child_id] = child
            parent.children.append(child)
            self.kv.fork(parent, child)
            # A child whose one output token is the one just sampled finishes at this commit, room or not.
            if self.kv.block_table(child) or child.remaining_output == 0:
                child.status = Status.RUNNING
                self._join_running(child)
            else:  # no room to hold the child's KV: it starts over like a recompute preemption
                child.num_computed_tokens = 0
                child.status = Status.WAITING
                self.waiting.add(child)
            children.append(child)
        return children

    def _finish(self, request: Request, now: float, step: int | None = None) -> None:
        """``step``: the step whose commit this is, when called from ``commit``."""
        request.status = Status.FINISHED
        request.finish_s = now
        self._leave_running(request, step)
        if self.hold_finished_kv:
            self.held[request.request_id] = request
        else:
            self.kv.free(request)
        self.counters.finished += 1

    def release_kv(self, request_id: str) -> None:
        """A held request's KV has been sent: its blocks go back to the pool (or its prefix cache)."""
        self.kv.free(self.held.pop(request_id))

    # --- observation -------------------------------------------------------------------
    def kv_counts(self) -> KVCounts:
        """(used, cached, free, internal-waste slots): what every step records."""
        computed = self._batch.ctx_sum + sum(map(_num_computed, self._loose))
        if self.held:
            computed += sum(map(_num_computed, self.held.values()))
        return (*self.kv.pool_counts(), self.kv.internal_waste(self._holding(), computed))

    def kv_stats(self) -> KVStats:
        return self.kv.stats(self._holding())

    def _holding(self) -> list[Request]:
        """The requests holding device blocks: the running, and finished ones whose KV is still being sent."""
        return [*self.running, *self.held.values()] if self.held else self.running

    def check_invariants(self) -> None:
        """Pool bookkeeping and request state agree; raises AssertionError otherwise."""
        self.kv.check_invariants(self._holding())
        for request in self.running:
            assert request.status is Status.RUNNING
            assert len(self.kv.block_table(request)) * self.kv.block_size >= request.num_computed_tokens
        # C-level passes over the waiting queue, which holds thousands under load, every step.
        assert set(map(_status, self.waiting)) <= {Status.WAITING}, "a waiting request is not WAITING"
        # A preempted request gave its device blocks back; one never admitted has none, which the
        # managers' own checks hold them to (tables only of live requests).
        for request in filter(_num_preemptions, self.waiting):
            assert not self.kv.block_table(request), f"waiting request {request.request_id} still holds device blocks"
        assert len(self.running) <= self.config.max_num_seqs
        assert self._running_seats == sum(r.seats for r in self.running), "running seats out of step"
        assert self.kv_counts()[3] == self.kv_stats().internal_waste_slots, "internal waste out of step"
        assert [r for r in self.running if not r.in_decode_batch] == self._loose, "loose requests out of step"
        assert len(self._batch) + len(self._loose) == len(self.running), "decode batch out of step"
        self._batch.check(self.counters.steps)
        if not self.has_unfinished() and not self.held:
            stats = self.kv_stats()
            assert stats.used == 0, f"engine drained but {stats.used} blocks are still used"
