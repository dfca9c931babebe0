"""Fingerprint every simulate output over a grid of workloads x schedulers x block managers.

    python benchmarks/decision_identity.py --write benchmarks/identity/<name>.json
    python benchmarks/decision_identity.py --compare benchmarks/identity/<name>.json
    python benchmarks/decision_identity.py --decisions off ...   # requests, steps and summary of log-less runs

A refactor or a speed-up must not change a single decision: this runs ``kvsim simulate
--decisions full`` as a user would (a subprocess per case, so it fingerprints whatever version
is installed) and records the SHA-256 of the decision log as ``kvsim decisions show`` expands
it (the bytes of the decisions.jsonl that versions before the diff-encoded log wrote, which a
run of such a version still has), the compact record stream itself (the SHA-256 in
decisions.digest.json, which a ``--decisions summary`` run reports), requests.csv, steps.csv
and summary.json (minus its wall-clock fields). ``--compare`` exits 1 naming every case whose fingerprint moved.

Workloads: the bundled demo (tiny model, cpu profile), the bundled Mooncake sample (500
requests) and the first 2,000 rows of the Azure conversation trace (skipped when
../shared/traces is absent), on ascend-910b3 (Qwen2.5-7B for Mooncake, Llama-2-7B for Azure); plus two
tight-pool cases per workload that force recompute and swap preemption.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from kvsim.policies.plan import expand_decision_log

SHARED_AZURE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "azure_llm_2023" / "AzureLLMInferenceTrace_conv.csv"
SCHEDULERS = ("fcfs", "chunked", "priority", "sjf", "static")
MANAGERS = ("paged", "prefix", "contiguous")
VOLATILE_SUMMARY_KEYS = ("wall_s", "macro_stretches")  # macro_stretches: gone since macro-stepping was removed
REMOVED_CONFIG_KEYS = ("exact",)  # RunConfig.exact (macro-stepping off): gone with it; older summaries still carry it
# Fields added since with the value that turns their feature off: a run with the feature off writes
# that value where an older version wrote nothing, which is not a change of any decision.
ADDED_CONFIG_KEYS = {"quantization": None, "expert_routing_skew": 0.0, "tensor_parallel_size": 1,
                     "pipeline_parallel_size": 1, "data_parallel_size": 1, "enable_expert_parallel": False,
                     "enable_dbo": False, "dbo_decode_token_threshold": 32, "dbo_prefill_token_threshold": 512,
                     "all2all_backend": "allgather_reducescatter",
                     "enforce_eager": None, "async_scheduling": None, "engine_core": "v1", "vllm_version": "",
                     "estimate_cudagraph_memory": None, "api_server": False,
                     "max_concurrency": 0, "instances": 1,
                     "router": "round-robin", "router_params": {}, "router_staleness_s": 0.0, "autoscaler": "",
                     "autoscaler_params": {}, "kv_offload_host_gb": 0.0, "kv_offload_ssd_gb": 0.0,
                     "kv_prefetch_steps": 1, "prefill_instances": 0, "decode_instances": 0, "decode_router": "least-requests",
                     "decode_router_params": {}, "decode_tensor_parallel_size": 0, "kv_connector": "after-prefill",
                     "kv_link": "auto", "cluster_workers": 0, "cluster_backend": "processes", "kv_store_gb": 0.0}
# Memory-plan fields added since, with the value a single-device run writes (the same rule as above).
ADDED_MEMORY_KEYS = {"moe_tokens": None, "graph_bytes": 0}


def workloads() -> dict[str, list[str]]:
    big = ["--model", "llama-2-7b", "--device", "ascend-910b3"]
    cases = {
        "demo": ["--trace", "demo"],
        "mooncake_500": ["--trace", "mooncake_500", "--model", "qwen2.5-7b", "--device", "ascend-910b3",
                         "--max-model-len", "32768"],
    }
    if SHARED_AZURE.exists():
        cases["azure_2000"] = ["--trace", str(SHARED_AZURE), "--max-requests", "2000", *big]
    return cases


def cases() -> dict[str, list[str]]:
    grid: dict[str, list[str]] = {}
    for name, args in workloads().items():
        for scheduler in SCHEDULERS:
            for manager in MANAGERS:
                grid[f"{name}/{scheduler}/{manager}"] = [*args, "--scheduler", scheduler, "--block-manager", manager]
        tight = "60" if name == "demo" else "400"
        for mode in ("recompute", "swap"):
            grid[f"{name}/fcfs/prefix/tight-{mode}"] = [*args, "--num-blocks", tight, "--preemption-mode", mode,
                                                      "--swap-space", "4"]
    return grid


def expanded_decisions(out: Path) -> bytes:
    """The per-step decision log: decisions.jsonl if the version wrote one (decode stretches
    expanded), else the expanded full log, one line a step."""
    legacy = out / "decisions.jsonl"
    if legacy.exists():
        return "".join(line + "\n" for line in expand_decision_log(legacy.read_text().splitlines())).encode()
    return subprocess.run(["kvsim", "decisions", "show", "--per-step", str(out)], check=True, capture_output=True).stdout


def fingerprint(out: Path) -> dict[str, str]:
    prints = {}
    if DECISIONS_ARGS != ["--decisions", "off"]:
        prints["decisions.jsonl"] = hashlib.sha256(expanded_decisions(out)).hexdigest()
        digest = out / "decisions.digest.json"
        if digest.exists():  # the compact records themselves: the digest a summary-mode run reports
            prints["records"] = json.loads(digest.read_text())["sha256"]
    for name in ("requests.csv", "steps.csv"):
        prints[name] = hashlib.sha256((out / name).read_bytes()).hexdigest()
    summary = json.loads((out / "summary.json").read_text())
    for key in VOLATILE_SUMMARY_KEYS:
        summary.pop(key, None)
    config = summary.get("config", {})
    for key in REMOVED_CONFIG_KEYS:
        config.pop(key, None)
    for added, section in ((ADDED_CONFIG_KEYS, config), (ADDED_MEMORY_KEYS, summary.get("memory", {}))):
        for key, off in added.items():
            if key in section and section[key] == off:
                del section[key]
    prints["summary.json"] = hashlib.sha256(json.dumps(summary, sort_keys=True).encode()).hexdigest()
    return prints


def run_case(args: list[str], out: Path) -> dict[str, str]:
    command = ["kvsim", "simulate", *args, "--out", str(out), "--quiet", *DECISIONS_ARGS, *EXTRA_ARGS]
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    return fingerprint(out)


EXTRA_ARGS: list[str] = []
DECISIONS_ARGS: list[str] = ["--decisions", "full"]  # emptied by --legacy-log for versions without the option


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--write", type=Path, help="record the fingerprints here")
    parser.add_argument("--compare", type=Path, help="compare with fingerprints recorded earlier")
    parser.add_argument("--only", default="", help="run only cases whose name contains this")
    parser.add_argument("--extra", default="", help="extra simulate flags, space-separated (e.g. '--seed 3')")
    parser.add_argument("--decisions", choices=("full", "off"), default="full",
                        help="off: fingerprint the outputs of a run without a decision log (the simulator's fastest path)")
    parser.add_argument("--legacy-log", action="store_true",
                        help="the installed version writes decisions.jsonl and has no --decisions option")
    options = parser.parse_args()
    EXTRA_ARGS.extend(options.extra.split())
    if options.legacy_log:
        DECISIONS_ARGS.clear()
    elif options.decisions == "off":
        DECISIONS_ARGS[1] = "off"
    expected = json.loads(options.compare.read_text()) if options.compare else {}
    results: dict[str, dict[str, str]] = {}
    moved = []
    with tempfile.TemporaryDirectory() as scratch:
        for index, (name, args) in enumerate(cases().items()):
            if options.only not in name:
                continue
            results[name] = run_case(args, Path(scratch) / str(index))
            # the fingerprints both runs have: a --decisions off run against a full baseline compares
            # requests.csv, steps.csv and summary.json, not the log it did not write
            shared = sorted(set(expected.get(name, {})) & set(results[name]))
            changed = [k for k in shared if expected[name][k] != results[name][k]]
            if name in expected and (changed or not shared):
                moved.append(f"{name}: {', '.join(changed) or 'no fingerprint in common'}")
            print(f"{name}: {'MOVED' if moved and moved[-1].startswith(name + ':') else 'ok'}", flush=True)
    if options.write:
        options.write.parent.mkdir(parents=True, exist_ok=True)
        options.write.write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")
    if options.compare:
        missing = sorted(set(expected) - set(results)) if not options.only else []
        for line in moved:
            print("moved:", line)
        for name in missing:
            print("not run:", name)
        print(f"{len(results) - len(moved)} of {len(results)} cases identical")
        return 1 if moved or missing else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
