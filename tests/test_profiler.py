"""kvsim profile: the fit recovers a known device, the profile it writes loads and is used, a tiny sweep runs."""

from __future__ import annotations

import dataclasses
import itertools
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from click.testing import CliRunner  # noqa: E402
from torch_npu_standin import make_torch_npu_standin  # noqa: E402

from kvsim.cli.profile import profile as profile_command  # noqa: E402
from kvsim.realexec.backends import get_backend  # noqa: E402
from kvsim.realexec.executor import Executor  # noqa: E402
from kvsim.realexec.profile_bench import KVPool, Measured, OperatorBenches, Sample, measure  # noqa: E402
from kvsim.realexec.profile_fit import GROUPS, Measurements, _fit_group, fit_groups, stack  # noqa: E402
from kvsim.realexec.profile_shapes import QUICK, Sweep, decode, prefill, ragged_decode, shape_features, sweep_for  # noqa: E402
from kvsim.realexec.profiler import run_profile  # noqa: E402
from kvsim.realexec.speed_check import REFERENCE_EXECUTORS, REFERENCE_SHAPES  # noqa: E402
from kvsim.sim.perf.cost_model import CostModel  # noqa: E402
from kvsim.sim.perf.device import OperatorCoefficients, load_device, save_device, scaled_profile  # noqa: E402
from kvsim.sim.perf.model_spec import load_model  # noqa: E402

TINY = load_model("tiny")
BS = 16

# A few seconds on two cores: every group is measured, at two block sizes, with a held-out run.
SMALL = Sweep(
    block_sizes=(16, 32),
    token_counts=(1, 16, 64),
    prefill_tokens=(8, 32),
    prefix_tokens=(0, 32),
    decode_batches=(1, 4),
    decode_contexts=(16, 64),
    sample_rows=(1, 4),
    moved_blocks=(1, 4),
    repeats=2,
    engine_requests=2,
)

TRUTH = {
    "gemm": OperatorCoefficients(call_s=2e-5, compute_efficiency=0.31, memory_efficiency=0.47),
    "elementwise": OperatorCoefficients(call_s=7e-6, compute_efficiency=0.3, memory_efficiency=0.05),
    "kv_write": OperatorCoefficients(call_s=9e-6, memory_efficiency=0.12),
    "attn_prefill": OperatorCoefficients(call_s=3e-5, compute_efficiency=0.04, memory_efficiency=0.2),
    "attn_decode": OperatorCoefficients(call_s=4e-5, compute_efficiency=0.2, memory_efficiency=0.03),
    "paged_gather": OperatorCoefficients(call_s=3e-7),
    "lm_head": OperatorCoefficients(call_s=1.5e-5, compute_efficiency=0.4, memory_efficiency=0.35),
    "sampling": OperatorCoefficients(call_s=3e-6, compute_efficiency=0.2, memory_efficiency=0.6),
    "block_copy": OperatorCoefficients(call_s=6e-6, memory_efficiency=0.25),
    "swap": OperatorCoefficients(call_s=5e-6, memory_efficiency=0.2),
    "host_step": OperatorCoefficients(call_s=4e-4),
    "host_seq": OperatorCoefficients(call_s=6e-6),
}


def synthetic_measurements(truth, sweep: Sweep) -> Measurements:
    """What a perfectly repeatable device with the ``truth`` profile would measure over ``sweep``."""
    data = Measurements()
    for index, block_size in enumerate(sweep.block_sizes):  # as profile() measures: attention at every block size
        shapes = {"attention": sweep.attention_shapes()}
        if index == 0:
            tokens = [prefill(n) for n in sweep.token_counts]
            rows = [decode(r, 1) for r in sweep.sample_rows]
            shapes.update(gemm=tokens, elementwise=tokens, kv_write=tokens, lm_head=rows, sampling=rows, steps=sweep.step_shapes())
        model = CostModel(TINY, truth, block_size)
        samples, seconds = [], []
        for group in GROUPS:
            for shape in shapes.get(group.name, []):
                features = shape_features(shape, block_size)
                times = model.operator_times(features)
                samples.append(Sample(group.name, group.name, features, lambda: lambda: 0.0))
                seconds.append(sum(times[op] for op in group.operators + group.fixed))
        runs = np.array(seconds)[:, None]
        data.add(samples, Measured(runs[:, 0], runs))
    return data


@pytest.mark.parametrize("gemv_rows, half_tokens", [(0, 0.0), (4, 8.0), (3, 16.0)])
def test_fit_recovers_below_how_many_rows_matrix_products_run_row_by_row(gemv_rows: int, half_tokens: float, tmp_path: Path) -> None:
    base = load_device("cpu")
    gemm = dataclasses.replace(TRUTH["gemm"], shape=half_tokens)
    truth = dataclasses.replace(base.with_operators({**TRUTH, "gemm": gemm}), gemv_rows=gemv_rows)
    fitted, errors = fit_groups(TINY, base, 16, synthetic_measurements(truth, QUICK))
    assert (fitted.gemv_rows, fitted.operators["gemm"].shape) == (gemv_rows, half_tokens)
    assert load_device(save_device(fitted, tmp_path / "fitted.toml")) == fitted
    assert next(e for e in errors if e.name == "gemm").mape < 1e-6
    if gemv_rows:  # (without, gemv_rows = 2 and half_tokens = 0 is the same model: one row is one GEMV either way)
        assert next(e for e in errors if e.name.startswith("gemm if ")).mape > 1e-3  # the runner-up is told apart
    # the LM head shares the BLAS's row-by-row path: 3 rows stream its weights three times below 4
    three_rows = shape_features(decode(3, 1), 16)
    work = CostModel(TINY, fitted, 16).operator_work(three_rows)["lm_head"]
    weights = TINY.vocab_size * TINY.hidden_size * 4
    sampling = three_rows.num_sampled * (TINY.hidden_size * 4 + 4 * TINY.vocab_size)
    assert work.bytes - sampling == pytest.approx(weights * (3 if gemv_rows > 3 else 1))


@pytest.mark.parametrize("padded", [True, False])
def test_fit_recovers_a_known_device_and_its_attention_layout(padded: bool, tmp_path: Path) -> None:
    base = load_device("cpu")
    truth = dataclasses.replace(base.with_operators(TRUTH), padded_attention=padded)
    sweep = dataclasses.replace(QUICK, block_sizes=(16, 64))
    fitted, errors = fit_groups(TINY, dataclasses.replace(base, padded_attention=not padded), 16, synthetic_measurements(truth, sweep))

    assert fitted.padded_attention is padded
    chosen = [e for e in errors if " if " not in e.name]
    assert chosen and all(e.mape < 1e-6 for e in chosen), chosen
    rejected = next(e for e in errors if e.name.startswith("attention if"))
    assert rejected.mape > 0.05  # the ragged batches in the sweep tell the two layouts apart
    for op in ("gemm", "kv_write", "attn_decode", "paged_gather", "host_step", "host_seq"):
        got, want = fitted.operators[op], TRUTH[op]
        assert got.call_s == pytest.approx(want.call_s, rel=1e-5), op
        assert got.memory_efficiency == (None if want.memory_efficiency is None else pytest.approx(want.memory_efficiency, rel=1e-5)), op
    assert fitted.operators["gemm"].compute_efficiency == pytest.approx(0.31, rel=1e-5)

    # profile -> TOML -> predictions: held-out shapes, at a block size the fit never saw
    path = save_device(fitted, tmp_path / "fitted.toml")
    loaded = load_device(path)
    assert loaded == fitted
    held_out = [ragged_decode(24, 700), prefill(300, 200) + ragged_decode(9, 333), prefill(77)]
    for shape in held_out:
        features = shape_features(shape, 32)
        assert CostModel(TINY, loaded, 32).predict(features) == pytest.approx(CostModel(TINY, truth, 32).predict(features), rel=1e-4)


WALKS = {"decode_chain": OperatorCoefficients(call_s=1.6e-6), "prefill_chain": OperatorCoefficients(call_s=0.35e-6)}


def test_fit_recovers_both_block_walks_where_attention_is_not_padded() -> None:
    """The sweep's chunks over a cached prefix and lone long decodes tell the two walks' costs apart
    (on an H200 a block of the 8B's prefill walk cost about a quarter of its decode walk's)."""
    base = load_device("cpu")
    truth = dataclasses.replace(base.with_operators({**TRUTH, **WALKS}), padded_attention=False)
    fitted, errors = fit_groups(TINY, base, 16, synthetic_measurements(truth, dataclasses.replace(QUICK, block_sizes=(16, 64))))
    assert fitted.padded_attention is False
    assert next(e for e in errors if e.name == "attention").mape < 1e-6
    for op, want in WALKS.items():
        assert fitted.operators[op].call_s == pytest.approx(want.call_s, rel=1e-4), op


def test_a_padded_layout_fits_no_prefill_walk() -> None:
    """A kernel padded to each group's longest entry walks no token's blocks: under that layout the
    prefill walk is not fitted, so time that grows with it cannot land there (here the measurements
    carry such time; a fit free to price it would recover it exactly)."""
    truth = dataclasses.replace(load_device("cpu"), padded_attention=True).with_operators({**TRUTH, **WALKS})
    data = synthetic_measurements(truth, dataclasses.replace(QUICK, block_sizes=(16,)))
    attention = next(g for g in GROUPS if g.name == "attention")
    features, seconds = stack(data.features["attention"]), np.array(data.median["attention"])
    fitted, _, mape = _fit_group(TINY, load_device("cpu"), 16, None, attention, features, seconds)
    assert fitted.padded_attention and load_device("cpu").padded_attention
    assert fitted.operators["prefill_chain"].call_s == 0.0 and mape > 1e-4


def test_measure_interleaves_primed_rounds_and_takes_medians() -> None:
    order: list[tuple[int, int]] = []  # (case, instance) of every run
    # Each round makes an instance of each case, runs it `primes` times untimed, then keeps the next (primed) time.
    values = {0: iter([0.0, 5.0, 0.0, 1.0, 0.0, 3.0]), 1: iter([0.0, 0.0, 0.0, 2.0] * 2 + [0.0, 0.0, 0.0, 9.0])}
    instances = {0: 0, 1: 0}

    def case(i: int):
        def instance():
            instances[i] += 1
            made = instances[i]

            def run() -> float:
                order.append((i, made))
                return next(values[i])

            return run

        return instance

    samples = [Sample("g", "one priming run", None, case(0)), Sample("g", "three priming runs", None, case(1), primes=3)]
    measured = measure(samples, repeats=3, rng=np.random.default_rng(0))
    assert measured.median.tolist() == [3.0, 2.0]
    assert measured.runs[1].tolist() == [2.0, 2.0, 9.0]  # each case's timed runs in its own row, whatever the order
    stretches = [list(group) for _, group in itertools.groupby(order)]
    assert sorted(len(s) for s in stretches) == [2, 2, 2, 4, 4, 4]  # every timed run right after its instance's priming runs
    assert instances == {0: 3, 1: 3}  # a fresh instance (block layout) every round
    rounds = [sorted(s[0][0] for s in stretches[k : k + 2]) for k in range(0, 6, 2)]
    assert rounds == [[0, 1]] * 3  # every round visits every case once


def test_block_tables_are_runs_of_consecutive_blocks_in_a_compact_region() -> None:
    pool, rng = KVPool(caches=[], block_size=16, num_blocks=1000), np.random.default_rng(1)
    shape = ragged_decode(5, 100) + prefill(40, cached=30)
    tables = pool.tables(shape, rng)
    assert [len(t) for t in tables] == [-(-(s.cached + s.new) // 16) for s in shape]
    blocks = [b for t in tables for b in t]
    assert len(set(blocks)) == len(blocks) and max(blocks) < 2 * len(blocks)
    assert all(t == list(range(t[0], t[0] + len(t))) for t in tables)
    assert pool.tables(shape, rng) != tables  # a fresh layout every step
    with pytest.raises(ValueError, match="does not fit the profiling pool of 3"):
        KVPool(caches=[], block_size=16, num_blocks=3).tables(decode(4, 100), rng)


@pytest.fixture
def one_thread():
    """One torch thread: two threads on a shared two-core machine wait on each other for whole time slices."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_tiny_sweep_on_cpu_writes_a_profile_that_changes_predictions(tmp_path: Path, one_thread: None) -> None:
    out = tmp_path / "cpu-tiny.toml"
    lines: list[str] = []
    result = run_profile("cpu", "tiny", out, sweep=SMALL, seed=3, echo=lines.append)

    loaded = load_device(out)
    assert loaded == result.device and loaded.name == "cpu-calibrated"
    assert loaded.step_timing_noise == round(result.step_noise, 4)  # what validate reports as the noise floor
    assert loaded.held_out_step_mape == round(result.error("held-out steps").mape, 4)  # what validate gates a profile on
    assert loaded.source.startswith("kvsim profile --backend cpu --model tiny --kv-cache-dtype fp32 --seed 3 on ")
    assert f"torch {torch.__version__} with num_threads=1, timed on thread CPU time," in loaded.source
    base = load_device("cpu")
    assert loaded.operators != base.operators
    for coeffs in loaded.operators.values():
        for value in (coeffs.call_s, coeffs.compute_efficiency, coeffs.memory_efficiency):
            assert value is None or (np.isfinite(value) and value >= 0)
    plan_features = shape_features(prefill(40) + ragged_decode(3, 50), BS)
    assert CostModel(TINY, loaded, BS).predict(plan_features) != CostModel(TINY, base, BS).predict(plan_features)

    names = {e.name for e in result.errors}
    assert {"gemm", "forward without attention", "kv_write", "attention", "lm_head", "sampling", "block_copy", "swap"} <= names
    assert {"steps", "held-out steps"} <= names and any(name.startswith("engine ") for name in names)  # engine-run steps are fitted
    held = result.error("held-out steps")
    assert held.samples >= SMALL.engine_requests + 1  # every request's prefill plus at least one more step
    fitted_engine_steps = sum(label.startswith("engine ") for label in result.measurements.labels["steps"])
    assert fitted_engine_steps > held.samples  # a run at each of SMALL.engine_rates, the held-out run at the first
    assert 0 <= held.mape <= held.max_error and result.step_noise >= 0
    assert any(line.startswith("held-out steps") for line in lines) and lines[-1].startswith("profiled in")
    # the speed check's reference steps, timed as validate times them, for it to tell drift from model error
    assert list(loaded.reference_steps_s) == [label for label, _ in REFERENCE_SHAPES]
    assert all(np.isfinite(s) and s > 0 for s in loaded.reference_steps_s.values())
    # and where the fit landed against them, which validate's verdict weighs: recomputed from the recorded times
    from kvsim.realexec.speed_check import median_ratio, reference_times

    _, features = reference_times(get_backend("cpu"), TINY, BS, "fp32", 3, executors=1)
    predicted = [float(CostModel(TINY, loaded, BS).predict(f)) for f in features]
    assert loaded.reference_fit_ratio == round(median_ratio(list(loaded.reference_steps_s.values()), predicted), 4) > 0
    assert any(line.startswith("the reference steps timed right after the cases took") for line in lines)


def test_base_device_sweep_and_machine_follow_the_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvsim.realexec.backends.cuda import CudaBackend
    from kvsim.realexec.backends.npu import NpuBackend

    cpu = get_backend("cpu")
    assert cpu.default_profile() == "cpu" and sweep_for(cpu, quick=True) == QUICK
    assert not cpu.needs_batch_blocks_within_pool and cpu.clock == "thread CPU time"
    standin = make_torch_npu_standin()
    standin.npu.get_device_name = lambda index: f"Ascend910B3 #{index}"
    npu = NpuBackend("cpu", torch_npu_module=standin)
    assert npu.default_profile() == "ascend-910b3" and npu.machine_name() == "Ascend910B3 #0"
    assert sweep_for(npu, quick=True).block_sizes == sweep_for(npu, quick=False).block_sizes == (128, 256)  # FIA's sizes
    assert npu.needs_batch_blocks_within_pool and npu.clock.startswith("device events")
    cuda = object.__new__(CudaBackend)  # its facts without a GPU
    cuda.device = torch.device("cuda", 0)
    for device_name, profile_name in (("NVIDIA H100 80GB HBM3", "h100-sxm"), ("NVIDIA H100 PCIe", "h100-pcie"), ("NVIDIA H200", "h200"),
                                      ("NVIDIA A100-SXM4-80GB", "a100-sxm")):
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None, name=device_name: name)
        assert cuda.default_profile() == profile_name and cuda.machine_name() == device_name
        assert device_name in cuda.fingerprint_parts()
    for unprofiled in ("Tesla T4", "NVIDIA A100-SXM4-40GB"):  # no bundled profile: half the A100's memory
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None, name=unprofiled: name)
        with pytest.raises(ValueError, match=f"{unprofiled}.*--base-device"):
            cuda.default_profile()


@pytest.mark.parametrize(
    "args, message",
    [
        (["--backend", "tpu"], "unknown backend 'tpu'"),
        (["--model", "nope"], "unknown model 'nope'"),
        (["--base-device", "nope"], "unknown device 'nope'"),
        (["--out", "no/such/dir/p.toml"], "directory no/such/dir does not exist"),
        (["--backend", "cuda"] if not torch.cuda.is_available() else ["--backend", "cpu", "--device", "cuda"], "cuda"),
    ],
)
def test_cli_bad_input_is_one_line(args: list[str], message: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    full = ["--out", "p.toml", *args] if "--out" not in args else args
    result = CliRunner().invoke(profile_command, full)
    assert result.exit_code != 0
    output = result.output.strip()
    assert output.startswith("Error: ") and "\n" not in output and message in output, output
    assert not (tmp_path / "p.toml").exists()


def test_a_step_instance_runs_twice_on_the_same_blocks_as_a_served_decode_does() -> None:
    executor = Executor(TINY, get_backend("cpu"), num_blocks=64, block_size=BS, seed=0)
    plans = []
    step = executor.step
    passes: list[int | None] = []
    executor.step = lambda plan, repeats=None: plans.append(plan) or passes.append(repeats) or step(plan, repeats)
    case = OperatorBenches(executor, np.random.default_rng(0), 0).step(decode(2, 40)).case
    first = case()
    first(), first()
    case()()
    tables = [list(plan.block_tables.values()) for plan in plans]
    assert tables[0] == tables[1] != tables[2]  # primed and timed run share a layout; the next instance gets its own
    assert not set(plans[0].block_tables) & set(plans[1].block_tables)  # fresh requests each run
    assert passes == [1, 1, 1]  # one pass per run: the case's median over rounds is its estimate


def test_int8_benches_write_and_attend_through_the_quantised_cache_with_the_executors_scales(monkeypatch: pytest.MonkeyPatch) -> None:
    backend = get_backend("cpu")
    executor = Executor(TINY, backend, num_blocks=64, block_size=BS, seed=0, kv_dtype="int8")
    assert executor.kv_dtype == torch.int8 and all(s is not None for s in executor.kv_scales)
    calls: list[tuple[str, torch.dtype, torch.dtype, object]] = []
    for name in ("write_kv", "attention"):
        real = getattr(backend, name)

        def spy(*args, name=name, real=real):
            key_cache = args[2 if name == "write_kv" else 1]
            calls.append((name, args[0].dtype, key_cache.dtype, args[-1]))
            return real(*args)

        monkeypatch.setattr(backend, name, spy)
    benches = OperatorBenches(executor, np.random.default_rng(0), 0)
    benches.kv_write(16).case()()
    benches.attention(decode(2, 40), KVPool(executor.kv_caches, BS, executor.num_blocks)).case()()
    layers = TINY.num_layers
    assert [c[0] for c in calls] == ["write_kv"] * layers + ["attention"] * layers
    for i, (_, data_dtype, cache_dtype, scales) in enumerate(calls):
        assert data_dtype == executor.attention_dtype and cache_dtype == torch.int8
        assert scales is executor.kv_scales[i % layers]  # each layer's own static scales, as the executor passes them


def test_an_int8_profile_is_measured_and_fitted_with_int8_and_says_so(tmp_path: Path, one_thread: None,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    fitted_with: list[str | None] = []
    executors: list[Executor] = []
    monkeypatch.setattr("kvsim.realexec.profiler.fit_groups",
                        lambda spec, base, bs, data, kv_dtype=None:
                            fitted_with.append(kv_dtype) or fit_groups(spec, base, bs, data, kv_dtype))
    for module in ("profiler", "speed_check"):  # the reference steps too
        monkeypatch.setattr(f"kvsim.realexec.{module}.OperatorBenches",
                            lambda ex, rng, seed: executors.append(ex) or OperatorBenches(ex, rng, seed))
    out = tmp_path / "int8.toml"
    result = run_profile("cpu", "tiny", out, sweep=dataclasses.replace(SMALL, block_sizes=(16,)), seed=3, kv_dtype="int8")
    assert result.kv_dtype == "int8" and fitted_with == ["int8"]
    # every bench, whole step and reference step (one executor each of REFERENCE_EXECUTORS) ran the quantised cache
    assert [ex.kv_dtype for ex in executors] == [torch.int8] * (1 + REFERENCE_EXECUTORS)
    assert load_device(out).source.startswith("kvsim profile --backend cpu --model tiny --kv-cache-dtype int8 --seed 3 on ")


def test_a_negative_gemv_rows_is_rejected_naming_the_field(tmp_path: Path) -> None:
    path = save_device(load_device("cpu"), tmp_path / "d.toml")
    path.write_text(path.read_text().replace("padded_attention", "gemv_rows = -1\npadded_attention"))
    with pytest.raises(ValueError, match="field gemv_rows must be >= 0, got -1"):
        load_device(path)


def test_reference_steps_round_trip_and_a_bad_one_is_named(tmp_path: Path) -> None:
    device = dataclasses.replace(load_device("cpu"), reference_steps_s={"decode 1 x 128": 0.0025, "prefill 256": 0.02},
                                 reference_fit_ratio=1.1234)
    path = save_device(device, tmp_path / "d.toml")
    assert load_device(path) == device
    # a copy biased for a check of the checker keeps where the measured fit landed: the bias cannot explain itself
    assert scaled_profile(device, 1.2).reference_fit_ratio == 1.1234
    path.write_text(path.read_text().replace("0.0025", "-1"))
    with pytest.raises(ValueError, match=r"field reference_steps_s.decode 1 x 128 must be > 0, got -1"):
        load_device(path)


def test_row_count_terms_measure_what_steps_of_a_few_tokens_take_beyond_the_operators(tmp_path: Path) -> None:
    """A BLAS whose 2-row products cost 2 ms more than any roofline: the fit's last term finds it, and only it."""
    base = load_device("cpu")
    truth = base.with_operators(TRUTH)
    data = synthetic_measurements(truth, QUICK)
    tokens = [f.num_tokens for f in data.features["steps"]]
    data.median["steps"] = [s + (2e-3 if t == 2 else 0.0) for s, t in zip(data.median["steps"], tokens)]
    assert tokens.count(2) >= 3  # the quick sweep's 2-sequence decodes

    fitted, errors = fit_groups(TINY, base, 16, data)
    assert list(fitted.row_count_s) == [2] and fitted.row_count_s[2] == pytest.approx(2e-3, rel=0.05)
    before, after = (next(e for e in errors if e.name == name).mape for name in ("steps", "steps with row-count terms"))
    assert after < before
    assert load_device(save_device(fitted, tmp_path / "fitted.toml")) == fitted
    clean, _ = fit_groups(TINY, base, 16, synthetic_measurements(truth, QUICK))
    assert clean.row_count_s == {}  # a device that follows its rooflines gets none


def test_a_row_count_term_is_negative_where_steps_of_that_count_run_under_the_operators() -> None:
    """One-token steps 20 % faster than every operator says (a CPU BLAS's matrix-vector kernel): a negative term, there alone."""
    base = load_device("cpu")
    data = synthetic_measurements(base.with_operators(TRUTH), QUICK)
    tokens = [f.num_tokens for f in data.features["steps"]]
    data.median["steps"] = [s * (0.8 if t == 1 else 1.0) for s, t in zip(data.median["steps"], tokens)]
    assert tokens.count(1) >= 3
    fitted, _ = fit_groups(TINY, base, 16, data)
    assert list(fitted.row_count_s) == [1] and fitted.row_count_s[1] < 0
    ones = [f for f, t in zip(data.features["steps"], tokens) if t == 1]
    measured = [s for s, t in zip(data.median["steps"], tokens) if t == 1]
    predicted = CostModel(TINY, fitted, 16).predict(stack(ones))
    assert np.median(predicted / np.array(measured)) == pytest.approx(1.0, abs=0.02)


def test_the_cost_model_adds_a_row_count_term_at_its_token_count_alone() -> None:
    plain = load_device("cpu")
    device = dataclasses.replace(plain, row_count_s={2: 1e-3})
    shapes = [decode(1, 64), decode(2, 64), prefill(2), decode(3, 64), prefill(30, 16) + decode(2, 40)]
    features = [shape_features(shape, BS) for shape in shapes]
    with_term, without = CostModel(TINY, device, BS), CostModel(TINY, plain, BS)
    added = [with_term.step_total(f) - without.step_total(f) for f in features]
    assert added == pytest.approx([0.0, 1e-3, 1e-3, 0.0, 0.0], abs=1e-12)
    assert with_term.step_split(features[1])["gemm"] - without.step_split(features[1])["gemm"] == pytest.approx(1e-3)
    stacked = stack(features)  # the fit's and replay's array path agrees with the simulator's one-step path
    assert with_term.predict(stacked) == pytest.approx([with_term.step_total(f) for f in features], rel=1e-12)


def test_row_count_terms_round_trip_and_a_bad_one_is_named(tmp_path: Path) -> None:
    device = dataclasses.replace(load_device("cpu"), row_count_s={2: 0.0021, 3: 0.0017})
    path = save_device(device, tmp_path / "d.toml")
    assert load_device(path) == device
    text = path.read_text()
    path.write_text(text.replace('"3" = ', '"three" = '))
    with pytest.raises(ValueError, match=r'field row_count_s.three must be named by a positive token count, like "2"'):
        load_device(path)
    path.write_text(text.replace("0.0017", "-0.001"))  # steps of 3 tokens running under their operators
    assert load_device(path).row_count_s == {2: 0.0021, 3: -0.001}
    path.write_text(text.replace("0.0017", '"fast"'))
    with pytest.raises(ValueError, match=r"field row_count_s.3 must be a finite number of seconds, got 'fast'"):
        load_device(path)
