"""How a device's boards and nodes are wired: the ``[topology]`` table of a device file.

Collectives (sim/parallel/collectives.py) price a group on the slowest link it spans: the links
inside a node when the group fits in one, the node's network cards otherwise. Inside a node a
fabric is either

- ``mesh``: every pair of devices has its own link (HCCS on an Atlas 800 A2 server: 8 x 910B,
  7 links each), so a device drives n - 1 links at once and a collective's time falls with n;
- ``switch``: every device has one port of ``intra_bandwidth`` into a switch (NVLink through
  NVSwitch; the A3 super-node fabric), so the classic ring / all-to-all factors apply.

Layout::

    [topology]
    devices_per_node = 8
    intra_fabric = "mesh"            # mesh | switch
    intra_bandwidth = 5.6e10         # B/s one way: per link (mesh) or per device port (switch)
    intra_latency_s = 1e-5           # a collective's fixed cost inside a node, per algorithm step
    inter_bandwidth = 2.5e10         # B/s one way per device's NIC between nodes (0: no network)
    inter_latency_s = 2e-5
    bandwidth_efficiency = 0.38      # achieved fraction of the intra-node bandwidth by a collective library
    inter_efficiency = 0.87          # ... and of the network cards'
    reduce_efficiency = 0.5          # a reduction's further fraction (the adds, on the vector units)
    buffer_bytes = 209715200         # per communication group, outside the framework's allocator
"""

from __future__ import annotations

from dataclasses import dataclass

from kvsim.sim.toml_io import toml_value

FABRICS = ("mesh", "switch")


@dataclass(frozen=True)
class Topology:
    devices_per_node: int
    intra_fabric: str
    intra_bandwidth: float
    intra_latency_s: float
    inter_bandwidth: float
    inter_latency_s: float
    bandwidth_efficiency: float
    inter_efficiency: float
    reduce_efficiency: float
    buffer_bytes: int

    def __post_init__(self) -> None:
        if self.intra_fabric not in FABRICS:
            raise ValueError(f"topology.intra_fabric must be one of {', '.join(FABRICS)}, got {self.intra_fabric!r}")
        if self.devices_per_node < 1:
            raise ValueError(f"topology.devices_per_node must be >= 1, got {self.devices_per_node}")
        for name in ("bandwidth_efficiency", "inter_efficiency", "reduce_efficiency"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"topology.{name} must be in (0, 1], got {getattr(self, name)}")

    @property
    def has_network(self) -> bool:
        return self.inter_bandwidth > 0


TOPOLOGY_FIELDS: dict[str, type] = {
    "devices_per_node": int,
    "intra_fabric": str,
    "intra_bandwidth": float,
    "intra_latency_s": float,
    "inter_bandwidth": float,
    "inter_latency_s": float,
    "bandwidth_efficiency": float,
    "inter_efficiency": float,
    "reduce_efficiency": float,
    "buffer_bytes": int,
}
_MAY_BE_ZERO = frozenset({"intra_latency_s", "inter_bandwidth", "inter_latency_s", "buffer_bytes"})


def parse_topology(table: dict, path: object) -> Topology:
    """``[topology]`` of a device file; every field required, errors naming the field."""
    unknown = sorted(set(table) - set(TOPOLOGY_FIELDS))
    if unknown:
        raise ValueError(f"{path}: unknown field(s) {', '.join('topology.' + k for k in unknown)} "
                         f"(allowed: {', '.join(TOPOLOGY_FIELDS)})")
    values: dict = {}
    for key, kind in TOPOLOGY_FIELDS.items():
        if key not in table:
            raise ValueError(f"{path}: missing field topology.{key}")
        value = table[key]
        if kind is str:
            if not isinstance(value, str):
                raise ValueError(f"{path}: field topology.{key} must be a string, got {value!r}")
            values[key] = value
            continue
        ok = isinstance(value, int) if kind is int else isinstance(value, (int, float))
        if isinstance(value, bool) or not ok:
            raise ValueError(f"{path}: field topology.{key} must be {'an integer' if kind is int else 'a number'}, got {value!r}")
        if value < 0 or (value == 0 and key not in _MAY_BE_ZERO):
            raise ValueError(f"{path}: field topology.{key} must be {'>= 0' if key in _MAY_BE_ZERO else '> 0'}, got {value!r}")
        values[key] = kind(value)
    try:
        return Topology(**values)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None


def topology_toml_lines(topology: Topology) -> list[str]:
    lines = ["[topology]"]
    for key in TOPOLOGY_FIELDS:
        value = getattr(topology, key)
        lines.append(f"{key} = {toml_value(value)}")
    return lines
