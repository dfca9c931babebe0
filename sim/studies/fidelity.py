"""Published serving measurements replayed through the simulator: how far kvsim is from real engines.

Each row of ``sim/studies/published/serving.toml`` is one figure a public source measured on vLLM or
vllm-ascend (a TTFT, a TPOT, a throughput, a KV block count), with the configuration it was
measured under. :func:`predict_row` rebuilds that configuration (model, device, engine mode,
prompt and output lengths, number of prompts, arrival rate or client concurrency) and predicts
the same figure. Rows are ``fit`` or ``check``: :func:`fit_parameters` solves each fit row's one
named parameter (``fits``) so that row is matched, in file order, and check rows are only
predicted, never used to choose a value, so their error is the model's accuracy.
:func:`leave_one_source_out` goes further: each source's rows predicted with every parameter fitted
on the other sources' fit rows alone (its rule for a parameter only that source fits is there).

A row may carry vLLM's ``quantization`` and parallel flags (``tensor_parallel_size`` and the rest,
defaults off / 1); they go into the RunConfig it replays, so a multi-device row is priced by
sim/parallel/ (one rank plus its collectives) and a memory row is one rank's pool.

Each row runs the scheduler its source's engine ran (``scheduler``): ``fcfs`` for vLLM V1's mixed,
chunked steps; ``vllm-v0`` (policies/v0_scheduler.py) for vLLM V0 and vllm-ascend's AscendScheduler,
which run whole prompts in prefill-only steps. Rows of vLLM's V0 engine (``engine_core = "v0"``)
also pay the device's V0 host time per sequence per step (``[engine] v0_seq_s``,
sim/perf/engine_overhead.py).

Benchmark clients are reproduced as follows (vLLM ``benchmarks/`` and ``vllm bench``):
``batch`` = every prompt at t = 0 inside the engine (offline latency / throughput tests, no API
server); ``burst`` = every prompt at t = 0 through the API server (``--request-rate inf``);
``poisson`` = Poisson arrivals at ``rate`` (fixed seed); ``concurrency`` = a closed loop of
``concurrency`` clients, each sending its next prompt when the previous one finishes, solved as
a fixed point (the arrivals of one simulation are the finishes of the previous one).
Served requests (not ``batch``) pass the API server first, ``admit_s`` of its time each, and
reach the engine ``request_s`` after that (both the engine profile's, sim/perf/engine_overhead.py):
the server's time is shared by the requests in it, so at low load this is a fixed delay and a
burst of many prompts reaches the engine together, late. On V1 rows the same server also
streams every token, ``stream_s`` each, on a lane that takes one share (sim/perf/api_server.py):
clients see tokens when it has sent them.

ShareGPT rows (``input_total``/``output_total``: the sources give only totals) take their lengths
from :func:`dataset_lengths`, one of :data:`LENGTH_SOURCES`:
``sharegpt``: vLLM's own draw (traces/sharegpt.py: first two turns, its length filters, seeded
shuffle) of ``num_prompts`` conversations with the row's ``seed``, counted with the model's
tokenizer, from the ShareGPT file the ``[fidelity]`` extra installs. That file is cut off, so
the sample is drawn the same way from part of the data, not the run's own prompts: its totals
differ from the published ones (``kvsim fidelity`` prints both) and are used as drawn, data
and not a parameter. ``sharegpt-scaled``: that sample with each column scaled by one factor to
the published total (the shape from the file, the totals from the source; a sensitivity view,
not the default, added after the ``sharegpt`` results were seen). ``lognormal``: lengths drawn
lognormal (cv ``length_cv``), kept inside vLLM's filter and scaled so their sums equal the
published totals (per-request lengths an assumption, the totals not). ``auto`` (the default) is
``sharegpt`` where the extra is installed and the model has a tokenizer
(:data:`SHAREGPT_TOKENIZERS`), else ``lognormal``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace
from functools import cache
from pathlib import Path

import numpy as np

from kvsim.policies.registry import SCHEDULERS
from kvsim.sim.parallel.layout import ParallelLayout
from kvsim.sim.parallel.memory import plan_rank_memory, rank_graph_capture
from kvsim.sim.perf.device import (
    ENGINE_CORES,
    SHAPE_KEYS,
    DeviceProfile,
    OperatorCoefficients,
    engine_as_run,
    load_device,
)
from kvsim.sim.perf.graph_memory import GraphMemory
from kvsim.sim.perf.model_spec import QUANTIZATIONS, load_model
from kvsim.sim.perf.vllm_release import parse_version
from kvsim.sim.run.clients import bench_metric, bench_run
from kvsim.sim.run.config import ResolvedRun, RunConfig, resolve
from kvsim.sim.studies.sweep import parallel_map
from kvsim.sim.toml_io import load_toml
from kvsim.traces.errors import MissingExtraError
from kvsim.traces.schema import Trace
from kvsim.traces.sharegpt import (
    MAX_PROMPT,
    MAX_TOTAL,
    MIN_LEN,
    Conversations,
    bundled_dataset,
    read_conversations,
    sample_lengths,
)
from kvsim.traces.synth import poisson_arrivals
from kvsim.traces.tokenizers import get_tokenizer

PUBLISHED = Path(__file__).parent / "published" / "serving.toml"
SPLITS = ("fit", "check")
WORKLOADS = ("batch", "burst", "poisson", "concurrency", "memory")
METRICS = (
    "ttft_mean", "ttft_median", "ttft_p99", "tpot_mean", "tpot_median", "itl_median", "e2e_mean", "batch_latency",
    "output_throughput", "total_throughput", "request_throughput", "num_blocks", "graph_gib",
)  # fmt: skip
MEMORY_METRICS = ("num_blocks", "graph_gib")  # a memory row's: the KV pool's blocks, or what the graph capture took
# Parameters a fit row may solve, and the range searched (log-spaced bisection).
PARAMETERS: dict[str, tuple[float, float]] = {
    "engine.dispatch_s": (1e-7, 1e-3),
    "engine.request_s": (1e-5, 1.0),
    "operators.host_step.step_s": (1e-6, 0.1),
    "operators.gemm.compute_efficiency": (0.05, 1.0),
    "operators.moe.compute_efficiency": (0.05, 1.0),
    "operators.moe.w8a8_compute_efficiency": (0.05, 1.0),
    "operators.gemm.memory_efficiency": (0.2, 1.0),
    "operators.attn_prefill.compute_efficiency": (0.01, 1.0),
    "operators.attn_decode.half_context": (1.0, 1e5),
    "operators.attn_decode.memory_efficiency": (0.2, 1.0),
    "operators.attn_prefill.score_bytes": (1e-2, 1e3),
    "operators.host_seq.seq_s": (1e-7, 1e-2),
    "engine.admit_s": (1e-5, 0.2),
    "engine.v0_seq_s": (1e-7, 1e-2),
    "engine.stream_s": (1e-7, 1e-2),
    "operators.moe.group_flops": (1e6, 1e12),
    "graph_memory.pool_bytes": (1e6, 1e10),
    "graph_memory.layer_bytes": (1e3, 1e8),
    "graph_memory.moe_layer_bytes": (1e3, 1e8),
    "graph_memory.split_accumulators": (0.5, 256.0),
}
# Parameters that refine another where a device sets them (without one, the cost model runs on the other):
# a refinement left out of a fit is left unset, so its value is the other's, not its range's log-centre.
REFINES = {"operators.moe.w8a8_compute_efficiency": "operators.moe.compute_efficiency"}
# Fit rows whose parameter is a structural choice made by hand on that row (not solved here): the
# row is still reported as a fit row, never as accuracy.
HAND_FITTED = {"memory.hidden_buffers": "kvsim.sim.perf.memory.HIDDEN_BUFFERS",
               "memory.sampler_bytes_before_v017": "kvsim.sim.perf.vllm_release.SAMPLER_BYTES_BEFORE_V017",
               "memory.sampler_bytes_from_v017": "kvsim.sim.perf.vllm_release.SAMPLER_BYTES_FROM_V017",
               "memory.nccl_pipeline_buffers": "kvsim.sim.parallel.memory.NCCL_PIPELINE_BUFFERS"}
LENGTH_SOURCES = ("auto", "sharegpt", "sharegpt-scaled", "lognormal")  # how ShareGPT rows get their lengths (module docstring)
# The tokenizer vLLM's benchmark counted a model's ShareGPT lengths with (traces/tokenizers.py).
SHAREGPT_TOKENIZERS = {"qwen2.5-7b": "qwen2.5", "qwen3-8b": "qwen3", "qwen3-14b": "qwen3", "qwen3-32b": "qwen3",
                       "qwen3-30b-a3b": "qwen3", "qwen3-235b-a22b": "qwen3"}


@dataclass(frozen=True)
class Source:
    id: str
    url: str
    title: str
    quote: str  # the source's own wording of the figures used, verbatim


@dataclass(frozen=True)
class Row:
    """One published figure and the configuration it was measured under."""

    id: str
    source: str
    split: str
    metric: str
    measured: float  # in the metric's unit: seconds, tokens/s, requests/s or blocks
    model: str
    device: str
    engine: str  # engine and version, as the source states it
    parallelism: str  # the layout as ParallelLayout.describe() names it ("TP1", "TP4 x EP4"), checked against the sizes below
    workload: str
    wording: str  # the source's line this figure comes from
    fits: str = ""  # fit rows: the parameter solved on this row
    engine_mode: str = ""  # override of the device's [engine] mode ("eager" or "graph")
    async_scheduling: bool | None = None
    scheduler: str = "fcfs"  # vLLM V1's; "vllm-v0" = prefill-first (V0, vllm-ascend's AscendScheduler)
    engine_core: str = "v1"  # "v0": vLLM's V0 LLMEngine, which pays [engine] v0_seq_s per sequence per step
    vllm_version: str = ""  # the release whose KV-pool sizing rules apply where not the device engine's (GPUs)
    watermark: float = 0.0  # fraction of KV blocks admission keeps free (V0 and AscendScheduler: 0.01)
    enable_prefix_caching: bool | None = None  # vLLM's switch; None: the engine generation's default (see block_manager)
    num_prompts: int = 0
    input_len: int = 0  # fixed lengths (random dataset), or
    output_len: int = 0
    input_total: int = 0  # published totals of a dataset's lengths (ShareGPT)
    output_total: int = 0
    length_cv: float = 1.0
    rate: float = 0.0  # poisson: requests/s
    concurrency: int = 0  # concurrency: clients
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    max_model_len: int = 0  # 0: the model's
    block_size: int = 128
    memory_utilization: float = 0.9
    total_gib: float = 0.0  # memory rows: device memory the log reports
    seed: int = 0
    notes: str = ""
    # vLLM's --quantization and parallel flags, passed into the replayed RunConfig ("" / 1 / off: one device, the model's weights)
    quantization: str = ""
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    enable_expert_parallel: bool = False

    @property
    def solved_by_fit(self) -> bool:
        """A fit row whose parameter the fit solves (:data:`PARAMETERS`), not a constant set by hand."""
        return self.split == "fit" and self.fits in PARAMETERS

    @property
    def layout(self) -> ParallelLayout:
        return ParallelLayout(self.tensor_parallel_size, self.pipeline_parallel_size, self.data_parallel_size,
                              self.enable_expert_parallel)

    @property
    def block_manager(self) -> str:
        """The KV block manager the row's engine ran: vLLM V1 turns prefix caching on by default
        (vllm-ascend's V1 too), V0 leaves it off. It matters beyond shared prompts: a preempted
        request's computed blocks stay cached, so its re-admission does not compute them again."""
        on = self.engine_core == "v1" if self.enable_prefix_caching is None else self.enable_prefix_caching
        return "prefix" if on else "paged"

    @property
    def run(self) -> Row:
        """The measured run this figure comes from: the row with only what names the figure blanked.

        Two figures of one benchmark run (its TTFT and TPOT, its ITL and output throughput)
        share a run: fitting a parameter on one of them tunes the other too.
        """
        return replace(self, id="", split="", metric="", measured=0.0, wording="", fits="", notes="")


@dataclass
class Result:
    row: Row
    predicted: float

    @property
    def signed_error(self) -> float:
        return self.predicted / self.row.measured - 1.0

    def to_dict(self) -> dict:
        r = self.row
        return {
            "id": r.id, "source": r.source, "split": r.split, "metric": r.metric, "measured": r.measured,
            "predicted": self.predicted, "signed_error": self.signed_error, "fits": r.fits, "model": r.model,
            "device": r.device, "engine": r.engine, "engine_mode": r.engine_mode, "engine_core": r.engine_core,
            "scheduler": r.scheduler, "block_manager": r.block_manager, "parallelism": r.parallelism,
            "quantization": r.quantization or None,
            "tensor_parallel_size": r.tensor_parallel_size, "pipeline_parallel_size": r.pipeline_parallel_size,
            "data_parallel_size": r.data_parallel_size, "enable_expert_parallel": r.enable_expert_parallel,
            "workload": r.workload, "num_prompts": r.num_prompts, "input_len": r.input_len or None,
            "output_len": r.output_len or None, "input_total": r.input_total or None,
            "output_total": r.output_total or None, "rate": r.rate or None, "concurrency": r.concurrency or None,
            "wording": r.wording,
        }  # fmt: skip


@dataclass
class Published:
    sources: dict[str, Source]
    rows: list[Row] = field(default_factory=list)


def load_published(path: str | Path = PUBLISHED) -> Published:
    """Sources and rows of a published-figures file; errors name the file, row and field."""
    path = Path(path)
    data = load_toml(path)
    sources = {}
    for i, s in enumerate(data.get("source", [])):
        _require(s, ("id", "url", "title", "quote"), path, f"source[{i}]")
        sources[s["id"]] = Source(s["id"], s["url"], s["title"], s["quote"])
    allowed = {f.name for f in fields(Row)}
    rows = []
    for i, raw in enumerate(data.get("row", [])):
        where = f"row[{i}] ({raw.get('id', '?')})"
        unknown = sorted(set(raw) - allowed)
        if unknown:
            raise ValueError(f"{path}: {where}: unknown field(s) {unknown}")
        required = ("id", "source", "split", "metric", "measured", "model", "device", "engine", "parallelism", "workload", "wording")
        _require(raw, required, path, where)
        row = Row(**raw)
        _check_row(row, sources, path, where)
        rows.append(row)
    ids = [r.id for r in rows]
    if len(set(ids)) != len(ids):
        raise ValueError(f"{path}: duplicate row ids {sorted({i for i in ids if ids.count(i) > 1})}")
    return Published(sources, rows)


def _require(table: dict, keys: tuple[str, ...], path: Path, where: str) -> None:
    missing = [k for k in keys if k not in table]
    if missing:
        raise ValueError(f"{path}: {where}: missing field(s) {missing}")


def _check_row(row: Row, sources: dict[str, Source], path: Path, where: str) -> None:
    problems = []
    if row.source not in sources:
        problems.append(f"source {row.source!r} is not a [[source]] id")
    if row.split not in SPLITS:
        problems.append(f"split must be one of {SPLITS}")
    if row.metric not in METRICS:
        problems.append(f"metric must be one of {METRICS}")
    if row.vllm_version:
        try:
            parse_version(row.vllm_version)
        except ValueError as exc:
            problems.append(str(exc))
    if row.scheduler not in SCHEDULERS:
        problems.append(f"scheduler must be one of {sorted(SCHEDULERS)}")
    if row.engine_core not in ENGINE_CORES:
        problems.append(f"engine_core must be one of {ENGINE_CORES}")
    if row.workload not in WORKLOADS:
        problems.append(f"workload must be one of {WORKLOADS}")
    if not row.measured > 0:
        problems.append("measured must be > 0")
    if row.split == "fit" and row.fits not in PARAMETERS and row.fits not in HAND_FITTED:
        problems.append(f"a fit row names the parameter it fits, one of {sorted(PARAMETERS) + sorted(HAND_FITTED)}")
    if row.split == "check" and row.fits:
        problems.append("a check row fits nothing")
    if row.quantization and row.quantization not in QUANTIZATIONS:
        problems.append(f"quantization must be one of {QUANTIZATIONS} (or left out)")
    try:
        label = layout_label(row.layout)
    except ValueError as exc:
        problems.append(str(exc))
    else:
        if row.parallelism != label:
            problems.append(f"parallelism {row.parallelism!r} does not name the layout of its sizes ({label!r})")
    if row.workload == "poisson" and not row.rate > 0:
        problems.append("poisson rows need rate > 0")
    if row.workload == "concurrency" and row.concurrency < 1:
        problems.append("concurrency rows need concurrency >= 1")
    if row.workload == "memory" and not (row.metric in MEMORY_METRICS and row.total_gib > 0):
        problems.append(f"memory rows give total_gib and a metric of {', '.join(MEMORY_METRICS)}")
    if row.workload != "memory" and row.num_prompts < 1:
        problems.append("serving rows need num_prompts >= 1")
    if row.workload != "memory" and not ((row.input_len > 0 and row.output_len > 0) or (row.input_total > 0 and row.output_total > 0)):
        problems.append("give input_len and output_len, or input_total and output_total")
    if problems:
        raise ValueError(f"{path}: {where}: " + "; ".join(problems))


def layout_label(layout: ParallelLayout) -> str:
    """The layout as a row's ``parallelism`` spells it: ParallelLayout.describe() without the device count."""
    return layout.describe().split(" (")[0]


# --- devices as a row runs them ------------------------------------------------------------
def set_parameter(device: DeviceProfile, name: str, value: float) -> DeviceProfile:
    """A copy of ``device`` with one :data:`PARAMETERS` entry set."""
    kind, *rest = name.split(".")
    if kind == "engine":
        if device.engine is None:
            raise ValueError(f"device {device.name} has no [engine] table to fit {name}")
        return replace(device, engine=replace(device.engine, **{rest[0]: value}))
    if kind == "graph_memory":
        coefficients = device.graph_memory or GraphMemory(pool_bytes=0.0, layer_bytes=0.0)
        return replace(device, graph_memory=replace(coefficients, **{rest[0]: value}))
    op, key = rest
    current = device.operators[op]
    if key in ("step_s", "seq_s", "token_s", "launch_s", "block_s"):
        updated = replace(current, call_s=value)
    elif key in SHAPE_KEYS:
        updated = replace(current, shape=value)
    else:
        updated = replace(current, **{key: value})
    return device.with_operators({op: updated})


def get_parameter(device: DeviceProfile, name: str) -> float:
    kind, *rest = name.split(".")
    if kind == "engine":
        return float(getattr(device.engine, rest[0]))
    if kind == "graph_memory":
        return float(getattr(device.graph_memory, rest[0])) if device.graph_memory else 0.0
    op, key = rest
    coeffs: OperatorCoefficients = device.operators[op]
    if key in ("step_s", "seq_s", "token_s", "launch_s", "block_s"):
        return coeffs.call_s
    if name in REFINES and getattr(coeffs, key) is None:  # unset: the cost model runs on the refined parameter
        return get_parameter(device, REFINES[name])
    return coeffs.shape if key in SHAPE_KEYS else float(getattr(coeffs, key))


def row_device(row: Row, device: DeviceProfile) -> DeviceProfile:
    """The device as the row's engine ran it: its mode and async scheduling where the row says, for a V0
    engine the V0 host time per sequence added to the cost model's ``host_seq``, and the row's vLLM release."""
    enforce_eager = {"eager": True, "graph": False}.get(row.engine_mode)
    return engine_as_run(device, enforce_eager, row.async_scheduling, row.engine_core, row.vllm_version)


# --- replay ----------------------------------------------------------------------------------
def row_lengths(row: Row, lengths: str = "auto") -> tuple[np.ndarray, np.ndarray]:
    """Prompt and output lengths of the row's prompts: fixed, or a dataset's (:func:`dataset_lengths`)."""
    n = row.num_prompts
    if row.input_len:
        return np.full(n, row.input_len, dtype=np.int64), np.full(n, row.output_len, dtype=np.int64)
    source = dataset_lengths(row, lengths)
    if source == "sharegpt":
        return sharegpt_sample(n, row.seed, SHAREGPT_TOKENIZERS[row.model])
    return scaled_sharegpt_lengths(row) if source == "sharegpt-scaled" else lognormal_lengths(row)


def dataset_lengths(row: Row, lengths: str = "auto") -> str:
    """Where a ShareGPT row's lengths come from: one of :data:`LENGTH_SOURCES` but ``auto`` (module docstring).

    A ShareGPT sample asked for and not available (no extra, no tokenizer for the model) is a ValueError.
    """
    if lengths not in LENGTH_SOURCES:
        raise ValueError(f"lengths must be one of {LENGTH_SOURCES}, got {lengths!r}")
    if lengths == "lognormal":
        return "lognormal"
    why_not = sharegpt_unavailable(row.model)
    if why_not and lengths != "auto":
        raise ValueError(f"row {row.id}: no ShareGPT sample: {why_not}")
    return "lognormal" if why_not else "sharegpt" if lengths == "auto" else lengths


def sharegpt_unavailable(model: str) -> str:
    """Why a ShareGPT sample cannot be drawn for ``model`` ("" when it can)."""
    if model not in SHAREGPT_TOKENIZERS:
        return f"no tokenizer is known for {model} (traces/tokenizers.py)"
    try:
        get_tokenizer(SHAREGPT_TOKENIZERS[model])
        _bundled_conversations()
    except MissingExtraError as exc:
        return str(exc)
    return ""


@cache
def _bundled_conversations() -> Conversations:
    with bundled_dataset() as path:
        return read_conversations(path)


@cache
def sharegpt_sample(num_prompts: int, seed: int, tokenizer: str) -> tuple[np.ndarray, np.ndarray]:
    """vLLM's ShareGPT draw from the bundled file (read-only arrays, drawn once per process)."""
    sample = sample_lengths(_bundled_conversations(), num_prompts, seed, tokenizer)
    for column in (sample.prompt_tokens, sample.output_tokens):
        column.flags.writeable = False
    return sample.prompt_tokens, sample.output_tokens


def lognormal_lengths(row: Row) -> tuple[np.ndarray, np.ndarray]:
    """Lognormal lengths at the row's published totals, inside vLLM's ShareGPT filter (module docstring)."""
    n = row.num_prompts
    rng = np.random.default_rng(row.seed)
    sigma2 = math.log1p(row.length_cv**2)
    prompts = _with_total(rng.lognormal(-sigma2 / 2, math.sqrt(sigma2), size=n), row.input_total, np.full(n, MAX_PROMPT))
    outputs = _with_total(rng.lognormal(-sigma2 / 2, math.sqrt(sigma2), size=n), row.output_total, MAX_TOTAL - prompts)
    return prompts, outputs


def scaled_sharegpt_lengths(row: Row) -> tuple[np.ndarray, np.ndarray]:
    """vLLM's ShareGPT draw with each column scaled to the row's published total, inside vLLM's filter."""
    prompts, outputs = sharegpt_sample(row.num_prompts, row.seed, SHAREGPT_TOKENIZERS[row.model])
    scaled = _with_total(prompts.astype(np.float64), row.input_total, np.full(row.num_prompts, MAX_PROMPT))
    return scaled, _with_total(outputs.astype(np.float64), row.output_total, MAX_TOTAL - scaled)


def _with_total(weights: np.ndarray, total: int, cap: np.ndarray) -> np.ndarray:
    """Integer lengths proportional to ``weights``, within [MIN_LEN, cap], that sum to ``total`` (when the caps allow it)."""
    lengths = weights / weights.sum() * total
    for _ in range(50):  # scale the free ones until the clipped lengths sum to the total
        lengths = np.clip(lengths, MIN_LEN, cap)
        free = (lengths > MIN_LEN) & (lengths < cap)
        gap = total - lengths.sum()
        if abs(gap) < 0.5 or not free.any():
            break
        lengths[free] *= 1 + gap / lengths[free].sum()
    out = np.floor(lengths).astype(np.int64)
    room = np.flatnonzero(out < cap)
    out[room[: max(total - int(out.sum()), 0)]] += 1  # exact total
    return out


def _resolved(row: Row, device: DeviceProfile) -> ResolvedRun:
    config = RunConfig(
        trace="(fidelity row)", model=row.model, device=row.device, block_size=row.block_size,
        memory_utilization=row.memory_utilization, max_num_seqs=row.max_num_seqs,
        max_num_batched_tokens=row.max_num_batched_tokens, max_model_len=row.max_model_len or None,
        block_manager=row.block_manager, scheduler=row.scheduler, watermark=row.watermark, seed=row.seed, engine_core=row.engine_core,
        vllm_version=row.vllm_version,
        quantization=row.quantization or None, tensor_parallel_size=row.tensor_parallel_size,
        pipeline_parallel_size=row.pipeline_parallel_size, data_parallel_size=row.data_parallel_size,
        enable_expert_parallel=row.enable_expert_parallel,
    )  # fmt: skip
    resolved = resolve(config)
    return replace(resolved, device=device)


def predict_row(row: Row, device: DeviceProfile, lengths: str = "auto") -> float:
    """The row's metric as kvsim predicts it on ``device`` (already the row's device); ``lengths``:
    where a ShareGPT row's lengths come from (:data:`LENGTH_SOURCES`)."""
    device = row_device(row, device)
    if row.workload == "memory":
        return _graph_gib(row, device) if row.metric == "graph_gib" else float(_memory_blocks(row, device))
    resolved = _resolved(row, device)
    trace = row_trace(row, lengths)
    # offline tests (batch) send straight into the engine; served rows pass the API server
    clients = row.concurrency if row.workload == "concurrency" else 0
    sent, replay = bench_run(resolved, trace, api_server=row.workload != "batch", max_concurrency=clients)
    return bench_metric(row.metric, replay, trace.prompt_tokens, trace.output_tokens, sent)


def row_command(row: Row, trace_file: str) -> list[str] | None:
    """The ``kvsim simulate`` command that predicts the row's figure (``summary.json``'s ``bench`` block, key
    ``row.metric``) on the bundled device, with ``trace_file`` holding :func:`row_trace`; None for memory rows.

    Offline batch rows send every prompt at once straight into the engine: ``--max-concurrency`` the
    number of prompts and no API server, which is the same run."""
    if row.workload == "memory":
        return None
    command = ["kvsim", "simulate", "--trace", trace_file, "--model", row.model, "--device", row.device,
               "--block-manager", row.block_manager, "--block-size", str(row.block_size),
               "--gpu-memory-utilization", f"{row.memory_utilization:g}", "--max-num-seqs", str(row.max_num_seqs),
               "--max-num-batched-tokens", str(row.max_num_batched_tokens), "--scheduler", row.scheduler,
               "--watermark", f"{row.watermark:g}", "--seed", str(row.seed)]  # fmt: skip
    if row.max_model_len:
        command += ["--max-model-len", str(row.max_model_len)]
    if row.quantization:
        command += ["--quantization", row.quantization]
    for flag, size in (("-tp", row.tensor_parallel_size), ("-pp", row.pipeline_parallel_size), ("-dp", row.data_parallel_size)):
        if size > 1:
            command += [flag, str(size)]
    if row.enable_expert_parallel:
        command.append("--enable-expert-parallel")
    if row.engine_mode:
        command.append("--enforce-eager" if row.engine_mode == "eager" else "--no-enforce-eager")
    if row.async_scheduling is not None:
        command.append("--async-scheduling" if row.async_scheduling else "--no-async-scheduling")
    if row.engine_core != "v1":
        command += ["--engine-core", row.engine_core]
    if row.vllm_version:
        command += ["--vllm-version", row.vllm_version]
    if row.workload == "batch":
        command += ["--max-concurrency", str(row.num_prompts)]
    else:
        command.append("--api-server")
        if row.workload == "concurrency":
            command += ["--max-concurrency", str(row.concurrency)]
    return command


def row_trace(row: Row, lengths: str = "auto") -> Trace:
    """The requests a row's benchmark sent: its lengths, at Poisson arrivals (``poisson``) or all at once."""
    prompts, outputs = row_lengths(row, lengths)
    n = row.num_prompts
    arrivals = poisson_arrivals(row.rate, n=n, rng=row.seed) if row.workload == "poisson" else np.zeros(n)
    return Trace(arrival_s=arrivals, prompt_tokens=prompts, output_tokens=outputs, source=f"fidelity row {row.id}")


def _memory_blocks(row: Row, device: DeviceProfile) -> int:
    """KV blocks as the engine sizes them, on a device reporting ``total_gib`` of memory: one rank's
    under a parallel layout (every rank of a layout ends with the same count, as vLLM's do)."""
    sized = replace(device, hbm_bytes=int(round(row.total_gib * 2**30)))
    plan = plan_rank_memory(
        load_model(row.model, quantization=row.quantization or None), sized, row.layout,
        block_size=row.block_size, memory_utilization=row.memory_utilization,
        max_num_batched_tokens=row.max_num_batched_tokens, max_num_seqs=row.max_num_seqs,
        max_model_len=row.max_model_len or None,
    )  # fmt: skip
    return plan.num_blocks


def _graph_gib(row: Row, device: DeviceProfile) -> float:
    """GiB one rank's graph capture takes (sim/perf/graph_memory.py); 0 where the device has no figure."""
    model = load_model(row.model, quantization=row.quantization or None)
    capture = rank_graph_capture(device, model, row.layout, row.max_num_seqs)
    return capture.total_bytes / 2**30 if capture else 0.0


# --- fit and table ---------------------------------------------------------------------------
# Metrics whose figure is linear in the parameters their fit rows solve (graph_memory.py prices a capture
# as a sum of coefficient x count): a device's fit rows of one such metric are solved together, exactly.
LINEAR_METRICS = ("graph_gib",)


def fit_parameters(
    rows: list[Row], devices: dict[str, DeviceProfile], steps: int = 14, passes: int = 2, lengths: str = "auto"
) -> dict[str, DeviceProfile]:
    """Solve each fit row's parameter on its device so that row is matched, rows in file order,
    ``passes`` times over (a later row's parameter moves an earlier row's figure a little).

    A row is solved alone by :func:`bisect_row`; the rows of a :data:`LINEAR_METRICS` metric on
    one device are solved together by :func:`solve_linear_rows`, where the first of them stands in
    the order (one at a time, coupled linear rows converge only slowly). Check rows are never read.
    """
    devices = dict(devices)
    fit_rows = [r for r in rows if r.solved_by_fit]
    for _ in range(passes):
        solved: set[tuple[str, str]] = set()
        for row in fit_rows:
            if row.metric not in LINEAR_METRICS:
                devices[row.device] = bisect_row(row, devices[row.device], steps, lengths)
            elif (row.device, row.metric) not in solved:
                solved.add((row.device, row.metric))
                group = [r for r in fit_rows if (r.device, r.metric) == (row.device, row.metric)]
                devices[row.device] = solve_linear_rows(group, devices[row.device], lengths)
    return devices


def bisect_row(row: Row, device: DeviceProfile, steps: int, lengths: str) -> DeviceProfile:
    """``device`` with the row's parameter set so the row is matched: log-spaced bisection inside the
    parameter's range; a row whose figure the range cannot reach keeps the end that comes closest."""
    lo, hi = PARAMETERS[row.fits]

    def error(value: float) -> float:
        return predict_row(row, set_parameter(device, row.fits, value), lengths) / row.measured - 1.0

    e_lo, e_hi = error(lo), error(hi)
    if e_lo * e_hi <= 0:
        for _ in range(steps):
            mid = math.sqrt(lo * hi)
            e_mid = error(mid)
            if e_mid * e_lo > 0:
                lo, e_lo = mid, e_mid
            else:
                hi, e_hi = mid, e_mid
    return set_parameter(device, row.fits, lo if abs(e_lo) <= abs(e_hi) else hi)


def solve_linear_rows(rows: list[Row], device: DeviceProfile, lengths: str) -> DeviceProfile:
    """``device`` with the rows' parameters set so the rows are matched together, their figures being
    linear in those parameters: one Newton step from the device's values, each column of the Jacobian
    from one parameter moved by its own value (or its range's low end, from 0), is then exact.
    Least squares on relative errors where rows outnumber parameters; each value kept in its range."""
    names = list(dict.fromkeys(r.fits for r in rows))
    measured = np.array([r.measured for r in rows])
    base = np.array([predict_row(r, device, lengths) for r in rows])
    values = np.array([get_parameter(device, n) for n in names])
    jacobian = np.empty((len(rows), len(names)))
    for j, name in enumerate(names):
        step = max(values[j], PARAMETERS[name][0])
        moved = set_parameter(device, name, values[j] + step)
        jacobian[:, j] = [(predict_row(r, moved, lengths) - b) / step for r, b in zip(rows, base, strict=True)]
    delta = np.linalg.lstsq(jacobian / measured[:, None], (measured - base) / measured, rcond=None)[0]
    for name, value in zip(names, values + delta, strict=True):
        lo, hi = PARAMETERS[name]
        device = set_parameter(device, name, float(min(max(value, lo), hi)))
    return device


FIT_TOLERANCE = 1e-3  # a pass that moves no fitted parameter by more than this (relative) ends the fit
FIT_MAX_PASSES = 6


@dataclass(frozen=True)
class FixedPoint:
    """The fit run pass after pass, each from the previous pass's result (:func:`fit_to_fixed_point`).

    ``moves``: per pass, the largest relative move of any fitted parameter (``"device:parameter"``,
    move) against its value before that pass; the first pass's is against the starting devices.
    """

    devices: dict[str, DeviceProfile]
    moves: list[tuple[str, float]]
    tolerance: float

    @property
    def converged(self) -> bool:
        """True when the last pass moved nothing beyond the tolerance: run again from its own result,
        the fit gives back (within the tolerance) the parameters it started from."""
        return bool(self.moves) and self.moves[-1][1] <= self.tolerance

    def describe(self) -> str:
        name, move = self.moves[-1] if self.moves else ("", 0.0)
        if self.converged:
            return (f"fit: a fixed point after {len(self.moves)} passes (the last moved no parameter by more than "
                    f"{move:.3%}; tolerance {self.tolerance:.2%})")
        return (f"fit: NOT a fixed point after {len(self.moves)} passes: the last still moved {name} by {move:.2%} "
                f"(tolerance {self.tolerance:.2%})")

    def to_dict(self) -> dict:
        return {"converged": self.converged, "passes": len(self.moves), "tolerance": self.tolerance,
                "largest_move_per_pass": [{"parameter": n, "relative_move": m if math.isfinite(m) else None} for n, m in self.moves]}


def fit_to_fixed_point(
    rows: list[Row], devices: dict[str, DeviceProfile], tolerance: float = FIT_TOLERANCE,
    max_passes: int = FIT_MAX_PASSES, steps: int = 14, lengths: str = "auto", jobs: int | None = 1,
) -> FixedPoint:
    """Each device's fit rows fitted to their fixed point (:func:`device_fixed_point`); the moves of a
    pass are the largest over the devices still fitting in it.

    A device's parameters depend on its own rows alone, so devices are fitted apart, and ``jobs``
    worker processes (None: one per core) take them in parallel, with the same results as one.
    """
    names = sorted({r.device for r in rows if r.solved_by_fit})
    if not names:
        return FixedPoint(devices, [("", 0.0)], tolerance)
    tasks = [([r for r in rows if r.device == name], {name: devices[name]}, tolerance, max_passes, steps, lengths) for name in names]
    fits = parallel_map(device_fixed_point, tasks, jobs=jobs)
    passes = max(len(fit.moves) for fit in fits)
    moves = [max((fit.moves[i] for fit in fits if i < len(fit.moves)), key=lambda kv: kv[1]) for i in range(passes)]
    return FixedPoint({**devices, **{name: fit.devices[name] for name, fit in zip(names, fits, strict=True)}}, moves, tolerance)


def device_fixed_point(
    rows: list[Row], devices: dict[str, DeviceProfile], tolerance: float, max_passes: int, steps: int, lengths: str,
) -> FixedPoint:
    """:func:`fit_parameters` one pass at a time, each from the previous pass's result, until a pass
    moves no fitted parameter by more than ``tolerance`` (relative), or ``max_passes`` passes.

    A later fit row's parameter moves an earlier row's figure, so one pass does not match every
    fit row; a pass that moves nothing is a fixed point. The tolerance must exceed the bisection's
    own resolution (``steps`` halvings of the log range: under 0.1 % for every range of
    :data:`PARAMETERS` at 14 steps), or rounding alone keeps the fit from converging.
    """
    fitted = sorted({(r.device, r.fits) for r in rows if r.solved_by_fit})
    moves: list[tuple[str, float]] = []
    for _ in range(max_passes):
        before = {(d, n): get_parameter(devices[d], n) for d, n in fitted}
        devices = fit_parameters(rows, devices, steps, passes=1, lengths=lengths)
        move = {f"{d}:{n}": _relative_move(before[d, n], get_parameter(devices[d], n)) for d, n in fitted}
        moves.append(max(move.items(), key=lambda kv: kv[1], default=("", 0.0)))
        if moves[-1][1] <= tolerance:
            break
    return FixedPoint(devices, moves, tolerance)


def _relative_move(before: float, after: float) -> float:
    """How far a parameter moved, relative; from 0 (a device file that does not set it) any move is infinite."""
    if before == 0:
        return 0.0 if after == 0 else math.inf
    return abs(after / before - 1)


def bundled_devices_for(rows: list[Row]) -> dict[str, DeviceProfile]:
    return {name: load_device(name) for name in sorted({r.device for r in rows})}


def evaluate(rows: list[Row], devices: dict[str, DeviceProfile], lengths: str = "auto", jobs: int | None = 1) -> list[Result]:
    """Every row predicted; rows are independent, so ``jobs`` worker processes share them (the same results;
    None: one per core)."""
    predicted = parallel_map(predict_row, [(row, devices[row.device], lengths) for row in rows], jobs=jobs)
    return [Result(row, value) for row, value in zip(rows, predicted, strict=True)]


def runs_with_fit_rows(rows: list[Row]) -> set[Row]:
    """The runs (:attr:`Row.run`) that some fit row was measured in."""
    return {r.run for r in rows if r.split == "fit"}


SUMMARIES = ("fit", "check", "independent check")


def summarize_errors(results: list[Result], split: str) -> dict:
    """Median and largest |signed error| of one of :data:`SUMMARIES`, and how many rows it has.

    "independent check": the check rows of runs no fit row was measured in, the only rows no
    fitted parameter has seen any figure of.
    """
    fitted_runs = runs_with_fit_rows([r.row for r in results])
    if split == "independent check":
        chosen = [r for r in results if r.row.split == "check" and r.row.run not in fitted_runs]
    else:
        chosen = [r for r in results if r.row.split == split]
    errors = np.array([abs(r.signed_error) for r in chosen])
    if errors.size == 0:
        return {"rows": 0, "median_abs_error": None, "max_abs_error": None}
    return {"rows": int(errors.size), "median_abs_error": float(np.median(errors)), "max_abs_error": float(errors.max())}


# --- leave one source out --------------------------------------------------------------------
@dataclass
class SourceLeftOut:
    """One source's rows predicted with every parameter fitted without any of its rows.

    ``priors``: ``"device:parameter"`` -> (value, where it came from) for each parameter that only
    this source's fit rows set (:func:`leave_one_source_out` says which value it takes); ``fits``:
    each device fitted again without this source, with its convergence;
    ``hand_fitted``: hand-fitted constants (:data:`HAND_FITTED`) set on this source's rows, which
    stay as they are (no code refits them), so for those this source is not left out.
    """

    source: str
    results: list[Result]
    priors: dict[str, tuple[float, str]] = field(default_factory=dict)
    hand_fitted: list[str] = field(default_factory=list)
    fits: dict[str, FixedPoint] = field(default_factory=dict)  # device -> its fit without this source


def prior_value(name: str) -> float:
    """The log-centre of a parameter's search range (:data:`PARAMETERS`): the value used where no
    row outside the left-out source tells anything about it, fixed before any row was looked at."""
    lo, hi = PARAMETERS[name]
    return math.sqrt(lo * hi)


def leave_one_source_out(
    rows: list[Row], bundled: dict[str, DeviceProfile], fitted: dict[str, DeviceProfile], full: list[Result],
    tolerance: float = FIT_TOLERANCE, max_passes: int = FIT_MAX_PASSES, lengths: str = "auto", jobs: int | None = 1,
) -> list[SourceLeftOut]:
    """For each source (in file order), its rows predicted after fitting every parameter on the other
    sources' fit rows alone.

    The rule for a parameter whose only fit rows belong to the left-out source: it is not
    identified without them, and the bundled device value is no prior (the device files hold the
    values these very rows fitted), so it takes the value the full fit gives the same parameter
    on another device from a row of another source (the median where several do), and where there
    is none, the log-centre of its search range (:func:`prior_value`); each such parameter is
    named with its value and origin per source. Hand-fitted constants stay (:class:`SourceLeftOut`).

    ``fitted``: the full fit's devices; ``full``: every row's result with them. A device's fitted
    parameters depend only on its own fit rows, so only the devices where the left-out source has
    fit rows are fitted again (:func:`fit_to_fixed_point`, starting from ``bundled``); the other
    devices and a source without fit rows reuse the full fit. Sources are independent of each
    other: ``jobs`` worker processes take them in parallel, with the same results as one.
    """
    tasks = [(source, rows, bundled, fitted, full, tolerance, max_passes, lengths) for source in dict.fromkeys(r.source for r in rows)]
    return parallel_map(_leave_out, tasks, jobs=jobs)


def _leave_out(
    source: str, rows: list[Row], bundled: dict[str, DeviceProfile], fitted: dict[str, DeviceProfile], full: list[Result],
    tolerance: float, max_passes: int, lengths: str,
) -> SourceLeftOut:
    """One source of :func:`leave_one_source_out`."""
    fitters = {(r.device, r.fits): r for r in rows if r.solved_by_fit}
    own = [r for r in rows if r.source == source]
    others = [r for r in rows if r.source != source]
    refit = sorted({r.device for r in own if (r.device, r.fits) in fitters})
    devices = dict(fitted)
    priors: dict[str, tuple[float, str]] = {}
    fits: dict[str, FixedPoint] = {}
    for name in refit:
        device = bundled[name]
        for dev, parameter in fitters:
            if dev != name or any(r.device == dev and r.fits == parameter for r in others):
                continue
            value, origin = _prior(parameter, dev, source, fitters, fitted, device)
            priors[f"{dev}:{parameter}"] = (value, origin)
            device = set_parameter(device, parameter, value)
        fits[name] = fit_to_fixed_point([r for r in others if r.device == name], {name: device}, tolerance, max_passes,
                                        lengths=lengths)
        devices[name] = fits[name].devices[name]
    full_by_id = {r.row.id: r for r in full}
    results = [Result(r, predict_row(r, devices[r.device], lengths)) if r.device in refit else full_by_id[r.id] for r in own]
    hand = sorted({r.fits for r in own if r.fits in HAND_FITTED})
    return SourceLeftOut(source, results, priors, hand, fits)


def _prior(parameter: str, device: str, source: str, fitters: dict[tuple[str, str], Row],
           fitted: dict[str, DeviceProfile], profile: DeviceProfile) -> tuple[float, str]:
    """A left-out parameter's value and its origin (:func:`leave_one_source_out`'s rule); ``profile``:
    the device as the refit starts from, whose refined parameter a refinement (:data:`REFINES`) takes."""
    elsewhere = {dev: row.id for (dev, p), row in fitters.items() if p == parameter and dev != device and row.source != source}
    if elsewhere:
        value = float(np.median([get_parameter(fitted[dev], parameter) for dev in elsewhere]))
        return value, "fitted on " + ", ".join(f"{dev} (row {row_id})" for dev, row_id in sorted(elsewhere.items()))
    if parameter in REFINES:
        return get_parameter(profile, REFINES[parameter]), f"unset: {REFINES[parameter]}, as without the fit"
    return prior_value(parameter), "log-centre of its search range"


def summarize_left_out(left_out: list[SourceLeftOut]) -> dict:
    """Median and largest |signed error| over every left-out source's rows, and per source."""
    pooled = [abs(r.signed_error) for s in left_out for r in s.results]
    summary = {"rows": len(pooled), "sources": len(left_out),
               "median_abs_error": float(np.median(pooled)) if pooled else None,
               "max_abs_error": float(max(pooled)) if pooled else None, "per_source": {}}  # fmt: skip
    for s in left_out:
        errors = [abs(r.signed_error) for r in s.results]
        summary["per_source"][s.source] = {
            "rows": len(errors), "median_abs_error": float(np.median(errors)), "max_abs_error": float(max(errors)),
            "priors": {k: {"value": v, "from": origin} for k, (v, origin) in s.priors.items()},
            "hand_fitted_kept": s.hand_fitted,
            "refits": {device: fit.to_dict() for device, fit in s.fits.items()},
        }  # fmt: skip
    return summary
