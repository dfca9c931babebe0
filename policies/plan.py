"""StepPlan: everything one engine step decided, as plain data, and its decision-log line.

The executor in between ``schedule`` and ``commit`` only turns a plan into a duration (and,
in the real world, tokens). Serialising a plan gives one JSON line of the decision log; two
runs made the same decisions exactly when their logs are byte-identical.

A plan spells out as much as its readers need (``PlanDetail``, asked for by the driver): a
whole plan lists every entry with its block table (vLLM V1's ``NewRequestData``: all there is
to know), while a plan for readers of totals or of changes leaves the persistent decode
batch's members out and carries them as a part of their own (``BatchDecodes``, or
``BatchChanges`` with what changed since the last step: vLLM's ``CachedRequestData``).
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass, field

from kvsim.policies.blocks import batch_slots, cdiv, slot


@dataclass(slots=True)
class PlanEntry:
    """One request's share of a step: tokens ``[first_position, first_position + num_tokens)``."""

    request_id: str
    first_position: int
    num_tokens: int
    is_prefill: bool  # False: a one-token decode that samples a token
    samples: bool  # the step ends with a sampled token for this request

    @property
    def end_position(self) -> int:
        return self.first_position + self.num_tokens


@dataclass(slots=True)
class PlanTotals:
    """A plan's batch shape in integers: what the cost model and the step records read.

    The engine accumulates these while it fills a plan (one pass it makes anyway), so readers
    need not walk the entries again; :meth:`of` computes the same from any list of entries and
    is the reference the engine's figures are tested against. Integers, so sums are exact.
    """

    block_size: int
    num_tokens: int = 0
    num_sampled: int = 0
    blocks_touched: int = 0  # sum over entries of ceil(end_position / block_size)
    prefill_seqs: int = 0
    prefill_tokens: int = 0
    attn_pairs: int = 0  # sum over prefill entries of n*first + n(n+1)/2 (causal)
    prefill_ctx_tokens: int = 0  # sum over prefill entries of end_position
    prefill_max_blocks: int = 0  # the longest prefill entry's blocks
    prefill_max_tokens: int = 0  # the largest prefill query
    decode_seqs: int = 0
    decode_tokens: int = 0
    decode_ctx_tokens: int = 0  # sum over decode entries of end_position
    decode_max_blocks: int = 0

    @property
    def num_seqs(self) -> int:
        return self.prefill_seqs + self.decode_seqs

    @property
    def kind(self) -> str:
        """``prefill``, ``decode``, ``mixed`` or ``idle`` (nothing to run, e.g. only rejections)."""
        if self.prefill_seqs and self.decode_seqs:
            return "mixed"
        if self.prefill_seqs:
            return "prefill"
        return "decode" if self.decode_seqs else "idle"

    def add_prefill(self, first: int, n: int, blocks: int) -> None:
        """Count a prefill entry of ``n`` new tokens after ``first``, touching ``blocks`` blocks."""
        self.prefill_seqs += 1
        self.prefill_tokens += n
        self.attn_pairs += n * first + n * (n + 1) // 2
        self.prefill_ctx_tokens += first + n
        self.prefill_max_blocks = max(self.prefill_max_blocks, blocks)
        self.prefill_max_tokens = max(self.prefill_max_tokens, n)

    @classmethod
    def of(cls, entries: list[PlanEntry], block_size: int) -> PlanTotals:
        t = cls(block_size)
        for e in entries:
            n, end = e.num_tokens, e.end_position
            blocks = cdiv(end, block_size)
            t.num_tokens += n
            t.num_sampled += e.samples
            t.blocks_touched += blocks
            if e.is_prefill:
                t.add_prefill(e.first_position, n, blocks)
            else:
                t.decode_seqs += 1
                t.decode_tokens += n
                t.decode_ctx_tokens += end
                t.decode_max_blocks = max(t.decode_max_blocks, blocks)
        return t


class PlanDetail(enum.IntEnum):
    """How much of a step a plan spells out; each level holds everything of the ones below.

    A driver asks ``EngineCore.schedule`` for the most any reader of its plans needs (a step
    timer's and a decision sink's ``plan_detail``, ``--check``); less is cheaper to write.
    """

    TOTALS = 0  # entries outside the decode batch, the batch's decodes counted (BatchDecodes); no tables
    CHANGES = 1  # and what changed in the batch (BatchChanges) where that tells the step, else TABLES
    TABLES = 2  # every entry and its block table; slots left to StepPlan.all_slots()
    SLOTS = 3  # every entry, block table and slot: what an executor runs


@dataclass(slots=True)
class BatchDecodes:
    """The persistent decode batch's one-token decodes, which a plan below ``PlanDetail.TABLES``
    leaves out of its entries: counted (the plan's totals include them), not listed."""

    count: int


@dataclass(slots=True)
class BatchChanges(BatchDecodes):
    """What a step changed in the batch, for a reader that keeps the previous step's entries
    (the decision log) when the plan leaves the batch's entries out: it costs what changed.

    It describes the step exactly when every running request ran in this step and the last and
    nothing forked in between; the engine attaches it only then (else it writes the whole plan).
    The step's entries are then the last step's, less ``left``, followed by the new ones (in
    ``StepPlan.entries``); every member of the batch decodes its next token; only the tables
    in ``tables`` may differ from the last step's.
    """

    left: list[str]  # requests that left the running set since the last step (finished, preempted, aborted)
    tables: dict[str, list[int]]  # copies of the tables that may have changed: every entry's and every due member's


@dataclass(slots=True)
class StepPlan:
    step: int
    entries: list[PlanEntry] = field(default_factory=list)
    block_tables: dict[str, list[int]] = field(default_factory=dict)
    # Flat, in entry order; None where the plan's readers derive slots from the tables (below
    # PlanDetail.SLOTS): ``all_slots()`` gives them either way.
    slot_mapping: list[int] | None = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write (src, dst)
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device block, host block)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host block, device block)
    preempted: list[tuple[str, str]] = field(default_factory=list)  # (request id, mode)
    rejected: list[tuple[str, str]] = field(default_factory=list)  # (request id, reason)
    forks: list[tuple[str, list[str]]] = field(default_factory=list)  # parent -> children at commit
    # Filled by the engine with the entries (None: a plan built by hand; readers compute it).
    # Derived from the entries, so not part of a plan's equality.
    totals: PlanTotals | None = field(default=None, compare=False)
    # The decode batch's part where ``entries`` leaves it out (below PlanDetail.TABLES); None:
    # ``entries`` is the whole step.
    batch: BatchDecodes | None = None

    @property
    def batch_decodes(self) -> int:
        """One-token decodes of the engine's persistent batch that ``entries`` leaves out."""
        return 0 if self.batch is None else self.batch.count

    def totals_for(self, block_size: int) -> PlanTotals:
        """The batch shape at ``block_size``: the engine's totals when they match, else computed."""
        t = self.totals
        return t if t is not None and t.block_size == block_size else PlanTotals.of(self.entries, block_size)

    @property
    def shape(self) -> PlanTotals:
        """Totals for the counts that do not depend on the block size (the step records read them)."""
        return self.totals if self.totals is not None else PlanTotals.of(self.entries, 1)

    @property
    def num_seqs(self) -> int:
        """Requests in the step, the batch's left-out decodes included."""
        return self.shape.num_seqs

    @property
    def num_tokens(self) -> int:
        return self.shape.num_tokens

    @property
    def num_prefill_tokens(self) -> int:
        return self.shape.prefill_tokens

    @property
    def num_decode_tokens(self) -> int:
        return self.shape.decode_tokens

    @property
    def kind(self) -> str:
        """``prefill``, ``decode``, ``mixed`` or ``idle`` (nothing to run, e.g. only rejections)."""
        return self.shape.kind

    @property
    def is_empty(self) -> bool:
        return not (self.entries or self.batch_decodes or self.swap_out or self.swap_in or self.copies)

    def check(self, block_size: int) -> None:
        """Raise AssertionError unless every new token has its own slot inside its block table (and the totals add up)."""
        if self.totals is not None:
            expected_totals = PlanTotals.of(self.entries, self.totals.block_size)
            assert self.totals == expected_totals, f"step {self.step}: totals {self.totals} != {expected_totals}"
        slots = self.all_slots()
        assert len(slots) == self.num_tokens, f"step {self.step}: {len(slots)} slots for {self.num_tokens} tokens"
        assert len(set(slots)) == len(slots), f"step {self.step}: two tokens write the same slot"
        offset = 0
        for e in self.entries:
            table = self.block_tables.get(e.request_id)
            assert table is not None, f"step {self.step}: no block table for {e.request_id}"
            assert len(table) * block_size >= e.end_position, (
                f"step {self.step}: {e.request_id}'s {len(table)} blocks cannot hold {e.end_position} tokens"
            )
            # block by block: the positions inside one block have consecutive slots
            first, end = e.first_position, e.end_position
            for k in range(first // block_size, cdiv(end, block_size)):
                lo, hi = max(first, k * block_size), min(end, (k + 1) * block_size)
                base = slot(table[k], lo - k * block_size, block_size)
                got = slots[offset + lo - first: offset + hi - first]
                if got != list(range(base, base + hi - lo)):
                    pos = lo + next(i for i, s in enumerate(got) if s != base + i)
                    raise AssertionError(f"step {self.step}: {e.request_id} position {pos} has the wrong slot")
            offset += e.num_tokens

    def all_slots(self) -> list[int]:
        """``slot_mapping``, derived from the entries and block tables where the plan leaves it out."""
        if self.slot_mapping is not None:
            return self.slot_mapping
        entries, tables = self.entries, self.block_tables
        block_size = self.totals.block_size  # the engine, the one that omits slots, always sets the totals
        return batch_slots([e.first_position for e in entries], [e.num_tokens for e in entries],
                           [tables[e.request_id] for e in entries], block_size)

    def to_dict(self) -> dict:
        return {
            "step": self.step,
            "entries": [
                [e.request_id, e.first_position, e.num_tokens, "p" if e.is_prefill else "d", int(e.samples)]
                for e in self.entries
            ],
            "block_tables": self.block_tables,
            "slot_mapping": self.all_slots(),
            "copies": [list(c) for c in self.copies],
            "swap_out": [list(s) for s in self.swap_out],
            "swap_in": [list(s) for s in self.swap_in],
            "preempted": [list(p) for p in self.preempted],
            "rejected": [list(r) for r in self.rejected],
            "forks": [[p, c] for p, c in self.forks],
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), separators=(",", ":"))

    @classmethod
    def from_dict(cls, d: dict) -> StepPlan:
        return cls(
            step=d["step"],
            entries=[PlanEntry(r, p, n, k == "p", bool(s)) for r, p, n, k, s in d["entries"]],
            block_tables={k: list(v) for k, v in d["block_tables"].items()},
            slot_mapping=list(d["slot_mapping"]),
            copies=[tuple(c) for c in d["copies"]],
            swap_out=[tuple(s) for s in d["swap_out"]],
            swap_in=[tuple(s) for s in d["swap_in"]],
            preempted=[tuple(p) for p in d["preempted"]],
            rejected=[tuple(r) for r in d["rejected"]],
            forks=[(p, list(c)) for p, c in d["forks"]],
        )


@dataclass(slots=True)
class DecodeStretch:
    """Several consecutive pure-decode steps of one unchanged batch, as one decision-log record.

    Versions of kvsim that macro-stepped wrote these; the log readers still expand them
    (``plans()``) into exactly the StepPlans of those steps, so old run directories stay readable.
    """

    first_step: int
    num_steps: int
    block_size: int
    request_ids: list[str]
    start_positions: list[int]  # each request's first_position at the stretch's first step
    start_tables: dict[str, list[int]]
    growth: list[tuple[int, str, int]]  # (step offset, request id, block appended to its table)

    def plans(self):
        tables = {rid: list(t) for rid, t in self.start_tables.items()}
        growth = iter(self.growth)
        pending = next(growth, None)
        bs = self.block_size
        for i in range(self.num_steps):
            while pending is not None and pending[0] == i:
                tables[pending[1]].append(pending[2])
                pending = next(growth, None)
            plan = StepPlan(step=self.first_step + i)
            for rid, p0 in zip(self.request_ids, self.start_positions):
                pos = p0 + i
                table = tables[rid]
                plan.entries.append(PlanEntry(rid, pos, 1, False, True))
                plan.block_tables[rid] = list(table)
                plan.slot_mapping.append(slot(table[pos // bs], pos % bs, bs))
            yield plan

    def to_json(self) -> str:
        return json.dumps(
            {
                "stretch": self.num_steps,
                "step": self.first_step,
                "block_size": self.block_size,
                "requests": [[r, p] for r, p in zip(self.request_ids, self.start_positions)],
                "block_tables": self.start_tables,
                "growth": [list(g) for g in self.growth],
            },
            separators=(",", ":"),
        )

    @classmethod
    def from_dict(cls, d: dict) -> DecodeStretch:
        return cls(
            first_step=d["step"],
            num_steps=d["stretch"],
            block_size=d["block_size"],
            request_ids=[r for r, _ in d["requests"]],
            start_positions=[p for _, p in d["requests"]],
            start_tables={k: list(v) for k, v in d["block_tables"].items()},
            growth=[tuple(g) for g in d["growth"]],
        )


def expand_decision_log(lines):
    """Yield the per-step decision log from one that may hold decode-stretch records."""
    for line in lines:
        line = line.rstrip("\n")
        if line.startswith('{"stretch"'):
            for plan in DecodeStretch.from_dict(json.loads(line)).plans():
                yield plan.to_json()
        elif line:
            yield line
