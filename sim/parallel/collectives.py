"""Collectives priced from a device's topology: latency + bytes / bandwidth, times the algorithm's factor.

``S`` is the size of the whole buffer a collective produces on each rank (an all-reduce's tensor,
an all-gather's gathered output), ``m`` what one rank sends (all-to-all, send/recv), ``n`` the
group size, ``g`` the group's ranks on one node, ``a`` a link's latency and ``b`` its achieved
bandwidth (``bandwidth x efficiency``); a reduction runs at ``reduce_efficiency`` ``r`` of it.

Inside a node, a rank's share of the data that its node-mates hold, ``(g-1)/n``, moves

- on a full **mesh** (every pair linked; HCCS on Atlas A2) over its g - 1 links at once:
  ``(g-1)/n S / ((g-1) b) = S / (n b)``;
- through a **switch** (NVSwitch, the A3 fabric) over its one port: ``(g-1)/n S / b``.

The share held on other nodes, ``(n-g)/n``, crosses the rank's network card; both parts run at
once, so a group pays the slower: all-gather ``a + max(intra, inter)``, reduce-scatter the same
at ``r``, all-reduce = reduce-scatter + all-gather, all-to-all the same with ``m`` for ``S``;
send/recv ``a + m / b`` on the link between the two ranks. ``a`` is the latency of the slowest
link the group spans. A mesh all-reduce driving n - 1 links is why bus bandwidth grows with n on
910B (18 / 30 / 72 GB/s at 2 / 4 / 8 NPUs in the measurements the device file cites), which a
ring formula does not follow.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvsim.sim.perf.topology import Topology


@dataclass(frozen=True)
class Group:
    """A communication group of ``size`` ranks, ``per_node`` of them on each node, and its links."""

    size: int
    per_node: int
    fabric: str  # inside a node: "mesh" or "switch"
    intra_bandwidth: float  # B/s achieved, one way (per link on a mesh, per port through a switch)
    intra_latency_s: float
    inter_bandwidth: float  # B/s achieved per rank's network card; 0 when the group fits in a node
    inter_latency_s: float
    reduce_efficiency: float

    @property
    def latency_s(self) -> float:
        return self.inter_latency_s if self.size > self.per_node else self.intra_latency_s

    def move_s(self, share_bytes: float) -> float:
        """Seconds to bring a rank ``share_bytes`` spread evenly over the group (module docstring)."""
        n, g = self.size, self.per_node
        intra_share = share_bytes * (g - 1) / n
        intra = intra_share / ((g - 1) * self.intra_bandwidth) if self.fabric == "mesh" and g > 1 else intra_share / self.intra_bandwidth
        inter = share_bytes * (n - g) / n / self.inter_bandwidth if n > g else 0.0
        return max(intra, inter)


def make_group(topology: Topology, size: int) -> Group:
    """A group of ``size`` consecutive ranks: filling a node before spilling to the next."""
    per_node = min(size, topology.devices_per_node)
    if size > per_node and not topology.has_network:
        raise ValueError(f"a group of {size} ranks spans nodes of {topology.devices_per_node} devices, "
                         "but the device's topology has no inter-node link (topology.inter_bandwidth = 0)")
    return Group(size, per_node, topology.intra_fabric, topology.intra_bandwidth * topology.bandwidth_efficiency,
                 topology.intra_latency_s, topology.inter_bandwidth * topology.inter_efficiency,
                 topology.inter_latency_s, topology.reduce_efficiency)


def all_gather_s(group: Group, size: float) -> float:
    return 0.0 if group.size <= 1 else group.latency_s + group.move_s(size)


def reduce_scatter_s(group: Group, size: float) -> float:
    return 0.0 if group.size <= 1 else group.latency_s + group.move_s(size) / group.reduce_efficiency


def all_reduce_s(group: Group, size: float) -> float:
    return reduce_scatter_s(group, size) + all_gather_s(group, size)


def all_to_all_s(group: Group, sent: float) -> float:
    """Every rank sends ``sent`` bytes spread evenly over the group (its own share stays)."""
    return 0.0 if group.size <= 1 else group.latency_s + group.move_s(sent)


def send_recv_s(topology: Topology, sent: float, across_nodes: bool) -> float:
    """One hand-over between two ranks (pipeline stages), over one link or the network cards."""
    if across_nodes:
        return topology.inter_latency_s + sent / (topology.inter_bandwidth * topology.inter_efficiency)
    return topology.intra_latency_s + sent / (topology.intra_bandwidth * topology.bandwidth_efficiency)


def bus_bandwidth(kind: str, group: Group, size: float) -> float:
    """What nccl-tests / HCCL tests print as bus bandwidth for a collective of ``size`` bytes
    (algorithm bandwidth size / time, times 2 (n-1)/n for an all-reduce, (n-1)/n otherwise)."""
    seconds = {"all_reduce": all_reduce_s, "all_gather": all_gather_s, "reduce_scatter": reduce_scatter_s}[kind](group, size)
    n = group.size
    factor = 2 * (n - 1) / n if kind == "all_reduce" else (n - 1) / n
    return size / seconds * factor
