#!/usr/bin/env python3
"""Golden embeddings for SmolLM2-135M-Instruct (Q4_1 GGUF) from Hugging Face transformers.

Switchyard's `/v1/embeddings` returns, per input, the model's final hidden state (after the last
RMSNorm) at the input's last token, L2-normalized. The reference here is transformers itself:
its GGUF loader dequantizes the very file Switchyard loads (float32), `model.model(ids)` gives
`last_hidden_state` (after the final norm, as Hugging Face defines it), and the last position's
row is the vector. Nothing here uses Switchyard's code or output.

Output: gpu/tests/fixtures/smollm2_embeddings.json:
  model_file, model_sha256, reference (versions, device, date),
  cases: [{name, text, ids, hidden}] where `ids` are the tokenizer's ids of `text`
  (add_special_tokens=False, the repaired SmolLM pre-tokenizer as make_golden.py builds it) and
  `hidden` the float32 final hidden state at the last id, not normalized (576 values).
  Also `checks`: the norm of each vector, and the cosine similarity of the batched pass (all
  cases padded on the left into one batch with an attention mask) against the one-by-one pass.

Needs torch, transformers (5.17 was used), numpy and gguf, like make_golden.py, whose helpers it
imports (run it from anywhere; it finds make_golden.py beside itself).

  python3 gpu/reference/make_embedding_golden.py --model PATH --out gpu/tests/fixtures/smollm2_embeddings.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_golden import (  # noqa: E402
    MODEL_FILE,
    default_model_path,
    encode,
    load_reference,
)

CASES = [
    ("capital", "The capital of France is Paris."),
    ("question", "What is the boiling point of water at sea level?"),
    ("code", "def add(a, b):\n    return a + b\n"),
    ("one_token", "Hello"),
    ("unicode", "café naïve résumé — 東京は日本の首都です。"),
    (
        "long",
        "Embeddings map text to vectors so that texts with similar meanings lie close together. "
        * 6,
    ),
]


def main() -> int:
    here = os.path.dirname(os.path.abspath(__file__))
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=default_model_path(), help="path of the GGUF file")
    ap.add_argument(
        "--out",
        default=os.path.join(here, "..", "tests", "fixtures", "smollm2_embeddings.json"),
    )
    ap.add_argument("--device", default=None, help="torch device (default: cuda if available)")
    args = ap.parse_args()

    torch, transformers, tok, model, device, digest = load_reference(args.model, args.device)

    cases = []
    with torch.no_grad():
        for name, text in CASES:
            ids = encode(tok, text)
            out = model.model(input_ids=torch.tensor([ids], device=device))
            hidden = out.last_hidden_state[0, -1].float().cpu().tolist()
            cases.append({"name": name, "text": text, "ids": ids, "hidden": hidden})

        # The same vectors from one left-padded batch: checks that the reference itself does not
        # depend on batching (it should agree to float32 noise).
        longest = max(len(c["ids"]) for c in cases)
        pad = tok.pad_token_id if tok.pad_token_id is not None else 0
        batch = [[pad] * (longest - len(c["ids"])) + c["ids"] for c in cases]
        mask = [[0] * (longest - len(c["ids"])) + [1] * len(c["ids"]) for c in cases]
        positions = [
            [0] * (longest - len(c["ids"])) + list(range(len(c["ids"]))) for c in cases
        ]
        out = model.model(
            input_ids=torch.tensor(batch, device=device),
            attention_mask=torch.tensor(mask, device=device),
            position_ids=torch.tensor(positions, device=device),
        )
        batched = out.last_hidden_state[:, -1].float().cpu().tolist()

    def cos(a, b):
        dot = sum(x * y for x, y in zip(a, b))
        return dot / math.sqrt(sum(x * x for x in a) * sum(y * y for y in b))

    checks = {
        "norms": {c["name"]: math.sqrt(sum(x * x for x in c["hidden"])) for c in cases},
        "batched_cosine": {c["name"]: cos(c["hidden"], b) for c, b in zip(cases, batched)},
    }
    worst = min(checks["batched_cosine"].values())
    fixture = {
        "model_file": MODEL_FILE,
        "model_sha256": digest,
        "reference": {
            "library": "transformers",
            "transformers": transformers.__version__,
            "torch": torch.__version__,
            "device": str(device),
            "dtype": "float32",
            "date": datetime.date.today().isoformat(),
            "what": "model.model(ids).last_hidden_state[0, -1] (after the final norm), not normalized",
        },
        "checks": checks,
        "cases": cases,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(fixture, f)
        f.write("\n")
    print(f"wrote {args.out}: {len(cases)} cases, dims {len(cases[0]['hidden'])}")
    for c in cases:
        print(
            f"  {c['name']:10} {len(c['ids']):3} ids  norm {checks['norms'][c['name']]:.4f}"
            f"  batched cosine {checks['batched_cosine'][c['name']]:.8f}"
        )
    if worst < 0.9999:
        print(f"the batched pass disagrees (cosine {worst})", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
