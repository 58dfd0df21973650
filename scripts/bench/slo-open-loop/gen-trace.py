#!/usr/bin/env python3
"""Open-loop traces with rare premium requests, for slo-aware's reserve (PERFORMANCE.md v0.49.0).

Batch requests Poisson at BATCH_RATE/s for DURATION s; premium requests either Poisson at
PREMIUM_RATE/s (--burst 1) or in bursts: burst starts Poisson at PREMIUM_RATE/BURST per second,
each burst BURST requests Poisson-spread over BURST_SPAN s (so PREMIUM_RATE/s on average either
way). Lengths are fixed per tier. random.seed(SEED); batch drawn first, then premium, with
random.expovariate. Writes JSONL to stdout.

  gen-trace.py SEED DURATION BATCH_RATE BATCH_IN BATCH_OUT PREMIUM_RATE PREMIUM_IN PREMIUM_OUT
               [--burst N --burst-span S]
"""
import argparse
import json
import random

ap = argparse.ArgumentParser()
for name, kind in [("seed", int), ("duration", float), ("batch_rate", float), ("batch_in", int),
                   ("batch_out", int), ("premium_rate", float), ("premium_in", int),
                   ("premium_out", int)]:
    ap.add_argument(name, type=kind)
ap.add_argument("--burst", type=int, default=1)
ap.add_argument("--burst-span", type=float, default=1.0)
a = ap.parse_args()

random.seed(a.seed)
rows = []
t = 0.0
while True:
    t += random.expovariate(a.batch_rate)
    if t > a.duration:
        break
    rows.append((t, a.batch_in, a.batch_out, "initech", "batch"))
t = 0.0
while True:
    t += random.expovariate(a.premium_rate / a.burst)
    if t > a.duration:
        break
    if a.burst == 1:
        rows.append((t, a.premium_in, a.premium_out, "acme", "premium"))
        continue
    u = t
    for _ in range(a.burst):
        rows.append((u, a.premium_in, a.premium_out, "acme", "premium"))
        u += random.expovariate(a.burst / a.burst_span)
rows.sort()
for t, prompt, output, tenant, tier in rows:
    print(json.dumps({"arrival_s": round(t, 6), "prompt_len": prompt, "output_len": output,
                      "tenant": tenant, "tier": tier}))
