"""How ``kvsim profile`` times things: primed shuffled rounds, paged KV pools laid out as an engine
lays them out, a case per operator class and shape, and engine-scheduled runs of synthetic traces.

Timing hygiene: cases are timed in rounds that visit all of them in a seeded shuffled order, so a
slow spell on a shared machine spreads over all of them instead of biasing one (or passing for a
block-size effect), and each timed run follows an untimed run of the same case, so it finds the
caches as a serving run's similar previous step leaves them; a case's time is its median. How
far single runs stray from that median is reported as the timing noise: a model's per-step
error against single runs cannot go much below it. Everything is timed on the backend's clock
(``KernelBackend.clock``), the one ``kvsim execute`` times steps with.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields, replace

import numpy as np
import torch

from kvsim.policies.blocks import cdiv, slots_for
from kvsim.policies.config import EngineConfig
from kvsim.policies.engine import EngineCore
from kvsim.policies.plan import PlanDetail, PlanEntry, StepPlan
from kvsim.policies.request import Request
from kvsim.realexec.backends import KernelBackend
from kvsim.realexec.backends.base import AttentionMetadata
from kvsim.realexec.executor import Executor, kv_cache_layout
from kvsim.realexec.graphs import StepGraph, capture
from kvsim.realexec.model import LayerWeights
from kvsim.realexec.profile_shapes import StepShape, Sweep, decode, prefill, shape_features, step_kind
from kvsim.sim.perf.cost_model import StepFeatures, features_from_plan
from kvsim.sim.perf.step_timer import StepTiming
from kvsim.sim.run.simulator import simulate
from kvsim.traces.synth import Uniform, synthesize

# Untimed runs before the timed one of a case that streams the model's weights on its own (GEMMs,
# the forward pass without attention, the LM head). Right after another case, the tiny model's
# decode-step GEMMs took 1.19 ms primed once, 0.90 ms primed three times and 0.55 ms primed five
# times, against 0.45 ms back to back, as a served run's consecutive steps run them: a CPU's
# last-level cache keeps lines touched repeatedly, not lines touched once. Whole steps and
# attention came within 5 % of back to back after one priming run (docs/benchmarks.md).
WEIGHT_PRIMING_RUNS = 5
Run = Callable[[], float]  # runs once, returns the seconds to count
Case = Callable[[], Run]  # one instance of a case (its block layout, its ids): run primed, then timed


@dataclass
class Measured:
    """Every timed run of each case, and each case's median."""

    median: np.ndarray  # [cases]
    runs: np.ndarray  # [cases, repeats]


def measure(samples: Sequence[Sample], repeats: int, rng: np.random.Generator, tick: Callable[[], None] | None = None) -> Measured:
    """Time ``repeats`` rounds, each visiting the cases in a fresh shuffled order, every timed run primed.

    Each round makes a fresh instance of every case (a new block layout), runs it untimed
    (``Sample.primes`` times), then timed: the untimed runs leave the caches holding that
    instance's weights and KV blocks, as the steps before it do in a serving run, where a decode
    step follows a decode step of the same requests reading the same blocks. Timed right after
    some other case instead, a batch-1 decode step measured 27 % slower on a CPU, and the profile
    overestimated every small step of a served trace (docs/benchmarks.md). ``tick`` is called
    after every timed run.
    """
    runs = np.empty((len(samples), repeats))
    for r in range(repeats):
        for i in rng.permutation(len(samples)):
            run = samples[i].case()
            for _ in range(samples[i].primes):
                run()
            runs[i, r] = run()
            if tick is not None:
                tick()
    return Measured(np.median(runs, axis=1), runs)



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
        counts = [cdiv(s.cached + s.new, self.block_size) for s in shape]
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

    def metadata(self, shape: StepShape, tables: list[list[int]], device: torch.device) -> AttentionMetadata:
        """Attention metadata of a step of this shape on ``tables``, as the executor builds it."""
        return AttentionMetadata.build(
            [s.new for s in shape], [s.cached + s.new for s in shape], tables, self.block_size, device
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

    def plan(self, shape: StepShape, tables: list[list[int]] | None = None) -> StepPlan:
        """A plan of fresh requests of this shape, on ``tables`` (default: a fresh layout)."""
        bs = self.pool.block_size
        plan = StepPlan(step=self._next_id)
        for s, table in zip(shape, tables or self.pool.tables(shape, self.rng)):
            rid = f"profile-{self._next_id}"
            self.executor.add_request(Request(rid, self._next_id, 0.0, s.cached + s.new, 1))
            self._next_id += 1
            plan.entries.append(PlanEntry(rid, s.cached, s.new, not s.is_decode, s.samples))
            plan.block_tables[rid] = table
            plan.slot_mapping += slots_for(table, s.cached, s.cached + s.new, bs)
        return plan



@dataclass
class Sample:
    """One case of a group: what the cost model sees, a label for the error report, and how to run it."""

    group: str
    label: str
    features: StepFeatures
    case: Case
    primes: int = 1  # untimed runs of an instance before its timed run


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

    def _timed(self, fn: Callable[[], object], in_graph: bool = True) -> float:
        """Seconds ``fn`` takes on the backend's clock: replayed as a graph of its own when the executor
        replays its steps as graphs and ``fn`` runs inside a step's forward pass (``in_graph``), so the
        operators' costs are fitted without the per-kernel launches a graph step does not pay."""
        if in_graph and self.ex.graphs is not None:
            return self._graph_timed(self._captured(fn))
        return self.backend.elapsed(fn)[1]

    def _captured(self, fn: Callable[[], object]) -> StepGraph:
        graph = self.backend.new_graph(self.ex.graphs.pool)  # beside its executor's step graphs, as when the backend had one pool
        capture(graph, fn)
        return graph

    def _graph_timed(self, graph: StepGraph) -> float:
        return self.backend.elapsed(graph.replay)[1]

    def _same(self, fn: Callable[[], object], in_graph: bool = True) -> Case:
        """A case with nothing to lay out: every instance times ``fn`` (captured once, where graphs run)."""
        graph: list[StepGraph] = []

        def run() -> float:
            if not in_graph or self.ex.graphs is None:
                return self._timed(fn, in_graph=False)
            if not graph:
                graph.append(self._captured(fn))
            return self._graph_timed(graph[0])

        return lambda: run

    def gemm(self, tokens: int) -> Sample:
        """Every matrix product the cost model's gemm operator counts, over all layers: the attention
        projections (MLA's query, latent and output ones), the dense or shared-expert MLP and the router."""
        layers = [gemm_weights(layer) for layer in self.ex.model.layers]
        inputs = {w.shape[1]: None for weights in layers for w in weights}
        inputs = {size: self._randn(tokens, size) for size in inputs}

        def run() -> None:
            for weights in layers:
                for w in weights:
                    inputs[w.shape[1]] @ w.T

        return Sample("gemm", "gemm", self._features(prefill(tokens)), self._same(run), WEIGHT_PRIMING_RUNS)

    def moe(self, tokens: int) -> Sample:
        """The routed experts of every MoE layer (the cost model's moe operator) on the backend's kernels,
        routed by the layer's own router from random hidden states, as a step's tokens are."""
        hidden = self._randn(tokens, self.spec.hidden_size)
        layers = [(layer.moe, hidden @ layer.moe.router.T) for layer in self.ex.model.layers if layer.moe is not None]
        top_k = self.spec.num_experts_per_tok

        def run() -> None:
            for moe, logits in layers:
                self.backend.moe_experts(hidden, logits, moe, top_k)

        return Sample("moe", "moe", self._features(prefill(tokens)), self._same(run), WEIGHT_PRIMING_RUNS)

    def forward_without_attention(self, tokens: int) -> Sample:
        """The decoder's forward pass with attention replaced by the identity: GEMMs, routed experts, elementwise."""
        ids = torch.randint(0, self.spec.vocab_size, (tokens,), generator=self.gen).to(self.backend.device)
        positions = torch.arange(tokens).to(self.backend.device)
        v_dim = self.spec.v_head_dim if self.spec.is_mla else self.spec.head_dim  # what o_proj takes per head

        def run() -> None:
            self.ex.model.forward(ids, positions, lambda layer, q, k, v: q[..., :v_dim], self.backend.moe_experts)

        return Sample("elementwise", "forward without attention", self._features(prefill(tokens)), self._same(run), WEIGHT_PRIMING_RUNS)

    def kv_write(self, tokens: int) -> Sample:
        """KV writes into every layer's cache as the executor writes them (an int8 cache quantises with the layer's scales)."""
        bs = self.ex.block_size
        heads, key_size, value_size = kv_cache_layout(self.spec)
        k, v = (self._randn(tokens, heads, size, dtype=self.ex.attention_dtype) for size in (key_size, value_size))
        shape = prefill(tokens)
        layers = list(zip(self.ex.kv_caches, self.ex.kv_scales))

        def case() -> Run:
            table = self.builder.pool.tables(shape, self.rng)[0]
            slots = torch.tensor(slots_for(table, 0, tokens, bs), dtype=torch.int64).to(self.backend.device)
            return lambda: self._timed(lambda: [self.backend.write_kv(k, v, kc, vc, slots, sc) for (kc, vc), sc in layers])

        return Sample("kv_write", "kv_write", self._features(shape), case)

    def attention(self, shape: StepShape, pool: KVPool) -> Sample:
        """Paged attention over every layer of ``pool``, in the executor's attention dtype (an int8 cache
        dequantised with the layer's scales)."""
        s = self.spec
        q = self._randn(sum(x.new for x in shape), s.num_heads, s.head_dim, dtype=self.ex.attention_dtype)
        scale = self.ex.model.scale
        layers = list(zip(pool.caches, self.ex.kv_scales, self.ex.model.layers))

        def attend(meta: AttentionMetadata) -> list[torch.Tensor]:
            """Every layer's attention, as the executor calls it (MLA: with the layer's up-projections)."""
            return [self.backend.attention(q, kc, vc, meta, scale, sc) if layer.mla is None
                    else self.backend.mla_attention(q, kc, vc, meta, scale, layer.mla.w_uk, layer.mla.w_uv)
                    for (kc, vc), sc, layer in layers]

        def case() -> Run:
            tables = pool.tables(shape, self.rng)

            def run() -> float:
                meta = pool.metadata(shape, tables, self.backend.device)  # fresh: what a backend derives per step is part of the cost
                return self._timed(lambda: attend(meta))

            return run

        label = f"attention {'decode' if shape[0].is_decode else 'prefill'}"
        return Sample("attention", label, shape_features(shape, pool.block_size), case)

    def lm_head(self, rows: int) -> Sample:
        hidden = self._randn(rows, self.spec.hidden_size)
        # The LM head and sampling run outside a step's graph (the executor's sampler), so they are timed eagerly.
        return Sample("lm_head", "lm_head", self._features(decode(rows, 1)),
                      self._same(lambda: self.ex.model.logits(hidden), in_graph=False), WEIGHT_PRIMING_RUNS)

    def sampling(self, rows: int) -> Sample:
        """Greedy sampling, as the executor samples: an argmax over the fp32 logits."""
        logits = self.ex.model.logits(self._randn(rows, self.spec.hidden_size))
        return Sample("sampling", "sampling", self._features(decode(rows, 1)), self._same(lambda: logits.argmax(dim=-1), in_graph=False))

    def block_copy(self, blocks: int) -> Sample:
        def case() -> Run:
            ids = self.rng.permutation(self.ex.num_blocks)[: 2 * blocks].tolist()
            pairs = list(zip(ids[:blocks], ids[blocks:]))
            return lambda: self._timed(lambda: self.backend.copy_blocks(self.ex.kv_caches, pairs), in_graph=False)

        return Sample("block_copy", "block_copy", _only("copy_blocks", blocks), case)

    def swap(self, blocks: int, out: bool) -> Sample:
        def case() -> Run:
            device = self.rng.permutation(self.ex.num_blocks)[:blocks].tolist()
            host = self.rng.permutation(self.ex.num_host_blocks)[:blocks].tolist()
            pairs = list(zip(device, host)) if out else list(zip(host, device))
            src, dst = (self.ex.kv_caches, self.ex.host_caches) if out else (self.ex.host_caches, self.ex.kv_caches)
            return lambda: self._timed(lambda: self.backend.swap(src, dst, pairs), in_graph=False)

        return Sample("swap", "swap out" if out else "swap in", _only("swap_blocks", blocks), case)

    def step(self, shape: StepShape, passes: int = 1) -> Sample:
        """A whole step through the executor: what the simulator's step time must match.

        Both runs of an instance read the same blocks (fresh requests, as a sampled token makes
        a plan single-use), as consecutive decode steps of the same requests do. Each run is
        the median of ``passes`` forward passes (``Executor.step``'s repeats; one by default):
        the case's median over rounds is its estimate.
        """

        def case() -> Run:
            tables = self.builder.pool.tables(shape, self.rng)
            return lambda: self.ex.step(self.builder.plan(shape, tables), repeats=passes).duration_s

        return Sample("steps", f"steps {step_kind(shape)}", self._features(shape), case)



def gemm_weights(layer: LayerWeights) -> list[torch.Tensor]:
    """The weights of one layer's products that the cost model's gemm operator counts (``ModelSpec.per_token_matmul_params``):
    attention projections but MLA's kv_b_proj (priced with attention), a dense or the shared experts' MLP, the router."""
    mla = layer.mla
    weights = [layer.qkv_proj] if mla is None else [w for w in (mla.q_proj, mla.q_a_proj, mla.q_b_proj, mla.kv_a_proj) if w is not None]
    weights.append(layer.o_proj)
    mlp = layer.mlp if layer.moe is None else layer.moe.shared
    if mlp is not None:
        weights += [mlp.gate_up_proj, mlp.down_proj]
    return weights + ([layer.moe.router] if layer.moe is not None else [])


def _only(name: str, value: int) -> StepFeatures:
    return StepFeatures(**{**{f.name: 0.0 for f in fields(StepFeatures)}, name: float(value)})



def sweep_samples(benches: OperatorBenches, sweep: Sweep, pools: Sequence[KVPool], fits: Callable[[StepShape, int], bool]) -> list[Sample]:
    """Every case: attention at every pool's block size, whole steps and the other operators on the executor.

    ``fits(shape, block_size)`` drops shapes too large for the memory the profile may use.
    """
    samples = [benches.attention(shape, pool) for pool in pools for shape in sweep.attention_shapes() if fits(shape, pool.block_size)]
    samples += [benches.step(shape) for shape in sweep.step_shapes() if fits(shape, benches.ex.block_size)]
    for n in sweep.token_counts:
        samples += [benches.gemm(n), benches.forward_without_attention(n), benches.kv_write(n)]
        samples += [benches.moe(n)] if benches.spec.is_moe else []
    for rows in sweep.sample_rows:
        samples += [benches.lm_head(rows), benches.sampling(rows)]
    for blocks in sweep.moved_blocks:
        samples += [benches.block_copy(blocks), benches.swap(blocks, out=True), benches.swap(blocks, out=False)]
    return samples



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

    plan_detail = PlanDetail.SLOTS  # the executor's

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


def engine_run(executor: Executor, sweep: Sweep, seed: int, rate: float) -> StepRecords:
    """An engine-scheduled synthetic trace arriving at ``rate`` replayed on ``executor``, each step measured once.

    Two-turn conversations give what a serving run has: batched decodes of mixed contexts,
    prompts split into chunks beside them, and second turns that prefill only what their
    cached first turn does not cover (arriving faster than served: large batches; slower:
    the small ones of a server within its capacity). The engine's pool holds the
    ``max_num_seqs`` longest requests at once, as a server's pool is sized to its batch, so the
    blocks it hands out span a region about as large as a served batch's (on a CPU, a pool
    that fits the cache times very differently from one that does not).
    """
    longest = max(sweep.prefill_tokens)
    trace = synthesize(
        rate=rate, n_requests=sweep.engine_requests, prompt=Uniform(min(16, longest), longest), output=Uniform(2, 48), turns=2,
        think_time_s=0.05, hash_block_size=executor.block_size, seed=seed,
    )
    lengths = np.minimum(trace.prompt_tokens + trace.output_tokens, executor.spec.max_position)
    batch = max(sweep.decode_batches)
    blocks = int(np.sum(cdiv(np.sort(lengths)[-batch:], executor.block_size)))
    config = EngineConfig(
        num_blocks=min(executor.num_blocks, blocks), block_size=executor.block_size, max_model_len=int(lengths.max()),
        max_num_seqs=batch, max_num_batched_tokens=longest,
    )
    timer = RecordingTimer(executor, prefix=f"engine-{seed}-{rate:g}-")
    simulate(trace, EngineCore(config), timer)
    return timer.records
