"""A run's files (summary.json, requests.csv, steps.csv) and its printed summary table.

``kvsim simulate`` and ``kvsim execute`` write the same files, so reports and scripts read
either world the same way. The decision log is streamed during the run (``sim.run.decisions``). Each file is
written under a temporary name and renamed, so a reader never sees half of one.
"""

from __future__ import annotations

import contextlib
import csv
import json
import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO

import numpy as np

from kvsim.sim.run.metrics import MEASURED_STEP_COLUMNS, STEP_COLUMNS, StepLog, plain_step_values
from kvsim.sim.run.request_records import REQUEST_COLUMNS, RequestRecords

SUMMARY = "summary.json"
REQUESTS = "requests.csv"
STEPS = "steps.csv"
_WRITE_ROWS = 65536  # rows turned into text at a time: a cluster's millions are never all text at once


def _clean(value):
    """JSON has no NaN: write null."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


@contextlib.contextmanager
def atomic_open(path: Path) -> Iterator[TextIO]:
    """Write ``path`` through a temporary sibling renamed over it once closed without error."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with tmp.open("w", newline="") as fh:
            yield fh
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_summary(out_dir: Path, summary: dict) -> Path:
    path = out_dir / SUMMARY
    with atomic_open(path) as fh:
        fh.write(json.dumps(_clean(summary), indent=2, sort_keys=False) + "\n")
    return path


def write_requests(out_dir: Path, requests: RequestRecords, instance: np.ndarray | None = None) -> Path:
    """requests.csv in ``REQUEST_COLUMNS`` order; ``instance``: a last column (a cluster's)."""
    path = out_dir / REQUESTS
    with atomic_open(path) as fh:
        writer = csv.writer(fh)
        writer.writerow(REQUEST_COLUMNS if instance is None else (*REQUEST_COLUMNS, "instance"))
        for first in range(0, len(requests), _WRITE_ROWS):
            rows = requests.tuples(first, first + _WRITE_ROWS)
            if instance is not None:
                rows = [(*row, i) for row, i in zip(rows, instance[first:first + _WRITE_ROWS].tolist())]
            writer.writerows(rows)  # csv writes None as an empty field
    return path


# A simulated step's row (no measured fields) as the csv module writes it: ints by str, floats by
# repr, a kind that needs no quoting, three empty cells. One format a row takes two thirds of
# the csv module's time (57,000 rows: 0.15 -> 0.10 s), what a long trace's run is otherwise waiting on.
_SIMULATED_STEP_FIELDS = ",".join(["%d", "%r", "%r", "%d", "%s"] + ["%d"] * 10) + ",,,"
_MEASURED_FIELDS = len(STEP_COLUMNS) - len(MEASURED_STEP_COLUMNS)  # where device_s, host_s, memory_bytes start


def write_steps(out_dir: Path, steps: StepLog | np.ndarray, instance: np.ndarray | None = None,
                order: np.ndarray | None = None) -> Path:
    """steps.csv from a log or a record array (``STEP_DTYPE``); ``instance``: a last column (a
    cluster's); ``order``: the rows in the order to write them (a cluster's by end time), gathered a
    chunk at a time rather than copying the whole table in that order."""
    table = steps.table() if isinstance(steps, StepLog) else steps
    path = out_dir / STEPS
    header = STEP_COLUMNS if instance is None else (*STEP_COLUMNS, "instance")
    simulated_row = _SIMULATED_STEP_FIELDS + ("\r\n" if instance is None else ",%d\r\n")
    with atomic_open(path) as fh:
        writer = csv.writer(fh)
        writer.writerow(header)
        for first in range(0, len(table), _WRITE_ROWS):
            rows = slice(first, first + _WRITE_ROWS) if order is None else order[first:first + _WRITE_ROWS]
            chunk = table[rows]
            measured = not all(np.isnan(chunk[name]).all() for name in MEASURED_STEP_COLUMNS)
            names = STEP_COLUMNS if measured else STEP_COLUMNS[:_MEASURED_FIELDS]
            columns = [plain_step_values(name, chunk[name]) for name in names]
            if instance is not None:
                columns.append(instance[rows].tolist())
            if measured:
                writer.writerows(zip(*columns))  # csv writes None as an empty field
            else:
                fh.write("".join([simulated_row % row for row in zip(*columns)]))
    return path


def read_summary(run_dir: Path) -> dict:
    return json.loads((Path(run_dir) / SUMMARY).read_text())


def read_csv(path: Path) -> dict[str, list[str]]:
    """Columns of a CSV as lists of strings (callers convert what they need)."""
    with Path(path).open(newline="") as fh:
        reader = csv.reader(fh)
        header = next(reader)
        columns: dict[str, list[str]] = {h: [] for h in header}
        for row in reader:
            for h, v in zip(header, row):
                columns[h].append(v)
    return columns


def _latency_unit(dist: dict) -> tuple[str, float]:
    """ms, as vLLM's benchmark prints, unless the worst figure reaches 10 s: then seconds."""
    worst = max((v for v in dist.values() if v is not None), default=0.0)
    return ("s", 1.0) if worst >= 10 else ("ms", 1e3)


def _scaled(dist: dict, key: str, factor: float) -> str:
    v = dist.get(key)
    return "n/a" if v is None else f"{v * factor:.2f}"


def model_fact_lines(name: str, facts: dict) -> list[str]:
    """What a run used of an MoE, MLA or W8A8 model (ModelSpec.facts), one line each."""
    lines = [f"Model: {name} ({facts['architecture']}), {facts['total_params'] / 1e9:.2f}B parameters, "
             f"{facts['active_params'] / 1e9:.2f}B active per token"]
    moe = facts.get("moe")
    if moe:
        routing = moe.get("routing", f"top-{moe['num_experts_per_tok']} of {moe['num_experts']} experts")
        shared = f", shared experts {moe['shared_expert_intermediate_size']} wide" if moe["shared_expert_intermediate_size"] else ""
        lines.append(f"MoE: {routing}; {moe['moe_layers']} MoE layers, {moe['dense_layers']} dense{shared}")
    mla = facts.get("mla")
    if mla:
        lines.append(f"MLA: {mla['cached_values_per_token_per_layer']} cached values per token per layer "
                     f"(latent {mla['kv_lora_rank']} + rope key {mla['qk_rope_head_dim']}); decode {mla['decode']}")
    if facts.get("quantization"):
        lines.append(f"Quantization: {facts['quantization']} (decoder-layer matmuls in int8)")
    return lines


def format_summary(summary: dict, title: str = "kvsim simulate") -> str:
    """A summary table in the style of vLLM's serving benchmark."""
    width = 50
    lines = [f"{' ' + title + ' ':=^{width}}"]

    def row(label: str, value) -> None:
        lines.append(f"{label:<40}{value:>10}")

    resolved = summary.get("config", {}).get("resolved", {})
    if resolved.get("model"):
        lines += model_fact_lines(summary["config"]["model"], resolved["model"])
    if "router" in summary:
        r = summary["router"]
        lines.append(f"Cluster: {r['instances']} instances behind {r['name']}"
                     + (f" (view {r['staleness_s']:g} s stale)" if r["staleness_s"] else ""))
    if "autoscaler" in summary:
        a = summary["autoscaler"]
        lines.append(f"Autoscaler {a['name']}: {a['launched']} launched, {a['retired']} retired "
                     f"({a['min_instances']}-{a['max_instances']}); {summary['instance_seconds']:.0f} instance-seconds, "
                     f"{summary['completed_per_instance_hour']:.0f} requests per instance-hour")
    if "parallel" in summary:
        p = summary["parallel"]
        lines.append(f"Layout: {p['layout']}, {resolved['parallel']['blocks_per_rank']} KV blocks per rank; "
                     f"collectives {100 * p['collective_share']:.1f} % of step time")
    row("Successful requests:", summary["requests_completed"])
    row("Rejected requests:", summary["requests_rejected"])
    row("Duration (s):", f"{summary['duration_s']:.2f}")
    row("Total generated tokens:", summary.get("output_tokens", "n/a"))
    row("Request throughput (req/s):", f"{summary['request_rate_rps']:.2f}")
    row("Output token throughput (tok/s):", f"{summary['throughput_tok_s']:.2f}")
    row("Preemptions:", summary["preemptions"])
    for key in (k for k in summary if k.endswith("hit_rate")):  # prefix hits, and any split of them the summary has
        row(f"{key.replace('_', ' ').capitalize()} (%):", f"{100 * summary[key]:.2f}")
    row("KV blocks (peak used / total):", f"{summary['peak_kv_blocks_used']}/{summary['num_kv_blocks']}")
    row("Mean KV usage (%):", f"{100 * summary['mean_kv_usage']:.1f}")
    for key, heading, name in (
        ("ttft_s", "Time to First Token", "TTFT"),
        ("tpot_s", "Time per Output Token (excl. 1st token)", "TPOT"),
        ("itl_s", "Inter-token Latency", "ITL"),
        ("e2e_s", "End-to-end Latency", "E2EL"),
    ):
        lines.append(f"{heading:-^{width}}")
        dist = summary[key]
        unit, factor = _latency_unit(dist)
        row(f"Mean {name} ({unit}):", _scaled(dist, "mean", factor))
        row(f"Median {name} ({unit}):", _scaled(dist, "p50", factor))
        row(f"P90 {name} ({unit}):", _scaled(dist, "p90", factor))
        row(f"P99 {name} ({unit}):", _scaled(dist, "p99", factor))
    lines.append("=" * width)
    if "wall_s" in summary:
        lines.append(f"wall time {summary['wall_s']:.2f} s, {summary.get('steps', '?')} steps")
    return "\n".join(lines)
