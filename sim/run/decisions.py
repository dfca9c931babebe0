"""The decision log: off, a digest (summary), or every step, diff-encoded and compressed (full).

The reference format is one JSON line per ``StepPlan`` (its ``to_json``); two runs decided
the same exactly when those lines are equal. (Logs of versions that macro-stepped also hold
``DecodeStretch`` records, several decode steps in one; the reader still expands them.) Written as is,
they cost a fifth of a whole-trace run and hundreds of MB, because every line repeats the
whole batch: each request's entry, its full block table and every slot.

The full log stores instead what changed against the previous step, in the manner of vLLM
V1's incremental scheduler output over a persistent batch: requests that left the batch,
new ones (entry and block table), entries that are not the expected next decode token,
blocks appended to a table, tables replaced, and whatever else the step holds (copies,
swaps, preemptions, rejections, forks). Slots are derived from tables and positions and
stored only when they differ. In the simulator the engine hands over the changes
themselves (``StepPlan.batch``, a ``BatchChanges``) in every step they tell, so the encoder's work and the
engine's are what changed, not the batch: the encoder keeps the previous entries with each
request's next position as an offset from the step, which a decoding request never updates.
Records are gzip-compressed by a background thread (zlib releases the GIL). ``read_decisions``
expands a full log back to the reference lines byte for byte, by rebuilding each plan and
calling its own ``to_json``.

The summary is a digest: record and step counts and the SHA-256 of the uncompressed
record stream. The encoding is a deterministic function of the reference lines and the
reader inverts it, so two runs have equal digests exactly when their logs are equal.
"""

from __future__ import annotations

import hashlib
import json
import queue
import threading
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from itertools import count
from operator import add, attrgetter
from pathlib import Path
from typing import Protocol

from kvsim.policies.blocks import batch_slots
from kvsim.policies.plan import (
    BatchChanges,
    DecodeStretch,
    PlanDetail,
    StepPlan,
    expand_decision_log,
)

MODES = ("off", "summary", "full")
FULL_LOG = "decisions.delta.gz"
DIGEST = "decisions.digest.json"
LEGACY_LOG = "decisions.jsonl"  # the reference lines as runs before the diff encoding wrote them
FORMAT = 1

_RID, _POS, _NTOK = attrgetter("request_id"), attrgetter("first_position"), attrgetter("num_tokens")
_PRE, _SMP = attrgetter("is_prefill"), attrgetter("samples")
_SEPARATORS = (",", ":")
_CHUNK_BYTES = 1 << 20


class DecisionSink(Protocol):
    """Where the simulator hands each step's plan, in order.

    ``plan_detail``: ``PlanDetail.CHANGES`` for a sink that keeps the previous step itself and
    takes plans that carry what changed (``BatchChanges`` as ``StepPlan.batch``, the batch's
    entries left out) where the engine can tell a step that way; ``TABLES`` (or more) for whole plans.
    """

    plan_detail: PlanDetail

    def plan(self, plan: StepPlan) -> None: ...


@dataclass
class _Batch:
    """The previous step as both sides of the encoding see it: the persistent batch."""

    block_size: int
    rids: list[str] = field(default_factory=list)
    next_pos: list[int] = field(default_factory=list)  # each entry's position if it decodes on
    tables: list[list[int]] = field(default_factory=list)
    next_step: int = 0

    def after_stretch(self, stretch: DecodeStretch) -> None:
        """A stretch record of an older log, as the decoder replays it."""
        tables = {rid: list(t) for rid, t in stretch.start_tables.items()}
        for _, rid, block in stretch.growth:
            tables[rid].append(block)
        self.rids = list(stretch.request_ids)
        self.next_pos = [p + stretch.num_steps for p in stretch.start_positions]
        self.tables = [tables[rid] for rid in self.rids]
        self.next_step = stretch.first_step + stretch.num_steps


# One encoder for every record: json.dumps builds a new one per call when given separators.
_dumps = json.JSONEncoder(separators=_SEPARATORS).encode


@dataclass
class _Previous:
    """The previous step's entries as the encoder keeps them: their order, and per request its
    table and its expected next position as ``offset + next_step``, so that a request decoding
    one token a step keeps its offset and a step told by its changes costs what changed."""

    rids: list[str] = field(default_factory=list)
    offset: dict[str, int] = field(default_factory=dict)
    tables: dict[str, list[int]] = field(default_factory=dict)
    next_step: int = 0


def _entry_item(first, position: int, num_tokens: int, is_prefill: bool, samples: bool) -> list:
    """A new entry (``first``: its request id) or a kept one (``first``: its index) as records hold it."""
    return [first, position, num_tokens, int(is_prefill), int(samples)]


class DiffEncoder:
    """Plans in, one compact JSON record each out (see the module docstring).

    A whole plan is compared with the previous step entry by entry; a plan that carries its
    changes (``BatchChanges`` as ``StepPlan.batch``: the engine's persistent batch, left out of ``entries``)
    gives the same record from the changes alone.
    """

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.previous = _Previous()

    def header(self) -> str:
        return _dumps({"kvsim_decisions": FORMAT, "block_size": self.block_size})

    def plan(self, plan: StepPlan) -> str:
        rec: dict = {}
        if plan.step != self.previous.next_step:
            rec["n"] = plan.step
        if isinstance(plan.batch, BatchChanges):
            self._changes(rec, plan, plan.batch)
        else:
            self._whole(rec, plan)
        for key, items in (("c", plan.copies), ("so", plan.swap_out), ("si", plan.swap_in),
                           ("p", plan.preempted), ("r", plan.rejected)):
            if items:
                rec[key] = [list(item) for item in items]
        if plan.forks:
            rec["f"] = [[parent, list(children)] for parent, children in plan.forks]
        self.previous.next_step = plan.step + 1
        return _dumps(rec) if rec else "{}"  # a step that is exactly the last one's continuation

    def _whole(self, rec: dict, plan: StepPlan) -> None:
        b = self.previous
        entries = plan.entries
        rids, pos, ns = list(map(_RID, entries)), list(map(_POS, entries)), list(map(_NTOK, entries))
        block_tables = plan.block_tables
        if list(block_tables) == rids:
            tables = list(block_tables.values())
        else:
            rec["T"] = block_tables
            tables = [block_tables.get(rid, []) for rid in rids]
        previous_pos = [b.offset[rid] + b.next_step for rid in b.rids]
        previous_tables = [b.tables[rid] for rid in b.rids]
        same_batch = rids == b.rids
        if same_batch:
            src: list[int | None] = list(range(len(rids)))
        else:
            index = dict(zip(b.rids, range(len(b.rids))))
            src = list(map(index.get, rids))
            self._order(rec, src, len(b.rids))
        if not (same_batch and pos == previous_pos and ns.count(1) == len(ns) and not any(map(_PRE, entries))
                and all(map(_SMP, entries))):
            pre, smp = list(map(_PRE, entries)), list(map(_SMP, entries))
            new, odd = [], []
            for i, j in enumerate(src):
                if j is None:
                    item = _entry_item(rids[i], pos[i], ns[i], pre[i], smp[i])
                    new.append(item + [tables[i]] if "T" not in rec else item)
                elif pos[i] != previous_pos[j] or ns[i] != 1 or pre[i] or not smp[i]:
                    odd.append(_entry_item(i, pos[i], ns[i], pre[i], smp[i]))
            self._entries(rec, new, odd)
        if same_batch:
            changed = [(i, table, old) for i, table, old in zip(count(), tables, previous_tables) if table != old]
        else:
            changed = [(i, tables[i], previous_tables[j]) for i, j in enumerate(src)
                       if j is not None and tables[i] != previous_tables[j]]
        self._tables(rec, changed)
        if plan.slot_mapping is not None:  # else they are the formula's by definition: nothing to store
            try:
                derived = batch_slots(pos, ns, tables, self.block_size)
            except IndexError:  # a table too short for its entry: keep the plan's own slots
                derived = None
            if derived != plan.slot_mapping:
                rec["m"] = list(plan.slot_mapping)
        next_step = plan.step + 1
        b.rids = rids
        b.offset = {rid: p + n - next_step for rid, p, n in zip(rids, pos, ns)}
        b.tables = dict(zip(rids, tables))

    def _changes(self, rec: dict, plan: StepPlan, changes: BatchChanges) -> None:
        """The record of a plan told by its changes: the same as :meth:`_whole` gives for the whole plan."""
        b = self.previous
        rids, offset, previous_tables = b.rids, b.offset, b.tables
        left = sorted(rids.index(rid) for rid in changes.left if rid in offset)
        if left or any(e.request_id not in offset for e in plan.entries):
            rec["x"] = left  # the kept entries keep their order; the new ones follow
            for i in reversed(left):
                del offset[rids[i]], previous_tables[rids[i]], rids[i]
        expected_at, next_step, kept = b.next_step, plan.step + 1, len(rids)
        new, odd = [], []
        for e in plan.entries:
            rid, position, num_tokens, is_prefill, samples = e.request_id, e.first_position, e.num_tokens, e.is_prefill, e.samples
            if rid in offset:
                i = rids.index(rid)
                if new or i >= kept:
                    raise AssertionError(f"step {plan.step}: {rid} runs after a new request; the changes cannot tell this step")
                if position != offset[rid] + expected_at or num_tokens != 1 or is_prefill or not samples:
                    odd.append(_entry_item(i, position, num_tokens, is_prefill, samples))
            else:
                table = changes.tables[rid]
                new.append(_entry_item(rid, position, num_tokens, is_prefill, samples) + [table])
                rids.append(rid)
                previous_tables[rid] = table
            offset[rid] = position + num_tokens - next_step
        if len(rids) != len(plan.entries) + changes.count:
            raise AssertionError(f"step {plan.step}: {len(rids)} entries kept and new, the plan has "
                                 f"{len(plan.entries) + changes.count}: the changes cannot tell this step")
        self._entries(rec, new, sorted(odd))
        changed = []
        for rid, table in changes.tables.items():
            old = previous_tables[rid]
            if table is not old and table != old:
                changed.append((rids.index(rid), table, old))
                previous_tables[rid] = table
        self._tables(rec, sorted(changed))

    @staticmethod
    def _order(rec: dict, src: list[int | None], previous: int) -> None:
        """``x``: indices that left when the rest kept their order and newcomers follow; else ``o``."""
        kept = [j for j in src if j is not None]
        k = len(kept)
        if all(j is None for j in src[k:]) and all(a < b for a, b in zip(kept, kept[1:])):
            rec["x"] = sorted(set(range(previous)) - set(kept))
        else:
            rec["o"] = [-1 if j is None else j for j in src]

    @staticmethod
    def _entries(rec: dict, new: list[list], odd: list[list]) -> None:
        """New entries in ``a`` (with their tables); a kept entry that is not the next decode token in ``v``."""
        if new:
            rec["a"] = new
        if odd:
            rec["v"] = odd

    @staticmethod
    def _tables(rec: dict, changed: list[tuple[int, list[int], list[int]]]) -> None:
        """``g``: blocks appended to a kept request's table; ``G``: a table that changed otherwise."""
        grown, replaced = [], []
        for i, table, old in changed:
            n = len(old)
            if len(table) > n and table[:n] == old:
                grown.append([i, *table[n:]])
            else:
                replaced.append([i, table])
        if grown:
            rec["g"] = grown
        if replaced:
            rec["G"] = replaced


class DiffDecoder:
    """Records in, the reference lines out (``StepPlan.to_json`` / ``DecodeStretch.to_json``)."""

    def __init__(self, header: str) -> None:
        head = json.loads(header)
        if head.get("kvsim_decisions") != FORMAT:
            raise ValueError(f"not a kvsim decision log of format {FORMAT}: {header[:80]!r}")
        self.batch = _Batch(int(head["block_size"]))

    def line(self, record: str) -> str:
        rec = json.loads(record)
        if "S" in rec:
            stretch = DecodeStretch.from_dict(rec["S"])
            self.batch.after_stretch(stretch)
            return stretch.to_json()
        return self._plan(rec).to_json()

    def _plan(self, rec: dict) -> StepPlan:
        b = self.batch
        step = rec.get("n", b.next_step)
        if "o" in rec:
            src = [None if j < 0 else j for j in rec["o"]]
        else:
            left = set(rec.get("x", ()))
            src = [j for j in range(len(b.rids)) if j not in left] + [None] * len(rec.get("a", ()))
        new = iter(rec.get("a", ()))
        entries, tables = [], []
        for j in src:
            if j is None:
                item = next(new)
                entries.append(item[:5])
                tables.append(item[5] if len(item) > 5 else [])
            else:
                entries.append([b.rids[j], b.next_pos[j], 1, 0, 1])
                tables.append(b.tables[j])
        for i, *values in rec.get("v", ()):
            entries[i][1:] = values
        for i, *blocks in rec.get("g", ()):
            tables[i] = tables[i] + blocks
        for i, table in rec.get("G", ()):
            tables[i] = table
        rids = [e[0] for e in entries]
        pos = [e[1] for e in entries]
        ns = [e[2] for e in entries]
        if "T" in rec:
            block_tables = rec["T"]
            tables = [block_tables.get(rid, []) for rid in rids]
        else:
            block_tables = dict(zip(rids, tables))
        slots = rec["m"] if "m" in rec else batch_slots(pos, ns, tables, b.block_size)
        b.rids, b.tables, b.next_step = rids, tables, step + 1
        b.next_pos = list(map(add, pos, ns))
        return StepPlan.from_dict({
            "step": step,
            "entries": [[r, p, n, "p" if k else "d", s] for r, p, n, k, s in entries],
            "block_tables": block_tables,
            "slot_mapping": slots,
            "copies": rec.get("c", []),
            "swap_out": rec.get("so", []),
            "swap_in": rec.get("si", []),
            "preempted": rec.get("p", []),
            "rejected": rec.get("r", []),
            "forks": rec.get("f", []),
        })


class _GzipSink:
    """Compresses and writes chunks on a background thread, so the loop only joins bytes."""

    def __init__(self, path: Path) -> None:
        self._fh = path.open("wb")
        self._zip = zlib.compressobj(6, zlib.DEFLATED, 31)  # wbits 31: a gzip member
        self._queue: queue.Queue[bytes | None] = queue.Queue(maxsize=4)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._drain, name="kvsim-decisions", daemon=True)
        self._thread.start()

    def _drain(self) -> None:
        try:
            while (chunk := self._queue.get()) is not None:
                self._fh.write(self._zip.compress(chunk))
            self._fh.write(self._zip.flush())
        except BaseException as exc:  # re-raised by close() in the writing thread
            self._error = exc
            while self._queue.get() is not None:  # keep the producer from blocking
                pass

    def write(self, chunk: bytes) -> None:
        self._queue.put(chunk)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()
        self._fh.close()
        if self._error is not None:
            raise self._error


class DecisionLog:
    """What the simulator hands each step's plan to, for ``summary`` or ``full`` (``off``: none at all)."""

    plan_detail = PlanDetail.CHANGES  # its encoder keeps the batch: plans may carry their changes

    def __init__(self, mode: str, block_size: int, out_dir: Path | None = None) -> None:
        if mode not in ("summary", "full"):
            raise ValueError(f"decision log mode must be summary or full (off: no log), not {mode!r}")
        self.mode = mode
        self.out_dir = out_dir
        self.records = 0
        self.steps = 0
        self._encoder = DiffEncoder(block_size)
        self._hash = hashlib.sha256()
        self._sink = _GzipSink(out_dir / FULL_LOG) if mode == "full" and out_dir is not None else None
        self._buffer: list[bytes] = []
        self._buffered = 0
        self._add(self._encoder.header())

    def plan(self, plan: StepPlan) -> None:
        self._add(self._encoder.plan(plan))
        self.steps += 1

    def _add(self, record: str) -> None:
        self._buffer.append(record)
        self._buffered += len(record) + 1  # records are ASCII: a character a byte
        self.records += 1
        if self._buffered >= _CHUNK_BYTES:
            self._flush()

    def _flush(self) -> None:
        """Hash (and, full, write) the buffered records as one chunk: the digest of the stream is the same."""
        if not self._buffer:
            return
        data = ("\n".join(self._buffer) + "\n").encode()
        self._hash.update(data)
        if self._sink is not None:
            self._sink.write(data)
        self._buffer, self._buffered = [], 0

    def digest(self) -> dict:
        self._flush()
        return {"mode": self.mode, "format": FORMAT, "records": self.records, "steps": self.steps,
                "sha256": self._hash.hexdigest()}

    def close(self) -> dict:
        """Finish the file (full) and write the digest beside it; returns the digest."""
        self._flush()
        if self._sink is not None:
            self._sink.close()
            self._sink = None
        digest = self.digest()
        if self.out_dir is not None:
            (self.out_dir / DIGEST).write_text(json.dumps(digest, indent=1) + "\n")
        return digest


def decode_records(records) -> Iterator[str]:
    """Reference lines from an iterable of records (header first)."""
    records = iter(records)
    header = next(records, None)
    if header is None:
        return
    decoder = DiffDecoder(header)
    for record in records:
        yield decoder.line(record.rstrip("\n"))


def read_decisions(run_dir: Path, per_step: bool = False) -> Iterator[str]:
    """A run's decision log as reference lines; ``per_step`` also expands decode stretches.

    Reads the full log, or a ``decisions.jsonl`` written before the diff encoding existed.
    """
    run_dir = Path(run_dir)
    full, legacy = run_dir / FULL_LOG, run_dir / LEGACY_LOG
    if full.exists():
        import gzip

        with gzip.open(full, "rt") as fh:
            lines = decode_records(fh)
            yield from expand_decision_log(lines) if per_step else lines
    elif legacy.exists():
        with legacy.open() as fh:
            lines = (line.rstrip("\n") for line in fh)
            yield from expand_decision_log(lines) if per_step else lines
    else:
        raise FileNotFoundError(f"{run_dir}: no full decision log ({FULL_LOG}); run with --decisions full")


def read_digest(run_dir: Path) -> dict:
    return json.loads((Path(run_dir) / DIGEST).read_text())
