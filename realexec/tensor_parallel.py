"""Tensor parallelism in the real executor: one rank's shard of the weights, and the collectives it runs.

vLLM's Megatron-style split (``vllm/model_executor/layers/linear.py``, ``vocab_parallel_embedding.py``),
which vllm-ascend keeps:

- **column-parallel** (each rank a slice of the output rows): q/k/v by attention head, gate/up by
  MLP column, every routed and shared expert's gate/up likewise (no expert parallelism), MLA's
  ``q_proj`` / ``q_b_proj`` and ``kv_b_proj`` by head; KV heads are replicated when TP exceeds
  them (rank r keeps head ``r // (tp / kv_heads)``);
- **row-parallel** (each rank a slice of the input columns, its partial output summed by an
  all-reduce): ``o_proj`` and ``down_proj``;
- **vocabulary-parallel**: the embedding and the LM head split by vocabulary rows (padded to an equal
  share); a rank embeds the tokens its rows hold and an all-reduce adds the ranks' rows, and each
  rank's logits are all-gathered, so every rank samples the same greedy token (vLLM V1);
- **replicated**: norms, the MoE router, MLA's latent projections (``q_a_proj``, ``kv_a_proj_with_mqa``
  and their norms): the latent cache has no heads to split;
- **expert-parallel** (``--enable-expert-parallel``, EP over the TP ranks as vLLM's ``FusedMoE``
  with an expert map): rank r holds whole experts ``r E/ep`` to ``(r+1) E/ep - 1``, renumbered
  from 0, and the whole router; every rank routes every token over all experts, runs the pairs
  its experts were chosen for, and the layer's all-reduce adds the ranks' parts (with one DP
  member every rank holds the same tokens, so vLLM needs no all-to-all either).

The rank's shapes are those of ``sim.parallel.layout.rank_model``, the model the simulator prices
one rank by, so the two worlds agree on what a rank holds (``shard_weights`` checks it).

On an accelerator the ranks join the device's collective library's group (the backend's
``process_group``: NCCL for cuda, HCCL for npu, torch_npu's registration), one device a rank, and
its collectives run on the devices. On the cpu backend they join a gloo group, whose collectives
run over loopback TCP on gloo's own threads; on the 2-core development VM a 3 KB all-reduce then
took 0.7-2.5 ms, its median moving 2x from one set of runs to the next, as the ranks' main threads
and gloo's contend for two cores.
vLLM's CPU backend all-reduces through shared memory instead (``CpuCommunicator``'s shm path on
x86), and so does :class:`SharedMemoryGroup`, the default: each rank writes its tensor into its
slot of a shared buffer, raises its sequence number, waits (spinning, yielding the core) for the
others' and sums the slots in rank order, so every rank ends with the same bits.
"""

from __future__ import annotations

import math
import os
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from kvsim.realexec.backends.base import KernelBackend
from kvsim.sim.parallel.layout import ParallelLayout, rank_model
from kvsim.sim.perf.model_spec import ModelSpec

# A collective that waits this long has lost its peer (a worker that died closes its sockets sooner).
COLLECTIVE_TIMEOUT = timedelta(seconds=120)

_VOCAB = ("model.embed_tokens.weight", "lm_head.weight")
_ROW_PARALLEL = ("o_proj.weight", "down_proj.weight")
_COLUMN_PARALLEL = ("q_proj.weight", "q_b_proj.weight", "kv_b_proj.weight", "gate_proj.weight", "up_proj.weight")
_KV_HEADS = ("k_proj.weight", "v_proj.weight")
_EXPERT = re.compile(r"(model\.layers\.\d+\.mlp\.experts\.)(\d+)(\..*)")


TRANSPORTS = ("shm", "gloo")
# Values of one rank's slot in the shared buffer (4 MiB of fp32): a larger tensor goes through in pieces.
SLOT_VALUES = 1 << 20


def transport() -> str:
    """How the ranks' collectives move data (``KVSIM_TP_TRANSPORT``: shm, the default, or gloo)."""
    name = os.environ.get("KVSIM_TP_TRANSPORT", "shm")
    if name not in TRANSPORTS:
        raise ValueError(f"KVSIM_TP_TRANSPORT must be one of {', '.join(TRANSPORTS)}, not {name!r}")
    return name


@dataclass
class TensorParallelGroup:
    """This process's place in a tensor-parallel group joined by ``torch.distributed``; the group's own collectives."""

    rank: int
    size: int
    expert_parallel: bool = False

    @property
    def layout(self) -> ParallelLayout:
        return ParallelLayout(tensor_parallel_size=self.size, enable_expert_parallel=self.expert_parallel)

    def rank_spec(self, spec: ModelSpec) -> ModelSpec:
        """What one rank of this group holds of ``spec``: the simulator's ``rank_model``."""
        return rank_model(spec, self.layout)

    def first_expert(self, experts_here: int) -> int:
        """The global id of this rank's first routed expert, when each rank holds ``experts_here`` (0 without EP)."""
        return self.rank * experts_here if self.expert_parallel else 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over ranks of ``x`` (in place, returned for chaining)."""
        dist.all_reduce(x)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """The ranks' ``x`` side by side along the last dimension, in rank order."""
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=-1)


@dataclass(frozen=True)
class SharedBuffers:
    """The shared memory a :class:`SharedMemoryGroup` exchanges through, made by rank 0 before the workers start
    (torch's shared tensors cross to a spawned process by file descriptor)."""

    slots: torch.Tensor  # [2 alternating rounds, ranks, SLOT_VALUES] fp32
    sequence: torch.Tensor  # [ranks] int64: the last round each rank has written

    @classmethod
    def make(cls, size: int, slot_values: int = SLOT_VALUES) -> SharedBuffers:
        return cls(torch.zeros(2, size, slot_values).share_memory_(), torch.zeros(size, dtype=torch.int64).share_memory_())


@dataclass
class SharedMemoryGroup(TensorParallelGroup):
    """Collectives through shared memory (module docstring). Two alternating rounds make one wait per
    collective enough: a rank writes round k + 2's slot only after every rank has announced round k + 1,
    and a rank announces k + 1 only after it has read round k. x86's store order keeps a slot's values
    visible before the sequence number that announces them."""

    buffers: SharedBuffers | None = None
    _round: int = 0
    _announced: np.ndarray = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._announced = self.buffers.sequence.numpy()

    def _exchange(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's ``x`` (flattened, at most a slot), [ranks, numel]: a view valid until this rank's next round but one."""
        self._round += 1
        round_slots = self.buffers.slots[self._round % 2, :, : x.numel()]
        round_slots[self.rank].copy_(x.reshape(-1))
        self._announced[self.rank] = self._round
        for other in range(self.size):
            spins, deadline = 0, None
            while self._announced[other] < self._round:
                os.sched_yield()
                spins += 1
                if spins % 4096 == 0:  # a peer that stopped (an error, a killed process) never announces
                    deadline = deadline or time.monotonic() + COLLECTIVE_TIMEOUT.total_seconds()
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"tensor-parallel rank {other} did not reach collective {self._round} within "
                                           f"{COLLECTIVE_TIMEOUT.total_seconds():.0f} s (its process stopped?)")
        return round_slots

    def _pieces(self, x: torch.Tensor) -> list[torch.Tensor]:
        flat = x.reshape(-1)
        step = self.buffers.slots.shape[2]
        return [flat[i : i + step] for i in range(0, max(flat.numel(), 1), step)]

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32 or not x.is_contiguous():  # the slots hold fp32, written from a flat view
            return x.copy_(self.all_reduce(x.float().contiguous()))
        for piece in self._pieces(x):
            piece.copy_(self._exchange(piece).sum(0))
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32:
            return self.all_gather_last(x.float()).to(x.dtype)
        if x.numel() > self.buffers.slots.shape[2]:
            return super().all_gather_last(x)  # gloo's: the logits of more rows than a slot holds
        parts = self._exchange(x.contiguous()).reshape(self.size, *x.shape)
        return torch.cat(list(parts), dim=-1)


def join_group(rank: int, size: int, port: int, backend: KernelBackend, buffers: SharedBuffers | None = None,
               expert_parallel: bool = False) -> TensorParallelGroup:
    """Join the group of ``size`` processes on this host (rank 0 listens on ``port``) through ``backend``'s
    collective library, on its device; the collectives through ``buffers`` (shared memory) when given."""
    backend.make_current()
    dist.init_process_group(backend.process_group, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size,
                            timeout=COLLECTIVE_TIMEOUT)
    if buffers is None:
        return TensorParallelGroup(rank, size, expert_parallel)
    return SharedMemoryGroup(rank, size, expert_parallel, buffers)


def leave_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def vocab_rows(spec: ModelSpec, tp: int) -> int:
    """Vocabulary rows each rank holds (the last rank's share padded with zero rows)."""
    return math.ceil(spec.vocab_size / tp)


def shard(spec: ModelSpec, name: str, full: torch.Tensor, group: TensorParallelGroup) -> torch.Tensor:
    """Rank ``group.rank``'s part of the full tensor ``name`` (module docstring); a copy, contiguous.
    Under expert parallelism a routed expert's tensors go whole to the rank that holds the expert."""
    tp, r = group.size, group.rank
    if tp == 1 or (group.expert_parallel and _EXPERT.fullmatch(name)):
        return full
    if name in _VOCAB:
        rows = vocab_rows(spec, tp)
        part = full[r * rows : (r + 1) * rows]
        if part.shape[0] < rows:
            part = torch.cat([part, part.new_zeros(rows - part.shape[0], *part.shape[1:])])
        return part.contiguous()
    if name.endswith(_KV_HEADS):
        kv = spec.num_kv_heads
        heads = full.view(kv, spec.head_dim, -1)
        if tp > kv:  # replicated: each rank keeps the one head its query heads read
            return heads[r // (tp // kv)].clone()
        return heads.chunk(tp)[r].reshape(-1, full.shape[1]).contiguous()
    if name.endswith(_COLUMN_PARALLEL):
        return full.chunk(tp, dim=0)[r].contiguous()
    if name.endswith(_ROW_PARALLEL):
        return full.chunk(tp, dim=1)[r].contiguous()
    return full  # norms, the router, MLA's latent projections: every rank holds all of it


def shard_weights(spec: ModelSpec, weights: Iterator[tuple[str, torch.Tensor]], group: TensorParallelGroup) -> dict[str, torch.Tensor]:
    """The rank's weights by checkpoint name, each sharded as it arrives (the full model is never held
    at once), checked against the shapes of ``rank_model``: what the simulator prices a rank by."""
    from kvsim.realexec.weights import weight_shapes

    expected = weight_shapes(group.rank_spec(spec))
    out: dict[str, torch.Tensor] = {}
    local = group.rank_spec(spec).num_experts
    first = group.first_expert(local)
    for name, full in weights:
        if group.expert_parallel:
            expert = _EXPERT.fullmatch(name)
            if expert and not first <= int(expert[2]) < first + local:
                continue  # another rank's expert
            if expert:
                name = f"{expert[1]}{int(expert[2]) - first}{expert[3]}"
        part = shard(spec, name, full, group)
        if tuple(part.shape) != expected[name]:
            raise ValueError(f"tensor-parallel shard of {name!r}: shape {tuple(part.shape)}, the rank's model "
                             f"expects {expected[name]}")
        out[name] = part
    return out
