"""Device profiles: the hardware figures and calibrated coefficients the cost and memory models read.

A device is one TOML file (``sim/devices/*.toml``, a file in a directory the caller names, or
any path). Bundled files carry the source of every figure in a comment; ``save_device`` writes
a profile (e.g. one calibrated by ``kvsim profile``) that ``load_device`` reads back identically.

Layout::

    name = "ascend-910b3"
    source = "..."                    # provenance, kept when a calibrated copy is saved
    platform = "ascend"               # vLLM's platform: ascend, cuda or cpu
    generation = "910b"               # optional: ascend 910b / 910c, cuda ampere / hopper
    hbm_bytes = 68719476736           # device memory the runtime reports as total
    hbm_bandwidth = 1.6e12            # B/s
    vector_flops = 1.83e13            # FLOP/s of the vector (non-matrix) units
    host_link_bandwidth = 3.2e10      # B/s one way, device <-> host (swap)
    interconnect_bandwidth = 1.96e11  # B/s device <-> device (0: none)
    launch_overhead_s = 3e-6          # fixed cost of one kernel launch
    runtime_reserve_bytes = 1073741824  # memory the runtime holds outside the framework's allocator
    host_memory_bytes = 137438953472  # optional: host DRAM per device (its share of the server's)
    host_link_latency_s = 1e-5        # optional: fixed cost of one host -> device transfer
    ssd_bandwidth = 6.8e9             # optional: B/s one way, the local NVMe SSD -> host
    ssd_latency_s = 1e-4              # optional: fixed cost of one SSD read
    padded_attention = false          # optional: attention pads a batch to its longest sequence
    gemv_rows = 0                     # optional: matrix products of fewer rows run one row at a time
                                      # optional [row_count_s]: "2" = 2.1e-3 (seconds a step of that
                                      #  many tokens takes beyond its operators; kvsim profile measures it)
    attention_query_tile = 0          # optional: padded prefill attention runs query tiles of this many rows

    [matrix_flops]                    # FLOP/s of the matrix units, dense, per input dtype
    fp16 = ...; bf16 = ...; fp32 = ...; int8 = ...

    [operators.gemm]                  # one table per operator class of the cost model
    compute_efficiency = 0.7          # achieved fraction of the matrix (or vector) peak
    memory_efficiency = 0.85          # achieved fraction of the bandwidth it streams over
    launch_s = 3e-6                   # optional: this operator's fixed cost per launch
    w8a8_compute_efficiency = 0.34    # optional (gemm, moe): the fraction of the int8 peak under W8A8

    [operators.paged_gather]
    block_s = 2e-8                    # seconds per KV block touched, per layer

    [operators.host_step]             # optional (default 0: not modelled); kvsim profile measures it
    step_s = 1e-4                     # seconds of host work per step that runs the model

    [engine]                          # optional: how the serving engine runs a step
    mode = "graph"                    # (sim/perf/engine_overhead.py; without it, kernels and host
    dispatch_s = 3e-5                 #  terms simply add up, as for the CPU executor)
    capture_sizes = [1, 2, 4, 8]

A file may start from another device with ``base = "h100-sxm"`` (a name, looked up beside the
file and then among the bundled devices, or a ``.toml`` path relative to the file) and give only
what differs: its tables merge into the base's key by key, and ``name`` is never inherited. That
is how a part of the same family carries its sibling's fitted terms (``h200.toml``), and how a
what-if device ("the 910B3 with twice the HBM bandwidth") is three lines.

Which keys each operator takes is :data:`OPERATOR_KEYS`; the cost model documents what each
operator's formula does with them.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

from kvsim.sim.perf.engine_overhead import EngineProfile, engine_toml_lines, parse_engine
from kvsim.sim.perf.graph_memory import GraphMemory, graph_memory_toml_lines, parse_graph_memory
from kvsim.sim.perf.topology import Topology, parse_topology, topology_toml_lines
from kvsim.sim.perf.vllm_release import parse_version
from kvsim.sim.toml_io import load_toml, toml_value

DEVICES_DIR = Path(__file__).parents[1] / "devices"  # sim/devices/, the data beside the rooms

MATRIX_DTYPES = ("fp16", "bf16", "fp32", "int8")

# Operator class -> the coefficients its formula reads (see sim/perf/cost_model.py).
# ``launch_s`` is optional everywhere it appears and defaults to the device's launch_overhead_s.
OPERATOR_KEYS: dict[str, tuple[str, ...]] = {
    "gemm": ("compute_efficiency", "memory_efficiency", "launch_s", "half_tokens", "w8a8_compute_efficiency"),
    "moe": ("compute_efficiency", "memory_efficiency", "launch_s", "half_tokens", "launches", "w8a8_compute_efficiency",
            "group_flops"),
    "elementwise": ("compute_efficiency", "memory_efficiency", "launch_s"),
    "kv_write": ("memory_efficiency", "launch_s"),
    "attn_prefill": ("compute_efficiency", "memory_efficiency", "launch_s", "score_bytes"),
    "attn_decode": ("compute_efficiency", "memory_efficiency", "launch_s", "half_context"),
    "paged_gather": ("block_s",),
    "decode_chain": ("block_s",),
    "prefill_chain": ("block_s",),
    "lm_head": ("compute_efficiency", "memory_efficiency", "launch_s"),
    "sampling": ("compute_efficiency", "memory_efficiency", "launch_s"),
    "block_copy": ("memory_efficiency", "launch_s"),
    "swap": ("memory_efficiency", "launch_s"),
    "host_step": ("step_s",),
    "host_seq": ("seq_s",),
    "host_token": ("token_s",),
}
# How an operator's cost depends on its shape beyond its work (0 = not at all; cost_model.py):
# ``half_*`` the size at which it reaches half its efficiency, ``score_bytes`` the bytes per
# (query, key, head) pair of attention kernels that write their score matrix to HBM.
SHAPE_KEYS = ("half_tokens", "half_context", "score_bytes")
OPTIONAL_OPERATOR_KEYS = frozenset({"launch_s", "w8a8_compute_efficiency", "group_flops", *SHAPE_KEYS})
# The key that holds an operator's fixed cost per call (OperatorCoefficients.call_s).
CALL_KEYS = ("launch_s", "block_s", "step_s", "seq_s", "token_s")
# Operators a profile may leave out, costing nothing then: host overhead and the attention kernel's serial
# block walks are measured figures (kvsim profile), and the bundled roofline estimates have no source for one.
OPTIONAL_OPERATORS = frozenset({"host_step", "host_seq", "host_token", "decode_chain", "prefill_chain"})
# Operators a profile may leave out, priced then as the operator named: an MoE layer's grouped
# expert matmuls run on the matrix units as the dense GEMMs do. A profile measured on an MoE model
# (kvsim profile) or fitted on MoE serving figures sets its own table; keys that table leaves out
# are the named operator's (a device file may set only the grouped matmul's half_tokens).
INHERITED_OPERATORS = {"moe": "gemm"}

PLATFORMS = ("ascend", "cuda", "cpu")
GENERATIONS = {"ascend": ("910b", "910c"), "cuda": ("ampere", "hopper"), "cpu": ()}

_SCALAR_FIELDS: dict[str, type] = {
    "hbm_bytes": int,
    "hbm_bandwidth": float,
    "vector_flops": float,
    "host_link_bandwidth": float,
    "interconnect_bandwidth": float,
    "launch_overhead_s": float,
    "runtime_reserve_bytes": int,
}
_MAY_BE_ZERO = frozenset({"interconnect_bandwidth", "launch_overhead_s", "runtime_reserve_bytes"})
# What the KV tiers below HBM read (policies/kv_tiers.py); optional, 0 where a file does not state them.
_TIER_FIELDS: dict[str, type] = {
    "host_memory_bytes": int,
    "host_link_latency_s": float,
    "ssd_bandwidth": float,
    "ssd_latency_s": float,
}


@dataclass(frozen=True)
class OperatorCoefficients:
    """Calibratable coefficients of one operator class.

    ``call_s`` is the fixed cost of one call: a kernel launch (TOML key ``launch_s``), or for
    ``paged_gather`` one KV block touched in one layer (``block_s``), for ``host_step`` one
    step (``step_s``), for ``host_seq`` one sequence of a step (``seq_s``), for ``host_token``
    one token (``token_s``). An efficiency is None where the operator's formula does not read
    it. ``shape`` is the value of the operator's shape key (:data:`SHAPE_KEYS`), 0 without one.
    ``launches`` (moe only): the kernels one MoE layer launches, where an engine's MoE path is known
    to launch another number than the cost model's generic count (None: that count).
    ``group_flops`` (moe only): the work each touched expert's grouped matmul adds per MoE layer whatever
    the expert's size, a fixed cost per group (0: none), where ``half_tokens`` adds rows of that expert.
    ``w8a8_compute_efficiency`` (gemm and moe): the share of the 8-bit matrix peak the operator reaches
    when a W8A8 model runs it there; an engine's 8-bit path (scaled FP8/INT8 GEMMs, per-block scales)
    need not reach the share its 16-bit path does of a peak twice as high (None: ``compute_efficiency``).
    """

    call_s: float
    compute_efficiency: float | None = None
    memory_efficiency: float | None = None
    shape: float = 0.0
    launches: int | None = None
    w8a8_compute_efficiency: float | None = None
    group_flops: float = 0.0


@dataclass(frozen=True)
class DeviceProfile:
    name: str
    hbm_bytes: int
    hbm_bandwidth: float
    matrix_flops: dict[str, float]
    vector_flops: float
    host_link_bandwidth: float
    interconnect_bandwidth: float
    launch_overhead_s: float
    runtime_reserve_bytes: int
    operators: dict[str, OperatorCoefficients]
    # vLLM's platform for the part (:data:`PLATFORMS`) and its generation within it (:data:`GENERATIONS`; "" for
    # none the rules name): what vLLM and vllm-ascend decide by (block size, scheduler budget, the MoE exchange,
    # what a platform turns off), so a device of any name, a what-if one among them, is taken for what it is.
    platform: str
    source: str = ""
    generation: str = ""
    # True where the attention kernels run each of a step's decode and prefill groups as one dense
    # batch, every sequence padded to the group's longest query and context in whole blocks (kvsim's
    # portable PyTorch path); False for paged kernels that skip padding (torch_npu, FlashInfer).
    padded_attention: bool = False
    # Under padded_attention, a prefill group's queries run in tiles of this many rows, each tile
    # against the context its last row sees (kvsim's portable path: ``QUERY_TILE``), which skips
    # most of the masked triangle of a long prompt; 0: one tile, every row against the whole context.
    attention_query_tile: int = 0
    # Matrix products (GEMMs, LM head) of fewer rows than this run as one matrix-vector product per
    # row, each streaming the whole weight matrix; 0: never. A CPU BLAS does this (one thread of
    # MKL on the development VM: 2 and 3 rows cost 1.9x and 2.8x one row, 4 rows 2.3x; measured in
    # docs/benchmarks.md), accelerators' GEMM kernels do not. ``kvsim profile`` picks it.
    gemv_rows: int = 0
    # Written by ``kvsim profile``: seconds a step of exactly this many tokens (a few) takes beyond
    # what its operators' formulas give, the median over the whole steps it timed at that count. A
    # CPU BLAS picks its kernel by row count (one row: a matrix-vector product; multiples of four:
    # its GEMM micro-kernel; others: slower paths), which no roofline in the token count follows:
    # on the development VM a 768-wide model's 2- and 3-token decode steps took 2.1 and 1.7 ms more
    # than the fitted operators gave, and its 1-token steps 1.2-1.6 ms less (docs/benchmarks.md). The
    # cost model adds it to the step's matrix products; negative where such steps run under them.
    # Empty: no such term (every bundled device).
    row_count_s: dict[int, float] = field(default_factory=dict)
    # Written by ``kvsim profile``: mean |single step / its median - 1| over whole steps timed
    # while profiling. No model predicts single steps better than this on that machine, so
    # ``kvsim validate`` reports it beside the per-step error. None for profiles not measured.
    step_timing_noise: float | None = None
    # Written by ``kvsim profile``: the fitted model's per-step MAPE on an engine run it never saw.
    # ``kvsim validate`` measures a profile anew (once) when it is above the step limit: a noisy
    # machine bent the fit. None for profiles not measured.
    held_out_step_mape: float | None = None
    # Written by ``kvsim profile``: the reference steps timed right after its cases over the fitted
    # model's prediction of them (the median over the three). Quick fits on a noisy machine scatter
    # around it from one profile to the next; this is where this one landed, measured, and ``kvsim
    # validate``'s verdict also weighs a miss with the model scaled by it. None for profiles not measured.
    reference_fit_ratio: float | None = None
    # Written by ``kvsim profile``: the speed check's reference steps (label -> median seconds),
    # timed as ``kvsim validate`` times them, right after the profile's cases. The speed check
    # compares what they take now with these, so a change of the machine's speed is told apart
    # from the model's error on those steps. Empty for profiles not measured.
    reference_steps_s: dict[str, float] = field(default_factory=dict)
    # How the serving engine runs steps (sim/perf/engine_overhead.py); None: kernels and host terms add up.
    engine: EngineProfile | None = None
    # How devices are wired inside and between nodes (sim/perf/topology.py); None: a single device.
    topology: Topology | None = None
    # What a graph capture takes (sim/perf/graph_memory.py); None: no figure for this platform.
    graph_memory: GraphMemory | None = None
    # The KV tiers' figures (host DRAM per device, the host link's latency, the SSD's bandwidth and
    # latency); 0: not stated, and a run that needs one says so.
    host_memory_bytes: int = 0
    host_link_latency_s: float = 0.0
    ssd_bandwidth: float = 0.0
    ssd_latency_s: float = 0.0

    @property
    def captures_graphs(self) -> bool:
        """Whether the device's engine replays captured graphs (CUDA graphs, ACL graphs)."""
        return self.engine is not None and self.engine.mode == "graph"

    def matrix_peak(self, dtype: str) -> float:
        try:
            return self.matrix_flops[dtype]
        except KeyError:
            raise ValueError(f"device {self.name}: no matrix_flops for dtype {dtype!r}") from None

    def with_operators(self, updates: dict[str, OperatorCoefficients], source: str | None = None) -> DeviceProfile:
        """A copy with some operators' coefficients replaced (what a calibration produces)."""
        unknown = set(updates) - set(OPERATOR_KEYS)
        if unknown:
            raise ValueError(f"unknown operator(s) {sorted(unknown)}; known: {sorted(OPERATOR_KEYS)}")
        return replace(self, operators={**self.operators, **updates}, source=self.source if source is None else source)


ENGINE_CORES = ("v0", "v1")  # vLLM's engine generation: V0 LLMEngine, V1 EngineCore


def engine_as_run(device: DeviceProfile, enforce_eager: bool | None = None, async_scheduling: bool | None = None,
                  engine_core: str = "v1", vllm_version: str | None = None) -> DeviceProfile:
    """The device as a given vLLM setup runs it: ``enforce_eager`` (None: the device's mode; True:
    eager dispatch; False: graph replay), ``async_scheduling`` (None: the device's), vLLM's V0
    engine, which pays ``[engine] v0_seq_s`` host time per sequence per step on top of ``host_seq``,
    and ``vllm_version``, the release whose KV-pool sizing rules a GPU's engine follows (None or "":
    the device's; sim/perf/vllm_release.py). A device without an ``[engine]`` (an executor's calibrated
    CPU profile) runs every step eagerly: enforce_eager changes nothing there, and the others have
    nothing to apply to."""
    if engine_core not in ENGINE_CORES:
        raise ValueError(f"engine_core must be one of {', '.join(ENGINE_CORES)}, got {engine_core!r}")
    if vllm_version:
        parse_version(vllm_version)
        if device.platform != "cuda" or device.engine is None:
            raise ValueError(f"vllm_version {vllm_version}: release rules are vLLM's on CUDA devices; {device.name} "
                             f"({device.platform}) runs its own engine's")
    engine = device.engine
    if engine is None:
        if async_scheduling is not None or engine_core != "v1":
            raise ValueError(f"device {device.name} has no [engine] table: async scheduling and the V0 engine "
                             "are not modelled on it")
        return device
    updates: dict = {}
    if enforce_eager is not None:
        if not enforce_eager and not engine.capture_sizes:
            raise ValueError(f"device {device.name}: graph mode (--no-enforce-eager) needs [engine] capture_sizes")
        updates["mode"] = "eager" if enforce_eager else "graph"
    if async_scheduling is not None:
        updates["async_scheduling"] = async_scheduling
    if vllm_version:
        updates["vllm_version"] = vllm_version
    if updates:
        device = replace(device, engine=replace(engine, **updates))
    if engine_core == "v0" and engine.v0_seq_s > 0:
        seq = device.operators["host_seq"]
        device = device.with_operators({"host_seq": replace(seq, call_s=seq.call_s + engine.v0_seq_s)})
    return device


def scaled_profile(device: DeviceProfile, factor: float = 1.0, row_count_terms: bool = True,
                   why: str = "biased for a check of the checker", compute_factor: float | None = None) -> DeviceProfile:
    """A copy of a profile whose every operator's predicted time is ``factor`` times as long
    (efficiencies divided by it; fixed costs, row-count terms and the engine's dispatch multiplied),
    without its row-count terms if asked. ``kvsim validate`` uses it three times: a deliberately wrong
    model that proves the verdict can fail (``--perturb-profile``, ``--no-row-count-terms``), the model
    at the speed the machine was measured at (its verdict weighs a miss against that), and a TP rank
    beside its peers, whose compute-bound work slows by less than the rest (``compute_factor``: the
    compute efficiencies' own divisor; ``factor`` where None)."""
    compute = factor if compute_factor is None else compute_factor
    for value, flag in ((factor, "--perturb-profile"), (compute, "compute_factor")):
        if not (value > 0 and value != float("inf")):
            raise ValueError(f"{flag} must be a finite number > 0, got {value}")

    def divided(efficiency: float | None, by: float) -> float | None:
        return None if efficiency is None else efficiency / by

    def scaled(c: OperatorCoefficients) -> OperatorCoefficients:
        return replace(c, call_s=c.call_s * factor, compute_efficiency=divided(c.compute_efficiency, compute),
                       w8a8_compute_efficiency=divided(c.w8a8_compute_efficiency, compute),
                       memory_efficiency=divided(c.memory_efficiency, factor))

    terms = {rows: seconds * factor for rows, seconds in device.row_count_s.items()} if row_count_terms else {}
    engine = device.engine if device.engine is None else replace(device.engine, dispatch_s=device.engine.dispatch_s * factor)
    split = "" if compute_factor is None else f", compute x{compute:g}"
    source = f"{device.source}; {why} (x{factor:g}{split}{'' if row_count_terms else ', no row-count terms'})"
    return replace(device, operators={op: scaled(c) for op, c in device.operators.items()}, row_count_s=terms,
                   engine=engine, source=source)


def load_device(name_or_path: str | Path, search_dirs: Iterable[str | Path] = ()) -> DeviceProfile:
    """A device by TOML path, or by name: ``<dir>/<name>.toml`` in ``search_dirs``, then bundled.

    Put a ``mydevice.toml`` beside a run's config and pass that directory in ``search_dirs``
    (``kvsim`` commands pass the working directory) to use it by name.
    """
    path = _resolve(name_or_path, search_dirs)
    return _parse(_with_base(load_toml(path), path, ()), path)


def bundled_devices() -> list[str]:
    return sorted(p.stem for p in DEVICES_DIR.glob("*.toml"))


def save_device(profile: DeviceProfile, path: str | Path) -> Path:
    """Write ``profile`` as TOML that :func:`load_device` reads back equal to ``profile``."""
    path = Path(path)
    lines = [f"name = {toml_value(profile.name)}", f"source = {toml_value(profile.source)}",
             f"platform = {toml_value(profile.platform)}"]
    if profile.generation:
        lines.append(f"generation = {toml_value(profile.generation)}")
    lines += [f"{key} = {toml_value(getattr(profile, key))}" for key in _SCALAR_FIELDS]
    lines += [f"{key} = {toml_value(getattr(profile, key))}" for key in _TIER_FIELDS if getattr(profile, key)]
    lines.append(f"padded_attention = {toml_value(profile.padded_attention)}")
    if profile.attention_query_tile:
        lines.append(f"attention_query_tile = {profile.attention_query_tile}")
    if profile.gemv_rows:
        lines.append(f"gemv_rows = {profile.gemv_rows}")
    for key in ("step_timing_noise", "held_out_step_mape", "reference_fit_ratio"):
        if getattr(profile, key) is not None:
            lines.append(f"{key} = {toml_value(getattr(profile, key))}")
    if profile.engine is not None:
        lines += ["", *engine_toml_lines(profile.engine)]
    if profile.topology is not None:
        lines += ["", *topology_toml_lines(profile.topology)]
    if profile.graph_memory is not None:
        lines += ["", *graph_memory_toml_lines(profile.graph_memory)]
    if profile.row_count_s:
        lines += ["", "[row_count_s]"]
        lines += [f'"{rows}" = {toml_value(seconds)}' for rows, seconds in sorted(profile.row_count_s.items())]
    if profile.reference_steps_s:
        lines += ["", "[reference_steps_s]"]
        lines += [f"{toml_value(label)} = {toml_value(seconds)}" for label, seconds in profile.reference_steps_s.items()]
    lines += ["", "[matrix_flops]"]
    lines += [f"{dt} = {toml_value(profile.matrix_flops[dt])}" for dt in MATRIX_DTYPES]
    for op, keys in OPERATOR_KEYS.items():
        coeffs = profile.operators[op]
        lines += ["", f"[operators.{op}]"]
        for key in keys:
            value = coeffs.call_s if key in CALL_KEYS else coeffs.shape if key in SHAPE_KEYS else getattr(coeffs, key)
            if value is not None:
                lines.append(f"{key} = {toml_value(value)}")
    path.write_text("\n".join(lines) + "\n")
    return path


def _is_path(name_or_path: str | Path) -> bool:
    """A device named like a file (``x.toml``, ``dir/x``) is that file; anything else is a name to look up."""
    path = Path(name_or_path)
    return path.suffix == ".toml" or len(path.parts) > 1


def _named(name: str | Path, search_dirs: Iterable[str | Path], skip: Path | None = None) -> Path | None:
    """``<dir>/<name>.toml`` in ``search_dirs``, then bundled; ``skip`` (a file naming its own base) never counts."""
    for candidate in [*(Path(d) / f"{name}.toml" for d in search_dirs), DEVICES_DIR / f"{name}.toml"]:
        if candidate.is_file() and (skip is None or candidate.resolve() != skip.resolve()):
            return candidate
    return None


def _resolve(name_or_path: str | Path, search_dirs: Iterable[str | Path]) -> Path:
    if _is_path(name_or_path):
        return Path(name_or_path)
    found = _named(name_or_path, search_dirs)
    if found is None:
        raise ValueError(f"unknown device {str(name_or_path)!r}; bundled: {', '.join(bundled_devices())}; or give a .toml path")
    return found


def _with_base(data: dict, path: Path, chain: tuple[Path, ...]) -> dict:
    """``data`` over the device its ``base`` names (recursively); ``data`` itself without a base."""
    if "base" not in data:
        return data
    base = data["base"]
    if not isinstance(base, str) or not base:
        raise ValueError(f"{path}: field base must be a device name or a .toml path, got {base!r}")
    base_path = _base_path(base, path)
    chain = (*chain, path.resolve())
    if base_path.resolve() in chain:
        cycle = " -> ".join(p.name for p in (*chain, base_path))
        raise ValueError(f"{path}: field base makes a cycle ({cycle})")
    own = {key: value for key, value in data.items() if key != "base"}
    merged = _merged(_with_base(load_toml(base_path), base_path, chain), own)
    if "name" not in own:  # never the base's: _parse names the device after its file
        merged.pop("name", None)
    if "source" not in own:  # the base's provenance, saying which fields are not the base's
        merged["source"] = f"{path.name} over {base_path.name}: {merged.get('source', '')}"
    return merged


def _base_path(base: str, path: Path) -> Path:
    """A base named like a path is relative to the file naming it; a name is looked up beside that file
    (the file itself excepted, so a local ``h100-sxm.toml`` may start from the bundled one), then bundled."""
    if _is_path(base):
        candidate = path.parent / base
        if not candidate.is_file():
            raise ValueError(f"{path}: field base {base!r}: no such file {candidate}")
        return candidate
    found = _named(base, [path.parent], skip=path)
    if found is None:
        raise ValueError(f"{path}: field base names unknown device {base!r}; bundled: {', '.join(bundled_devices())}")
    return found


def _merged(base: dict, own: dict) -> dict:
    """``own`` over ``base``: tables merge key by key, any other value of ``own`` replaces the base's."""
    merged = dict(base)
    for key, value in own.items():
        merged[key] = _merged(base[key], value) if isinstance(value, dict) and isinstance(base.get(key), dict) else value
    return merged


def _parse(data: dict, path: Path) -> DeviceProfile:
    allowed = {f.name for f in fields(DeviceProfile)}
    _reject_unknown(data, allowed, path, "")
    values: dict = {"name": str(data.get("name", path.stem)), "source": str(data.get("source", ""))}
    values["platform"], values["generation"] = _platform(data, path)
    for key, kind in _SCALAR_FIELDS.items():
        values[key] = _number(data, key, kind, path, "", allow_zero=key in _MAY_BE_ZERO)
    for key, kind in _TIER_FIELDS.items():
        if key in data:
            values[key] = _number(data, key, kind, path, "", allow_zero=True)
    values["padded_attention"] = data.get("padded_attention", False)
    if not isinstance(values["padded_attention"], bool):
        raise ValueError(f"{path}: field padded_attention must be true or false, got {values['padded_attention']!r}")
    for key in ("gemv_rows", "attention_query_tile"):
        if key in data:
            values[key] = _number(data, key, int, path, "", allow_zero=True)
    for key in ("step_timing_noise", "held_out_step_mape", "reference_fit_ratio"):
        if key in data:
            values[key] = _number(data, key, float, path, "", allow_zero=True)
    matrix = _table(data, "matrix_flops", path)
    _reject_unknown(matrix, set(MATRIX_DTYPES), path, "matrix_flops.")
    values["matrix_flops"] = {dt: _number(matrix, dt, float, path, "matrix_flops.") for dt in MATRIX_DTYPES}
    ops = _table(data, "operators", path)
    _reject_unknown(ops, set(OPERATOR_KEYS), path, "operators.")
    operators: dict[str, OperatorCoefficients] = {}
    for op in OPERATOR_KEYS:  # an inherited operator comes after the one it inherits from
        inherit = INHERITED_OPERATORS.get(op)
        parent = operators[inherit] if inherit else None
        operators[op] = parent if parent and op not in ops else _operator(ops, op, values["launch_overhead_s"], path, parent)
    values["operators"] = operators
    if "engine" in data:
        values["engine"] = parse_engine(_table(data, "engine", path), path)
    if "topology" in data:
        values["topology"] = parse_topology(_table(data, "topology", path), path)
    if "graph_memory" in data:
        values["graph_memory"] = parse_graph_memory(_table(data, "graph_memory", path), path)
    if "row_count_s" in data:
        values["row_count_s"] = _row_counts(_table(data, "row_count_s", path), path)
    if "reference_steps_s" in data:
        steps = _table(data, "reference_steps_s", path)
        values["reference_steps_s"] = {str(label): _number(steps, label, float, path, "reference_steps_s.") for label in steps}
    return DeviceProfile(**values)


def _platform(data: dict, path: Path) -> tuple[str, str]:
    platform, generation = data.get("platform"), data.get("generation", "")
    if platform not in PLATFORMS:
        raise ValueError(f"{path}: field platform must be one of {', '.join(PLATFORMS)}, got {platform!r}")
    if generation and generation not in GENERATIONS[platform]:
        known = ", ".join(GENERATIONS[platform]) or "none"
        raise ValueError(f"{path}: field generation {generation!r} is not one kvsim knows on platform {platform} "
                         f"(known: {known}); leave it out for a generic part")
    return platform, generation


def _row_counts(table: dict, path: Path) -> dict[int, float]:
    """``[row_count_s]``: keys are token counts (positive integers written as strings), values seconds of either sign."""
    terms = {}
    for key, value in table.items():
        if not key.isdigit() or int(key) < 1:
            raise ValueError(f"{path}: field row_count_s.{key} must be named by a positive token count, like \"2\"")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"{path}: field row_count_s.{key} must be a finite number of seconds, got {value!r}")
        terms[int(key)] = float(value)
    return terms


def _operator(ops: dict, op: str, default_launch_s: float, path: Path,
              parent: OperatorCoefficients | None = None) -> OperatorCoefficients:
    """One ``[operators.X]`` table; with ``parent`` (an inherited operator) the keys it leaves out are the parent's."""
    if op in OPTIONAL_OPERATORS and op not in ops:
        return OperatorCoefficients(call_s=0.0)
    prefix = f"operators.{op}."
    table = _table(ops, op, path, prefix="operators.")
    keys = OPERATOR_KEYS[op]
    _reject_unknown(table, set(keys), path, prefix)
    call_key = next(k for k in keys if k in CALL_KEYS)
    if call_key not in table and parent:
        call_s = parent.call_s
    elif call_key not in table and call_key == "launch_s":
        call_s = default_launch_s
    else:  # given, or required (a missing one is named)
        call_s = _number(table, call_key, float, path, prefix, allow_zero=True)
    effs = {k: _number(table, k, float, path, prefix) if k in table or parent is None else getattr(parent, k)
            for k in ("compute_efficiency", "memory_efficiency") if k in keys}
    shape_key = next((k for k in SHAPE_KEYS if k in keys), None)
    if shape_key in table:
        shape = _number(table, shape_key, float, path, prefix, allow_zero=True)
    else:
        shape = parent.shape if parent else 0.0
    if "launches" in table:
        launches = _number(table, "launches", int, path, prefix)
    else:
        launches = parent.launches if parent else None
    if "group_flops" in table:
        effs["group_flops"] = _number(table, "group_flops", float, path, prefix, allow_zero=True)
    if "w8a8_compute_efficiency" in table:
        effs["w8a8_compute_efficiency"] = _number(table, "w8a8_compute_efficiency", float, path, prefix)
    elif parent and "compute_efficiency" not in table:  # the 8-bit figure goes with the 16-bit one it was found beside
        effs["w8a8_compute_efficiency"] = parent.w8a8_compute_efficiency
    return OperatorCoefficients(call_s=call_s, shape=shape, launches=launches, **effs)


def _table(data: dict, key: str, path: Path, prefix: str = "") -> dict:
    if key not in data:
        raise ValueError(f"{path}: missing table [{prefix}{key}]")
    if not isinstance(data[key], dict):
        raise ValueError(f"{path}: field {prefix}{key} must be a table")
    return data[key]


def _number(data: dict, key: str, kind: type, path: Path, prefix: str, allow_zero: bool = False) -> float | int:
    if key not in data:
        raise ValueError(f"{path}: missing field {prefix}{key}")
    value = data[key]
    ok_type = isinstance(value, int) if kind is int else isinstance(value, (int, float))
    if isinstance(value, bool) or not ok_type:
        raise ValueError(f"{path}: field {prefix}{key} must be {'an integer' if kind is int else 'a number'}, got {value!r}")
    if value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"{path}: field {prefix}{key} must be {'>= 0' if allow_zero else '> 0'}, got {value!r}")
    return kind(value)


def _reject_unknown(data: dict, allowed: set[str], path: Path, prefix: str) -> None:
    unknown = sorted(set(data) - allowed)
    if unknown:
        names = ", ".join(prefix + k for k in unknown)
        raise ValueError(f"{path}: unknown field(s) {names} (allowed: {', '.join(sorted(allowed))})")
