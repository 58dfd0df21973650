#!/usr/bin/env python3
"""Writes a synthetic trace in Mooncake's JSONL format where requests share long prefixes.

Each request opens with one of GROUPS shared prefixes (PREFIX_BLOCKS blocks of 512 tokens,
e.g. a long system prompt or a document many questions are asked about), then a question of
its own (one unique, partial block). Groups are drawn at random with Zipf-like popularity,
so consecutive arrivals rarely share a prefix: under FCFS a prefix is often evicted before
the next request of its group is admitted, which is what longest-prefix-match admission
(`prefix-aware`) is for. Arrivals are Poisson at 1 request/s; rescale them with the spec's
`arrival: {load: X}`. Deterministic for a given seed.

With `--burst N`, requests arrive N at a time (the bursts Poisson at 1/N per second, so the
mean rate is unchanged), and each burst asks `--burst-groups` groups (drawn as above, then
one of them at random per request): many questions about a few documents at once, often
cold ones, which is where holding back requests that share a prefix not yet cached matters.
With `--unique-prefixes`, every request gets a prefix of its own (same lengths, nothing
shared): the control where no sharing policy can gain.

    scripts/shared-prefix-trace.py [--requests N] [--groups G] [--prefix-blocks B]
                                   [--zipf S] [--burst N] [--burst-groups K]
                                   [--unique-prefixes] [--seed K] > trace.jsonl
"""

import argparse
import json
import random


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--groups", type=int, default=64)
    ap.add_argument("--prefix-blocks", type=int, default=8)
    ap.add_argument("--zipf", type=float, default=0.8, help="popularity exponent (0: uniform)")
    ap.add_argument("--min-question", type=int, default=64)
    ap.add_argument("--max-question", type=int, default=512)
    ap.add_argument("--min-output", type=int, default=32)
    ap.add_argument("--max-output", type=int, default=256)
    ap.add_argument("--burst", type=int, default=1, help="requests arriving at once")
    ap.add_argument("--burst-groups", type=int, default=1, help="groups one burst asks")
    ap.add_argument(
        "--unique-prefixes", action="store_true", help="every prefix its own: no sharing"
    )
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args()
    if a.burst < 1 or a.burst_groups < 1:
        ap.error("--burst and --burst-groups must be at least 1")
    rng = random.Random(a.seed)
    weights = [1.0 / (g + 1) ** a.zipf for g in range(a.groups)]
    next_unique = a.groups * a.prefix_blocks
    t_ms = 0.0
    burst_groups: list[int] = []
    for i in range(a.requests):
        if a.burst == 1:
            t_ms += rng.expovariate(1.0) * 1000.0
            g = rng.choices(range(a.groups), weights)[0]
        else:
            if i % a.burst == 0:
                t_ms += rng.expovariate(1.0 / a.burst) * 1000.0
                burst_groups = rng.choices(range(a.groups), weights, k=a.burst_groups)
            g = rng.choice(burst_groups)
        if a.unique_prefixes:
            ids = list(range(next_unique, next_unique + a.prefix_blocks))
            next_unique += a.prefix_blocks
        else:
            ids = [g * a.prefix_blocks + k for k in range(a.prefix_blocks)]
        ids.append(next_unique)
        next_unique += 1
        question = rng.randint(a.min_question, a.max_question)
        row = {
            "timestamp": round(t_ms, 3),
            "input_length": a.prefix_blocks * 512 + question,
            "output_length": rng.randint(a.min_output, a.max_output),
            "hash_ids": ids,
        }
        print(json.dumps(row))


if __name__ == "__main__":
    main()
