"""``kvsim profile``: measure a kernel backend running the paged decoder and fit the cost model to it.

Everything runs on one executor's model, caches and kernels (plus bare KV pools of the other
block sizes for attention):

1. Operator microbenchmarks, each operator class alone at swept shapes, summed over all layers
   as the cost model counts them: the GEMMs at several token counts; the forward pass with
   attention replaced by the identity, whose time beyond the GEMMs is the elementwise class; KV
   writes; paged attention for decode batches (even and ragged), prompts, chunks over a cached
   prefix and two prompts at once, at every block size (which separates the per-block
   ``paged_gather`` cost from the per-byte one, and the ragged batches tell whether the kernels
   pad a batch to its longest sequence); the LM head, greedy sampling, block copies and swaps.
2. Whole steps, whose ``duration_s`` (device + host) from :meth:`Executor.step` is what the
   simulator predicts: StepPlans of swept shapes (prefill, chunked prefill, decode batches, mixed
   batches), and the steps an engine schedules for a synthetic trace replayed through the
   executor as ``kvsim execute`` runs one (several chunks beside ragged decodes, prefix hits).
   The ``host_step`` and ``host_seq`` terms are fitted on what the operators leave unexplained.
3. A held-out engine run of another synthetic trace, never fitted: its per-step error is reported.

Groups are fitted in :data:`GROUPS` order with :meth:`CostModel.fit` (minimum MAPE), each with
the coefficients fitted before it held fixed.

Timing hygiene: cases are timed in rounds that visit all of them in a seeded shuffled order, so a
slow spell on a shared machine spreads over all of them instead of biasing one (or passing for a
block-size effect), and each timed run follows an untimed run of the same case, so it finds the
caches as a serving run's similar previous step leaves them; a case's time is its median. How
far single runs stray from that median is reported as the timing noise: a model's per-step
error against single runs cannot go much below it. ``torch`` threads are left as they are and recorded.
"""

from __future__ import annotations

import os
import platform
import time
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch
from tqdm import tqdm

from kvsim.policies.config import EngineConfig
from kvsim.policies.engine import EngineCore
from kvsim.policies.plan import PlanEntry, StepPlan
from kvsim.policies.request import Request
from kvsim.realexec.backends import KernelBackend, get_backend
from kvsim.realexec.backends.base import AttentionMetadata
from kvsim.realexec.executor import Executor
from kvsim.sim.cost_model import STEP_OPERATORS, CostModel, StepFeatures, features_from_plan
from kvsim.sim.device import DeviceProfile, load_device, save_device
from kvsim.sim.memory import plan_memory
from kvsim.sim.model_spec import ModelSpec, load_model
from kvsim.sim.simulator import SimOptions, simulate
from kvsim.sim.step_timer import StepTiming
from kvsim.traces.synth import Uniform, synthesize

Echo = Callable[[str], None]
Case = Callable[[], float]  # runs once, returns the seconds to count


# ---------------------------------------------------------------------------------- shapes


@dataclass(frozen=True)
class SeqShape:
    """One sequence of a step: ``new`` query tokens after ``cached`` tokens already in the KV cache."""

    cached: int
    new: int
    samples: bool = True  # False: a prefill chunk that is not the prompt's last

    @property
    def is_decode(self) -> bool:
        return self.new == 1 and self.cached > 0 and self.samples


StepShape = tuple[SeqShape, ...]


def decode(batch: int, context: int) -> StepShape:
    return (SeqShape(context, 1),) * batch


def ragged_decode(batch: int, context: int) -> StepShape:
    """A decode batch whose contexts spread evenly from ``context / 8`` to ``context``, as a served batch's do."""
    return tuple(SeqShape(int(c), 1) for c in np.linspace(max(1, context // 8), context, batch).round())


def prefill(tokens: int, cached: int = 0, samples: bool = True) -> StepShape:
    return (SeqShape(cached, tokens, samples),)


@dataclass(frozen=True)
class Sweep:
    """What to measure. ``quick`` and ``full`` differ only in these numbers."""

    block_sizes: tuple[int, ...]
    token_counts: tuple[int, ...]  # GEMM, forward, KV write
    prefill_tokens: tuple[int, ...]  # attention over a prompt or a chunk
    prefix_tokens: tuple[int, ...]  # cached tokens before a chunk
    decode_batches: tuple[int, ...]
    decode_contexts: tuple[int, ...]
    sample_rows: tuple[int, ...]  # LM head and sampling
    moved_blocks: tuple[int, ...]  # block copies and swaps
    repeats: int
    engine_requests: int  # requests of each engine-scheduled trace (one fitted, one held out)

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            values = value if isinstance(value, tuple) else (value,)
            least = 0 if f.name == "prefix_tokens" else 1
            if not values or min(values) < least:
                raise ValueError(f"sweep: {f.name} must be non-empty and at least {least}, got {value!r}")

    def attention_shapes(self) -> list[StepShape]:
        """Decode batches (even and ragged), prompts, chunks over a cached prefix, and several at once.

        Several at once: two prompts, and a prompt's last chunk over its cached prefix beside a
        new prompt (what a chunked-prefill scheduler puts in one step).
        """
        shapes = [decode(b, c) for b in self.decode_batches for c in self.decode_contexts]
        shapes += [ragged_decode(b, c) for b, c in _pairs(self.decode_batches[1:], self.decode_contexts)]
        shapes += [prefill(n, c) for n in self.prefill_tokens for c in self.prefix_tokens]
        shapes += [prefill(n) + prefill(max(1, n // 4)) for n in self.prefill_tokens]
        shapes += [prefill(max(1, n // 8), self.prefix_tokens[-1]) + prefill(n) for n in self.prefill_tokens]
        return shapes

    def step_shapes(self) -> list[StepShape]:
        """The whole steps the host terms are fitted on: every kind a scheduler produces."""
        shapes = [prefill(n) for n in self.prefill_tokens]
        shapes += [prefill(n, c, samples=i % 2 == 0) for i, (n, c) in enumerate(_pairs(self.prefill_tokens, self.prefix_tokens))]
        shapes += [decode(b, c) for b in self.decode_batches for c in self.decode_contexts]
        shapes += [ragged_decode(b, c) for b, c in _pairs(self.decode_batches[1:], self.decode_contexts)]
        chunk = self.prefill_tokens[len(self.prefill_tokens) // 2]
        chunked = prefill(chunk, self.prefix_tokens[-1], samples=False)
        shapes += [chunked + ragged_decode(b, c) for b, c in _pairs(self.decode_batches, self.decode_contexts)]
        return shapes


def _pairs(a: Sequence[int], b: Sequence[int]) -> list[tuple[int, int]]:
    """Both sequences' values, each at least once, paired along a diagonal: a sparse cover of a x b."""
    n = max(len(a), len(b)) if a and b else 0
    return [(a[i * len(a) // n], b[i * len(b) // n]) for i in range(n)]


QUICK = Sweep(
    block_sizes=(16, 64),
    token_counts=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512),
    prefill_tokens=(16, 64, 256, 512),
    prefix_tokens=(0, 128, 640),
    decode_batches=(1, 2, 4, 8, 16, 32),
    decode_contexts=(16, 128, 512, 1024),
    sample_rows=(1, 2, 4, 8, 16, 32),
    moved_blocks=(1, 8, 32),
    repeats=9,
    engine_requests=16,
)

FULL = Sweep(
    block_sizes=(16, 32, 128),
    token_counts=(1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 2048),
    prefill_tokens=(8, 32, 64, 128, 256, 512, 1024),
    prefix_tokens=(0, 64, 256, 640, 1024, 2048),
    decode_batches=(1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64),
    decode_contexts=(16, 64, 128, 256, 512, 768, 1024, 2048),
    sample_rows=(1, 2, 4, 8, 16, 32, 64),
    moved_blocks=(1, 4, 16, 64),
    repeats=9,
    engine_requests=48,
)


# --------------------------------------------------------------------------------- timing


@dataclass
class Measured:
    """Every timed run of each case, and each case's median."""

    median: np.ndarray  # [cases]
    runs: np.ndarray  # [cases, repeats]


def measure(cases: Sequence[Case], repeats: int, rng: np.random.Generator, tick: Callable[[], None] | None = None) -> Measured:
    """Time ``repeats`` rounds, each visiting the cases in a fresh shuffled order, every timed run primed.

    Each timed run follows an untimed run of the same case, which leaves the caches holding that
    case's weights and KV blocks, as the step before it does in a serving run (a decode step
    follows a decode step of about the same batch). Timed right after some other case instead, a
    batch-1 decode step measured 27 % slower on a CPU, and the profile overestimated every small
    step of a served trace (docs/benchmarks.md). ``tick`` is called after every timed run.
    """
    runs = np.empty((len(cases), repeats))
    for r in range(repeats):
        for i in rng.permutation(len(cases)):
            cases[i]()
            runs[i, r] = cases[i]()
            if tick is not None:
                tick()
    return Measured(np.median(runs, axis=1), runs)


# ---------------------------------------------------------------------------------- plans


@dataclass
class KVPool:
    """Paged KV caches of one block size: the executor's own, or a bare one for attention alone."""

    caches: list[tuple[torch.Tensor, torch.Tensor]]
    block_size: int
    num_blocks: int

    def tables(self, shape: StepShape, rng: np.random.Generator) -> list[list[int]]:
        """Block tables of a step of this shape, laid out as an engine's free queue hands them out.

        A request's blocks come off a FIFO free queue together at admission, so each sequence
        holds a run of consecutive blocks; the runs sit in random order with random gaps in a
        region twice the step's footprint (a serving engine's running batch fills most of its
        pool, so what a step reads is about as spread, and as cache-resident, as that). On a CPU
        the layout matters: consecutive blocks gather faster than scattered ones.
        """
        counts = [-(-(s.cached + s.new) // self.block_size) for s in shape]
        footprint = sum(counts)
        if footprint > self.num_blocks:
            raise ValueError(f"a step of {footprint} blocks does not fit the profiling pool of {self.num_blocks}")
        spare = min(self.num_blocks, 2 * footprint) - footprint
        gaps = rng.multinomial(spare, np.full(len(counts) + 1, 1.0 / (len(counts) + 1)))
        tables: list[list[int]] = [[] for _ in counts]
        start = 0
        for i, gap in zip(rng.permutation(len(counts)).tolist(), gaps):
            start += int(gap)
            tables[i] = list(range(start, start + counts[i]))
            start += counts[i]
        return tables

    def metadata(self, shape: StepShape, rng: np.random.Generator, device: torch.device) -> AttentionMetadata:
        """Attention metadata of a step of this shape, as the executor builds it."""
        return AttentionMetadata.build(
            [s.new for s in shape], [s.cached + s.new for s in shape], self.tables(shape, rng), self.block_size, device
        )


class PlanBuilder:
    """StepPlans of given shapes for one executor, with fresh requests every time.

    A sampled token is appended to its request, so the same plan could not run twice.
    """

    def __init__(self, executor: Executor, rng: np.random.Generator) -> None:
        self.executor = executor
        self.pool = KVPool(executor.kv_caches, executor.block_size, executor.num_blocks)
        self.rng = rng
        self._next_id = 0

    def plan(self, shape: StepShape) -> StepPlan:
        bs = self.pool.block_size
        plan = StepPlan(step=self._next_id)
        for s, table in zip(shape, self.pool.tables(shape, self.rng)):
            rid = f"profile-{self._next_id}"
            self.executor.add_request(Request(rid, self._next_id, 0.0, s.cached + s.new, 1))
            self._next_id += 1
            plan.entries.append(PlanEntry(rid, s.cached, s.new, not s.is_decode, s.samples))
            plan.block_tables[rid] = table
            plan.slot_mapping += [table[p // bs] * bs + p % bs for p in range(s.cached, s.cached + s.new)]
        return plan


def shape_features(shape: StepShape, block_size: int) -> StepFeatures:
    """The cost model's features of a step of this shape (they do not depend on block ids)."""
    entries = [PlanEntry(str(i), s.cached, s.new, not s.is_decode, s.samples) for i, s in enumerate(shape)]
    return features_from_plan(StepPlan(step=0, entries=entries), block_size)


# ----------------------------------------------------------------------- operator benchmarks


@dataclass(frozen=True)
class Group:
    """Operators fitted together from one kind of measurement, in :data:`GROUPS` order.

    ``fixed`` operators also run inside the measured time; they were fitted by an earlier group.
    """

    name: str
    operators: tuple[str, ...]
    fixed: tuple[str, ...] = ()


HOST_OPERATORS = ("host_step", "host_seq")
GROUPS = (
    Group("gemm", ("gemm",)),
    Group("elementwise", ("elementwise",), fixed=("gemm",)),  # measured: the forward pass without attention
    Group("kv_write", ("kv_write",)),
    Group("attention", ("attn_prefill", "attn_decode", "paged_gather")),
    Group("lm_head", ("lm_head",)),
    Group("sampling", ("sampling",)),
    Group("block_copy", ("block_copy",)),
    Group("swap", ("swap",)),
    Group("steps", HOST_OPERATORS, fixed=tuple(op for op in STEP_OPERATORS if op not in HOST_OPERATORS)),
)


@dataclass
class Sample:
    """One case of a group: what the cost model sees, a label for the error report, and how to run it."""

    group: str
    label: str
    features: StepFeatures
    run: Case


class OperatorBenches:
    """Cases for every group on one executor's model, caches and backend."""

    def __init__(self, executor: Executor, rng: np.random.Generator, seed: int) -> None:
        self.ex = executor
        self.builder = PlanBuilder(executor, rng)
        self.rng = rng
        self.spec = executor.spec
        self.backend: KernelBackend = executor.backend
        self.gen = torch.Generator(device="cpu").manual_seed(seed)

    def _features(self, shape: StepShape) -> StepFeatures:
        return shape_features(shape, self.ex.block_size)

    def _randn(self, *shape: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        x = torch.randn(*shape, generator=self.gen, dtype=torch.float32)
        return x.to(device=self.backend.device, dtype=dtype or self.ex.model.dtype)

    def _timed(self, fn: Callable[[], object]) -> float:
        return self.backend.elapsed(fn)[1]

    def gemm(self, tokens: int) -> Sample:
        s = self.spec
        x, attn, act = self._randn(tokens, s.hidden_size), self._randn(tokens, s.q_size), self._randn(tokens, s.intermediate_size)

        def run() -> None:
            for layer in self.ex.model.layers:
                x @ layer.qkv_proj.T
                attn @ layer.o_proj.T
                x @ layer.gate_up_proj.T
                act @ layer.down_proj.T

        return Sample("gemm", "gemm", self._features(prefill(tokens)), lambda: self._timed(run))

    def forward_without_attention(self, tokens: int) -> Sample:
        """The decoder's forward pass with attention replaced by the identity: GEMMs + elementwise."""
        ids = torch.randint(0, self.spec.vocab_size, (tokens,), generator=self.gen).to(self.backend.device)
        positions = torch.arange(tokens).to(self.backend.device)

        def run() -> None:
            self.ex.model.forward(ids, positions, lambda layer, q, k, v: q)

        return Sample("elementwise", "forward without attention", self._features(prefill(tokens)), lambda: self._timed(run))

    def kv_write(self, tokens: int) -> Sample:
        s, bs = self.spec, self.ex.block_size
        k, v = (self._randn(tokens, s.num_kv_heads, s.head_dim, dtype=self.ex.kv_dtype) for _ in range(2))
        shape = prefill(tokens)

        def case() -> float:
            table = self.builder.pool.tables(shape, self.rng)[0]
            slots = torch.tensor([table[p // bs] * bs + p % bs for p in range(tokens)], dtype=torch.int64).to(self.backend.device)
            return self._timed(lambda: [self.backend.write_kv(k, v, kc, vc, slots) for kc, vc in self.ex.kv_caches])

        return Sample("kv_write", "kv_write", self._features(shape), case)

    def attention(self, shape: StepShape, pool: KVPool) -> Sample:
        s = self.spec
        q = self._randn(sum(x.new for x in shape), s.num_heads, s.head_dim, dtype=self.ex.kv_dtype)
        scale = self.ex.model.scale

        def case() -> float:
            meta = pool.metadata(shape, self.rng, self.backend.device)  # fresh: what a backend derives per step is part of the cost
            return self._timed(lambda: [self.backend.attention(q, kc, vc, meta, scale) for kc, vc in pool.caches])

        label = f"attention {'decode' if shape[0].is_decode else 'prefill'}"
        return Sample("attention", label, shape_features(shape, pool.block_size), case)

    def lm_head(self, rows: int) -> Sample:
        hidden = self._randn(rows, self.spec.hidden_size)
        return Sample("lm_head", "lm_head", self._features(decode(rows, 1)), lambda: self._timed(lambda: self.ex.model.logits(hidden)))

    def sampling(self, rows: int) -> Sample:
        """Greedy sampling, as the executor samples: an argmax over the fp32 logits."""
        logits = self.ex.model.logits(self._randn(rows, self.spec.hidden_size))
        return Sample("sampling", "sampling", self._features(decode(rows, 1)), lambda: self._timed(lambda: logits.argmax(dim=-1)))

    def block_copy(self, blocks: int) -> Sample:
        def case() -> float:
            ids = self.rng.permutation(self.ex.num_blocks)[: 2 * blocks].tolist()
            pairs = list(zip(ids[:blocks], ids[blocks:]))
            return self._timed(lambda: self.backend.copy_blocks(self.ex.kv_caches, pairs))

        return Sample("block_copy", "block_copy", _only("copy_blocks", blocks), case)

    def swap(self, blocks: int, out: bool) -> Sample:
        def case() -> float:
            device = self.rng.permutation(self.ex.num_blocks)[:blocks].tolist()
            host = self.rng.permutation(self.ex.num_host_blocks)[:blocks].tolist()
            if out:
                return self._timed(lambda: self.backend.swap(self.ex.kv_caches, self.ex.host_caches, list(zip(device, host))))
            return self._timed(lambda: self.backend.swap(self.ex.host_caches, self.ex.kv_caches, list(zip(host, device))))

        return Sample("swap", "swap out" if out else "swap in", _only("swap_blocks", blocks), case)

    def step(self, shape: StepShape) -> Sample:
        """A whole step through the executor: what the simulator's step time must match."""
        return Sample("steps", f"steps {_kind(shape)}", self._features(shape), lambda: self.ex.step(self.builder.plan(shape)).duration_s)


def _kind(shape: StepShape) -> str:
    decodes = sum(s.is_decode for s in shape)
    return "decode" if decodes == len(shape) else "prefill" if decodes == 0 else "mixed"


def _only(name: str, value: int) -> StepFeatures:
    return StepFeatures(**{**{f.name: 0.0 for f in fields(StepFeatures)}, name: float(value)})


def _stack(features: Sequence[StepFeatures]) -> StepFeatures:
    return StepFeatures(**{f.name: np.array([getattr(x, f.name) for x in features], dtype=np.float64) for f in fields(StepFeatures)})


def sweep_samples(benches: OperatorBenches, sweep: Sweep, pools: Sequence[KVPool], fits: Callable[[StepShape, int], bool]) -> list[Sample]:
    """Every case: attention at every pool's block size, whole steps and the other operators on the executor.

    ``fits(shape, block_size)`` drops shapes too large for the memory the profile may use.
    """
    samples = [benches.attention(shape, pool) for pool in pools for shape in sweep.attention_shapes() if fits(shape, pool.block_size)]
    samples += [benches.step(shape) for shape in sweep.step_shapes() if fits(shape, benches.ex.block_size)]
    for n in sweep.token_counts:
        samples += [benches.gemm(n), benches.forward_without_attention(n), benches.kv_write(n)]
    for rows in sweep.sample_rows:
        samples += [benches.lm_head(rows), benches.sampling(rows)]
    for blocks in sweep.moved_blocks:
        samples += [benches.block_copy(blocks), benches.swap(blocks, out=True), benches.swap(blocks, out=False)]
    return samples


# ----------------------------------------------------------------------------- fit and error


@dataclass(frozen=True)
class FitError:
    """How far the calibrated model's times are from the measured ones, relative to the measured."""

    name: str
    samples: int
    mape: float
    max_error: float

    @classmethod
    def of(cls, name: str, predicted: np.ndarray, measured: np.ndarray) -> "FitError":
        errors = np.abs(np.asarray(predicted) / np.asarray(measured) - 1.0)
        return cls(name, int(errors.size), float(errors.mean()), float(errors.max()))


@dataclass
class Measurements:
    """Every measured sample of a profiling run, in measurement order per group."""

    labels: dict[str, list[str]] = field(default_factory=dict)
    features: dict[str, list[StepFeatures]] = field(default_factory=dict)
    median: dict[str, list[float]] = field(default_factory=dict)
    noise: dict[str, list[np.ndarray]] = field(default_factory=dict)  # |run / median - 1|: a perfect model's error on one run

    def add_once(self, steps: StepRecords) -> None:
        """Whole steps measured once each (an engine run): fitted with the steps group, no noise figure."""
        self.labels.setdefault("steps", []).extend(f"engine {kind}" for kind in steps.kinds)
        self.features.setdefault("steps", []).extend(steps.features)
        self.median.setdefault("steps", []).extend(steps.seconds)

    def add(self, samples: Sequence[Sample], measured: Measured) -> None:
        for i, sample in enumerate(samples):
            self.labels.setdefault(sample.group, []).append(sample.label)
            self.features.setdefault(sample.group, []).append(sample.features)
            self.median.setdefault(sample.group, []).append(float(measured.median[i]))
            self.noise.setdefault(sample.group, []).append(np.abs(measured.runs[i] / measured.median[i] - 1.0))


def fit_groups(spec: ModelSpec, base: DeviceProfile, block_size: int, data: Measurements) -> tuple[DeviceProfile, list[FitError]]:
    """Fit every group in :data:`GROUPS` order; each starts from the coefficients fitted before it.

    The attention group also decides ``padded_attention``: it is fitted both ways and the layout
    that explains the measurements better is kept (ragged batches in the sweep tell them apart).
    Returns the calibrated profile and the fit's error per group and per labelled subset.
    """
    device, errors = base, []
    for group in GROUPS:
        if group.name not in data.median:
            continue
        features, seconds = _stack(data.features[group.name]), np.array(data.median[group.name])
        layouts = [replace(device, padded_attention=p) for p in (False, True)] if group.name == "attention" else [device]
        fits = sorted((_fit_group(spec, layout, block_size, group, features, seconds) for layout in layouts), key=lambda fit: fit[2])
        (device, predicted, _), rejected = fits[0], fits[1:]
        labels = np.array(data.labels[group.name])
        for label in dict.fromkeys(labels.tolist()):
            rows = labels == label
            errors.append(FitError.of(label, predicted[rows], seconds[rows]))
        if len(set(labels)) > 1:
            errors.append(FitError.of(group.name, predicted, seconds))
        for other, other_predicted, _ in rejected:
            errors.append(FitError.of(f"{group.name} if {'' if other.padded_attention else 'not '}padded", other_predicted, seconds))
    return device, errors


def _fit_group(
    spec: ModelSpec, device: DeviceProfile, block_size: int, group: Group, features: StepFeatures, seconds: np.ndarray
) -> tuple[DeviceProfile, np.ndarray, float]:
    """The profile with ``group`` fitted, its predictions of the group's samples, and their MAPE."""
    fitted = device.with_operators(CostModel(spec, device, block_size).fit(features, seconds, group.operators, fixed=group.fixed))
    times = CostModel(spec, fitted, block_size).operator_times(features)
    predicted = sum(np.broadcast_to(times[op], seconds.shape) for op in group.operators + group.fixed)
    return fitted, predicted, float(np.mean(np.abs(predicted / seconds - 1.0)))


# ----------------------------------------------------------------------------- engine runs


@dataclass
class StepRecords:
    """Steps run once each: their features, measured ``duration_s`` and kind (prefill, decode, mixed)."""

    features: list[StepFeatures] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    kinds: list[str] = field(default_factory=list)


class RecordingTimer:
    """The executor as a step timer that records every step it runs.

    Request ids get ``prefix``, so several engine runs can share one executor (trace ids repeat).
    """

    def __init__(self, executor: Executor, prefix: str) -> None:
        self.executor = executor
        self.prefix = prefix
        self.records = StepRecords()

    def add_request(self, request: Request) -> None:
        self.executor.add_request(replace(request, request_id=self.prefix + request.request_id))

    def step(self, plan: StepPlan) -> StepTiming:
        p = self.prefix
        timing = self.executor.step(replace(
            plan,
            entries=[replace(e, request_id=p + e.request_id) for e in plan.entries],
            block_tables={p + rid: table for rid, table in plan.block_tables.items()},
            forks=[(p + parent, [p + child for child in children]) for parent, children in plan.forks],
        ))
        if plan.entries:
            self.records.features.append(features_from_plan(plan, self.executor.block_size))
            self.records.seconds.append(timing.duration_s)
            self.records.kinds.append(plan.kind)
        return timing


def engine_run(executor: Executor, sweep: Sweep, seed: int) -> StepRecords:
    """An engine-scheduled synthetic trace replayed on ``executor``, each step measured once.

    Two-turn conversations arriving faster than they are served give what a serving run has:
    batched decodes of mixed contexts, prompts split into chunks beside them, and second turns
    that prefill only what their cached first turn does not cover. The engine's pool holds the
    ``max_num_seqs`` longest requests at once, as a server's pool is sized to its batch, so the
    blocks it hands out span a region about as large as a served batch's (on a CPU, a pool
    that fits the cache times very differently from one that does not).
    """
    longest = max(sweep.prefill_tokens)
    trace = synthesize(
        rate=1000.0, n_requests=sweep.engine_requests, prompt=Uniform(min(16, longest), longest), output=Uniform(2, 48), turns=2,
        think_time_s=0.05, hash_block_size=executor.block_size, seed=seed,
    )
    lengths = np.minimum(trace.prompt_tokens + trace.output_tokens, executor.spec.max_position)
    batch = max(sweep.decode_batches)
    blocks = int(np.sum(-(-np.sort(lengths)[-batch:] // executor.block_size)))
    config = EngineConfig(
        num_blocks=min(executor.num_blocks, blocks), block_size=executor.block_size, max_model_len=int(lengths.max()),
        max_num_seqs=batch, max_num_batched_tokens=longest,
    )
    timer = RecordingTimer(executor, prefix=f"engine-{seed}-")
    simulate(trace, EngineCore(config), timer, SimOptions(exact=True))
    return timer.records


# --------------------------------------------------------------------------------- top level


STEP_KINDS = ("prefill", "decode", "mixed")


@dataclass
class Profile:
    """A calibrated device profile and the evidence for it."""

    device: DeviceProfile
    errors: list[FitError]  # per fitted group and labelled subset, then the held-out steps
    operator_noise: float  # mean |single run / median - 1| over every operator benchmark run
    step_noise: float  # the same over whole steps: about the floor of any model's error against one run
    seconds: float  # wall time of the profiling run
    measurements: Measurements  # what the fit saw
    held_out: StepRecords  # the held-out steps

    def error(self, name: str) -> FitError:
        return next(e for e in self.errors if e.name == name)


def kv_token_budget(spec: ModelSpec, base: DeviceProfile, block_size: int, pools: int) -> int:
    """KV tokens one profiling pool may hold: half of what an engine would give its KV cache on ``base``, split over the pools.

    Half, because attention may gather a padded copy of everything it reads next to the cache.
    """
    return plan_memory(spec, base, block_size=block_size).num_blocks * block_size // (2 * pools)


def footprint(shape: StepShape, block_size: int) -> int:
    """KV blocks a step of this shape holds."""
    return sum(-(-(s.cached + s.new) // block_size) for s in shape)


def profile(
    backend: KernelBackend,
    spec: ModelSpec,
    base: DeviceProfile,
    sweep: Sweep,
    seed: int = 0,
    echo: Echo | None = None,
    progress: bool = False,
) -> Profile:
    """Measure ``backend`` running ``spec`` over ``sweep`` and fit ``base``'s coefficients to it.

    One executor at the first block size runs everything but attention at the other block sizes,
    which reads bare pools of those sizes; every case of every block size is timed in the same
    shuffled rounds, so a change of load on a shared machine cannot pass for a block-size effect.
    """
    started = time.perf_counter()
    say = echo or (lambda _: None)
    rng = np.random.default_rng(seed)
    first = sweep.block_sizes[0]
    budget = kv_token_budget(spec, base, first, len(sweep.block_sizes))

    def fits(shape: StepShape, block_size: int) -> bool:
        return footprint(shape, block_size) * block_size <= budget

    shapes = sweep.step_shapes() + sweep.attention_shapes()
    if not any(fits(shape, first) for shape in shapes):
        raise ValueError(f"model {spec.name} leaves no memory for a KV cache on {base.name} ({base.hbm_bytes} bytes)")
    blocks = max([footprint(shape, first) for shape in shapes if fits(shape, first)] + [2 * max(sweep.moved_blocks)])
    executor = Executor(spec, backend, num_blocks=blocks, block_size=first, num_host_blocks=max(sweep.moved_blocks), seed=seed)
    pools = [KVPool(executor.kv_caches, first, executor.num_blocks)]
    for block_size in sweep.block_sizes[1:]:
        blocks = max([footprint(shape, block_size) for shape in sweep.attention_shapes() if fits(shape, block_size)], default=0)
        if blocks:
            caches = backend.allocate_kv_cache(spec.num_layers, blocks, block_size, spec.num_kv_heads, spec.head_dim, executor.kv_dtype)
            pools.append(KVPool(caches, block_size, blocks))
    samples = sweep_samples(OperatorBenches(executor, rng, seed), sweep, pools, fits)
    say(f"timing {len(samples)} cases in {sweep.repeats} rounds, each timed run after an untimed one")
    data = Measurements()
    with tqdm(total=len(samples) * sweep.repeats, unit="run", disable=not progress, leave=False, mininterval=0.5) as bar:
        data.add(samples, measure([s.run for s in samples], sweep.repeats, rng, tick=bar.update))
    del pools[1:]
    say(f"engine runs: two traces of {sweep.engine_requests} requests, one fitted and one held out")
    data.add_once(engine_run(executor, sweep, seed + 1))
    held_out = engine_run(executor, sweep, seed)

    device, errors = fit_groups(spec, base, first, data)
    predicted = CostModel(spec, device, first).predict(_stack(held_out.features))
    seconds, kinds = np.array(held_out.seconds), np.array(held_out.kinds)
    errors.append(FitError.of("held-out steps", predicted, seconds))
    for kind in STEP_KINDS:
        if np.any(kinds == kind):
            errors.append(FitError.of(f"held-out {kind}", predicted[kinds == kind], seconds[kinds == kind]))
    noise = {group: float(np.mean(np.concatenate(runs))) for group, runs in data.noise.items()}
    step_noise = noise.pop("steps")
    operator_noise = float(np.mean(list(noise.values())))
    return Profile(device, errors, operator_noise, step_noise, time.perf_counter() - started, data, held_out)


def default_base_device(backend: KernelBackend) -> str:
    """The bundled profile a backend's fit starts from: its roofs (peaks, bandwidths) are kept."""
    if backend.name == "cpu":
        return "cpu"
    if backend.name == "npu":
        return "ascend-910b3"
    name = torch.cuda.get_device_name(backend.device)
    for marker, profile_name in (("H200", "h200"), ("H100", "h100-sxm")):
        if marker in name:
            return profile_name
    raise ValueError(f"no bundled profile for CUDA device {name!r}: pass --base-device NAME or a .toml path")


def sweep_for(backend: KernelBackend, quick: bool) -> Sweep:
    """The quick or full sweep; the npu kernels take block sizes 128 to 512 only."""
    sweep = QUICK if quick else FULL
    return replace(sweep, block_sizes=(128, 256)) if backend.name == "npu" else sweep


def machine(backend: KernelBackend) -> str:
    """What ran the profile, for the profile's ``source``."""
    if backend.name == "cuda":
        return torch.cuda.get_device_name(backend.device)
    if backend.name == "npu":
        return str(backend.torch_npu.npu.get_device_name(backend.device.index or 0))
    cpu = next((line.split(":", 1)[1].strip() for line in _cpuinfo() if line.startswith("model name")), platform.machine())
    return f"{cpu} ({os.cpu_count()} cpus)"


def _cpuinfo() -> list[str]:
    try:
        return Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return []


def run_profile(
    backend: str,
    model: str,
    out: str | Path,
    *,
    quick: bool = False,
    seed: int = 0,
    base_device: str | None = None,
    torch_device: str | None = None,
    sweep: Sweep | None = None,
    echo: Echo | None = None,
    progress: bool = False,
) -> Profile:
    """``kvsim profile``: profile ``backend`` running ``model``, write the calibrated profile to ``out``.

    ``sweep`` replaces the quick or full sweep (tests run a small one).
    """
    spec = load_model(model)
    kernels = get_backend(backend, torch_device)
    base = load_device(base_device or default_base_device(kernels), search_dirs=[Path.cwd()])
    sweep = sweep or sweep_for(kernels, quick)
    if echo:
        echo(f"profiling {backend} ({machine(kernels)}) with model {spec.name}, {torch.get_num_threads()} torch threads, "
             f"{'quick' if quick else 'full'} sweep, starting from the {base.name} profile")
    result = profile(kernels, spec, base, sweep, seed, echo, progress)
    command = f"kvsim profile --backend {backend} --model {model}{' --quick' if quick else ''} --seed {seed}"
    held = result.error("held-out steps")
    source = (
        f"{command} on {machine(kernels)}, torch {torch.__version__} with num_threads={torch.get_num_threads()}, "
        f"{time.strftime('%Y-%m-%d')}; fitted from {base.name}; held-out per-step MAPE {held.mape:.1%} "
        f"against single steps whose timing noise is {result.step_noise:.1%}"
    )
    calibrated = replace(result.device, name=f"{base.name}-calibrated", source=source, step_timing_noise=round(result.step_noise, 4))
    result = replace(result, device=calibrated)
    save_device(result.device, out)
    if echo:
        for line in report_lines(result):
            echo(line)
    return result


def report_lines(result: Profile) -> list[str]:
    """The fit's error per operator group and for whole steps, and the timing noise."""
    lines = [f"{'fit':<28}{'samples':>8}{'MAPE':>8}{'max':>8}"]
    lines += [f"{e.name:<28}{e.samples:>8}{e.mape:>8.1%}{e.max_error:>8.1%}" for e in result.errors]
    layout = "padded to the batch's longest sequence" if result.device.padded_attention else "exact (no padding)"
    lines.append(f"attention work: {layout}")
    lines.append(f"timing noise (mean |run / median - 1|): operators {result.operator_noise:.1%}, steps {result.step_noise:.1%}")
    lines.append(f"profiled in {result.seconds:.0f} s")
    return lines
