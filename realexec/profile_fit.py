"""How ``kvsim profile`` turns measurements into a calibrated profile: operator groups fitted in order."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields, replace

import numpy as np

from kvsim.realexec.cost_fit import fit_operators
from kvsim.realexec.profile_bench import Measured, Sample, StepRecords
from kvsim.sim.perf.cost_model import STEP_OPERATORS, CostModel, StepFeatures
from kvsim.sim.perf.device import DeviceProfile
from kvsim.sim.perf.model_spec import ModelSpec


@dataclass(frozen=True)
class Group:
    """Operators fitted together from one kind of measurement, in :data:`GROUPS` order.

    ``fixed`` operators also run inside the measured time; they were fitted by an earlier group.
    ``fixed_calls`` operators (among ``operators``) keep the per-call cost an earlier group fitted.
    """

    name: str
    operators: tuple[str, ...]
    fixed: tuple[str, ...] = ()
    fixed_calls: tuple[str, ...] = ()


HOST_OPERATORS = ("host_step", "host_seq")
# Kernels whose rates are fitted again on whole steps (their per-call costs kept: every step launches
# each once per layer, so whole steps cannot tell them apart), after their own cases. A case
# runs its operator alone, right after other cases: on the development VM's CPU the GEMMs of a
# decode step timed so took 1.2-1.3 ms where back-to-back decode steps spend 0.45 ms on them
# (docs/benchmarks.md), so operator cases misplace time between operators and the host terms,
# and whole steps of other batch sizes then miss (2-sequence decode steps predicted 15 % short).
# Refitted on whole steps, one profile's held-out steps' error fell from 6.4 % to 5.6 %. An MoE model's
# routed experts likewise (their case routes random hidden states, a step its tokens' own; a dense model
# has no moe work, so refitting it changes nothing there).
STEP_REFITTED = ("gemm", "moe", "elementwise", "lm_head", "attn_decode")
MAX_GEMV_ROWS = 8  # token counts the gemv_rows choice looks at: a BLAS's matrix-vector path ends well below this
ROW_COUNT_MIN_STEPS = 3  # whole steps of one token count before its row-count term is measured
ROW_COUNT_FLOOR = 0.01  # ... and the share of those steps' median time its residual must pass (below: noise)
# gemm half_tokens tried with each gemv_rows: a GEMM's small-M efficiency loss (cost_model.py) is part of
# the same fact (which kernel a few rows run on), so the two are chosen together.
HALF_TOKENS = (0.0, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0)
# Fitted only where attention is not padded: a kernel that pads each group to its longest entry
# (the cpu backend's portable path) runs no per-token walk, so a value there would be noise.
UNPADDED_ONLY = ("prefill_chain",)
GROUPS = (
    Group("gemm", ("gemm",)),
    Group("moe", ("moe",)),  # MoE models only: the routed experts at several token counts
    Group("elementwise", ("elementwise",), fixed=("gemm", "moe")),  # measured: the forward pass without attention
    Group("kv_write", ("kv_write",)),
    Group("attention", ("attn_prefill", "attn_decode", "paged_gather", "decode_chain", "prefill_chain")),
    Group("lm_head", ("lm_head",)),
    Group("sampling", ("sampling",)),
    Group("block_copy", ("block_copy",)),
    Group("swap", ("swap",)),
    Group("steps", HOST_OPERATORS + STEP_REFITTED, fixed=tuple(op for op in STEP_OPERATORS if op not in HOST_OPERATORS + STEP_REFITTED),
          fixed_calls=STEP_REFITTED),
)



def stack(features: Sequence[StepFeatures]) -> StepFeatures:
    return StepFeatures(**{f.name: np.array([getattr(x, f.name) for x in features], dtype=np.float64) for f in fields(StepFeatures)})



@dataclass(frozen=True)
class FitError:
    """How far the calibrated model's times are from the measured ones, relative to the measured."""

    name: str
    samples: int
    mape: float
    max_error: float

    @classmethod
    def of(cls, name: str, predicted: np.ndarray, measured: np.ndarray) -> FitError:
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


def fit_groups(
    spec: ModelSpec, base: DeviceProfile, block_size: int, data: Measurements, kv_dtype: str | None = None
) -> tuple[DeviceProfile, list[FitError]]:
    """Fit every group in :data:`GROUPS` order; each starts from the coefficients fitted before it.

    ``kv_dtype`` is the KV cache dtype the measurements ran with (None: the model's): the cost
    model then counts the bytes that cache moves, as the simulator will when it predicts it.

    Groups may also decide a structural fact, by fitting every choice and keeping the one that
    explains the measurements best: the attention group ``padded_attention`` (ragged batches in
    the sweep tell the layouts apart), the gemm group ``gemv_rows`` (below how many rows the
    BLAS runs one matrix-vector product per row) with ``half_tokens`` (its small-M efficiency
    loss above that; the sweep's small token counts tell). The moe group (MoE models only) picks its
    ``half_tokens`` likewise: the small-M loss each touched expert's grouped matmuls pay. The
    runner-up's error is reported beside the choice.
    Last, the row-count terms (:func:`row_count_terms`), from the whole steps the fit leaves unexplained.
    Returns the calibrated profile and the fit's error per group and per labelled subset.
    """
    device, errors = replace(base, row_count_s={}), []  # the groups fit the operators alone; the row-count terms come last
    for group in GROUPS:
        if group.name not in data.median:
            continue
        features, seconds = stack(data.features[group.name]), np.array(data.median[group.name])
        choices = structural_choices(group.name, device, features)
        fits = sorted(((_fit_group(spec, layout, block_size, kv_dtype, group, features, seconds), name) for name, layout in choices),
                      key=lambda fit: fit[0][2])
        ((device, predicted, _), _), rejected = fits[0], fits[1:]
        labels = np.array(data.labels[group.name])
        for label in dict.fromkeys(labels.tolist()):
            rows = labels == label
            errors.append(FitError.of(label, predicted[rows], seconds[rows]))
        if len(set(labels)) > 1:
            errors.append(FitError.of(group.name, predicted, seconds))
        if rejected:
            (_, runner_up, _), name = rejected[0]
            errors.append(FitError.of(f"{group.name} if {name}", runner_up, seconds))
    if "steps" in data.median:
        features, seconds = stack(data.features["steps"]), np.array(data.median["steps"])
        residual = seconds - CostModel(spec, device, block_size, kv_dtype).predict(features)
        device = replace(device, row_count_s=row_count_terms(np.asarray(features.num_tokens), seconds, residual))
        errors.append(FitError.of("steps with row-count terms", CostModel(spec, device, block_size, kv_dtype).predict(features), seconds))
    return device, errors


def row_count_terms(tokens: np.ndarray, seconds: np.ndarray, residual: np.ndarray) -> dict[int, float]:
    """``row_count_s``: per token count up to :data:`MAX_GEMV_ROWS`, the median ``residual`` (measured
    ``seconds`` less the fitted prediction) of the whole steps of ``tokens`` tokens, where at least
    :data:`ROW_COUNT_MIN_STEPS` were timed and its size passes :data:`ROW_COUNT_FLOOR` of their time.

    Either sign: the operators' rates are fitted over every step, and at one count the BLAS may run
    a faster kernel than that fit gives as well as a slower one. On the 2-core development VM the
    small model's one-token steps, the commonest of a served trace, ran 15-18 % under the fitted
    operators in every profile looked at, beside terms of +0.3 to +4.7 ms at 2-7 tokens; with terms
    that could only add, every one-token step stayed that much over (docs/benchmarks.md)."""
    terms = {}
    for rows in range(1, MAX_GEMV_ROWS + 1):
        at = tokens == rows
        if at.sum() >= ROW_COUNT_MIN_STEPS and abs(np.median(residual[at])) > ROW_COUNT_FLOOR * np.median(seconds[at]):
            terms[rows] = float(np.median(residual[at]))
    return terms


def structural_choices(group: str, device: DeviceProfile, features: StepFeatures) -> list[tuple[str, DeviceProfile]]:
    """The profiles a group is fitted under, each with how the report names it (one: no choice)."""
    if group == "attention":
        return [(f"{'' if p else 'not '}padded", replace(device, padded_attention=p)) for p in (False, True)]
    if group == "moe":  # the grouped matmuls' small-M loss, paid once per touched expert (cost_model._moe_row)
        moe = device.operators["moe"]
        return [(f"half_tokens = {h:g}", device.with_operators({"moe": replace(moe, shape=h)}))
                for h in sorted({moe.shape, *HALF_TOKENS})]
    if group == "gemm":
        small = sorted({int(t) for t in np.atleast_1d(features.num_tokens) if t <= MAX_GEMV_ROWS})
        gemm = device.operators["gemm"]
        return [
            (f"gemv_rows = {g}, half_tokens = {h:g}", replace(device.with_operators({"gemm": replace(gemm, shape=h)}), gemv_rows=g))
            for g in (0, *(t + 1 for t in small[:-1]))
            for h in sorted({gemm.shape, *HALF_TOKENS})
        ]
    return [("", device)]


def _fit_group(
    spec: ModelSpec, device: DeviceProfile, block_size: int, kv_dtype: str | None, group: Group, features: StepFeatures,
    seconds: np.ndarray,
) -> tuple[DeviceProfile, np.ndarray, float]:
    """The profile with ``group`` fitted, its predictions of the group's samples, and their MAPE."""
    model = CostModel(spec, device, block_size, kv_dtype)
    operators = tuple(op for op in group.operators if not (device.padded_attention and op in UNPADDED_ONLY))
    fitted = device.with_operators(
        fit_operators(model, features, seconds, operators, fixed=group.fixed, fixed_calls=group.fixed_calls))
    times = CostModel(spec, fitted, block_size, kv_dtype).operator_times(features)
    predicted = sum(np.broadcast_to(times[op], seconds.shape) for op in group.operators + group.fixed)
    return fitted, predicted, float(np.mean(np.abs(predicted / seconds - 1.0)))
