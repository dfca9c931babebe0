"""A KV store shared by instances, as Mooncake Store keeps it under vLLM's MooncakeStoreConnector
and vllm-ascend's KV cache pool (AscendStoreConnector).

The store is content-addressed: a block's key is its prefix hash, so every instance that
computes the same prefix writes the same key, and any instance can read it. It is a copy store,
not a tier a block moves through: an instance puts each prompt block it computes (the
connectors save every computed block; a key the store already holds is not written again, as
their ``exists`` check skips it), and a read copies the block into the reader's HBM while the
store keeps it. When full, the store drops its least recently used block (reads refresh a
block; Mooncake's master evicts by access order once its segments pass a high-water mark).

A block's size here is what every rank of an instance holds of it (``block_bytes``): the
connectors key blocks per rank, so a TP group writes its shards side by side, and MLA's latent
cache, which every TP rank keeps whole, is stored once a rank. Each rank reads its own shard over
its own network card, so a read takes one rank's bytes over one card (``rank_block_bytes``).

Instances of a cluster share one :class:`SharedKVStore`; a single engine with a store has one of its
own (a store outside the engine, as LMCache's remote backend). The per-engine side (lookups,
promotions, their transfer time) is ``policies.kv_tiers.KVTiers``.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field


@dataclass(frozen=True)
class StoreSpec:
    """The store's size and one instance's path to it."""

    capacity_blocks: int
    bandwidth: float  # B/s, store -> HBM, one rank's network card
    latency_s: float  # fixed cost of one read
    block_bytes: int  # a block over every rank of an instance (what the store holds)
    rank_block_bytes: int  # one rank's shard of a block (what one card moves)

    def __post_init__(self) -> None:
        if self.capacity_blocks < 1 or self.bandwidth <= 0 or self.latency_s < 0 or not 0 < self.rank_block_bytes <= self.block_bytes:
            raise ValueError(f"kv store: capacity_blocks >= 1, bandwidth > 0, latency_s >= 0, "
                             f"0 < rank_block_bytes <= block_bytes, not {self}")


@dataclass
class StoreStats:
    """What the store did over a run (the summary's ``kv_store``)."""

    put: int = 0  # blocks written
    put_skipped: int = 0  # puts of a key the store already held
    got: int = 0  # blocks read into an instance's HBM
    evicted: int = 0  # dropped at capacity


@dataclass
class SharedKVStore:
    """The store: an LRU of prefix hashes within ``spec.capacity_blocks``."""

    spec: StoreSpec
    blocks: OrderedDict[int, None] = field(default_factory=OrderedDict)  # least recently used first
    stats: StoreStats = field(default_factory=StoreStats)

    def __contains__(self, h: int) -> bool:
        return h in self.blocks

    def put(self, hashes: list[int]) -> int:
        """Write the blocks the store does not hold yet; returns how many were written."""
        blocks, written = self.blocks, 0
        for h in hashes:
            if h in blocks:
                continue
            blocks[h] = None
            written += 1
            if len(blocks) > self.spec.capacity_blocks:
                blocks.popitem(last=False)
                self.stats.evicted += 1
        self.stats.put += written
        self.stats.put_skipped += len(hashes) - written
        return written

    def get(self, hashes: list[int]) -> None:
        """Read these blocks (each held): the store keeps them, now most recently used."""
        for h in hashes:
            self.blocks.move_to_end(h)
        self.stats.got += len(hashes)

    def summary(self) -> dict:
        s, bb = self.stats, self.spec.block_bytes
        return {
            "capacity_blocks": self.spec.capacity_blocks,
            "blocks_held": len(self.blocks),
            "blocks_put": s.put,
            "puts_skipped": s.put_skipped,
            "blocks_read": s.got,
            "blocks_evicted": s.evicted,
            "bytes_put": s.put * bb,
            "bytes_read": s.got * bb,
        }

    def check(self) -> None:
        assert len(self.blocks) <= self.spec.capacity_blocks, "KV store over capacity"
        assert self.stats.put == len(self.blocks) + self.stats.evicted, "KV store: blocks put are not all held or evicted"


def share_store(tiers: list) -> SharedKVStore | None:
    """Give every engine's tiers (``KVTiers`` or None) the first one's store: one store for a
    cluster. Returns it (None where no engine has a store)."""
    storing = [t for t in tiers if t is not None and t.store is not None]
    if not storing:
        return None
    shared = storing[0].store
    for t in storing[1:]:
        if t.store.spec != shared.spec:
            raise ValueError("instances sharing a KV store must store blocks of the same size (model, KV dtype, block "
                             "size and parallel layout)")
        t.store = shared
    return shared
