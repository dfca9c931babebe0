"""``kvsim profile``: measure a kernel backend running the paged decoder and fit the cost model to it.

Everything runs on one executor's model, caches and kernels (plus bare KV pools of the other
block sizes for attention):

1. Operator microbenchmarks, each operator class alone at swept shapes, summed over all layers
   as the cost model counts them: the GEMMs at several token counts; the forward pass with
   attention replaced by the identity, whose time beyond the GEMMs is the elementwise class; KV
   writes; paged attention for decode batches (even and ragged), prompts, chunks over a cached
   prefix and two prompts at once, at every block size (which separates the per-block
   ``paged_gather`` cost from the per-byte one; decode batches of one to many sequences separate
   the walk over the longest sequence's blocks, ``decode_chain``, from the blocks of all of them,
   and short chunks over a long prefix a prefill entry's own walk, ``prefill_chain`` (fitted only
   where attention is not padded: ``profile_fit.UNPADDED_ONLY``);
   the ragged batches tell whether the kernels pad a batch to its longest sequence); the LM head, greedy sampling, block copies and swaps.
2. Whole steps, whose ``duration_s`` (device + host) from :meth:`Executor.step` is what the
   simulator predicts: StepPlans of swept shapes (prefill, chunked prefill, decode batches, mixed
   batches), and the steps an engine schedules for a synthetic trace replayed through the
   executor as ``kvsim execute`` runs one (several chunks beside ragged decodes, prefix hits).
   The ``host_step`` and ``host_seq`` terms are fitted on what the operators leave unexplained.
3. A held-out engine run of another synthetic trace, never fitted: its per-step error is reported.
4. The speed check's reference steps, timed as ``kvsim validate`` times them and recorded in the
   profile, so that a later speed check tells the machine's drift apart from the model's error.

Groups are fitted in :data:`GROUPS` order with ``cost_fit.fit_operators`` (minimum MAPE, bounded efficiencies), each with
the coefficients fitted before it held fixed.

The jobs live in their own modules: what to measure (``profile_shapes``), how to time it
(``profile_bench``), how to fit it (``profile_fit``); this one runs them and writes the profile.
Which cached profile fits a machine is ``calibration``'s job.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from kvsim.realexec.backends import KernelBackend, get_backend
from kvsim.realexec.executor import Executor, kv_cache_layout
from kvsim.realexec.graphs import engine_of
from kvsim.realexec.profile_bench import KVPool, OperatorBenches, StepRecords, engine_run, measure, sweep_samples
from kvsim.realexec.profile_fit import FitError, Measurements, fit_groups, stack
from kvsim.realexec.profile_shapes import StepShape, Sweep, footprint, sweep_for
from kvsim.realexec.speed_check import median_ratio, reference_steps
from kvsim.sim.perf.cost_model import CostModel
from kvsim.sim.perf.device import DeviceProfile, load_device, save_device
from kvsim.sim.perf.memory import plan_memory
from kvsim.sim.perf.model_spec import ModelSpec, load_model

Echo = Callable[[str], None]


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
    kv_dtype: str  # the KV cache dtype every case wrote and attended through

    def error(self, name: str) -> FitError:
        return next(e for e in self.errors if e.name == name)


def kv_token_budget(spec: ModelSpec, base: DeviceProfile, block_size: int, pools: int, kv_dtype: str | None = None) -> int:
    """KV tokens one profiling pool may hold: half of what an engine would give its KV cache on ``base``, split over the pools.

    Half, because attention may gather a padded copy of everything it reads next to the cache.
    """
    return plan_memory(spec, base, block_size=block_size, kv_dtype=kv_dtype).num_blocks * block_size // (2 * pools)


def profile(
    backend: KernelBackend,
    spec: ModelSpec,
    base: DeviceProfile,
    sweep: Sweep,
    seed: int = 0,
    echo: Echo | None = None,
    progress: bool = False,
    kv_dtype: str | None = None,
) -> Profile:
    """Measure ``backend`` running ``spec`` over ``sweep`` and fit ``base``'s coefficients to it.

    ``kv_dtype`` is the KV cache the executor runs with (None: the model's); with int8 every KV
    write, attention and step runs the quantised path, and the fit counts int8 bytes.

    One executor at the first block size runs everything but attention at the other block sizes,
    which reads bare pools of those sizes; every case of every block size is timed in the same
    shuffled rounds, so a change of load on a shared machine cannot pass for a block-size effect.
    """
    started = time.perf_counter()
    say = echo or (lambda _: None)
    rng = np.random.default_rng(seed)
    first = sweep.block_sizes[0]
    kv_dtype = kv_dtype or spec.kv_dtype
    budget = kv_token_budget(spec, base, first, len(sweep.block_sizes), kv_dtype)

    def fits(shape: StepShape, block_size: int) -> bool:
        return footprint(shape, block_size) * block_size <= budget

    shapes = sweep.step_shapes() + sweep.attention_shapes()
    if not any(fits(shape, first) for shape in shapes):
        raise ValueError(f"model {spec.name} leaves no memory for a KV cache on {base.name} ({base.hbm_bytes} bytes)")
    blocks = max([footprint(shape, first) for shape in shapes if fits(shape, first)] + [2 * max(sweep.moved_blocks)])
    executor = Executor(spec, backend, num_blocks=blocks, block_size=first, num_host_blocks=max(sweep.moved_blocks), seed=seed,
                        kv_dtype=kv_dtype)
    pools = [KVPool(executor.kv_caches, first, executor.num_blocks)]
    for block_size in sweep.block_sizes[1:]:
        blocks = max([footprint(shape, block_size) for shape in sweep.attention_shapes() if fits(shape, block_size)], default=0)
        if blocks:
            heads, key_size, value_size = kv_cache_layout(spec)
            caches = backend.allocate_kv_cache(spec.num_layers, blocks, block_size, heads, key_size, executor.kv_dtype, value_size)
            pools.append(KVPool(caches, block_size, blocks))
    samples = sweep_samples(OperatorBenches(executor, rng, seed), sweep, pools, fits)
    say(f"timing {len(samples)} cases (operators alone and whole steps) in {sweep.repeats} rounds on {backend.clock}, "
        "each timed run after untimed runs of the same case")
    data = Measurements()
    with tqdm(total=len(samples) * sweep.repeats, desc="profiling", unit="run", disable=not progress, mininterval=0.5) as bar:
        data.add(samples, measure(samples, sweep.repeats, rng, tick=bar.update))
    del pools[1:]
    rates = ", ".join(f"{rate:g}" for rate in sweep.engine_rates)
    say(f"engine runs: traces of {sweep.engine_requests} requests arriving at {rates} requests/s fitted, one held out (a few seconds)")
    for i, rate in enumerate(sweep.engine_rates):
        data.add_once(engine_run(executor, sweep, seed + 1 + i, rate))
    held_out = engine_run(executor, sweep, seed, sweep.engine_rates[0])
    engine = engine_of(executor.graphs)  # the cost model must run steps as the executor ran them
    del executor, pools, samples  # the speed check's reference steps run on an executor of their own, as validate runs them
    references, reference_features = reference_steps(backend, spec, first, kv_dtype, seed)

    device, errors = fit_groups(spec, replace(base, engine=engine), first, data, kv_dtype)
    cost = CostModel(spec, device, first, kv_dtype)
    landed = median_ratio(list(references.values()), [float(cost.predict(f)) for f in reference_features])
    device = replace(device, reference_steps_s=references, reference_fit_ratio=round(landed, 4))
    predicted = cost.predict(stack(held_out.features))
    seconds, kinds = np.array(held_out.seconds), np.array(held_out.kinds)
    errors.append(FitError.of("held-out steps", predicted, seconds))
    for kind in STEP_KINDS:
        if np.any(kinds == kind):
            errors.append(FitError.of(f"held-out {kind}", predicted[kinds == kind], seconds[kinds == kind]))
    noise = {group: float(np.mean(np.concatenate(runs))) for group, runs in data.noise.items()}
    step_noise = noise.pop("steps")
    operator_noise = float(np.mean(list(noise.values())))
    return Profile(device, errors, operator_noise, step_noise, time.perf_counter() - started, data, held_out, kv_dtype)


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
    kv_dtype: str | None = None,
    enforce_eager: bool = False,
) -> Profile:
    """``kvsim profile``: profile ``backend`` running ``model``, write the calibrated profile to ``out``.

    ``sweep`` replaces the quick or full sweep (tests run a small one); ``kv_dtype`` is the KV
    cache dtype to profile (None: the model's), named in the profile's ``source``.
    """
    spec = load_model(model)
    kernels = get_backend(backend, torch_device, enforce_eager=enforce_eager)
    base = load_device(base_device or kernels.default_profile(), search_dirs=[Path.cwd()])
    sweep = sweep or sweep_for(kernels, quick)
    if echo:
        echo(f"profiling {backend} ({kernels.machine_name()}) with model {spec.name}, {torch.get_num_threads()} torch threads, "
             f"{'quick' if quick else 'full'} sweep, {kv_dtype or spec.kv_dtype} KV cache, starting from the {base.name} profile")
    result = profile(kernels, spec, base, sweep, seed, echo, progress, kv_dtype)
    command = (f"kvsim profile --backend {backend} --model {model} --kv-cache-dtype {result.kv_dtype}"
               f"{' --quick' if quick else ''}{' --enforce-eager' if enforce_eager else ''} --seed {seed}")
    held = result.error("held-out steps")
    source = (
        f"{command} on {kernels.machine_name()}, torch {torch.__version__} with num_threads={torch.get_num_threads()}, "
        f"timed on {kernels.clock}, {time.strftime('%Y-%m-%d')}; fitted from {base.name}; held-out per-step MAPE "
        f"{held.mape:.1%} against single steps whose timing noise is {result.step_noise:.1%}"
    )
    calibrated = replace(result.device, name=f"{base.name}-calibrated", source=source, step_timing_noise=round(result.step_noise, 4),
                         held_out_step_mape=round(held.mape, 4))
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
    walks = [(name, result.device.operators[op].call_s)
             for name, op in (("decode walks the longest sequence's", "decode_chain"),
                              ("a prefill entry walks the longest context's (beyond the decodes')", "prefill_chain"))]
    walk = "".join(f"; {name} blocks at {seconds * 1e6:.3g} us a block per layer" for name, seconds in walks if seconds > 1e-9)
    lines.append(f"attention work: {layout}{walk}")
    gemv = result.device.gemv_rows
    lines.append(f"matrix products: {f'fewer than {gemv} rows run one row at a time, ' if gemv else ''}"
                 f"small-M efficiency half at {result.device.operators['gemm'].shape:g} tokens")
    if result.device.row_count_s:
        terms = ", ".join(f"{rows}: {seconds * 1e3:.2f} ms" for rows, seconds in sorted(result.device.row_count_s.items()))
        lines.append(f"steps of a few tokens, time beyond (-: short of) the operators (row-count terms): {terms}")
    if result.device.reference_fit_ratio is not None:
        lines.append(f"the reference steps timed right after the cases took {result.device.reference_fit_ratio:.2f}x the fit's "
                     "prediction of them (median)")
    lines.append(f"timing noise (mean |run / median - 1|): operators {result.operator_noise:.1%}, steps {result.step_noise:.1%}")
    lines.append(f"profiled in {result.seconds:.0f} s")
    return lines
