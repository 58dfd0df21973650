#!/usr/bin/env python3
"""Golden beam-search answers for SmolLM2-135M-Instruct (Q4_1 GGUF) from Hugging Face transformers.

Switchyard's beam search (`use_beam_search: true` on completions and chat) is vLLM's algorithm:
each step extends every live beam by its 2 x width most likely next tokens, an end token (end of
sequence unless ignore_eos) completes its beam, the width best extensions live on; a beam's score
is its cumulative logprob over (prompt + generated tokens before an end token) ^ length_penalty;
the answer is the width best of the completed and the final live beams. This script runs that
algorithm in Python over transformers' float32 logits (its GGUF loader dequantizes the very file
Switchyard loads), to max_tokens steps as vLLM does (Switchyard stops once the answer is decided;
the answer must be the same). Nothing here uses Switchyard's code or output.

Cross-check of the Python search itself: where no end token completes a beam within the steps
(every beam reaches max_tokens), vLLM's algorithm and transformers' own `generate(num_beams=...)`
must give the same beams (both keep the width best cumulative logprobs of equal lengths); the
script asserts that for such cases.

Output: gpu/tests/fixtures/smollm2_beam_search.json:
  model_file, model_sha256, reference (versions, device, date),
  cases: [{name, prompt, prompt_ids, width, max_tokens, length_penalty, ignore_eos,
           beams: [{tokens, cum_logprob, finish}], margin, end_to_end, steps}]
  `tokens` are the generated ids (an end token that completed a beam left out, as
  include_stop_str_in_output false does), best beam first; `margin` is the smallest gap, over the
  steps, between the score of the last beam kept and the first one dropped (how far a numerical
  difference would have to move a score to change the answer); `steps` every prefix (generated
  ids) the search evaluated with its 2 x width alternatives [[id, logprob], ...], best first, so
  that a search can be replayed on exactly these logprobs; `end_to_end` marks the cases a server
  on the same GGUF is expected to answer identically (see END_TO_END).

Needs torch, transformers (5.17 was used), numpy and gguf, like make_golden.py, whose helpers it
imports.

  python3 gpu/reference/make_beam_golden.py --model PATH --out gpu/tests/fixtures/smollm2_beam_search.json
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


def chat(text: str) -> str:
    return f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"


# name, prompt, width, max_tokens, length_penalty, ignore_eos
CASES = [
    ("ok_chat", chat("Reply with just the word OK."), 2, 4, 1.0, False),
    ("paris_chat", chat("What is the capital of France? One word."), 2, 4, 1.0, False),
    ("hi_chat", chat("Say hi."), 3, 4, 1.0, False),
    ("color_chat", chat("Name a color. One word."), 2, 3, 0.0, False),
    ("blue_chat", chat("What color is the sky? One word."), 3, 4, 2.0, False),
    ("end_chat", chat("Say goodbye in one word."), 3, 4, 0.0, False),
    ("story", "Once upon a time, there was a", 2, 10, 0.0, False),
    ("sky", "The sky is", 2, 5, -1.0, False),
    ("greedy", "The capital of France is", 1, 4, 1.0, False),
    ("capital", "The capital of France is", 3, 12, 1.0, False),
    ("days", "Monday, Tuesday, Wednesday,", 2, 4, 1.0, True),
    ("months", "January, February, March,", 3, 4, 0.5, True),
    ("fibonacci", "def fibonacci(n):", 4, 8, 1.0, False),
]
# Cases whose answer Switchyard's CPU backend is to reproduce end to end: its Q4_1 kernels'
# logprobs differ from this float32 reference by up to ~0.2 nats on unlikely tokens, which
# reorders near-equal beams in most cases (the algorithm itself is checked on every case by
# replaying `steps`); these are the ones whose beams stay apart on both.
END_TO_END = {"greedy", "story"}

# The model's end tokens as Switchyard reads them from the GGUF: its eos id and the control
# tokens llama.cpp ends generation at (for SmolLM2 `<|im_end|>` and `<|endoftext|>`).
END_TOKENS = ["<|im_end|>", "<|endoftext|>"]


def beam_search(logprobs_of, prompt_ids, width, max_tokens, length_penalty, ends, ignore_eos):
    """vLLM's EngineClient.beam_search, over `logprobs_of(ids) -> list of (token, logprob)`, best
    first (the 2 x width most likely next tokens)."""

    def score(cum, generated, ended):
        seq_len = len(prompt_ids) + len(generated) - (1 if ended else 0)
        return cum / (seq_len**length_penalty)

    live = [([], 0.0)]
    completed = []  # (tokens, cum, score)
    steps = []  # every prefix the search evaluated, with its alternatives
    margin = math.inf
    for _ in range(max_tokens):
        extended = []
        for tokens, cum in live:
            top = logprobs_of(prompt_ids + tokens)
            steps.append({"prefix": tokens, "top": [[t, lp] for t, lp in top]})
            for token, lp in top:
                if token in ends and not ignore_eos:
                    completed.append((tokens, cum + lp, score(cum + lp, tokens + [token], True)))
                else:
                    new = tokens + [token]
                    extended.append((new, cum + lp, score(cum + lp, new, False)))
        extended.sort(key=lambda b: b[2], reverse=True)
        if len(extended) > width:
            margin = min(margin, extended[width - 1][2] - extended[width][2])
        live = [(t, c) for t, c, _ in extended[:width]]
    final = completed + [(t, c, score(c, t, False)) for t, c in live]
    ended = {id(x) for x in completed}
    final.sort(key=lambda b: b[2], reverse=True)
    if len(final) > width:
        margin = min(margin, final[width - 1][2] - final[width][2])
    beams = [
        {"tokens": t, "cum_logprob": c, "finish": "stop" if id(b) in ended else "length"}
        for b in final[:width]
        for (t, c, _) in [b]
    ]
    return beams, margin, steps


def main() -> int:
    here = os.path.dirname(os.path.abspath(__file__))
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=default_model_path(), help="path of the GGUF file")
    ap.add_argument(
        "--out",
        default=os.path.join(here, "..", "tests", "fixtures", "smollm2_beam_search.json"),
    )
    ap.add_argument("--device", default=None, help="torch device (default: cuda if available)")
    args = ap.parse_args()

    torch, transformers, tok, model, device, digest = load_reference(args.model, args.device)
    ends = sorted({tok.convert_tokens_to_ids(t) for t in END_TOKENS})
    import gguf

    field = gguf.GGUFReader(args.model).fields["tokenizer.ggml.eos_token_id"]
    gguf_eos = int(field.contents())
    if gguf_eos not in ends:
        ends.append(gguf_eos)

    cases = []
    failures = 0
    with torch.no_grad():
        for name, prompt, width, max_tokens, length_penalty, ignore_eos in CASES:
            ids = encode(tok, prompt)

            def logprobs_of(seq, k=2 * width):
                logits = model(input_ids=torch.tensor([seq], device=device)).logits[0, -1]
                lps = torch.log_softmax(logits.float(), dim=-1)
                top = torch.topk(lps, k)
                return list(zip(top.indices.tolist(), top.values.tolist()))

            beams, margin, steps = beam_search(
                logprobs_of, ids, width, max_tokens, length_penalty, ends, ignore_eos
            )
            case = {
                "name": name,
                "prompt": prompt,
                "prompt_ids": ids,
                "width": width,
                "max_tokens": max_tokens,
                "length_penalty": length_penalty,
                "ignore_eos": ignore_eos,
                "beams": beams,
                "margin": margin,
                "end_to_end": name in END_TO_END,
                "steps": steps,
            }
            # transformers' own beam search on the cases no end token cut short.
            # (min_new_tokens keeps every end token out: only where none made the answer.)
            if all(b["finish"] == "length" for b in beams) and not ignore_eos:
                out = model.generate(
                    input_ids=torch.tensor([ids], device=device),
                    attention_mask=torch.ones(1, len(ids), dtype=torch.long, device=device),
                    num_beams=width,
                    num_return_sequences=width,
                    do_sample=False,
                    max_new_tokens=max_tokens,
                    min_new_tokens=max_tokens,
                    length_penalty=length_penalty,
                    early_stopping=True,
                    pad_token_id=ends[0],
                    eos_token_id=ends,
                )
                hf = [row[len(ids):].tolist() for row in out]
                ours = [b["tokens"] for b in beams]
                case["transformers_generate"] = hf
                if sorted(hf) != sorted(ours):
                    print(f"{name}: generate() disagrees: {hf} vs {ours}", file=sys.stderr)
                    failures += 1
            cases.append(case)
            print(f"{name:12} width {width} margin {margin:.4f}")
            for b in beams:
                print(f"   {b['finish']:6} {b['cum_logprob']:9.4f} {tok.decode(b['tokens'])!r}")

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
            "what": "vLLM's beam search over transformers' float32 logprobs, run to max_tokens",
            "end_token_ids": ends,
        },
        "cases": cases,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(fixture, f, indent=1)
        f.write("\n")
    print(f"wrote {args.out}: {len(cases)} cases")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
