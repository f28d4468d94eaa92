"""Issue 20's table from scripts/diag/serve-table.sh's JSON: loop vs server per placement and N.
usage: serve_table.py OUT_DIR"""
import json
import os
import sys

d = sys.argv[1]
print("| FLAGS | N | clients | loop tok/s, random tokens, -p + -n per sequence | loop tok/s, greedy, -c 4096 | server decode tok/s | server / loop | ITL p50 ms | ITL p99 ms "
      "| loop step ms | per step | engine forward ms | engine step interval ms | TTFT p50 ms "
      "| TTFT p99 ms | server aggregate (wall) |")
print("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
for tag, flags in (("gpu", "`-ngl 99`"), ("cpumoe", "`-ngl 99 --cpu-moe`")):
    lp = os.path.join(d, f"loop-{tag}.json")
    if not os.path.exists(lp):
        continue
    loop = {p["n_seq"]: p["agg_tok_s"] for p in json.load(open(lp))["parallel"]}
    sp_ = os.path.join(d, f"loop-{tag}-short.json")
    short = ({p["n_seq"]: p["agg_tok_s"] for p in json.load(open(sp_))["parallel"]}
             if os.path.exists(sp_) else {})
    first = True
    for n, mode in ((n, m) for n in (1, 2, 4, 8) for m in ("sync", "free")):
        sp = os.path.join(d, f"serve-{tag}-{n}{'-sync' if mode == 'sync' else ''}.json")
        if not os.path.exists(sp) or n not in loop:
            continue
        s = json.load(open(sp))
        dec = n * s["per_request_tok_s"]
        step = n / loop[n] * 1e3
        itl50, itl99 = s["itl_ms"]["p50"], s["itl_ms"]["p99"]
        eng = s.get("engine", {})
        sh = f"{short[n]:.1f}" if n in short else "-"
        print(f"| {flags if first else ''} | {n} | {mode} | {sh} | {loop[n]:.1f} | {dec:.1f} | {dec / loop[n]:.3f} "
              f"| {itl50:.2f} | {itl99:.2f} | {step:.2f} | {step / itl50:.3f} "
              f"| {eng.get('decode_step_ms', 0):.2f} | {eng.get('decode_interval_ms', 0):.2f} "
              f"| {s['ttft_ms']['p50']:.1f} | {s['ttft_ms']['p99']:.1f} | {s['aggregate_tok_s']:.1f} |"
              + (f" ({s['failed']} failed)" if s["failed"] else ""))
        first = False
