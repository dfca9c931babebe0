"""Prefill/decode pools against co-located instances of the same NPU count, on the Mooncake
conversation trace: TTFT / TPOT SLO attainment and goodput for each split.

    python examples/pd_vs_colocated.py                       # the bundled mooncake_500 sample
    python examples/pd_vs_colocated.py --trace ../shared/traces/mooncake_fast25/conversation_trace.jsonl \\
        --max-requests 2000

Every configuration serves Qwen2.5-7B on 8 Ascend 910B3 NPUs of one node (TP 1), prompts up to 32k
tokens; prompts go to instances by the kv-aware router (the co-located instances' and the prefill
pool's: Mooncake's conductor places prefills by cached prefix too), decodes by least-requests. A
request meets the SLO when both its TTFT and its TPOT are within it; rejected requests miss it.
Attainment is the share of the trace's requests that meet it, goodput those per second of the run.
"""

from __future__ import annotations

import argparse

from kvsim.sim.cluster.runner import run_cluster
from kvsim.sim.run.config import RunConfig, load_run_trace, resolve

SPLITS = [("co-located 8", {"instances": 8}),
          ("P/D 2P+6D", {"prefill_instances": 2, "decode_instances": 6}),
          ("P/D 3P+5D", {"prefill_instances": 3, "decode_instances": 5}),
          ("P/D 4P+4D", {"prefill_instances": 4, "decode_instances": 4}),
          ("P/D 4P+4D layerwise", {"prefill_instances": 4, "decode_instances": 4, "kv_connector": "layerwise"})]


def measure(config: RunConfig, ttft_slo: float, tpot_slo: float) -> dict:
    resolved, trace = resolve(config), load_run_trace(config)
    run, summary = run_cluster(resolved, trace, None, decisions="off")
    users = run.user_records()  # NaN where a request got no token or did not finish: it misses both SLOs
    met = (users.first_token_s - users.arrival_s <= ttft_slo) & (users.family_tpot_s <= tpot_slo)
    good = int((met & users.is_root).sum())
    pd = summary.get("pd", {})
    return {"completed": summary["requests_completed"], "attainment": good / len(trace),
            "goodput_rps": good / summary["duration_s"], "ttft_p50": summary["ttft_s"]["p50"],
            "ttft_p99": summary["ttft_s"]["p99"], "tpot_p50": summary["tpot_s"]["p50"], "tpot_p99": summary["tpot_s"]["p99"],
            "kv_delay_p99": pd["delay_s"]["p99"] if pd else None, "prefix_hit_rate": summary["prefix_hit_rate"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", default="mooncake_500")
    parser.add_argument("--max-requests", type=int, default=0)
    parser.add_argument("--rate-scale", type=float, default=1.0)
    parser.add_argument("--slo-ttft", type=float, default=5.0, help="seconds")
    parser.add_argument("--slo-tpot", type=float, default=0.1, help="seconds")
    args = parser.parse_args()
    base = RunConfig(trace=args.trace, max_requests=args.max_requests, rate_scale=args.rate_scale, model="qwen2.5-7b",
                     device="ascend-910b3", max_model_len=32768, router="kv-aware")
    print(f"SLO: TTFT <= {args.slo_ttft:g} s and TPOT <= {args.slo_tpot:g} s")
    print(f"{'cluster':22} {'done':>5} {'attain':>7} {'goodput':>8} {'TTFT p50':>9} {'p99':>7} {'TPOT p50':>9} {'p99':>7} "
          f"{'KV p99':>7} {'hit':>5}")
    for name, split in SPLITS:
        m = measure(base.updated(**split), args.slo_ttft, args.slo_tpot)
        kv = f"{m['kv_delay_p99']:.3f}" if m["kv_delay_p99"] is not None else "-"
        print(f"{name:22} {m['completed']:5d} {m['attainment']:7.1%} {m['goodput_rps']:8.2f} {m['ttft_p50']:9.2f} "
              f"{m['ttft_p99']:7.2f} {m['tpot_p50']:9.4f} {m['tpot_p99']:7.4f} {kv:>7} {m['prefix_hit_rate']:5.2f}")


if __name__ == "__main__":
    main()
