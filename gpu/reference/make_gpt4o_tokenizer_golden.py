#!/usr/bin/env python3
"""Golden reference for GGUF tokenizers with `tokenizer.ggml.pre = "gpt-4o"` (llama.cpp's name
for OpenAI's o200k split, which Phi-4-mini's files use): ids from OpenAI's `tiktoken` for a tiny
byte-level BPE vocabulary, the split being o200k_base's regex as tiktoken ships it.

The script builds a `tiktoken.Encoding` from
  - o200k_base's pattern, read from tiktoken's own registry (`tiktoken_ext.openai_public`; its
    download of the real ranks is replaced by an empty table, so nothing is fetched),
  - ranks: the 256 bytes (rank = byte value), then the merges below in order,
encodes the texts below with it, and writes `gpt4o_tokenizer_golden.json`: {format,
reference, tokens (the vocabulary as GGUF writes it: GPT-2's byte symbols), merges ("a b" in
GGUF's form, rank order), texts [{text, ids}]}. Switchyard's test builds a GGUF header from
`tokens` and `merges` and must give tiktoken's ids. Nothing here uses Switchyard's code.

Needs: tiktoken (0.14 tested), regex. Runs in a second.
"""

from __future__ import annotations

import datetime
import json
import os

# Merges (byte strings), applied by rank: chosen so that the split decides the ids (a merge
# across a split boundary never applies): contractions, case runs, digit triples, newlines.
# The first three join pieces that o200k's split keeps in one pre-token and Llama 3's (cl100k)
# does not, or the other way round: a lower letter before an upper one ("HelloWorld" is two
# words for o200k), a contraction's apostrophe (o200k keeps "it's" whole) and a combining mark
# after its letter (a letter for o200k, punctuation for cl100k).
MERGES = [
    b"oW", b"t'", b"e\xcc",
    b"'s", b"'S", b"He", b"Hel", b"Hell", b"Hello", b"Wo", b"Wor", b"Worl", b"World",
    b"12", b"123", b" .", b" ..", b"\n\n", b"\r\n", b" t", b" th", b" the", b"ab", b"//",
    b"  ", b"LL", b"LLM", b"s.", b"ll",
]
TEXTS = [
    "HelloWorld HELLO'S",
    "it's HE'S the LLMs",
    "1234567 12 123.5",
    "a/b//c ...\n\n x",
    "  the\r\n\r\nthe  ",
    "caf\u00e9 cafe\u0301 \u00fcber",
    "\u0645\u0631\u062d\u0628\u0627 123",
    "x\t\ty\n",
    "Hello, World! ab//ab",
]


def main() -> None:
    import tiktoken
    import tiktoken_ext.openai_public as registry

    # o200k_base's pattern as tiktoken defines it, without fetching its ranks.
    registry.load_tiktoken_bpe = lambda *a, **k: {}
    pat_str = registry.o200k_base()["pat_str"]

    # GPT-2's byte symbols, indexed by byte value (what GGUF's token strings hold).
    from make_qwen_golden import bytes_to_unicode

    ranks = {bytes([b]): b for b in range(256)}
    symbols = bytes_to_unicode()
    merges = []
    for m in MERGES:
        # The merge that makes m: the split with both halves already tokens and the lowest
        # rank pair (tiktoken merges the lowest-ranked adjacent pair first).
        best = None
        for i in range(1, len(m)):
            a, b = m[:i], m[i:]
            if a in ranks and b in ranks:
                key = max(ranks[a], ranks[b])
                if best is None or key < best[0]:
                    best = (key, a, b)
        assert best is not None, m
        _, a, b = best
        assert m not in ranks, m
        ranks[m] = len(ranks)
        merges.append(("".join(symbols[x] for x in a), "".join(symbols[x] for x in b)))
    enc = tiktoken.Encoding(name="tiny-o200k", pat_str=pat_str, mergeable_ranks=ranks, special_tokens={})
    tokens = symbols + ["".join(symbols[x] for x in m) for m in MERGES]
    texts = [{"text": t, "ids": enc.encode(t)} for t in TEXTS]
    for t in texts:
        assert enc.decode(t["ids"]) == t["text"]
        print(repr(t["text"]), t["ids"])
    out = {
        "format": "switchyard-gpt4o-tokenizer-golden/1",
        "reference": {
            "tiktoken": tiktoken.__version__,
            "pattern": "o200k_base",
            "date": datetime.date.today().isoformat(),
        },
        "pattern": pat_str,
        "tokens": tokens,
        "merges": [f"{a} {b}" for a, b in merges],
        "texts": texts,
    }
    path = os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures", "gpt4o_tokenizer_golden.json")
    with open(path, "w") as f:
        json.dump(out, f, ensure_ascii=False, indent=1)
    print("wrote", os.path.normpath(path))


if __name__ == "__main__":
    main()
