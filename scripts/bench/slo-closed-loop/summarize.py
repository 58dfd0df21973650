#!/usr/bin/env python3
"""Prints, per trace group and policy, premium TTFT (ms) pooled over the group's traces, the premium
requests meeting their TTFT target / both targets, and output tok/s (batch, all; mean of the traces),
from the directory sim.sh wrote."""
import glob
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from _summary import pct, requests  # noqa: E402  (scripts/bench/_summary.py)


out = sys.argv[1]
groups = {}
for summary in sorted(glob.glob(os.path.join(out, "*.json"))):
    name = os.path.basename(summary)[:-5]
    group = name.split("-r")[0] if name.startswith("t") else name
    doc = json.load(open(summary))
    for p in doc["policies"]:
        rows = requests(os.path.join(out, name), p["policy"])
        premium = [r for r in rows if r["tier"] == "premium" and r.get("ttft_ms") is not None]
        g = groups.setdefault((group, p["policy"]), {"ttft": [], "met": 0, "both": 0, "n": 0, "batch": [], "all": []})
        g["ttft"] += [r["ttft_ms"] for r in premium]
        g["met"] += sum(1 for r in premium if r["met_ttft"])
        g["both"] += sum(1 for r in premium if r["met_ttft"] and r["met_tpot"])
        g["n"] += len(premium)
        g["batch"].append(sum(r["generated"] for r in rows if r["tier"] == "batch") / p["duration_s"])
        g["all"].append(sum(r["generated"] for r in rows) / p["duration_s"])
print("| traces | policy | TTFT p50 | p90 | mean | met TTFT / both | batch tok/s | all tok/s |")
print("|---|---|---|---|---|---|---|---|")
for (group, policy), g in groups.items():
    t = g["ttft"]
    print(f"| {group} | {policy} | {pct(t, .5):,.0f} | {pct(t, .9):,.0f} | {statistics.mean(t):,.0f} | "
          f"{g['met']} / {g['both']} of {g['n']} | {statistics.mean(g['batch']):.2f} | {statistics.mean(g['all']):.2f} |")
