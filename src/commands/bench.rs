//! `switchyard bench throughput`: offline throughput through the scheduling core and a backend,
//! printing the fields `vllm bench throughput` prints.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use switchyard_actors::structured::{GrammarCompiler, StructuredOutput};
use switchyard_actors::{CoreEvent, SubmitOptions};
use switchyard_config::BackendKind;
use switchyard_gpu::backend::SamplingParams;
use switchyard_policies::{SamplingLimits, SchedulerConfig, Timestamp};

use super::bench_serve::{read_dataset, DatasetStart, MAX_DATASET_BYTES, MAX_REQUEST_TOKENS};
use super::mooncake::{self, RowShape, TokenSpace, TraceReuse};
use super::runtime;
use crate::cli::{BenchCommand, BenchDataset, ThroughputArgs};

/// Most prompts one benchmark run accepts.
const MAX_PROMPTS: usize = 100_000;
/// CPU KV cache budget for the benchmark, MiB.
const KV_MB: usize = 2048;
/// The mooncake dataset's default file, relative to the current directory.
const MOONCAKE_DEFAULT_PATH: &str = "../shared/traces/synthetic_trace.jsonl";
/// The sharegpt dataset's file when --dataset-path is not given.
const SHAREGPT_DEFAULT_PATH: &str =
    "../shared/traces/sharegpt_8k_filtered_stats_llama2_tokenizer.csv";

/// The file `bench throughput` reads its dataset from (`None`: random lengths, no file).
fn dataset_file(args: &ThroughputArgs) -> Option<std::path::PathBuf> {
    let default = match args.dataset {
        BenchDataset::Random => return None,
        BenchDataset::Sharegpt => Some(SHAREGPT_DEFAULT_PATH),
        BenchDataset::Mooncake => Some(MOONCAKE_DEFAULT_PATH),
        BenchDataset::Prompts => None,
    };
    args.dataset_path
        .clone()
        .or_else(|| default.map(Into::into))
}

/// The columns `bench throughput` (and `bench serve`) read of a ShareGPT lengths CSV.
const SHAREGPT_COLUMNS: [&str; 2] = ["num_prefill_tokens", "num_decode_tokens"];

/// The dataset file ([`dataset_file`]) and its text, read before the model loads (minutes
/// for a large one), opened once (a FIFO's writer writes it once), to its bound: a file that
/// is not there, or whose start cannot be the dataset (`/dev/zero`, a CSV without the
/// header's columns, a mooncake trace that is not JSON Lines of objects), is refused at once,
/// as `bench serve` refuses it, not after up to [`MAX_DATASET_BYTES`] of it.
fn read_dataset_file(args: &ThroughputArgs) -> anyhow::Result<Option<(PathBuf, String)>> {
    // The formats `bench serve` takes too are checked at their start as it checks them.
    let (max, start) = match args.dataset {
        BenchDataset::Random => return Ok(None),
        BenchDataset::Sharegpt => (
            MAX_DATASET_BYTES,
            Some(DatasetStart::Csv(&SHAREGPT_COLUMNS)),
        ),
        BenchDataset::Mooncake => (
            MAX_DATASET_BYTES,
            Some(DatasetStart::Mooncake {
                skip_rows: args.mooncake.skip_rows,
            }),
        ),
        BenchDataset::Prompts => (MAX_PROMPTS_FILE, None),
    };
    // Only the prompts dataset has no default file.
    let Some(path) = dataset_file(args) else {
        anyhow::bail!("--dataset prompts needs --dataset-path FILE");
    };
    let text = read_dataset(&path, max, start).with_context(|| {
        format!(
            "the dataset file {} (pass another with --dataset-path)",
            path.display()
        )
    })?;
    Ok(Some((path, text)))
}

/// The first token id of the mooncake dataset's blocks and how many ids they are drawn from:
/// `bench serve`'s defaults (--token-offset, --token-range), so both send the same prompts
/// for a row and a seed; the range is narrowed to a smaller vocabulary.
const MOONCAKE_TOKEN_OFFSET: u32 = 1000;
const MOONCAKE_TOKEN_RANGE: u32 = 20_000;

/// The first id and the number of ids the mooncake dataset's blocks draw from for a model of
/// `vocab` ids: `bench serve`'s defaults narrowed to the vocabulary, and for a vocabulary of
/// [`MOONCAKE_TOKEN_OFFSET`] ids or fewer, all of it (every id must be one the model has).
fn mooncake_token_ids(vocab: u64) -> (u32, u32) {
    let offset = u64::from(MOONCAKE_TOKEN_OFFSET);
    if vocab > offset {
        let above = u32::try_from(vocab - offset).unwrap_or(u32::MAX);
        (MOONCAKE_TOKEN_OFFSET, MOONCAKE_TOKEN_RANGE.min(above))
    } else {
        (0, u32::try_from(vocab).unwrap_or(u32::MAX).max(1))
    }
}

pub fn run(cmd: BenchCommand) -> anyhow::Result<()> {
    match cmd {
        BenchCommand::Throughput(args) => throughput(args),
        BenchCommand::Serve(args) => super::bench_serve::run(args),
    }
}

/// Most bytes of a prompts file.
const MAX_PROMPTS_FILE: u64 = 64 << 20;

/// Tokenizes the JSONL text of `{"prompt": "..."}` lines of the file `path`, each prompt as
/// one user message through the model's chat template (plain text when it has none).
fn prompt_dataset(
    path: &Path,
    text: &str,
    model: &switchyard_gpu::model::LoadedModel,
) -> anyhow::Result<Vec<Vec<u32>>> {
    #[derive(serde::Deserialize)]
    struct Line {
        prompt: String,
    }
    let mut out = Vec::new();
    for (n, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let l: Line = serde_json::from_str(line)
            .with_context(|| format!("{} line {}", path.display(), n + 1))?;
        let ids = match &model.chat_template {
            Some(t) => {
                let rendered = t.render(
                    &[switchyard_gpu::model::ChatMessage::new("user", l.prompt)],
                    true,
                )?;
                model.tokenizer.encode(&rendered, false)?
            }
            None => model.tokenizer.encode(&l.prompt, true)?,
        };
        anyhow::ensure!(
            !ids.is_empty(),
            "{} line {}: no tokens",
            path.display(),
            n + 1
        );
        out.push(ids);
    }
    Ok(out)
}

/// The (prompt, output) lengths of the ShareGPT lengths CSV `text` of the file `path`.
fn sharegpt_lengths(
    path: &Path,
    text: &str,
    max_model_len: usize,
) -> anyhow::Result<Vec<(usize, usize)>> {
    let names = SHAREGPT_COLUMNS;
    let (text, columns) = super::bench_serve::csv_columns(path, text, &names)?;
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate().skip(1) {
        let fields: Vec<&str> = line.split(',').collect();
        let num = |k: usize| -> anyhow::Result<usize> {
            fields
                .get(columns[k])
                .and_then(|f| f.trim().parse().ok())
                .with_context(|| {
                    format!(
                        "{}:{}: field {} is not a number",
                        path.display(),
                        i + 1,
                        names[k]
                    )
                })
        };
        let (p, o) = (num(0)?, num(1)?);
        let total = p.checked_add(o).with_context(|| {
            format!(
                "{}:{}: num_prefill_tokens + num_decode_tokens overflows",
                path.display(),
                i + 1
            )
        })?;
        if p >= 1 && o >= 1 && total <= max_model_len {
            out.push((p, o));
        }
    }
    anyhow::ensure!(!out.is_empty(), "{} has no usable rows", path.display());
    Ok(out)
}

/// The batch limits as the server bounds them, and the CUDA backend's bound with `--backend
/// cuda`, named by their flags: the backend's own check would name its internal field
/// (`max_batch_tokens`) after the model has loaded.
fn check_batch_flags(
    kind: BackendKind,
    max_num_seqs: usize,
    max_num_batched_tokens: usize,
) -> anyhow::Result<()> {
    let (seqs, tokens) = (
        switchyard_config::MAX_NUM_SEQS,
        switchyard_config::MAX_NUM_BATCHED_TOKENS,
    );
    anyhow::ensure!(
        (1..=seqs).contains(&max_num_seqs),
        "--max-num-seqs must be 1..={seqs} (the server's scheduler.max_num_seqs), not {max_num_seqs}"
    );
    anyhow::ensure!(
        (1..=tokens).contains(&max_num_batched_tokens),
        "--max-num-batched-tokens must be 1..={tokens} (the server's \
         scheduler.max_num_batched_tokens), not {max_num_batched_tokens}"
    );
    if kind == BackendKind::Cuda {
        runtime::check_cuda_batch_tokens(max_num_batched_tokens, "--max-num-batched-tokens", kind)?;
    }
    Ok(())
}

/// Refuses the dataset and cache flags the run cannot honour, before the model loads: the
/// random dataset's lengths and the mooncake flags as `bench serve` bounds them, --num-kv-blocks and --kv-offloading-size as
/// the configuration bounds cache.num_blocks and cache.kv_offloading_size. Returns the host
/// tier's bytes (0: none).
fn validate(args: &ThroughputArgs) -> anyhow::Result<usize> {
    super::check_threads(args.threads)?;
    let is_mooncake = args.dataset == BenchDataset::Mooncake;
    mooncake::check_flags(
        is_mooncake,
        args.mooncake.mooncake_block_tokens,
        args.mooncake.skip_rows,
        &[
            ("--max-input-len", args.max_input_len.is_some()),
            ("--max-output-len", args.max_output_len.is_some()),
        ],
    )?;
    // The random dataset's lengths too, as `bench serve` bounds them (whether they fit the
    // model's context is known once it loads).
    for (name, v) in [
        ("--input-len", args.input_len),
        ("--output-len", args.output_len),
        ("--max-input-len", args.max_input_len()),
        ("--max-output-len", args.max_output_len()),
    ] {
        anyhow::ensure!(
            (1..=MAX_REQUEST_TOKENS).contains(&v),
            "{name} must be 1..={MAX_REQUEST_TOKENS}, not {v}"
        );
    }
    if let Some(n) = args.num_kv_blocks {
        let max = switchyard_config::MAX_NUM_BLOCKS;
        anyhow::ensure!(
            (1..=max).contains(&n),
            "--num-kv-blocks must be 1..={max} (the server's cache.num_blocks), not {n}"
        );
    }
    let gib = args.kv_offloading_size;
    let max = switchyard_config::MAX_KV_OFFLOADING_GIB;
    anyhow::ensure!(
        gib.is_finite() && (0.0..=max).contains(&gib),
        "--kv-offloading-size {gib} must be a size in GiB in 0..={max} (the server's \
         cache.kv_offloading_size; 0: no host tier)"
    );
    let cache = switchyard_config::CacheSection {
        kv_offloading_size: gib,
        ..switchyard_config::CacheSection::default()
    };
    Ok(cache.kv_offloading_bytes())
}

/// One mooncake row to run: its (input, output) lengths and its blocks' hash ids (`None`:
/// random tokens).
type MooncakeRun = ((usize, usize), Option<Arc<[u64]>>);

/// The mooncake dataset's rows as (input, output) lengths and each row's hash ids, of the
/// text of `path` (--dataset-path, default [`MOONCAKE_DEFAULT_PATH`]) as `bench serve` reads
/// them. Each prompt and its output must fit the model's context `max_model_len`.
fn mooncake_rows(
    args: &ThroughputArgs,
    path: &Path,
    text: &str,
    max_model_len: usize,
) -> anyhow::Result<Vec<MooncakeRun>> {
    let shape = RowShape {
        block_tokens: args.mooncake.block_tokens(),
        max_input: args.max_input_len(),
        max_output: args.max_output_len(),
        max_row_tokens: MAX_REQUEST_TOKENS,
        max_total_ids: mooncake::MAX_TOTAL_HASH_IDS,
    };
    let rows = mooncake::read_rows(path, text, shape, args.mooncake.skip_rows, args.num_prompts)?;
    let mut out = Vec::with_capacity(rows.len());
    for (i, r) in rows.into_iter().enumerate() {
        // Both are at most 2^20, so the sum cannot overflow.
        anyhow::ensure!(
            r.input + r.output <= max_model_len,
            "{}: row {} (after --skip-rows {}) has {} prompt tokens and {} output tokens, more \
             than the model's context ({max_model_len}): lower --max-input-len or \
             --max-output-len",
            path.display(),
            i + 1,
            args.mooncake.skip_rows,
            r.input,
            r.output
        );
        out.push(((r.input, r.output), r.hash_ids));
    }
    Ok(out)
}

/// Refuses requests that could never run in a KV cache of `num_blocks` blocks of
/// `block_size` tokens: the longest `(input, output)` of `lengths` (requests of `dataset`)
/// must fit in it. The refusal names the flags that shorten that dataset's requests.
fn check_fits_cache(
    lengths: &[(usize, usize)],
    num_blocks: usize,
    block_size: usize,
    dataset: BenchDataset,
) -> anyhow::Result<()> {
    let longest = lengths.iter().map(|&(i, o)| i + o).max().unwrap_or(0);
    let capacity = num_blocks.saturating_mul(block_size);
    let shorter = match dataset {
        BenchDataset::Random => " or lower --input-len / --output-len",
        BenchDataset::Prompts => " or lower --output-len (or pass shorter prompts)",
        BenchDataset::Mooncake => " or lower --max-input-len / --max-output-len",
        // The rows' lengths are the file's: no flag shortens them.
        BenchDataset::Sharegpt => "",
    };
    anyhow::ensure!(
        longest <= capacity,
        "a request of {longest} tokens (prompt and output) does not fit in the KV cache's \
         {capacity} tokens ({num_blocks} blocks of {block_size}): raise --num-kv-blocks{shorter}"
    );
    Ok(())
}

fn throughput(args: ThroughputArgs) -> anyhow::Result<()> {
    anyhow::ensure!(
        (1..=MAX_PROMPTS).contains(&args.num_prompts),
        "--num-prompts must be 1..={MAX_PROMPTS}"
    );
    let host_kv_bytes = validate(&args)?;
    let kind = runtime::parse_backend(&args.backend)?;
    check_batch_flags(kind, args.max_num_seqs, args.max_num_batched_tokens)?;
    if let Some(b) = args.decode_batch {
        anyhow::ensure!(
            (1..=switchyard_gpu::backend::MAX_LOGIT_ROWS).contains(&b),
            "--decode-batch must be 1..={}",
            switchyard_gpu::backend::MAX_LOGIT_ROWS
        );
    }
    // Before the model loads: a dataset file that is not there or cannot be one is refused
    // at once.
    let dataset = read_dataset_file(&args)?;
    if let Some(dir) = &args.lora {
        super::config::check_lora_flag(dir, switchyard_gpu::lora::MAX_LORA_RANK)?;
    }
    let dataset_text = || {
        dataset
            .as_ref()
            .map(|(path, text)| (path.as_path(), text.as_str()))
            .context("no dataset file read")
    };
    // Real weights from a file, or random weights of a named architecture.
    let loaded = match &args.dummy {
        Some(_) => None,
        None => {
            let path = runtime::resolve_model_path(args.model.as_deref())?;
            Some(runtime::load(&path)?)
        }
    };
    let source = match (&args.dummy, &loaded) {
        (Some(arch), _) => runtime::ModelSource::Dummy(runtime::preset(arch)?, args.seed),
        (None, Some(m)) => runtime::ModelSource::Loaded(&m.config, &m.weights),
        (None, None) => anyhow::bail!("no model"),
    };
    let config = source.config().clone();
    let grammars = match (&args.regex, &loaded) {
        (None, _) => None,
        (Some(_), None) => {
            anyhow::bail!("--regex needs a model with a tokenizer (--model, not --dummy)")
        }
        (Some(r), Some(m)) => {
            let tokenizer = Arc::new(m.tokenizer.clone());
            let compiler = GrammarCompiler::new(tokenizer.clone()).map_err(anyhow::Error::msg)?;
            let spec = StructuredOutput::Regex(r.clone());
            Some((compiler, spec, tokenizer.eos_token_ids().to_vec()))
        }
    };
    let adapter = args
        .lora
        .as_deref()
        .map(|dir| runtime::load_lora(dir, &config, switchyard_gpu::lora::MAX_LORA_RANK))
        .transpose()?;
    let vocab = config.vocab_size as u64;
    let max_model_len = config.max_position_embeddings;
    let mut rng = ChaCha8Rng::seed_from_u64(args.seed);
    // Tokenized prompts of the `prompts` dataset (the others are random ids).
    let mut texts: Vec<Vec<u32>> = Vec::new();
    // The hash ids of each mooncake row's blocks (`None`: random tokens).
    let mut blocks: Vec<Option<Arc<[u64]>>> = Vec::new();
    let lengths: Vec<(usize, usize)> = match args.dataset {
        BenchDataset::Random => {
            let total = args
                .input_len
                .checked_add(args.output_len)
                .context("--input-len + --output-len overflows")?;
            anyhow::ensure!(
                total <= max_model_len,
                "input + output length exceed the context ({max_model_len})"
            );
            let n = args.decode_batch.unwrap_or(args.num_prompts);
            vec![(args.input_len, args.output_len); n]
        }
        BenchDataset::Sharegpt => {
            let (file, text) = dataset_text()?;
            let all = sharegpt_lengths(file, text, max_model_len).with_context(|| {
                format!(
                    "the sharegpt dataset {} (pass another with --dataset-path)",
                    file.display()
                )
            })?;
            (0..args.num_prompts)
                .map(|_| all[rng.random_range(0..all.len())])
                .collect()
        }
        BenchDataset::Prompts => {
            let Some((file, text)) = dataset.as_ref() else {
                anyhow::bail!("--dataset prompts needs --dataset-path FILE");
            };
            let Some(m) = &loaded else {
                anyhow::bail!(
                    "--dataset prompts needs a model with a tokenizer (--model, or the \
                     embedded default), not --dummy"
                );
            };
            let all = prompt_dataset(file, text, m)?;
            anyhow::ensure!(!all.is_empty(), "{} holds no prompts", file.display());
            let n = args.decode_batch.unwrap_or(args.num_prompts);
            let out = args.output_len.max(1);
            // Checked before the prompts are copied n times (one prompt may be millions of
            // tokens).
            for t in all.iter().take(n) {
                anyhow::ensure!(
                    t.len().checked_add(out).is_some_and(|n| n <= max_model_len),
                    "a prompt of {} tokens and {out} output tokens exceed the context ({max_model_len})",
                    t.len()
                );
            }
            texts = (0..n).map(|i| all[i % all.len()].clone()).collect();
            texts.iter().map(|t| (t.len(), out)).collect()
        }
        BenchDataset::Mooncake => {
            anyhow::ensure!(
                args.decode_batch.is_none(),
                "--decode-batch runs prompts of one length: use the random or prompts dataset"
            );
            let (file, text) = dataset_text()?;
            let rows = mooncake_rows(&args, file, text, max_model_len)?;
            blocks = rows.iter().map(|(_, ids)| ids.clone()).collect();
            rows.into_iter().map(|(lengths, _)| lengths).collect()
        }
    };
    // The dataset's text (up to its bound) is not held through the run.
    drop(dataset);
    let trace_reuse = (args.dataset == BenchDataset::Mooncake).then(|| {
        let prompts = lengths
            .iter()
            .zip(&blocks)
            .map(|(&(input, _), ids)| (input, ids.as_deref()));
        TraceReuse::of(prompts, args.mooncake.block_tokens())
    });
    let (offset, range) = mooncake_token_ids(vocab);
    let token_space = TokenSpace {
        seed: args.seed,
        offset,
        range,
    };
    let eos = loaded
        .as_ref()
        .map(|m| m.tokenizer.eos_token_ids().to_vec())
        .unwrap_or_default();
    let block_size = 16;
    let max_num_seqs = args.decode_batch.unwrap_or(args.max_num_seqs);
    if let Some(n) = args.num_kv_blocks {
        // Before the backend is built: a cache too small for the run is known now.
        check_fits_cache(&lengths, n, block_size, args.dataset)?;
    }
    let settings = runtime::BackendSettings {
        num_blocks: args.num_kv_blocks,
        kv_cache_mb: KV_MB,
        gpu_memory_utilization: args.gpu_memory_utilization,
        block_size,
        threads: args.threads,
        max_batch_tokens: args.max_num_batched_tokens,
        max_batch_tokens_setting: "--max-num-batched-tokens",
        max_num_seqs,
        quantization: args.quantization,
        kv_cache_dtype: args.kv_cache_dtype,
        cpu_precision: args.cpu_precision,
        host_kv_bytes,
        kv_setting_names: switchyard_gpu::KvSettingNames {
            tier: "--kv-offloading-size",
            cache: "--num-kv-blocks",
            blocks: "--num-kv-blocks",
        },
    };
    let (backend, chosen) = runtime::build_backend(kind, source, &settings)?;
    anyhow::ensure!(
        adapter.is_none() || backend.lora_slots() > 0,
        "--lora: the {} backend does not run LoRA adapters",
        backend.name()
    );
    drop(loaded);
    let num_blocks = backend.num_kv_blocks();
    check_fits_cache(&lengths, num_blocks, block_size, args.dataset)?;
    // `build_backend` refused a tier too large for the scheduler or the memory.
    let num_host_blocks = backend.num_host_kv_blocks();
    let backend_name = backend.name().to_string();
    let scheduler = SchedulerConfig {
        max_num_seqs,
        max_num_batched_tokens: args.max_num_batched_tokens,
        block_size,
        num_gpu_blocks: num_blocks,
        enable_prefix_caching: true,
        max_model_len,
        tiers: Vec::new(),
        max_logit_rows: switchyard_gpu::backend::MAX_LOGIT_ROWS,
        max_loras: 4,
        speculative: runtime::speculative_from_args(&args.speculative)?,
        sliding_window: runtime::sliding_window(&config, backend.as_ref()),
        // Offline work has no client to give up: no queue bound.
        max_queue_ms: None,
        num_host_blocks,
        kv_offload_ahead: !args.kv_offloading_on_eviction,
    };
    let mut engine = runtime::offline_core(backend, scheduler, args.async_scheduling)?;
    anyhow::ensure!(
        args.temperature.is_finite() && (0.0..=100.0).contains(&args.temperature),
        "--temperature must be in 0..=100"
    );
    let sampling = Arc::new(if texts.is_empty() {
        SamplingParams {
            temperature: args.temperature,
            ignore_eos: true,
            ..SamplingParams::default()
        }
    } else {
        SamplingParams {
            temperature: args.temperature,
            eos_token_ids: eos.clone(),
            ..SamplingParams::default()
        }
    });
    let bar = super::progress("bench throughput", lengths.len() as u64, "requests added");
    let mut prompt_tokens = 0usize;
    // The time spent adding the requests to the engine.
    let mut added = Duration::ZERO;
    for (i, &(input, output)) in lengths.iter().enumerate() {
        let limits = match texts.get(i) {
            // Real prompts end where the model ends them.
            Some(_) => SamplingLimits {
                max_tokens: output as u32,
                stop_token_ids: eos.iter().skip(1).copied().collect(),
                eos_token_id: eos.first().copied(),
                ..SamplingLimits::default()
            },
            None => SamplingLimits {
                max_tokens: output as u32,
                ignore_eos: true,
                ..SamplingLimits::default()
            },
        };
        // Random ids away from the first 256 (special and byte tokens), unique per prompt; a
        // mooncake row's blocks as `bench serve` builds them.
        let prompt: Vec<u32> = match (texts.get(i), blocks.get(i)) {
            (Some(t), _) => t.clone(),
            (None, Some(Some(ids))) => mooncake::block_prompt(
                ids,
                input,
                args.mooncake.block_tokens(),
                token_space,
                &mut rng,
            ),
            (None, _) => (0..input)
                .map(|_| (256 + rng.random_range(0..vocab.saturating_sub(256).max(1))) as u32)
                .collect(),
        };
        prompt_tokens += input;
        // vLLM's timer runs from handing the requests to the engine (`llm.generate`) to the
        // last output: adding them (and compiling their grammars) is timed, drawing their
        // prompts is not.
        let adding = Instant::now();
        let sampling = match &grammars {
            None => sampling.clone(),
            Some((compiler, spec, eos)) => {
                let constraint = compiler
                    .compile(spec, eos, 1)
                    .map_err(|e| anyhow::anyhow!("--regex: {e}"))?
                    .pop();
                Arc::new(SamplingParams {
                    constraint,
                    ..(*sampling).clone()
                })
            }
        };
        let mut submit = SubmitOptions::offline(i as u64, prompt, limits, sampling);
        if let Some(a) = &adapter {
            submit = submit.with_adapter(1, a.clone());
        }
        engine.core().add_request(submit)?;
        added += adding.elapsed();
        bar.inc(1);
    }
    bar.finish();
    let bar = super::progress("bench throughput", lengths.len() as u64, "requests");
    let start = Instant::now();
    let (mut output_tokens, mut steps, mut overhead_us) = (0usize, 0u64, 0u64);
    // Decode steps: those after every request has its first token and before any finishes.
    let mut first_token = std::collections::HashSet::new();
    let mut finished_any = false;
    // Each measured decode step's time and the tokens it produced.
    let mut decode_steps: Vec<(u64, usize)> = Vec::new();
    // The most KV blocks in use after any step.
    let mut peak_blocks = 0usize;
    // Prompt tokens the prefix cache served, over the requests (each counted once, at its
    // first token, as a response's `cached_tokens`).
    let mut cached_tokens = 0u64;
    while engine.core().has_unfinished() {
        let all_started = first_token.len() == lengths.len();
        let t0 = Instant::now();
        let report = engine.step(Timestamp(start.elapsed().as_micros() as u64))?;
        let step_us = t0.elapsed().as_micros() as u64;
        steps += 1;
        overhead_us += report.plan_us + report.apply_us;
        peak_blocks = peak_blocks.max(num_blocks - engine.core().stats().num_free_blocks);
        let mut finished_now = false;
        let mut step_tokens = 0usize;
        for e in &report.events {
            match e {
                CoreEvent::Token { id, .. } => {
                    output_tokens += 1;
                    step_tokens += 1;
                    first_token.insert(*id);
                }
                CoreEvent::Finished { .. } => {
                    bar.inc(1);
                    finished_now = true;
                }
                CoreEvent::PromptCached { tokens, .. } => cached_tokens += u64::from(*tokens),
                CoreEvent::PromptLogprobs { .. } | CoreEvent::Hidden { .. } => {}
            }
        }
        if all_started && !finished_any && !finished_now {
            decode_steps.push((step_us, step_tokens));
        }
        finished_any |= finished_now;
    }
    bar.finish();
    let secs = (added + start.elapsed()).as_secs_f64().max(1e-9);
    let n = lengths.len() as f64;
    let mut decode_step_us: Vec<u64> = decode_steps.iter().map(|&(us, _)| us).collect();
    decode_step_us.sort_unstable();
    let median_ms = decode_step_us
        .get(decode_step_us.len() / 2)
        .map(|&us| us as f64 / 1000.0);
    let decode_rate = decode_tokens_per_second(&decode_steps);
    let mut result = serde_json::json!({
        "backend": match chosen {
            switchyard_config::BackendKind::Cuda => "cuda",
            _ => "cpu",
        },
        "backend_name": backend_name,
        "elapsed_time": secs,
        "num_requests": lengths.len(),
        "total_num_tokens": prompt_tokens + output_tokens,
        "requests_per_second": n / secs,
        "tokens_per_second": (prompt_tokens + output_tokens) as f64 / secs,
        "output_tokens_per_second": output_tokens as f64 / secs,
        "total_prompt_tokens": prompt_tokens,
        "total_output_tokens": output_tokens,
        "steps": steps,
        "async_scheduling": engine.async_scheduling(),
        "engine_overhead_us_per_step": overhead_us as f64 / steps.max(1) as f64,
        "kv_cache_blocks": num_blocks,
        "kv_blocks_used_max": peak_blocks,
        "preemptions": engine.core().stats().num_preemptions,
        "cached_prompt_tokens": cached_tokens,
        "cached_prompt_fraction": fraction(cached_tokens, prompt_tokens),
    });
    let stats = engine.core().stats();
    if num_host_blocks > 0 {
        result["kv_offload_blocks"] = num_host_blocks.into();
        result["kv_offload_stored_blocks"] = stats.num_kv_offloaded_blocks.into();
        result["kv_offload_stored_ahead_blocks"] = stats.num_kv_stored_ahead_blocks.into();
        result["kv_offload_loaded_blocks"] = stats.num_kv_loaded_blocks.into();
        result["kv_offload_prefix_hit_tokens"] = stats.num_host_hit_tokens.into();
    }
    if let Some(t) = trace_reuse {
        result["trace_reusable_prompt_tokens"] = t.reusable.into();
        result["trace_reusable_fraction"] = fraction(t.reusable as u64, t.input).into();
    }
    let spec = engine.core().spec_decode_stats();
    if spec.num_drafts > 0 {
        result["spec_decode_num_drafts"] = spec.num_drafts.into();
        result["spec_decode_num_draft_tokens"] = spec.num_draft_tokens.into();
        result["spec_decode_num_accepted_tokens"] = spec.num_accepted_tokens.into();
    }
    if let (Some(b), Some(ms), Some(rate)) = (args.decode_batch, median_ms, decode_rate) {
        result["decode_batch"] = b.into();
        result["decode_steps_measured"] = decode_step_us.len().into();
        result["decode_ms_per_step_median"] = ms.into();
        result["decode_tokens_per_second"] = rate.into();
    }
    if args.json {
        println!("{result}");
    } else {
        println!(
            "Throughput: {:.2} requests/s, {:.2} total tokens/s, {:.2} output tokens/s",
            n / secs,
            (prompt_tokens + output_tokens) as f64 / secs,
            output_tokens as f64 / secs
        );
        println!("Total num prompt tokens:  {prompt_tokens}");
        println!("Total num output tokens:  {output_tokens}");
        println!(
            "Engine overhead (plan + apply) per step: {:.1} us over {steps} steps",
            overhead_us as f64 / steps.max(1) as f64
        );
        println!("Backend: {backend_name}");
        println!(
            "KV cache: {num_blocks} blocks of {block_size}, at most {peak_blocks} in use; {} \
             preemptions",
            engine.core().stats().num_preemptions
        );
        println!(
            "Prompt tokens from the prefix cache: {cached_tokens} ({:.1}% of the prompt tokens)",
            100.0 * fraction(cached_tokens, prompt_tokens)
        );
        if let Some(t) = trace_reuse {
            println!(
                "Trace's reusable prompt tokens: {} ({:.1}% of its tokens)",
                t.reusable,
                100.0 * fraction(t.reusable as u64, t.input)
            );
        }
        if num_host_blocks > 0 {
            println!(
                "Host KV tier: {num_host_blocks} blocks; {} stored ({} ahead of eviction), {} \
                 loaded; {} prompt tokens found there",
                stats.num_kv_offloaded_blocks,
                stats.num_kv_stored_ahead_blocks,
                stats.num_kv_loaded_blocks,
                stats.num_host_hit_tokens
            );
        }
        if spec.num_drafts > 0 {
            println!(
                "Speculative decoding: {} of {} draft tokens accepted ({:.1}%), {:.2} per draft",
                spec.num_accepted_tokens,
                spec.num_draft_tokens,
                100.0 * spec.num_accepted_tokens as f64 / spec.num_draft_tokens as f64,
                spec.num_accepted_tokens as f64 / spec.num_drafts as f64
            );
        }
        if let (Some(b), Some(ms), Some(rate)) = (args.decode_batch, median_ms, decode_rate) {
            println!(
                "Decode at batch {b}: {ms:.3} ms per step (median of {} steps), {rate:.0} tokens/s",
                decode_step_us.len(),
            );
        }
    }
    Ok(())
}

/// `part` of `whole` as a fraction (0 of nothing).
fn fraction(part: u64, whole: usize) -> f64 {
    if whole == 0 {
        0.0
    } else {
        part as f64 / whole as f64
    }
}

/// Decode throughput over the measured steps, `(microseconds, tokens produced)` each: their
/// tokens over their time. A speculative step produces a token per sequence plus the drafts
/// it accepted, so the batch size times the step rate would undercount it. `None` without a
/// measured step (or no time).
fn decode_tokens_per_second(steps: &[(u64, usize)]) -> Option<f64> {
    let us: u64 = steps.iter().map(|&(us, _)| us).sum();
    let tokens: usize = steps.iter().map(|&(_, t)| t).sum();
    (us > 0).then(|| tokens as f64 * 1e6 / us as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every id drawn is below the vocabulary: `offset + range <= vocab`, and at least one id.
    #[test]
    fn mooncake_token_ids_stay_in_the_vocabulary() {
        // SmolLM2 (49,152 ids) and Llama-3 (128,256): bench serve's defaults.
        assert_eq!(mooncake_token_ids(49_152), (1000, 20_000));
        assert_eq!(mooncake_token_ids(128_256), (1000, 20_000));
        // Narrowed above the offset, the whole vocabulary at or below it.
        assert_eq!(mooncake_token_ids(1500), (1000, 500));
        assert_eq!(mooncake_token_ids(1001), (1000, 1));
        assert_eq!(mooncake_token_ids(1000), (0, 1000));
        assert_eq!(mooncake_token_ids(256), (0, 256));
        assert_eq!(mooncake_token_ids(0), (0, 1));
        for vocab in [2u64, 999, 1000, 1001, 1002, 20_999, 21_000, 21_001, 1 << 40] {
            let (o, r) = mooncake_token_ids(vocab);
            assert!(
                r >= 1 && u64::from(o) + u64::from(r) <= vocab.max(1),
                "{vocab}"
            );
        }
    }

    /// ShareGPT lengths are read by column name, as `bench serve` and the simulator read them.
    #[test]
    fn sharegpt_columns_are_read_by_name() {
        let path = Path::new("d.csv");
        let text = "\u{feff}num_decode_tokens,pd_ratio,num_prefill_tokens\n5,0.1,50\n";
        assert_eq!(sharegpt_lengths(path, text, 1000).unwrap(), vec![(50, 5)]);
        let e = sharegpt_lengths(path, "a,b\n1,2\n", 1000).unwrap_err();
        assert!(
            format!("{e:#}").contains("no column num_prefill_tokens"),
            "{e:#}"
        );
    }

    #[test]
    fn batch_limits_are_checked_under_their_flag_names() {
        let (cpu, auto, cuda) = (BackendKind::Cpu, BackendKind::Auto, BackendKind::Cuda);
        check_batch_flags(cpu, 256, 8192).unwrap();
        check_batch_flags(cpu, 2048, 1 << 20).unwrap();
        let e = check_batch_flags(cpu, 256, 0).unwrap_err().to_string();
        assert!(
            e.starts_with("--max-num-batched-tokens must be 1..=1048576")
                && !e.contains("max_batch"),
            "{e}"
        );
        let e = check_batch_flags(cpu, 0, 8192).unwrap_err().to_string();
        assert!(e.starts_with("--max-num-seqs must be 1..=2048"), "{e}");
        assert!(check_batch_flags(cpu, 2049, 8192).is_err());
        // The CUDA backend runs at most 65,536 tokens a step: refused under the flag's name
        // with --backend cuda, before the model loads; auto is checked once it picks a GPU.
        check_batch_flags(cuda, 256, 65_536).unwrap();
        check_batch_flags(auto, 256, 65_537).unwrap();
        let e = check_batch_flags(cuda, 256, 65_537)
            .unwrap_err()
            .to_string();
        assert_eq!(
            e,
            "--max-num-batched-tokens 65537 is more than the CUDA backend runs in one step, at \
             most 65536: lower it, or run on the CPU backend"
        );
    }

    fn throughput_args(extra: &str) -> ThroughputArgs {
        use clap::Parser;
        let argv = ["switchyard", "bench", "throughput"]
            .into_iter()
            .chain(extra.split_whitespace());
        match crate::cli::Cli::try_parse_from(argv)
            .expect("parses")
            .command
        {
            crate::cli::Command::Bench(BenchCommand::Throughput(a)) => a,
            other => panic!("parsed {other:?}"),
        }
    }

    /// The mooncake flags are bounded and refused as `bench serve` refuses them, the cache
    /// flags as the configuration bounds cache.num_blocks and cache.kv_offloading_size, all
    /// before the model loads.
    #[test]
    fn dataset_and_cache_flags_are_refused_out_of_range() {
        let ok = |extra: &str| validate(&throughput_args(extra));
        assert_eq!(ok("").unwrap(), 0);
        assert_eq!(ok("--kv-offloading-size 1").unwrap(), 1 << 30);
        assert_eq!(ok("--kv-offloading-size 0.5").unwrap(), 1 << 29);
        assert_eq!(ok("--kv-offloading-size 1024").unwrap(), 1 << 40);
        ok("--num-kv-blocks 1").unwrap();
        ok("--num-kv-blocks 16777216").unwrap();
        ok("--input-len 1048576 --output-len 1").unwrap();
        ok(
            "--dataset mooncake --mooncake-block-tokens 4096 --skip-rows 10000000 \
            --max-input-len 1048576 --max-output-len 1",
        )
        .unwrap();
        let cases = [
            ("--num-kv-blocks 0", "--num-kv-blocks must be 1..=16777216 (the server's cache.num_blocks), not 0"),
            ("--num-kv-blocks 16777217", "--num-kv-blocks must be 1..=16777216"),
            ("--kv-offloading-size -1", "--kv-offloading-size -1 must be a size in GiB in 0..=1024 (the server's cache.kv_offloading_size; 0: no host tier)"),
            ("--kv-offloading-size 1024.5", "--kv-offloading-size 1024.5 must be"),
            ("--kv-offloading-size nan", "--kv-offloading-size NaN must be"),
            ("--kv-offloading-size inf", "--kv-offloading-size inf must be"),
            ("--dataset mooncake --mooncake-block-tokens 0", "--mooncake-block-tokens must be 1..=4096, not 0"),
            ("--dataset mooncake --mooncake-block-tokens 4097", "--mooncake-block-tokens must be 1..=4096, not 4097"),
            ("--dataset mooncake --skip-rows 10000001", "--skip-rows must be 0..=10000000, not 10000001"),
            ("--dataset mooncake --max-input-len 0", "--max-input-len must be 1..=1048576, not 0"),
            ("--dataset mooncake --max-output-len 1048577", "--max-output-len must be 1..=1048576, not 1048577"),
            // The random dataset's lengths, as `bench serve` bounds them (a 0 was refused
            // only once the model had loaded).
            ("--input-len 0", "--input-len must be 1..=1048576, not 0"),
            ("--output-len 0", "--output-len must be 1..=1048576, not 0"),
            ("--input-len 1048577", "--input-len must be 1..=1048576, not 1048577"),
            // Only the mooncake dataset has blocks, rows to skip and rows to bound.
            ("--mooncake-block-tokens 64", "--mooncake-block-tokens needs --dataset mooncake"),
            ("--dataset sharegpt --skip-rows 1", "--skip-rows needs --dataset mooncake"),
            ("--max-input-len 64", "--max-input-len needs --dataset mooncake"),
            ("--dataset prompts --max-output-len 4", "--max-output-len needs --dataset mooncake"),
        ];
        for (extra, want) in cases {
            let e = ok(extra).unwrap_err().to_string();
            assert!(e.starts_with(want), "{extra}: got {e}");
        }
    }

    /// A negative count is refused naming its flag (clap would otherwise take `-3` for an
    /// unknown option and name no flag), in `bench throughput` and in `bench serve`.
    #[test]
    fn negative_counts_are_refused_naming_their_flag() {
        use clap::Parser;
        let flags = [
            "--num-kv-blocks",
            "--mooncake-block-tokens",
            "--skip-rows",
            "--max-input-len",
            "--max-output-len",
        ];
        for (command, flags) in [
            (&["bench", "throughput"][..], &flags[..]),
            (
                &["bench", "serve", "--base-url", "http://localhost:1"][..],
                &flags[1..],
            ),
        ] {
            for flag in flags {
                let tail = ["--dataset", "mooncake", flag, "-3"];
                let argv = ["switchyard"].iter().chain(command).chain(&tail);
                let e = crate::cli::Cli::try_parse_from(argv)
                    .expect_err("a negative count")
                    .to_string();
                assert!(
                    e.contains(&format!("invalid value '-3' for '{flag} <")),
                    "{command:?} {flag}: {e}"
                );
            }
        }
    }

    /// A request longer than the whole KV cache could never run: refused, naming the flags
    /// that shorten the dataset's requests (the random dataset's --input-len, not the mooncake
    /// dataset's --max-input-len, which is refused with it).
    #[test]
    fn requests_must_fit_the_kv_cache() {
        let too_long = |dataset| {
            check_fits_cache(&[(60, 4), (100, 29)], 8, 16, dataset)
                .unwrap_err()
                .to_string()
        };
        check_fits_cache(&[(60, 4), (100, 28)], 8, 16, BenchDataset::Random).unwrap();
        let head =
            "a request of 129 tokens (prompt and output) does not fit in the KV cache's 128 \
                    tokens (8 blocks of 16): raise --num-kv-blocks";
        for (dataset, tail) in [
            (BenchDataset::Random, " or lower --input-len / --output-len"),
            (
                BenchDataset::Mooncake,
                " or lower --max-input-len / --max-output-len",
            ),
            (
                BenchDataset::Prompts,
                " or lower --output-len (or pass shorter prompts)",
            ),
            (BenchDataset::Sharegpt, ""),
        ] {
            assert_eq!(too_long(dataset), format!("{head}{tail}"), "{dataset:?}");
        }
        check_fits_cache(&[], 1, 16, BenchDataset::Mooncake).unwrap();
    }

    /// The mooncake dataset's default file is the shipped trace beside the repository;
    /// missing, the error names it and the flag to pass another.
    #[test]
    fn the_mooncake_default_file_is_named_when_missing() {
        let mut args = throughput_args("--dataset mooncake");
        args.dataset_path = None;
        let cwd_has_it = Path::new(MOONCAKE_DEFAULT_PATH).exists();
        match read_dataset_file(&args) {
            Ok(Some((path, text))) => {
                assert!(cwd_has_it);
                assert_eq!(path, Path::new(MOONCAKE_DEFAULT_PATH));
                let rows = mooncake_rows(&args, &path, &text, 1 << 20).unwrap();
                assert_eq!(rows.len(), 32, "--num-prompts' default rows");
            }
            Ok(None) => panic!("the mooncake dataset has a default file"),
            Err(e) => {
                assert!(!cwd_has_it);
                let e = format!("{e:#}");
                assert!(
                    e.contains(MOONCAKE_DEFAULT_PATH) && e.contains("--dataset-path"),
                    "{e}"
                );
            }
        }
    }

    /// The dataset file is read (and its start checked) before the model loads: none for
    /// random prompts, and `--dataset prompts` without a file is refused then too.
    #[test]
    fn the_dataset_file_is_read_and_checked_before_the_model_loads() {
        let random = throughput_args("--dataset random");
        assert!(read_dataset_file(&random).unwrap().is_none());
        let mut prompts = throughput_args("--dataset prompts");
        prompts.dataset_path = None;
        let e = format!("{:#}", read_dataset_file(&prompts).unwrap_err());
        assert_eq!(e, "--dataset prompts needs --dataset-path FILE");
        let dir = crate::scratch::ScratchDir::new("bench-throughput-dataset-start");
        let mut sharegpt = throughput_args("--dataset sharegpt");
        let path = dir.join("d.csv");
        sharegpt.dataset_path = Some(path.clone());
        std::fs::write(&path, "num_prefill_tokens,num_decode_tokens\n12,5\n").unwrap();
        let (read, text) = read_dataset_file(&sharegpt).unwrap().unwrap();
        assert_eq!(
            (read.as_path(), text.as_str()),
            (
                path.as_path(),
                "num_prefill_tokens,num_decode_tokens\n12,5\n"
            )
        );
        // JSON where a CSV is due: refused at its header, naming the file and the flag.
        std::fs::write(&path, "{\"input_length\": 8}\n").unwrap();
        let e = format!("{:#}", read_dataset_file(&sharegpt).unwrap_err());
        assert!(
            e.starts_with(&format!(
                "the dataset file {} (pass another with --dataset-path): ",
                path.display()
            )) && e.contains("the header has no column num_prefill_tokens"),
            "{e}"
        );
        let mut mooncake = throughput_args("--dataset mooncake");
        mooncake.dataset_path = Some(path.clone());
        std::fs::write(&path, "num_prefill_tokens,num_decode_tokens\n12,5\n").unwrap();
        let e = format!("{:#}", read_dataset_file(&mooncake).unwrap_err());
        assert!(
            e.contains("not JSON Lines of objects (its first character is `n`"),
            "{e}"
        );
    }

    #[test]
    fn decode_throughput_counts_the_tokens_the_steps_produced() {
        // Batch 4 at 10 ms a step: 400 tokens/s without drafts; with two drafts accepted per
        // sequence in every step, 12 tokens a step, 1200 tokens/s (not batch × step rate).
        assert_eq!(decode_tokens_per_second(&[(10_000, 4); 3]), Some(400.0));
        assert_eq!(
            decode_tokens_per_second(&[(10_000, 12), (10_000, 12)]),
            Some(1200.0)
        );
        assert_eq!(decode_tokens_per_second(&[]), None);
    }
}
