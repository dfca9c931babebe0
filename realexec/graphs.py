"""Steps replayed as captured graphs (CUDA graphs), as vLLM runs them.

vLLM captures the model's forward pass at a list of token counts (its capture sizes; V1's default
is 1, 2, 4, then 8 to 256 by 8, then 272 to 512 by 16) and replays the smallest captured graph
that holds a step, padding the step's tokens up to that size; larger steps run eagerly. The
executor does the same with the sizes of the device profile's ``[engine] capture_sizes``, the list
the cost model pads a graph step's GEMMs to (``sim/perf/engine_overhead.py``): one list for both.

Where it differs from vLLM, and why:

- A size is captured at its first step, on that step's own inputs, not at start-up on dummy
  ones: a forward pass is a pure function of the plan and the tokens so far, so the warm-up runs
  before capture write the very K/V into the very slots the replay then writes again. The graph
  is then launched once, untimed (``capture``), so the step's timed replay is not its first.
- Padding rows repeat the step's last token (its id, position and sequence) and write their K/V
  into a slot of one block past the engine's (``pad_slot``); vLLM points them at a slot its
  kernels skip, as the npu backend does (``KernelBackend.graph_pad_slot``: -1, which its scatter
  skips). Their attention is skipped, as vLLM's kernels skip padded rows (the cost model
  pads the GEMMs, not attention), so from the second layer on they no longer compute what the
  last token computes: their K/V must not land in its slot.
- The LM head and the argmax run outside the graph, on the sampling rows only, as vLLM's sampler does.

Attention inside a CUDA graph reads only device tensors (``AttentionMetadata.captured``): the
token-addressed path of ``backends/token_attention.py``. The captured metadata's host lists
(``query_lens_list``, ``seq_lens_list``) are the loaded step's, refilled in place by every ``load``:
a CUDA graph never reads them, while an ACL graph (``backends/npu.py``, as vllm-ascend runs it)
re-issues its attention tasks with them before each replay, since the NPU attention kernel takes its
sequence lengths as host arguments.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from kvsim.realexec.backends.base import AttentionMetadata, KernelBackend
from kvsim.realexec.backends.token_attention import TOKENS_KEY, TokenMetadata
from kvsim.realexec.model import Attend, DecoderModel
from kvsim.sim.perf.engine_overhead import EngineProfile


class StepGraph(Protocol):
    """One captured forward pass: ``capture`` records ``fn`` (after warm-up runs), ``replay`` reruns it."""

    def capture(self, fn: Callable[[], None]) -> None: ...

    def replay(self) -> None: ...


def capture(graph: StepGraph, fn: Callable[[], None]) -> None:
    """``graph.capture(fn)`` with Python's cyclic garbage collector paused, then one untimed replay.

    A graph's first launch is slower than the ones after it: on an H200 the first replay of each of
    16 newly captured prefill sizes took up to 1.13x its later replays on the small model (median
    1.06x) and up to 1.14x (1.6 ms) on Llama-3.1-8B (benchmarks/first_launch.py; likely the upload
    that CUDA does at a graph's first launch, on the stream the timing events read). vLLM captures
    every size at start-up, so its served steps replay warm graphs; this executor captures a size at
    its first step and the profiler captures many one-off graphs, so without the replay here every
    first step of a size, and every graph-timed operator case, would carry that launch. The replay
    reruns what the warm-up runs already ran on the same inputs, so it changes no result.

    A collection that runs during a capture may free a dead graph (the profiler makes hundreds of
    one-off graphs, and a released executor leaves its own): its destructor resets it on the
    capturing stream, which invalidates the capture. On an H200 a validate run measuring its second
    profile in one process died so (cudaErrorStreamCaptureInvalidated). vLLM freezes its collector
    around its captures for the same reason. The dead graphs go at the next collection instead.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        graph.capture(fn)
    finally:
        if enabled:
            gc.enable()
    graph.replay()


@dataclass
class GraphInputs:
    """A step's tokens as host lists, in the order the executor packs them."""

    input_ids: list[int]
    positions: list[int]
    slots: list[int]
    token_seq: list[int]  # each token's sequence (row of block_tables)
    block_tables: list[list[int]]
    query_lens: list[int]  # per sequence: its tokens in this step
    seq_lens: list[int]  # per sequence: its context after this step (cached + new)


class StepGraphs:
    """Static input buffers at the largest capture size and one graph per size used so far."""

    def __init__(
        self,
        backend: KernelBackend,
        model: DecoderModel,
        attend: Callable[[AttentionMetadata], Attend],
        capture_sizes: Sequence[int],
        max_blocks_per_seq: int,
        block_size: int,
        pad_slot: int,
    ) -> None:
        if not capture_sizes or list(capture_sizes) != sorted(set(capture_sizes)) or capture_sizes[0] < 1:
            raise ValueError(f"capture sizes must be positive, increasing and distinct, got {list(capture_sizes)}")
        self.backend, self.model, self.attend = backend, model, attend
        self.capture_sizes = tuple(capture_sizes)
        self.block_size = block_size
        self.pad_slot = pad_slot  # where padding rows write their K/V: a slot no block table names
        n, device = self.capture_sizes[-1], backend.device
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slots = torch.zeros(n, dtype=torch.int64, device=device)
        self.token_seq = torch.zeros(n, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(n, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.num_real = torch.zeros(1, dtype=torch.int32, device=device)  # tokens of the loaded step before its padding
        self.hidden = torch.zeros(n, model.spec.hidden_size, dtype=model.dtype, device=device)
        # The loaded step's per-sequence lengths, the captured metadata's host lists (refilled in place).
        self.query_lens: list[int] = []
        self.seq_lens: list[int] = []
        self._graphs: dict[int, StepGraph] = {}
        self.pool = backend.new_graph_pool()  # these graphs' own, so none is captured into a pool whose graphs are gone

    def size_for(self, num_tokens: int) -> int | None:
        """The captured size a step of ``num_tokens`` replays at (None: larger than any, so eager)."""
        return next((s for s in self.capture_sizes if s >= num_tokens), None) if num_tokens > 0 else None

    @property
    def captured_sizes(self) -> list[int]:
        return sorted(self._graphs)

    def load(self, step: GraphInputs, size: int) -> None:
        """Copy a step's inputs into the static buffers, padded to ``size`` with its last token (its K/V to ``pad_slot``)."""
        pad = size - len(step.input_ids)
        width = max(len(t) for t in step.block_tables)
        if pad < 0 or width > self.block_tables.shape[1] or len(step.block_tables) > size:
            raise ValueError(f"a step of {len(step.input_ids)} tokens and {width} blocks a sequence does not fit graph size {size}")

        def fill(buffer: torch.Tensor, values: list[int], padding: int) -> None:
            host = torch.tensor(values + [padding] * pad, dtype=buffer.dtype)
            buffer[:size].copy_(host, non_blocking=True)

        fill(self.input_ids, step.input_ids, step.input_ids[-1])
        fill(self.positions, step.positions, step.positions[-1])
        fill(self.slots, step.slots, self.pad_slot)
        fill(self.token_seq, step.token_seq, step.token_seq[-1])
        self.num_real.fill_(len(step.input_ids))
        self.query_lens[:], self.seq_lens[:] = step.query_lens, step.seq_lens
        tables = torch.tensor([t + [0] * (width - len(t)) for t in step.block_tables], dtype=torch.int32)
        self.block_tables[: len(tables), :width].copy_(tables, non_blocking=True)

    def ensure_captured(self, size: int) -> None:
        """Capture ``size`` on the inputs now loaded, if it has no graph yet (outside any timing)."""
        if size not in self._graphs:
            graph = self.backend.new_graph(self.pool)
            capture(graph, self._forward(size))
            self._graphs[size] = graph

    def replay(self, size: int) -> torch.Tensor:
        """The residual stream [size, hidden] of the loaded step (rows past its tokens are padding)."""
        self._graphs[size].replay()
        return self.hidden[:size]

    def _forward(self, size: int) -> Callable[[], None]:
        meta = AttentionMetadata(
            query_start_loc=self.token_seq[:0],
            seq_lens=self.token_seq[:0],
            block_tables=self.block_tables,
            slot_mapping=self.slots[:size],
            query_lens_list=self.query_lens,
            seq_lens_list=self.seq_lens,
            block_size=self.block_size,
            captured=True,
        )
        meta.scratch[TOKENS_KEY] = TokenMetadata(self.token_seq[:size], self.positions[:size], self.block_tables, self.num_real)
        attend = self.attend(meta)
        ids, positions, hidden = self.input_ids[:size], self.positions[:size], self.hidden[:size]

        def forward() -> None:
            hidden.copy_(self.model.forward(ids, positions, attend))

        return forward


def engine_of(graphs: StepGraphs | None) -> EngineProfile | None:
    """How an executor runs steps, as a calibrated profile's ``[engine]``.

    With graphs: graph mode at the executor's capture sizes and no per-kernel dispatch, since
    the profiler times a graph step's operators replayed as graphs too, so their fitted per-call
    costs are the kernels' own. Eager (None): kernels and host work add up, and the fitted
    per-call costs hold the launches, as measured.
    """
    if graphs is None:
        return None
    return EngineProfile(mode="graph", dispatch_s=0.0, capture_sizes=graphs.capture_sizes,
                         source="the executor's captured graphs (kvsim profile)")
