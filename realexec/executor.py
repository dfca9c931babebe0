"""The real step timer: runs each StepPlan through the paged decoder on a backend and measures it.

The engine decides everything (batch, positions, blocks, slots, swaps, copies, forks); the
executor only carries the plan out and owns what the engine does not track: token ids. Its
per-request token list (prompt + generated) is the truth a plan's positions index into, so a
request re-planned from position 0 after a recompute preemption is fed the very same tokens.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from kvsim.policies.blocks import cdiv
from kvsim.policies.plan import PlanDetail, PlanEntry, StepPlan
from kvsim.policies.request import Request
from kvsim.realexec.backends.base import AttentionMetadata, KernelBackend
from kvsim.realexec.backends.kv_quant import KVScales
from kvsim.realexec.graphs import GraphInputs, StepGraphs
from kvsim.realexec.model import Attend, DecoderModel, calibrate_kv_scales, kv_cache_dtypes
from kvsim.realexec.prompts import prompt_tokens
from kvsim.realexec.tensor_parallel import TensorParallelGroup
from kvsim.sim.perf.model_spec import ModelSpec
from kvsim.sim.perf.step_timer import StepTiming

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]


def kv_cache_layout(spec: ModelSpec) -> tuple[int, int, int]:
    """(heads, key cache size, value cache size) of one token's entry in a layer's paged pool.

    Per-head attention caches K and V for every KV head. Latent attention (MLA) caches one latent
    and one rope key per token, the pair vLLM's MLA backends keep (vllm-ascend as two caches, a
    no-rope and a rope one): ``kv_lora_rank + qk_rope_head_dim`` values, so a block holds exactly
    what ``ModelSpec.bytes_per_block`` counts.
    """
    if spec.is_mla:
        return 1, spec.kv_lora_rank, spec.qk_rope_head_dim
    return spec.num_kv_heads, spec.head_dim, spec.head_dim


@dataclass
class StepInputs:
    """Device tensors for one forward pass, plus which requests sample from which rows."""

    input_ids: torch.Tensor  # int64 [T]
    positions: torch.Tensor  # int64 [T]
    meta: AttentionMetadata
    sample_rows: torch.Tensor  # int64 [S]: the last new token of each sampling entry
    sampling_ids: list[str]  # request id of each sample row


@dataclass
class HostInputs:
    """A step's inputs as host lists: what both the eager path and a graph's buffers are built from."""

    graph_inputs: GraphInputs
    query_start: list[int]  # cumulative query lengths, [B + 1]
    sample_rows: list[int]
    sampling_ids: list[str]


@dataclass
class TimedPass:
    """One run of a step's forward pass: its greedy samples and its time on the backend's clock."""

    sampled: torch.Tensor  # int64 [S]
    sampling_ids: list[str]
    host_s: float
    forward_s: float


class Executor:
    """Implements ``sim.perf.step_timer.StepTimer`` on a real device.

    ``check=True`` verifies each plan against the block tables it carries (slot mapping, block
    ids in range) before running it; off by default so it never inflates measured host time.

    A step's duration is measured on the backend's clock (``backend.clock``: device events, or
    CPU time on the cpu backend); its wall-clock time is kept beside it in ``wall_s``.

    ``timing_repeats`` (default: the backend's ``timing_repeats``) runs a step's forward pass
    that many times and keeps the run of median duration: the pass is a pure function of the
    plan and the tokens so far (it writes the same K/V into the same slots and samples the same
    greedy tokens every time), so repeating it changes nothing but the precision of the time.
    A CPU shared with other tenants times one run of a few milliseconds with 8-30 % noise
    (docs/benchmarks.md); the median of the repeats is the estimate the profiler fits its cases on.
    Block moves (swap, copy) run once: they are not idempotent when a plan reuses a block.
    The first run's time alone is kept in ``single_run_s``.

    ``keep_plans`` keeps every timed step's plan so that :meth:`retime` can time the run's
    steps again once it is over: a second measurement of each step minutes after the first,
    which is how ``kvsim validate`` measures the machine's repeatability (realexec/repeatability.py).

    ``capture_sizes`` (None: the backend's) replays every step of at most the largest size as a
    captured graph padded to the next size, as vLLM does (``realexec/graphs.py``); empty, or an
    int8 cache (the graph's attention path takes float caches): every step runs eagerly.

    ``tp``: this process is one rank of a tensor-parallel group (realexec/tp_executor.py starts
    the group): its model is the rank's shard and its cache holds the rank's KV heads; every rank
    must be handed the same requests and plans, in the same order, since each pass runs collectives.
    """

    plan_detail = PlanDetail.SLOTS  # the StepTimer's: it runs every token at its slot

    def __init__(
        self,
        spec: ModelSpec,
        backend: KernelBackend,
        num_blocks: int,
        block_size: int,
        num_host_blocks: int = 0,
        seed: int = 0,
        weights_path: str | Path | None = None,
        kv_dtype: str | None = None,
        check: bool = False,
        timing_repeats: int | None = None,
        capture_sizes: Sequence[int] | None = None,
        keep_plans: bool = False,
        tp: TensorParallelGroup | None = None,
    ) -> None:
        self.spec = spec
        self.backend = backend
        self.num_blocks = num_blocks
        self.num_host_blocks = num_host_blocks
        self.block_size = block_size
        self.seed = seed
        self.check = check
        self.timing_repeats = backend.timing_repeats if timing_repeats is None else timing_repeats
        if self.timing_repeats < 1:
            raise ValueError(f"timing_repeats must be at least 1, not {self.timing_repeats}")
        if spec.quantization:
            raise ValueError(f"model {spec.name}: quantization {spec.quantization} (W8A8) is simulated only; realexec runs "
                             "float weights (drop --quantization to run it)")
        if spec.is_mla and (kv_dtype or spec.kv_dtype) == "int8":
            raise ValueError(f"model {spec.name}: an int8 KV cache under latent attention (MLA) is not implemented "
                             "by realexec (its static scales are per K/V channel); use a float KV cache")
        self.model = DecoderModel.build(spec, backend.device, seed, weights_path, tp)
        # int8 (C8): quantised cache, attention in the model's dtype, static per-channel scales per layer.
        self.kv_dtype, self.attention_dtype = kv_cache_dtypes(
            kv_dtype or spec.kv_dtype, self.model.dtype, backend.attention_dtypes
        )
        self.kv_scales: list[KVScales | None] = (
            calibrate_kv_scales(self.model, seed) if self.kv_dtype == torch.int8 else [None] * spec.num_layers
        )
        capture_sizes = backend.capture_sizes if capture_sizes is None else capture_sizes
        # MoE routing sizes each expert's GEMMs by the step's data and MLA splits decodes from prefills by
        # the host lists, so neither replays as a fixed-shape graph: such models run every step eagerly, as a
        # tensor-parallel rank does (its collectives wait on other processes, which no graph captures).
        graphs = (bool(capture_sizes) and backend.supports_graphs and self.kv_dtype != torch.int8
                  and not spec.is_moe and not spec.is_mla and tp is None)
        # With graphs, one block past the engine's takes the K/V of a graph's padding rows (vLLM's V1
        # reserves a null block likewise); everything else sees the engine's blocks alone.
        heads, key_size, value_size = kv_cache_layout(self.model.spec)  # a TP rank caches its own heads
        shape = (spec.num_layers, num_blocks + graphs, block_size, heads, key_size, self.kv_dtype, value_size)
        self._all_caches: KVCaches = backend.allocate_kv_cache(*shape)
        self.kv_caches: KVCaches = [(k[:num_blocks], v[:num_blocks]) for k, v in self._all_caches]
        host_shape = (spec.num_layers, num_host_blocks, *shape[2:])
        self.host_caches: KVCaches = backend.allocate_host_cache(*host_shape) if num_host_blocks else []
        self.graphs = (
            StepGraphs(backend, self.model, lambda meta: self._paged_attend(meta, self._all_caches), capture_sizes,
                       min(num_blocks, cdiv(spec.max_position, block_size)), block_size,
                       pad_slot=num_blocks * block_size if backend.graph_pad_slot is None else backend.graph_pad_slot)
            if graphs else None
        )
        self._tokens: dict[str, list[int]] = {}  # prompt + generated, per request
        self._prompt_lens: dict[str, int] = {}
        self.wall_s: list[float] = []  # wall-clock seconds of every step run, in order (first run of its pass)
        self.single_run_s: list[float] = []  # every step's duration from its pass's first run alone
        self.kept_plans: list[tuple[StepPlan, float]] | None = [] if keep_plans else None  # (plan, its block moves' seconds)
        self._retiming = False

    # ---- StepTimer -------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        if request.request_id in self._tokens:
            raise ValueError(f"request {request.request_id} was already added to the executor")
        tokens = prompt_tokens(request, self.spec.vocab_size, self.seed)
        self._tokens[request.request_id] = tokens
        self._prompt_lens[request.request_id] = len(tokens)

    def step(self, plan: StepPlan, repeats: int | None = None) -> StepTiming:
        """Apply the plan's block moves, run its tokens, sample, fork; return the measured time.

        Block moves run in the order swap_out, swap_in, copies, all before the forward pass:
        a device block swapped out may have been freed and handed straight to a swap-in or a
        copy destination in the same plan, so its contents must leave first; and a copy-on-write
        source may be a block that is only now swapped back in, so copies read after swap-ins.
        The forward pass then writes this step's new K/V into blocks that hold the right data.
        ``repeats`` overrides ``timing_repeats`` (the profiler's cases take their own medians).
        """
        if self.check:
            self._check_plan(plan)
        wall_start = time.perf_counter()
        operators: dict[str, float] = {}
        with torch.inference_mode():
            if plan.swap_out or plan.swap_in:
                operators["swap"] = self.backend.elapsed(lambda: self._swap(plan))[1]
            if plan.copies:
                operators["copy"] = self.backend.elapsed(lambda: self.backend.copy_blocks(self.kv_caches, plan.copies))[1]
            moves_s = sum(operators.values())
            passes = [self._timed_pass(plan)] if plan.entries else []
            wall_s = time.perf_counter() - wall_start  # the step as it ran once
            self.single_run_s.append(moves_s + sum(p.host_s + p.forward_s for p in passes))
            if self.kept_plans is not None:
                self.kept_plans.append((plan, moves_s))
            host_s = 0.0
            if passes:
                count = self.timing_repeats if repeats is None else repeats
                passes += [self._timed_pass(plan) for _ in range(count - 1)]
                median = sorted(passes, key=lambda p: p.host_s + p.forward_s)[len(passes) // 2]
                host_s, operators["forward"] = median.host_s, median.forward_s
                for request_id, token in zip(passes[0].sampling_ids, passes[0].sampled.tolist()):
                    self._tokens[request_id].append(token)
        for parent, children in plan.forks:
            self._fork(parent, children)
        self.wall_s.append(wall_s)
        device_s = sum(operators.values())
        return StepTiming(
            duration_s=device_s + host_s,
            device_s=device_s,
            host_s=host_s,
            memory_bytes=self.backend.memory_in_use(),
            operators=operators,
        )

    def retime(self, passes: int, progress: Callable[[], None] | None = None) -> list[list[float]]:
        """Time every kept step again, ``passes`` times over the whole run in its order; each pass's step durations.

        Pass after pass, not repeat after repeat: a step's runs then lie minutes apart, so a
        machine whose speed wanders moves them apart as it moved the real run from its profile
        (a step's own repeats, back to back, share one moment's speed). Each is one run of the
        step's forward pass (the backend's clock, as the run timed it) plus the block moves the
        run measured: moves are not repeatable once the run is over, and the forward pass is
        (the tokens are known, the slots are the plan's; the KV it reads is stale, which changes
        no dense kernel's time). ``progress`` is called after every pass.
        """
        if self.kept_plans is None:
            raise ValueError("retime needs an executor made with keep_plans=True")
        out: list[list[float]] = []
        self._retiming = True
        try:
            with torch.inference_mode():
                for _ in range(passes):
                    durations = []
                    for plan, moves_s in self.kept_plans:
                        timed = self._timed_pass(plan) if plan.entries else None
                        durations.append(moves_s + (timed.host_s + timed.forward_s if timed else 0.0))
                    out.append(durations)
                    if progress is not None:
                        progress()
        finally:
            self._retiming = False
        return out

    # ---- queries ---------------------------------------------------------------------

    @property
    def kv_pool_bytes(self) -> int:
        """Bytes of the engine's KV blocks on the device (every layer's key and value caches)."""
        return sum(k.nbytes + v.nbytes for k, v in self.kv_caches)

    def tokens(self, request_id: str) -> list[int]:
        """Tokens generated so far for ``request_id`` (a forked child's include the parent's)."""
        return self._tokens[request_id][self._prompt_lens[request_id] :]

    # ---- internals -------------------------------------------------------------------

    def _entry_tokens(self, entry: PlanEntry) -> list[int]:
        known = self._tokens.get(entry.request_id)
        if known is None:
            raise ValueError(f"plan names request {entry.request_id!r}, which was never added nor forked")
        if entry.end_position > len(known) or entry.end_position > self.spec.max_position:
            raise ValueError(
                f"request {entry.request_id}: plan asks for positions [{entry.first_position}, {entry.end_position}) "
                f"but {len(known)} tokens are known (model max_position {self.spec.max_position})"
            )
        if entry.samples and entry.end_position != len(known) and not self._retiming:  # retimed: later tokens are known
            raise ValueError(
                f"request {entry.request_id}: entry samples after position {entry.end_position - 1}, "
                f"but the next token to generate is position {len(known)}"
            )
        return known[entry.first_position : entry.end_position]

    def _timed_pass(self, plan: StepPlan) -> TimedPass:
        """Build the inputs (host time) and run the forward pass and sampling (device time) once.

        A step a captured size holds replays its graph (captured and launched once, untimed, at a size's first step).
        """
        size = self.graphs.size_for(plan.num_tokens) if self.graphs is not None else None
        clock = self.backend.host_time
        start = clock()
        step = self._host_inputs(plan)
        if size is None:
            inputs = self._device_inputs(step)
            host_s = clock() - start
            sampled, forward_s = self.backend.elapsed(lambda: self._forward_and_sample(inputs))
            return TimedPass(sampled, inputs.sampling_ids, host_s, forward_s)
        self.graphs.load(step.graph_inputs, size)
        sample_rows = torch.tensor(step.sample_rows, dtype=torch.int64).to(self.backend.device, non_blocking=True)
        host_s = clock() - start
        self.graphs.ensure_captured(size)
        sampled, forward_s = self.backend.elapsed(lambda: self._replay_and_sample(size, sample_rows))
        return TimedPass(sampled, step.sampling_ids, host_s, forward_s)

    def _host_inputs(self, plan: StepPlan) -> HostInputs:
        if len(plan.slot_mapping) != plan.num_tokens:
            raise ValueError(f"step {plan.step}: {len(plan.slot_mapping)} slots for {plan.num_tokens} tokens")
        ids: list[int] = []
        positions: list[int] = []
        token_seq: list[int] = []
        query_start = [0]
        sample_rows: list[int] = []
        sampling_ids: list[str] = []
        for b, entry in enumerate(plan.entries):
            ids += self._entry_tokens(entry)
            positions += range(entry.first_position, entry.end_position)
            token_seq += [b] * entry.num_tokens
            query_start.append(query_start[-1] + entry.num_tokens)
            if entry.samples:
                sample_rows.append(query_start[-1] - 1)
                sampling_ids.append(entry.request_id)
        tables = [plan.block_tables[e.request_id] for e in plan.entries]
        return HostInputs(
            GraphInputs(ids, positions, list(plan.slot_mapping), token_seq, tables,
                        [e.num_tokens for e in plan.entries], [e.end_position for e in plan.entries]),
            query_start, sample_rows, sampling_ids,
        )

    def _device_inputs(self, step: HostInputs) -> StepInputs:
        tokens = step.graph_inputs
        width = max(len(t) for t in tokens.block_tables)
        padded = [t + [0] * (width - len(t)) for t in tokens.block_tables]

        def dev(values, dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype).to(self.backend.device, non_blocking=True)

        meta = AttentionMetadata(
            query_start_loc=dev(step.query_start, torch.int32),
            seq_lens=dev(tokens.seq_lens, torch.int32),
            block_tables=dev(padded, torch.int32),
            slot_mapping=dev(tokens.slots, torch.int64),
            query_lens_list=tokens.query_lens,
            seq_lens_list=tokens.seq_lens,
            block_size=self.block_size,
        )
        return StepInputs(dev(tokens.input_ids, torch.int64), dev(tokens.positions, torch.int64), meta,
                          dev(step.sample_rows, torch.int64), step.sampling_ids)

    def _paged_attend(self, meta: AttentionMetadata, caches: KVCaches | None = None) -> Attend:
        """Write the layer's new K/V into its paged cache (``caches``, default the engine's blocks), then attend over it."""
        caches = self.kv_caches if caches is None else caches

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            key_cache, value_cache = caches[layer]
            scales, dtype = self.kv_scales[layer], self.attention_dtype
            self.backend.write_kv(k.to(dtype), v.to(dtype), key_cache, value_cache, meta.slot_mapping, scales)
            mla = self.model.layers[layer].mla
            if mla is not None:  # the pair holds the latent and the rope key (model.Attend)
                return self.backend.mla_attention(q.to(dtype), key_cache, value_cache, meta, self.model.scale, mla.w_uk, mla.w_uv)
            return self.backend.attention(q.to(dtype), key_cache, value_cache, meta, self.model.scale, scales)

        return attend

    def _forward_and_sample(self, inputs: StepInputs) -> torch.Tensor:
        """Greedy token ids [S] (on device) for the sampling rows; logits only for those rows."""
        hidden = self.model.forward(inputs.input_ids, inputs.positions, self._paged_attend(inputs.meta), self.backend.moe_experts)
        if not inputs.sampling_ids:
            return inputs.sample_rows
        return self.model.logits(hidden[inputs.sample_rows]).argmax(dim=-1)

    def _replay_and_sample(self, size: int, sample_rows: torch.Tensor) -> torch.Tensor:
        hidden = self.graphs.replay(size)
        if not sample_rows.numel():
            return sample_rows
        return self.model.logits(hidden[sample_rows]).argmax(dim=-1)

    def _swap(self, plan: StepPlan) -> None:
        if plan.swap_out:
            self.backend.swap(self.kv_caches, self.host_caches, plan.swap_out)
        if plan.swap_in:
            self.backend.swap(self.host_caches, self.kv_caches, plan.swap_in)

    def _fork(self, parent: str, children: list[str]) -> None:
        """Each child continues from a copy of the parent's tokens, this step's sample included."""
        for child in children:
            if child in self._tokens:
                raise ValueError(f"fork of {parent}: child {child} already exists")
            self._tokens[child] = list(self._tokens[parent])
            self._prompt_lens[child] = self._prompt_lens[parent]

    def _check_plan(self, plan: StepPlan) -> None:
        """The plan's slot mapping agrees with its block tables, and every block id is in range."""
        plan.check(self.block_size)
        device_ids = [b for e in plan.entries for b in plan.block_tables[e.request_id]]
        device_ids += [b for pair in plan.copies for b in pair] + [d for d, _ in plan.swap_out] + [d for _, d in plan.swap_in]
        host_ids = [h for _, h in plan.swap_out] + [h for h, _ in plan.swap_in]
        for kind, ids, limit in (("device", device_ids, self.num_blocks), ("host", host_ids, self.num_host_blocks)):
            bad = [b for b in ids if not 0 <= b < limit]
            if bad:
                raise ValueError(f"step {plan.step}: {kind} block id {bad[0]} out of range [0, {limit})")
