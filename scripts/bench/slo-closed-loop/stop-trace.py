#!/usr/bin/env python3
"""The "premium stream that stops" trace of PERFORMANCE.md (slo-aware's reserve): batch requests
Poisson at 40/s for 120 s (2,048 prompt tokens, 128 out; the first arrival past 120 s included),
premium requests Poisson at 1/s for the first 60 s (256 in, 32 out), random.seed(7), batch drawn
first. Writes JSONL to stdout."""
import json
import random

random.seed(7)
rows = []
t = 0.0
while True:
    t += random.expovariate(40.0)
    rows.append((t, 2048, 128, "initech", "batch"))
    if t > 120.0:
        break
t = 0.0
while True:
    t += random.expovariate(1.0)
    if t > 60.0:
        break
    rows.append((t, 256, 32, "acme", "premium"))
rows.sort()
for t, prompt, output, tenant, tier in rows:
    print(json.dumps({"arrival_s": round(t, 6), "prompt_len": prompt, "output_len": output,
                      "tenant": tenant, "tier": tier}))
