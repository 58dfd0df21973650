#!/usr/bin/env python3
"""Prints, per scenario of the directory run.sh wrote, `slo-aware` with its reserve (on), with
`reserve_window_ms: 1` (live: the bound while a targeted request is present, no window after) and
with `reserve_window_ms: 0` (off): medians over the seeds of premium TTFT p50 / p90 and TPOT p50 (ms),
premium requests meeting both targets, batch TTFT p50 / p90 (ms), the batch tier's throughput
(prompt and output tokens done by the last arrival, per second: a prompt counts at its first
token, output tokens evenly between the first and the last), when the last request finished, and
goodput (requests meeting both targets per second); then the median over the seeds of each
seed's on / off and live / off ratios."""
import glob
import json
import os
import re
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from _summary import pct, requests  # noqa: E402  (scripts/bench/_summary.py)


def batch_tokens_by(rows, t_end):
    done = 0.0
    for r in rows:
        ft, fin = r.get("first_token_s"), r.get("finish_s")
        if ft is None or ft > t_end:
            continue
        done += r["prompt_len"]
        g = r["generated"]
        if g == 0:
            continue
        if fin is None or fin <= t_end:
            done += g
        else:
            done += 1 + (g - 1) * (t_end - ft) / (fin - ft)
    return done


def metrics(run_dir, policy, duration, goodput):
    rows = requests(run_dir, policy)
    prem = [r for r in rows if r["tier"] == "premium"]
    batch = [r for r in rows if r["tier"] == "batch"]
    t_end = max(r["arrival_s"] for r in rows)
    pt = [r["ttft_ms"] for r in prem if r.get("ttft_ms") is not None]
    pp = [r["tpot_ms"] for r in prem if r.get("tpot_ms") is not None]
    bt = [r["ttft_ms"] for r in batch if r.get("ttft_ms") is not None]
    return {
        "p_ttft50": pct(pt, .5), "p_ttft90": pct(pt, .9), "p_tpot50": pct(pp, .5),
        "p_both": sum(1 for r in prem if r["met_ttft"] and r["met_tpot"]) / max(len(prem), 1),
        "n_prem": len(prem),
        "b_ttft50": pct(bt, .5), "b_ttft90": pct(bt, .9),
        "b_tps": batch_tokens_by(batch, t_end) / t_end,
        "end_s": duration, "goodput": goodput or 0.0,
    }


out = sys.argv[1]
runs = {}
for summary in sorted(glob.glob(os.path.join(out, "*-s*.json"))):
    m = re.match(r"(.*)-s(\d+)\.json$", os.path.basename(summary))
    if not m:
        continue
    doc = json.load(open(summary))
    per = {}
    for p in doc["policies"]:
        per[p["policy"]] = metrics(summary[:-5], p["policy"], p["duration_s"], p.get("goodput_rps"))
    runs.setdefault(m.group(1), []).append(
        (int(m.group(2)), per["slo-aware"], per["live-only"], per["no-reserve"]))

cols = [("p_ttft50", "premium TTFT p50", "{:,.0f}"), ("p_ttft90", "p90", "{:,.0f}"),
        ("p_tpot50", "premium TPOT p50", "{:,.1f}"), ("p_both", "premium both met", "{:.1%}"),
        ("b_ttft50", "batch TTFT p50", "{:,.0f}"), ("b_ttft90", "p90", "{:,.0f}"),
        ("b_tps", "batch tok/s", "{:,.1f}"), ("end_s", "last done s", "{:,.1f}"),
        ("goodput", "goodput req/s", "{:.4f}")]
print("| scenario (seeds, premium requests) | reserve | " + " | ".join(c[1] for c in cols) + " |")
print("|---|---|" + "---|" * len(cols))
order = sorted(runs, key=lambda n: (not n.startswith("cpu"), n))
for name in order:
    rs = sorted(runs[name])
    n_prem = statistics.median(r[1]["n_prem"] for r in rs)
    label = f"{name} ({len(rs)}, {n_prem:.0f})"
    for i, tag in [(1, "on"), (2, "live"), (3, "off")]:
        vals = [fmt.format(statistics.median(r[i][k] for r in rs)) for k, _, fmt in cols]
        print(f"| {label} | {tag} | " + " | ".join(vals) + " |")
        label = ""
    for i, tag in [(1, "on / off"), (2, "live / off")]:
        ratios = []
        for k, _, _ in cols:
            rr = [r[i][k] / r[3][k] for r in rs if r[3][k]]
            ratios.append(f"{statistics.median(rr):.3f}" if rr else "-")
        print(f"| | {tag} | " + " | ".join(ratios) + " |")
