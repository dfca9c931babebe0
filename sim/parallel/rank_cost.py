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

Collectives are not overlapped with compute (their whole time is exposed; the summary gives their
share), except under vLLM's dual batch overlap (``--enable-dbo``, :class:`DualBatchOverlap`).
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
from kvsim.sim.perf.cost_model import HOST_OPERATORS, CostModel, StepFeatures, features_from_plan
from kvsim.sim.perf.device import DeviceProfile
from kvsim.sim.perf.expert_routing import ExpertRouting
from kvsim.sim.perf.model_spec import DTYPE_BYTES, ModelSpec

LOGIT_BYTES = 4
# Features that count tokens or sequences: a DP member's share is rounded up (padding to the largest).
_COUNTED = frozenset({"num_tokens", "num_seqs", "num_sampled", "prefill_tokens", "decode_seqs", "copy_blocks", "swap_blocks"})
# The longest prompt and context are the same in every member.
_LONGEST = frozenset({"prefill_max_tokens", "decode_max_blocks", "prefill_max_blocks"})
_FEATURES = tuple(f.name for f in fields(StepFeatures))
# vllm-ascend's MC2 limits on Atlas A2 (ascend_forward_context.py select_moe_comm_method): experts per
# device at most 24, EP at least 16, tokens within capacity min(ceil(max_tokens / tp), 512) x tp.
MC2_MAX_EXPERTS_PER_RANK, MC2_MIN_EP, MC2_TOKEN_CAP = 24, 16, 512


def share_of(f: StepFeatures, parts: int) -> StepFeatures:
    """One of ``parts`` equal shares of a step: token and sequence counts rounded up (the largest share, as vLLM
    pads DP members to the group's largest batch), the longest prompt and context the same in every share."""
    if parts == 1:
        return f
    values = {}
    for name in _FEATURES:
        value = getattr(f, name)
        if name in _LONGEST:
            values[name] = value
        elif name in _COUNTED:
            values[name] = float(math.ceil(value / parts))
        else:
            values[name] = value / parts
    return StepFeatures(**values)


# vLLM's --all2all-backend values kvsim prices (vllm/config/parallel.py): its default gathers every token to every
# EP rank and scatters the sums back; DeepEP's kernels send each token's routed copies to their experts' ranks.
ALL2ALL_BACKENDS = ("allgather_reducescatter", "deepep_high_throughput", "deepep_low_latency")


def moe_comm_method(device: DeviceProfile, layout: ParallelLayout, model: ModelSpec, tokens: float, max_tokens: int,
                    all2all_backend: str = ALL2ALL_BACKENDS[0]) -> str:
    """How MoE layers move tokens: vllm-ascend's rule on Ascend (see the constants above; A3, the 910C
    generation, uses all-to-all), elsewhere vLLM's ``all2all_backend`` (all-gather + reduce-scatter, or DeepEP's
    all-to-all); all-reduce without EP."""
    if not layout.enable_expert_parallel:
        return "all-reduce"
    tp, ep = layout.tensor_parallel_size, layout.expert_parallel_size
    if device.platform == "ascend" and device.generation == "910c":
        return "all-to-all"
    if device.platform == "ascend":
        capacity = min(math.ceil(max_tokens / tp), MC2_TOKEN_CAP) * tp
        if model.num_experts // ep <= MC2_MAX_EXPERTS_PER_RANK and ep >= MC2_MIN_EP and tokens <= capacity:
            return "mc2"
        return "all-gather"
    return "all-gather" if all2all_backend == ALL2ALL_BACKENDS[0] else "all-to-all"


@dataclass(frozen=True)
class DualBatchOverlap:
    """vLLM's dual batch overlap (``--enable-dbo``; vllm/config/parallel.py, vllm/v1/worker/ubatching.py): a step of
    at least the threshold's tokens (``dbo_decode_token_threshold`` for a batch of decodes alone, else
    ``dbo_prefill_token_threshold``; vLLM's defaults 32 and 512) runs as two micro-batches, each on its own
    thread, one's expert dispatch and combine on the communication stream while the other computes. vLLM
    takes it only with a DeepEP ``--all2all-backend`` (vllm/config/vllm.py asserts it), so the MoE exchange
    is an all-to-all of the routed copies. Priced as two micro-batches sharing the compute stream and the links: each micro-batch's
    compute (with its tensor-parallel collectives, which stay in line) ``u`` and its exchange ``x``
    overlap all but the pipeline's fill, ``max(2u, 2x) + min(u, x) / phases`` (two exchanges a MoE
    layer), plus the step's host time once. A micro-batch reads the weights the whole batch would:
    decode steps pay them twice, which is what can make the overlap lose."""

    decode_token_threshold: int = 32
    prefill_token_threshold: int = 512

    def splits(self, f: StepFeatures) -> bool:
        """Whether vLLM runs this (data-parallel member's) step as two micro-batches."""
        decode_only = f.prefill_tokens == 0
        return f.num_tokens >= (self.decode_token_threshold if decode_only else self.prefill_token_threshold)


@dataclass
class CollectiveTotals:
    """Seconds of exposed collectives and of whole steps, summed over a run."""

    collective_s: float = 0.0
    step_s: float = 0.0
    steps_by_method: dict[str, int] = field(default_factory=dict)  # steps by their MoE communication method


class ParallelCostModel:
    """The cost model of one rank of a layout, plus collectives: what CostModelTimer reads."""

    def __init__(self, model: ModelSpec, device: DeviceProfile, layout: ParallelLayout, block_size: int,
                 kv_dtype: str | None = None, routing: ExpertRouting | None = None, max_num_batched_tokens: int = 2048,
                 overlap: DualBatchOverlap | None = None, all2all_backend: str = ALL2ALL_BACKENDS[0]) -> None:
        layout.check(model, device.topology, device.name)
        self.model, self.device, self.layout, self.block_size = model, device, layout, block_size
        self.overlap, self.all2all_backend = overlap, all2all_backend
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
        return share_of(f, self.layout.data_parallel_size)

    def collective_seconds(self, f: StepFeatures) -> tuple[float, str]:
        """Exposed collective time of one rank's step (one pipeline stage), and the MoE method used."""
        if f.num_tokens <= 0:
            return 0.0, "none"
        method = moe_comm_method(self.device, self.layout, self.model, f.num_tokens, self.max_num_batched_tokens,
                                 self.all2all_backend)
        return self._tensor_parallel_seconds(f) + self._moe_exchange_seconds(f, method), method

    def _tensor_parallel_seconds(self, f: StepFeatures) -> float:
        """The TP group's all-reduces of the hidden states and the logits' all-gather (module docstring)."""
        if self._tp_group is None:
            return 0.0
        spec = self.rank_spec
        reduce = all_reduce_s(self._tp_group, f.num_tokens * spec.hidden_size * DTYPE_BYTES[spec.activation_dtype])
        seconds = reduce  # the vocabulary-parallel embedding's rows, summed (vLLM's VocabParallelEmbedding)
        seconds += spec.num_layers * reduce  # after attention
        seconds += spec.num_dense_mlp_layers * reduce  # after a dense MLP
        return seconds + all_gather_s(self._tp_group, f.num_sampled * self.model.vocab_size * LOGIT_BYTES)

    def _moe_exchange_seconds(self, f: StepFeatures, method: str) -> float:
        """The MoE layers' token exchange by ``method`` (:func:`moe_comm_method`)."""
        spec, moe_layers = self.rank_spec, self.rank_spec.num_moe_layers
        if not moe_layers:
            return 0.0
        a = DTYPE_BYTES[spec.activation_dtype]
        hidden = f.num_tokens * spec.hidden_size * a
        if method == "all-reduce":
            return moe_layers * (all_reduce_s(self._tp_group, hidden) if self._tp_group else 0.0)
        if method == "all-gather":  # every rank gathers the group's tokens, then scatters the sums back
            gathered = hidden * self.layout.data_parallel_size  # TP ranks of a member hold the same tokens
            return moe_layers * (all_gather_s(self._ep_group, gathered) + reduce_scatter_s(self._ep_group, gathered))
        # mc2 / all-to-all: only the routed copies move, dispatched in int8 under W8A8
        copies = f.num_tokens * self.model.num_experts_per_tok * spec.hidden_size
        dispatch, combine = copies * (1 if spec.quantization else a), copies * a
        return moe_layers * (all_to_all_s(self._ep_group, dispatch) + all_to_all_s(self._ep_group, combine))

    def _overlapped(self, member: StepFeatures) -> tuple[float, float, str]:
        """(seconds, exposed collective seconds, MoE method) of a member's step as two overlapped micro-batches
        (:class:`DualBatchOverlap`; the run's all2all backend, a DeepEP one, sets the exchange)."""
        half = share_of(member, 2)
        split = self.rank.step_split(half, one_step=True)
        host_half = sum(split[op] for op in HOST_OPERATORS)
        compute = sum(split.values()) - host_half
        tp = self._tensor_parallel_seconds(half)
        method = moe_comm_method(self.device, self.layout, self.model, half.num_tokens, self.max_num_batched_tokens,
                                 self.all2all_backend)
        exchange = self._moe_exchange_seconds(half, method)
        work = compute + tp
        full = self.rank.step_split(member, one_step=True)
        host = sum(full[op] for op in HOST_OPERATORS)
        seconds = host + max(2 * work, 2 * exchange) + min(work, exchange) / (2 * self.rank_spec.num_moe_layers)
        return seconds, seconds - host - 2 * compute, f"{method}, two micro-batches"

    def _priced(self, f: StepFeatures) -> tuple[float, float, str]:
        """(step seconds, exposed collective seconds, MoE method) of the group's step ``f``."""
        member = self.member_features(f)
        if self.overlap is not None and member.num_tokens and self.overlap.splits(member):
            stage, comm, method = self._overlapped(member)
        else:
            comm, method = self.collective_seconds(member)
            stage = self.rank.step_total(member) + comm
        pp = self.layout.pipeline_parallel_size
        handover = 0.0
        if pp > 1 and member.num_tokens:
            sent = member.num_tokens * self.rank_spec.hidden_size * DTYPE_BYTES[self.rank_spec.activation_dtype]
            handover = send_recv_s(self.device.topology, sent, self._pp_across_nodes)
        return pp * stage + (pp - 1) * handover, pp * comm + (pp - 1) * handover, method

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
