#!/usr/bin/env python3
"""Golden reference fixtures for SmolLM2-135M-Instruct (Q4_1 GGUF) from Hugging Face transformers.

The reference is transformers itself: its GGUF loader dequantizes the weights of the very file that
Switchyard loads (float32, Q/K rows un-permuted back to the Hugging Face layout) and builds a
LlamaForCausalLM; the tokenizer and the chat template are the ones transformers builds from the
GGUF metadata. Nothing here uses Switchyard's code or output.

Output: gpu/tests/fixtures/smollm2_golden.json, in the schema of the gpu/ crate's contract:
  tokenization  strings -> ids (add_special_tokens=False)
  chat          conversations -> rendered text (template from the GGUF) and its ids
  generations   32 greedy tokens per prompt and, per generated position, the logprob of the chosen
                token and the top-5 (id, logprob): log_softmax of the float32 logits

Greedy decoding recomputes the whole sequence at every step (no KV cache), so each step's logits
are exactly what a teacher-forced pass over prompt_ids + tokens gives at that position.

With --crosscheck the script also runs an independent forward pass written here from the GGUF
tensors as stored (gguf package dequantization, Q/K rows left permuted, RoPE on adjacent pairs as
llama.cpp does) and compares it, teacher-forced, with the transformers logprobs. That checks the
reference and shows the contract's tolerances are reachable by an implementation that reads the
GGUF rows as they are.

Needs: torch, transformers (>= 4.46, tested with 5.17), accelerate, numpy, gguf.
See README.md beside this file for how to run it.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import math
import os
import sys

MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
NUM_GENERATED = 32
TOP_N = 5

# Cases from issue 3: the reference must reproduce them.
ISSUE_CASES = {
    "12345 apples": [33, 34, 35, 36, 37, 13855],
    "  hello   world": [216, 33662, 256, 905],
    "<|im_start|>user\nhi<|im_end|>": [1, 4093, 198, 6004, 2],
}

TOKENIZATION_TEXTS = [
    "12345 apples",
    "  hello   world",
    "<|im_start|>user\nhi<|im_end|>",
    "",
    "Hello, world!",
    "0123456789",
    "I have 3 apples and 1024 pears, pi is 3.14159.",
    "Year 2024: 100% of 7/8 items cost $1,234.56",
    "café naïve résumé façade",
    "Ünïcödé Straße ÅÆØ",
    "日本語のテキストです。",
    "中文测试，你好世界！",
    "emoji 😀🎉👍🏽 family 👨‍👩‍👧 flag 🇫🇷",
    "Привет мир! Γειά σου κόσμε",
    "١٢٣ arabic digits ٤٥ and x²+y³=z⁴",
    "x ١٢٣ y ²³ ½",
    "tab\tseparated\tvalues\n\nnew lines\r\nend",
    "def square(x):\n    return x ** 2  # comment\n",
    'fn main() {\n\tprintln!("{}", 1 + 2);\n}',
    "don't I'll we're they've she'd it's",
    "DON'T I'LL WE'RE",
    "a" + " " * 16 + "b",
    "\n\n\n\n",
    "      ",
    "   leading and trailing   ",
    "mixed\t tabs \t\tand  \n  spaces",
    "Some text <|im_end|> then <|im_start|>assistant\nmore",
    "x<|endoftext|>y",
    "<|im_start|><|im_end|><|endoftext|>",
    "<|im_sta not special|>",
    "https://example.com/path?query=1&b=2#frag",
]

CHATS = [
    {"messages": [{"role": "user", "content": "hi"}], "add_generation_prompt": True},
    {
        "messages": [
            {"role": "system", "content": "You are a terse assistant."},
            {"role": "user", "content": "What is the capital of Italy?"},
        ],
        "add_generation_prompt": True,
    },
    {
        "messages": [
            {"role": "user", "content": "Give me a number."},
            {"role": "assistant", "content": "42"},
            {"role": "user", "content": "Another one, please."},
        ],
        "add_generation_prompt": True,
    },
    {
        "messages": [
            {"role": "system", "content": "Answer in French."},
            {"role": "user", "content": "Hello!"},
            {"role": "assistant", "content": "Bonjour !"},
        ],
        "add_generation_prompt": False,
    },
]

LONG_TEXT = (
    "Photosynthesis is the process by which green plants, algae and some bacteria convert light "
    "energy into chemical energy. It takes place mainly in the chloroplasts of leaf cells, which "
    "contain the pigment chlorophyll. During the light-dependent reactions, water molecules are "
    "split, releasing oxygen as a by-product and producing ATP and NADPH. In the Calvin cycle, these "
    "energy carriers are used to fix carbon dioxide from the air into sugars such as glucose. The "
    "overall equation can be written as six molecules of carbon dioxide plus six molecules of water, "
    "with light, giving one molecule of glucose and six molecules of oxygen. Photosynthesis is "
    "essential for life on Earth because"
)

LONG_CODE = '''def quicksort(items):
    """Sort a list with the quicksort algorithm."""
    if len(items) <= 1:
        return items
    pivot = items[len(items) // 2]
    left = [x for x in items if x < pivot]
    middle = [x for x in items if x == pivot]
    right = [x for x in items if x > pivot]
    return quicksort(left) + middle + quicksort(right)


def binary_search(items, target):
    """Return the index of target in the sorted list items, or -1."""
    low, high = 0, len(items) - 1
    while low <= high:
        mid = (low + high) // 2
        if items[mid] == target:
            return mid'''

# (name, kind, payload): kind "raw" feeds the text as is; kind "chat" renders the messages with the
# template from the GGUF and add_generation_prompt=True. Chosen among ~30 candidates so that no
# greedy step has a top-1/top-2 margin under 0.06 nats: a fixture step decided by float noise
# would test the arithmetic's rounding, not the model. The two long prompts (>100 tokens) span
# several KV blocks. End-of-turn tokens are not special: 32 tokens are always generated.
GENERATIONS = [
    ("raw-alphabet", "raw", "The alphabet: A B C D"),
    ("raw-count", "raw", "1, 2, 3, 4, 5,"),
    ("raw-code", "raw", "def fibonacci(n):\n"),
    ("raw-long-text", "raw", LONG_TEXT),
    ("raw-long-code", "raw", LONG_CODE),
    ("chat-hi", "chat", [{"role": "user", "content": "Hi! Who are you?"}]),
    ("chat-haiku", "chat", [{"role": "user", "content": "Write a haiku about trains."}]),
    (
        "chat-system",
        "chat",
        [
            {"role": "system", "content": "You are a concise assistant."},
            {"role": "user", "content": "What is the boiling point of water?"},
        ],
    ),
    (
        "chat-multi",
        "chat",
        [
            {"role": "user", "content": "What is 2+2?"},
            {"role": "assistant", "content": "4"},
            {"role": "user", "content": "And 3+3?"},
        ],
    ),
]


def sha256_of(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def dumps(obj, indent: int = 0, width: int = 110) -> str:
    """JSON with short lists and objects kept on one line, so the fixture stays reviewable."""
    compact = json.dumps(obj, ensure_ascii=False, separators=(", ", ": "))
    if len(compact) + indent <= width or not isinstance(obj, (dict, list)) or not obj:
        return compact
    pad = " " * (indent + 1)
    if isinstance(obj, list) and all(isinstance(v, (int, float)) for v in obj):
        # A long list of numbers (token ids): packed, several to a line.
        lines, line = [], ""
        for v in obj:
            item = json.dumps(v)
            if line and len(pad) + len(line) + len(item) + 2 > width:
                lines.append(pad + line.rstrip().rstrip(","))
                line = ""
            line += item + ", "
        lines.append(pad + line.rstrip().rstrip(","))
        return "[\n" + ",\n".join(lines) + "\n" + " " * indent + "]"
    if isinstance(obj, dict):
        items = [
            pad + json.dumps(k, ensure_ascii=False) + ": " + dumps(v, indent + 1, width)
            for k, v in obj.items()
        ]
        return "{\n" + ",\n".join(items) + "\n" + " " * indent + "}"
    items = [pad + dumps(v, indent + 1, width) for v in obj]
    return "[\n" + ",\n".join(items) + "\n" + " " * indent + "]"


def encode(tok, text: str) -> list[int]:
    return [int(i) for i in tok(text, add_special_tokens=False)["input_ids"]]


def restore_smollm_pretokenizer(tok, model_path: str) -> bool:
    """transformers' GGUF tokenizer converter keeps only the ByteLevel pre-tokenizer and ignores
    `tokenizer.ggml.pre`. For "smollm" (SmolLM's own tokenizer.json, and llama.cpp's
    LLAMA_VOCAB_PRE_TYPE_SMOLLM) every Unicode number is isolated first: tokenizers'
    Digits(individual_digits=True), then ByteLevel. Without it " ٤" or " ²" merge with the space
    into a token the original tokenizer never produces. Restores it; True if it did."""
    import gguf
    from tokenizers import pre_tokenizers

    field = gguf.GGUFReader(model_path).fields.get("tokenizer.ggml.pre")
    if field is None or field.contents() != "smollm":
        return False
    backend = tok.backend_tokenizer
    current = json.loads(backend.to_str()).get("pre_tokenizer") or {}
    if current.get("type") != "ByteLevel":
        raise SystemExit(f"unexpected pre-tokenizer from the GGUF converter: {current}")
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    return True


def default_model_path() -> str:
    """The GGUF where `switchyard model fetch smollm2-135m` puts it (SWITCHYARD_MODEL_DIR
    overrides the folder)."""
    return os.path.join(
        os.environ.get(
            "SWITCHYARD_MODEL_DIR",
            os.path.expanduser("~/.cache/switchyard/models/smollm2-135m"),
        ),
        MODEL_FILE,
    )


def load_reference(model_path: str, device_name):
    """transformers' float32 model and tokenizer of the GGUF at `model_path`, after checking
    its sha256 (SystemExit 2 if it is another file): TF32 off, eager attention, the SmolLM
    pre-tokenizer restored. Returns (torch, transformers, tok, model, device, digest)."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    digest = sha256_of(model_path)
    if digest != MODEL_SHA256:
        print(f"{model_path}: sha256 {digest}, expected {MODEL_SHA256}", file=sys.stderr)
        raise SystemExit(2)
    device = torch.device(device_name or ("cuda" if torch.cuda.is_available() else "cpu"))
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    model_dir, model_name = os.path.split(os.path.abspath(model_path))
    tok = AutoTokenizer.from_pretrained(model_dir, gguf_file=model_name)
    restore_smollm_pretokenizer(tok, model_path)
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, gguf_file=model_name, dtype=torch.float32, attn_implementation="eager"
    )
    model.to(device)
    model.eval()
    return torch, transformers, tok, model, device, digest


def render_chat(tok, messages, add_generation_prompt: bool) -> str:
    return tok.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )


def greedy(model, torch, prompt_ids: list[int], n: int, device):
    """n greedy tokens; every step runs the full sequence (no cache). Returns tokens and per-step
    float32 log-softmax rows (on the CPU)."""
    ids = list(prompt_ids)
    tokens, rows = [], []
    with torch.no_grad():
        for _ in range(n):
            x = torch.tensor([ids], dtype=torch.long, device=device)
            logits = model(input_ids=x, use_cache=False).logits[0, -1].float()
            lp = torch.log_softmax(logits, dim=-1).cpu()
            t = int(torch.argmax(lp))
            tokens.append(t)
            rows.append(lp)
            ids.append(t)
    return tokens, rows


def teacher_forced(model, torch, prompt_ids, tokens, device):
    """log-softmax rows at the positions that predict tokens[0..], from one pass over all ids."""
    ids = list(prompt_ids) + list(tokens)
    with torch.no_grad():
        x = torch.tensor([ids], dtype=torch.long, device=device)
        logits = model(input_ids=x, use_cache=False).logits[0].float()
        lp = torch.log_softmax(logits, dim=-1).cpu()
    p = len(prompt_ids)
    return lp[p - 1 : p - 1 + len(tokens)]


# ---------------------------------------------------------------------------------------------
# Independent cross-check: a Llama forward pass written here from the raw GGUF tensors.
# ---------------------------------------------------------------------------------------------


class GgufLlama:
    """Llama forward pass over GGUF tensors as stored (llama.cpp layout: Q/K rows permuted for
    RoPE on adjacent pairs (x[2i], x[2i+1]))."""

    def __init__(self, path: str, torch, device):
        import gguf
        import numpy as np

        self.torch = torch
        self.device = device
        reader = gguf.GGUFReader(path)

        def meta(key):
            return reader.fields[key].contents()

        self.n_layers = int(meta("llama.block_count"))
        self.n_heads = int(meta("llama.attention.head_count"))
        self.n_kv = int(meta("llama.attention.head_count_kv"))
        self.hidden = int(meta("llama.embedding_length"))
        self.head_dim = self.hidden // self.n_heads
        self.eps = float(meta("llama.attention.layer_norm_rms_epsilon"))
        self.theta = float(meta("llama.rope.freq_base"))
        self.w = {}
        for t in reader.tensors:
            arr = gguf.quants.dequantize(t.data, t.tensor_type)
            # gguf-py gives the array in row-major PyTorch order: [.., ne1, ne0].
            shape = [int(d) for d in reversed([int(x) for x in t.shape])]
            arr = np.array(arr, dtype=np.float32, copy=True).reshape(shape)
            self.w[t.name] = torch.from_numpy(arr).to(device)
        self.lm_head = self.w.get("output.weight", self.w["token_embd.weight"])

    def _rms(self, x, w):
        t = self.torch
        return x * t.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * w

    def _rope_adjacent(self, x, pos):
        # x: [T, H, D]; rotate pairs (2i, 2i+1) by pos * theta^(-2i/D).
        t = self.torch
        d = self.head_dim
        inv = 1.0 / (self.theta ** (t.arange(0, d, 2, dtype=t.float64, device=self.device) / d))
        ang = pos.to(t.float64)[:, None] * inv[None, :]
        cos = t.cos(ang).to(t.float32)[:, None, :]
        sin = t.sin(ang).to(t.float32)[:, None, :]
        x0, x1 = x[..., 0::2], x[..., 1::2]
        out = t.empty_like(x)
        out[..., 0::2] = x0 * cos - x1 * sin
        out[..., 1::2] = x0 * sin + x1 * cos
        return out

    def logprobs(self, ids):
        t = self.torch
        w = self.w
        n = len(ids)
        x = w["token_embd.weight"][t.tensor(ids, device=self.device)]
        pos = t.arange(n, device=self.device)
        mask = t.full((n, n), float("-inf"), device=self.device).triu(1)
        group = self.n_heads // self.n_kv
        for i in range(self.n_layers):
            p = f"blk.{i}."
            h = self._rms(x, w[p + "attn_norm.weight"])
            q = (h @ w[p + "attn_q.weight"].T).view(n, self.n_heads, self.head_dim)
            k = (h @ w[p + "attn_k.weight"].T).view(n, self.n_kv, self.head_dim)
            v = (h @ w[p + "attn_v.weight"].T).view(n, self.n_kv, self.head_dim)
            q, k = self._rope_adjacent(q, pos), self._rope_adjacent(k, pos)
            k = k.repeat_interleave(group, dim=1)
            v = v.repeat_interleave(group, dim=1)
            s = t.einsum("qhd,khd->hqk", q, k) / math.sqrt(self.head_dim) + mask
            a = t.einsum("hqk,khd->qhd", t.softmax(s, dim=-1), v).reshape(n, self.hidden)
            x = x + a @ w[p + "attn_output.weight"].T
            h = self._rms(x, w[p + "ffn_norm.weight"])
            g = t.nn.functional.silu(h @ w[p + "ffn_gate.weight"].T) * (h @ w[p + "ffn_up.weight"].T)
            x = x + g @ w[p + "ffn_down.weight"].T
        x = self._rms(x, w["output_norm.weight"])
        return t.log_softmax(x @ self.lm_head.T, dim=-1).cpu()


def crosscheck(path, torch, device, generations) -> dict:
    indep = GgufLlama(path, torch, device)
    agree = total = 0
    diffs = []
    for g in generations:
        with torch.no_grad():
            lp = indep.logprobs(g["prompt_ids"] + g["tokens"])
        p = len(g["prompt_ids"])
        for i, (tok, step) in enumerate(zip(g["tokens"], g["steps"])):
            row = lp[p - 1 + i]
            agree += int(int(torch.argmax(row)) == step["top5"][0][0])
            total += 1
            diffs.append(abs(float(row[tok]) - step["logprob"]))
    return {
        "top1_agreement": agree / max(total, 1),
        "mean_abs_logprob_diff": sum(diffs) / max(len(diffs), 1),
        "max_abs_logprob_diff": max(diffs) if diffs else 0.0,
        "steps": total,
    }


def main() -> int:
    here = os.path.dirname(os.path.abspath(__file__))
    default_model = os.path.join(
        os.environ.get(
            "SWITCHYARD_MODEL_DIR",
            os.path.expanduser("~/.cache/switchyard/models/smollm2-135m"),
        ),
        MODEL_FILE,
    )
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=default_model, help="path of the GGUF file")
    ap.add_argument(
        "--out",
        default=os.path.join(here, "..", "tests", "fixtures", "smollm2_golden.json"),
        help="where to write the fixture",
    )
    ap.add_argument("--device", default=None, help="torch device (default: cuda if available)")
    ap.add_argument("--crosscheck", action="store_true", help="also run the independent pass")
    ap.add_argument(
        "--bf16-check",
        action="store_true",
        help="also run transformers in bfloat16, teacher-forced over the fixture's tokens, and "
        "report how far a plain bf16 implementation lands from the float32 fixture",
    )
    ap.add_argument("--summary", default=None, help="write a JSON summary of the checks here")
    ap.add_argument(
        "--any-model",
        action="store_true",
        help="accept another GGUF of this model (e.g. a K-quant made by make_kquant_model.py): "
        "the fixture names that file and its sha256",
    )
    args = ap.parse_args()

    import torch
    import transformers

    try:
        import gguf

        gguf_version = getattr(gguf, "__version__", None)
        if gguf_version is None:
            from importlib.metadata import version

            gguf_version = version("gguf")
    except ImportError:
        print("the gguf package is required (transformers' GGUF loader uses it)", file=sys.stderr)
        return 2

    digest = sha256_of(args.model)
    if digest != MODEL_SHA256 and not args.any_model:
        print(f"{args.model}: sha256 {digest}, expected {MODEL_SHA256}", file=sys.stderr)
        return 2

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    # Plain float32 everywhere: no TF32 in matrix products or convolutions.
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    torch.manual_seed(0)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir, model_name = os.path.split(os.path.abspath(args.model))
    tok = AutoTokenizer.from_pretrained(model_dir, gguf_file=model_name)
    restored = restore_smollm_pretokenizer(tok, args.model)
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, gguf_file=model_name, dtype=torch.float32, attn_implementation="eager"
    )
    model.to(device)
    model.eval()

    failures = []

    tokenization = []
    for text in TOKENIZATION_TEXTS:
        ids = encode(tok, text)
        tokenization.append({"text": text, "ids": ids})
        want = ISSUE_CASES.get(text)
        if want is not None and ids != want:
            failures.append(f"issue case {text!r}: got {ids}, issue says {want}")

    chat = []
    for c in CHATS:
        rendered = render_chat(tok, c["messages"], c["add_generation_prompt"])
        ids = encode(tok, rendered)
        via_template = tok.apply_chat_template(
            c["messages"], tokenize=True, add_generation_prompt=c["add_generation_prompt"]
        )
        if isinstance(via_template, dict) or hasattr(via_template, "keys"):
            via_template = via_template["input_ids"]
        if [int(i) for i in via_template] != ids:
            failures.append(f"chat {c['messages']!r}: apply_chat_template ids differ from encode")
        chat.append(
            {
                "messages": c["messages"],
                "add_generation_prompt": c["add_generation_prompt"],
                "rendered": rendered,
                "ids": ids,
            }
        )

    generations = []
    tf_max_diff = 0.0
    for name, kind, payload in GENERATIONS:
        prompt = payload if kind == "raw" else render_chat(tok, payload, True)
        prompt_ids = encode(tok, prompt)
        tokens, rows = greedy(model, torch, prompt_ids, NUM_GENERATED, device)
        steps = []
        for t_id, row in zip(tokens, rows):
            vals, idx = torch.topk(row, TOP_N)
            steps.append(
                {
                    "logprob": round(float(row[t_id]), 6),
                    "top5": [[int(i), round(float(v), 6)] for v, i in zip(vals, idx)],
                }
            )
            if steps[-1]["top5"][0][0] != t_id:
                failures.append(f"{name}: greedy token is not top-1")
        tf = teacher_forced(model, torch, prompt_ids, tokens, device)
        for i, t_id in enumerate(tokens):
            tf_max_diff = max(tf_max_diff, abs(float(tf[i][t_id]) - float(rows[i][t_id])))
        text = tok.decode(tokens, skip_special_tokens=False)
        generations.append(
            {
                "name": name,
                "prompt": prompt,
                "completion": text,
                "prompt_ids": prompt_ids,
                "tokens": tokens,
                "steps": steps,
            }
        )
        margins = [s["top5"][0][1] - s["top5"][1][1] for s in steps]
        print(
            f"[{name}] {len(prompt_ids)} prompt tokens, min top1-top2 margin "
            f"{min(margins):.4f} nats -> {text!r}",
            flush=True,
        )

    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    reference = (
        f"Hugging Face transformers {transformers.__version__} (GGUF loader, weights dequantized to "
        f"float32 by gguf {gguf_version}, LlamaForCausalLM, eager attention, no TF32), torch "
        f"{torch.__version__} on {device.type}"
        + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else "")
        + "; greedy by full recompute each step, logprobs = log_softmax(float32 logits); "
        "tokenizer and chat template built by transformers from the GGUF"
        + (
            " (with the smollm pre-tokenizer that its converter drops restored: tokenizers' "
            "Digits(individual_digits=True) before ByteLevel); "
            if restored
            else "; "
        )
        + f"made {date} by gpu/reference/make_golden.py"
    )
    fixture = {
        "model_file": os.path.basename(args.model) if args.any_model else MODEL_FILE,
        "model_sha256": digest,
        "reference": reference,
        "tokenization": tokenization,
        "chat": chat,
        "generations": generations,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        f.write(dumps(fixture) + "\n")
    print(f"wrote {args.out}")
    print(f"teacher-forced vs step-by-step: max |logprob diff| {tf_max_diff:.2e}")

    summary = {"reference": reference, "teacher_forced_max_diff": tf_max_diff, "failures": failures}
    if args.crosscheck:
        cc = crosscheck(args.model, torch, device, generations)
        summary["crosscheck"] = cc
        print(f"independent GGUF pass (adjacent-pair RoPE, rows as stored): {cc}")
        if cc["top1_agreement"] < 0.99 or cc["mean_abs_logprob_diff"] > 0.05:
            failures.append(f"independent pass disagrees with transformers: {cc}")
    if args.bf16_check:
        model.to(torch.bfloat16)
        agree, n, diff = 0, 0, 0.0
        for g in generations:
            rows = teacher_forced(model, torch, g["prompt_ids"], g["tokens"], device)
            for i, step in enumerate(g["steps"]):
                agree += int(torch.argmax(rows[i])) == step["top5"][0][0]
                diff += abs(float(rows[i][g["tokens"][i]]) - step["logprob"])
                n += 1
        bf = {"top1_agreement": agree / n, "mean_abs_logprob_diff": diff / n, "steps": n}
        summary["bf16"] = bf
        print(f"transformers in bfloat16 against the float32 fixture: {bf}")
    if args.summary:
        with open(args.summary, "w", encoding="utf-8") as f:
            json.dump(summary, f, indent=1)
    for msg in failures:
        print("FAIL:", msg, file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
