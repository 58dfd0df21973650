#!/usr/bin/env python3
"""Golden values for the GGUF block types Switchyard dequantizes (gpu/src/model/quant_blocks.rs):
random blocks of Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K and Q6_K dequantized by the `gguf` Python package
(llama.cpp's gguf-py, an independent implementation of the same formats), written to
gpu/tests/fixtures/kquant_golden.json.

Each block's bytes are random except its f16 scales, which are drawn as finite values of a
realistic size (random bytes there would give infinities and NaNs). The fixture holds, per type,
the blocks' bytes (hex) and the f32 values gguf-py produces for them.

    pip install gguf numpy   # gguf 0.19 tested
    python3 gpu/reference/make_kquant_golden.py
"""

import json
import pathlib

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import GGML_QUANT_SIZES
from gguf.quants import dequantize

BLOCKS = 6
rng = np.random.default_rng(20261201)


def f16(x):
    return np.float16(x).tobytes()


def block(ty):
    _, size = GGML_QUANT_SIZES[ty]
    b = bytearray(rng.integers(0, 256, size, dtype=np.uint8).tobytes())
    scale = lambda: f16(rng.uniform(-0.02, 0.02))  # noqa: E731
    if ty in (T.Q5_0,):
        b[0:2] = scale()
    elif ty in (T.Q5_1,):
        b[0:2] = scale()
        b[2:4] = scale()
    elif ty in (T.Q4_K, T.Q5_K):
        b[0:2] = f16(rng.uniform(0, 0.002))
        b[2:4] = f16(rng.uniform(0, 0.002))
    elif ty == T.Q6_K or ty == T.Q3_K:
        b[size - 2:size] = f16(rng.uniform(-0.002, 0.002))
    elif ty == T.Q2_K:
        b[size - 4:size - 2] = f16(rng.uniform(0, 0.002))
        b[size - 2:size] = f16(rng.uniform(0, 0.002))
    return bytes(b)


out = {}
for ty in (T.Q5_0, T.Q5_1, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K):
    raw = b"".join(block(ty) for _ in range(BLOCKS))
    values = dequantize(np.frombuffer(raw, dtype=np.uint8), ty).astype(np.float32)
    assert np.isfinite(values).all()
    out[ty.name] = {"hex": raw.hex(), "values": [float(v) for v in values]}

path = pathlib.Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "kquant_golden.json"
path.write_text(json.dumps(out, indent=0) + "\n")
print(f"{path}: " + ", ".join(f"{k} {len(v['values'])} values" for k, v in out.items()))
