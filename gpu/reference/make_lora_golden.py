#!/usr/bin/env python3
"""Golden reference for LoRA adapters on SmolLM2-135M-Instruct (Q4_1 GGUF), from transformers.

1. Makes a random PEFT LoRA adapter for SmolLM2-135M (rank 4, lora_alpha 8, all seven Llama
   projections of every layer, bf16) from a fixed numpy seed, each module's B scaled so that
   the update scale * B @ A has a Frobenius norm of DELTA_REL times the module's base weight,
   and writes it in PEFT's format (adapter_config.json, adapter_model.safetensors) into
   gpu/tests/fixtures/lora/smollm2-r4/.
2. Loads the GGUF with transformers (float32; its GGUF loader un-permutes Q/K rows to the
   Hugging Face layout, the layout PEFT adapters are trained in), adds scale * B @ A (from the
   bf16 values as stored) to each adapted weight, and generates greedy tokens for a few
   prompts, recomputing the whole sequence at every step (so each step's logits are those of a
   teacher-forced pass). Also records the base model's top-1 at the same positions (the merged
   model is undone first), so a test can see that the adapter changes the answers.

Nothing here uses Switchyard's code or output: the adapter is applied by merging it into the
Hugging Face weights, the independent counterpart of Switchyard's per-request application.

Output: gpu/tests/fixtures/lora/smollm2-r4/ and gpu/tests/fixtures/lora_golden.json:
  adapter       the adapter's directory (relative to the fixtures folder), rank, alpha
  generations   [{name, prompt_ids, tokens, steps: [{logprob, top5: [[id, logprob] x5], margin}],
                  base_top1: [id per step]}]

Needs: torch, transformers (GGUF support), numpy, safetensors, gguf.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import sys

MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
RANK = 4
ALPHA = 8.0
DELTA_REL = 0.15
SEED = 20261130
NUM_GENERATED = 24
TOP_N = 5
MODULES = [
    ("self_attn", "q_proj"),
    ("self_attn", "k_proj"),
    ("self_attn", "v_proj"),
    ("self_attn", "o_proj"),
    ("mlp", "gate_proj"),
    ("mlp", "up_proj"),
    ("mlp", "down_proj"),
]
# Token-id prompts are made from these texts with the model's own tokenizer (chat ones through
# its template).
PROMPTS = [
    ("raw-capital", "raw", "The capital of France is"),
    ("raw-story", "raw", "Once upon a time, in a small village by the sea,"),
    ("chat-haiku", "chat", [{"role": "user", "content": "Write a haiku about trains."}]),
    ("chat-math", "chat", [{"role": "user", "content": "What is 17 times 23? Explain briefly."}]),
    ("raw-code", "raw", "def fibonacci(n):\n"),
]


def sha256_of(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def main() -> int:
    here = os.path.dirname(os.path.abspath(__file__))
    fixtures = os.path.join(here, "..", "tests", "fixtures")
    default_model = os.path.join(
        os.environ.get(
            "SWITCHYARD_MODEL_DIR", os.path.expanduser("~/.cache/switchyard/models/smollm2-135m")
        ),
        MODEL_FILE,
    )
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=default_model, help="path of the GGUF file")
    ap.add_argument("--out", default=fixtures, help="fixtures folder to write into")
    ap.add_argument("--device", default=None, help="torch device (default: cuda if available)")
    args = ap.parse_args()

    import numpy as np
    import torch
    import transformers
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    digest = sha256_of(args.model)
    if digest != MODEL_SHA256:
        print(f"{args.model}: sha256 {digest}, expected {MODEL_SHA256}", file=sys.stderr)
        return 2
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")

    model_dir, model_name = os.path.split(os.path.abspath(args.model))
    tok = AutoTokenizer.from_pretrained(model_dir, gguf_file=model_name)
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, gguf_file=model_name, dtype=torch.float32, attn_implementation="eager"
    )
    model.to(device)
    model.eval()
    layers = model.model.layers

    # 1. The adapter.
    rng = np.random.default_rng(SEED)
    scale = ALPHA / RANK
    tensors = {}
    deltas = []
    for i, layer in enumerate(layers):
        for part, mod in MODULES:
            w = getattr(getattr(layer, part), mod).weight  # [out, in]
            out_f, in_f = w.shape
            a = rng.standard_normal((RANK, in_f)) / np.sqrt(in_f)
            b = rng.standard_normal((out_f, RANK))
            a_t = torch.tensor(a, dtype=torch.float32).to(torch.bfloat16)
            delta = scale * b @ a_t.float().numpy()
            w_norm = float(torch.linalg.norm(w.detach().float()).cpu())
            b = b * (DELTA_REL * w_norm / float(np.linalg.norm(delta)))
            b_t = torch.tensor(b, dtype=torch.float32).to(torch.bfloat16)
            prefix = f"base_model.model.model.layers.{i}.{part}.{mod}"
            tensors[f"{prefix}.lora_A.weight"] = a_t.contiguous()
            tensors[f"{prefix}.lora_B.weight"] = b_t.contiguous()
            deltas.append((w, scale * (b_t.float() @ a_t.float())))
    adapter_rel = os.path.join("lora", "smollm2-r4")
    adapter_dir = os.path.join(args.out, adapter_rel)
    os.makedirs(adapter_dir, exist_ok=True)
    save_file(tensors, os.path.join(adapter_dir, "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": "HuggingFaceTB/SmolLM2-135M-Instruct",
        "r": RANK,
        "lora_alpha": ALPHA,
        "lora_dropout": 0.0,
        "target_modules": [m for _, m in MODULES],
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "rank_pattern": {},
        "alpha_pattern": {},
    }
    with open(os.path.join(adapter_dir, "adapter_config.json"), "w") as f:
        json.dump(config, f, indent=2)
        f.write("\n")

    # 2. Prompts, then greedy generation with the adapter merged into the weights.
    prompts = []
    for name, kind, payload in PROMPTS:
        if kind == "chat":
            text = tok.apply_chat_template(payload, tokenize=False, add_generation_prompt=True)
        else:
            text = payload
        prompts.append((name, tok(text, add_special_tokens=False)["input_ids"]))

    def set_merged(on: bool):
        with torch.no_grad():
            for w, d in deltas:
                if on:
                    w.add_(d.to(w.device))
                else:
                    w.sub_(d.to(w.device))

    def rows_of(ids):
        with torch.no_grad():
            x = torch.tensor([ids], dtype=torch.long, device=device)
            logits = model(input_ids=x, use_cache=False).logits[0].float()
            return torch.log_softmax(logits, dim=-1).cpu()

    base_w = {id(w): w.detach().clone() for w, _ in deltas}
    set_merged(True)
    generations = []
    for name, prompt_ids in prompts:
        ids = list(prompt_ids)
        tokens, steps = [], []
        for _ in range(NUM_GENERATED):
            lp = rows_of(ids)[-1]
            top = torch.topk(lp, TOP_N)
            t = int(top.indices[0])
            steps.append(
                {
                    "logprob": float(lp[t]),
                    "top5": [[int(i), float(v)] for i, v in zip(top.indices, top.values)],
                    "margin": float(top.values[0] - top.values[1]),
                }
            )
            tokens.append(t)
            ids.append(t)
        # One teacher-forced pass over the same ids gives the same rows (checked).
        tf = rows_of(list(prompt_ids) + tokens[:-1])[len(prompt_ids) - 1 :]
        tf_diff = max(abs(float(tf[k][t]) - s["logprob"]) for k, (t, s) in enumerate(zip(tokens, steps)))
        generations.append(
            {
                "name": name,
                "prompt_ids": prompt_ids,
                "tokens": tokens,
                "completion": tok.decode(tokens),
                "steps": steps,
                "tf_max_diff": tf_diff,
            }
        )
    set_merged(False)
    restored = max(float((w - base_w[id(w)]).abs().max()) for w, _ in deltas)
    changed = 0
    total = 0
    for g in generations:
        rows = rows_of(list(g["prompt_ids"]) + g["tokens"][:-1])[len(g["prompt_ids"]) - 1 :]
        g["base_top1"] = [int(r.argmax()) for r in rows]
        changed += sum(1 for a, b in zip(g["base_top1"], g["tokens"]) if a != b)
        total += len(g["tokens"])

    out = {
        "model_file": MODEL_FILE,
        "model_sha256": MODEL_SHA256,
        "reference": {
            "tool": "gpu/reference/make_lora_golden.py",
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "device": str(device),
            "date": datetime.date.today().isoformat(),
            "method": "adapter merged into the float32 weights (W += alpha/r * B @ A)",
        },
        "adapter": {"dir": adapter_rel, "rank": RANK, "alpha": ALPHA, "delta_rel": DELTA_REL},
        "generations": generations,
    }
    with open(os.path.join(args.out, "lora_golden.json"), "w") as f:
        json.dump(out, f, indent=1)
        f.write("\n")
    min_margin = min(s["margin"] for g in generations for s in g["steps"])
    print(
        json.dumps(
            {
                "steps": total,
                "top1_changed_by_adapter": changed,
                "min_margin": min_margin,
                "margins_below_0.02": sum(
                    1 for g in generations for s in g["steps"] if s["margin"] < 0.02
                ),
                "tf_max_diff": max(g["tf_max_diff"] for g in generations),
                "weights_restored_max_abs": restored,
                "completions": {g["name"]: g["completion"] for g in generations},
            },
            indent=1,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
