"""Device memory of one rank of a parallel layout: its weight shard, KV pool, workspace and buffers.

Each rank sizes its own KV pool from what its share of the weights leaves, as vLLM's workers do
(every TP rank ends with the same block count: the engine takes the minimum). A rank caches its
stage's layers for its KV heads (or the whole MLA latent). Collective libraries keep a buffer per
communication group outside the framework's allocator (HCCL_BUFFSIZE), counted in the reserve.
Where the experts' exchange gathers the data-parallel members' tokens (``moe_comm_method``'s
all-gather), the start-up profile's MoE layers work on every member's dummy batch at once, and so
size the rank's activation peak (sim/perf/memory.py).
"""

from __future__ import annotations

from kvsim.sim.parallel.layout import ParallelLayout, rank_model
from kvsim.sim.parallel.rank_cost import ALL2ALL_BACKENDS, moe_comm_method
from kvsim.sim.perf.device import DeviceProfile
from kvsim.sim.perf.graph_memory import GraphCapture, graph_capture
from kvsim.sim.perf.memory import DEFAULT_MAX_NUM_BATCHED_TOKENS, MemoryPlan, plan_memory
from kvsim.sim.perf.model_spec import ModelSpec
from kvsim.sim.perf.vllm_release import device_vllm_version, estimates_graph_memory


def communication_groups(layout: ParallelLayout) -> int:
    """Groups a rank communicates in: TP, the pipeline hand-over, EP (or DP's dummy-batch sync)."""
    groups = int(layout.tensor_parallel_size > 1) + int(layout.pipeline_parallel_size > 1)
    return groups + int(layout.expert_parallel_size > 1 or layout.data_parallel_size > 1)


# Buffers a pipeline hand-over group holds outside the allocator where the collective library is NCCL
# (platform "cuda"), in units of the topology's buffer_bytes: none shows. vLLM v0.19 logs a "non-torch forward
# increase" of 0.07 GiB for Llama-3.1-8B at PP2 and PP4 on H100s, below TP1's 0.25 (read off fidelity row
# llmd-llama8b-pp2-blocks, a fit row for that reason; its PP4 sibling is a check). HCCL allocates
# HCCL_BUFFSIZE per communicator, a pipeline group's included: one.
NCCL_PIPELINE_BUFFERS = 0


def buffer_bytes(device: DeviceProfile, layout: ParallelLayout) -> int:
    if layout.is_single_device or device.topology is None:
        return 0
    groups = communication_groups(layout)
    if layout.pipeline_parallel_size > 1 and device.platform == "cuda":
        groups += NCCL_PIPELINE_BUFFERS - 1
    return groups * device.topology.buffer_bytes


def gathered_moe_tokens(model: ModelSpec, device: DeviceProfile, layout: ParallelLayout, max_num_batched_tokens: int,
                        all2all_backend: str = ALL2ALL_BACKENDS[0]) -> int | None:
    """Tokens one rank's MoE layers work on in the start-up profile's step: every data-parallel member's
    where the exchange gathers them, else None (the rank's own)."""
    if not model.is_moe or layout.data_parallel_size == 1:
        return None
    method = moe_comm_method(device, layout, model, max_num_batched_tokens, max_num_batched_tokens, all2all_backend)
    return layout.data_parallel_size * max_num_batched_tokens if method == "all-gather" else None


def plan_rank_memory(model: ModelSpec, device: DeviceProfile, layout: ParallelLayout,
                     all2all_backend: str = ALL2ALL_BACKENDS[0], **sizing) -> MemoryPlan:
    """One rank's memory plan (``sizing``: plan_memory's keywords); the reserve includes the buffers."""
    if layout.is_single_device:
        return plan_memory(model, device, **sizing)
    layout.check(model, device.topology, device.name)
    reserve = sizing.pop("reserve_bytes", None)
    reserve = (device.runtime_reserve_bytes if reserve is None else reserve) + buffer_bytes(device, layout)
    tokens = sizing.get("max_num_batched_tokens", DEFAULT_MAX_NUM_BATCHED_TOKENS)
    moe_tokens = gathered_moe_tokens(model, device, layout, tokens, all2all_backend)
    return plan_memory(rank_model(model, layout), device, reserve_bytes=reserve, moe_tokens=moe_tokens, **sizing)


def rank_graph_capture(device: DeviceProfile, model: ModelSpec, layout: ParallelLayout, max_num_seqs: int) -> GraphCapture | None:
    """One rank's graph capture on ``device`` as its engine runs (the sizes a run of ``max_num_seqs`` keeps:
    sim/perf/engine_overhead.py); None where nothing is captured (eager) or the device has no ``[graph_memory]``."""
    if device.graph_memory is None or not device.captures_graphs:
        return None
    run = device.engine.for_run(max_num_seqs, model.num_layers, layout.tensor_parallel_size, layout.data_parallel_size)
    return graph_capture(device.graph_memory, rank_model(model, layout), run.capture_sizes, max_num_seqs)


def budgeted_graph_bytes(device: DeviceProfile, capture: GraphCapture | None, estimate: bool | None = None) -> int:
    """What vLLM takes off the KV budget for ``capture`` (:func:`rank_graph_capture`'s) under
    ``VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS`` (``estimate`` None: the device engine's release decides, on
    from v0.21); 0 when not estimated or for an eager engine. A device that captures graphs but has no
    ``[graph_memory]`` figure is an error when asked: kvsim would otherwise leave the pool as large as before."""
    if estimate is None:
        estimate = estimates_graph_memory(device_vllm_version(device))
    if not estimate or not device.captures_graphs:
        return 0
    if capture is None:
        raise ValueError(f"estimate_cudagraph_memory: device {device.name} has no [graph_memory] figure to take off the "
                         f"KV budget (no measured capture of its platform); run without it or with --enforce-eager")
    return capture.total_bytes
