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
    def from_rows(cls, rows: list[list[int]] | list[np.ndarray]) -> "Ragged":
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

    def take(self, index: np.ndarray) -> "Ragged":
        """Rows ``index`` (any order, repeats allowed) as a new Ragged."""
        return Ragged.from_rows([self.row(int(i)) for i in index])


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
