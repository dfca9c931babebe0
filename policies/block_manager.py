"""The KV block-manager interface, its statistics, and the host swap pool.

A block manager owns the device KV pool and every request's block table. The engine asks
it, per step: how much of a new request is already cached (``lookup``), to make room for a
request's next tokens (``allocate_slots``, all-or-nothing), to release (``free``), to share
(``fork``), and to move a request's KV to and from the host pool (``swap_out``/``swap_in``).
Running out of blocks is never an exception: ``allocate_slots`` answers False and the
scheduler decides (queue, preempt, swap or reject).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import deque
from dataclasses import asdict, dataclass

from kvsim.policies.request import Request


@dataclass
class KVStats:
    num_blocks: int
    used: int  # held by at least one request
    cached: int  # unreferenced but still holding a reusable prefix (evictable)
    free: int  # unreferenced and empty
    internal_waste_slots: int  # allocated token slots not (yet) holding a token
    fragmentation: float  # contiguous only: 1 - largest free extent / free blocks
    prefix_query_tokens: int
    prefix_hit_tokens: int
    evictions: int
    copies: int
    swapped_out_blocks: int
    swapped_in_blocks: int
    host_blocks_used: int

    def to_dict(self) -> dict:
        return asdict(self)


class HostPool:
    """Host-memory swap space: ``num_blocks`` block-sized slots, allocated lowest id first."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        return [self._free.popleft() for _ in range(n)]

    def free(self, blocks: list[int]) -> None:
        self._free.extend(blocks)


class BlockManager(ABC):
    """Interface shared by ``contiguous``, ``paged`` and ``prefix``."""

    registered_name = "?"

    def __init__(self, num_blocks: int, block_size: int, num_host_blocks: int = 0) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks ({num_blocks}) and block_size ({block_size}) must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.host = HostPool(num_host_blocks)
        self._host_tables: dict[int, list[int]] = {}
        self.prefix_query_tokens = 0
        self.prefix_hit_tokens = 0
        self.num_copies = 0
        self.swapped_out_blocks = 0
        self.swapped_in_blocks = 0
        self._pending_copies: list[tuple[int, int]] = []

    # --- capacity ---------------------------------------------------------------------
    @abstractmethod
    def can_ever_fit(self, request: Request) -> bool:
        """Could this request's full length fit in an otherwise empty pool?"""

    @abstractmethod
    def num_available_blocks(self) -> int:
        """Blocks an allocation could use right now (free plus evictable cached)."""

    @abstractmethod
    def blocks_needed(self, request: Request, num_new_tokens: int, num_hit_tokens: int = 0) -> int:
        """Blocks ``allocate_slots`` would take from the available pool for these tokens."""

    # --- per-request operations -------------------------------------------------------
    def lookup(self, request: Request) -> int:
        """Tokens of ``request`` already cached (block-aligned, at most ``num_tokens - 1``)."""
        return 0

    @abstractmethod
    def allocate_slots(self, request: Request, num_new_tokens: int, num_hit_tokens: int = 0) -> bool:
        """Make room for tokens ``[computed + hit, computed + hit + new)``; False (no change) if it cannot."""

    @abstractmethod
    def free(self, request: Request) -> None:
        """Release the request's blocks (a prefix cache keeps full ones cached)."""

    @abstractmethod
    def fork(self, parent: Request, child: Request) -> None:
        """Give ``child`` the parent's KV (shared where the manager can share)."""

    @abstractmethod
    def block_table(self, request: Request) -> list[int]:
        """Device block ids covering the request's allocated tokens, in position order."""

    def has_blocks(self, request: Request) -> bool:
        return bool(self.block_table(request))

    def discard_pending_copies(self, request: Request) -> bool:
        """Drop this step's copies into ``request``'s blocks (it is being preempted); True if any."""
        targets = set(self.block_table(request))
        kept = [c for c in self._pending_copies if c[1] not in targets]
        dropped = len(kept) != len(self._pending_copies)
        self._pending_copies = kept
        return dropped

    def has_pending_copies(self) -> bool:
        return bool(self._pending_copies)

    def take_copies(self) -> list[tuple[int, int]]:
        """Block copies (src, dst) decided since the last call, for this step's plan."""
        copies, self._pending_copies = self._pending_copies, []
        return copies

    # --- swap ------------------------------------------------------------------------
    def can_swap_out(self, request: Request) -> bool:
        return self.host.num_free >= len(self.block_table(request))

    def swap_out(self, request: Request) -> list[tuple[int, int]]:
        """Move the request's KV to the host pool; returns (device, host) pairs. Needs ``can_swap_out``."""
        table = self.block_table(request)
        host_blocks = self.host.allocate(len(table))
        self._host_tables[request.seq_id] = host_blocks
        self.free(request)
        self.swapped_out_blocks += len(table)
        return list(zip(table, host_blocks))

    def swap_in_blocks_needed(self, request: Request) -> int:
        return len(self._host_tables[request.seq_id])

    def swap_in(self, request: Request) -> list[tuple[int, int]] | None:
        """Bring the request's KV back to fresh device blocks; (host, device) pairs, or None if no room."""
        host_blocks = self._host_tables[request.seq_id]
        device_blocks = self._take_blocks_for_swap_in(request, len(host_blocks))
        if device_blocks is None:
            return None
        del self._host_tables[request.seq_id]
        self.host.free(host_blocks)
        self.swapped_in_blocks += len(host_blocks)
        return list(zip(host_blocks, device_blocks))

    def drop_swapped(self, request: Request) -> None:
        """Forget a swapped request's host copy (it was aborted)."""
        self.host.free(self._host_tables.pop(request.seq_id, []))

    @abstractmethod
    def _take_blocks_for_swap_in(self, request: Request, n: int) -> list[int] | None:
        """Allocate ``n`` device blocks as the request's whole table, or None."""

    # --- observation -----------------------------------------------------------------
    @abstractmethod
    def pool_counts(self) -> tuple[int, int, int]:
        """(used, cached, free) blocks right now, in O(1)."""

    def decode_write_needs_copy(self, request: Request) -> bool:
        """Would the request's next one-token write land in a shared, partially filled block?"""
        return False

    growth_uses_pool = True  # each block a table grows by comes out of the pool

    def decode_growth_steps(self, request: Request, num_steps: int) -> range:
        """Steps (0-based) of a pure-decode stretch at which the request's table grows a block."""
        first = -request.num_computed_tokens % self.block_size
        return range(first, num_steps, self.block_size)

    def decode_bookkeeping_steps(self, request: Request, num_steps: int) -> range:
        """Other steps at which ``allocate_slots`` changes state (a prefix cache registers a full block)."""
        return range(0)

    @abstractmethod
    def internal_waste(self, live: list[Request]) -> int:
        """Allocated token slots that hold no token yet (``live`` hold device blocks)."""

    @abstractmethod
    def stats(self, live: list[Request]) -> KVStats:
        """Pool occupancy and counters; ``live`` are requests holding device blocks."""

    @abstractmethod
    def check_invariants(self, live: list[Request]) -> None:
        """Raise AssertionError if the pool's bookkeeping is inconsistent with ``live``."""
