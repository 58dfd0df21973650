#!/usr/bin/env python3
"""Where the CUDA backend's error against a float32 reference comes from: a numpy Llama forward
pass (Llama-3-8B widths, random weights drawn like ref_logits.py's: normal std 0.02, RMSNorm
weights 1 + 0.1 normal, all rounded to bf16) run in float32, then again with values rounded to
bf16 at the points where the CUDA backend stores bf16 activations:

  xn   the RMS-normalised inputs of the QKV, gate|up and lm_head products
  q    the queries after RoPE
  kv   the keys after RoPE and the values (the paged cache)
  att  the attention output (input of the o projection)
  gu   the gate|up product's output (bf16 in the cuBLAS path)
  act  silu(gate) * up (input of the down projection)

The residual stream, QKV outputs, softmax and accumulations stay float32 (as on the GPU: f32
accumulation, P as a hi + lo bf16 pair). Prints the relative L2 error of the logits (per
position, worst and mean, as the CUDA test `llama3_8b_shape_matches_transformers_float32`
reports it) with every rounding on, with each one left out, and with each one alone.

usage: bf16_budget.py [LAYERS] (default 4; 8 layers need about 12 GB of memory)
Needs: numpy.
"""

import math
import sys
import time

import numpy as np

L = int(sys.argv[1]) if len(sys.argv) > 1 else 4
T = 100
H, FF, V, NH, NKV, HD = 4096, 14336, 128256, 32, 8, 128
rng = np.random.default_rng(7)


def bf16(x):
    """Round float32 to the nearest bfloat16 (ties to even), kept as float32."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000).astype(np.uint32).view(np.float32)


def weight(shape, std=0.02):
    return bf16(rng.standard_normal(shape, dtype=np.float32) * std)


def norm_weight():
    return bf16(1 + 0.1 * rng.standard_normal(H, dtype=np.float32))


t0 = time.time()
embed, head, final_norm = weight((V, H)), weight((V, H)), norm_weight()
layers = [
    dict(an=norm_weight(), fn=norm_weight(), qkv=weight(((NH + 2 * NKV) * HD, H)),
         o=weight((H, NH * HD)), gu=weight((2 * FF, H)), d=weight((H, FF)))
    for _ in range(L)
]
print(f"{L} layers of random weights in {time.time() - t0:.0f} s", flush=True)
tokens = np.concatenate([[128000], rng.integers(0, V, T - 1)])

# Llama 3 RoPE frequencies (theta 500000, factor 8, low/high frequency factors 1 and 4, 8192).
inv = 1.0 / (500000.0 ** (np.arange(0, HD, 2, dtype=np.float64) / HD))
wavelen = 2 * math.pi / inv
smooth = (8192 / wavelen - 1.0) / (4.0 - 1.0)
inv = np.where(wavelen < 8192 / 4.0, inv,
               np.where(wavelen > 8192 / 1.0, inv / 8.0, (1 - smooth) * inv / 8.0 + smooth * inv))
angle = np.arange(T)[:, None] * inv[None, :]
cos, sin = np.cos(angle).astype(np.float32), np.sin(angle).astype(np.float32)


def rope(x):
    """Rotate halves (Hugging Face layout); x is [T, heads, HD]."""
    a, b = x[..., :HD // 2], x[..., HD // 2:]
    c, s = cos[:, None, :], sin[:, None, :]
    return np.concatenate([a * c - b * s, b * c + a * s], axis=-1)


def rms(x, w):
    return (x / np.sqrt((x.astype(np.float64) ** 2).mean(-1, keepdims=True) + 1e-5)).astype(np.float32) * w


def forward(rounded):
    r = lambda name, x: bf16(x) if name in rounded else x
    x = embed[tokens].astype(np.float32)
    causal = np.triu(np.full((T, T), -np.inf, dtype=np.float32), 1)
    for ly in layers:
        xn = r("xn", rms(x, ly["an"]))
        qkv = xn @ ly["qkv"].T
        q = r("q", rope(qkv[:, :NH * HD].reshape(T, NH, HD)))
        k = r("kv", rope(qkv[:, NH * HD:(NH + NKV) * HD].reshape(T, NKV, HD)))
        v = r("kv", qkv[:, (NH + NKV) * HD:].reshape(T, NKV, HD))
        k, v = np.repeat(k, NH // NKV, axis=1), np.repeat(v, NH // NKV, axis=1)
        s = np.einsum("thd,shd->hts", q, k) / math.sqrt(HD) + causal
        p = np.exp(s - s.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        att = r("att", np.einsum("hts,shd->thd", p, v).reshape(T, NH * HD))
        x = x + att @ ly["o"].T
        xn = r("xn", rms(x, ly["fn"]))
        gu = r("gu", xn @ ly["gu"].T)
        act = r("act", gu[:, :FF] / (1 + np.exp(-gu[:, :FF])) * gu[:, FF:])
        x = x + act @ ly["d"].T
    return r("xn", rms(x, final_norm)) @ head.T


reference = forward(set())
points = {"xn", "q", "kv", "att", "gu", "act"}
variants = [("every rounding", points)]
variants += [(f"all but {n}", points - {n}) for n in sorted(points)]
variants += [(f"only {n}", {n}) for n in sorted(points)]
print(f"relative L2 of the logits against float32, {T} positions "
      "(worst / mean / positions 0 and 1; top-1 agreement)")
for name, rounded in variants:
    out = forward(rounded)
    e = np.linalg.norm(out - reference, axis=-1) / np.linalg.norm(reference, axis=-1)
    top = (out.argmax(-1) == reference.argmax(-1)).mean()
    print(f"  {name:16} worst {e.max():.2e}  mean {e.mean():.2e}  "
          f"positions 0-1 {e[0]:.1e} {e[1]:.1e}  top-1 {top:.2f}", flush=True)
