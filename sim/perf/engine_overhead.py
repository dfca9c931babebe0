"""How a serving engine runs the kernels of a step: eager or graph-captured, synchronous or async.

The cost model prices each operator as a roofline plus a device-side gap per kernel; this module
says what the host adds around them, as vLLM and vllm-ascend run a step:

- **eager** (``mode = "eager"``, vllm-ascend's ``enforce_eager``, vLLM without CUDA graphs): the
  host dispatches every kernel through PyTorch, ``dispatch_s`` seconds each. Dispatch runs ahead
  of the device, so kernels cost ``max(device time, dispatch time)``: small decode batches are
  bound by dispatch, large prefills by the device.
- **graph** (``mode = "graph"``: CUDA graphs, ACLGraph): a step whose token count is at most the
  largest of ``capture_sizes`` replays a captured graph, with no per-kernel dispatch; its tokens
  are padded up to the nearest captured size, so the GEMMs do the padded work. Larger steps run
  eagerly (vLLM captures no graph for them). A device file's ``capture_sizes`` is vLLM's default
  list, and ``graph_sizes_per_seq = 2`` keeps a run's sizes up to twice its ``max_num_seqs``, as
  vLLM's default ceiling ``min(2 max_num_seqs, 512)`` does (``VllmConfig._set_cudagraph_sizes``,
  ``vllm/config/vllm.py``): with 8 sequences, graphs of up to 16 tokens, and a larger step runs
  eagerly. An executor's calibrated profile has none (0): it lists what the executor captured.
- **ACL graph's stream budget** (``graph_stream_budget``, Ascend): every captured graph holds
  device streams, and a device has 2,048, so vllm-ascend captures fewer sizes the more layers a
  model has and the more communication groups it joins, sampling the default list evenly and
  keeping its first and last size (``update_aclgraph_sizes`` in ``vllm_ascend/utils.py``, v0.11.0:
  1,800 streams, ``floor((1800 - 40 g) / (layers + 1) / (1 + 2 g))`` sizes with g the groups among
  TP and DP larger than 1; the budget binds vllm-ascend's default piecewise graphs, one graph a
  layer and size, MLA models' included: ``vllm_ascend/platform.py``). Qwen3-8B keeps 48 of 51
  sizes; DeepSeek-V3 under TP8 x DP2 keeps 5, so a step of 2 decodes there runs the graph of 80
  tokens. CUDA graphs have no such budget (0).
- **fused-MoE chunk** (``moe_chunk_tokens``, memory only): vLLM's fused-MoE kernels work on at most
  ``VLLM_FUSED_MOE_CHUNK_SIZE`` tokens at a time, so their workspace stops growing there
  (sim/perf/memory.py); vllm-ascend's MoE path has no such chunk (0).
- **async scheduling** (``async_scheduling = true``): the engine prepares step ``n + 1`` while the
  device runs step ``n``, so the step takes ``max(execution, host work)`` instead of their sum.

Host work per step (scheduling, input preparation, sampling read-back, output processing) is the
cost model's ``host_step``, ``host_seq`` and ``host_token`` operators. A served request meets two
more costs outside the engine loop: ``admit_s``, the API server's own time for it (request
parsing, chat template, tokenisation), which a single server process shares among the requests
in it, so a burst of prompts reaches the engine together and late; and ``request_s``, latency every request sees in
parallel (HTTP, hand-over to the engine process, detokenising and streaming the first token).
Both add to a served request's time to first token, not to any step. On vLLM's V1 engine the same
server process also detokenises and streams every token, ``stream_s`` each, on one lane that
shares the process with the admissions (sim/perf/api_server.py).

vLLM's V0 engine (``vllm/engine/llm_engine.py``, ``LLMEngine.step``; vllm-ascend v0.7.x runs it)
adds host work per sequence per step on the thread that also dispatches the kernels: the
scheduler's per-group loop and ``SequenceGroupMetadata``, the model runner's per-sequence input
building, the sampler's per-group metadata, and output processing with incremental
detokenisation and stop checks for every sequence. ``v0_seq_s`` is that time per sequence; it is
charged (as the cost model's ``host_seq``) only to runs of a V0 engine, since V1 moved
detokenisation to the front-end process and builds its inputs from a persistent batch.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from kvsim.sim.perf.vllm_release import parse_version
from kvsim.sim.toml_io import toml_value

Num = float | np.ndarray

MODES = ("eager", "graph")
# Streams vllm-ascend sets aside per communication group when HCCL unfolds collectives on the AI CPU,
# its default (vllm_ascend/utils.py, update_aclgraph_sizes, v0.11.0).
ACL_STREAMS_PER_GROUP = 40


@dataclass(frozen=True)
class EngineProfile:
    """The execution mode of an engine on a device and its host costs (module docstring)."""

    mode: str
    dispatch_s: float  # host time to dispatch one kernel outside a graph
    capture_sizes: tuple[int, ...] = ()  # token counts with a captured graph (graph mode)
    async_scheduling: bool = False
    request_s: float = 0.0  # latency per served request before its first token, paid in parallel
    admit_s: float = 0.0  # API-server time per request, in one process the requests share
    v0_seq_s: float = 0.0  # vLLM V0 engine: host time per sequence per step (module docstring)
    stream_s: float = 0.0  # vLLM V1's API server: time per streamed token, on a lane beside the admissions
    graph_sizes_per_seq: int = 0  # sizes kept up to this many tokens per max_num_seqs (vLLM's 2; 0: every size)
    graph_stream_budget: int = 0  # ACL graph: device streams the captured graphs may hold (0: no budget, as CUDA graphs)
    moe_chunk_tokens: int = 0  # tokens a fused-MoE call works on at once (vLLM's VLLM_FUSED_MOE_CHUNK_SIZE; 0: all)
    vllm_version: str = ""  # the vLLM release whose KV-pool sizing rules apply (sim/perf/vllm_release.py; "": none named)
    source: str = ""
    capped_from: int = 0  # capture sizes before a run's settings cut them (0: not cut; :meth:`for_run`)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"engine mode must be one of {MODES}, got {self.mode!r}")
        if self.mode == "graph" and not self.capture_sizes:
            raise ValueError("graph mode needs capture_sizes")
        if any(s <= 0 for s in self.capture_sizes) or list(self.capture_sizes) != sorted(set(self.capture_sizes)):
            raise ValueError(f"capture_sizes must be positive, increasing and distinct, got {list(self.capture_sizes)}")
        if min(self.dispatch_s, self.request_s, self.admit_s, self.v0_seq_s, self.stream_s) < 0:
            raise ValueError("dispatch_s, request_s, admit_s, v0_seq_s and stream_s must be >= 0")

    def for_run(self, max_num_seqs: int, num_layers: int, tensor_parallel_size: int = 1,
                data_parallel_size: int = 1) -> EngineProfile:
        """The engine as it captures graphs for a run of ``max_num_seqs`` sequences, a model of ``num_layers``
        layers and a TP x DP layout: the capture sizes up to ``graph_sizes_per_seq`` times ``max_num_seqs``,
        then cut to what a stream budget holds (module docstring); itself in eager mode or where nothing is
        cut. A budget too small for two sizes is an error, as it stops vllm-ascend from starting in graph mode."""
        if self.mode != "graph":
            return self
        ceiling = self.graph_sizes_per_seq * max_num_seqs or self.capture_sizes[-1]
        sizes = tuple(s for s in self.capture_sizes if s <= ceiling) or self.capture_sizes[:1]
        cut = replace(self, capture_sizes=sizes, capped_from=len(self.capture_sizes)) if sizes != self.capture_sizes else self
        return cut._within_stream_budget(num_layers, tensor_parallel_size, data_parallel_size)

    def _within_stream_budget(self, num_layers: int, tensor_parallel_size: int, data_parallel_size: int) -> EngineProfile:
        if not self.graph_stream_budget:
            return self
        groups = (tensor_parallel_size > 1) + (data_parallel_size > 1)
        most = (self.graph_stream_budget - ACL_STREAMS_PER_GROUP * groups) // (num_layers + 1) // (1 + 2 * groups)
        sizes = self.capture_sizes
        if most >= len(sizes):
            return self
        if most < 2:
            raise ValueError(f"graph mode: a {num_layers}-layer model under TP{tensor_parallel_size} x DP{data_parallel_size} "
                             f"leaves room for {max(most, 0)} ACL graph capture size(s) of {self.graph_stream_budget} streams "
                             f"(vllm-ascend's update_aclgraph_sizes), too few to start; run eagerly (--enforce-eager)")
        step = (len(sizes) - 1) / (most - 1)
        picked = [sizes[round(i * step)] for i in range(most)]
        picked[0], picked[-1] = sizes[0], sizes[-1]
        return replace(self, capture_sizes=tuple(picked), capped_from=self.capped_from or len(sizes))

    def in_graph(self, num_tokens: Num) -> Num:
        """1 where a step of ``num_tokens`` replays a captured graph, else 0."""
        if self.mode != "graph":
            return np.zeros_like(num_tokens, dtype=bool) if isinstance(num_tokens, np.ndarray) else False
        return (num_tokens > 0) & (num_tokens <= self.capture_sizes[-1])

    def padded_tokens(self, num_tokens: Num) -> Num:
        """The token count the GEMMs run at: the nearest captured size at or above it inside a graph."""
        if self.mode != "graph":
            return num_tokens
        sizes = np.asarray(self.capture_sizes, dtype=np.float64)
        index = np.minimum(np.searchsorted(sizes, num_tokens), sizes.size - 1)
        padded = np.where(self.in_graph(num_tokens), sizes[index], num_tokens)
        return padded if isinstance(num_tokens, np.ndarray) else float(padded)

    def step_seconds(self, device: Num, dispatch_calls: Num, host: Num, num_tokens: Num) -> tuple[Num, Num, Num]:
        """(total, dispatch stall, exposed host time) of a step from its kernels' device time, the
        kernels it dispatches and its host work. total = device + stall + exposed host."""
        if not any(isinstance(x, np.ndarray) for x in (device, dispatch_calls, host, num_tokens)):
            return self.one_step_seconds(device, dispatch_calls, host, num_tokens)
        dispatch = np.where(self.in_graph(num_tokens), 0.0, dispatch_calls * self.dispatch_s)
        execution = np.maximum(device, dispatch)
        exposed = np.maximum(host - execution, 0.0) if self.async_scheduling else host
        return execution + exposed, execution - device, exposed

    def one_step_seconds(self, device: float, dispatch_calls: float, host: float, num_tokens: float) -> tuple[float, float, float]:
        """:meth:`step_seconds` of one step: the same IEEE operations in plain floats, without numpy's per-call cost."""
        graph = self.mode == "graph" and 0 < num_tokens <= self.capture_sizes[-1]
        execution = max(device, 0.0 if graph else dispatch_calls * self.dispatch_s)
        exposed = max(host - execution, 0.0) if self.async_scheduling else host
        return float(execution + exposed), float(execution - device), float(exposed)


def parse_engine(table: dict, path: Path) -> EngineProfile:
    """An ``[engine]`` table of a device TOML; errors name the file and field."""
    allowed = {"mode", "dispatch_s", "capture_sizes", "async_scheduling", "request_s", "admit_s", "v0_seq_s", "stream_s",
               "graph_sizes_per_seq", "graph_stream_budget", "moe_chunk_tokens", "vllm_version", "source"}
    unknown = sorted(set(table) - allowed)
    if unknown:
        raise ValueError(f"{path}: unknown field(s) {', '.join('engine.' + k for k in unknown)} (allowed: {', '.join(sorted(allowed))})")
    for key in ("mode", "dispatch_s"):
        if key not in table:
            raise ValueError(f"{path}: missing field engine.{key}")
    sizes = table.get("capture_sizes", [])
    if not isinstance(sizes, list) or not all(isinstance(s, int) and not isinstance(s, bool) for s in sizes):
        raise ValueError(f"{path}: field engine.capture_sizes must be a list of integers, got {sizes!r}")
    for key in ("dispatch_s", "request_s", "admit_s", "v0_seq_s", "stream_s"):
        value = table.get(key, 0.0)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            raise ValueError(f"{path}: field engine.{key} must be a number >= 0, got {value!r}")
    for key in ("graph_sizes_per_seq", "graph_stream_budget", "moe_chunk_tokens"):
        value = table.get(key, 0)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{path}: field engine.{key} must be an integer >= 0, got {value!r}")
    if not isinstance(table.get("async_scheduling", False), bool):
        raise ValueError(f"{path}: field engine.async_scheduling must be true or false")
    version = table.get("vllm_version", "")
    try:
        if version != "":
            parse_version(str(version))
    except ValueError as exc:
        raise ValueError(f"{path}: field engine.{exc}") from None
    try:
        return EngineProfile(
            mode=str(table["mode"]),
            dispatch_s=float(table["dispatch_s"]),
            capture_sizes=tuple(sizes),
            async_scheduling=table.get("async_scheduling", False),
            request_s=float(table.get("request_s", 0.0)),
            admit_s=float(table.get("admit_s", 0.0)),
            v0_seq_s=float(table.get("v0_seq_s", 0.0)),
            stream_s=float(table.get("stream_s", 0.0)),
            graph_sizes_per_seq=table.get("graph_sizes_per_seq", 0),
            graph_stream_budget=table.get("graph_stream_budget", 0),
            moe_chunk_tokens=table.get("moe_chunk_tokens", 0),
            vllm_version=str(version),
            source=str(table.get("source", "")),
        )
    except ValueError as exc:
        raise ValueError(f"{path}: [engine]: {exc}") from None


def engine_toml_lines(engine: EngineProfile) -> list[str]:
    """The ``[engine]`` table that :func:`parse_engine` reads back equal to ``engine``."""
    return [
        "[engine]",
        f"mode = {toml_value(engine.mode)}",
        f"dispatch_s = {toml_value(engine.dispatch_s)}",
        f"capture_sizes = [{', '.join(str(s) for s in engine.capture_sizes)}]",
        f"async_scheduling = {toml_value(engine.async_scheduling)}",
        f"request_s = {toml_value(engine.request_s)}",
        f"admit_s = {toml_value(engine.admit_s)}",
        f"v0_seq_s = {toml_value(engine.v0_seq_s)}",
        f"stream_s = {toml_value(engine.stream_s)}",
        *([f"graph_sizes_per_seq = {engine.graph_sizes_per_seq}"] if engine.graph_sizes_per_seq else []),
        *([f"graph_stream_budget = {engine.graph_stream_budget}"] if engine.graph_stream_budget else []),
        *([f"moe_chunk_tokens = {engine.moe_chunk_tokens}"] if engine.moe_chunk_tokens else []),
        *([f"vllm_version = {toml_value(engine.vllm_version)}"] if engine.vllm_version else []),
        f"source = {toml_value(engine.source)}",
    ]
