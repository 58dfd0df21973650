//! `switchyard calibrate`: runs the engine a server's configuration describes over a sweep of
//! batch shapes (prefills of several lengths, alone and batched, chunked and past cached
//! prefixes; decodes at several batch sizes and contexts; decodes joined by prefills),
//! records each step's shape and the backend's time for it, and fits the simulator's
//! calibrated cost model ([`switchyard_simulator::calibrate`]) to them. With `--lora DIR` the
//! sweep adds steps whose every sequence runs that adapter, loaded as 1, 2 or 4 distinct
//! adapters, so that the fit can tell the cost per adapted token from the cost per adapter.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use anyhow::Context;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};
use switchyard_actors::{CoreEvent, EngineCore, SubmitOptions};
use switchyard_config::{AsyncSchedulingMode, BackendKind};
use switchyard_gpu::backend::SamplingParams;
use switchyard_gpu::model::ChatTemplate;
use switchyard_gpu::LoraAdapter;
use switchyard_policies::{SamplingLimits, SchedulerConfig, StepShape, Timestamp};
use switchyard_simulator::calibrate::{self, Fit, Sample};
use switchyard_simulator::cost::Calibration;
use switchyard_simulator::slo_params::{self, SloAwareParams};

use super::runtime;
use crate::cli::CalibrateArgs;

/// Largest samples file read.
const MAX_SAMPLES_FILE: u64 = 256 << 20;
/// Most runs of the sweep.
const MAX_REPEATS: usize = 100;
/// Tokens each decode measurement generates per sequence.
const DECODE_STEPS: usize = 8;
/// Most distinct adapters of a `--lora` measurement (the copies of the adapter loaded).
const LORA_COPIES: usize = 4;

/// The measured steps and the engine they were measured on, as `--samples` writes them.
#[derive(Debug, Serialize, Deserialize)]
#[serde(
    deny_unknown_fields,
    expecting = "an object of the measured steps (model, hardware, ..., samples)"
)]
struct SamplesFile {
    /// The model.
    model: String,
    /// The backend, as it names itself.
    hardware: String,
    /// The engine's KV blocks.
    num_gpu_blocks: usize,
    /// Tokens per block.
    block_size: usize,
    /// Median host time per step (planning and applying outputs in the calling thread, as
    /// `EngineCore::step` reports them; without the server's actor hand-offs), microseconds.
    host_overhead_us: f64,
    /// Runs of the sweep the samples' times are medians of.
    repeats: usize,
    /// The engine's most sequences per step.
    #[serde(default)]
    max_num_seqs: Option<usize>,
    /// The engine's most tokens per step.
    #[serde(default)]
    max_num_batched_tokens: Option<usize>,
    /// The adapter of `--lora` (its directory, rank and projections), when steps ran it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    lora: Option<String>,
    /// The median time to load the adapter of `--lora` from its directory, in milliseconds
    /// (its loads through the server's loader, `LoraAdapter::load`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    lora_load_ms: Option<f64>,
    /// The chat template and tokenizer's time on this machine: (prompt tokens, median
    /// microseconds) per prompt length timed (none with `--dummy`, nor in files written
    /// before it was measured).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    front_end: Vec<(usize, f64)>,
    /// One per distinct step shape.
    samples: Vec<Sample>,
}

pub fn run(args: CalibrateArgs) -> anyhow::Result<()> {
    // Where the results go is checked before minutes of measuring.
    super::writable(&args.output)?;
    let samples_path = args
        .samples
        .clone()
        .unwrap_or_else(|| args.output.with_extension("steps.json"));
    let measured = match &args.from_samples {
        Some(path) => read_samples(path)?,
        None => {
            super::writable(&samples_path)?;
            let m = measure(&args)?;
            // Written before the fit, so that no measurement is lost to a failed one.
            let json = serde_json::to_string_pretty(&m)?;
            std::fs::write(&samples_path, json + "\n")
                .with_context(|| format!("cannot write {}", samples_path.display()))?;
            eprintln!(
                "wrote the measured steps to {} (refit them with --from-samples)",
                samples_path.display()
            );
            m
        }
    };
    let fit = calibrate::fit(&measured.samples).with_context(|| match &args.from_samples {
        Some(path) => format!("fitting the step times of {}", path.display()),
        None => "fitting the step times".to_string(),
    })?;
    let front_end = switchyard_simulator::front_end::fit(&measured.front_end);
    let calibration = Calibration {
        model: Some(measured.model.clone()),
        hardware: Some(measured.hardware.clone()),
        num_gpu_blocks: Some(measured.num_gpu_blocks),
        block_size: Some(measured.block_size),
        host_overhead_us: Some((measured.host_overhead_us * 10.0).round() / 10.0),
        front_end_us: front_end.map(|f| (f.fixed_us * 10.0).round() / 10.0),
        front_end_per_token_us: front_end.map(|f| (f.per_token_us * 1e3).round() / 1e3),
        max_context: Some(calibrate::longest_context(&measured.samples)).filter(|&c| c > 0),
        lora_load_ms: measured.lora_load_ms.map(|ms| (ms * 1e3).round() / 1e3),
        ..fit.calibration.clone()
    };
    // An old samples file without the engine's limit: the reference step of 32 sequences.
    let decode_seqs = measured.max_num_seqs.unwrap_or(usize::MAX);
    let slo_aware = SloAwareParams::from_calibration(&calibration, decode_seqs);
    let calibration = Calibration {
        slo_aware: Some(slo_aware),
        ..calibration
    };
    calibration
        .validate()
        .map_err(|why| anyhow::anyhow!("the fitted model is not usable: {why}"))?;
    print!("{}", report(&measured, &fit, &calibration));
    let spread = slo_aware_spread(&measured.samples, &calibration, decode_seqs);
    let median = fit.abs_error_quantile(0.5);
    if median > POOR_FIT {
        eprintln!(
            "warning: the linear model misses these steps by {:.0}% at the median: the \
             simulator's times will be as far off (a noisy machine, or an engine whose step time \
             is not linear in its work)",
            100.0 * median
        );
    }
    let limits = match (measured.max_num_seqs, measured.max_num_batched_tokens) {
        (Some(seqs), Some(tokens)) => format!(
            "# The engine ran at most {seqs} sequences and {tokens} tokens a step: give a spec the \
             same\n# scheduler.max_num_seqs and scheduler.max_num_batched_tokens.\n"
        ),
        _ => String::new(),
    };
    let yaml = format!(
        "# Written by `switchyard calibrate` (switchyard {}): {} steps, each the median\n\
         # of {} run(s); |predicted / measured - 1| median {:.1}%, 90th percentile {:.1}%, worst {:.1}%.\n{limits}{}",
        env!("CARGO_PKG_VERSION"),
        fit.num_samples,
        measured.repeats,
        100.0 * median,
        100.0 * fit.abs_error_quantile(0.9),
        100.0 * fit.abs_error_quantile(1.0),
        serde_yaml::to_string(&calibration)?
    );
    std::fs::write(&args.output, yaml)
        .with_context(|| format!("cannot write {}", args.output.display()))?;
    println!(
        "Wrote {}: use it as `calibration: {}` in a simulator spec. It sets the KV cache to {} \
         blocks and scheduler.host_overhead_us to {:.1} where the spec leaves them out; the \
         spec's cache.block_size must be {}.",
        args.output.display(),
        args.output.display(),
        measured.num_gpu_blocks,
        calibration.host_overhead_us.unwrap_or(0.0),
        measured.block_size,
    );
    if let Some(f) = front_end {
        println!(
            "The chat template and tokenizer took {:.1} us plus {:.3} us per prompt token: the \
             simulator's scheduler.front_end_us and front_end_per_token_us where the spec leaves \
             them out (the server's switchyard:request_front_end_seconds measures the whole way \
             from its receipt of a request to its queue, hops included).",
            f.fixed_us, f.per_token_us
        );
    }
    let reference = slo_params::reference(&calibration);
    // A value of 0 (a rounded-away step cost) has its spread shown as it is, not in percent.
    let within = |value: f64, error: Option<f64>| match error {
        Some(e) if value > 0.0 => format!("{value} (±{:.1}%)", 100.0 * e / value),
        Some(e) => format!("{value} (±{e})"),
        None => value.to_string(),
    };
    println!(
        "The fit implies the slo-aware policy's step_overhead_ms {} (a decode step of {} \
         sequences at {} tokens of context) and prefill_us_per_token {} (the marginal cost of a \
         {}-token prompt chunk joining it){}: the simulator uses them for a slo-aware policy \
         whose params leave them unset; for a server, copy them into scheduler.policy.params \
         (`policy: {{name: slo-aware, params: {{step_overhead_ms: {}, prefill_us_per_token: {}}}}}`).",
        within(slo_aware.step_overhead_ms, spread.map(|s| s.0)),
        slo_params::decode_batch(decode_seqs),
        reference.decode_context,
        within(slo_aware.prefill_us_per_token, spread.map(|s| s.1)),
        reference.prefill_chunk,
        if spread.is_some() {
            format!(
                "; ± the jackknife's standard error over {} refits, each leaving 1/{} of the \
                 steps out",
                calibrate::JACKKNIFE_GROUPS,
                calibrate::JACKKNIFE_GROUPS
            )
        } else {
            String::new()
        },
        slo_aware.step_overhead_ms,
        slo_aware.prefill_us_per_token,
    );
    if reference.decode_context < slo_params::DECODE_CONTEXT {
        println!(
            "The steps measured reach {} tokens of context: the reference steps are shortened \
             to that, rounded up to {} tokens (the fit's costs at {} tokens would be an \
             extrapolation); a server whose requests are longer spends more per step.",
            calibration.max_context.unwrap_or(0),
            slo_params::BOUND_ROUNDING,
            slo_params::DECODE_CONTEXT
        );
    }
    if let Some((step, prefill)) = spread {
        for (name, value, error) in [
            ("step_overhead_ms", slo_aware.step_overhead_ms, step),
            (
                "prefill_us_per_token",
                slo_aware.prefill_us_per_token,
                prefill,
            ),
        ] {
            if error > POOR_DETERMINATION * value {
                eprintln!(
                    "warning: the steps measured do not determine {name}: refits leaving a \
                     tenth of them out move it by ±{} (the jackknife's standard error): the \
                     fit cannot tell its terms apart on these shapes (measure a larger \
                     --max-context or --max-kv-tokens, or with more --repeats on a quieter \
                     machine)",
                    if value > 0.0 {
                        format!("{:.0}%", 100.0 * error / value)
                    } else {
                        format!("{error} around 0")
                    }
                );
            }
        }
    }
    if let Some(ms) = calibration.lora_load_ms {
        println!(
            "Loading the --lora adapter from its directory took {ms} ms (the median of \
             {LORA_COPIES} loads, its files in the page cache after the first): the simulator's \
             scheduler.lora_memory.load_ms where the spec leaves it out."
        );
    }
    if let (Some(seqs), Some(tokens)) = (measured.max_num_seqs, measured.max_num_batched_tokens) {
        println!(
            "The engine ran at most {seqs} sequences and {tokens} tokens a step: set the spec's \
             scheduler.max_num_seqs and max_num_batched_tokens to the same."
        );
    }
    Ok(())
}

/// A median error above which the fit is reported as poor.
const POOR_FIT: f64 = 0.25;
/// A standard error, relative to the value, above which a derived `slo-aware` parameter is
/// reported as not determined by the steps measured (a value interpolated from a sweep's
/// steps was within a few percent; one extrapolated far past them, tens of percent).
const POOR_DETERMINATION: f64 = 0.1;

/// The jackknife's standard errors of the `slo-aware` parameters `c` implies
/// (`step_overhead_ms`, `prefill_us_per_token`): each refit of [`calibrate::group_refits`]
/// priced at `c`'s reference steps. `None` when the samples are too few for the refits.
fn slo_aware_spread(
    samples: &[Sample],
    c: &Calibration,
    max_num_seqs: usize,
) -> Option<(f64, f64)> {
    let refits = calibrate::group_refits(samples).ok()?;
    let params: Vec<SloAwareParams> = refits
        .iter()
        .map(|r| {
            let refit = Calibration {
                max_context: c.max_context,
                ..r.calibration.clone()
            };
            SloAwareParams::from_calibration(&refit, max_num_seqs)
        })
        .collect();
    let of = |f: fn(&SloAwareParams) -> f64| {
        calibrate::jackknife_error(&params.iter().map(f).collect::<Vec<_>>())
    };
    Some((of(|p| p.step_overhead_ms), of(|p| p.prefill_us_per_token)))
}

fn read_samples(path: &Path) -> anyhow::Result<SamplesFile> {
    let text = super::bench_serve::read_bounded(path, MAX_SAMPLES_FILE)?;
    // The calibration YAML is the likely wrong file here: name the flag and what it takes.
    let file: SamplesFile = serde_json::from_str(&text).with_context(|| {
        format!(
            "--from-samples {}: not the measured steps that calibrate writes with --samples \
             (JSON, by default beside the calibration as NAME.steps.json)",
            path.display()
        )
    })?;
    anyhow::ensure!(
        file.samples.len() <= calibrate::MAX_SAMPLES,
        "{}: {} samples, at most {} are fitted",
        path.display(),
        file.samples.len(),
        calibrate::MAX_SAMPLES
    );
    Ok(file)
}

/// The fitted coefficients, the fit's error by kind of step, and the host's time.
fn report(m: &SamplesFile, fit: &Fit, c: &Calibration) -> String {
    use std::fmt::Write;
    let mut out = String::new();
    let (lo, hi) = m
        .samples
        .iter()
        .fold((f64::INFINITY, 0.0f64), |(lo, hi), s| {
            (lo.min(s.seconds), hi.max(s.seconds))
        });
    let _ = writeln!(
        out,
        "Measured {} distinct steps (the median of {} run(s) each) on {} with {}: {:.2} ms to {:.1} ms.",
        m.samples.len(),
        m.repeats,
        m.hardware,
        m.model,
        lo * 1e3,
        hi * 1e3
    );
    if let Some(lora) = &m.lora {
        let _ = writeln!(out, "LoRA steps ran {lora}.");
    }
    let _ = writeln!(out, "Step time = the sum of these terms:");
    let lora = m.samples.iter().any(|s| s.shape.lora_tokens > 0);
    let lora_terms = [
        (
            "per_lora_token_s",
            c.per_lora_token_s,
            "per token of an adapted sequence, more",
        ),
        (
            "per_adapter_s",
            c.per_adapter_s,
            "per distinct adapter in the step",
        ),
        (
            "per_lora_step_s",
            c.per_lora_step_s,
            "per step with any adapter",
        ),
    ];
    let terms = [
        ("intercept_s", c.intercept_s, "per step"),
        ("per_token_s", c.per_token_s, "per token fed"),
        (
            "per_prefill_token_s",
            c.per_prefill_token_s,
            "per prompt token, more",
        ),
        (
            "per_decode_seq_s",
            c.per_decode_seq_s,
            "per decoding sequence",
        ),
        (
            "per_sampled_seq_s",
            c.per_sampled_seq_s,
            "per row of logits sampled",
        ),
        (
            "per_kv_token_s",
            c.per_kv_token_s,
            "per token of context read",
        ),
        (
            "per_attention_pair_s",
            c.per_attention_pair_s,
            "per (query, key) pair",
        ),
    ];
    let shown = if lora { &lora_terms[..] } else { &[] };
    for (name, v, what) in terms.iter().chain(shown) {
        let _ = writeln!(out, "  {name:<22} {v:>11.4e}  {what}");
    }
    if let Some(knee) = c.token_knee {
        let _ = writeln!(
            out,
            "  {:<22} {knee:>11}  tokens: a step pays per_token_s on at least these (below, it \
             reads the weights whatever it computes)",
            "token_knee"
        );
    }
    let _ = writeln!(
        out,
        "Fit error |predicted / measured - 1|: median {:.1}%, 90th percentile {:.1}%, worst {:.1}%",
        100.0 * fit.abs_error_quantile(0.5),
        100.0 * fit.abs_error_quantile(0.9),
        100.0 * fit.abs_error_quantile(1.0)
    );
    type Kind = (&'static str, fn(&StepShape) -> bool);
    // Adapted steps apart: their error says how well the LoRA terms price them.
    let kinds: [Kind; 6] = [
        ("prefill steps", |s| {
            s.lora_tokens == 0 && s.num_decode_seqs == 0
        }),
        ("decode steps", |s| {
            s.lora_tokens == 0 && s.num_prefill_tokens == 0
        }),
        ("mixed steps", |s| {
            s.lora_tokens == 0 && s.num_decode_seqs > 0 && s.num_prefill_tokens > 0
        }),
        ("LoRA prefill", |s| {
            s.lora_tokens > 0 && s.num_decode_seqs == 0
        }),
        ("LoRA decode", |s| {
            s.lora_tokens > 0 && s.num_prefill_tokens == 0
        }),
        ("LoRA mixed", |s| {
            s.lora_tokens > 0 && s.num_decode_seqs > 0 && s.num_prefill_tokens > 0
        }),
    ];
    for (name, is) in kinds {
        let mut e: Vec<f64> = m
            .samples
            .iter()
            .zip(&fit.relative_errors)
            .filter(|(s, _)| is(&s.shape))
            .map(|(_, e)| e.abs())
            .collect();
        if e.is_empty() {
            continue;
        }
        e.sort_by(f64::total_cmp);
        let _ = writeln!(
            out,
            "  {name:<14} {:>4}: median {:.1}%, worst {:.1}%",
            e.len(),
            100.0 * e[e.len() / 2],
            100.0 * e[e.len() - 1]
        );
    }
    let _ = writeln!(
        out,
        "Host time per step (the engine's planning and applying outputs in one thread, outside \
         the backend; the server's switchyard:engine_step_overhead_seconds adds its actors' \
         hand-offs, README): median {:.1} us",
        m.host_overhead_us
    );
    out
}

/// A request of a measurement.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Req {
    /// Prompt tokens.
    prompt: usize,
    /// Tokens to generate.
    output: usize,
    /// Its prompt starts with the prompt of this earlier request of the measurement (a
    /// prefix-cache hit).
    extends: Option<usize>,
}

impl Req {
    fn new(prompt: usize, output: usize) -> Self {
        Req {
            prompt,
            output,
            extends: None,
        }
    }
}

/// One measurement: requests submitted together, then (once every one of them has its first
/// token and `later_after` more steps ran, or they all finished) some more, all run to the end.
#[derive(Clone, Debug, PartialEq)]
struct Scenario {
    first: Vec<Req>,
    later: Vec<Req>,
    later_after: usize,
    /// Distinct LoRA adapters its requests run, in turn (0: none).
    adapters: usize,
}

/// The sweep's limits.
#[derive(Clone, Copy, Debug)]
struct Limits {
    /// Longest prompt plus output.
    max_context: usize,
    /// Most context tokens of one measurement, over its sequences.
    max_kv_tokens: usize,
    /// Most sequences per step.
    max_num_seqs: usize,
    /// Most tokens per step.
    max_num_batched_tokens: usize,
}

impl Limits {
    /// Whether the requests of one measurement fit.
    fn fit(&self, reqs: &[Req]) -> bool {
        reqs.iter().all(|r| r.prompt + r.output <= self.max_context)
            && reqs.iter().map(|r| r.prompt + r.output).sum::<usize>() <= self.max_kv_tokens
            && reqs.len() <= self.max_num_seqs
    }

    /// Tokens each of `b` sequences of context `c` generates in a decode measurement: the
    /// prompts take several steps to prefill, and the first to finish theirs decode meanwhile,
    /// so each generates enough to still be running when the last starts.
    fn decode_output(&self, b: usize, c: usize) -> usize {
        DECODE_STEPS + (b * c).div_ceil(self.max_num_batched_tokens.max(1))
    }
}

/// The sweep: prefills alone and batched (long ones chunked by the token budget), prompts
/// extending a cached one, decodes at batch sizes 1, 4, 16, ... at three contexts, and decodes
/// that prefills join. Its lengths are those of a 1,024-token context, shortened to fit a
/// shorter one (batched prompts of 64 and 256 tokens to a quarter and all of it; decode
/// contexts of 32 and 256 to an eighth and a half of the longest), so that a short `--max-context` still
/// measures every kind of step, and decodes at three distinct contexts: at 64 tokens every
/// measurement past 63 tokens was left out, and the decodes' context tokens, at contexts 32
/// and 52 only, were nearly proportional to their sequences, so the fit could not tell the
/// cost of one from the other's.
fn sweep(l: Limits) -> Vec<Scenario> {
    let mut out: Vec<Scenario> = Vec::new();
    let mut push = |first: Vec<Req>, later: Vec<Req>, later_after: usize| {
        let all: Vec<Req> = first.iter().chain(&later).copied().collect();
        let s = Scenario {
            first,
            later,
            later_after,
            adapters: 0,
        };
        // Shortened lengths can make two measurements one.
        if !s.first.is_empty() && l.fit(&all) && !out.contains(&s) {
            out.push(s);
        }
    };
    // The longest prompt of one request that generates one token.
    let longest = l.max_context.saturating_sub(1).max(1);
    let short = 64.min(l.max_context / 4).max(1);
    let long = 256.min(longest);
    // Prefills of one prompt, 16 to the longest context.
    let mut lengths: Vec<usize> = std::iter::successors(Some(16usize), |p| Some(p * 4))
        .take_while(|&p| p < l.max_context)
        .collect();
    // At least three lengths (at a context of 64 tokens or fewer: 16, half and all of it).
    if lengths.len() < 2 {
        lengths.push(l.max_context / 2);
    }
    lengths.push(l.max_context - 1);
    lengths.dedup();
    for &p in &lengths {
        push(vec![Req::new(p, 1)], vec![], 0);
    }
    // Batched prefills.
    for (n, p) in [(4, short), (16, short), (64, short), (4, long), (16, long)] {
        push(vec![Req::new(p, 1); n], vec![], 0);
    }
    // Prompts that extend a cached prompt: few new tokens over a long context (the
    // context a multiple of 16 tokens, the default block size, so that its blocks are cached).
    for c in [256, l.max_context / 2 / 16 * 16] {
        for new in [16, 128.min(l.max_context / 4)] {
            let c = c.min(l.max_context.saturating_sub(new + 1) / 16 * 16);
            if c == 0 {
                continue;
            }
            push(
                vec![Req::new(c, 1)],
                vec![Req {
                    prompt: c + new,
                    output: 1,
                    extends: Some(0),
                }],
                0,
            );
        }
    }
    // Decodes.
    // The longest context leaves room for the tokens generated while the batch is prefilled.
    let prefill_steps = l.max_kv_tokens.div_ceil(l.max_num_batched_tokens.max(1));
    let longest_decode = l.max_context.saturating_sub(DECODE_STEPS + prefill_steps);
    let mut contexts = vec![
        32.min(longest_decode / 8),
        256.min(longest_decode / 2),
        longest_decode,
    ];
    contexts.dedup();
    for c in contexts.into_iter().filter(|&c| c >= 1) {
        let output = |b: usize| l.decode_output(b, c);
        let fits_kv = |b: usize| b * (c + output(b)) <= l.max_kv_tokens;
        let mut most = l.max_num_seqs.min(l.max_kv_tokens / (c + DECODE_STEPS));
        while most > 1 && !fits_kv(most) {
            most -= 1;
        }
        let mut batches: Vec<usize> = std::iter::successors(Some(1usize), |b| Some(b * 4))
            .take_while(|&b| b < most)
            .collect();
        batches.push(most);
        batches.dedup();
        for b in batches.into_iter().filter(|&b| b >= 1) {
            push(vec![Req::new(c, output(b)); b], vec![], 0);
        }
    }
    // Decodes joined by prefills.
    let context = 256.min(l.max_context / 2);
    for b in [4, 16] {
        for p in [short, 512.min(longest)] {
            push(
                vec![Req::new(context, 2 * DECODE_STEPS); b],
                vec![Req::new(p, 1)],
                2,
            );
        }
    }
    out
}

/// The steps of `--lora`: every sequence runs an adapter, the measurement's requests taking 1,
/// 2 or 4 distinct ones in turn (the same steps with another number of adapters tell the
/// per-adapter cost from the per-token one): prefills alone and batched, decodes at batches 1
/// to 16 and a decode joined by a prefill, at a context of 256 or half the longest measured
/// (its length costs what it costs without an adapter). About a third of the default sweep's
/// measurements, shorter ones.
fn lora_sweep(l: Limits) -> Vec<Scenario> {
    let mut out = Vec::new();
    let mut push = |first: Vec<Req>, later: Vec<Req>, later_after: usize, adapters: usize| {
        let all: Vec<Req> = first.iter().chain(&later).copied().collect();
        if l.fit(&all) && adapters <= all.len() {
            out.push(Scenario {
                first,
                later,
                later_after,
                adapters,
            });
        }
    };
    let c = 256.min(l.max_context / 2);
    for p in [c / 4, c] {
        push(vec![Req::new(p, 1)], vec![], 0, 1);
    }
    for n in [1, 2, LORA_COPIES] {
        push(vec![Req::new(c / 4, 1); 4], vec![], 0, n);
        for b in [1, 4, 16] {
            push(vec![Req::new(c, l.decode_output(b, c)); b], vec![], 0, n);
        }
        push(
            vec![Req::new(c, 2 * DECODE_STEPS); 3],
            vec![Req::new(c / 4, 1)],
            2,
            n,
        );
    }
    out
}

/// Loads the configured engine, runs the sweep `repeats` times and returns each distinct step
/// shape with the median of its times.
fn measure(args: &CalibrateArgs) -> anyhow::Result<SamplesFile> {
    anyhow::ensure!(
        (1..=MAX_REPEATS).contains(&args.repeats),
        "--repeats must be 1..={MAX_REPEATS}"
    );
    let config = super::config::load_or_defaults(args.config.as_deref(), &args.overrides)?;
    if let Some(dir) = &args.lora {
        super::config::check_lora_flag(dir, config.lora.max_lora_rank)?;
    }
    let loaded = match &args.dummy {
        Some(_) => None,
        None => Some(runtime::load(&runtime::config_model_path(&config)?)?),
    };
    let (source, model_name) = match (&args.dummy, &loaded) {
        (Some(arch), _) => (
            runtime::ModelSource::Dummy(runtime::preset(arch)?, args.seed),
            format!("{arch} (random weights)"),
        ),
        (None, Some(m)) => (
            runtime::ModelSource::Loaded(&m.config, &m.weights),
            m.name.clone(),
        ),
        (None, None) => anyhow::bail!("no model"),
    };
    let model_config = source.config().clone();
    let block_size = config.cache.block_size;
    let settings = runtime::BackendSettings {
        // The steps timed here copy nothing to or from a host KV tier: none is held.
        host_kv_bytes: 0,
        ..runtime::BackendSettings::from_config(&config)
    };
    let (backend, chosen) = runtime::build_backend(config.model.backend, source, &settings)?;
    // The chat template and tokenizer, timed as the server's tokenizer pool runs them (random
    // weights have neither).
    let front_end = match &loaded {
        None => Vec::new(),
        Some(m) => {
            let own = match &config.model.chat_template {
                Some(file) => Some(
                    ChatTemplate::from_file(
                        &runtime::expand_home(Path::new(file)),
                        m.chat_template.as_ref(),
                        &m.tokenizer,
                    )
                    .with_context(|| format!("model.chat_template `{file}`"))?,
                ),
                None => None,
            };
            let context = model_config.max_position_embeddings;
            super::calibrate_front_end::measure(
                &m.tokenizer,
                own.as_ref().or(m.chat_template.as_ref()),
                config.model.max_model_len.unwrap_or(context).min(context),
            )
            .context("timing the chat template and tokenizer")?
        }
    };
    drop(loaded);
    // The adapter loaded as distinct adapters (each load has its own weights' id), each load
    // timed: the server's LoRA manager loads an adapter with the same `LoraAdapter::load`.
    let mut load_ms = Vec::with_capacity(LORA_COPIES);
    let adapters: Vec<Arc<LoraAdapter>> = match &args.lora {
        None => Vec::new(),
        Some(dir) => {
            anyhow::ensure!(
                backend.lora_slots() >= LORA_COPIES,
                "--lora: the {} backend runs {} LoRA adapters in a step, the sweep {LORA_COPIES}",
                backend.name(),
                backend.lora_slots()
            );
            // Bounded as the server bounds the adapters it serves: a rank past the
            // configuration's lora.max_lora_rank is one the server would refuse.
            let max_rank = config.lora.max_lora_rank;
            (0..LORA_COPIES)
                .map(|_| {
                    let t0 = Instant::now();
                    let adapter = runtime::load_lora(dir, &model_config, max_rank);
                    load_ms.push(t0.elapsed().as_secs_f64() * 1e3);
                    adapter
                })
                .collect::<anyhow::Result<_>>()
                .with_context(|| format!("--lora {}", dir.display()))?
        }
    };
    let lora = adapters.first().map(|a| {
        let targets: Vec<&str> = a.targets().iter().map(|t| t.module()).collect();
        format!(
            "{} (rank {} on {}) as 1 to {LORA_COPIES} distinct adapters",
            args.lora.as_deref().unwrap_or(Path::new("")).display(),
            a.rank(),
            targets.join(", ")
        )
    });
    let num_blocks = backend.num_kv_blocks();
    let hardware = backend.name().to_string();
    let capacity = num_blocks * block_size;
    let max_model_len = config
        .model
        .max_model_len
        .unwrap_or(model_config.max_position_embeddings)
        .min(model_config.max_position_embeddings)
        .min(capacity);
    let default_kv = if chosen == BackendKind::Cuda {
        262_144
    } else {
        8192
    };
    let max_kv_tokens = args.max_kv_tokens.unwrap_or(default_kv).min(capacity / 2);
    let limits = Limits {
        max_context: args.max_context.min(max_model_len).min(max_kv_tokens),
        max_kv_tokens,
        max_num_seqs: config.scheduler.max_num_seqs,
        max_num_batched_tokens: config.scheduler.max_num_batched_tokens,
    };
    anyhow::ensure!(
        limits.max_context >= 64,
        "the longest context measured would be {} tokens: --max-context ({}), the model's \
         context ({max_model_len}), --max-kv-tokens and half the KV cache ({} tokens: \
         cache.kv_cache_mb, cache.num_blocks or cache.gpu_memory_utilization) cap it, and at \
         least 64 are needed",
        limits.max_context,
        args.max_context,
        capacity / 2
    );
    let scheduler = SchedulerConfig {
        max_num_seqs: config.scheduler.max_num_seqs,
        max_num_batched_tokens: config.scheduler.max_num_batched_tokens,
        block_size,
        num_gpu_blocks: num_blocks,
        enable_prefix_caching: config.cache.prefix_caching,
        max_model_len,
        tiers: Vec::new(),
        max_logit_rows: switchyard_gpu::backend::MAX_LOGIT_ROWS,
        max_loras: LORA_COPIES,
        speculative: None,
        sliding_window: runtime::sliding_window(&model_config, backend.as_ref()),
        // Offline work has no client to give up: no queue bound.
        max_queue_ms: None,
        num_host_blocks: 0,
        kv_offload_ahead: true,
    };
    // One step at a time, so that each backend time is one planned step's.
    let mut engine = runtime::offline_core(backend, scheduler, AsyncSchedulingMode::Off)?;
    let mut scenarios = sweep(limits);
    if !adapters.is_empty() {
        scenarios.extend(lora_sweep(limits));
    }
    let vocab = model_config.vocab_size as u64;
    let mut rng = ChaCha8Rng::seed_from_u64(args.seed);
    let mut steps: Vec<(StepShape, u64, u64)> = Vec::new();
    let bar = super::progress(
        "calibrate",
        (scenarios.len() * args.repeats) as u64,
        "measurements",
    );
    let mut next_id = 0u64;
    let start = Instant::now();
    // Runs `s`, its steps' times added to `times`.
    let mut run = |s: &Scenario, times: &mut Vec<(StepShape, u64, u64)>| {
        run_scenario(
            &mut engine,
            s,
            &mut Prompts {
                rng: &mut rng,
                vocab,
            },
            &adapters,
            &mut next_id,
            start,
            times,
        )
    };
    // A warm-up, not recorded: the first steps of a process pay for page faults, caches and
    // (on a GPU) kernel loads.
    if let Some(first) = scenarios.iter().find(|s| s.later.is_empty()) {
        run(first, &mut Vec::new())?;
    }
    for _ in 0..args.repeats {
        for s in &scenarios {
            run(s, &mut steps)?;
            bar.inc(1);
        }
    }
    bar.finish();
    let mut host: Vec<u64> = steps.iter().map(|&(_, _, h)| h).collect();
    host.sort_unstable();
    let host_overhead_us = host.get(host.len() / 2).copied().unwrap_or(0) as f64;
    Ok(SamplesFile {
        model: model_name,
        hardware,
        num_gpu_blocks: num_blocks,
        block_size,
        host_overhead_us,
        repeats: args.repeats,
        max_num_seqs: Some(config.scheduler.max_num_seqs),
        max_num_batched_tokens: Some(config.scheduler.max_num_batched_tokens),
        lora,
        lora_load_ms: median_load_ms(&mut load_ms),
        front_end,
        samples: medians(&steps),
    })
}

/// The median of the adapter's load times (the lower middle one of an even count, as the
/// steps' medians); `None` without loads.
fn median_load_ms(ms: &mut [f64]) -> Option<f64> {
    ms.sort_by(f64::total_cmp);
    ms.get(ms.len().checked_sub(1)? / 2).copied()
}

/// Each distinct shape once, with the median of its backend times (the lower one of an even
/// count: an outlier is a slow step, never a fast one; at least a microsecond), in the order
/// the shapes were first seen.
fn medians(steps: &[(StepShape, u64, u64)]) -> Vec<Sample> {
    let mut order = Vec::new();
    let mut times: HashMap<StepShape, Vec<u64>> = HashMap::new();
    for &(shape, us, _) in steps {
        let t = times.entry(shape).or_default();
        if t.is_empty() {
            order.push(shape);
        }
        t.push(us);
    }
    order
        .into_iter()
        .map(|shape| {
            let t = times.get_mut(&shape).expect("every shape seen has times");
            t.sort_unstable();
            Sample {
                shape,
                seconds: t[(t.len() - 1) / 2].max(1) as f64 / 1e6,
            }
        })
        .collect()
}

/// Random prompts: ids away from the first 256 (special and byte tokens), distinct per
/// request, so that only the prefixes a measurement asks for are cached.
struct Prompts<'a> {
    rng: &'a mut ChaCha8Rng,
    vocab: u64,
}

impl Prompts<'_> {
    fn make(&mut self, len: usize, prefix: Option<&[u32]>) -> Vec<u32> {
        let mut p: Vec<u32> = prefix.map(<[u32]>::to_vec).unwrap_or_default();
        let span = self.vocab.saturating_sub(256).max(1);
        while p.len() < len {
            p.push((256 + self.rng.random_range(0..span)) as u32);
        }
        p.truncate(len);
        p
    }
}

/// Runs one measurement to its end, recording every non-empty step's shape, backend time and
/// host time (microseconds). Its requests run the first `s.adapters` of `adapters` in turn.
fn run_scenario(
    engine: &mut EngineCore,
    s: &Scenario,
    prompts: &mut Prompts<'_>,
    adapters: &[Arc<LoraAdapter>],
    next_id: &mut u64,
    start: Instant,
    out: &mut Vec<(StepShape, u64, u64)>,
) -> anyhow::Result<()> {
    let sampling = Arc::new(SamplingParams {
        temperature: 1.0,
        ignore_eos: true,
        ..SamplingParams::default()
    });
    let mut made: Vec<Vec<u32>> = Vec::new();
    let mut submit = |engine: &mut EngineCore, reqs: &[Req]| -> anyhow::Result<Vec<u64>> {
        let mut ids = Vec::new();
        for r in reqs {
            let prefix = r.extends.and_then(|i| made.get(i)).cloned();
            let prompt = prompts.make(r.prompt, prefix.as_deref());
            made.push(prompt.clone());
            let limits = SamplingLimits {
                max_tokens: r.output as u32,
                ignore_eos: true,
                ..SamplingLimits::default()
            };
            let id = *next_id;
            *next_id += 1;
            let mut submit = SubmitOptions::offline(id, prompt, limits, sampling.clone());
            // The measurement's requests take its adapters in turn.
            let turn = (made.len() - 1) % s.adapters.max(1);
            if let Some(adapter) = adapters.get(turn).filter(|_| s.adapters > 0) {
                submit = submit.with_adapter(1 + turn as u32, adapter.clone());
            }
            engine.core().add_request(submit)?;
            ids.push(id);
        }
        Ok(ids)
    };
    let first = submit(engine, &s.first)?;
    let mut started = std::collections::HashSet::new();
    let (mut later_done, mut steps_since_started) = (s.later.is_empty(), 0usize);
    loop {
        let all_started = first.iter().all(|id| started.contains(id));
        if !later_done
            && ((all_started && steps_since_started >= s.later_after)
                || !engine.core().has_unfinished())
        {
            submit(engine, &s.later)?;
            later_done = true;
        }
        if !engine.core().has_unfinished() {
            return Ok(());
        }
        let report = engine.step(Timestamp(start.elapsed().as_micros() as u64))?;
        if report.shape.num_seqs > 0 {
            out.push((
                report.shape,
                report.execute_us,
                report.plan_us + report.apply_us,
            ));
        }
        if all_started {
            steps_since_started += 1;
        }
        for e in &report.events {
            if let CoreEvent::Token { id, .. } = e {
                started.insert(id.0);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIMITS: Limits = Limits {
        max_context: 1024,
        max_kv_tokens: 8192,
        max_num_seqs: 256,
        max_num_batched_tokens: 2048,
    };

    /// A `--from-samples` file that is JSON but not an object of the measured steps (a list,
    /// a number) is refused saying what it must be, not by the name of the Rust type that
    /// reads it (serde's "expected struct SamplesFile with 12 elements").
    #[test]
    fn a_samples_file_of_another_shape_says_what_it_must_hold() {
        let dir = crate::scratch::ScratchDir::new("calibrate-samples-shape");
        for text in ["[]", "3", "\"steps\""] {
            let path = dir.path().join("steps.json");
            std::fs::write(&path, text).unwrap();
            let e = format!("{:#}", read_samples(&path).expect_err("not samples"));
            assert!(
                !e.contains("SamplesFile")
                    && e.contains(
                        "expected an object of the measured steps (model, hardware, ..., samples)"
                    ),
                "{text}: {e}"
            );
        }
    }

    /// Every measurement fits the limits, and the sweep has each kind of step: long and short
    /// prefills, batched ones, prefix hits, decodes from batch 1 to the most that fit, and
    /// decodes joined by a prefill.
    #[test]
    fn the_sweep_covers_every_kind_of_step_within_the_limits() {
        let s = sweep(LIMITS);
        for sc in &s {
            let all: Vec<&Req> = sc.first.iter().chain(&sc.later).collect();
            assert!(all.iter().all(|r| r.prompt + r.output <= 1024), "{sc:?}");
            let kv: usize = all.iter().map(|r| r.prompt + r.output).sum();
            assert!(kv <= 8192 && all.len() <= 256, "{sc:?}");
        }
        let single = |p: usize| {
            s.iter()
                .any(|sc| sc.first == [Req::new(p, 1)] && sc.later.is_empty())
        };
        assert!(single(16) && single(1023));
        assert!(s
            .iter()
            .any(|sc| sc.later.first().is_some_and(|r| r.extends == Some(0))));
        // A decode measurement's sequences generate DECODE_STEPS tokens once all of them run:
        // the prefill takes ceil(b * c / 2048) steps, during which the first ones decode.
        let decode = |c: usize, b: usize| {
            let output = DECODE_STEPS + (b * c).div_ceil(2048);
            s.iter()
                .any(|sc| sc.first == vec![Req::new(c, output); b] && sc.later.is_empty())
        };
        // At the shortest context 190 sequences of 32 + 8 + 3 tokens fit in 8192 (191 do
        // not); the longest context leaves room for 8 + 8192 / 2048 tokens, 1012, and 8 such
        // sequences fit.
        assert!(decode(32, 1) && decode(32, 190) && decode(1012, 8));
        assert!(!decode(32, 191) && !decode(1012, 9));
        assert!(s
            .iter()
            .any(|sc| sc.later_after == 2 && !sc.later.is_empty()));
        // A smaller engine gets a smaller sweep, still within its limits.
        let small = sweep(Limits {
            max_context: 100,
            max_kv_tokens: 400,
            max_num_seqs: 4,
            max_num_batched_tokens: 64,
        });
        assert!(!small.is_empty());
        for sc in &small {
            let all: Vec<&Req> = sc.first.iter().chain(&sc.later).collect();
            assert!(all.iter().all(|r| r.prompt + r.output <= 100) && all.len() <= 4);
        }
    }

    /// A short `--max-context` (64 tokens) still measures every kind of step, at three
    /// prefill lengths and three decode contexts (lengths worked out from the sweep's rules):
    /// before, only prefills of 16 and 63 tokens, one prefix hit and decodes at contexts 32
    /// and 52 fitted, no batched prefill and no decode joined by a prefill.
    #[test]
    fn a_short_context_keeps_every_kind_of_step() {
        let l = Limits {
            max_context: 64,
            ..LIMITS
        };
        let s = sweep(l);
        for sc in &s {
            let all: Vec<Req> = sc.first.iter().chain(&sc.later).copied().collect();
            assert!(l.fit(&all), "{sc:?}");
        }
        let alone = |first: Vec<Req>| s.iter().any(|sc| sc.first == first && sc.later.is_empty());
        // Single prefills of 16, 32 and 63 tokens; batched ones of a quarter (16) and all
        // (63) of the context.
        for p in [16, 32, 63] {
            assert!(alone(vec![Req::new(p, 1)]), "{p}");
        }
        for (n, p) in [(4, 16), (16, 16), (64, 16), (4, 63), (16, 63)] {
            assert!(alone(vec![Req::new(p, 1); n]), "{n} x {p}");
        }
        // A prefix hit: 16 new tokens past a cached 32.
        assert!(s.iter().any(|sc| sc.first == [Req::new(32, 1)]
            && sc.later
                == [Req {
                    prompt: 48,
                    output: 1,
                    extends: Some(0)
                }]));
        // Decodes: the longest context is 64 - 8 - 8192 / 2048 = 52, then 52 / 2 = 26 and
        // 52 / 8 = 6; each at batch 1 and at 64 (the most sequences, whose KV fits).
        for c in [6, 26, 52] {
            for b in [1, 64] {
                assert!(
                    alone(vec![Req::new(c, l.decode_output(b, c)); b]),
                    "{b} x {c}"
                );
            }
        }
        // Decodes at a context of 32 joined by prefills of 16 and 63 tokens.
        for b in [4, 16] {
            for p in [16, 63] {
                assert!(s.iter().any(
                    |sc| sc.first == vec![Req::new(32, 16); b] && sc.later == [Req::new(p, 1)]
                ));
            }
        }
        // No measurement twice.
        for (i, sc) in s.iter().enumerate() {
            assert!(!s[..i].contains(sc), "{sc:?}");
        }
    }

    /// Every `--lora` measurement runs adapters, 1, 2 and 4 of them, never more than it has
    /// requests, within the limits; prefills, decodes from batch 1 to 16 and mixed steps.
    #[test]
    fn the_lora_sweep_runs_each_kind_of_step_over_one_to_four_adapters() {
        let s = lora_sweep(LIMITS);
        let mut counts: Vec<usize> = s.iter().map(|sc| sc.adapters).collect();
        counts.sort_unstable();
        counts.dedup();
        assert_eq!(counts, [1, 2, LORA_COPIES]);
        for sc in &s {
            let all: Vec<Req> = sc.first.iter().chain(&sc.later).copied().collect();
            assert!(LIMITS.fit(&all) && sc.adapters <= all.len(), "{sc:?}");
        }
        let decode = |b: usize, n: usize| {
            s.iter().any(|sc| {
                sc.adapters == n
                    && sc.later.is_empty()
                    && sc.first == vec![Req::new(256, LIMITS.decode_output(b, 256)); b]
            })
        };
        assert!(decode(1, 1) && decode(16, 1) && decode(16, 2) && decode(16, 4));
        assert!(!decode(1, 2), "one request cannot run two adapters");
        assert!(s
            .iter()
            .any(|sc| sc.adapters == 4 && sc.first == vec![Req::new(64, 1); 4]));
        assert!(s.iter().any(|sc| sc.adapters == 4 && !sc.later.is_empty()));
        // The base sweep runs none.
        assert!(sweep(LIMITS).iter().all(|sc| sc.adapters == 0));
        // A short context shortens the measurements.
        let short = lora_sweep(Limits {
            max_context: 128,
            max_kv_tokens: 512,
            max_num_seqs: 4,
            max_num_batched_tokens: 8192,
        });
        assert!(short.iter().any(|sc| sc.first == vec![Req::new(64, 9); 4]));
    }

    /// Steps timed as exactly 2 ms + 10 us per token + 5 us more per prompt token: every
    /// refit agrees (a standard error of 0); too few steps for the refits, none.
    #[test]
    fn the_spread_of_exact_steps_is_nil() {
        let mut samples = Vec::new();
        for (seqs, prefill) in [(1, 0), (4, 0), (16, 0), (64, 0), (1, 128), (1, 512)] {
            for context in [32, 256] {
                let mut shape = StepShape::default();
                for i in 0..seqs {
                    let p = prefill > 0 && i == 0;
                    shape.add_seq(context, if p { prefill } else { 1 }, p, true);
                }
                let seconds =
                    2e-3 + 10e-6 * shape.num_tokens as f64 + 5e-6 * shape.num_prefill_tokens as f64;
                samples.push(Sample { shape, seconds });
            }
        }
        let c = calibrate::fit(&samples).unwrap().calibration;
        // 2 ms + 8 x 10 us.
        assert_eq!(
            SloAwareParams::from_calibration(&c, 8).step_overhead_ms,
            2.08
        );
        let (step, prefill) = slo_aware_spread(&samples, &c, 8).unwrap();
        assert!(step < 1e-9 && prefill < 1e-9, "{step} {prefill}");
        assert_eq!(slo_aware_spread(&samples[..11], &c, 8), None);
    }

    #[test]
    fn each_shape_gets_the_median_of_its_times() {
        let a = StepShape {
            num_seqs: 1,
            num_tokens: 16,
            ..StepShape::default()
        };
        let b = StepShape { num_seqs: 2, ..a };
        let steps = [
            (a, 30, 1),
            (b, 0, 1),
            (a, 10, 1),
            (a, 20, 1),
            (b, 0, 1),
            (b, 5, 1),
        ];
        let m = medians(&steps);
        assert_eq!(m.len(), 2);
        assert_eq!((m[0].shape, m[0].seconds), (a, 20e-6));
        // A step faster than the clock's microsecond counts as one.
        assert_eq!((m[1].shape, m[1].seconds), (b, 1e-6));
    }
}
