"""Device memory a CUDA-graph capture takes: the ``[graph_memory]`` table of a device file.

vLLM captures its graphs after the KV pool is allocated and logs what the capture took, as the fall
in free device memory around it (``Graph capturing finished in S secs, took X GiB``,
``gpu_model_runner.capture_model``). Up to v0.20 that memory comes out of the headroom the
utilisation fraction leaves (``1 - gpu_memory_utilization`` of the device): a capture larger than
the headroom fails at start-up, after the KV pool was sized. From v0.21 vLLM estimates it
beforehand and takes it off the KV budget (``VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS``, on by
default there); kvsim sizes the pool as the releases before did and reports the capture beside it.

Under vLLM's default ``cudagraph_mode`` (FULL_AND_PIECEWISE, since v0.11) it captures one piecewise
graph set per capture size (the layers between attention calls, one graph each) and one full
graph per uniform-decode batch size (capture sizes up to ``max_num_seqs``). All of them share one
memory pool, captured largest first so the smaller ones reuse it. vLLM's own estimator prices a
capture as the first (largest) graph's pool plus a fixed cost for each further graph
(``profile_cudagraph_memory``). This module follows that structure, with the terms
shaped by the model:

    took = pool_bytes
         + graphs * (layers * layer_bytes + moe_layers * moe_layer_bytes)
         + split_accumulators * largest_decode_batch * heads * head_width * 4

- ``graphs`` = piecewise sizes + full decode sizes, ``layers`` the rank's (its pipeline stage's):
  a captured graph keeps device memory per kernel node, and a layer's kernels (an MoE layer's
  routing and fused-expert kernels on top) repeat in every graph;
- the last term is split-KV decode attention's fp32 partial outputs inside the largest full
  graph: per decode row, ``split_accumulators`` partial results of every head of the rank
  (``head_width``: the value head size; MLA's latent rank under MLA). vLLM's debug log puts the
  full graphs' first capture at 260 MiB for Llama-3.1-8B on one H100, 132 MiB under TP2 and
  70 MiB under TP4: it follows the rank's heads;
- ``pool_bytes``: the rest of the largest graphs' pool and what capture allocates once.

A device without the table has no figure (``kvsim memory`` says so): the coefficients are fitted
per platform on logged captures (docs/fidelity.md), and no ACL-graph capture figure of
vllm-ascend has been found.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvsim.sim.perf.model_spec import ModelSpec
from kvsim.sim.toml_io import toml_value

FIELDS = ("pool_bytes", "layer_bytes", "moe_layer_bytes", "split_accumulators")
ACCUMULATOR_BYTES = 4  # fp32 partial outputs


@dataclass(frozen=True)
class GraphMemory:
    """A platform's graph-capture memory coefficients (module docstring)."""

    pool_bytes: float
    layer_bytes: float
    moe_layer_bytes: float = 0.0
    split_accumulators: float = 0.0
    source: str = ""

    def __post_init__(self) -> None:
        if min(self.pool_bytes, self.layer_bytes, self.moe_layer_bytes, self.split_accumulators) < 0:
            raise ValueError(f"graph_memory fields {', '.join(FIELDS)} must be >= 0")


@dataclass(frozen=True)
class GraphCapture:
    """What one rank's graph capture holds, and its terms (module docstring)."""

    piecewise_graphs: int
    full_graphs: int
    layers: int
    moe_layers: int
    pool_bytes: int
    per_graph_bytes: int
    accumulator_bytes: int

    @property
    def graphs(self) -> int:
        return self.piecewise_graphs + self.full_graphs

    @property
    def total_bytes(self) -> int:
        return self.pool_bytes + self.graphs * self.per_graph_bytes + self.accumulator_bytes

    def to_dict(self) -> dict:
        return {"piecewise_graphs": self.piecewise_graphs, "full_graphs": self.full_graphs, "layers": self.layers,
                "moe_layers": self.moe_layers, "pool_bytes": self.pool_bytes, "per_graph_bytes": self.per_graph_bytes,
                "accumulator_bytes": self.accumulator_bytes, "total_bytes": self.total_bytes}


def graph_capture(coefficients: GraphMemory, rank: ModelSpec, capture_sizes: tuple[int, ...], max_num_seqs: int) -> GraphCapture:
    """The capture of a rank holding ``rank`` (its stage's layers, its heads), for the sizes the run keeps."""
    decode_sizes = [s for s in capture_sizes if s <= max_num_seqs]
    width = rank.kv_lora_rank if rank.is_mla else (rank.v_head_dim or rank.head_dim)
    largest = decode_sizes[-1] if decode_sizes else 0
    accumulators = coefficients.split_accumulators * largest * rank.num_heads * width * ACCUMULATOR_BYTES
    moe_layers = rank.num_moe_layers
    per_graph = rank.num_layers * coefficients.layer_bytes + moe_layers * coefficients.moe_layer_bytes
    return GraphCapture(piecewise_graphs=len(capture_sizes), full_graphs=len(decode_sizes), layers=rank.num_layers,
                        moe_layers=moe_layers, pool_bytes=round(coefficients.pool_bytes), per_graph_bytes=round(per_graph),
                        accumulator_bytes=round(accumulators))


def parse_graph_memory(table: dict, path: Path) -> GraphMemory:
    """A ``[graph_memory]`` table; errors name the file and the field."""
    allowed = {*FIELDS, "source"}
    unknown = sorted(set(table) - allowed)
    if unknown:
        raise ValueError(f"{path}: unknown field(s) {', '.join('graph_memory.' + k for k in unknown)} "
                         f"(allowed: {', '.join(sorted(allowed))})")
    values: dict = {"source": str(table.get("source", ""))}
    for key in FIELDS:
        if key not in table and key in ("pool_bytes", "layer_bytes"):
            raise ValueError(f"{path}: missing field graph_memory.{key}")
        value = table.get(key, 0.0)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            raise ValueError(f"{path}: field graph_memory.{key} must be a number >= 0, got {value!r}")
        values[key] = float(value)
    return GraphMemory(**values)


def graph_memory_toml_lines(coefficients: GraphMemory) -> list[str]:
    """The ``[graph_memory]`` table that :func:`parse_graph_memory` reads back equal to ``coefficients``."""
    return ["[graph_memory]", *(f"{key} = {toml_value(getattr(coefficients, key))}" for key in FIELDS),
            f"source = {toml_value(coefficients.source)}"]
