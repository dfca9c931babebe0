"""What moving a prompt's KV from a prefill instance to a decode instance costs (P/D disaggregation).

The bytes: the memory model's KV block of one rank (``bytes_per_block``: the layout's share of the
heads and layers, the KV dtype, MLA's latent where the model has it) times the blocks the prompt
fills, the last one partly: connectors move whole blocks (vLLM's NixlConnector reads the block ids
the scheduler hands it; vllm-ascend's Mooncake connector registers and sends blocks). Every rank
sends its own shard over its own device's link at once, so the time is that of one rank's shard;
where the two pools' layouts differ, the side whose ranks hold more per block sets it. The reported bytes are every rank's.

The link (sim/perf/topology.py): pools are laid out on the device's nodes in order, the prefill
instances' devices first, then the decode instances'; two instances whose first devices share a
node talk over the intra-node fabric (HCCS on an Atlas A2), others over the NICs (RoCE). A transfer
takes ``latency + bytes / (bandwidth x efficiency)`` with the efficiencies the collectives use.

Two connector behaviours:

- ``after-prefill``: the KV moves once the prefill has finished, as vLLM's NixlConnector and
  vllm-ascend's MooncakeConnector do (``vllm_ascend/distributed/kv_transfer/kv_p2p/mooncake/
  connector.py``: ``request_finished`` keeps the blocks until the decode side has read them);
  the whole transfer is exposed.
- ``layerwise``: each layer's KV is sent as soon as the layer has been computed, overlapped with the
  next layers (vllm-ascend's ``kv_p2p/layerwise_push/connector.py``, ``save_kv_layer`` after each
  attention layer; Mooncake's layer-wise prefill/transfer pipeline, Qin et al., FAST '25, section 5).
  With ``L`` layers over a prefill of ``c`` seconds on a link that needs ``t`` seconds for the
  whole KV, layer ``j`` is ready at ``j c / L`` and the link sends layers one after another, so the
  last arrives ``max(t / L, t - c (L - 1) / L)`` after the prefill ends (plus the latency): only the
  last layer's share when the link keeps up, the link's backlog when it does not.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from kvsim.policies.request import Request
from kvsim.sim.perf.topology import Topology

CONNECTORS = ("after-prefill", "layerwise")
KV_LINKS = ("auto", "intra", "inter")


@dataclass(frozen=True)
class KVLink:
    """One rank's link between a prefill and a decode instance."""

    kind: str  # "intra" (inside a node) | "inter" (between nodes)
    bandwidth: float  # B/s one way
    efficiency: float  # achieved fraction of it
    latency_s: float

    @classmethod
    def intra_of(cls, topology: Topology) -> KVLink:
        """The link between two devices of one node."""
        return cls("intra", topology.intra_bandwidth, topology.bandwidth_efficiency, topology.intra_latency_s)

    def seconds(self, nbytes: float) -> float:
        """The whole transfer of ``nbytes`` over this link, nothing overlapped."""
        return self.latency_s + nbytes / (self.bandwidth * self.efficiency)


def exposed_s(connector: str, link: KVLink, nbytes: float, prefill_s: float, num_layers: int) -> float:
    """Seconds from the prefill's end until the KV has arrived (module docstring)."""
    wire = nbytes / (link.bandwidth * link.efficiency)
    if connector == "after-prefill":
        return link.latency_s + wire
    layers = max(num_layers, 1)
    return link.latency_s + max(wire / layers, wire - prefill_s * (layers - 1) / layers)


class KVMover(Protocol):
    """Moves one prompt's KV between a P/D pair's instances: ``move`` gives (the whole transfer's seconds,
    the seconds it stays exposed after the prefill's end). The simulator prices it (:class:`PricedMover`);
    a real pair sends the KV and measures it (realexec/pd_pair.py)."""

    def move(self, request: Request, prefill: int, decode: int, link: KVLink, nbytes_rank: float,
             prefill_s: float) -> tuple[float, float]: ...


@dataclass(frozen=True)
class PricedMover:
    """The link model's transfer: ``link.seconds`` for the whole KV, the connector's exposed share (module docstring)."""

    connector: str
    num_layers: int

    def move(self, request: Request, prefill: int, decode: int, link: KVLink, nbytes_rank: float,
             prefill_s: float) -> tuple[float, float]:
        return link.seconds(nbytes_rank), exposed_s(self.connector, link, nbytes_rank, prefill_s, self.num_layers)


@dataclass(frozen=True)
class RecordedMover:
    """A real pair's measured transfers, by trace row, handed back to a replay of its run (both figures the measured one)."""

    seconds: dict[int, float]

    def move(self, request: Request, prefill: int, decode: int, link: KVLink, nbytes_rank: float,
             prefill_s: float) -> tuple[float, float]:
        measured = self.seconds[request.trace_index]
        return measured, measured


@dataclass(frozen=True)
class PoolPlacement:
    """Which node each instance of the two pools starts on, and the links between them."""

    prefill_nodes: tuple[int, ...]
    decode_nodes: tuple[int, ...]
    intra: KVLink | None
    inter: KVLink | None

    def link(self, prefill: int, decode: int) -> KVLink:
        same = self.prefill_nodes[prefill] == self.decode_nodes[decode]
        link = self.intra if same else self.inter
        assert link is not None, "place_pools checked every pair's link"
        return link


def place_pools(topology: Topology | None, device: str, prefill: int, prefill_devices: int, decode: int,
                decode_devices: int, kv_link: str) -> PoolPlacement:
    """Lay the pools out on nodes (``kv_link`` auto: in order; intra: all in one node; inter: each pool on
    nodes of its own) and check that the topology has every link that needs; errors name ``kv_link``."""
    if kv_link not in KV_LINKS:
        raise ValueError(f"kv_link = {kv_link!r}: must be one of {', '.join(KV_LINKS)}")
    if topology is None:
        raise ValueError(f"kv_link = {kv_link!r}: device {device} has no [topology] to move KV over (sim/perf/topology.py)")
    per_node = topology.devices_per_node
    first_decode_device = prefill * prefill_devices
    if kv_link == "inter":  # the decode pool starts on a node of its own
        first_decode_device = -(-first_decode_device // per_node) * per_node
    prefill_nodes = tuple(i * prefill_devices // per_node for i in range(prefill))
    decode_nodes = tuple((first_decode_device + i * decode_devices) // per_node for i in range(decode))
    total = prefill * prefill_devices + decode * decode_devices
    if kv_link == "intra" and total > per_node:
        raise ValueError(f"kv_link = 'intra': {prefill} prefill x {prefill_devices} + {decode} decode x {decode_devices} "
                         f"devices do not fit one node of {per_node} (topology.devices_per_node of {device})")
    crosses = any(p != d for p in prefill_nodes for d in decode_nodes)
    if crosses and not topology.has_network:
        raise ValueError(f"kv_link = {kv_link!r}: the pools span nodes but device {device} has no network between "
                         "nodes (topology.inter_bandwidth = 0)")
    intra = KVLink.intra_of(topology)
    inter = (KVLink("inter", topology.inter_bandwidth, topology.inter_efficiency, topology.inter_latency_s)
             if topology.has_network else None)
    return PoolPlacement(prefill_nodes, decode_nodes, intra, inter)
