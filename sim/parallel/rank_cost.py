"""A step's time under a parallel layout: one rank's compute plus the collectives it waits for.

Ranks of a layout are symmetric, so one rank is priced (sim/parallel/layout.py ``rank_model``)
and the imbalance enters as the busiest rank:

- **DP**: the engine's batch is the data-parallel group's; each member runs ``1/dp`` of it,
  every member padded to the largest (token and sequence counts rounded up), as vLLM pads
  members to the group's largest batch. (The group is scheduled as one engine with dp x the
  member's limits and pool: vLLM's DP members each schedule their own requests.)
- **TP**: one all-reduce of the member's hidden states after the embedding (its vocabulary is
  split), after attention and after each MLP; the LM head's logits are gathered (fp32).
- **EP**: MoE layers exchange tokens over the EP group as vllm-ascend chooses
  (``moe_comm_method``) instead of an all-reduce; the busiest rank's experts set the compute
  (sim/perf/expert_routing.py).
- **PP**: a batch passes the stages in turn (no micro-batch overlap inside a step): the step is
  ``pp`` times a stage's time plus ``pp - 1`` hand-overs of its hidden states. A stage's time
  includes the engine's host work of a step, so PP counts it once a stage: an upper bound.

Collectives are not overlapped with compute: their whole time is exposed (the summary gives their share).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

from kvsim.policies.plan import StepPlan
from kvsim.sim.parallel.collectives import (
    all_gather_s,
    all_reduce_s,
    all_to_all_s,
    make_group,
    reduce_scatter_s,
    send_recv_s,
)
from kvsim.sim.parallel.layout import ParallelLayout, rank_model, rank_routing
from kvsim.sim.perf.cost_model import CostModel, StepFeatures, features_from_plan
from kvsim.sim.perf.device import DeviceProfile
from kvsim.sim.perf.expert_routing import ExpertRouting
from kvsim.sim.perf.model_spec import DTYPE_BYTES, ModelSpec

LOGIT_BYTES = 4
# Features that count tokens or sequences: a DP member's share is rounded up (padding to the largest).
_COUNTED = frozenset({"num_tokens", "num_seqs", "num_sampled", "prefill_tokens", "decode_seqs", "copy_blocks", "swap_blocks"})
_LONGEST = frozenset({"prefill_max_tokens", "decode_max_blocks"})  # the longest prompt / context is the same in every member
_FEATURES = tuple(f.name for f in fields(StepFeatures))
# vllm-ascend's MC2 limits on Atlas A2 (ascend_forward_context.py select_moe_comm_method): experts per
# device at most 24, EP at least 16, tokens within capacity min(ceil(max_tokens / tp), 512) x tp.
MC2_MAX_EXPERTS_PER_RANK, MC2_MIN_EP, MC2_TOKEN_CAP = 24, 16, 512


def moe_comm_method(device: DeviceProfile, layout: ParallelLayout, model: ModelSpec, tokens: float, max_tokens: int) -> str:
    """How MoE layers move tokens: vllm-ascend's rule on Ascend (see the constants above; A3 uses
    all-to-all), vLLM's default all-gather + reduce-scatter elsewhere; all-reduce without EP."""
    if not layout.enable_expert_parallel:
        return "all-reduce"
    tp, ep = layout.tensor_parallel_size, layout.expert_parallel_size
    if device.name.startswith("ascend-910c"):
        return "all-to-all"
    if device.name.startswith("ascend-910b"):
        capacity = min(math.ceil(max_tokens / tp), MC2_TOKEN_CAP) * tp
        if model.num_experts // ep <= MC2_MAX_EXPERTS_PER_RANK and ep >= MC2_MIN_EP and tokens <= capacity:
            return "mc2"
    return "all-gather"


@dataclass
class CollectiveTotals:
    """Seconds of exposed collectives and of whole steps, summed over a run."""

    collective_s: float = 0.0
    step_s: float = 0.0
    steps_by_method: dict[str, int] = field(default_factory=dict)  # steps by their MoE communication method


class ParallelCostModel:
    """The cost model of one rank of a layout, plus collectives: what CostModelTimer reads."""

    def __init__(self, model: ModelSpec, device: DeviceProfile, layout: ParallelLayout, block_size: int,
                 kv_dtype: str | None = None, routing: ExpertRouting | None = None, max_num_batched_tokens: int = 2048) -> None:
        layout.check(model, device.topology, device.name)
        self.model, self.device, self.layout, self.block_size = model, device, layout, block_size
        self.rank_spec = rank_model(model, layout)
        if model.is_moe:
            routing = rank_routing(model, layout, routing)
        self.rank = CostModel(self.rank_spec, device, block_size, kv_dtype, routing=routing)
        self.routing = routing
        self.max_num_batched_tokens = max_num_batched_tokens
        topo = device.topology
        tp, ep = layout.tensor_parallel_size, layout.expert_parallel_size
        self._tp_group = make_group(topo, tp) if tp > 1 else None
        self._ep_group = make_group(topo, ep) if ep > 1 else None
        self._pp_across_nodes = layout.pipeline_parallel_size > 1 and layout.pp_spans_nodes(topo)
        self.totals = CollectiveTotals()

    # --- the slot CostModelTimer fills ------------------------------------------------------------
    def member_features(self, f: StepFeatures) -> StepFeatures:
        """One DP member's share of the group's step (module docstring)."""
        dp = self.layout.data_parallel_size
        if dp == 1:
            return f
        values = {}
        for name in _FEATURES:
            value = getattr(f, name)
            if name in _LONGEST:
                values[name] = value
            elif name in _COUNTED:
                values[name] = float(math.ceil(value / dp))
            else:
                values[name] = value / dp
        return StepFeatures(**values)

    def collective_seconds(self, f: StepFeatures) -> tuple[float, str]:
        """Exposed collective time of one rank's step (one pipeline stage), and the MoE method used."""
        spec, layout = self.rank_spec, self.layout
        tokens = f.num_tokens
        if tokens <= 0:
            return 0.0, "none"
        a = DTYPE_BYTES[spec.activation_dtype]
        hidden = tokens * spec.hidden_size * a
        seconds = 0.0
        if self._tp_group is not None:
            reduce = all_reduce_s(self._tp_group, hidden)
            seconds += reduce  # the vocabulary-parallel embedding's rows, summed (vLLM's VocabParallelEmbedding)
            seconds += spec.num_layers * reduce  # after attention
            seconds += spec.num_dense_mlp_layers * reduce  # after a dense MLP
            seconds += all_gather_s(self._tp_group, f.num_sampled * self.model.vocab_size * LOGIT_BYTES)
        method = moe_comm_method(self.device, layout, self.model, tokens, self.max_num_batched_tokens)
        moe_layers = spec.num_moe_layers
        if moe_layers:
            if method == "all-reduce":
                seconds += moe_layers * (all_reduce_s(self._tp_group, hidden) if self._tp_group else 0.0)
            elif method == "all-gather":  # every rank gathers the group's tokens, then scatters the sums back
                gathered = hidden * layout.data_parallel_size  # TP ranks of a member hold the same tokens
                seconds += moe_layers * (all_gather_s(self._ep_group, gathered) + reduce_scatter_s(self._ep_group, gathered))
            else:  # mc2 / all-to-all: only the routed copies move, dispatched in int8 under W8A8
                copies = tokens * self.model.num_experts_per_tok * spec.hidden_size
                dispatch, combine = copies * (1 if spec.quantization else a), copies * a
                seconds += moe_layers * (all_to_all_s(self._ep_group, dispatch) + all_to_all_s(self._ep_group, combine))
        return seconds, method

    def _priced(self, f: StepFeatures) -> tuple[float, float, str]:
        """(step seconds, exposed collective seconds, MoE method) of the group's step ``f``."""
        member = self.member_features(f)
        compute = self.rank.step_total(member)
        comm, method = self.collective_seconds(member)
        pp = self.layout.pipeline_parallel_size
        handover = 0.0
        if pp > 1 and member.num_tokens:
            sent = member.num_tokens * self.rank_spec.hidden_size * DTYPE_BYTES[self.rank_spec.activation_dtype]
            handover = send_recv_s(self.device.topology, sent, self._pp_across_nodes)
        return pp * (compute + comm) + (pp - 1) * handover, pp * comm + (pp - 1) * handover, method

    def step_time(self, plan: StepPlan) -> float:
        """Seconds for one plan, as ``CostModel.step_time``; a prediction only (the run's totals stay as they are)."""
        return self._priced(features_from_plan(plan, self.block_size))[0]

    def step_total(self, f: StepFeatures) -> float:
        """The step's seconds, counted into the run's totals (the summary's collective share)."""
        total, exposed, method = self._priced(f)
        self.totals.collective_s += exposed
        self.totals.step_s += total
        self.totals.steps_by_method[method] = self.totals.steps_by_method.get(method, 0) + 1
        return total

    def swap_time(self, num_blocks: int) -> float:
        return self.rank.swap_time(num_blocks)

    def summary(self) -> dict:
        t = self.totals
        return {
            "layout": self.layout.describe(),
            "tensor_parallel_size": self.layout.tensor_parallel_size,
            "pipeline_parallel_size": self.layout.pipeline_parallel_size,
            "data_parallel_size": self.layout.data_parallel_size,
            "expert_parallel_size": self.layout.expert_parallel_size,
            "collective_share": t.collective_s / t.step_s if t.step_s else 0.0,
            "collective_s": t.collective_s,
            "moe_comm_steps": dict(sorted(t.steps_by_method.items())),
        }
