"""What the summarize.py scripts under scripts/bench share: percentiles and the per-request rows
`switchyard simulate --out DIR` writes. They import it by its path (their own directory's
parent), so they run from any working directory."""
import json
import os


def pct(xs, q):
    """The `q` quantile of `xs` (0 <= q <= 1), interpolated linearly between the two nearest
    ranks; NaN when `xs` is empty."""
    xs = sorted(xs)
    if not xs:
        return float("nan")
    k = (len(xs) - 1) * q
    f = int(k)
    c = min(f + 1, len(xs) - 1)
    return xs[f] + (xs[c] - xs[f]) * (k - f)


def requests(run_dir, policy):
    """The rows of `run_dir/requests-POLICY.jsonl`: one dict per request, in file order."""
    with open(os.path.join(run_dir, f"requests-{policy}.jsonl")) as f:
        return [json.loads(line) for line in f]
