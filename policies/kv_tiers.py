"""KV tiers below HBM: host DRAM and SSD, as LMCache and vllm-ascend's KV offloading keep them,
and a KV store shared with other instances, as Mooncake Store keeps it (``policies.kv_store``).

A prefix block the device pool evicts (allocation reuses a free block that still holds a
cached prefix, ``BlockPool.allocate``) demotes to the host tier instead of vanishing; the host
tier keeps blocks in LRU order and, when full, demotes its least recently used block to the
SSD tier; a full SSD tier drops its least recently used one. A prefix lookup that misses HBM
but finds the next blocks in a tier promotes them: each gets a fresh device block, and the
transfer (bytes / bandwidth + latency per tier) is charged to the step that runs the request.

Every block lives in exactly one place: a hash is in the device pool's index, the host tier or
the SSD tier, never two (promotion moves it up, demotion down; :meth:`KVTiers.check`). A
shared store is a copy store beside them: the prompt blocks a step computes are put there when
the step runs (those still indexed then: a request preempted before its step wrote nothing), a
lookup that finds none of the next blocks in HBM or the local tiers goes on into the store, and
reading a block from the store copies it, the store keeping its own.

Timing. The transfer of a request's promoted blocks is issued ``prefetch_steps`` steps before
the step that admits it, or at its arrival if that is later: the scheduler knows the queue's
head that far ahead (vLLM's async KV loading starts a request's load in one step and runs the
request in a later one; LMCache and vllm-ascend's offloading connectors prefetch the same
way). Transfers from the host and SSD tiers run one after another on the host link, reads from
the store one after another on the network card. The step waits only for what has not arrived by
its start (:meth:`KVTiers.exposed_s`); demotions and puts are writes behind the step
(asynchronous stores, as LMCache's and the store connectors') and cost no step time, only bytes.
Device blocks held for an in-flight prefetch before admission are not modelled (the block is
taken at admission).

Nothing here runs in a run with tiers off: the pool's eviction hook is None and the engine
has no tiers.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field

from kvsim.policies.kv_store import SharedKVStore, StoreSpec


@dataclass(frozen=True)
class TierSpec:
    """One tier's size and its path to HBM."""

    capacity_blocks: int
    bandwidth: float  # B/s, tier -> HBM
    latency_s: float  # fixed cost of one transfer

    def __post_init__(self) -> None:
        if self.capacity_blocks < 0 or self.bandwidth < 0 or (self.capacity_blocks and not self.bandwidth) or self.latency_s < 0:
            raise ValueError(f"tier: capacity_blocks >= 0, bandwidth > 0 (where it holds blocks), latency_s >= 0, not {self}")


@dataclass(frozen=True)
class TierConfig:
    """The tiers under one engine's pool; ``block_bytes`` is what one device block moves."""

    host: TierSpec
    ssd: TierSpec
    block_bytes: int
    prefetch_steps: int = 1
    store: StoreSpec | None = None  # a store shared with other instances; None: none

    def __post_init__(self) -> None:
        if self.block_bytes <= 0 or self.prefetch_steps < 0:
            raise ValueError(f"kv tiers: block_bytes > 0 and prefetch_steps >= 0, not {self.block_bytes}, {self.prefetch_steps}")


@dataclass
class TierStats:
    """What the tiers did over a run (the summary's ``kv_tiers``)."""

    host_tokens: int = 0  # prompt tokens first admissions found in the host tier
    ssd_tokens: int = 0
    received: int = 0  # blocks the device pool evicted into the tiers
    demoted_to_host: int = 0
    demoted_to_ssd: int = 0
    dropped: int = 0  # pushed out of the last tier
    superseded: int = 0  # dropped from a tier because HBM indexed the same prefix again
    promoted_from_host: int = 0
    promoted_from_ssd: int = 0
    store_tokens: int = 0  # prompt tokens first admissions read from the shared store
    read_from_store: int = 0
    put_to_store: int = 0  # blocks this engine wrote to the store (not held there yet)
    exposed_s: float = 0.0  # step time spent waiting for promotions
    transfer_s: float = 0.0  # total promotion transfer time, hidden or not


@dataclass(slots=True)
class _Promotion:
    arrival_s: float  # the request's: no prefetch before it
    host_blocks: int
    ssd_blocks: int
    store_blocks: int


@dataclass
class KVTiers:
    """The host and SSD tiers of one engine (LRU stores of block hashes), its side of a shared
    store, and their transfers. ``device_index`` is the device pool's prefix index (hash -> block)."""

    config: TierConfig
    device_index: dict[int, int] = field(default_factory=dict)
    host: OrderedDict[int, None] = field(default_factory=OrderedDict)  # LRU first
    ssd: OrderedDict[int, None] = field(default_factory=OrderedDict)
    store: SharedKVStore | None = None  # made from config.store; a cluster swaps in the shared one
    stats: TierStats = field(default_factory=TierStats)
    _pending: list[_Promotion] = field(default_factory=list)  # promotions decided this step
    _puts: list[int] = field(default_factory=list)  # prefixes this step computes, for the store
    _starts: deque[float] = field(default_factory=deque)  # the last prefetch_steps step starts
    _free_at: dict[str, float] = field(default_factory=lambda: {"host link": 0.0, "network card": 0.0})

    def __post_init__(self) -> None:
        if self.config.store is not None and self.store is None:
            self.store = SharedKVStore(self.config.store)

    def __contains__(self, h: int) -> bool:
        return h in self.host or h in self.ssd or (self.store is not None and h in self.store)

    # --- moves -----------------------------------------------------------------------------
    def demote(self, h: int) -> None:
        """The device pool evicted the block of prefix ``h``: it goes to the host tier (MRU end)."""
        self.stats.received += 1
        host_cap = self.config.host.capacity_blocks
        if host_cap == 0:
            self._to_ssd(h)
            return
        self.host[h] = None
        self.stats.demoted_to_host += 1
        if len(self.host) > host_cap:
            self._to_ssd(self.host.popitem(last=False)[0])

    def _to_ssd(self, h: int) -> None:
        ssd_cap = self.config.ssd.capacity_blocks
        if ssd_cap == 0:
            self.stats.dropped += 1
            return
        self.ssd[h] = None
        self.stats.demoted_to_ssd += 1
        if len(self.ssd) > ssd_cap:
            self.ssd.popitem(last=False)
            self.stats.dropped += 1

    def promote(self, hashes: list[int], arrival_s: float) -> tuple[int, int, int]:
        """Take ``hashes`` out of their local tiers (they move to device blocks) or copy them from
        the store, and queue their transfer for this step; returns how many came from the host
        tier, the SSD tier and the store."""
        host_blocks = ssd_blocks = 0
        from_store = []
        for h in hashes:
            if h in self.host:
                del self.host[h]
                host_blocks += 1
            elif h in self.ssd:
                del self.ssd[h]
                ssd_blocks += 1
            else:
                from_store.append(h)
        if from_store:
            self.store.get(from_store)
        self.stats.promoted_from_host += host_blocks
        self.stats.promoted_from_ssd += ssd_blocks
        self.stats.read_from_store += len(from_store)
        self._pending.append(_Promotion(arrival_s, host_blocks, ssd_blocks, len(from_store)))
        return host_blocks, ssd_blocks, len(from_store)

    def computed(self, hashes: list[int]) -> None:
        """Prefixes this step computes, just indexed in HBM. Where one was computed anew (its request
        was admitted before it demoted) its local tier copy is dropped, so each block stays in one
        place; with a store, they are put there when the step runs."""
        if self.store is not None:
            self._puts += hashes
        device_index = self.device_index
        for h in hashes:
            if h in device_index and (h in self.host or h in self.ssd):
                if h in self.host:
                    del self.host[h]
                else:
                    del self.ssd[h]
                self.stats.superseded += 1

    # --- time --------------------------------------------------------------------------------
    def transfer_s(self, host_blocks: int, ssd_blocks: int) -> float:
        """Seconds to bring these blocks to HBM: bytes / bandwidth plus each tier's latency once."""
        c = self.config
        out = 0.0
        if host_blocks:
            out += c.host.latency_s + host_blocks * c.block_bytes / c.host.bandwidth
        if ssd_blocks:
            out += c.ssd.latency_s + ssd_blocks * c.block_bytes / c.ssd.bandwidth
        return out

    def store_read_s(self, blocks: int) -> float:
        """Seconds to read these blocks from the store: each rank its shard over its own card."""
        spec = self.config.store
        return spec.latency_s + blocks * spec.rank_block_bytes / spec.bandwidth if blocks else 0.0

    def exposed_s(self, start: float) -> float:
        """The step starting at ``start``: seconds it waits for this step's promotions (0 when
        they arrived in time), the transfers run in order on each link; and the step's puts to
        the store. Called once per step."""
        n = self.config.prefetch_steps
        # the start of the step ``n`` before this one; before that many steps, the run's start
        known_from = start if n == 0 else self._starts[0] if len(self._starts) == n else 0.0
        wait = 0.0
        for p in self._pending:
            for link, took in (("host link", self.transfer_s(p.host_blocks, p.ssd_blocks)),
                               ("network card", self.store_read_s(p.store_blocks))):
                if took:
                    done = self._free_at[link] = max(p.arrival_s, known_from, self._free_at[link]) + took
                    self.stats.transfer_s += took
                    wait = max(wait, done - start)
        self._pending.clear()
        if self._puts:
            index = self.device_index
            self.stats.put_to_store += self.store.put([h for h in self._puts if h in index])
            self._puts.clear()
        self.stats.exposed_s += wait
        if self.config.prefetch_steps:
            self._starts.append(start)
            if len(self._starts) > self.config.prefetch_steps:
                self._starts.popleft()
        return wait

    # --- observation ------------------------------------------------------------------------
    def summary(self, query_tokens: int, hit_tokens: int) -> dict:
        """``query_tokens`` / ``hit_tokens``: the prefix hit rate's (first admissions), hits in any tier."""
        s, bb = self.stats, self.config.block_bytes
        tokens = {"hbm": hit_tokens - s.host_tokens - s.ssd_tokens - s.store_tokens, "host": s.host_tokens,
                  "ssd": s.ssd_tokens, **({"store": s.store_tokens} if self.store is not None else {}),
                  "recomputed": query_tokens - hit_tokens}
        moved = {"hbm_to_host": s.demoted_to_host * bb, "host_to_ssd": s.demoted_to_ssd * bb,
                 "host_to_hbm": s.promoted_from_host * bb, "ssd_to_hbm": s.promoted_from_ssd * bb}
        if self.store is not None:
            moved |= {"hbm_to_store": s.put_to_store * self.config.store.block_bytes,
                      "store_to_hbm": s.read_from_store * self.config.store.block_bytes}
        return {
            "host_capacity_blocks": self.config.host.capacity_blocks,
            "ssd_capacity_blocks": self.config.ssd.capacity_blocks,
            "prefetch_steps": self.config.prefetch_steps,
            "query_tokens": query_tokens,
            "tokens": tokens,
            "hit_rate": {k: v / query_tokens if query_tokens else 0.0 for k, v in tokens.items()},
            "bytes": moved,
            "blocks_dropped": s.dropped,
            "blocks_superseded": s.superseded,
            "blocks_held": {"host": len(self.host), "ssd": len(self.ssd)},
            "transfer_s": s.transfer_s,
            "transfer_exposed_s": s.exposed_s,
        }

    def check(self, device_hashes) -> None:
        """Every block in exactly one place, within each tier's capacity."""
        assert len(self.host) <= self.config.host.capacity_blocks, "host tier over capacity"
        assert len(self.ssd) <= self.config.ssd.capacity_blocks, "SSD tier over capacity"
        assert not self.host.keys() & self.ssd.keys(), "a block is in the host and the SSD tier"
        assert not self.host.keys() & device_hashes, "a block is in HBM and the host tier"
        assert not self.ssd.keys() & device_hashes, "a block is in HBM and the SSD tier"
        if self.store is not None:
            self.store.check()
        s = self.stats
        held = len(self.host) + len(self.ssd)
        assert s.received == held + s.promoted_from_host + s.promoted_from_ssd + s.dropped + s.superseded, (
            "blocks evicted into the tiers are not all held, promoted or dropped"
        )
