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
  eagerly (vLLM captures no graph for them).
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

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvsim.sim.toml_io import toml_value

Num = float | np.ndarray

MODES = ("eager", "graph")


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
    source: str = ""

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"engine mode must be one of {MODES}, got {self.mode!r}")
        if self.mode == "graph" and not self.capture_sizes:
            raise ValueError("graph mode needs capture_sizes")
        if any(s <= 0 for s in self.capture_sizes) or list(self.capture_sizes) != sorted(set(self.capture_sizes)):
            raise ValueError(f"capture_sizes must be positive, increasing and distinct, got {list(self.capture_sizes)}")
        if min(self.dispatch_s, self.request_s, self.admit_s, self.v0_seq_s, self.stream_s) < 0:
            raise ValueError("dispatch_s, request_s, admit_s, v0_seq_s and stream_s must be >= 0")

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
    allowed = {"mode", "dispatch_s", "capture_sizes", "async_scheduling", "request_s", "admit_s", "v0_seq_s", "stream_s", "source"}
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
    if not isinstance(table.get("async_scheduling", False), bool):
        raise ValueError(f"{path}: field engine.async_scheduling must be true or false")
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
        f"source = {toml_value(engine.source)}",
    ]
