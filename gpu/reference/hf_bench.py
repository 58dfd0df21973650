#!/usr/bin/env python3
"""Hugging Face transformers baselines for the shapes Switchyard's CUDA backend is benchmarked on.

Random weights (transformers' own initialisation), bfloat16, sdpa attention, generate() with
cache_implementation="static" (which transformers compiles with torch.compile, mode
"reduce-overhead", for the decode steps), greedy, no end-of-sequence token, so every sequence
produces exactly the requested number of tokens.

Parts (--only, comma-separated; default all):
  smollm2   SmolLM2-135M shape: decode ms/step at batch 1 and batch 256, aggregate tok/s
  llama8b   Llama-3-8B shape (Llama 3.1 RoPE scaling): decode ms/step at batch 1 and batch 64
  offline   Llama-3-8B shape: 2000 prompts x 128 input / 128 output tokens through generate() in
            batches of --offline-batch (padded to a full batch at the end), output tok/s; when
            the whole set would run past --offline-cap-s, the batches measured so far are
            extrapolated to the whole set (the JSON and the summary say so)

Decode ms/step: a StoppingCriteria records a CUDA event after every generated token, so each
decode step's time is the event-to-event interval on the GPU stream, host work of generate()
included (generate() waits for every step). Per run, the median over the decode steps (the first
--skip-steps steps after the prefill left out); the figure reported is the median over --runs runs,
after --warmup runs that compile and capture the CUDA graphs. Prompts are --prompt-len random
tokens; each run generates --new-tokens tokens (a static cache of prompt + new tokens).

Output: a JSON file (--out) rewritten after each measurement, and a summary on stdout with the
reference figures measured on the project's H200 (DESIGN.md) beside the new ones.

Needs: torch, transformers (5.17 tested) on a CUDA GPU.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import os
import statistics
import sys
import time

SHAPES = {
    "smollm2": {
        "name": "SmolLM2-135M",
        "vocab_size": 49152,
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": True,
        "rope_theta": 100000.0,
        "rope_scaling": None,
    },
    "llama8b": {
        "name": "Llama-3-8B",
        "vocab_size": 128256,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    },
}

# HF transformers 5.17, compiled static cache, random weights, on the project's H200
# (../shared/DESIGN.md, "GPU notes"): decode ms/step.
KNOWN = {
    ("smollm2", 1): 3.52,
    ("smollm2", 256): 7.08,
    ("llama8b", 1): 9.45,
    ("llama8b", 64): 17.9,
}

PARTS = ("smollm2", "llama8b", "offline")


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def build_model(key: str, torch, transformers):
    from transformers import LlamaConfig, LlamaForCausalLM

    s = dict(SHAPES[key])
    name = s.pop("name")
    theta, scaling = s.pop("rope_theta"), s.pop("rope_scaling")
    kw = dict(
        s,
        hidden_act="silu",
        attention_bias=False,
        mlp_bias=False,
        bos_token_id=None,
        eos_token_id=None,  # never stop early: every run makes exactly --new-tokens tokens
        pad_token_id=0,
    )
    if int(transformers.__version__.split(".")[0]) >= 5:
        kw["rope_parameters"] = {"rope_type": "default", **(scaling or {}), "rope_theta": theta}
    else:
        kw["rope_theta"] = theta
        kw["rope_scaling"] = scaling
    config = LlamaConfig(**kw)
    try:
        config._attn_implementation = "sdpa"
    except Exception as e:  # noqa: BLE001 - sdpa is transformers' default anyway
        log(f"could not select sdpa explicitly: {e!r}")
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(old)
    model.eval()
    model.requires_grad_(False)
    gen = model.generation_config
    gen.eos_token_id = None
    gen.bos_token_id = None
    gen.pad_token_id = 0
    params = sum(p.numel() for p in model.parameters())
    attn = getattr(model.config, "_attn_implementation", None)
    log(f"{name}: {params / 1e9:.3f} B parameters, bf16, attention {attn}")
    return model, {"name": name, "parameters": params, "attn_implementation": attn}


def dynamo_graphs(torch):
    try:
        from torch._dynamo.utils import counters

        return int(counters["stats"]["unique_graphs"])
    except Exception:  # noqa: BLE001 - best effort
        return None


class Bench:
    def __init__(self, args, torch, transformers):
        self.args = args
        self.torch = torch
        self.transformers = transformers
        self.warmed = set()  # (id(model), batch, cache length) already compiled and captured
        self.explicit_compile = set()
        from transformers import StoppingCriteria

        outer = self

        class StepEvents(StoppingCriteria):
            """Records a CUDA event after each generated token; never stops generation."""

            def __init__(self):
                self.events = []

            def __call__(self, input_ids, scores, **kwargs):
                e = outer.torch.cuda.Event(enable_timing=True)
                e.record()
                self.events.append(e)
                return outer.torch.zeros(
                    input_ids.shape[0], dtype=outer.torch.bool, device=input_ids.device
                )

        self.StepEvents = StepEvents

    def forget_models(self):
        self.warmed.clear()
        self.explicit_compile.clear()

    def generate(self, model, ids, new_tokens, recorder=None):
        torch = self.torch
        from transformers import StoppingCriteriaList

        kwargs = dict(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            do_sample=False,
            cache_implementation="static",
            pad_token_id=0,
        )
        if recorder is not None:
            kwargs["stopping_criteria"] = StoppingCriteriaList([recorder])
        out = model.generate(**kwargs)  # generate() runs under torch.no_grad()
        if out.shape != (ids.shape[0], ids.shape[1] + new_tokens):
            raise RuntimeError(f"generate returned shape {tuple(out.shape)}")
        return out

    def warm(self, model, ids, new_tokens, runs) -> dict:
        """Runs generate `runs` times for this shape so that it is compiled and its CUDA graphs
        captured (one call already replays them from its third decode step on)."""
        torch = self.torch
        key = (id(model), ids.shape[0], ids.shape[1] + new_tokens)
        if key in self.warmed:
            return {"warmup_s": 0.0, "compiled_graphs": None, "reused": True}
        g0 = dynamo_graphs(torch)
        t0 = time.time()
        for _ in range(runs):
            self.generate(model, ids, new_tokens)
        torch.cuda.synchronize()
        g1 = dynamo_graphs(torch)
        compiled = None if g0 is None or g1 is None else g1 - g0
        if compiled == 0 and id(model) not in self.explicit_compile and not any(
            k[0] == id(model) for k in self.warmed
        ):
            # generate() did not compile (an older transformers): compile the forward as the
            # "static cache + torch.compile" recipe of transformers' docs does, and warm again.
            log("  generate() compiled nothing: wrapping model.forward in torch.compile")
            model.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
            self.explicit_compile.add(id(model))
            for _ in range(runs):
                self.generate(model, ids, new_tokens)
            torch.cuda.synchronize()
            g2 = dynamo_graphs(torch)
            compiled = None if g2 is None else g2 - g0
        self.warmed.add(key)
        return {"warmup_s": time.time() - t0, "compiled_graphs": compiled, "reused": False}

    def decode(self, key: str, model, batch: int) -> dict:
        torch, a = self.torch, self.args
        vocab = SHAPES[key]["vocab_size"]
        g = torch.Generator(device="cuda").manual_seed(1234 + batch)
        ids = torch.randint(0, vocab, (batch, a.prompt_len), device="cuda", generator=g)
        log(f"{SHAPES[key]['name']} batch {batch}: warming up (compile + graph capture)")
        warm = self.warm(model, ids, a.new_tokens, a.warmup)
        run_medians, run_means, prefill, total = [], [], [], []
        for _ in range(a.runs):
            rec = self.StepEvents()
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            self.generate(model, ids, a.new_tokens, rec)
            end.record()
            torch.cuda.synchronize()
            ev = rec.events
            steps = [ev[i - 1].elapsed_time(ev[i]) for i in range(1 + a.skip_steps, len(ev))]
            if not steps:
                raise RuntimeError("no decode steps measured: raise --new-tokens")
            run_medians.append(statistics.median(steps))
            run_means.append(statistics.fmean(steps))
            prefill.append(start.elapsed_time(ev[0]))
            total.append(start.elapsed_time(end))
        ms = statistics.median(run_medians)
        res = {
            "batch": batch,
            "prompt_len": a.prompt_len,
            "new_tokens": a.new_tokens,
            "runs": a.runs,
            "steps_per_run": len(steps),
            "decode_ms_per_step": ms,
            "decode_ms_run_medians": run_medians,
            "decode_ms_run_means": run_means,
            "decode_tok_s": batch * 1000.0 / ms,
            "prefill_ms_median": statistics.median(prefill),
            "generate_ms_median": statistics.median(total),
            "generate_ms_per_token": statistics.median(total) / a.new_tokens,
            **warm,
        }
        known = KNOWN.get((key, batch))
        if known is not None:
            res["known_reference_ms"] = known
            res["ratio_to_known"] = ms / known
        log(f"  {ms:.3f} ms/step (runs {', '.join(f'{x:.3f}' for x in run_medians)}), "
            f"{res['decode_tok_s']:.0f} tok/s, prefill {res['prefill_ms_median']:.1f} ms")
        return res

    def offline(self, model) -> dict:
        torch, a = self.torch, self.args
        vocab = SHAPES["llama8b"]["vocab_size"]
        n, lin, lout = a.offline_prompts, a.offline_in, a.offline_out
        g = torch.Generator(device="cuda").manual_seed(4321)
        prompts = torch.randint(0, vocab, (n, lin), device="cuda", generator=g)
        batch = min(a.offline_batch, n)
        while True:
            try:
                log(f"offline: batch {batch}, warming up")
                warm = self.warm(model, prompts[:batch], lout, 1)
                break
            except torch.OutOfMemoryError:
                gc.collect()
                torch.cuda.empty_cache()
                if batch <= 1:
                    raise
                batch = max(1, batch // 2)
                log(f"  out of memory: trying batch {batch}")
        n_batches = math.ceil(n / batch)
        times = []
        t_all = time.time()
        for b in range(n_batches):
            chunk = prompts[b * batch:(b + 1) * batch]
            if chunk.shape[0] < batch:  # pad the last batch to the compiled batch size
                chunk = torch.cat([chunk, prompts[: batch - chunk.shape[0]]])
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            self.generate(model, chunk, lout)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
            mean = statistics.fmean(times)
            left = n_batches - len(times)
            log(f"  batch {len(times)}/{n_batches}: {times[-1]:.2f} s")
            if left and time.time() - t_all + mean * left > a.offline_cap_s:
                break
        measured = len(times)
        extrapolated = measured < n_batches
        total_s = sum(times) + (n_batches - measured) * statistics.fmean(times)
        out_tokens = n * lout
        res = {
            "prompts": n,
            "input_len": lin,
            "output_len": lout,
            "batch": batch,
            "batches": n_batches,
            "batches_measured": measured,
            "batch_s": times,
            "extrapolated": extrapolated,
            "total_s": total_s,
            "output_tok_s": out_tokens / total_s,
            "total_tok_s": n * (lin + lout) / total_s,
            "padded_last_batch": n % batch != 0,
            **warm,
        }
        note = f" (extrapolated from {measured} of {n_batches} batches)" if extrapolated else ""
        log(f"  offline: {res['output_tok_s']:.0f} output tok/s, {total_s:.1f} s{note}")
        return res


def summary(results: dict) -> str:
    lines = ["", "HF transformers baselines (bf16, sdpa, static cache + torch.compile, random weights)"]
    for key in ("smollm2", "llama8b"):
        for name, r in results.get(key, {}).items():
            if not name.startswith("bs"):
                continue
            known = r.get("known_reference_ms")
            kn = f"  (DESIGN.md: {known} ms, ratio {r['ratio_to_known']:.2f})" if known else ""
            lines.append(
                f"  {SHAPES[key]['name']:13s} batch {r['batch']:4d}: {r['decode_ms_per_step']:8.3f} ms/step "
                f"{r['decode_tok_s']:10.0f} tok/s; whole generate() "
                f"{r['generate_ms_per_token']:.3f} ms/token{kn}"
            )
    o = results.get("offline")
    if o:
        ex = (f"  EXTRAPOLATED from {o['batches_measured']}/{o['batches']} batches"
              if o["extrapolated"] else "")
        lines.append(
            f"  Llama-3-8B offline {o['prompts']} x {o['input_len']}/{o['output_len']} "
            f"(batch {o['batch']}): {o['output_tok_s']:.0f} output tok/s, {o['total_s']:.1f} s{ex}"
        )
    for part, err in results.get("errors", {}).items():
        lines.append(f"  {part}: FAILED: {err}")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default=",".join(PARTS), help="comma-separated parts: " + ",".join(PARTS))
    ap.add_argument("--quick", action="store_true",
                    help="3 runs, offline batch 64 (reuses the batch-64 graph) capped at 20 s")
    ap.add_argument("--out", default="hf_bench.json", help="JSON output path")
    ap.add_argument("--smollm2-batches", default="1,256")
    ap.add_argument("--llama8b-batches", default="1,64")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--runs", type=int, default=None, help="measured runs per point (default 5, quick 3)")
    ap.add_argument("--warmup", type=int, default=2,
                    help="warm-up generate() calls per new decode shape (offline: 1 call)")
    ap.add_argument("--skip-steps", type=int, default=2, help="decode steps left out after the prefill")
    ap.add_argument("--offline-prompts", type=int, default=2000)
    ap.add_argument("--offline-in", type=int, default=128)
    ap.add_argument("--offline-out", type=int, default=128)
    ap.add_argument("--offline-batch", type=int, default=None, help="default 500, quick 64")
    ap.add_argument("--offline-cap-s", type=float, default=None,
                    help="time cap for the measured offline batches (default 180, quick 20)")
    args = ap.parse_args()
    parts = [p.strip() for p in args.only.split(",") if p.strip()]
    for p in parts:
        if p not in PARTS:
            raise SystemExit(f"--only: unknown part '{p}' (choose from {', '.join(PARTS)})")
    if args.runs is None:
        args.runs = 3 if args.quick else 5
    if args.offline_batch is None:
        args.offline_batch = 64 if args.quick else 500
    if args.offline_cap_s is None:
        args.offline_cap_s = 20.0 if args.quick else 180.0

    import torch
    import transformers

    if not torch.cuda.is_available():
        raise SystemExit("hf_bench.py needs a CUDA GPU")
    # Several models and shapes recompile the same forward: allow it.
    for name, value in (("recompile_limit", 64), ("cache_size_limit", 64),
                        ("accumulated_recompile_limit", 512), ("accumulated_cache_size_limit", 512)):
        try:
            setattr(torch._dynamo.config, name, value)
        except Exception:  # noqa: BLE001 - the name differs between torch versions
            pass

    out = {
        "tool": "gpu/reference/hf_bench.py",
        "method": "generate(), bf16, sdpa, cache_implementation=static (torch.compile), greedy, "
                  "random weights; decode ms/step = median over runs of the per-run median "
                  "event-to-event step time",
        "quick": args.quick,
        "args": vars(args),
        "reference": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "cuda": torch.version.cuda,
            "device": torch.cuda.get_device_name(0),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        },
        "known_reference_ms": {f"{k}_bs{b}": v for (k, b), v in KNOWN.items()},
        "results": {},
    }

    def save():
        d = os.path.dirname(os.path.abspath(args.out))
        os.makedirs(d, exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
            f.write("\n")

    bench = Bench(args, torch, transformers)
    res = out["results"]
    errors = {}

    def batches(s):
        return [int(x) for x in s.split(",") if x.strip()]

    if "smollm2" in parts:
        model, info = build_model("smollm2", torch, transformers)
        res["smollm2"] = {"model": info}
        for b in batches(args.smollm2_batches):
            try:
                res["smollm2"][f"bs{b}"] = bench.decode("smollm2", model, b)
            except Exception as e:  # noqa: BLE001 - recorded, the other parts still run
                errors[f"smollm2_bs{b}"] = repr(e)
                log(f"  FAILED: {e!r}")
            save()
        del model
        gc.collect()
        torch.cuda.empty_cache()
        torch._dynamo.reset()
        bench.forget_models()  # id() of a freed model can be reused

    if "llama8b" in parts or "offline" in parts:
        model, info = build_model("llama8b", torch, transformers)
        if "llama8b" in parts:
            res["llama8b"] = {"model": info}
            for b in batches(args.llama8b_batches):
                try:
                    res["llama8b"][f"bs{b}"] = bench.decode("llama8b", model, b)
                except Exception as e:  # noqa: BLE001
                    errors[f"llama8b_bs{b}"] = repr(e)
                    log(f"  FAILED: {e!r}")
                save()
        if "offline" in parts:
            try:
                res["offline"] = bench.offline(model)
            except Exception as e:  # noqa: BLE001
                errors["offline"] = repr(e)
                log(f"  FAILED: {e!r}")
            save()

    if errors:
        res["errors"] = errors
    save()
    print(summary(res))
    print(f"\nJSON: {args.out}")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
