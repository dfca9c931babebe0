"""reports/: the validation and comparison HTML reports, their JSON, downsampling, the CLI, rendering."""

from __future__ import annotations

import base64
import json
import re
import shutil
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from plotly.offline import get_plotlyjs

from kvsim.cli.main import main as kvsim
from kvsim.reports.compare import Slo, slo_attainment, write_compare_report
from kvsim.reports.downsample import even_indices, minmax_indices
from kvsim.reports.render_check import CHROMIUM, decode_png, render_check
from kvsim.reports.runs import ReportInputError, default_labels, load_run
from kvsim.reports.validation import step_pairs, write_validation_report
from kvsim.sim.run.decisions import read_decisions

DEMO_RUNS = {
    # two devices: the CPU run stands in for the measured world, the 910B3 one for the prediction
    "cpu": ["--device", "cpu", "--model", "tiny"],
    "ascend": [],
    "paged": ["--block-manager", "paged"],
    "contiguous": ["--block-manager", "contiguous", "--max-model-len", "4096"],
    "preempting": ["--block-manager", "paged", "--num-blocks", "6", "--max-num-seqs", "8"],
    "rejecting": ["--num-blocks", "6", "--watermark", "0.3", "--max-waiting", "1"],
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("runs")
    cli = CliRunner()
    for name, args in DEMO_RUNS.items():
        result = cli.invoke(kvsim, ["simulate", "--trace", "demo", "--quiet", "--decisions", "full", "--out", str(base / name),
                                    *args])
        assert result.exit_code == 0, result.output
    return {name: base / name for name in DEMO_RUNS}


# --- a validation.json as `kvsim validate` writes it, computed from two real runs --------


def _first_divergence(real: Path, sim: Path) -> tuple[int, dict | None]:
    real_log, sim_log = list(read_decisions(real, per_step=True)), list(read_decisions(sim, per_step=True))
    for step in range(max(len(real_log), len(sim_log))):
        ra = real_log[step] if step < len(real_log) else None
        sa = sim_log[step] if step < len(sim_log) else None
        if ra != sa:
            load = lambda line: None if line is None else json.loads(line)  # noqa: E731
            return step, {"step": step, "real": load(ra), "sim": load(sa)}
    return len(real_log), None


def _rel(real: float, sim: float) -> dict:
    return {"real": real, "sim": sim, "rel_error": (sim - real) / real}


def _timing_stats(measured: np.ndarray, predicted: np.ndarray) -> dict:
    error = predicted - measured
    return {"mape": float(np.mean(np.abs(error) / measured)), "p90_abs_error_s": float(np.percentile(np.abs(error), 90)),
            "steps": int(len(measured))}


def make_validation(real_dir: Path, sim_dir: Path) -> dict:
    real, sim = load_run(real_dir), load_run(sim_dir)
    compared, divergence = _first_divergence(real_dir, sim_dir)
    pairs = step_pairs(real, sim)
    same = pairs["matched"]
    measured, predicted, kinds = pairs["measured_s"][same], pairs["predicted_s"][same], pairs["kind"][same]
    per_step = _timing_stats(measured, predicted)
    per_step["by_kind"] = {k: _timing_stats(measured[kinds == k], predicted[kinds == k]) for k in np.unique(kinds)}
    rs, ss = real.summary, sim.summary
    latency = {m: {p: _rel(rs[m][p], ss[m][p]) for p in ("p50", "p99")} for m in ("ttft_s", "tpot_s", "e2e_s")}
    pool = {"predicted": ss["memory"]["kv_pool_bytes"], "measured": rs["memory"]["kv_pool_bytes"]}
    pool["rel_error"] = (pool["predicted"] - pool["measured"]) / pool["measured"]
    checks = [
        {"name": "decisions identical", "value": float(divergence is None), "threshold": 1.0, "passed": divergence is None,
         "group": "decisions"},
        {"name": "per-step MAPE", "value": per_step["mape"], "threshold": 0.15, "passed": per_step["mape"] <= 0.15, "group": "timing"},
        {"name": "TTFT p99 rel error", "value": latency["ttft_s"]["p99"]["rel_error"], "threshold": 0.2,
         "passed": abs(latency["ttft_s"]["p99"]["rel_error"]) <= 0.2, "group": "latency"},
        {"name": "KV pool rel error", "value": pool["rel_error"], "threshold": 0.05, "passed": abs(pool["rel_error"]) <= 0.05,
         "group": "memory"},
        {"name": "peak device memory", "value": None, "threshold": 0.1, "passed": True, "group": "memory"},
    ]
    return {
        "passed": all(c["passed"] for c in checks),
        "checks": checks,
        "decision_identity": {"identical": divergence is None, "steps_compared": compared, "first_divergence": divergence},
        "timing": {
            "per_step": per_step,
            "latency": latency,
            "throughput_tok_s": _rel(rs["throughput_tok_s"], ss["throughput_tok_s"]),
            "makespan_s": _rel(rs["duration_s"], ss["duration_s"]),
        },
        "memory": {
            "kv_pool_bytes": pool,
            "peak_device_bytes": {"predicted": ss["memory"]["budget_bytes"], "measured": None, "rel_error": None},
            "peak_kv_blocks_used": {"real": rs["peak_kv_blocks_used"], "sim": ss["peak_kv_blocks_used"]},
            "preemptions": {"real": rs["preemptions"], "sim": ss["preemptions"]},
        },
        "config": ss["config"],
        "backend": "cpu",
        "profile": None,
    }


@pytest.fixture(scope="module")
def validation_dir(runs, tmp_path_factory) -> Path:
    """What `kvsim validate --out DIR` leaves: real/, sim/ and validation.json."""
    base = tmp_path_factory.mktemp("validate")
    shutil.copytree(runs["cpu"], base / "real")
    shutil.copytree(runs["ascend"], base / "sim")
    (base / "validation.json").write_text(json.dumps(make_validation(base / "real", base / "sim"), indent=1))
    return base


EXTERNAL_REF = re.compile(r"<(?:script|link|img|iframe)\b[^>]*\b(?:src|href)\s*=", re.IGNORECASE)


def assert_self_contained(html: str) -> None:
    """No element loads anything: plotly.js and the CSS are inline."""
    assert not EXTERNAL_REF.findall(html)
    assert "@import" not in html
    assert html.count("<script") >= 2 and "Plotly.newPlot" in html


def figure_data(html: str) -> list[list[dict]]:
    """The traces of every figure on the page, decoded from the Plotly.newPlot calls (typed arrays as lists)."""
    decoder = json.JSONDecoder()
    figures = []
    for match in re.finditer(r'Plotly\.newPlot\(\s*"figure-\d+",\s*', html):
        traces, _ = decoder.raw_decode(html, match.end())
        figures.append([_plain(t) for t in traces])
    return figures


def _plain(value):
    if isinstance(value, dict) and set(value) >= {"dtype", "bdata"}:
        return np.frombuffer(base64.b64decode(value["bdata"]), dtype=value["dtype"]).tolist()
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


# --- downsampling ------------------------------------------------------------------------


def test_minmax_downsampling_keeps_ends_and_extremes_and_bounds_size():
    rng = np.random.default_rng(0)
    y = rng.normal(size=300_000)
    y[123_457] = 50.0  # a one-step spike must survive
    y[200_001] = -50.0
    keep = minmax_indices(y, 5000)
    assert len(keep) <= 5000
    assert keep[0] == 0 and keep[-1] == len(y) - 1
    assert {123_457, 200_001} <= set(keep.tolist())
    assert np.all(np.diff(keep) > 0)
    assert np.array_equal(minmax_indices(y[:100], 5000), np.arange(100))


def test_minmax_downsampling_ignores_nan():
    y = np.full(10_000, np.nan)
    y[5000] = 3.0
    assert 5000 in minmax_indices(y, 100)


def test_even_indices_are_evenly_spaced_with_both_ends():
    keep = even_indices(1_000_001, 5000)
    assert len(keep) == 5000 and keep[0] == 0 and keep[-1] == 1_000_000
    assert np.ptp(np.diff(keep)) <= 1


# --- run directories ---------------------------------------------------------------------


def test_load_run_reads_every_step_and_request(runs):
    run = load_run(runs["paged"])
    summary = run.summary
    assert len(run.steps["step"]) == summary["steps"]
    assert int(run.steps["kv_used"].max()) == summary["peak_kv_blocks_used"]
    assert (run.requests["status"] == "finished").sum() == summary["requests_completed"]


def test_default_labels_name_the_differing_config_fields(runs):
    labels = default_labels([load_run(runs["paged"]), load_run(runs["contiguous"])])
    assert labels == ["paged max_model_len=null", "contiguous max_model_len=4096"]
    # the same config twice cannot be told apart by it: directory names
    assert default_labels([load_run(runs["paged"]), load_run(runs["paged"])]) == ["paged", "paged"]


def test_bad_csv_cell_is_reported_with_file_line_and_column(runs, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(runs["paged"], bad)
    lines = (bad / "steps.csv").read_text().splitlines()
    header = lines[0].split(",")
    cells = lines[3].split(",")
    cells[header.index("kv_used")] = "lots"
    lines[3] = ",".join(cells)
    (bad / "steps.csv").write_text("\n".join(lines) + "\n")
    with pytest.raises(ReportInputError, match=r"steps\.csv: line 4: column kv_used: not a number: 'lots'"):
        load_run(bad)


# --- validation report -------------------------------------------------------------------


def test_validation_report_draws_every_step_kind_and_both_runs(validation_dir, tmp_path):
    validation = json.loads((validation_dir / "validation.json").read_text())
    out = write_validation_report(validation, {"real": validation_dir / "real", "sim": validation_dir / "sim"}, tmp_path / "v.html")
    html = out.read_text()
    assert_self_contained(html)
    scatter, histogram, cdfs, kv = figure_data(html)
    real, sim = load_run(validation_dir / "real"), load_run(validation_dir / "sim")
    pairs = step_pairs(real, sim)
    # scatter: one trace per kind among matched steps, the unmatched ones, and y = x
    drawn = {t["name"].split(" (")[0]: t for t in scatter}
    kinds = set(np.unique(pairs["kind"][pairs["matched"]]).tolist())
    assert kinds <= set(drawn) and "y = x" in drawn
    assert drawn["different batch"]["visible"] == "legendonly"
    counted = sum(int(re.search(r"\((\d+) steps\)", t["name"]).group(1)) for t in scatter if t["name"] != "y = x")
    assert counted == len(pairs["step"])
    # histogram: every matched step is in exactly one bin
    assert sum(sum(t["y"]) for t in histogram) == validation["timing"]["per_step"]["steps"]
    # CDFs: TTFT, TPOT and e2e of both runs, ending at 1 at the largest latency
    assert {t["name"] for t in cdfs} == {"real", "sim"} and len(cdfs) == 6
    ttft_real = cdfs[0]
    assert ttft_real["y"][-1] == 1.0 and ttft_real["x"][-1] == pytest.approx(np.nanmax(real.requests["ttft_s"]))
    # KV blocks over time reach each run's peak
    assert [max(t["y"]) for t in kv] == [real.summary["peak_kv_blocks_used"], sim.summary["peak_kv_blocks_used"]]
    # tables: every check with its verdict, the divergence with both plans
    for check in validation["checks"]:
        assert f"<td class=\"text\">{check['name']}</td>" in html
    assert html.count('<td class="fail">FAIL</td>') == sum(not c["passed"] for c in validation["checks"])
    step = validation["decision_identity"]["first_divergence"]["step"]
    assert f"first divergence at step {step}" in html
    assert 'class="text diff"' in html


def test_validation_report_from_lead_series_and_identical_decisions(validation_dir, tmp_path):
    """With validate's per-plan predictions (series.step_time) every step is matched; identical logs say so."""
    validation = json.loads((validation_dir / "validation.json").read_text())
    real = load_run(validation_dir / "real")
    measured = real.steps["duration_s"].tolist()
    validation["series"] = {"step_time": {"measured": measured, "predicted": [1.1 * m for m in measured],
                                          "kind": real.steps["kind"].tolist()}}
    validation["decision_identity"] = {"identical": True, "steps_compared": len(measured), "first_divergence": None}
    out = write_validation_report(validation, {"real": validation_dir / "real", "sim": validation_dir / "sim",
                                               "replay": validation_dir / "no-such-replay"}, tmp_path / "v.html")
    html = out.read_text()
    scatter, histogram, *_ = figure_data(html)
    assert not any(t["name"].startswith("different batch") for t in scatter)
    centers = [x for t in histogram for x, n in zip(t["x"], t["y"]) if n]
    assert min(centers) == pytest.approx(10.0, abs=1.0) and max(centers) == pytest.approx(10.0, abs=1.0)
    assert f"identical decision logs over {len(measured)} steps" in html


def test_validation_cli_rerenders_beside_the_json(validation_dir, tmp_path):
    out = tmp_path / "again.html"
    result = CliRunner().invoke(kvsim, ["report", "validation", str(validation_dir / "validation.json"), "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert len(figure_data(out.read_text())) == 4


def test_validation_cli_errors_name_the_path(validation_dir, tmp_path):
    cli = CliRunner()
    lonely = tmp_path / "validation.json"
    lonely.write_text((validation_dir / "validation.json").read_text())
    result = cli.invoke(kvsim, ["report", "validation", str(lonely), "--out", str(tmp_path / "r.html")])
    assert result.exit_code == 2  # a user error
    assert f"Error: {tmp_path / 'real'}: not a directory" in result.output
    (tmp_path / "other.json").write_text('{"passed": true}')
    result = cli.invoke(kvsim, ["report", "validation", str(tmp_path / "other.json"), "--out", str(tmp_path / "r.html")])
    assert "not a kvsim validation result (missing checks, decision_identity, timing, memory)" in result.output
    (tmp_path / "broken.json").write_text('{"passed": tru')
    result = cli.invoke(kvsim, ["report", "validation", str(tmp_path / "broken.json"), "--out", str(tmp_path / "r.html")])
    assert f"{tmp_path / 'broken.json'}: line 1: invalid JSON" in result.output


# --- comparison report -------------------------------------------------------------------


def test_compare_cli_writes_html_and_json_with_every_figure(runs, tmp_path):
    names = ["paged", "contiguous", "preempting", "rejecting"]
    args = ["report", "compare", *(str(runs[n]) for n in names), *(a for n in names for a in ("--label", n)),
            "--out", str(tmp_path / "cmp"), "--slo-ttft", "0.05", "--slo-tpot", "0.02"]
    result = CliRunner().invoke(kvsim, args)
    assert result.exit_code == 0, result.output
    data = json.loads((tmp_path / "cmp" / "compare.json").read_text())
    html = (tmp_path / "cmp" / "compare.html").read_text()
    assert_self_contained(html)
    assert [r["label"] for r in data["runs"]] == names
    assert data["slo"] == {"ttft_s": 0.05, "tpot_s": 0.02}
    summaries = {n: load_run(runs[n]).summary for n in names}
    figures = data["figures"]
    for n in names:
        s = summaries[n]
        assert figures["throughput_vs_p99_ttft"][n] == {"p99_ttft_s": s["ttft_s"]["p99"], "throughput_tok_s": s["throughput_tok_s"]}
        assert figures["preemptions"][n] == s["preemptions"]
        assert figures["rejections"][n] == s["rejection_reasons"]
        assert figures["prefix_hit_rate"][n] == s["prefix_hit_rate"]
        assert max(figures["kv_usage_pct"][n]["used_pct"]) == pytest.approx(100 * s["peak_kv_blocks_used"] / s["num_kv_blocks"])
        assert set(figures["latency_cdfs"]) == {"ttft_s", "tpot_s", "e2e_s"}
    assert figures["preemptions"]["preempting"] > 0
    assert set(figures["rejections"]["rejecting"]) == {"exceeds_kv_pool", "queue_full"}
    # a max-length reservation holds max_model_len / block_size blocks per sequence; paging holds what is written
    assert max(figures["kv_blocks_per_sequence"]["contiguous"]["blocks"]) == 4096 / 128
    assert max(figures["kv_blocks_per_sequence"]["paged"]["blocks"]) <= 600 / 128 + 1
    # the page draws the same numbers
    plotted = figure_data(html)
    scatter = {t["name"]: (t["x"][0], t["y"][0]) for t in plotted[0]}
    assert scatter["contiguous"] == (summaries["contiguous"]["ttft_s"]["p99"], summaries["contiguous"]["throughput_tok_s"])
    goodput_bars = plotted[1][1]
    assert goodput_bars["y"] == [figures["goodput"][n]["goodput_rps"] for n in names]
    assert "<td class=\"text\">preempting</td>" in html


def test_goodput_counts_requests_meeting_both_slos(runs):
    run = load_run(runs["rejecting"])
    req = run.requests
    roots = req["parent"] == ""
    finished = roots & (req["status"] == "finished")
    ttft_cut = float(np.median(req["ttft_s"][finished]))
    met, total = slo_attainment(run, Slo(ttft_s=ttft_cut, tpot_s=1e9))
    assert total == roots.sum()
    assert met == (finished & (req["ttft_s"] <= ttft_cut)).sum()
    tpot_cut = float(np.nanmin(req["tpot_s"][finished]))
    met, _ = slo_attainment(run, Slo(ttft_s=1e9, tpot_s=tpot_cut))
    assert met == (finished & ((req["tpot_s"] <= tpot_cut) | np.isnan(req["tpot_s"]))).sum()
    assert slo_attainment(run, Slo(1e9, 1e9))[0] == run.summary["requests_completed"]


def test_compare_bounds_large_runs(runs, tmp_path):
    """A long run's time series are thinned to at most 5000 points that keep its first and last step."""
    big = tmp_path / "big"
    shutil.copytree(runs["paged"], big)
    lines = (big / "steps.csv").read_text().splitlines()
    header, body = lines[0], lines[1:]
    start = header.split(",").index("start_s")
    repeats = 30_000 // len(body) + 1
    longer = []
    for r in range(repeats):  # the run replayed back to back: same rows, shifted in time
        for line in body:
            cells = line.split(",")
            cells[start] = repr(float(cells[start]) + 100.0 * r)
            longer.append(",".join(cells))
    (big / "steps.csv").write_text("\n".join([header, *longer]) + "\n")
    html_path, json_path = write_compare_report([big], tmp_path / "out")
    usage = json.loads(json_path.read_text())["figures"]["kv_usage_pct"]["big"]
    assert len(usage["used_pct"]) <= 5000 < len(longer)
    assert usage["t_used_pct"][0] == 0.0 and usage["t_used_pct"][-1] == float(longer[-1].split(",")[start])
    assert html_path.stat().st_size < 8e6


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda d: d / "absent", "{d}/absent: not a directory"),
        (lambda d: d, "{d}: not a kvsim run directory (no summary.json)"),
    ],
)
def test_compare_cli_bad_paths_are_one_line_errors(tmp_path, make, message):
    result = CliRunner().invoke(kvsim, ["report", "compare", str(make(tmp_path)), "--out", str(tmp_path / "o")])
    assert result.exit_code == 2  # a user error
    assert result.output.strip() == "Error: " + message.format(d=tmp_path)


def test_compare_cli_missing_file_and_label_count(runs, tmp_path):
    partial = tmp_path / "partial"
    shutil.copytree(runs["paged"], partial)
    (partial / "requests.csv").unlink()
    cli = CliRunner()
    result = cli.invoke(kvsim, ["report", "compare", str(partial), "--out", str(tmp_path / "o")])
    assert result.output.strip() == f"Error: {partial / 'requests.csv'}: missing"
    result = cli.invoke(kvsim, ["report", "compare", str(runs["paged"]), "--label", "a", "--label", "b", "--out", str(tmp_path / "o")])
    assert result.output.strip() == "Error: 2 label(s) for 1 run(s)"


# --- headless Chromium -------------------------------------------------------------------


def encode_png(pixels: np.ndarray, filters: list[int]) -> bytes:
    """A PNG with the given filter on each row (the forward transform, for the decoder to undo)."""
    height, width, channels = pixels.shape
    x = pixels.astype(np.int32)
    zero_row, zero_col = np.zeros((1, width, channels), np.int32), np.zeros((height, 1, channels), np.int32)
    up = np.concatenate([zero_row, x[:-1]])
    left = np.concatenate([zero_col, x[:, :-1]], axis=1)
    up_left = np.concatenate([zero_col, up[:, :-1]], axis=1)
    p = left + up - up_left
    pa, pb, pc = np.abs(p - left), np.abs(p - up), np.abs(p - up_left)
    paeth = np.where((pa <= pb) & (pa <= pc), left, np.where(pb <= pc, up, up_left))
    predictors = [np.zeros_like(x), left, up, (left + up) // 2, paeth]
    raw = b"".join(bytes([f]) + ((x[y] - predictors[f][y]) & 0xFF).astype(np.uint8).tobytes() for y, f in enumerate(filters))

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    header = struct.pack(">IIBBBBB", width, height, 8, {3: 2, 4: 6}[channels], 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b"")


@pytest.mark.parametrize("channels", [3, 4])
def test_png_decoder_undoes_every_row_filter(channels):
    rng = np.random.default_rng(channels)
    noise = rng.integers(0, 256, size=(41, 29, channels), dtype=np.uint8)
    gradient = np.broadcast_to((np.arange(29)[None, :, None] * 9 + np.arange(41)[:, None, None] * 5) % 256, noise.shape)
    for image in (noise, gradient.astype(np.uint8)):
        filters = [y % 5 for y in range(image.shape[0])]
        assert np.array_equal(decode_png(encode_png(image, filters)), image)


@pytest.mark.slow
@pytest.mark.skipif(not CHROMIUM.exists(), reason=f"{CHROMIUM} not installed (apt-get install chromium)")
def test_reports_render_in_headless_chromium(runs, validation_dir, tmp_path):
    html_path, _ = write_compare_report([runs["paged"], runs["contiguous"]], tmp_path / "cmp")
    result = render_check(html_path, tmp_path / "compare.png")
    assert result.ok, str(result)
    assert result.drawn == result.figures == 5
    # the same page loading plotly.js from a CDN draws nothing here: the check sees it
    cdn = tmp_path / "cdn.html"
    inline = f'<script type="text/javascript">{get_plotlyjs()}</script>'
    cdn.write_text(html_path.read_text().replace(inline, '<script src="https://cdn.plot.ly/plotly-3.0.1.min.js"></script>'))
    broken = render_check(cdn, tmp_path / "cdn.png")
    assert broken.figures == 5 and broken.drawn == 0 and not broken.ok
