"""The KV-manager interface (what the engine asks of a block manager) and its statistics.

Three layers, as in vLLM V1: a pool of blocks (``block_pool``) below a per-request KV
manager (this interface: ``paged``, ``prefix``, ``contiguous``) below the scheduler. Per
step the engine asks a manager how much of a new request is already cached (``lookup``),
to make room for a request's next tokens (``allocate_slots``, all-or-nothing), to release
(``free``), to share (``fork``) and to move KV to and from the host pool (``swap_out`` /
``swap_in``). Running out of blocks is never an exception: ``allocate_slots`` answers False
and the scheduler decides (queue, preempt, swap or reject).

The manager holds the block size; every other layer reads it from here.

The decode batch's fast path is opt-in (``DecodeFastPath``, an interface of its own, as
inference-sim's optional store features): the engine keeps decoding requests in a persistent
batch and calls ``allocate_slots`` for a member only at the steps its manager's
``decode_outlook`` names. A manager that implements it promises that at every other step of a
one-token decode the call would change nothing and answer True; one that does not (a plain
``BlockManager`` subclass) still runs, every step decided request by request, with the same
decisions only slower.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass

from kvsim.policies.block_pool import HostPool
from kvsim.policies.request import Request


@dataclass
class KVStats:
    num_blocks: int
    used: int  # held by at least one request
    cached: int  # unreferenced but still holding a reusable prefix (evictable)
    free: int  # unreferenced and empty
    internal_waste_slots: int  # allocated token slots not (yet) holding a token
    fragmentation: float  # contiguous only: 1 - largest free extent / free blocks
    prefix_query_tokens: int  # first admissions only, as vLLM's hit rate
    prefix_hit_tokens: int
    resume_hit_blocks: int  # cached blocks recompute-preempted requests found again on re-admission
    evictions: int
    copies: int
    swapped_out_blocks: int
    swapped_in_blocks: int
    host_blocks_used: int

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class DecodeOutlook:
    """What ``allocate_slots`` will do for one request over its next one-token decode steps.

    The engine's decode batch calls ``allocate_slots`` for a member only at the steps listed
    here (0-based from the next step): at every other step the call would change nothing and
    answer True, which is the contract ``DecodeFastPath.decode_outlook`` must keep.
    """

    growth: range  # steps at which the request's block table grows by one block
    bookkeeping: range  # other steps at which the manager's state changes (a prefix registers)


class BlockManager(ABC):
    """Interface shared by ``contiguous``, ``paged`` and ``prefix``.

    Capacity: ``can_ever_fit``, ``blocks_needed``, ``num_available_blocks``.
    Per request: ``lookup``, ``allocate_slots``, ``free``, ``fork``, ``block_table``.
    Copies this step: ``take_copies``, ``has_pending_copies``, ``cancel_copies``.
    Swap: ``swap_out``, ``swap_in``, ``swap_in_blocks_needed``.
    The decode batch's fast path, opt-in: ``DecodeFastPath.decode_outlook``.
    Observation: ``pool_counts``, ``internal_waste``, ``stats``, ``check_invariants``.
    """

    registered_name = "?"

    def __init__(self, num_blocks: int, block_size: int, num_host_blocks: int = 0) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks ({num_blocks}) and block_size ({block_size}) must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.host = HostPool(num_host_blocks)
        self._host_tables: dict[str, list[int]] = {}
        self.prefix_query_tokens = 0
        self.prefix_hit_tokens = 0
        self.resume_hit_blocks = 0
        self.num_copies = 0
        self.swapped_out_blocks = 0
        self.swapped_in_blocks = 0
        self._pending_copies: list[tuple[int, int]] = []

    # --- capacity ---------------------------------------------------------------------
    @abstractmethod
    def can_ever_fit(self, request: Request) -> bool:
        """Could this request's full length fit in an otherwise empty pool?"""

    @abstractmethod
    def blocks_needed(self, request: Request, num_new_tokens: int, num_hit_tokens: int = 0) -> int:
        """Blocks ``allocate_slots`` would take from the available pool for these tokens."""

    @abstractmethod
    def num_available_blocks(self) -> int:
        """Blocks an allocation could use right now (free plus evictable cached)."""

    # --- per-request operations -------------------------------------------------------
    def lookup(self, request: Request) -> int:
        """Tokens of ``request`` already cached (block-aligned, at most ``num_tokens - 1``)."""
        return 0

    @abstractmethod
    def allocate_slots(self, request: Request, num_new_tokens: int, num_hit_tokens: int = 0) -> bool:
        """Make room for tokens ``[computed + hit, computed + hit + new)``; False (no change) if it cannot."""

    def free(self, request: Request) -> None:
        """Release the request's device blocks (a prefix cache keeps full ones cached) and its host copy."""
        self._free_device(request)
        self.host.free(self._host_tables.pop(request.request_id, []))

    @abstractmethod
    def _free_device(self, request: Request) -> None:
        """Release the request's device blocks."""

    @abstractmethod
    def fork(self, parent: Request, child: Request) -> None:
        """Give ``child`` the parent's KV (shared where the manager can share); may give it none."""

    @abstractmethod
    def block_table(self, request: Request) -> list[int]:
        """Device block ids covering the request's allocated tokens, in position order."""

    # --- copies decided this step -------------------------------------------------------
    def take_copies(self) -> list[tuple[int, int]]:
        """Block copies (src, dst) decided since the last call, for this step's plan."""
        copies, self._pending_copies = self._pending_copies, []
        return copies

    def has_pending_copies(self) -> bool:
        return bool(self._pending_copies)

    def cancel_copies(self, request: Request) -> bool:
        """Drop this step's copies into ``request``'s blocks (it is being preempted); True if any."""
        targets = set(self.block_table(request))
        kept = [c for c in self._pending_copies if c[1] not in targets]
        dropped = len(kept) != len(self._pending_copies)
        self._pending_copies = kept
        return dropped

    # --- swap ------------------------------------------------------------------------
    def swap_out(self, request: Request) -> list[tuple[int, int]] | None:
        """Move the request's KV to the host pool: (device, host) pairs, or None (nothing done) if it has no room."""
        table = self.block_table(request)
        if self.host.num_free < len(table):
            return None
        host_blocks = self.host.allocate(len(table))
        self._free_device(request)
        self._host_tables[request.request_id] = host_blocks
        self.swapped_out_blocks += len(table)
        return list(zip(table, host_blocks))

    def swap_in_blocks_needed(self, request: Request) -> int:
        return len(self._host_tables[request.request_id])

    def swap_in(self, request: Request) -> list[tuple[int, int]] | None:
        """Bring the request's KV back to fresh device blocks; (host, device) pairs, or None if no room."""
        host_blocks = self._host_tables[request.request_id]
        device_blocks = self._take_blocks_for_swap_in(request, len(host_blocks))
        if device_blocks is None:
            return None
        del self._host_tables[request.request_id]
        self.host.free(host_blocks)
        self.swapped_in_blocks += len(host_blocks)
        return list(zip(host_blocks, device_blocks))

    @abstractmethod
    def _take_blocks_for_swap_in(self, request: Request, n: int) -> list[int] | None:
        """Allocate ``n`` device blocks as the request's whole table, or None."""

    # --- observation -----------------------------------------------------------------
    @abstractmethod
    def pool_counts(self) -> tuple[int, int, int]:
        """(used, cached, free) blocks right now, in O(1)."""

    @abstractmethod
    def internal_waste(self, live: list[Request], computed_tokens: int | None = None) -> int:
        """Allocated token slots that hold no token yet (``live`` hold device blocks), asked between steps.

        ``computed_tokens``: the sum of ``live``'s ``num_computed_tokens`` when the caller keeps
        it (the engine does), which a manager may use instead of a walk over ``live``."""

    @abstractmethod
    def stats(self, live: list[Request]) -> KVStats:
        """Pool occupancy and counters; ``live`` are requests holding device blocks."""

    @abstractmethod
    def check_invariants(self, live: list[Request]) -> None:
        """Raise AssertionError if the pool's bookkeeping is inconsistent with ``live``."""


class DecodeFastPath(ABC):
    """Opt-in for a block manager: it can say when ``allocate_slots`` acts on a decoding request.

    A manager that inherits this (besides ``BlockManager``) lets the engine keep decoding
    requests in its persistent batch (``policies.decode_batch``) and skip the
    ``allocate_slots`` calls that would change nothing; one that does not is asked every step.
    The contract is ``DecodeOutlook``'s: a step not listed in a request's outlook is one at
    which ``allocate_slots(request, 1)`` would answer True and change nothing, as long as the
    request only decodes. The engine asks again after each listed step.
    """

    @abstractmethod
    def decode_outlook(self, request: Request, num_steps: int) -> DecodeOutlook | None:
        """The request's next ``num_steps`` one-token decodes, or None when the first must act at once (copy a shared block)."""
