"""ACLGraph for the npu backend: decode (and every other step a capture size holds) replayed as vllm-ascend does.

What vllm-ascend does (vllm-project/vllm-ascend at 182b75e; its developer guide
``docs/source/developer_guide/Design_Documents/ACL_Graph.md`` and user guide
``docs/source/user_guide/feature_guide/graph_mode.md``):

- ``vllm_ascend/compilation/acl_graph.py`` (``ACLGraphWrapper``) captures a forward pass per batch
  size with ``torch.npu.NPUGraph()`` inside ``torch.npu.graph(aclgraph, pool=graph_pool)``, every
  size sharing one pool, and replays it with ``aclgraph.replay()`` after synchronising the current
  stream. The default ``cudagraph_mode`` (FULL_AND_PIECEWISE) replays uniform decode batches as FULL
  graphs (the whole forward pass, attention included) and mixed batches piecewise; its attention
  backend ``attention_v1`` declares FULL graphs for mixed batches too (``ALWAYS``).
- The attention kernel, ``npu_fused_infer_attention_score`` (FIA), takes its per-step sequence
  lengths (``actual_seq_lengths``, ``actual_seq_lengths_kv``) as host int lists, which a graph would
  bake in at capture. ``vllm_ascend/attention/attention_v1.py`` therefore captures each FIA call on
  its own (``full_graph_fia``): an ``torch.npu.ExternalEvent`` the graph waits on and resets, the
  workspace from ``torch_npu._npu_fused_infer_attention_score_get_max_workspace`` (kept per size),
  then ``torch.npu.graph_task_group_begin(stream)``, ``torch_npu.npu_fused_infer_attention_score.out(...,
  workspace=, out=[output, softmax_lse])``, and ``handle = torch.npu.graph_task_group_end(stream)``.
  Before each replay, ``update_graph_params`` re-issues every captured call with the step's lengths
  and block table inside ``torch.npu.graph_task_update_begin(update_stream, handle)`` /
  ``graph_task_update_end(update_stream)`` on a separate update stream, then records the event.
  (vllm-ascend issues the update after launching the replay, which waits on the event; with
  ``enable_enpu`` it updates first. Here the update comes first, after a synchronize, as there.)
- Padding: the step's query is padded to the graph size and one dummy request covers the padding
  rows (so FIA's TND ``actual_seq_lengths`` ends at the padded row count); its output is dropped
  and padding tokens write no K/V (slot -1, which the cache-write kernel skips).

What this module does: ``NpuStepGraph`` is the ``realexec.graphs.StepGraph`` the executor captures
and replays; ``graph_attention`` is the backend's attention inside a graph: FIA over the step's
TND query, run directly during the warm-up runs and captured as an updatable task group during
capture; ``NpuStepGraph.replay`` updates every task from the captured metadata's host lists (the
loaded step's, ``realexec/graphs.py``) and replays. Differences from vllm-ascend: the dummy request
attends over as many positions as it has rows (vllm-ascend gives it one) because a query longer
than its context under causal ``sparse_mode=3`` is undefined by FIA's documentation, and its block
table row holds whatever ids the static buffer's row last held (zeros at first; vllm-ascend zeroes it):
it reads, never writes. At the 910B profiles' capture sizes a step is padded by at most 15 rows, so
with FIA's block sizes (128 and up) the dummy request adds one block to the batch's block count,
which FIA requires to stay within the cache's blocks: the one block the executor reserves past the
engine's when it runs graphs. All of it is tested only through the stand-in (``tests/torch_npu_standin.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import accumulate
from typing import TYPE_CHECKING, Any

import torch

from kvsim.realexec.backends.base import AttentionMetadata

if TYPE_CHECKING:
    from kvsim.realexec.backends.npu import NpuBackend


@dataclass
class AttentionTask:
    """One FIA call captured as a task group: what an update re-issues, and the step lengths it reads."""

    meta: AttentionMetadata  # the graph's captured metadata: its host lists are the loaded step's
    fixed: dict[str, Any]  # the call's arguments that no step changes (tensors at static addresses, scalars)
    out: torch.Tensor  # attention output [rows, heads, head_size]
    softmax_lse: torch.Tensor
    workspace: torch.Tensor
    handle: Any = None  # from torch.npu.graph_task_group_end
    event: Any = None  # the torch.npu.ExternalEvent the graph waits on before the task

    def step_args(self) -> dict[str, Any]:
        """The loaded step's block table and lengths, padded to the graph's rows by one dummy request."""
        return fia_step_args(self.meta, self.out.shape[0])

    def call(self, torch_npu: Any) -> None:
        torch_npu.npu_fused_infer_attention_score.out(
            **self.fixed, **self.step_args(), workspace=self.workspace, out=[self.out, self.softmax_lse]
        )


def fia_step_args(meta: AttentionMetadata, rows: int) -> dict[str, Any]:
    """FIA's per-step arguments for a query of ``rows`` packed tokens (TND), padding rows as one dummy request.

    The dummy request attends over ``pad`` positions of the block-table row after the step's
    sequences (its output is dropped), so every query row belongs to a request and the lengths stay
    within FIA's rules: the last cumulative query end equals the row count, no query is longer than
    its context.
    """
    query_lens, seq_lens = meta.query_lens_list, meta.seq_lens_list
    pad = rows - sum(query_lens)
    if pad < 0:
        raise ValueError(f"a step of {sum(query_lens)} tokens does not fit a graph of {rows} rows")
    ends, kv_lens = list(accumulate(query_lens)), list(seq_lens)
    if pad:
        ends.append(rows)
        kv_lens.append(pad)
    return dict(block_table=meta.block_tables[: len(ends)], actual_seq_lengths=ends, actual_seq_lengths_kv=kv_lens)


def graph_attention(
    backend: NpuBackend, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
    meta: AttentionMetadata, scale: float,
) -> torch.Tensor:
    """FIA over a captured step (``meta.captured``): run now during warm-up, captured as a task group under capture."""
    tnpu, npu = backend.torch_npu, backend.torch_npu.npu
    num_blocks, block_size, num_kv_heads, _ = key_cache.shape
    fixed = dict(
        query=query,
        key=key_cache.view(num_blocks, block_size, -1),
        value=value_cache.view(num_blocks, block_size, -1),
        atten_mask=backend._mask(),
        input_layout="TND",
        block_size=block_size,
        num_key_value_heads=num_kv_heads,
        num_heads=query.shape[1],
        scale=scale,
        sparse_mode=3,
    )
    workspace = tnpu._npu_fused_infer_attention_score_get_max_workspace(**fixed, **fia_step_args(meta, query.shape[0]))
    task = AttentionTask(meta, fixed, out=torch.empty_like(query),
                         softmax_lse=torch.empty(1, dtype=query.dtype, device=query.device), workspace=workspace)
    recording = backend.recording_tasks
    if recording is None:  # a warm-up run before capture: the kernel runs with this step's lengths
        task.call(tnpu)
        return task.out
    stream = npu.current_stream()
    task.event = npu.ExternalEvent()
    task.event.wait(stream)  # captured: each replay waits until the update stream has re-issued the task
    task.event.reset(stream)
    npu.graph_task_group_begin(stream)
    task.call(tnpu)
    task.handle = npu.graph_task_group_end(stream)
    recording.append(task)
    return task.out


@dataclass
class NpuStepGraph:
    """A ``realexec.graphs.StepGraph`` on an ACL graph (``torch.npu.NPUGraph``); in its executor's memory pool."""

    backend: NpuBackend
    pool: Any
    graph: Any = None
    tasks: list[AttentionTask] = field(default_factory=list)

    WARMUP_RUNS = 2  # on a side stream before capture, as torch's capture recipe asks (lazy init, workspaces)

    def capture(self, fn: Callable[[], None]) -> None:
        npu = self.backend.torch_npu.npu
        side = npu.Stream()
        side.wait_stream(npu.current_stream())
        with npu.stream(side):
            for _ in range(self.WARMUP_RUNS):
                fn()
        npu.current_stream().wait_stream(side)
        self.graph = npu.NPUGraph()
        self.backend.recording_tasks = self.tasks
        try:
            with npu.graph(self.graph, pool=self.pool):
                fn()
        finally:
            self.backend.recording_tasks = None

    def replay(self) -> None:
        """Re-issue every captured attention task with the loaded step's lengths, then replay.

        The synchronize keeps an update from landing while the previous replay still reads the
        task (ACLGraphWrapper synchronises before every replay for the same reason).
        """
        tnpu, npu = self.backend.torch_npu, self.backend.torch_npu.npu
        npu.current_stream().synchronize()
        if self.tasks:
            update_stream = self.backend.update_stream()
            with npu.stream(update_stream):
                for task in self.tasks:
                    npu.graph_task_update_begin(update_stream, task.handle)
                    task.call(tnpu)
                    npu.graph_task_update_end(update_stream)
                    task.event.record(update_stream)
        self.graph.replay()
