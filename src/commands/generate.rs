//! `switchyard generate`: several prompts generated together through the scheduling core
//! (continuous batching), printed as they finish; a single prompt streams to stdout.

use std::collections::BTreeMap;
use std::io::Write;
use std::sync::Arc;
use std::time::Instant;

use anyhow::Context;
use switchyard_actors::structured::{GrammarCompiler, StructuredOutput, MAX_SPEC_BYTES};
use switchyard_actors::{CoreEvent, IncrementalDetokenizer, SubmitOptions};
use switchyard_gpu::backend::SamplingParams;
use switchyard_gpu::model::ChatMessage;
use switchyard_policies::{RequestId, SamplingLimits, SchedulerConfig, Timestamp};

use super::runtime;
use crate::cli::GenerateArgs;

/// KV cache budget for offline generation, MiB.
const KV_MB: usize = 512;

struct Output {
    prompt_tokens: usize,
    /// Prompt tokens whose KV came from the prefix cache (whole blocks, at first admission).
    cached_prompt_tokens: u32,
    tokens: Vec<u32>,
    text: String,
    detok: IncrementalDetokenizer,
    finish: Option<&'static str>,
}

pub fn run(args: GenerateArgs) -> anyhow::Result<()> {
    super::check_threads(args.threads)?;
    // Before the model loads (minutes for a large one): a misspelt backend is refused at once.
    let backend_kind = runtime::parse_backend(&args.backend)?;
    let structured = structured_spec(&args)?;
    // The sampling flags too (the token ids they could name are checked per prompt later).
    check_sampling_flags(&args)?;
    if let Some(dir) = &args.lora {
        super::config::check_lora_flag(dir, switchyard_gpu::lora::MAX_LORA_RANK)?;
    }
    let path = runtime::resolve_model_path(args.model.as_deref())?;
    let model = runtime::load(&path)?;
    let tokenizer = model.tokenizer.clone();
    let adapter = args
        .lora
        .as_deref()
        .map(|dir| runtime::load_lora(dir, &model.config, switchyard_gpu::lora::MAX_LORA_RANK))
        .transpose()?;
    let mut prompts = Vec::with_capacity(args.prompt.len());
    for p in &args.prompt {
        let ids = if args.chat {
            let template = model.chat_template.as_ref().ok_or_else(|| {
                anyhow::anyhow!("{} has no chat template; drop --chat", path.display())
            })?;
            let text = template.render(&[ChatMessage::new("user", p.clone())], true)?;
            tokenizer.encode(&text, false)?
        } else {
            tokenizer.encode(p, true)?
        };
        anyhow::ensure!(!ids.is_empty(), "prompt {p:?} has no tokens");
        prompts.push(ids);
    }
    let max_model_len = model.config.max_position_embeddings;
    let block_size = 16;
    let settings = runtime::BackendSettings {
        num_blocks: None,
        kv_cache_mb: KV_MB,
        gpu_memory_utilization: 0.9,
        block_size,
        threads: args.threads,
        max_batch_tokens: 2048,
        max_batch_tokens_setting: "generate's step token budget",
        max_num_seqs: 256,
        quantization: args.quantization,
        kv_cache_dtype: args.kv_cache_dtype,
        cpu_precision: args.cpu_precision,
        // Offline work keeps no prefix across runs worth a host tier.
        host_kv_bytes: 0,
        kv_setting_names: switchyard_gpu::KvSettingNames::CONFIG,
    };
    let (backend, _) = runtime::build_backend(
        backend_kind,
        runtime::ModelSource::Loaded(&model.config, &model.weights),
        &settings,
    )?;
    let sliding_window = runtime::sliding_window(&model.config, backend.as_ref());
    drop(model);
    anyhow::ensure!(
        adapter.is_none() || backend.lora_slots() > 0,
        "--lora: the {} backend does not run LoRA adapters",
        backend.name()
    );
    let num_blocks = backend.num_kv_blocks();
    let scheduler = SchedulerConfig {
        max_num_seqs: 256,
        max_num_batched_tokens: 2048,
        block_size,
        num_gpu_blocks: num_blocks,
        enable_prefix_caching: true,
        max_model_len,
        tiers: Vec::new(),
        max_logit_rows: switchyard_gpu::backend::MAX_LOGIT_ROWS,
        max_loras: 4,
        speculative: runtime::speculative_from_args(&args.speculative)?,
        sliding_window,
        // Offline work has no client to give up: no queue bound.
        max_queue_ms: None,
        num_host_blocks: 0,
        kv_offload_ahead: true,
    };
    let mut engine = runtime::offline_core(backend, scheduler, args.async_scheduling)?;
    let eos = tokenizer.eos_token_ids().to_vec();
    let grammars = match &structured {
        Some(_) => {
            Some(GrammarCompiler::new(Arc::new(tokenizer.clone())).map_err(anyhow::Error::msg)?)
        }
        None => None,
    };
    let mut outputs = BTreeMap::new();
    for (i, ids) in prompts.into_iter().enumerate() {
        let id = RequestId(i as u64);
        let sampling = SamplingParams {
            temperature: args.temperature,
            top_p: args.top_p,
            top_k: args.top_k,
            seed: args.seed.map(|s| s.wrapping_add(i as u64)),
            eos_token_ids: eos.clone(),
            constraint: match (&grammars, &structured) {
                (Some(g), Some(spec)) => {
                    g.compile(spec, &eos, 1).map_err(anyhow::Error::msg)?.pop()
                }
                _ => None,
            },
            ..SamplingParams::default()
        };
        outputs.insert(
            id,
            Output {
                prompt_tokens: ids.len(),
                cached_prompt_tokens: 0,
                tokens: Vec::new(),
                text: String::new(),
                detok: IncrementalDetokenizer::new(Vec::new()),
                finish: None,
            },
        );
        let limits = SamplingLimits {
            max_tokens: args.max_tokens,
            stop_token_ids: eos.iter().skip(1).copied().collect(),
            eos_token_id: eos.first().copied(),
            ..SamplingLimits::default()
        };
        let mut submit = SubmitOptions::offline(id.0, ids, limits, Arc::new(sampling));
        if let Some(a) = &adapter {
            submit = submit.with_adapter(1, a.clone());
        }
        engine
            .core()
            .add_request(submit)
            .map_err(|e| anyhow::anyhow!("prompt {}: {}", id.0 + 1, e.client_message()))?;
    }
    let stream = outputs.len() == 1 && !args.json;
    let start = Instant::now();
    let mut generated = 0usize;
    let mut stdout = std::io::stdout().lock();
    while engine.core().has_unfinished() {
        let now = Timestamp(start.elapsed().as_micros() as u64);
        let report = engine.step(now)?;
        for event in report.events {
            match event {
                CoreEvent::Token {
                    id, token, stops, ..
                } => {
                    let Some(out) = outputs.get_mut(&id) else {
                        continue;
                    };
                    generated += 1;
                    out.tokens.push(token);
                    // A stop or end-of-sequence token ends the text without a part in it.
                    let bytes = if stops || tokenizer.is_special(token) {
                        &[][..]
                    } else {
                        tokenizer.token_bytes(token).unwrap_or(&[])
                    };
                    let piece = out.detok.push(bytes).text;
                    if stream {
                        write!(stdout, "{piece}")?;
                        stdout.flush()?;
                    }
                    out.text.push_str(&piece);
                }
                CoreEvent::PromptCached { id, tokens } => {
                    if let Some(out) = outputs.get_mut(&id) {
                        out.cached_prompt_tokens = tokens;
                    }
                }
                CoreEvent::PromptLogprobs { .. } | CoreEvent::Hidden { .. } => {}
                CoreEvent::Finished { id, reason } => {
                    let Some(out) = outputs.get_mut(&id) else {
                        continue;
                    };
                    let rest = out.detok.finish().text;
                    if stream {
                        writeln!(stdout, "{rest}")?;
                    }
                    out.text.push_str(&rest);
                    out.finish = Some(reason.metric_label());
                }
            }
        }
    }
    let secs = start.elapsed().as_secs_f64();
    if !stream {
        for (id, out) in &outputs {
            if args.json {
                let line = serde_json::json!({
                    "index": id.0,
                    "prompt": args.prompt[id.0 as usize],
                    "text": out.text,
                    "prompt_tokens": out.prompt_tokens,
                    "cached_prompt_tokens": out.cached_prompt_tokens,
                    "completion_tokens": out.tokens.len(),
                    "finish_reason": out.finish,
                });
                writeln!(stdout, "{line}")?;
            } else {
                writeln!(
                    stdout,
                    "--- [{}] {}\n{}",
                    id.0, args.prompt[id.0 as usize], out.text
                )?;
            }
        }
    }
    let prompt_tokens: usize = outputs.values().map(|o| o.prompt_tokens).sum();
    let cached: u64 = outputs
        .values()
        .map(|o| u64::from(o.cached_prompt_tokens))
        .sum();
    eprintln!(
        "{generated} tokens for {} in {secs:.2} s ({:.1} tok/s); {cached} of \
         {prompt_tokens} prompt tokens from the prefix cache",
        prompt_count(outputs.len()),
        generated as f64 / secs.max(1e-9)
    );
    let spec = engine.core().spec_decode_stats();
    if spec.num_draft_tokens > 0 {
        eprintln!(
            "speculative decoding: {} of {} draft tokens accepted",
            spec.num_accepted_tokens, spec.num_draft_tokens
        );
    }
    Ok(())
}

/// The structure `--json-schema`, `--regex` or `--choice` asks for (clap lets one through).
/// Refuses sampling flags out of range before the model loads: each prompt's parameters are
/// checked again, with the vocabulary, when it is added.
fn check_sampling_flags(args: &GenerateArgs) -> anyhow::Result<()> {
    anyhow::ensure!(args.max_tokens >= 1, "--max-tokens must be at least 1");
    let sampling = SamplingParams {
        temperature: args.temperature,
        top_p: args.top_p,
        top_k: args.top_k,
        ..SamplingParams::default()
    };
    // No token id among these flags: any vocabulary size passes the id checks.
    sampling.validate(usize::MAX)?;
    Ok(())
}

fn structured_spec(args: &GenerateArgs) -> anyhow::Result<Option<StructuredOutput>> {
    if let Some(path) = &args.json_schema {
        // Read to the bound, not to the end (a pipe or a device has no size to check first).
        let text = super::bench_serve::read_bounded(path, MAX_SPEC_BYTES as u64)
            .context("--json-schema")?;
        let schema = serde_json::from_str(&text)
            .with_context(|| format!("--json-schema: {} is not JSON", path.display()))?;
        return Ok(Some(StructuredOutput::JsonSchema(schema)));
    }
    if let Some(r) = &args.regex {
        return Ok(Some(StructuredOutput::Regex(r.clone())));
    }
    if !args.choice.is_empty() {
        return Ok(Some(StructuredOutput::Choice(args.choice.clone())));
    }
    Ok(None)
}

/// "1 prompt", "3 prompts".
fn prompt_count(n: usize) -> String {
    format!("{n} prompt{}", if n == 1 { "" } else { "s" })
}

#[cfg(test)]
mod tests {
    #[test]
    fn one_prompt_is_singular() {
        assert_eq!(super::prompt_count(1), "1 prompt");
        assert_eq!(super::prompt_count(0), "0 prompts");
        assert_eq!(super::prompt_count(14), "14 prompts");
    }
}
