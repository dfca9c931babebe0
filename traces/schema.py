"""The one request-trace schema every loader produces and every consumer reads.

A trace is columnar: one numpy array per field, one row per request, rows sorted by
arrival time. Ragged per-request data (prefix-block hashes, token ids) is stored flat with
an offsets array, CSR style, so a million-request trace stays a handful of arrays.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class Ragged:
    """Variable-length int64 rows stored flat: row i is ``values[offsets[i]:offsets[i+1]]``."""

    values: np.ndarray  # int64, all rows concatenated
    offsets: np.ndarray  # int64, len == rows + 1, offsets[0] == 0

    @classmethod
    def from_rows(cls, rows: list[list[int]] | list[np.ndarray]) -> Ragged:
        lengths = np.fromiter((len(r) for r in rows), dtype=np.int64, count=len(rows))
        offsets = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        values = (
            np.concatenate([np.asarray(r, dtype=np.int64) for r in rows])
            if len(rows) and offsets[-1] > 0
            else np.zeros(0, dtype=np.int64)
        )
        return cls(values=values, offsets=offsets)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def row(self, i: int) -> np.ndarray:
        return self.values[self.offsets[i] : self.offsets[i + 1]]

    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    @classmethod
    def from_lengths(cls, values: np.ndarray, lengths: np.ndarray) -> Ragged:
        """Wrap already-flat ``values`` whose consecutive rows have ``lengths``."""
        offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        values = np.asarray(values, dtype=np.int64)
        if offsets[-1] != len(values):
            raise ValueError(f"lengths sum to {offsets[-1]} but there are {len(values)} values")
        return cls(values=values, offsets=offsets)

    def take(self, index: np.ndarray) -> Ragged:
        """Rows ``index`` (any order, repeats allowed) as a new Ragged (vectorised gather)."""
        index = np.asarray(index, dtype=np.int64)
        starts = self.offsets[index]
        lengths = self.offsets[index + 1] - starts
        out = Ragged.from_lengths(np.zeros(int(lengths.sum()), dtype=np.int64), lengths)
        # position p of output row r reads values[starts[r] + (p - out.offsets[r])]
        gather = np.arange(len(out.values), dtype=np.int64) + np.repeat(starts - out.offsets[:-1], lengths)
        return Ragged(values=self.values[gather], offsets=out.offsets)

    def to_rows(self) -> list[list[int]]:
        """Python lists, one per row (for JSON output)."""
        flat = self.values.tolist()
        bounds = self.offsets.tolist()
        return [flat[a:b] for a, b in zip(bounds[:-1], bounds[1:])]

    def equals(self, other: Ragged) -> bool:
        return np.array_equal(self.offsets, other.offsets) and np.array_equal(self.values, other.values)


@dataclass(frozen=True)
class Trace:
    """A replayable request trace.

    Required columns: ``arrival_s`` (float64 seconds from the first request, non-decreasing),
    ``prompt_tokens`` and ``output_tokens`` (int64, prompt >= 1, output >= 1).
    Optional columns are ``None`` when the source does not have them:
    ``prefix_hashes`` (per-request hashes of consecutive ``hash_block_size``-token prompt
    blocks; equal leading hashes mean a shared prefix), ``token_ids`` (the prompt's token ids,
    when known), ``session_id`` (int64, conversation id), ``priority`` (int64, lower is served
    first) and ``n_samples`` (int64, parallel samples per request).
    """

    arrival_s: np.ndarray
    prompt_tokens: np.ndarray
    output_tokens: np.ndarray
    source: str = "<memory>"
    prefix_hashes: Ragged | None = None
    hash_block_size: int | None = None
    token_ids: Ragged | None = None
    session_id: np.ndarray | None = None
    priority: np.ndarray | None = None
    n_samples: np.ndarray | None = None
    notes: tuple[str, ...] = field(default_factory=tuple)

    def __len__(self) -> int:
        return len(self.arrival_s)

    def priority_of(self, i: int) -> int:
        return 0 if self.priority is None else int(self.priority[i])

    def n_samples_of(self, i: int) -> int:
        return 1 if self.n_samples is None else int(self.n_samples[i])

    def hashes_of(self, i: int) -> np.ndarray | None:
        return None if self.prefix_hashes is None else self.prefix_hashes.row(i)

    def tokens_of(self, i: int) -> np.ndarray | None:
        return None if self.token_ids is None else self.token_ids.row(i)

    @property
    def columns(self) -> tuple[str, ...]:
        """Names of the columns this trace has (required ones first)."""
        optional = ("prefix_hashes", "token_ids", "session_id", "priority", "n_samples")
        return ("arrival_s", "prompt_tokens", "output_tokens") + tuple(
            name for name in optional if getattr(self, name) is not None
        )

    @property
    def has_parallel_samples(self) -> bool:
        """Whether some request asks for n > 1 samples (what a benchmark client or a P/D proxy does not send)."""
        return self.n_samples is not None and bool((self.n_samples > 1).any())

    def equals(self, other: Trace) -> bool:
        """Bit-exact equality of every column and of the metadata."""
        if (self.source, self.hash_block_size, self.notes, self.columns) != (
            other.source,
            other.hash_block_size,
            other.notes,
            other.columns,
        ):
            return False
        for name in self.columns:
            mine, theirs = getattr(self, name), getattr(other, name)
            if isinstance(mine, Ragged):
                if not mine.equals(theirs):
                    return False
            elif mine.dtype != theirs.dtype or mine.tobytes() != theirs.tobytes():
                return False
        return True

    def validate(self) -> None:
        """Raise ValueError unless the trace keeps the schema's promises (see the class doc)."""
        n = len(self.arrival_s)
        for name in self.columns:
            column = getattr(self, name)
            if len(column) != n:
                raise ValueError(f"column {name} has {len(column)} rows, arrival_s has {n}")
        if n == 0:
            raise ValueError("a trace needs at least one request")
        if not np.all(np.isfinite(self.arrival_s)) or self.arrival_s[0] != 0 or np.any(np.diff(self.arrival_s) < 0):
            raise ValueError("arrival_s must be finite, non-decreasing and start at 0")
        for name in ("prompt_tokens", "output_tokens", "n_samples"):
            column = getattr(self, name)
            if column is not None and column.min() < 1:
                raise ValueError(f"{name} must be >= 1")
        if (self.prefix_hashes is None) != (self.hash_block_size is None):
            raise ValueError("prefix_hashes and hash_block_size come together")
        if self.prefix_hashes is not None:
            if self.hash_block_size < 1:
                raise ValueError("hash_block_size must be >= 1")
            expected = -(-self.prompt_tokens // self.hash_block_size)
            if not np.array_equal(self.prefix_hashes.lengths(), expected):
                raise ValueError("each request needs ceil(prompt_tokens / hash_block_size) prefix hashes")
        if self.token_ids is not None and not np.array_equal(self.token_ids.lengths(), self.prompt_tokens):
            raise ValueError("each request needs prompt_tokens token ids")
