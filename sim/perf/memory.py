"""Device-memory model: weights + activation workspace + KV pool + reserve, sized as vLLM sizes it.

vLLM (and vllm-ascend) size the KV pool at start-up from a memory-utilisation fraction
(``vllm/v1/worker/gpu_worker.py::determine_available_memory``)::

    budget    = ceil(total * memory_utilization)
    available = budget - weights - peak activation - non-torch (runtime) memory
    num_blocks = available // bytes_per_block        (kv_cache_utils.get_num_blocks)

The peak activation is what a dummy forward pass of the largest step the token budget allows
(``max_num_batched_tokens``) allocates. This module estimates it from the model's shape, as the
larger of two moments (``a`` = activation dtype bytes, ``T`` = max_num_batched_tokens,
``S = min(max_num_seqs, T)`` sampled rows)::

    inside a layer: a * T * (3h + max(q + 2kv + q, 3I))
        three hidden-size buffers (the residual stream, the normed hidden states and the
        block's output) stay live while either the
        attention block (fused QKV output + attention output) or the MLP block (fused gate/up
        output 2I + activated product I) holds its intermediates. Under MLA the attention block
        holds the latents (kv_lora_rank + rope) and their per-head up-projection n (nope + v)
        instead of 2kv; an MoE layer's block holds each token's top-k copies k (h + 3 I_moe) and
        the shared experts' 3 I_shared. The count of hidden-size
        buffers is read off vLLM's own profile: 3h + 3I is 110,592 bytes a token for Llama 3.1
        8B, where vLLM logged (17.06 - 14.99) GiB for 20,000 tokens = 111,196 (fidelity row
        vllm10517-20k, a fit row; 2h + 3I, the earlier count, was 8 % short);
    at the head:    a * T * h + b * S * V
        the final hidden states, and the dummy sampler's b bytes per sampled logit: 8 (fp32 logits
        plus their softmax) for an engine that names no vLLM release, else that release's figure
        read off vLLM's logs (38.4 before v0.17, 14.9 from it: sim/perf/vllm_release.py).

An MoE layer may work on more tokens than its rank's step: under data parallelism with an expert
exchange that gathers (vLLM's default ``allgather_reducescatter`` and its older ``naive``, vllm-ascend's
all-gather), every member's dummy batch reaches every rank's experts, G = dp * T tokens, and
the layer also holds the gathered inputs and the combined outputs (2 G h). Its per-copy
workspace then covers min(G, C) tokens, C the engine's fused-MoE chunk (``[engine]
moe_chunk_tokens``; vLLM's fused-MoE kernels allocate their workspace for one chunk and loop).

The real peak also depends on kernels' workspaces and the allocator's caching; calibrate the
runtime reserve against a measured ``kvsim execute`` if the block count must match exactly.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from kvsim.policies.blocks import cdiv
from kvsim.sim.perf.device import DeviceProfile
from kvsim.sim.perf.model_spec import DTYPE_BYTES, ModelSpec
from kvsim.sim.perf.vllm_release import SAMPLER_BYTES_UNVERSIONED, device_vllm_version, sampler_logit_bytes

DEFAULT_BLOCK_SIZE = 128  # the Ascend paged kernels' recommended size (vllm-ascend forces it)
GPU_BLOCK_SIZE = 16  # vLLM's CUDA platform default
FLASHMLA_BLOCK_SIZE = 64  # what vLLM forces for FlashMLA, its MLA backend on Hopper
DEFAULT_MEMORY_UTILIZATION = 0.9  # vLLM's gpu_memory_utilization default
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048  # vLLM's OpenAI-server default below 70 GiB (scheduler_defaults)
DEFAULT_MAX_NUM_SEQS = 256  # the same
LARGE_DEVICE_BYTES = 70 * 2**30  # vLLM's threshold for its larger scheduler defaults
HIDDEN_BUFFERS = 3  # hidden-size activations live at a layer's peak (module docstring)


def scheduler_defaults(device: DeviceProfile) -> tuple[int, int]:
    """(max_num_batched_tokens, max_num_seqs) that `vllm serve` takes on ``device`` when not given.

    vLLM's engine arguments (vllm/engine/arg_utils.py, V1) give the OpenAI server 8192 tokens and 1024
    sequences on a device of at least 70 GiB (vllm-project/vllm#12369 for the H100 and H200, #17073 by
    memory size), except on an A100, which keeps 2048 and 256 (#17885: the larger budget cost it up to
    36 % of throughput); every other device gets 2048 and 256. vllm-ascend's platform reports no memory to
    that rule (``NPUPlatform.get_device_total_memory`` raises, and vLLM then takes 0), so an Ascend NPU
    gets 2048 and 256 whatever its memory. vLLM reads "A100" in the GPU's name; kvsim reads the device file's
    ``generation`` (its Ampere parts are the A100 and the RTX 3090, which is under 70 GiB anyway).
    """
    if device.hbm_bytes >= LARGE_DEVICE_BYTES and device.platform != "ascend" and device.generation != "ampere":
        return 8192, 1024
    return DEFAULT_MAX_NUM_BATCHED_TOKENS, DEFAULT_MAX_NUM_SEQS


def block_size_default(device: DeviceProfile, model: ModelSpec) -> int:
    """The KV block size vLLM takes on ``device`` when none is given.

    vllm-ascend forces 128 (its paged kernels' size), and kvsim's CPU device keeps that too. vLLM's
    CUDA platform sets 16 (``CudaPlatform.check_and_update_config``), except for an MLA model on
    Hopper, where its default MLA backend, FlashMLA, forces 64. The device file's ``platform`` and
    ``generation`` say which, as vLLM reads its platform and the GPU's capability.
    """
    if device.platform in ("ascend", "cpu"):
        return DEFAULT_BLOCK_SIZE
    if model.is_mla and device.generation == "hopper":
        return FLASHMLA_BLOCK_SIZE
    return GPU_BLOCK_SIZE


class ModelDoesNotFit(ValueError):
    """The configuration leaves no room for a KV pool that can hold one max-length sequence."""


@dataclass(frozen=True)
class MemoryPlan:
    """Every term of the device-memory budget, in bytes, and the KV block count it yields."""

    model: str
    device: str
    kv_dtype: str
    block_size: int
    memory_utilization: float
    max_num_batched_tokens: int
    max_num_seqs: int
    max_model_len: int
    total_bytes: int  # what the runtime reports as the device's memory
    budget_bytes: int  # ceil(total * memory_utilization)
    weight_bytes: int
    activation_bytes: int  # peak workspace of the largest step (module docstring)
    reserve_bytes: int  # runtime memory outside the framework's allocator
    kv_available_bytes: int  # budget - weights - activations - reserve - int8 scales - graph_bytes; negative when over
    kv_bytes_per_token: int  # all layers, K and V
    bytes_per_block: int
    num_blocks: int
    problem: str | None  # why this cannot serve a max_model_len request; None when it can
    kv_scale_bytes: int = 0  # int8 KV's static per-channel scales, allocated once beside the pool
    moe_tokens: int | None = None  # tokens the MoE layers gathered in the profile's step (None: the step's own)
    graph_bytes: int = 0  # a graph capture taken off the budget first, as vLLM does from v0.21 (sim/perf/graph_memory.py)

    @property
    def fits(self) -> bool:
        return self.problem is None

    @property
    def kv_pool_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block

    @property
    def unused_bytes(self) -> int:
        """Budget left over: less than one block when the model fits."""
        return max(self.kv_available_bytes, 0) - self.kv_pool_bytes

    @property
    def token_capacity(self) -> int:
        return self.num_blocks * self.block_size

    def blocks_per_sequence(self, seq_len: int) -> int:
        if seq_len <= 0:
            raise ValueError(f"seq_len must be positive, got {seq_len}")
        return cdiv(seq_len, self.block_size)

    def max_sequences(self, seq_len: int) -> int:
        """How many sequences of ``seq_len`` tokens the pool holds at once (no prefix sharing)."""
        return self.num_blocks // self.blocks_per_sequence(seq_len)

    def require_fit(self) -> MemoryPlan:
        if self.problem is not None:
            raise ModelDoesNotFit(self.problem)
        return self

    def to_dict(self) -> dict:
        return {**asdict(self), "fits": self.fits, "kv_pool_bytes": self.kv_pool_bytes, "unused_bytes": self.unused_bytes}


def activation_workspace_bytes(model: ModelSpec, max_num_batched_tokens: int, max_num_seqs: int,
                               moe_tokens: int | None = None, moe_chunk_tokens: int = 0,
                               sampler_bytes: float = SAMPLER_BYTES_UNVERSIONED) -> int:
    """Peak activation memory of a step with ``max_num_batched_tokens`` tokens (module docstring).

    ``moe_tokens``: the tokens an MoE layer works on when it differs from the step's, as under data
    parallelism whose expert exchange gathers every member's tokens (default: the step's);
    ``moe_chunk_tokens``: the most of them its kernels hold workspace for at once (0: all);
    ``sampler_bytes``: bytes per sampled logit at the sampler's peak (sim/perf/vllm_release.py)."""
    a = DTYPE_BYTES[model.activation_dtype]
    tokens, h = max_num_batched_tokens, model.hidden_size
    sampled = min(max_num_seqs, tokens)
    attention_block = 2 * model.q_size + model.kv_entry_size
    if model.is_mla:  # prefill up-projects latents to per-head K (no-rope part) and V
        attention_block += model.num_heads * (model.qk_nope_head_dim + model.v_head_dim)
    mlp = a * tokens * 3 * model.intermediate_size if model.num_dense_mlp_layers else 0
    if model.is_moe:  # fused MoE: each token's top-k copies, their gate/up outputs and activations
        moe_block = model.num_experts_per_tok * (h + 3 * model.moe_intermediate_size) + 3 * model.shared_expert_intermediate_size
        gathered = tokens if moe_tokens is None else moe_tokens
        in_workspace = min(gathered, moe_chunk_tokens) if moe_chunk_tokens else gathered
        exchange = 2 * gathered * h if gathered > tokens else 0  # the gathered inputs and the combined outputs
        mlp = max(mlp, a * (in_workspace * moe_block + exchange))
    in_layer = a * tokens * HIDDEN_BUFFERS * h + max(a * tokens * attention_block, mlp)
    at_head = a * tokens * h + round(sampler_bytes * sampled * model.sampled_vocab_size)
    return max(in_layer, at_head)


def plan_memory(
    model: ModelSpec,
    device: DeviceProfile,
    *,
    kv_dtype: str | None = None,
    block_size: int = DEFAULT_BLOCK_SIZE,
    memory_utilization: float = DEFAULT_MEMORY_UTILIZATION,
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS,
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS,
    max_model_len: int | None = None,
    reserve_bytes: int | None = None,
    moe_tokens: int | None = None,
    graph_bytes: int = 0,
) -> MemoryPlan:
    """Size the KV pool as an engine does at start-up. A model that does not fit is a plan with
    ``problem`` set and no blocks, not an exception (``require_fit`` raises for callers that need blocks).

    ``reserve_bytes`` defaults to the device's ``runtime_reserve_bytes``; ``moe_tokens`` is what an
    MoE layer works on when it differs from ``max_num_batched_tokens`` (activation_workspace_bytes);
    ``graph_bytes`` is a graph capture's estimate that comes off the budget before the pool (vLLM from
    v0.21; before, the capture goes in the headroom and this is 0).
    """
    kv_dtype = kv_dtype or model.kv_dtype
    max_model_len = model.max_position if max_model_len is None else max_model_len
    _check_inputs(model, kv_dtype, block_size, memory_utilization, max_num_batched_tokens, max_num_seqs, max_model_len)
    reserve = device.runtime_reserve_bytes if reserve_bytes is None else reserve_bytes
    if reserve < 0:
        raise ValueError(f"reserve_bytes must be >= 0, got {reserve}")

    budget = math.ceil(device.hbm_bytes * memory_utilization)
    weights = model.weight_bytes()
    chunk = device.engine.moe_chunk_tokens if device.engine is not None else 0
    sampler = sampler_logit_bytes(device_vllm_version(device))
    activations = activation_workspace_bytes(model, max_num_batched_tokens, max_num_seqs, moe_tokens, chunk, sampler)
    scales = model.kv_scale_bytes(kv_dtype)
    available = budget - weights - activations - reserve - scales - graph_bytes
    per_block = model.bytes_per_block(block_size, kv_dtype)
    num_blocks = max(available, 0) // per_block

    gib = 2**30
    problem = None
    if available <= 0:
        problem = (
            f"{model.name} does not fit on {device.name}: weights {weights / gib:.2f} GiB + activations "
            f"{activations / gib:.2f} GiB + reserve {reserve / gib:.2f} GiB"
            f"{f' + graph capture {graph_bytes / gib:.2f} GiB' if graph_bytes else ''} exceed the budget {budget / gib:.2f} GiB "
            f"({memory_utilization:g} of {device.hbm_bytes / gib:.2f} GiB); {_fit_hint(model, weights, budget)}"
        )
    elif num_blocks * block_size < max_model_len:
        problem = (
            f"the KV pool of {model.name} on {device.name} holds {num_blocks} blocks = {num_blocks * block_size} tokens, "
            f"fewer than one max_model_len ({max_model_len}) sequence; lower max_model_len or "
            f"max_num_batched_tokens, or raise memory_utilization"
        )
    return MemoryPlan(
        model=model.name,
        device=device.name,
        kv_dtype=kv_dtype,
        block_size=block_size,
        memory_utilization=memory_utilization,
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs,
        max_model_len=max_model_len,
        total_bytes=device.hbm_bytes,
        budget_bytes=budget,
        weight_bytes=weights,
        activation_bytes=activations,
        reserve_bytes=reserve,
        kv_available_bytes=available,
        kv_bytes_per_token=model.kv_bytes_per_token(kv_dtype),
        bytes_per_block=per_block,
        num_blocks=num_blocks,
        problem=problem,
        kv_scale_bytes=scales,
        moe_tokens=moe_tokens,
        graph_bytes=graph_bytes,
    )


def _fit_hint(model: ModelSpec, weights: int, budget: int) -> str:
    """What would make a plan fit that does not, named by the run's keys."""
    split = "split the weights over more devices (tensor_parallel_size" + (", enable_expert_parallel)" if model.is_moe else ")")
    if weights < budget:
        return f"lower max_num_batched_tokens, raise memory_utilization or {split}"
    if model.quantization:
        return f"the weights alone exceed it: {split}"
    return f"the weights alone exceed it: {split} or quantize them (quantization w8a8 or w8a8_dynamic)"


def _check_inputs(
    model: ModelSpec,
    kv_dtype: str,
    block_size: int,
    memory_utilization: float,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    max_model_len: int,
) -> None:
    if kv_dtype not in DTYPE_BYTES:
        raise ValueError(f"unknown kv_dtype {kv_dtype!r} (one of {sorted(DTYPE_BYTES)})")
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    if not 0 < memory_utilization <= 1:
        raise ValueError(f"memory_utilization must be in (0, 1], got {memory_utilization}")
    if max_num_batched_tokens <= 0 or max_num_seqs <= 0:
        raise ValueError(f"max_num_batched_tokens and max_num_seqs must be positive, got {max_num_batched_tokens}, {max_num_seqs}")
    if not 0 < max_model_len <= model.max_position:
        raise ValueError(f"max_model_len must be in [1, {model.max_position}] for {model.name}, got {max_model_len}")
