#!/usr/bin/env python3
"""Requantize a Llama GGUF into one of llama.cpp's K-quant mixes with ggml's own quantizer.

Switchyard reads K-quant GGUF files (Q2_K .. Q6_K, with Q5_0 / Q5_1 / Q4_0 / Q8_0 where a row is
not a multiple of 256 values). The decoders are checked block by block against gguf-py
(make_kquant_golden.py); this script makes a whole model file of such tensors, quantized by
ggml's `ggml_quantize_chunk` (the function `llama-quantize` calls), so the engine can be checked
end to end against an independent reference (transformers reading the same file: make_golden.py
--model OUT --any-model) and benchmarked against the file it came from.

Each 2-D weight is dequantized with gguf-py and quantized again with ggml; the type of each
tensor follows llama.cpp's `llama_tensor_get_type` for the mix without an importance matrix,
simplified to the Llama tensors:

  mix      most weights   attn_v / ffn_down (more bits on 1/8 + 1/8 + every third layer)   output
  q4_k_m   Q4_K           Q6_K / Q4_K                                                    Q6_K
  q5_k_m   Q5_K           Q6_K / Q5_K                                                    Q6_K
  q3_k_m   Q3_K           Q5_K in the first layers, then Q4_K (attn_output Q4_K)         Q6_K
  q2_k     Q2_K           Q3_K (attn_v), Q3_K (ffn_down)                                 Q6_K
  q8_0     Q8_0 everywhere (a baseline)

`--random LAYERS:HIDDEN:FFN:HEADS:KV_HEADS` replaces the weights by random ones (normal, std
0.02; norms 1) of that shape, keeping the source's tokenizer and the rest of its metadata: a
larger model for CPU benchmarks of the K-quant kernels (e.g. 24:2048:8192:32:32, SmolLM2-1.7B's
shape, with the 135M model's vocabulary).

`--mix f32` writes gguf-py's dequantization of every tensor as F32 instead: run on a K-quant
file, it gives the engine the same weights decoded by someone else.

A tensor whose rows are not a multiple of 256 values takes llama.cpp's fallback: Q2_K and Q3_K
-> Q4_0, Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0. With tied embeddings the token embedding is
the output. Norm vectors stay F32.

ggml's quantizer is C: build its base library from a ggml checkout (github.com/ggml-org/ggml):

  cd ggml && for f in ggml.c ggml-alloc.c ggml-quants.c; do gcc -O2 -fPIC -c -Iinclude -Isrc src/$f -o $f.o; done
  for f in ggml.cpp ggml-backend.cpp ggml-backend-meta.cpp ggml-opt.cpp ggml-threading.cpp gguf.cpp; do
    g++ -O2 -fPIC -std=c++17 -c -DGGML_VERSION='"x"' -DGGML_COMMIT='"x"' -Iinclude -Isrc src/$f -o $f.o; done
  g++ -shared -o libggml-base.so *.o -lpthread -lm

Needs: numpy, gguf (gguf-py 0.19 tested).

  python3 make_kquant_model.py --src SmolLM2-135M-Instruct.Q4_1.gguf --mix q4_k_m \\
      --ggml-lib ggml/libggml-base.so --out SmolLM2-135M-Instruct.Q4_K_M.gguf
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import hashlib
import sys

import numpy as np
import gguf
from gguf import GGMLQuantizationType as T

# ggml's `enum ggml_type` values are the GGUF tensor type numbers.
FALLBACK = {T.Q2_K: T.Q4_0, T.Q3_K: T.Q4_0, T.Q4_K: T.Q5_0, T.Q5_K: T.Q5_1, T.Q6_K: T.Q8_0}
FILE_TYPE = {"q4_k_m": 15, "q5_k_m": 17, "q3_k_m": 12, "q2_k": 10, "q8_0": 7, "f32": 0}


def use_more_bits(i: int, n: int) -> bool:
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def choose(mix: str, name: str, layer: int | None, n_layers: int, is_output: bool) -> T:
    if mix == "q8_0":
        return T.Q8_0
    if is_output:
        return T.Q6_K
    kind = name.split(".")[-2] if layer is not None else name.split(".")[0]
    if mix == "q4_k_m":
        if kind in ("attn_v", "ffn_down") and use_more_bits(layer, n_layers):
            return T.Q6_K
        return T.Q4_K
    if mix == "q5_k_m":
        if kind in ("attn_v", "ffn_down") and use_more_bits(layer, n_layers):
            return T.Q6_K
        return T.Q5_K
    if mix == "q3_k_m":
        if kind == "attn_v":
            return T.Q5_K if layer < 2 else T.Q4_K
        if kind == "ffn_down":
            return T.Q5_K if layer < n_layers // 16 else T.Q4_K
        if kind == "attn_output":
            return T.Q4_K
        return T.Q3_K
    if mix == "q2_k":
        if kind in ("attn_v", "ffn_down"):
            return T.Q3_K
        return T.Q2_K
    raise ValueError(mix)


def field_value(field: gguf.ReaderField):
    return field.contents()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--src", required=True, help="source GGUF (any types gguf-py dequantizes)")
    ap.add_argument("--out", required=True, help="GGUF file to write")
    ap.add_argument("--mix", choices=sorted(FILE_TYPE), default="q4_k_m")
    ap.add_argument("--random", help="LAYERS:HIDDEN:FFN:HEADS:KV_HEADS of random weights")
    ap.add_argument("--seed", type=int, default=0, help="seed of --random")
    ap.add_argument("--ggml-lib", help="path of libggml-base.so (not needed for --mix f32)")
    args = ap.parse_args()

    if args.mix != "f32" and not args.ggml_lib:
        ap.error("--ggml-lib is needed to quantize")
    lib = ctypes.CDLL(args.ggml_lib) if args.ggml_lib else None
    if lib is not None:
        lib.ggml_quantize_chunk.restype = ctypes.c_size_t
        lib.ggml_quantize_chunk.argtypes = [
            ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
            ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
        ]

    reader = gguf.GGUFReader(args.src)
    arch = field_value(reader.fields["general.architecture"])
    n_layers = int(field_value(reader.fields[f"{arch}.block_count"]))
    names = {t.name for t in reader.tensors}
    tied = "output.weight" not in names
    tensors = [(t.name, [int(d) for d in reversed(t.shape)], t) for t in reader.tensors]
    overrides = {}
    if args.random:
        layers, hidden, ffn, heads, kv = (int(v) for v in args.random.split(":"))
        head_dim = hidden // heads
        vocab = int(field_value(reader.fields[f"{arch}.vocab_size"]))
        overrides = {
            f"{arch}.block_count": layers,
            f"{arch}.embedding_length": hidden,
            f"{arch}.feed_forward_length": ffn,
            f"{arch}.attention.head_count": heads,
            f"{arch}.attention.head_count_kv": kv,
            f"{arch}.rope.dimension_count": head_dim,
        }
        n_layers = layers
        shapes = {
            "attn_norm.weight": [hidden], "ffn_norm.weight": [hidden],
            "attn_q.weight": [hidden, hidden], "attn_k.weight": [kv * head_dim, hidden],
            "attn_v.weight": [kv * head_dim, hidden], "attn_output.weight": [hidden, hidden],
            "ffn_gate.weight": [ffn, hidden], "ffn_up.weight": [ffn, hidden],
            "ffn_down.weight": [hidden, ffn],
        }
        tensors = [("token_embd.weight", [vocab, hidden], None), ("output_norm.weight", [hidden], None)]
        if not tied:
            tensors.append(("output.weight", [vocab, hidden], None))
        for i in range(layers):
            tensors += [(f"blk.{i}.{k}", v, None) for k, v in shapes.items()]
    rng = np.random.default_rng(args.seed)

    writer = gguf.GGUFWriter(args.out, arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value = overrides.get(key, field_value(field))
        if key == "general.file_type":
            value = FILE_TYPE[args.mix]
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, value, vtype, sub)

    counts: collections.Counter[str] = collections.Counter()
    for name, shape, t in tensors:  # shapes rows first
        if t is not None:
            values = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        elif len(shape) == 1:
            values = np.ones(shape, dtype=np.float32)
        else:
            values = rng.normal(0.0, 0.02, size=shape).astype(np.float32)
        if len(shape) != 2:
            writer.add_tensor(name, values.reshape(shape))
            counts["F32"] += 1
            continue
        if args.mix == "f32":
            writer.add_tensor(name, values.reshape(shape))
            counts["F32"] += 1
            continue
        parts = name.split(".")
        layer = int(parts[1]) if parts[0] == "blk" else None
        is_output = name == "output.weight" or (tied and name == "token_embd.weight")
        qtype = choose(args.mix, name, layer, n_layers, is_output)
        rows, cols = shape
        block_len, _ = gguf.GGML_QUANT_SIZES[qtype]
        if cols % block_len != 0:
            qtype = FALLBACK[qtype]
        block_len, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
        src = np.ascontiguousarray(values.reshape(rows, cols))
        dst = np.zeros((rows, cols // block_len * block_bytes), dtype=np.uint8)
        written = lib.ggml_quantize_chunk(
            int(qtype), src.ctypes.data, dst.ctypes.data, 0, rows, cols, None
        )
        if written != dst.size:
            print(f"{name}: ggml wrote {written} bytes, expected {dst.size}", file=sys.stderr)
            return 1
        writer.add_tensor(name, dst, raw_shape=dst.shape, raw_dtype=qtype)
        counts[qtype.name] += 1

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file(progress=False)
    writer.close()
    digest = hashlib.sha256(open(args.out, "rb").read()).hexdigest()
    print(f"{args.out}: {dict(sorted(counts.items()))}, sha256 {digest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
