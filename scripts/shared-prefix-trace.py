#!/usr/bin/env python3
"""Writes a synthetic trace in Mooncake's JSONL format where requests share long prefixes.

Each request opens with one of GROUPS shared prefixes (PREFIX_BLOCKS blocks of 512 tokens,
e.g. a long system prompt or a document many questions are asked about), then a question of
its own (one unique, partial block). Groups are drawn at random with Zipf-like popularity,
so consecutive arrivals rarely share a prefix: under FCFS a prefix is often evicted before
the next request of its group is admitted, which is what longest-prefix-match admission
(`prefix-aware`) is for. Arrivals are Poisson at 1 request/s; rescale them with the spec's
`arrival: {load: X}`. Deterministic for a given seed.

    scripts/shared-prefix-trace.py [--requests N] [--groups G] [--prefix-blocks B]
                                   [--zipf S] [--seed K] > trace.jsonl
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
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args()
    rng = random.Random(a.seed)
    weights = [1.0 / (g + 1) ** a.zipf for g in range(a.groups)]
    next_unique = a.groups * a.prefix_blocks
    t_ms = 0.0
    for _ in range(a.requests):
        t_ms += rng.expovariate(1.0) * 1000.0
        g = rng.choices(range(a.groups), weights)[0]
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
