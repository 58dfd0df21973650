#!/usr/bin/env python3
"""Float32 reference logits for a random Llama-3-8B-shaped model (or SmolLM2-135M-shaped).

The script
  1. draws random weights from a seed (normal, std 0.02 for every matrix and the embedding; RMSNorm
     weights 1 + 0.1 * normal), rounds them to the saved dtype (bf16 by default) and writes a
     Hugging Face checkpoint directory: config.json, model-0000i-of-0000N.safetensors shards with
     model.safetensors.index.json (or one model.safetensors), and a tokenizer.json covering every id
     of the vocabulary (the Switchyard loader requires one; see make_tokenizer_json);
  2. reads that directory back with transformers (LlamaConfig.from_pretrained + the tensors from
     the files, upcast to float32), checks transformers' RoPE frequencies against an independent
     computation of the Llama 3 scaling, and runs LlamaForCausalLM in float32 (TF32 off, eager
     attention) over a fixed token sequence (BOS then ids drawn from the seed);
  3. writes ref_logits.json (tokens, positions, top-k ids/logits for every position, metadata) and
     ref_logits.f32 (full-vocabulary float32 rows for a few positions) into the same directory;
  4. unless --no-bf16-check, runs the same checkpoint through transformers in bfloat16 (sdpa) and
     records how far a plain bf16 implementation lands from the float32 reference, so the Rust
     side's tolerance can be judged against a known bf16 implementation.

The Rust CUDA backend loads the same directory and compares its logits with these files. The
formats are specified in README.md beside this script.

Needs: torch, transformers (5.17 tested), safetensors, numpy. A GPU is strongly advised for the
full 32-layer model (float32 weights alone are 32 GB); --device cpu works for small --layers.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import random
import shutil
import sys
import time
import zlib

FORMAT = "switchyard-ref-logits/1"

# config.json contents per architecture (the Hugging Face legacy layout: top-level rope_theta and
# a rope_scaling object, which both transformers 4.x/5.x and Switchyard's loader read).
ARCHS = {
    "llama3-8b": {
        "config": {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": 128256,
            "hidden_size": 4096,
            "intermediate_size": 14336,
            "num_hidden_layers": 32,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "hidden_act": "silu",
            "max_position_embeddings": 131072,
            "rms_norm_eps": 1e-05,
            "rope_theta": 500000.0,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
            "tie_word_embeddings": False,
            "attention_bias": False,
            "mlp_bias": False,
            "bos_token_id": 128000,
            "eos_token_id": [128001, 128008, 128009],
            "initializer_range": 0.02,
            "use_cache": True,
        },
        # Special tokens (id -> text), as in Llama 3.1's tokenizer; the other ids >= 128000 are
        # reserved specials.
        "specials": {
            128000: "<|begin_of_text|>",
            128001: "<|end_of_text|>",
            128004: "<|finetune_right_pad_id|>",
            128006: "<|start_header_id|>",
            128007: "<|end_header_id|>",
            128008: "<|eom_id|>",
            128009: "<|eot_id|>",
            128010: "<|python_tag|>",
        },
        "special_range": (128000, 128256),
        "byte_start": 0,
    },
    "smollm2-135m": {
        "config": {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": 49152,
            "hidden_size": 576,
            "intermediate_size": 1536,
            "num_hidden_layers": 30,
            "num_attention_heads": 9,
            "num_key_value_heads": 3,
            "head_dim": 64,
            "hidden_act": "silu",
            "max_position_embeddings": 8192,
            "rms_norm_eps": 1e-05,
            "rope_theta": 100000.0,
            "rope_scaling": None,
            "tie_word_embeddings": True,
            "attention_bias": False,
            "mlp_bias": False,
            "bos_token_id": 1,
            "eos_token_id": 2,
            "initializer_range": 0.02,
            "use_cache": True,
        },
        "specials": {0: "<|endoftext|>", 1: "<|im_start|>", 2: "<|im_end|>"},
        "special_range": (0, 3),
        "byte_start": 3,
    },
}

SAVE_DTYPES = {"bf16": ("bfloat16", 2), "f32": ("float32", 4)}


# ---------------------------------------------------------------------------------------------
# Files that need no torch: config.json and tokenizer.json.


def config_json(arch: str, layers: int, dtype_save: str) -> dict:
    cfg = json.loads(json.dumps(ARCHS[arch]["config"]))  # deep copy
    cfg["num_hidden_layers"] = layers
    cfg["torch_dtype"] = SAVE_DTYPES[dtype_save][0]
    if cfg.get("rope_scaling") is None:
        del cfg["rope_scaling"]
    return cfg


def bytes_to_unicode() -> list[str]:
    """GPT-2's byte -> printable character table (byte-level BPE): printable bytes stand for
    themselves, the others take code points 256, 257, ... in byte order."""
    out, nxt = [], 256
    for b in range(256):
        if 0x21 <= b <= 0x7E or 0xA1 <= b <= 0xAC or 0xAE <= b <= 0xFF:
            out.append(chr(b))
        else:
            out.append(chr(nxt))
            nxt += 1
    return out


def special_tokens(arch: str) -> dict[int, str]:
    spec = ARCHS[arch]
    lo, hi = spec["special_range"]
    named = spec["specials"]
    out, reserved = {}, 0
    for i in range(lo, hi):
        if i in named:
            out[i] = named[i]
        else:
            out[i] = f"<|reserved_special_token_{reserved}|>"
            reserved += 1
    return out


def make_tokenizer_json(arch: str) -> dict:
    """A byte-level BPE tokenizer.json with an entry for every id below vocab_size, so any id the
    model can emit decodes: the architecture's special tokens at their real ids (also listed as
    added special tokens, with the same ids), the 256 byte symbols from byte_start, and filler
    tokens `<|filler_N|>` (N = the id) elsewhere. No merges: text encodes to one token per byte.
    It is a stand-in that lets a checkpoint directory load, not the model's real vocabulary."""
    spec = ARCHS[arch]
    vocab_size = spec["config"]["vocab_size"]
    specials = special_tokens(arch)
    byte_chars = bytes_to_unicode()
    b0 = spec["byte_start"]
    vocab = {}
    for i in range(vocab_size):
        if i in specials:
            tok = specials[i]
        elif b0 <= i < b0 + 256:
            tok = byte_chars[i - b0]
        else:
            tok = f"<|filler_{i}|>"
        vocab[tok] = i
    if len(vocab) != vocab_size:
        raise SystemExit("internal error: tokenizer vocabulary has duplicate entries")
    added = [
        {
            "id": i,
            "content": t,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": True,
        }
        for i, t in sorted(specials.items())
    ]
    byte_level = {"add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", **byte_level},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", **byte_level},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": vocab,
            "merges": [],
        },
    }


def tensor_specs(cfg: dict) -> list[tuple[str, list[int], str]]:
    """(Hugging Face name, shape, kind) of every stored tensor, in file order. kind is "matrix"
    (normal(0, std)) or "norm" (1 + norm_std * normal)."""
    h, ff, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    hd = cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    specs = [("model.embed_tokens.weight", [v, h], "matrix")]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        specs += [
            (p + "input_layernorm.weight", [h], "norm"),
            (p + "self_attn.q_proj.weight", [q, h], "matrix"),
            (p + "self_attn.k_proj.weight", [kv, h], "matrix"),
            (p + "self_attn.v_proj.weight", [kv, h], "matrix"),
            (p + "self_attn.o_proj.weight", [h, q], "matrix"),
            (p + "post_attention_layernorm.weight", [h], "norm"),
            (p + "mlp.gate_proj.weight", [ff, h], "matrix"),
            (p + "mlp.up_proj.weight", [ff, h], "matrix"),
            (p + "mlp.down_proj.weight", [h, ff], "matrix"),
        ]
    specs.append(("model.norm.weight", [h], "norm"))
    if not cfg["tie_word_embeddings"]:
        specs.append(("lm_head.weight", [v, h], "matrix"))
    return specs


def tensor_seed(seed: int, name: str) -> int:
    """Each tensor has its own generator seed, so a model built with --layers N has exactly the
    first N layers (and the same embedding, final norm and head) of the full model."""
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (1 << 63)


def plan_shards(specs, elem_bytes: int, shard_bytes: int) -> list[list[int]]:
    shards, cur, size = [], [], 0
    for i, (_, shape, _) in enumerate(specs):
        n = math.prod(shape) * elem_bytes
        if cur and size + n > shard_bytes:
            shards.append(cur)
            cur, size = [], 0
        cur.append(i)
        size += n
    if cur:
        shards.append(cur)
    return shards


def shard_names(n: int) -> list[str]:
    if n == 1:
        return ["model.safetensors"]
    return [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]


def resolve_positions(spec: str, seq_len: int) -> list[int]:
    out = set()
    for part in spec.split(","):
        part = part.strip()
        if not part:
            continue
        p = int(part)
        if p < 0:
            p += seq_len
        if not 0 <= p < seq_len:
            raise SystemExit(f"--full-positions: {part} is outside a sequence of {seq_len}")
        out.add(p)
    return sorted(out)


def make_tokens(arch: str, seed: int, seq_len: int) -> list[int]:
    """BOS, then seq_len - 1 ids drawn uniformly (Python's random.Random(seed)) from the ids that
    are not special tokens."""
    spec = ARCHS[arch]
    lo, hi = spec["special_range"]
    vocab = spec["config"]["vocab_size"]
    rng = random.Random(seed)
    ordinary = [(0, lo), (hi, vocab)]
    total = sum(b - a for a, b in ordinary)
    toks = [spec["config"]["bos_token_id"]]
    for _ in range(seq_len - 1):
        r = rng.randrange(total)
        for a, b in ordinary:
            if r < b - a:
                toks.append(a + r)
                break
            r -= b - a
    return toks


def rope_inv_freq(cfg: dict) -> list[float]:
    """RoPE inverse frequencies computed here in float64 from config.json, with Meta's Llama 3.1
    scaling when rope_scaling says llama3 (independent of transformers)."""
    d, theta = cfg["head_dim"], cfg["rope_theta"]
    inv = [theta ** (-(2 * i) / d) for i in range(d // 2)]
    rs = cfg.get("rope_scaling")
    if not rs:
        return inv
    factor, lo, hi = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
    orig = rs["original_max_position_embeddings"]
    low_wavelen, high_wavelen = orig / lo, orig / hi
    out = []
    for f in inv:
        wavelen = 2 * math.pi / f
        if wavelen < high_wavelen:
            out.append(f)
        elif wavelen > low_wavelen:
            out.append(f / factor)
        else:
            smooth = (orig / wavelen - lo) / (hi - lo)
            out.append((1 - smooth) * f / factor + smooth * f)
    return out


def write_text_files(out_dir: str, arch: str, layers: int, dtype_save: str) -> dict:
    cfg = config_json(arch, layers, dtype_save)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
        f.write("\n")
    with open(os.path.join(out_dir, "tokenizer.json"), "w", encoding="utf-8") as f:
        json.dump(make_tokenizer_json(arch), f, ensure_ascii=False)
    return cfg


# ---------------------------------------------------------------------------------------------
# Weights and the forward passes (torch).


def write_weights(out_dir, cfg, args, torch, log):
    from safetensors.torch import save_file

    dtype_name, elem = SAVE_DTYPES[args.dtype_save]
    save_dtype = getattr(torch, dtype_name)
    specs = tensor_specs(cfg)
    shards = plan_shards(specs, elem, int(args.shard_gb * (1 << 30)))
    names = shard_names(len(shards))
    for stale in os.listdir(out_dir):
        if stale.endswith(".safetensors") or stale == "model.safetensors.index.json":
            os.remove(os.path.join(out_dir, stale))
    weight_map, total = {}, 0
    gen_device = args.device
    for shard_idx, members in enumerate(shards):
        tensors = {}
        for i in members:
            name, shape, kind = specs[i]
            g = torch.Generator(device=gen_device)
            g.manual_seed(tensor_seed(args.seed, name))
            t = torch.empty(shape, dtype=torch.float32, device=gen_device)
            t.normal_(0.0, 1.0, generator=g)
            if kind == "norm":
                t.mul_(args.norm_std).add_(1.0)
            else:
                t.mul_(args.std)
            tensors[name] = t.to(save_dtype).cpu().contiguous()
            weight_map[name] = names[shard_idx]
            total += tensors[name].numel() * elem
            del t
        path = os.path.join(out_dir, names[shard_idx])
        save_file(tensors, path, metadata={"format": "pt"})
        log(f"  wrote {names[shard_idx]} ({len(members)} tensors)")
        del tensors
    if len(names) > 1:
        with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
            f.write("\n")
    return names, total


def load_model(out_dir, dtype, attn, device, torch, log):
    """LlamaForCausalLM built from out_dir/config.json, its parameters copied from the shards."""
    from safetensors.torch import load_file
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig.from_pretrained(out_dir)
    try:
        config._attn_implementation = attn
    except Exception as e:  # noqa: BLE001 - reported, not fatal
        log(f"  could not select attention '{attn}': {e}")
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(old)
    model.eval()
    state = model.state_dict()
    loaded = set()
    files = sorted(f for f in os.listdir(out_dir) if f.endswith(".safetensors"))
    with torch.no_grad():
        for f in files:
            for name, t in load_file(os.path.join(out_dir, f), device=str(device)).items():
                if name not in state:
                    raise SystemExit(f"{f}: tensor {name} is not a parameter of the model")
                dst = model.get_parameter(name)
                if tuple(dst.shape) != tuple(t.shape):
                    raise SystemExit(f"{name}: shape {list(t.shape)} != {list(dst.shape)}")
                dst.copy_(t)
                loaded.add(name)
                del t
    tied = bool(config.tie_word_embeddings)
    missing = set(state) - loaded
    if tied:
        missing.discard("lm_head.weight")
        if model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr():
            with torch.no_grad():
                model.lm_head.weight.copy_(model.model.embed_tokens.weight)
            log("  lm_head was not tied to the embedding by transformers: copied it")
    if missing:
        raise SystemExit(f"tensors missing from the checkpoint: {sorted(missing)[:8]}")
    return model, config


def check_rope(model, cfg, torch) -> dict:
    want = rope_inv_freq(cfg)
    rot = getattr(model.model, "rotary_emb", None)
    if rot is None or not hasattr(rot, "inv_freq"):
        return {"checked": False, "why": "no model.model.rotary_emb.inv_freq in this transformers"}
    got = rot.inv_freq.double().cpu().tolist()
    scale = getattr(rot, "attention_scaling", 1.0)
    worst = max(abs(a - b) / b for a, b in zip(got, want))
    if len(got) != len(want) or worst > 1e-5 or abs(float(scale) - 1.0) > 1e-12:
        raise SystemExit(
            f"transformers' RoPE differs from the Llama 3 formula: max rel {worst:.3g}, "
            f"attention_scaling {scale}"
        )
    return {"checked": True, "max_rel_diff": worst, "inv_freq_dtype": str(rot.inv_freq.dtype)}


def row_errors(x, ref, torch) -> dict:
    """Per-row relative errors of x against ref ([P, V] float32 tensors)."""
    x, ref = x.double(), ref.double()
    d = x - ref
    rel_l2 = (d.norm(dim=-1) / ref.norm(dim=-1)).tolist()
    rel_max = (d.abs().amax(dim=-1) / ref.abs().amax(dim=-1)).tolist()
    top1 = (x.argmax(dim=-1) == ref.argmax(dim=-1)).double().mean().item()
    return {
        "rel_l2_max": max(rel_l2),
        "rel_l2_mean": sum(rel_l2) / len(rel_l2),
        "rel_maxabs_max": max(rel_max),
        "top1_agreement": top1,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", choices=sorted(ARCHS), default="llama3-8b")
    ap.add_argument("--layers", type=int, default=None, help="layers (default: the architecture's)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype-save", choices=sorted(SAVE_DTYPES), default="bf16",
                    help="dtype of the saved weights; the reference computes in float32 from them")
    ap.add_argument("--out-dir", default=None,
                    help="checkpoint + reference directory (default /tmp/switchyard-ref-ARCH-LLAYERS)")
    ap.add_argument("--seq-len", type=int, default=100)
    ap.add_argument("--full-positions", default="0,1,-4,-3,-2,-1",
                    help="positions whose full logit rows go to ref_logits.f32 (negative: from the end)")
    ap.add_argument("--topk", type=int, default=64)
    ap.add_argument("--std", type=float, default=0.02, help="std of the matrices and the embedding")
    ap.add_argument("--norm-std", type=float, default=0.1, help="RMSNorm weights are 1 + NORM_STD * normal")
    ap.add_argument("--shard-gb", type=float, default=4.0, help="largest shard, GiB")
    ap.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    ap.add_argument("--reuse-weights", action="store_true",
                    help="keep the weights already in --out-dir if ref_logits.json there names the "
                         "same arch/layers/seed/dtype/std/norm-std")
    ap.add_argument("--no-bf16-check", action="store_true", help="skip the transformers bf16 comparison")
    ap.add_argument("--copy-to", default=None,
                    help="also copy ref_logits.json, ref_logits.f32 and config.json to this directory")
    args = ap.parse_args()

    t_start = time.time()

    def log(msg):
        print(f"[{time.time() - t_start:7.1f}s] {msg}", flush=True)

    import numpy as np
    import torch
    import transformers

    spec = ARCHS[args.arch]
    layers = args.layers or spec["config"]["num_hidden_layers"]
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    out_dir = args.out_dir or f"/tmp/switchyard-ref-{args.arch}-L{layers}"
    os.makedirs(out_dir, exist_ok=True)
    if args.seq_len < 2:
        raise SystemExit("--seq-len must be at least 2")
    positions = resolve_positions(args.full_positions, args.seq_len)
    if not positions:
        raise SystemExit("--full-positions names no position")

    # float32 means float32: no TF32 in matrix products or convolutions.
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")

    gen_params = {
        "arch": args.arch,
        "layers": layers,
        "seed": args.seed,
        "dtype_save": args.dtype_save,
        "std": args.std,
        "norm_std": args.norm_std,
    }
    timings = {}
    cfg = write_text_files(out_dir, args.arch, layers, args.dtype_save)
    reuse = False
    prev_path = os.path.join(out_dir, "ref_logits.json")
    if args.reuse_weights and os.path.exists(prev_path):
        with open(prev_path) as f:
            prev = json.load(f)
        reuse = prev.get("weights", {}).get("generation") == gen_params
        log("reusing the weights in " + out_dir if reuse else "weights differ: regenerating")
    t0 = time.time()
    if reuse:
        shards = sorted(f for f in os.listdir(out_dir) if f.endswith(".safetensors"))
        total_bytes = sum(os.path.getsize(os.path.join(out_dir, f)) for f in shards)
    else:
        log(f"writing {args.arch} ({layers} layers, {args.dtype_save}, seed {args.seed}) to {out_dir}")
        shards, total_bytes = write_weights(out_dir, cfg, args, torch, log)
    timings["write_weights_s"] = time.time() - t0

    # The tokenizer must load with the tokenizers library the Rust crate wraps.
    tok_check = None
    try:
        from tokenizers import Tokenizer

        tk = Tokenizer.from_file(os.path.join(out_dir, "tokenizer.json"))
        bos = cfg["bos_token_id"]
        enc = tk.encode("héllo wörld", add_special_tokens=False).ids
        tok_check = {
            "vocab_size": tk.get_vocab_size(with_added_tokens=True),
            "bos_text": tk.id_to_token(bos),
            "roundtrip": tk.decode(enc) == "héllo wörld",
        }
        if tok_check["vocab_size"] != cfg["vocab_size"] or not tok_check["roundtrip"]:
            raise SystemExit(f"tokenizer.json check failed: {tok_check}")
    except ImportError:
        log("tokenizers not installed: tokenizer.json not checked")

    tokens = make_tokens(args.arch, args.seed, args.seq_len)
    ids = torch.tensor([tokens], dtype=torch.long, device=args.device)

    log("float32 reference forward (transformers, eager attention, TF32 off)")
    t0 = time.time()
    model, hf_cfg = load_model(out_dir, torch.float32, "eager", args.device, torch, log)
    rope = check_rope(model, cfg, torch)
    attn_used = getattr(model.config, "_attn_implementation", None)
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=False).logits[0].float()
    if not torch.isfinite(logits).all():
        raise SystemExit("non-finite float32 logits: lower --std")
    timings["f32_forward_s"] = time.time() - t0
    del model
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()

    top_v, top_i = torch.topk(logits, args.topk, dim=-1)
    full = logits[positions].contiguous().cpu().numpy().astype("<f4")
    full.tofile(os.path.join(out_dir, "ref_logits.f32"))
    lse = torch.logsumexp(logits.double(), dim=-1)
    stats = [
        {
            "position": p,
            "argmax": int(logits[p].argmax()),
            "max_abs": float(logits[p].abs().max()),
            "rms": float(logits[p].double().pow(2).mean().sqrt()),
            "logsumexp": float(lse[p]),
        }
        for p in positions
    ]

    bf16 = None
    if not args.no_bf16_check:
        log("bf16 comparison (transformers, sdpa attention)")
        t0 = time.time()
        model, _ = load_model(out_dir, torch.bfloat16, "sdpa", args.device, torch, log)
        with torch.no_grad():
            lb = model(input_ids=ids, use_cache=False).logits[0].float()
        bf16 = row_errors(lb, logits, torch)
        bf16["attn_implementation"] = getattr(model.config, "_attn_implementation", None)
        bf16["positions"] = "all"
        del model, lb
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
        timings["bf16_check_s"] = time.time() - t0
        log(f"  bf16 vs float32: rel L2 max {bf16['rel_l2_max']:.3e}, "
            f"rel max-abs max {bf16['rel_maxabs_max']:.3e}, top-1 {bf16['top1_agreement']:.3f}")

    device_name = torch.cuda.get_device_name(0) if args.device.startswith("cuda") else "cpu"
    result = {
        "format": FORMAT,
        "arch": args.arch,
        "config": cfg,
        "weights": {
            "generation": gen_params,
            "files": shards,
            "bytes": total_bytes,
            "init": "per tensor: torch.Generator(device=%s).manual_seed(tensor_seed) then normal_(0,1) "
                    "in float32; matrices * std, norms 1 + norm_std * x; rounded to dtype_save"
                    % args.device,
        },
        "tokens": tokens,
        "seq_len": args.seq_len,
        "logits_file": "ref_logits.f32",
        "logits_dtype": "float32-le",
        "full_positions": positions,
        "full_shape": [len(positions), cfg["vocab_size"]],
        "topk": args.topk,
        "top_ids": top_i.cpu().tolist(),
        "top_logits": top_v.cpu().tolist(),
        "full_stats": stats,
        "rope": {"inv_freq": rope_inv_freq(cfg), "transformers_check": rope},
        "hf_bf16_vs_ref": bf16,
        "tokenizer_check": tok_check,
        "reference": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "numpy": np.__version__,
            "device": device_name,
            "dtype": "float32 (TF32 off)",
            "attn_implementation": attn_used,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        },
        "timings_s": timings,
    }
    with open(os.path.join(out_dir, "ref_logits.json"), "w") as f:
        json.dump(result, f)
        f.write("\n")
    if args.copy_to:
        os.makedirs(args.copy_to, exist_ok=True)
        for name in ("ref_logits.json", "ref_logits.f32", "config.json"):
            shutil.copy(os.path.join(out_dir, name), os.path.join(args.copy_to, name))
    log(f"done: {out_dir}/ref_logits.json, ref_logits.f32 ({len(positions)} x {cfg['vocab_size']})")
    for s in stats:
        log(f"  pos {s['position']:4d}: argmax {s['argmax']:6d}  max|x| {s['max_abs']:.3f}  "
            f"rms {s['rms']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
