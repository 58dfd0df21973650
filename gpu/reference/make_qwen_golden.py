#!/usr/bin/env python3
"""Golden reference for the Qwen2, Qwen3 and Phi-3 architectures (--arch): a tiny random model,
as a Hugging Face checkpoint directory and as a GGUF file, with float32 logits from Hugging Face
transformers. Qwen3 is Qwen2 without the QKV biases and with an RMSNorm over each query and key
head (q_norm, k_norm) before RoPE. Phi-3 is Llama with Q, K and V in one matrix (qkv_proj) and
gate and up in another (gate_up_proj), and LongRoPE: each rotary frequency divided by a factor
of its own, from `short_factor` while the sequence is within the pre-training context
(`original_max_position_embeddings`, 16 here) and `long_factor` past it, cos and sin times
sqrt(1 + ln(64 / 16) / ln(16)). transformers picks the list per forward pass by the sequence's
length: the 24-token reference uses the long factors, and `logits_short` (the first 12
positions, run on their own) the short ones; Phi-3's greedy continuations cross the switch
inside `generate`, so there are none (`generations` is empty). The GGUF file is written as
llama.cpp's converter writes Phi-3 (`attn_qkv`, `ffn_up` holding gate then up, the factors as
`rope_factors_short.weight` / `rope_factors_long.weight`, `rope.scaling.original_context_length`
and `rope.scaling.attn_factor`).

The script
  1. builds a byte-level BPE tokenizer in Qwen2's form with the `tokenizers` library (the Qwen2
     normalizer (NFC) and pre-tokenizer regex, which splits every number into single digits, then
     ByteLevel without
     its own regex), over a small vocabulary: the 256 byte symbols, a few merges chosen so that
     the Qwen2 split changes the ids (no "123" token can form), filler tokens, and ChatML's
     special tokens; it encodes a few strings with it: the tokenization reference;
  2. draws random weights for a `Qwen2ForCausalLM` (or `Qwen3ForCausalLM`) of 2 layers (hidden
     64, 4 heads of 16 dimensions (Qwen3: 32) over 2 KV heads, Qwen2's QKV biases or Qwen3's head norms, an
     untied output head, RoPE base 1e6), rounds every value to one that bf16 and f16 both hold
     exactly, and writes the checkpoint directory (config.json, model.safetensors in bf16,
     tokenizer.json, tokenizer_config.json with a ChatML template);
  3. writes the same model as `tiny-qwen2.gguf` (`tiny-qwen3.gguf`) with the `gguf` package the
     way llama.cpp's converter writes it (architecture "qwen2" or "qwen3", F16 tensors, Q and K
     rows as Hugging Face has them: llama.cpp rotates both in the NeoX layout, so it does not
     permute them; Qwen2's biases as `blk.N.attn_{q,k,v}.bias`, Qwen3's norms as
     `blk.N.attn_{q,k}_norm.weight` and its head size as `attention.key_length`; tokenizer
     "gpt2" with pre "qwen2", which Qwen3 shares);
  4. runs the checkpoint through transformers in float32 (eager attention) over a fixed token
     sequence and writes every position's logits, and continues a few prompts greedily, keeping
     the two whose continuations vary most.

With `--rope yarn` the model stretches its rotary embedding with YaRN (factor 4 over an original
context of 16 tokens, so the 24-token sequence runs past it; transformers multiplies cos and sin
by YaRN's attention factor), written as transformers writes it into config.json and as llama.cpp's
converter writes it into GGUF (`rope.scaling.type` yarn, `.factor`, `.original_context_length`);
the outputs are named `{arch}-yarn`.

With `--partial F` (Phi-3 only) each head rotates only its first int(16 F) dimensions
(transformers' `partial_rotary_factor`, Phi-4-mini's 0.75; LongRoPE's lists cut to that many
pairs), written into config.json and as GGUF's `rope.dimension_count`; the outputs are named
`{arch}-partial`.

With `--window N` (Phi-3 only) every layer attends over the last N positions (transformers'
`sliding_window`: a query at position p sees keys p - N + 1 ..= p), written into config.json and
as GGUF's `attention.sliding_window`; the outputs are named `{arch}-swa` (the 24-token sequence
runs far past a window of 7).

Output (in --out, default gpu/tests/fixtures): the directory above as qwen2/ (qwen3/),
tiny-qwen2.gguf (tiny-qwen3.gguf) beside it (a directory holding one GGUF file loads as that
file), and qwen2_golden.json (qwen3_golden.json)
{format, reference, tokens, logits [[f32 x vocab] per position], tokenization [{text, ids}],
generations [{prompt, prompt_ids, tokens, text, min_margin}]: greedy continuations by
transformers' `generate`, with the smallest top-1 / top-2 logit margin of their steps}.
Nothing here uses Switchyard's code or output.

Needs: torch, transformers (5.17 tested), tokenizers, safetensors, numpy, gguf (0.19 tested).
Runs on a CPU in seconds.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import inspect
import json
import math
import os

GENERATED = 8
SEED = 20261202
ROPE_THETA = 1000000.0
# YaRN (--rope yarn): Qwen's documented form, at a scale the test sequence runs past.
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}
# Phi-3 (--arch phi3): LongRoPE over an original context of 16 stretched to 64, so the 24-token
# sequence runs past it; factors distinct per frequency, as Phi-3.5's are.
PHI3_ORIGINAL = 16
PHI3_CONTEXT = 64
PHI3_LONGROPE = {
    "rope_type": "longrope",
    "short_factor": [1.0, 1.02, 1.05, 1.1, 1.18, 1.3, 1.45, 1.6],
    "long_factor": [1.0, 1.3, 1.9, 2.8, 4.1, 6.0, 8.5, 12.0],
}
VOCAB = 320
SPECIALS = {317: "<|endoftext|>", 318: "<|im_start|>", 319: "<|im_end|>"}
# llama.cpp's LLAMA_VOCAB_PRE_TYPE_QWEN2 and Qwen2's tokenizer.json: Llama 3's split with single
# digits (\p{N}, not \p{N}{1,3}).
QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
MERGES = [
    ("1", "2"), ("12", "3"), ("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("Ġ", "Ġ"), ("i", "n"),
    ("Ġ", "in"), ("'", "s"), ("Ċ", "Ċ"), ("Ġ", "w"), ("o", "r"), ("Ġw", "or"), ("l", "d"),
    ("Ġwor", "ld"), ("a", "p"), ("ap", "p"), ("l", "e"), ("app", "le"), ("Ġ", "1"),
]
TEXTS = [
    "12345 apples",
    "the theory in 2024!\n\n  x",
    "it's  the WORLD's world",
    "ünïcödé 123 ١٢٣",
    "\t\n hello\n\n\nworld  ",
    # Decomposed: Qwen2's tokenizer composes it to NFC first.
    "cafe\u0301 un\u0303o",
]
# Prompts whose greedy continuations are tried; the two with the most different tokens (and no
# step closer than MIN_MARGIN between its top two logits) are kept.
PROMPTS = TEXTS[:3] + [
    "The quick brown fox",
    "what is the weather in Paris?",
    "hello world, 1 2 3",
    "zebra quantum 42 !?",
]
MIN_MARGIN = 0.05  # 10x the CPU path's largest logit error on these models (4.8e-3)
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content']"
    " + '<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def bytes_to_unicode() -> list[str]:
    """GPT-2's byte symbols, indexed by byte value."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    table = dict(zip(bs, cs))
    return [chr(table[b]) for b in range(256)]


def vocabulary() -> list[str]:
    tokens = bytes_to_unicode()
    for a, b in MERGES:
        tokens.append(a + b)
    while len(tokens) < min(SPECIALS):
        tokens.append(f"<|filler_{len(tokens)}|>")
    tokens += [SPECIALS[i] for i in sorted(SPECIALS)]
    assert len(tokens) == VOCAB and len(set(tokens)) == VOCAB
    return tokens


def build_tokenizer(tokens: list[str]):
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=MERGES, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    from tokenizers import AddedToken

    tok.add_special_tokens([AddedToken(SPECIALS[i], special=True, normalized=False) for i in sorted(SPECIALS)])
    for i, t in SPECIALS.items():
        assert tok.token_to_id(t) == i
    return tok


def representable(t, torch):
    """`t` rounded to bf16, with magnitudes below f16's normal range set to 0: values that bf16
    and f16 both hold exactly."""
    r = t.to(torch.bfloat16).to(torch.float32)
    r[r.abs() < 2.0**-14] = 0.0
    assert torch.equal(r.to(torch.float16).to(torch.float32), r)
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures"))
    ap.add_argument("--arch", choices=["qwen2", "qwen3", "phi3"], default="qwen2")
    ap.add_argument("--rope", choices=["default", "yarn"], default="default")
    ap.add_argument("--window", type=int, default=None, help="sliding window (phi3 only)")
    ap.add_argument("--partial", type=float, default=None, help="partial rotary factor (phi3 only)")
    args = ap.parse_args()
    arch = args.arch
    if (args.window is not None or args.partial is not None) and arch != "phi3":
        raise SystemExit("--window and --partial need --arch phi3")
    head_dim = 16
    rotary = int(head_dim * args.partial) if args.partial is not None else head_dim
    rotary_pairs = rotary // 2
    longrope = {
        k: (v[: rotary // 2] if isinstance(v, list) else v) for k, v in PHI3_LONGROPE.items()
    }
    # The outputs' name.
    tag = arch if args.rope == "default" else f"{arch}-{args.rope}"
    if args.window is not None:
        tag += "-swa"
    if args.partial is not None:
        tag += "-partial"
    hf = os.path.join(args.out, tag)
    os.makedirs(hf, exist_ok=True)

    import gguf
    import numpy as np
    import torch
    import transformers

    tokens = vocabulary()
    tok = build_tokenizer(tokens)
    tok.save(os.path.join(hf, "tokenizer.json"))
    tokenization = [{"text": t, "ids": tok.encode(t, add_special_tokens=False).ids} for t in TEXTS]
    # The split matters: with Llama 3's \p{N}{1,3}, "123" would merge into one token.
    assert tokenization[0]["ids"][:5] == [ord(c) for c in "12345"], tokenization[0]

    if arch == "qwen2":
        from transformers import Qwen2Config as Config, Qwen2ForCausalLM as Model

        extra = {}
    elif arch == "phi3":
        from transformers import Phi3Config as Config, Phi3ForCausalLM as Model

        extra = {
            "original_max_position_embeddings": PHI3_ORIGINAL,
            "pad_token_id": 319,
            "sliding_window": args.window,
        }

    else:
        from transformers import Qwen3Config as Config, Qwen3ForCausalLM as Model

        # Heads of 32 over a residual stream of 64: the query width (128) is not the stream's,
        # as in Qwen3-0.6B (16 x 128 over 1024).
        extra = {"head_dim": 32, "attention_bias": False}
    extra["rope_theta"] = ROPE_THETA
    if arch == "phi3":
        del extra["rope_theta"]
        extra["rope_parameters"] = dict(longrope, rope_theta=ROPE_THETA)
        if args.partial is not None:
            # transformers 5 reads it from the rope parameters (earlier ones: top level).
            extra["rope_parameters"]["partial_rotary_factor"] = args.partial
    if args.rope == "yarn":
        if "rope_parameters" in inspect.signature(Config.__init__).parameters:
            # transformers 5: the base and the scaling in one object.
            del extra["rope_theta"]
            extra["rope_parameters"] = dict(YARN, rope_theta=ROPE_THETA)
        else:
            extra["rope_scaling"] = dict(YARN)
    config = Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=PHI3_CONTEXT if arch == "phi3" else 512,
        rms_norm_eps=1e-6,
        # Untied (as Qwen2.5-7B): with a tied head, a random model's residual stream is mostly
        # its input's embedding and greedy decoding repeats the last token.
        tie_word_embeddings=False,
        **({} if arch == "phi3" else {"use_sliding_window": False}),
        hidden_act="silu",
        bos_token_id=317,
        eos_token_id=319,
        **extra,
    )
    def random_model(seed: int):
        torch.manual_seed(seed)
        model = Model._from_config(config, attn_implementation="eager").to(torch.float32)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(("q_norm.weight", "k_norm.weight")):
                    # Spread out, so that each dimension's weight shows.
                    v = 1.0 + 0.3 * torch.randn_like(p)
                elif name.endswith("norm.weight"):
                    v = 1.0 + 0.1 * torch.randn_like(p)
                elif name.endswith("bias"):
                    v = 0.5 * torch.randn_like(p)
                elif "embed_tokens" in name or "lm_head" in name:
                    v = 0.5 * torch.randn_like(p)
                else:
                    v = 0.1 * torch.randn_like(p)
                p.copy_(representable(v, torch))
        model.eval()
        assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
        rotary = model.model.rotary_emb
        if arch == "phi3":
            assert rotary.rope_type == "longrope", rotary.rope_type
            assert model.model.rotary_emb.inv_freq.numel() == rotary_pairs, model.model.rotary_emb.inv_freq.shape
            want = math.sqrt(1 + math.log(PHI3_CONTEXT / PHI3_ORIGINAL) / math.log(PHI3_ORIGINAL))
            assert abs(rotary.attention_scaling - want) < 1e-6, rotary.attention_scaling
        else:
            assert getattr(rotary, "rope_type", args.rope) == args.rope, rotary.rope_type
        if args.rope == "yarn":
            # transformers multiplies cos and sin by YaRN's attention factor.
            assert abs(rotary.attention_scaling - (0.1 * math.log(YARN["factor"]) + 1)) < 1e-6
        return model

    def continuations(model):
        """Greedy continuations (transformers' generate, KV cache on), with each step's top-1 /
        top-2 margin; the two most varied usable ones, or None."""
        generations = []
        for text in PROMPTS:
            prompt = tok.encode(text, add_special_tokens=False).ids
            with torch.no_grad():
                full = model.generate(
                    torch.tensor([prompt]), max_new_tokens=GENERATED, do_sample=False,
                    eos_token_id=319, pad_token_id=319,
                )[0].tolist()
                new = full[len(prompt):]
                steps = model(torch.tensor([full[:-1]])).logits[0, len(prompt) - 1:]
            top2 = steps.topk(2).values
            generations.append({
                "prompt": text,
                "prompt_ids": prompt,
                "tokens": new,
                "text": tok.decode(new, skip_special_tokens=True),
                "min_margin": float((top2[:, 0] - top2[:, 1]).min()),
            })
        for g in generations:
            print(repr(g["prompt"]), "->", g["tokens"], "min margin", round(g["min_margin"], 3))
        usable = [g for g in generations if g["min_margin"] >= MIN_MARGIN and "\ufffd" not in g["text"]]
        usable.sort(key=lambda g: -len(set(g["tokens"])))
        usable = [g for g in usable if len(set(g["tokens"])) > 1][:2]
        return usable if len(usable) == 2 else None

    # The first seed (from SEED on) whose model continues two prompts usably: clear margins,
    # whole characters (a random model may stop inside a character's bytes).
    for seed in range(SEED, SEED + 16):
        model = random_model(seed)
        if arch == "phi3":
            # LongRoPE switches factors inside generate (see above): no continuations.
            generations = []
            break
        generations = continuations(model)
        if generations:
            break
    else:
        raise SystemExit("no seed gave two usable continuations")

    # The checkpoint directory, bf16 (exact: every value is representable). Written from a
    # copy: `.to(bfloat16)` also rounds the rotary embedding's inverse frequencies (a buffer),
    # which converting back would not undo, and the reference runs with the exact ones.
    copy.deepcopy(model).to(torch.bfloat16).save_pretrained(hf, safe_serialization=True)
    with open(os.path.join(hf, "tokenizer_config.json"), "w") as f:
        json.dump(
            {
                "bos_token": None,
                "eos_token": "<|im_end|>",
                "chat_template": CHAT_TEMPLATE,
                "tokenizer_class": "Qwen2Tokenizer",
            },
            f,
            indent=1,
        )

    # The GGUF file, as llama.cpp's converter writes the architecture.
    w = gguf.GGUFWriter(os.path.join(args.out, f"tiny-{tag}.gguf"), arch)
    w.add_name(f"tiny-{tag}")
    w.add_context_length(config.max_position_embeddings)
    w.add_embedding_length(config.hidden_size)
    w.add_block_count(config.num_hidden_layers)
    w.add_feed_forward_length(config.intermediate_size)
    w.add_head_count(config.num_attention_heads)
    w.add_head_count_kv(config.num_key_value_heads)
    if arch == "qwen3":
        w.add_key_length(config.head_dim)
        w.add_value_length(config.head_dim)
    w.add_rope_freq_base(ROPE_THETA)
    if arch == "phi3":
        # llama.cpp's Phi3MiniModel: the rotary dimensions, the original context and the
        # attention factor; the factors are tensors (below).
        w.add_rope_dimension_count(rotary)
        w.add_rope_scaling_orig_ctx_len(PHI3_ORIGINAL)
        w.add_rope_scaling_attn_factors(
            math.sqrt(1 + math.log(PHI3_CONTEXT / PHI3_ORIGINAL) / math.log(PHI3_ORIGINAL))
        )
        w.add_sliding_window(args.window or 0)
    if args.rope == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(YARN["factor"])
        w.add_rope_scaling_orig_ctx_len(YARN["original_max_position_embeddings"])
    w.add_layer_norm_rms_eps(config.rms_norm_eps)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL if i in SPECIALS else gguf.TokenType.NORMAL for i in range(VOCAB)])
    w.add_token_merges([f"{a} {b}" for a, b in MERGES])
    w.add_bos_token_id(317)
    w.add_eos_token_id(319)
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)
    names = {
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "self_attn.q_norm": "attn_q_norm",
        "self_attn.k_norm": "attn_k_norm",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
        # Phi-3's fused projections keep their fusion in llama.cpp's files.
        "self_attn.qkv_proj": "attn_qkv",
        "mlp.gate_up_proj": "ffn_up",
        "input_layernorm": "attn_norm",
        "post_attention_layernorm": "ffn_norm",
    }
    for name, p in model.state_dict().items():
        if name == "lm_head.weight":
            out = "output.weight"
        elif name == "model.embed_tokens.weight":
            out = "token_embd.weight"
        elif name == "model.norm.weight":
            out = "output_norm.weight"
        else:
            _, _, layer, rest = name.split(".", 3)
            module, kind = rest.rsplit(".", 1)
            out = f"blk.{layer}.{names[module]}.{kind}"
        arr = p.detach().to(torch.float32).numpy()
        # llama.cpp keeps norms and biases in f32, matrices in the file type.
        if arr.ndim == 2:
            arr = arr.astype(np.float16)
        w.add_tensor(out, arr)
    if arch == "phi3":
        w.add_tensor("rope_factors_long.weight", np.array(longrope["long_factor"], dtype=np.float32))
        w.add_tensor("rope_factors_short.weight", np.array(longrope["short_factor"], dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    # The reference logits, float32.
    g = torch.Generator().manual_seed(SEED + 1)
    ids = torch.randint(0, min(SPECIALS), (24,), generator=g).tolist()
    torch.backends.cuda.matmul.allow_tf32 = False
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].to(torch.float32)
        # Within the pre-training context on its own: LongRoPE's short factors.
        short = model(torch.tensor([ids[:12]])).logits[0].to(torch.float32)
    out = {
        "format": f"switchyard-{tag}-golden/1",
        "reference": {
            "transformers": transformers.__version__,
            "torch": torch.__version__,
            "gguf": getattr(gguf, "__version__", "?"),
            "device": "cpu",
            "date": datetime.date.today().isoformat(),
            "seed": seed,
        },
        "tokens": ids,
        "logits": [[float(f"{x:.7g}") for x in row] for row in logits.tolist()],
        **(
            {"logits_short": [[float(f"{x:.7g}") for x in row] for row in short.tolist()]}
            if arch == "phi3"
            else {}
        ),
        "tokenization": tokenization,
        "generations": generations,
    }
    with open(os.path.join(args.out, f"{tag}_golden.json"), "w") as f:
        json.dump(out, f)
    top = logits.max(-1)
    print("argmax", top.indices.tolist())
    print("logit std", float(logits.std()), "top1-top2 min margin",
          float((logits.topk(2).values[:, 0] - logits.topk(2).values[:, 1]).min()))
    for t in tokenization:
        print(repr(t["text"]), t["ids"])
    for g in generations:
        print(repr(g["prompt"]), "->", g["tokens"], repr(g["text"]), "min margin", g["min_margin"])
    print("wrote", sorted(os.listdir(args.out)), sorted(os.listdir(hf)))


if __name__ == "__main__":
    main()
