"""A parallel layout (vLLM's TP / PP / DP / EP flags) and the model one rank of it holds.

vLLM's rules, which vllm-ascend follows:

- **TP** splits attention heads and MLP columns over ``tensor_parallel_size`` ranks; KV heads are
  split too, and replicated when TP exceeds their count (each rank keeps one); the vocabulary
  (embedding and LM head) is split as well. MLA's latent cache has no heads to split: every TP
  rank caches the whole latent of its tokens.
- **PP** splits the layers into ``pipeline_parallel_size`` stages; priced by its busiest stage
  (the one with the most MoE layers), holding both the embedding and the LM head (a bound).
- **DP** replicates the model over ``data_parallel_size`` groups that each run their own batch;
  for MoE models their MoE layers run together (every member padded to the group's largest
  batch, idle members running a dummy batch). MLA models' attention is data-parallel this way.
- **EP** (``enable_expert_parallel``) spreads the routed experts over TP x DP ranks instead of
  splitting each expert's columns by TP.

Ranks of a layout are symmetric, so one rank's model (:func:`rank_model`) is priced once; the
imbalance enters as the busiest rank (EP routing skew, DP padding; sim/parallel/rank_cost.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from kvsim.sim.perf.expert_routing import ExpertRouting
from kvsim.sim.perf.model_spec import ModelSpec
from kvsim.sim.perf.topology import Topology


@dataclass(frozen=True)
class ParallelLayout:
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    enable_expert_parallel: bool = False

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size * self.data_parallel_size

    @property
    def expert_parallel_size(self) -> int:
        return self.tensor_parallel_size * self.data_parallel_size if self.enable_expert_parallel else 1

    @property
    def is_single_device(self) -> bool:
        return self.world_size == 1

    def describe(self) -> str:
        parts = [f"TP{self.tensor_parallel_size}"]
        if self.pipeline_parallel_size > 1:
            parts.append(f"PP{self.pipeline_parallel_size}")
        if self.data_parallel_size > 1:
            parts.append(f"DP{self.data_parallel_size}")
        if self.enable_expert_parallel:
            parts.append(f"EP{self.expert_parallel_size}")
        return " x ".join(parts) + f" ({self.world_size} devices)"

    def check(self, model: ModelSpec, topology: Topology | None, device_name: str) -> None:
        """vLLM's layout rules for this model on this device; a ValueError naming the flag otherwise."""
        tp, pp = self.tensor_parallel_size, self.pipeline_parallel_size
        if self.world_size > 1 and topology is None:
            raise ValueError(f"--tensor/pipeline/data-parallel-size: device {device_name} has no [topology] table "
                             f"(devices per node, links), so {self.world_size} devices cannot be joined")
        if model.num_heads % tp:
            raise ValueError(f"--tensor-parallel-size {tp} does not divide {model.name}'s {model.num_heads} attention heads")
        kv = model.num_kv_heads
        if not model.is_mla and (kv % tp if tp <= kv else tp % kv):
            raise ValueError(f"--tensor-parallel-size {tp} neither divides nor is a multiple of {model.name}'s {kv} KV heads")
        if model.num_dense_mlp_layers and model.intermediate_size % tp:
            raise ValueError(f"--tensor-parallel-size {tp} does not divide {model.name}'s intermediate_size {model.intermediate_size}")
        if self.enable_expert_parallel:
            if not model.is_moe:
                raise ValueError(f"--enable-expert-parallel: {model.name} has no experts (not an MoE model)")
            if model.num_experts % self.expert_parallel_size:
                raise ValueError(f"--enable-expert-parallel: {model.num_experts} experts do not split over "
                                 f"{self.expert_parallel_size} ranks (TP x DP)")
        elif model.is_moe and model.moe_intermediate_size % tp:
            raise ValueError(f"--tensor-parallel-size {tp} does not divide {model.name}'s moe_intermediate_size "
                             f"{model.moe_intermediate_size} (or use --enable-expert-parallel)")
        if pp > model.num_layers:
            raise ValueError(f"--pipeline-parallel-size {pp} exceeds {model.name}'s {model.num_layers} layers")
        if topology is not None and self.world_size > topology.devices_per_node and not topology.has_network:
            raise ValueError(f"{self.describe()} needs more than one node of {topology.devices_per_node} "
                             f"{device_name} devices, and its topology has no inter-node link")

    def tp_spans_nodes(self, topology: Topology) -> bool:
        return self.tensor_parallel_size > topology.devices_per_node

    def ep_spans_nodes(self, topology: Topology) -> bool:
        return self.expert_parallel_size > topology.devices_per_node

    def pp_spans_nodes(self, topology: Topology) -> bool:
        """Stages on different nodes once a stage's TP x DP ranks fill a node."""
        return self.world_size > topology.devices_per_node


def rank_model(model: ModelSpec, layout: ParallelLayout) -> ModelSpec:
    """What one rank holds and computes: the busiest stage's layers, its share of heads, columns,
    vocabulary and experts (module docstring). The rank's KV per token is what it caches."""
    if layout.is_single_device:
        return model
    tp, pp, ep = layout.tensor_parallel_size, layout.pipeline_parallel_size, layout.expert_parallel_size
    layers = math.ceil(model.num_layers / pp)
    moe_layers = min(model.num_moe_layers, layers)
    changes: dict = {
        "name": f"{model.name} ({layout.describe()}, one rank)",
        "num_layers": layers,
        "num_heads": model.num_heads // tp,
        "num_kv_heads": model.num_heads // tp if model.is_mla else max(1, model.num_kv_heads // tp),
        "vocab_size": math.ceil(model.vocab_size / tp),
        "logits_vocab_size": model.vocab_size,  # the LM head is split, its logits gathered on every rank (vLLM V1)
        "intermediate_size": model.intermediate_size // tp,
    }
    if model.is_moe and layout.enable_expert_parallel:  # whole experts, E / ep of them (the routing is priced apart),
        experts = model.num_experts // ep  # and the whole router: every rank scores every expert
        changes.update(num_experts=experts, num_experts_per_tok=min(model.num_experts_per_tok, experts),
                       router_experts=model.num_experts)
    elif model.is_moe:  # every expert, its columns split by TP
        changes.update(moe_intermediate_size=model.moe_intermediate_size // tp)
    if model.is_moe:
        changes.update(dense_layers=layers - moe_layers, shared_expert_intermediate_size=model.shared_expert_intermediate_size // tp)
    return replace(model, **changes)


def rank_routing(model: ModelSpec, layout: ParallelLayout, base: ExpertRouting | None = None) -> ExpertRouting:
    """How a MoE model's tokens reach one rank's experts under ``layout``: ``base`` (default: uniform
    top-k of the whole model's experts) over the layout's EP ranks, the tokens of its DP members
    pooled where experts are shared across them."""
    base = base or ExpertRouting(model.num_experts, model.num_experts_per_tok)
    return replace(base, ep_size=layout.expert_parallel_size,
                   dp_size=layout.data_parallel_size if layout.enable_expert_parallel else 1)
