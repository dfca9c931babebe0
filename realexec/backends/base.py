"""The kernel-backend interface every device path implements (npu, cuda, cpu).

Caches follow vllm-ascend's ND layout: per layer one key cache and one value cache, each
``[num_blocks, block_size, num_kv_heads, head_size]``. A token at position ``p`` of a
sequence lives at slot ``block_table[p // block_size] * block_size + p % block_size``.

Attention reads everything from the paged cache: the model writes the step's new K/V first
(``write_kv``), then ``attention`` lets each query token at position ``context_len + i``
attend to cache positions ``[0, context_len + i]`` of its own sequence (causal over the new
tokens, full over the cached prefix). One call covers prefill, chunked prefill (cached
prefix + new chunk), decode and mixed batches; metadata says which it is.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

import torch

from kvsim.policies.blocks import slot
from kvsim.realexec.backends.kv_quant import KVScales

if TYPE_CHECKING:
    from kvsim.realexec.model import MoeWeights

T = TypeVar("T")


@dataclass
class AttentionMetadata:
    """Per-step metadata shared by all layers (built once by the executor).

    Sequences are in plan order; queries are packed (TND): sequence ``b`` owns query rows
    ``query_start_loc[b]:query_start_loc[b+1]``.
    """

    query_start_loc: torch.Tensor  # int32 [B + 1], cumulative query lengths, on device
    seq_lens: torch.Tensor  # int32 [B], context after this step (cached + new), on device
    block_tables: torch.Tensor  # int32 [B, max_blocks_per_seq], padded with 0, on device
    slot_mapping: torch.Tensor  # int32 [T] (npu) or int64 [T], on device
    query_lens_list: list[int]  # host copies: kernels take these as Python lists
    seq_lens_list: list[int]
    block_size: int
    # Per-step values a backend derives from this metadata (padded gather indices, masks, kernel
    # plans). Every layer attends with the same metadata, so deriving them once per step instead
    # of once per layer is where the per-layer cost goes down; backends key it by their own name.
    scratch: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)
    # A captured graph's metadata (``realexec/graphs.py``): its device tensors are static buffers refilled
    # before each replay, and its host lists are the loaded step's, refilled in place. A CUDA graph bakes
    # whatever host values its kernels saw at capture, so the cuda/cpu paths read the device tensors alone;
    # the npu backend updates its captured attention tasks from the host lists before each replay.
    captured: bool = False

    @classmethod
    def build(
        cls,
        query_lens: Sequence[int],
        seq_lens: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        block_size: int,
        device: torch.device | str = "cpu",
        slot_dtype: torch.dtype = torch.int64,
    ) -> AttentionMetadata:
        """Metadata of one step from host lists: new tokens are each sequence's last ``query_lens[b]``.

        ``block_tables[b]`` lists the blocks of sequence ``b`` in order and must cover its
        ``seq_lens[b]`` tokens; rows are padded with block 0 to a common width.
        """
        if not (len(query_lens) == len(seq_lens) == len(block_tables)):
            raise ValueError(
                f"query_lens, seq_lens and block_tables disagree on the batch size: "
                f"{len(query_lens)}, {len(seq_lens)}, {len(block_tables)}"
            )
        for b, (q, s, row) in enumerate(zip(query_lens, seq_lens, block_tables)):
            if not 1 <= q <= s:
                raise ValueError(f"sequence {b}: need 1 <= query_len <= seq_len, got query_len={q}, seq_len={s}")
            if len(row) * block_size < s:
                raise ValueError(f"sequence {b}: {len(row)} blocks of {block_size} cannot hold seq_len={s}")
        width = max(len(row) for row in block_tables)
        tables = torch.zeros(len(block_tables), width, dtype=torch.int32)
        for b, row in enumerate(block_tables):
            tables[b, : len(row)] = torch.tensor(row, dtype=torch.int32)
        q_lens = torch.tensor(list(query_lens), dtype=torch.int64)
        s_lens = torch.tensor(list(seq_lens), dtype=torch.int64)
        seq_of_token = torch.repeat_interleave(torch.arange(len(q_lens)), q_lens)
        first_row = torch.cumsum(q_lens, 0) - q_lens
        positions = (s_lens - q_lens)[seq_of_token] + torch.arange(int(q_lens.sum())) - first_row[seq_of_token]
        slots = slot(tables[seq_of_token, positions // block_size].long(), positions % block_size, block_size)
        return cls(
            query_start_loc=torch.cat([q_lens.new_zeros(1), torch.cumsum(q_lens, 0)]).to(device, torch.int32),
            seq_lens=s_lens.to(device, torch.int32),
            block_tables=tables.to(device),
            slot_mapping=slots.to(device, slot_dtype),
            query_lens_list=list(query_lens),
            seq_lens_list=list(seq_lens),
            block_size=block_size,
        )

    def memo(self, key: str, derive: Callable[[], T]) -> T:
        """``derive()`` once per step: the first layer computes it, the others reuse it."""
        if key not in self.scratch:
            self.scratch[key] = derive()
        return self.scratch[key]

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_list)

    @property
    def is_decode_only(self) -> bool:
        return all(q == 1 for q in self.query_lens_list)

    @property
    def context_lens_list(self) -> list[int]:
        """Tokens already in the cache before this step's new ones."""
        return [s - q for s, q in zip(self.seq_lens_list, self.query_lens_list)]


class KernelBackend(ABC):
    """Device-specific paged-KV kernels. Stateless apart from the device it targets.

    A backend also owns the facts the rest of kvsim would otherwise branch on its name for:
    its clock, its kernels' limits, the bundled profile a calibration starts from, and what
    identifies the machine a profile was measured on.
    """

    name: str
    device: torch.device
    # What ``elapsed`` and ``host_time`` measure, as validation.json and the reports name it.
    clock: str = "device events (host overhead: wall clock)"
    # What an inconclusive verdict tells the user to do on this backend (realexec/validation.py). On an
    # H200 the small model's sub-millisecond graph steps, timed again, moved 5-28 % and an 8B model's
    # 1-2 % (docs/benchmarks.md, "Cross-validation on a GPU"), so a device backend points to longer steps.
    rerun_advice: ClassVar[str] = ("rerun it with other work on the machine stopped, or with a model whose steps take "
                                   "milliseconds (--model llama-3.1-8b): sub-millisecond steps time unsteadily")
    # The kernels reject a batch whose per-sequence block counts sum past the pool (FIA on Ascend).
    needs_batch_blocks_within_pool: ClassVar[bool] = False
    # Block sizes the paged kernels take, where they do not take the profiler's defaults.
    profile_block_sizes: ClassVar[tuple[int, ...] | None] = None
    # The dtypes attention kernels compute in, where not every float dtype (an int8 cache over an
    # fp32 model then attends in the last of these); None: any.
    attention_dtypes: ClassVar[tuple[torch.dtype, ...] | None] = None
    # Runs of each step's forward pass the executor times, keeping the median (``Executor``):
    # device events time one run precisely; a shared CPU does not.
    timing_repeats: int = 1
    # Whether ``new_graph`` captures steps (CUDA graphs); where not, the executor runs every step eagerly.
    supports_graphs: ClassVar[bool] = False
    # Token counts whose steps replay as captured graphs (``realexec/graphs.py``); empty: every step runs
    # eagerly. ``get_backend`` sets vLLM's sizes from the backend's bundled profile unless told --enforce-eager.
    capture_sizes: tuple[int, ...] = ()
    # The slot a captured step's padding rows write their K/V to: None, a slot of one block past the
    # engine's (no block table names it); -1 where the backend's write kernel skips such slots (vLLM's
    # PAD_SLOT_ID) and would leave the repeated slot a shared one gets undefined (the npu scatter).
    graph_pad_slot: ClassVar[int | None] = None
    # The ``torch.distributed`` backend a tensor-parallel group of this backend's ranks joins
    # (realexec/tp_executor.py): gloo between processes on the host, the device's collective library.
    process_group: ClassVar[str] = "gloo"

    def new_graph_pool(self) -> Any:
        """A new memory pool for one executor's graphs (``realexec.graphs.StepGraphs`` makes one).

        One pool an executor, not one a backend: a pool is counted by the graphs captured into
        it, and capturing into one whose graphs were all released (an executor gone, as the
        speed check's is before `kvsim validate`'s run captures) trips the CUDA caching
        allocator's ``use_count > 0`` assert (11 of 27 validate runs on an H200; vLLM PR 53682).
        """
        raise NotImplementedError(f"the {self.name} backend captures no graphs")

    def new_graph(self, pool: Any) -> Any:
        """An empty ``realexec.graphs.StepGraph`` to capture one step's forward pass in, in ``pool``."""
        raise NotImplementedError(f"the {self.name} backend captures no graphs")

    def device_count(self) -> int | None:
        """Devices this backend sees, each a tensor-parallel rank's; None where ranks are processes sharing one (cpu)."""
        return None

    def make_current(self) -> None:
        """Make this backend's device the process's current one, which a collective library binds its communicator to
        (nothing to do where ranks share the host)."""
        return None

    def host_time(self) -> float:
        """Seconds on the clock host overhead (building inputs, Python) is timed with."""
        return time.perf_counter()

    def default_profile(self) -> str:
        """The bundled device profile a calibration of this backend starts from (its roofs are kept)."""
        raise ValueError(f"no bundled profile for the {self.name} backend: pass --base-device NAME or a .toml path")

    def machine_name(self) -> str:
        """What runs the kernels, for a profile's ``source`` and the machine fingerprint."""
        return str(self.device)

    def fingerprint_parts(self) -> list[str]:
        """What must match for a profile measured earlier to describe this machine now."""
        return [self.name, self.machine_name(), torch.__version__, f"{torch.get_num_threads()} torch threads",
                *self.mode_parts()]

    def mode_parts(self) -> list[str]:
        """How steps run, for the fingerprint: graphs at which sizes (nothing when eager, as before graphs existed)."""
        return [f"graphs at {len(self.capture_sizes)} sizes up to {self.capture_sizes[-1]}"] if self.capture_sizes else []

    @abstractmethod
    def allocate_kv_cache(
        self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_size: int, dtype: torch.dtype,
        value_head_size: int | None = None,
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer (key_cache, value_cache), each [num_blocks, block_size, num_kv_heads, head_size] (int8 for C8).

        ``value_head_size`` sizes the value cache apart (MLA: the latent in the key cache, the rope key in the value cache).
        """

    @abstractmethod
    def allocate_host_cache(
        self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_size: int, dtype: torch.dtype,
        value_head_size: int | None = None,
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The swap pool: same layout in (pinned where the device supports it) host memory."""

    @abstractmethod
    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        kv_scales: KVScales | None = None,
    ) -> None:
        """Scatter new ``key``/``value`` [T, num_kv_heads, head_size] into the caches at ``slot_mapping`` [T].

        An int8 cache quantises on the way in with the layer's static ``kv_scales`` (``kv_quant``).
        """

    @abstractmethod
    def attention(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        kv_scales: KVScales | None = None,
    ) -> torch.Tensor:
        """Paged attention of ``query`` [T, num_heads, head_size] -> [T, num_heads, head_size].

        An int8 cache is dequantised with ``kv_scales``; the math runs in ``query.dtype``.
        """

    @abstractmethod
    def mla_attention(
        self,
        query: torch.Tensor,
        latent_cache: torch.Tensor,
        rope_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        w_uk: torch.Tensor,
        w_uv: torch.Tensor,
    ) -> torch.Tensor:
        """Paged multi-head latent attention (DeepSeek's MLA) of ``query`` [T, H, nope + rope] -> [T, H, v].

        The caches hold one latent [num_blocks, block_size, 1, kv_lora_rank] and one rope key
        [..., 1, rope] per token (written by ``write_kv``); ``w_uk`` [H, nope, kv_lora_rank] and ``w_uv``
        [H, v, kv_lora_rank] are the layer's up-projections (kv_b_proj). As vLLM's MLA backends run it:
        decode sequences absorb ``w_uk`` into the query and ``w_uv`` into the output and attend over the
        latents themselves (multi-query attention with one latent "head"); prefill sequences up-project
        the latents they read to per-head keys and values and attend over those.
        """

    @abstractmethod
    def moe_experts(self, hidden: torch.Tensor, router_logits: torch.Tensor, moe: MoeWeights, top_k: int) -> torch.Tensor:
        """An MoE layer's routed experts [T, hidden]: softmax top-k routing (``model.route``), each token
        through its experts' SwiGLU MLPs, the outputs weighted and summed back per token."""

    @abstractmethod
    def gather_kv(
        self, key_cache: torch.Tensor, value_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Contiguous K and V [sum(seq_lens), num_kv_heads, head_size] of each sequence, concatenated."""

    @abstractmethod
    def copy_blocks(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write: block ``src`` -> ``dst`` in every layer's key and value cache."""

    @abstractmethod
    def swap(
        self,
        src_caches: list[tuple[torch.Tensor, torch.Tensor]],
        dst_caches: list[tuple[torch.Tensor, torch.Tensor]],
        pairs: list[tuple[int, int]],
    ) -> None:
        """Copy blocks between device and host pools (either direction), block ``src`` -> ``dst``."""

    @abstractmethod
    def synchronize(self) -> None:
        """Wait for all queued device work."""

    @abstractmethod
    def memory_in_use(self) -> int:
        """Bytes the framework has allocated on the device (0 where it cannot be measured)."""

    @abstractmethod
    def elapsed(self, fn) -> tuple[object, float]:
        """Run ``fn()`` and return (its result, device seconds it took), measured with device events."""
