//! `switchyard serve`: the YAML-configured OpenAI-compatible server.
//!
//! The HTTP layer (`switchyard-api`) talks to the engine through its `Engine` port; this module
//! adapts the actor engine (`switchyard-actors`) to that port, so neither crate knows the other.
//! Everything the configuration can get wrong is checked before the (slow) model load, except
//! what needs the model (`model.max_model_len` against its context, and against the KV cache
//! the backend sized). Signals are handled in [`shutdown`], SIGHUP's reload in [`reload`].
//! The model's load and the engine's configuration ([`load_engine`]) and the engine's start
//! ([`start_engine`]) are shared with `run-batch`, which answers batch files through the same
//! engine and HTTP layer.

mod checks;
mod engine_life;
mod reload;
mod shutdown;

pub(super) use engine_life::run_engine;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use parking_lot::Mutex;
use switchyard_actors::actors::{
    AdapterInfo, BackendReleased, BeamOptions, ChoiceDelta, Engine as ActorEngine, EngineConfig,
    EngineOutput, LoraManagerConfig, OutputSink, PromptSource, RequestOptions, SubmitError,
    SubmitErrorKind, TokenLogprobs,
};
use switchyard_actors::structured::StructuredOutput;
use switchyard_actors::token_filters::TokenFilters;
use switchyard_api::engine::{
    self as port, Delta, EngineError, EngineErrorKind, EngineEvent, EngineFuture, Finish,
    GenerateRequest, LoraAdapterInfo, PolicyInfo, PolicySpec, PolicySwap, SpeculativeMethod,
    SpeculativeSettings, TokenLogprob, TokenizeInput, TopLogprob,
};
use switchyard_api::rate_limit::TierLimits;
use switchyard_api::response_store::ResponseStore;
use switchyard_api::schema::{
    reasoning,
    tools::{writes_call_ids, MarkerTokens, ToolFormat, ToolSetup},
};
use switchyard_api::tls::CertificateResolver;
use switchyard_api::{AdapterAccess, ApiConfig, ApiKeyEntry, ApiState, ServerOptions, StoreLimits};
use switchyard_config::{Config, ReasoningParser, ToolCallFormat, ToolPrompt};
use switchyard_gpu::backend::{SamplingParams, MAX_LOGIT_ROWS};
use switchyard_gpu::model::{ChatEnding, ChatMessage, ChatTemplate, Tokenizer};
use switchyard_gpu::LoraLimits;
use switchyard_policies::{
    FinishReason, Policy, PolicyError, PolicyRegistry, SchedulerConfig, TierSpec,
};
use tokio::signal::unix::{signal, SignalKind};
use tokio::sync::mpsc;

use super::runtime;
use super::stop_signals::{self, Interrupted, StopSignals};
use crate::cli::ServeArgs;

/// Deltas buffered per request before a slow client is cut off.
const CHANNEL_CAPACITY: usize = 4096;

pub fn run(args: ServeArgs) -> anyhow::Result<()> {
    // SIGHUP's default action ends the process, and the signal loop ([`shutdown`]) starts
    // only once the model is loaded: take the signal over first. tokio's handler stays
    // installed from here on and keeps a hang-up that arrives meanwhile for the loop, which
    // then reloads (the file may have changed since it was read).
    let system = actix_web::rt::System::new();
    let hangup = system
        .block_on(async { signal(SignalKind::hangup()) })
        .context("cannot install the SIGHUP handler")?;
    let super::config::Checked {
        config,
        tls: certificate,
    } = super::config::load_checked(&args.config, &args.overrides)?;
    // The recorder goes in first so that no metric recorded during start-up is lost.
    let prometheus = match switchyard_api::metrics::install_prometheus_recorder() {
        Ok(handle) => {
            switchyard_actors::metric_names::register_at_zero();
            register_tier_series(&config);
            metrics::counter!(switchyard_api::metrics::POLICY_SWAPS).increment(0);
            // The HTTP layer moves it per request: made here so that it is there from the start.
            metrics::gauge!(switchyard_api::metrics::HTTP_IN_FLIGHT).set(0.0);
            Some(handle)
        }
        Err(e) => {
            eprintln!("warning: /metrics disabled: {e}");
            None
        }
    };
    super::init_logging(
        &config.logging.level,
        config.logging.format == switchyard_config::LogFormat::Json,
    );
    // The certificate's expiry: a gauge, and a warning as it nears (it is served regardless).
    if let Some(key) = &certificate {
        switchyard_api::tls::report_expiry(key);
    }
    let path = runtime::config_model_path(&config)?;
    // Everything that can be checked without the model is checked before its (slow) load,
    // so a typo fails fast: the load format, the address (bound here: a port in use fails
    // now), the policy, the TLS certificate and key (read above) and the API keys.
    check_load_format(&config, &path)?;
    let bind = SocketAddr::new(
        config
            .server
            .bind_ip()
            .map_err(|why| anyhow::anyhow!("server.host: {why}"))?,
        config.server.port,
    );
    let tiers: Vec<TierSpec> = super::config::tier_specs(&config);
    let policy = super::config::build_policy(&config.scheduler.policy, &tiers)
        .with_context(|| format!("{}: scheduler.policy", args.config.display()))?;
    let api_keys = config.load_api_keys()?;
    // The stored responses' journal is locked and read now: a second server on its directory
    // fails before the model loads.
    let responses = Arc::new(ResponseStore::open(
        store_limits(&config),
        config
            .server
            .responses
            .path
            .as_deref()
            .map(switchyard_config::expand_home)
            .as_deref(),
    )?);
    // The tenants the keys name label the usage counters (no other value does); like the
    // tiers, they change only with a restart, and their series are made once.
    let key_tenants = key_tenants(&config, &api_keys);
    if prometheus.is_some() {
        switchyard_actors::metric_names::register_tenants(&key_tenants);
    }
    // Bound now, so that an address in use fails before the model loads.
    let listener = checks::listen(bind, |field| {
        super::config::field_origin(&args.config, &args.overrides, field)
    })?;
    checks::warn_if_open(api_keys.is_empty(), bind);
    // From here on SIGINT and SIGTERM are watched: during the load, which they end at once,
    // then (the same listeners, so that none is lost while the engine starts) by the loop.
    let mut stops = StopSignals::install(&system)?;
    let loaded = match load_engine_interruptible(
        &system,
        &mut stops,
        &config,
        &path,
        &tiers,
        LoadOptions {
            metrics: prometheus.is_some(),
            metrics_tenants: key_tenants.into_iter().map(|(tenant, _)| tenant).collect(),
        },
    ) {
        Ok(loaded) => loaded,
        // A stop asked for before the server started is still the stop asked for, not a
        // failure: the process exits 0, as after a drain (see `stop_signals`).
        Err(e) => match e.downcast::<Interrupted>() {
            Ok(stop) => {
                tracing::info!(
                    signal = stop.signal.name(),
                    "stopped while the model loaded: the server did not start"
                );
                // Not by returning: the load runs on on its abandoned thread.
                stop_signals::exit_now(0);
            }
            Err(e) => return Err(e),
        },
    };
    let api_is_open = api_keys.is_empty();
    let api_config = loaded.api_config(&config, api_keys);
    let options = ServerOptions {
        // The socket bound at the start.
        bind: Vec::new(),
        workers: config.server.workers,
        shutdown_timeout: Duration::from_secs(config.server.drain_timeout_s),
        client_request_timeout: Duration::from_secs(config.server.request_timeout_s),
    };
    let drain = Duration::from_secs(config.server.drain_timeout_s);
    let config_path = args.config.clone();
    let overrides = args.overrides.clone();
    let served = run_engine(system, |system, slot| {
        system.block_on(async move {
            let RunningEngine {
                adapter,
                file_adapters,
            } = start_engine(loaded, policy, &config, tiers, slot, &|field| {
                super::config::field_origin(&config_path, &overrides, field)
            })
            .await?;
            let drain_engine = adapter.engine.clone();
            let state = ApiState::new(adapter.clone(), api_config, prometheus)
                .with_response_store(Arc::clone(&responses));
            // With TLS, new connections get the certificate the resolver holds: SIGHUP replaces it.
            let tls = certificate.map(|key| Arc::new(CertificateResolver::new(key)));
            let (server, addrs) = switchyard_api::build_server_on(
                state.clone(),
                &options,
                vec![listener],
                tls.clone(),
            )?;
            let handle = server.handle();
            let scheme = if tls.is_some() { "https" } else { "http" };
            for addr in &addrs {
                tracing::info!(url = %format!("{scheme}://{addr}"), "serving");
            }
            let reloader = reload::Reloader::new(
                adapter,
                reload::Started {
                    api: state.clone(),
                    open: api_is_open,
                    path: config_path,
                    overrides,
                    config,
                    file_adapters,
                    tls,
                },
            );
            // Signals: SIGTERM/SIGINT drain then stop (a second one ends the drain); SIGHUP
            // re-reads the policy section and the adapters (one reload at a time, in the
            // background).
            let shutdown = shutdown::Shutdown {
                state,
                engine: drain_engine,
                handle,
                drain,
            };
            actix_web::rt::spawn(shutdown::handle_signals(hangup, stops, reloader, shutdown));
            server.await?;
            // Background responses that ended during the drain are in the journal before exit.
            responses.sync();
            anyhow::Ok(())
        })
    });
    if served.is_ok() {
        tracing::info!("stopped");
    }
    served
}

/// Refuses a `model.load_format` that names another format than the one at `path`: checked
/// before the model loads.
pub(super) fn check_load_format(config: &Config, path: &Path) -> anyhow::Result<()> {
    checks::load_format(config.model.load_format, path)
}

/// What [`load_engine`] needs beyond the configuration.
pub(super) struct LoadOptions {
    /// Whether a metrics recorder is installed (`/metrics` served): then the cache's
    /// configuration is recorded as an info gauge.
    pub metrics: bool,
    /// The tenants the API keys name, whose usage counters the engine keeps.
    pub metrics_tenants: std::collections::BTreeSet<String>,
}

/// The model loaded and the engine configured, not yet started: what `serve` and `run-batch`
/// build alike from a configuration.
pub(super) struct LoadedEngine {
    /// The engine's configuration (scheduler, LoRA, tokenizer threads, pending bounds).
    engine_config: EngineConfig,
    /// The backend, holding the weights and the KV cache.
    backend: Box<dyn switchyard_gpu::backend::Backend>,
    /// The model's tokenizer.
    tokenizer: Arc<Tokenizer>,
    /// The chat template (`model.chat_template` or the model's own), if any.
    template: Option<Arc<ChatTemplate>>,
    /// The name clients call the model by.
    model_name: String,
    /// The longest sequence served, in tokens.
    max_model_len: usize,
    /// The length of the embeddings served; `None` with `server.embeddings: false`.
    embedding_size: Option<usize>,
    /// How the model writes tool calls, and who writes tools into prompts.
    tools: ToolSetup,
    /// The reasoning tags read apart from chat answers, if any.
    reasoning: Option<reasoning::ThinkTags>,
    /// The reasoning tags' ids where they are special tokens.
    reasoning_tokens: [Option<u32>; 2],
}

impl LoadedEngine {
    /// The HTTP layer's settings for this model with `keys` (none: an open API).
    pub(super) fn api_config(
        &self,
        config: &Config,
        keys: Vec<switchyard_config::ApiKeyEntry>,
    ) -> ApiConfig {
        let mut api = api_config(config, keys, self.tools);
        api.reasoning = self.reasoning;
        api.reasoning_tokens = self.reasoning_tokens;
        api
    }

    /// The engine's bound on requests in flight at once (`server.max_pending_requests`).
    pub(super) fn max_pending_requests(&self) -> usize {
        self.engine_config.max_pending_requests
    }
}

/// [`load_engine`] on a thread of its own, given up as soon as `stops` sees SIGINT or SIGTERM
/// (then the error is [`Interrupted`]): the load of `serve` and `run-batch`, which holds no
/// file they write and is left to end with the process.
pub(super) fn load_engine_interruptible(
    system: &actix_web::rt::SystemRunner,
    stops: &mut StopSignals,
    config: &Config,
    path: &Path,
    tiers: &[TierSpec],
    options: LoadOptions,
) -> anyhow::Result<LoadedEngine> {
    let (config, path, tiers) = (config.clone(), path.to_owned(), tiers.to_vec());
    stops.interruptible(system, "model-load", move || {
        load_engine(&config, &path, &tiers, options)
    })
}

/// Loads the model at `path` as `config` says, builds its backend and configures the engine
/// for `tiers`: everything between the checks made without the model and the engine's start.
pub(super) fn load_engine(
    config: &Config,
    path: &Path,
    tiers: &[TierSpec],
    options: LoadOptions,
) -> anyhow::Result<LoadedEngine> {
    tracing::info!(model = %path.display(), "loading model");
    let mut model = runtime::load(path)?;
    if let Some(file) = &config.model.chat_template {
        let file = runtime::expand_home(Path::new(file));
        let template =
            ChatTemplate::from_file(&file, model.chat_template.as_ref(), &model.tokenizer)
                .with_context(|| format!("model.chat_template `{}`", file.display()))?;
        model.chat_template = Some(template);
    }
    let tool_format = match config.model.tool_call_format {
        ToolCallFormat::Hermes => ToolFormat::Hermes,
        ToolCallFormat::Llama3Json => ToolFormat::Llama3Json,
        ToolCallFormat::Mistral => ToolFormat::Mistral,
        ToolCallFormat::MistralV11 => ToolFormat::MistralV11,
        ToolCallFormat::Auto => model
            .chat_template
            .as_ref()
            .map_or(ToolFormat::Hermes, |t| ToolFormat::for_template(t.source())),
    };
    let support = model
        .chat_template
        .as_ref()
        .map(ChatTemplate::tool_support)
        .unwrap_or_default();
    let template = match config.model.tool_prompt {
        ToolPrompt::Auto => support.complete(),
        ToolPrompt::Template => true,
        ToolPrompt::Server => false,
    };
    let tools = ToolSetup {
        format: tool_format,
        template,
        markers: marker_tokens(&model.tokenizer, tool_format),
        // A Mistral v11 template that writes each call's id: its model writes them too.
        call_ids: template
            && tool_format == ToolFormat::MistralV11
            && model
                .chat_template
                .as_ref()
                .is_some_and(|t| writes_call_ids(t.source())),
    };
    if tools.template && !support.complete() {
        tracing::warn!(
            writes_tools = support.tools,
            writes_calls = support.calls,
            writes_results = support.results,
            "model.tool_prompt is `template` but the chat template does not write all of a \
             request's tools, calls and results: what it leaves out will not reach the prompt \
             (the grammar still holds the answer)"
        );
    } else if !tools.template && (support.tools || support.calls) {
        tracing::info!(
            writes_tools = support.tools,
            writes_calls = support.calls,
            writes_results = support.results,
            "the chat template writes only part of what tools need: the server writes them"
        );
    }
    tracing::info!(
        tool_call_format = tool_format.name(),
        tool_prompt = if tools.template { "template" } else { "server" },
        marker_tokens = ?tools.markers.kept(),
        call_ids = tools.call_ids,
        "tool calls"
    );
    let reasoning = match config.model.reasoning_parser {
        ReasoningParser::None => None,
        ReasoningParser::Think => Some(reasoning::THINK_TAGS),
        ReasoningParser::Mistral => Some(reasoning::MISTRAL_THINK_TAGS),
        ReasoningParser::Auto => model
            .chat_template
            .as_ref()
            .and_then(|t| reasoning::ThinkTags::for_template(t.source())),
    };
    // Tags that are special tokens (Magistral's) stay in the answer's text for the splitter.
    let reasoning_tokens = reasoning.map_or([None; 2], |tags| {
        [tags.open, tags.close].map(|tag| special_token(&model.tokenizer, tag))
    });
    // Who opens the block is found per request, from the rendered prompt (QwQ's and
    // DeepSeek-R1's generation prompts open it; hybrid templates as their variables say).
    tracing::info!(
        reasoning = reasoning.is_some(),
        tags = ?reasoning.map(|t| (t.open, t.close)),
        tokens = ?reasoning_tokens,
        "reasoning parser (the think block read apart)"
    );
    // Clients name the model by its file (or directory) stem unless a served name is configured.
    let model_name = config.model.served_name.clone().unwrap_or_else(|| {
        path.file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_else(|| model.name.clone())
    });
    let max_model_len = checks::max_model_len(
        config.model.max_model_len,
        model.config.max_position_embeddings,
        path,
    )?;
    // LongRoPE's factors for the context served (`model.max_model_len` when set).
    model.config.serve_context(max_model_len);
    let tokenizer = Arc::new(model.tokenizer.clone());
    let template = model.chat_template.take().map(Arc::new);
    let block_size = config.cache.block_size;
    let settings = runtime::BackendSettings::from_config(config);
    let (backend, _) = runtime::build_backend(
        config.model.backend,
        runtime::ModelSource::Loaded(&model.config, &model.weights),
        &settings,
    )?;
    // The scheduler plans with the blocks the backend actually holds, and a sequence of
    // max_model_len tokens must fit in them (else such requests could never run).
    let num_blocks = backend.num_kv_blocks();
    // `build_backend` refused a tier too large for the scheduler or the memory before
    // building anything (`runtime::host_kv_blocks`).
    let num_host_blocks = backend.num_host_kv_blocks();
    if num_host_blocks > 0 {
        tracing::info!(
            host_blocks = num_host_blocks,
            gib = config.cache.kv_offloading_size,
            "host KV tier (cache.kv_offloading_size): evicted cached blocks are kept there"
        );
    }
    let sliding_window = runtime::sliding_window(&model.config, backend.as_ref());
    if let Some(w) = sliding_window {
        tracing::info!(
            window = w.tokens,
            read_slack = w.read_slack,
            blocks_held = w.blocks_held(block_size, config.scheduler.max_num_batched_tokens),
            "sliding window: running requests give back the KV blocks behind it, and hold at \
             most blocks_held at once"
        );
    }
    let max_model_len = checks::fit_kv_cache(
        max_model_len,
        config.model.max_model_len.is_some(),
        (num_blocks, block_size),
        config.scheduler.max_num_batched_tokens,
        sliding_window,
    )?;
    if options.metrics {
        cache_config_info(&config.cache, block_size, num_blocks);
    }
    let lora = config.lora.enabled.then(|| LoraManagerConfig {
        model: model.config.clone(),
        base_name: model_name.clone(),
        limits: LoraLimits {
            max_rank: config.lora.max_lora_rank,
            ..LoraLimits::default()
        },
        max_adapters: config.lora.max_adapters,
        max_loaded: config.lora.max_cpu_loras,
        adapter_dirs: config
            .lora
            .adapter_dirs
            .iter()
            .map(|d| switchyard_config::expand_home(d))
            .collect(),
        // What an adapter's base_model_name_or_path may call the model: its served name, its
        // own (GGUF `general.name`, or its directory's), and its file's or directory's (not
        // the directory holding a file: `model fetch`'s is a package name, such as
        // `smollm2-135m` for the Instruct model, another model's name).
        model_names: [
            Some(model_name.clone()),
            Some(model.name.clone()),
            path.file_stem().map(|s| s.to_string_lossy().into_owned()),
        ]
        .into_iter()
        .flatten()
        .filter(|n| !n.is_empty())
        .collect(),
        tenant_shares: super::config::tier_lora_share_limits(config),
    });
    let vocab_size = model.config.vocab_size;
    let embedding_size = config.server.embeddings.then_some(model.config.hidden_size);
    drop(model);
    let engine_config = EngineConfig {
        scheduler: SchedulerConfig {
            max_num_seqs: config.scheduler.max_num_seqs,
            max_num_batched_tokens: config.scheduler.max_num_batched_tokens,
            block_size,
            num_gpu_blocks: num_blocks,
            enable_prefix_caching: config.cache.prefix_caching,
            max_model_len,
            tiers: tiers.to_vec(),
            max_logit_rows: MAX_LOGIT_ROWS,
            max_loras: config.lora.max_loras,
            speculative: runtime::speculative_from_config(config.speculative.as_ref())?,
            sliding_window,
            max_queue_ms: config.scheduler.max_queue_ms,
            num_host_blocks,
            kv_offload_ahead: config.cache.kv_offloading_ahead,
        },
        lora,
        vocab_size,
        prefix_sharing_by_tenant: config.cache.prefix_sharing
            == switchyard_config::PrefixSharing::Tenant,
        message_tokens_as_text: config.model.message_special_tokens
            == switchyard_config::MessageSpecialTokens::Text,
        hash_key: runtime::random_hash_key(),
        async_scheduling: runtime::async_mode(config.scheduler.async_scheduling),
        tokenizer_threads: 2,
        max_pending_requests: config.server.max_pending_requests,
        tier_max_pending: super::config::tier_pending_limits(config),
        tier_max_pending_per_tenant: super::config::tier_pending_per_tenant_limits(config),
        metrics_tenants: options.metrics_tenants,
        step_timeout: config.scheduler.step_timeout(backend.overlaps_host()),
    };
    Ok(LoadedEngine {
        engine_config,
        backend,
        tokenizer,
        template,
        model_name,
        max_model_len,
        embedding_size,
        tools,
        reasoning,
        reasoning_tokens,
    })
}

/// The engine [`start_engine`] started.
pub(super) struct RunningEngine {
    /// The engine behind the HTTP layer's port.
    pub adapter: Arc<EngineAdapter>,
    /// The adapters `lora.adapters` registered (name, directory), for SIGHUP's reload.
    pub file_adapters: Vec<(String, std::path::PathBuf)>,
}

/// Starts the engine `loaded` describes with `policy` (built from `config`'s
/// `scheduler.policy` for `tiers`), registers `lora.adapters`, and wraps it for the HTTP
/// layer. Runs inside the actix system. `released` gets the engine's [`BackendReleased`] as
/// soon as it runs (a later step may fail), for [`stop_engine`]. `origin` says where a field
/// was set ([`super::config::field_origin`]: `config.yaml:12`, or the override), for an
/// adapter whose load fails.
pub(super) async fn start_engine(
    loaded: LoadedEngine,
    policy: Box<dyn Policy>,
    config: &Config,
    tiers: Vec<TierSpec>,
    released: &mut Option<BackendReleased>,
    origin: &dyn Fn(&str) -> String,
) -> anyhow::Result<RunningEngine> {
    let LoadedEngine {
        engine_config,
        backend,
        tokenizer,
        template,
        model_name,
        max_model_len,
        embedding_size,
        ..
    } = loaded;
    let policy_info = PolicyInfo {
        name: config.scheduler.policy.name.clone(),
        params: policy_params(&config.scheduler.policy.params),
        available: PolicyRegistry::with_builtins()
            .names()
            .iter()
            .map(|s| s.to_string())
            .collect(),
    };
    let device_backend = backend.overlaps_host();
    let engine = ActorEngine::start(engine_config, backend, tokenizer.clone(), template, policy)?;
    *released = Some(engine.backend_released());
    let mut file_adapters = Vec::new();
    for (i, a) in config.lora.adapters.iter().enumerate() {
        let path = switchyard_config::expand_home(&a.path);
        let info = engine
            .register_adapter(a.name.clone(), path.clone(), a.pinned)
            .await
            .map_err(|e| {
                // As the errors found before the load: where the entry is, then the field.
                let field = format!("lora.adapters[{i}].path");
                anyhow::anyhow!(
                    "{}: {field}: LoRA adapter `{}`: {e}",
                    origin(&field),
                    a.name
                )
            })?;
        tracing::info!(name = %info.name, rank = info.rank, pinned = info.pinned, "LoRA adapter served");
        file_adapters.push((a.name.clone(), path));
    }
    let adapter = Arc::new(EngineAdapter {
        engine,
        tokenizer,
        model_name,
        max_model_len,
        embedding_size,
        ready: AtomicBool::new(true),
        tiers: parking_lot::RwLock::new(tiers),
        tier_priorities: parking_lot::RwLock::new(tier_priorities(config)),
        policy: Mutex::new(policy_info),
        speculative: Arc::new(tokio::sync::Mutex::new(config.speculative.as_ref().map(
            |s| SpeculativeSettings {
                method: match s.method {
                    switchyard_config::SpeculativeMethod::Ngram => SpeculativeMethod::Ngram,
                },
                num_speculative_tokens: s.num_speculative_tokens,
                prompt_lookup_min: s.prompt_lookup_min,
                prompt_lookup_max: s.prompt_lookup_max,
                max_running: s.max_running,
            },
        ))),
        lora_enabled: config.lora.enabled,
        device_backend,
    });
    metrics::gauge!(switchyard_api::metrics::POLICY_INFO, "policy" => policy_label(&adapter.policy.lock().name)).set(1.0);
    Ok(RunningEngine {
        adapter,
        file_adapters,
    })
}

/// The ids of `format`'s markers that are special tokens of the model's tokenizer (Mistral's
/// tokenizers have `[TOOL_CALLS]`, and from v11 on `[ARGS]` and `[CALL_ID]`, as special tokens).
fn marker_tokens(tokenizer: &Tokenizer, format: ToolFormat) -> MarkerTokens {
    let special = |marker: &str| {
        format
            .special_markers()
            .contains(&marker)
            .then(|| special_token(tokenizer, marker))
            .flatten()
    };
    MarkerTokens {
        calls: special(switchyard_api::schema::tools::TOOL_CALLS),
        args: special(switchyard_api::schema::tools::ARGS),
        call_id: special(switchyard_api::schema::tools::CALL_ID),
    }
}

/// The id of `text` where it is one special token of the tokenizer.
fn special_token(tokenizer: &Tokenizer, text: &str) -> Option<u32> {
    tokenizer
        .token_to_id(text)
        .filter(|&id| tokenizer.is_special(id))
}

/// The tier of an API key that names none.
const KEY_TIER: &str = "standard";

/// The tenants the API keys name, each with the tier its keys' requests carry in the metrics
/// (their tier where `tiers` configures it, "" otherwise), once per pair.
fn key_tenants(config: &Config, keys: &[switchyard_config::ApiKeyEntry]) -> Vec<(String, String)> {
    let pairs: std::collections::BTreeSet<(String, String)> = keys
        .iter()
        .map(|k| {
            let tier = k.tier.as_deref().unwrap_or(KEY_TIER);
            let tier = if config.tiers.contains_key(tier) {
                tier
            } else {
                ""
            };
            (k.tenant.clone(), tier.to_owned())
        })
        .collect();
    pairs.into_iter().collect()
}

/// Builds the HTTP layer's settings from the configuration and the API keys (inline and from
/// `server.api_keys_file`, already read and checked).
fn api_config(
    config: &Config,
    keys: Vec<switchyard_config::ApiKeyEntry>,
    tools: ToolSetup,
) -> ApiConfig {
    ApiConfig {
        api_keys: api_keys(keys),
        admin_key: config.server.admin_key.clone(),
        max_body_bytes: config.server.max_body_bytes,
        body_timeout: Duration::from_secs(config.server.request_timeout_s),
        tools,
        tiers: config.tiers.keys().cloned().collect(),
        responses_store: store_limits(config),
        cors: config
            .server
            .cors
            .as_ref()
            .map(super::config::cors_settings),
        rate_limits: rate_limits(config),
        ..ApiConfig::default()
    }
}

/// The bounds of the store of responses (`server.responses`).
pub(super) fn store_limits(config: &Config) -> StoreLimits {
    StoreLimits {
        max_responses: config.server.responses.max_stored,
        max_bytes: config.server.responses.max_stored_mb << 20,
        max_age: (config.server.responses.max_age_s > 0)
            .then(|| Duration::from_secs(config.server.responses.max_age_s)),
        off_because: if config.server.responses.max_stored == 0 {
            switchyard_api::response_store::MAX_STORED_IS_ZERO
        } else {
            "server.responses.max_stored_mb is 0"
        },
    }
}

/// Creates the series of the configured tiers at zero (those already there stay as they are:
/// a reload calls it again for the tiers it puts in force).
fn register_tier_series(config: &Config) {
    let tiers: Vec<(String, bool, bool)> = config
        .tiers
        .iter()
        .map(|(name, t)| (name.clone(), t.ttft_ms.is_some(), t.tpot_ms.is_some()))
        .collect();
    switchyard_actors::metric_names::register_tiers(&tiers);
}

/// Each tier's priority (`tiers.<name>.priority`).
fn tier_priorities(config: &Config) -> HashMap<String, i32> {
    config
        .tiers
        .iter()
        .map(|(name, t)| (name.clone(), t.priority))
        .collect()
}

/// The API keys as the HTTP layer holds them (a key without a tier is of [`KEY_TIER`]).
fn api_keys(keys: Vec<switchyard_config::ApiKeyEntry>) -> Vec<ApiKeyEntry> {
    keys.into_iter()
        .map(|k| ApiKeyEntry {
            key: k.key,
            tenant: k.tenant,
            tier: k.tier.unwrap_or_else(|| KEY_TIER.into()),
            adapters: k
                .adapters
                .map_or_else(AdapterAccess::all, AdapterAccess::only),
        })
        .collect()
}

/// The tiers' rate limits (`requests_per_minute`, `tokens_per_minute`).
fn rate_limits(config: &Config) -> std::collections::HashMap<String, TierLimits> {
    config
        .tiers
        .iter()
        .map(|(name, tier)| {
            let limits = TierLimits {
                requests_per_minute: tier.requests_per_minute,
                tokens_per_minute: tier.tokens_per_minute,
            };
            (name.clone(), limits)
        })
        .collect()
}

/// A policy's parameters as `GET /admin/policy` shows them: no parameters (`null`) is `{}`,
/// the policy's defaults, so that a section without parameters and one with `params: {}` are
/// the same policy.
fn policy_params(params: &serde_yaml::Value) -> serde_json::Value {
    json_params(serde_json::to_value(params).unwrap_or(serde_json::Value::Null))
}

/// [`policy_params`] for parameters already in JSON.
fn json_params(params: serde_json::Value) -> serde_json::Value {
    match params {
        serde_json::Value::Null => serde_json::Value::Object(serde_json::Map::new()),
        other => other,
    }
}

/// A policy the registry refused, as an invalid request naming the field at fault: the name,
/// or the parameter (`params.token_budget`).
fn policy_error(e: PolicyError) -> EngineError {
    let param = match &e {
        PolicyError::UnknownPolicy { .. } | PolicyError::DuplicateName(_) => "name".to_string(),
        PolicyError::InvalidParam { field, .. } if field == "params" => "params".to_string(),
        PolicyError::InvalidParam { field, .. } => format!("params.{field}"),
    };
    EngineError::new(EngineErrorKind::InvalidRequest, e.to_string()).with_param(param)
}

/// Adapts the actor engine to the HTTP layer's port.
pub(super) struct EngineAdapter {
    engine: ActorEngine,
    tokenizer: Arc<Tokenizer>,
    model_name: String,
    max_model_len: usize,
    /// The length of the model's embeddings (its hidden size); `None` with
    /// `server.embeddings: false`.
    embedding_size: Option<usize>,
    ready: AtomicBool,
    /// The tiers in force (policies are built with them); written only while `policy` is
    /// held, so that a policy is always built with the tiers it is swapped in beside.
    tiers: parking_lot::RwLock<Vec<TierSpec>>,
    /// Each tier's priority (`tiers.<name>.priority`): its requests' unless they ask for a
    /// later one (`switchyard_policies::request_priority`); replaced by SIGHUP.
    tier_priorities: parking_lot::RwLock<HashMap<String, i32>>,
    /// The policy in force. Held while a swap is queued, so that swaps reach the scheduler in
    /// the order their records are written.
    policy: Mutex<PolicyInfo>,
    /// The speculative decoding settings in force; held from a change's send to the engine
    /// to its record, so that concurrent changes are recorded in the order they are applied.
    speculative: Arc<tokio::sync::Mutex<Option<SpeculativeSettings>>>,
    /// Whether LoRA adapters are served (`lora.enabled` at start).
    lora_enabled: bool,
    /// Whether the backend runs its steps on a device (`Backend::overlaps_host`): an unset
    /// `scheduler.step_timeout_s` limits its calls (`SchedulerSection::step_timeout`).
    device_backend: bool,
}

impl EngineAdapter {
    /// `PUT /admin/policy`: builds the policy `spec` names (checked by the registry) and
    /// swaps it in, unless it equals the one in force (as SIGHUP keeps an unchanged policy:
    /// a swap would reset its state).
    fn swap(&self, spec: PolicySpec) -> Result<PolicySwap, EngineError> {
        let params: serde_yaml::Value = serde_yaml::to_value(&spec.params).map_err(|e| {
            EngineError::new(EngineErrorKind::InvalidRequest, e.to_string()).with_param("params")
        })?;
        let section = switchyard_config::PolicySpec {
            name: spec.name.clone(),
            params,
        };
        // Held from the build to the swap: a reload of the tiers waits, so the policy is built
        // with the tiers in force beside it.
        let mut info = self.policy.lock();
        let policy =
            super::config::build_policy(&section, &self.tiers.read()).map_err(policy_error)?;
        let changed = self.install_locked(&mut info, spec.name, spec.params, policy, None);
        Ok(PolicySwap {
            policy: info.clone(),
            changed,
        })
    }

    /// Swaps in `policy` (built from `name` and `params` with `tiers`, or with the tiers in
    /// force when `None`) and records it, unless it equals the policy in force and the tiers
    /// are unchanged (a swap would reset its state: fair-share counters, aging). With new
    /// tiers, the scheduler gets them with the policy (`Engine::set_tiers`). Returns the
    /// policy in force and whether it was swapped.
    fn install_policy(
        &self,
        name: String,
        params: serde_json::Value,
        policy: Box<dyn Policy>,
        tiers: Option<Vec<TierSpec>>,
    ) -> (PolicyInfo, bool) {
        // Taken before the swap is queued (which does not block): concurrent swaps are queued
        // and recorded in the same order, so `GET /admin/policy` and the policy_info gauge
        // show the policy the scheduler runs.
        let mut info = self.policy.lock();
        let swapped = self.install_locked(&mut info, name, params, policy, tiers);
        (info.clone(), swapped)
    }

    /// [`EngineAdapter::install_policy`] with the policy's lock held.
    fn install_locked(
        &self,
        info: &mut PolicyInfo,
        name: String,
        params: serde_json::Value,
        policy: Box<dyn Policy>,
        tiers: Option<Vec<TierSpec>>,
    ) -> bool {
        let params = json_params(params);
        let tiers = tiers.filter(|t| *t != *self.tiers.read());
        if info.name == name && info.params == params && tiers.is_none() {
            return false;
        }
        match tiers {
            Some(tiers) => {
                self.engine.set_tiers(tiers.clone(), policy);
                *self.tiers.write() = tiers;
            }
            None => self.engine.swap_policy(policy),
        }
        metrics::gauge!(switchyard_api::metrics::POLICY_INFO, "policy" => policy_label(&info.name))
            .set(0.0);
        metrics::counter!(switchyard_api::metrics::POLICY_SWAPS).increment(1);
        info.name = name;
        info.params = params;
        metrics::gauge!(switchyard_api::metrics::POLICY_INFO, "policy" => policy_label(&info.name))
            .set(1.0);
        tracing::info!(policy = %info.name, "scheduling policy swap requested");
        true
    }
}

/// Policy names are registered names, so they are a bounded label set.
fn policy_label(name: &str) -> &'static str {
    match name {
        "fcfs" => "fcfs",
        "priority" => "priority",
        "slo-aware" => "slo-aware",
        "chunked-prefill" => "chunked-prefill",
        "fair-share" => "fair-share",
        "prefix-aware" => "prefix-aware",
        "mlfq" => "mlfq",
        _ => "other",
    }
}

/// A chat prompt for the engine: the API's messages as (role, content), its ending as the
/// chat template's.
fn chat_source(
    messages: Vec<port::ChatMessage>,
    template_kwargs: port::TemplateKwargs,
    client_kwargs: Vec<String>,
    ending: port::ChatEnding,
) -> PromptSource {
    PromptSource::Chat {
        messages: messages
            .into_iter()
            .map(|m| ChatMessage {
                role: m.role.as_str().to_owned(),
                content: m.content,
                tool_calls: m.tool_calls,
                tool_call_id: m.tool_call_id,
                name: m.name,
                server_text: m.server_text,
            })
            .collect(),
        template_kwargs,
        client_kwargs,
        ending: match ending {
            port::ChatEnding::GenerationPrompt => ChatEnding::GenerationPrompt,
            port::ChatEnding::Closed => ChatEnding::Closed,
            port::ChatEnding::ContinueFinal => ChatEnding::ContinueFinal,
        },
    }
}

fn to_port_error(e: SubmitError) -> EngineError {
    let kind = match e.kind {
        SubmitErrorKind::InvalidRequest => EngineErrorKind::InvalidRequest,
        SubmitErrorKind::UnknownModel => EngineErrorKind::NotFound,
        SubmitErrorKind::ContextLengthExceeded => EngineErrorKind::ContextLengthExceeded,
        SubmitErrorKind::Overloaded => EngineErrorKind::Overloaded {
            retry_after_secs: 1,
        },
        SubmitErrorKind::TooManyChoices => EngineErrorKind::TooManyChoices,
        SubmitErrorKind::QueueTimeout => EngineErrorKind::QueueTimeout,
        SubmitErrorKind::TenantBusy => EngineErrorKind::TenantBusy,
        SubmitErrorKind::Unavailable => EngineErrorKind::Unavailable,
        SubmitErrorKind::StructuredOutput => EngineErrorKind::StructuredOutput,
        SubmitErrorKind::Internal => EngineErrorKind::Internal,
    };
    let error = EngineError::new(kind, e.message);
    match e.param {
        Some(param) => error.with_param(param),
        None => error,
    }
}

/// Delivers engine outputs to an HTTP response's channel, converting them to the port's events.
struct ChannelSink {
    tx: mpsc::Sender<EngineEvent>,
    tokenizer: Arc<Tokenizer>,
    /// Set by the HTTP layer when another prompt of the same request failed.
    sibling_failure: port::SiblingFailure,
    /// Set once the client was cut off for reading too slowly: the request is over for the
    /// engine (the sink is closed), and it failed as unavailable, not because the client left.
    cut_off: bool,
}

impl ChannelSink {
    /// A token's text (lossy where it holds part of a character) and its bytes.
    fn token_text(&self, id: u32) -> (String, Vec<u8>) {
        let bytes = self.tokenizer.token_bytes(id).unwrap_or_default();
        (String::from_utf8_lossy(bytes).into_owned(), bytes.to_vec())
    }

    fn logprobs(&self, list: Vec<TokenLogprobs>) -> Vec<TokenLogprob> {
        list.into_iter()
            .map(|t| {
                let (token, bytes) = self.token_text(t.token);
                TokenLogprob {
                    token_id: t.token,
                    token,
                    bytes,
                    logprob: t.logprob,
                    rank: t.rank,
                    top: t
                        .top
                        .into_iter()
                        .map(|(t, l)| {
                            let (token, bytes) = self.token_text(t);
                            TopLogprob {
                                token_id: t,
                                token,
                                bytes,
                                logprob: l,
                            }
                        })
                        .collect(),
                }
            })
            .collect()
    }

    fn delta(&self, d: ChoiceDelta) -> Delta {
        let logprobs = self.logprobs(d.logprobs);
        let finish = d.finish.map(|(reason, n)| Finish {
            reason: match reason {
                FinishReason::Length => port::FinishReason::Length,
                _ => port::FinishReason::Stop,
            },
            completion_tokens: n,
        });
        Delta {
            index: d.index,
            text: d.text,
            token_ids: d.token_ids,
            logprobs,
            finish,
            cached_prompt_tokens: d.cached_prompt_tokens,
            embedding: d.embedding,
        }
    }
}

impl OutputSink for ChannelSink {
    fn send(&mut self, output: EngineOutput) -> bool {
        let event = match output {
            EngineOutput::Prompt {
                prompt_tokens,
                opens_thinking,
                prompt_logprobs,
            } => EngineEvent::Prompt {
                prompt_tokens,
                opens_thinking,
                prompt_logprobs: prompt_logprobs.map(|l| self.logprobs(l)),
            },
            EngineOutput::Delta(d) => EngineEvent::Delta(self.delta(d)),
            EngineOutput::Error(e) => EngineEvent::Error(to_port_error(e)),
        };
        if self.cut_off {
            return false;
        }
        // A full channel means the client reads far slower than we generate: cut it off
        // rather than block the engine, and say so in the last free slot.
        if self.tx.capacity() <= 1 && !matches!(event, EngineEvent::Error(_)) {
            self.cut_off = true;
            let _ = self.tx.try_send(EngineEvent::Error(EngineError::new(
                EngineErrorKind::Unavailable,
                format!(
                    "The stream was cut off: the client read it more slowly than the model \
                     generated it, and {} events waited unread.",
                    self.tx.max_capacity() - 1
                ),
            )));
            return false;
        }
        self.tx.try_send(event).is_ok()
    }

    fn is_closed(&self) -> bool {
        self.cut_off || self.tx.is_closed()
    }

    fn will_deliver(&self) -> bool {
        !self.is_closed() && self.tx.capacity() > 1
    }

    fn abandoned_for(&self) -> Option<SubmitErrorKind> {
        if self.cut_off && self.sibling_failure.get().is_none() {
            return Some(SubmitErrorKind::Unavailable);
        }
        self.sibling_failure.get().map(|kind| match kind {
            EngineErrorKind::InvalidRequest => SubmitErrorKind::InvalidRequest,
            EngineErrorKind::NotFound => SubmitErrorKind::UnknownModel,
            EngineErrorKind::ContextLengthExceeded => SubmitErrorKind::ContextLengthExceeded,
            EngineErrorKind::Overloaded { .. } => SubmitErrorKind::Overloaded,
            EngineErrorKind::TooManyChoices => SubmitErrorKind::TooManyChoices,
            EngineErrorKind::QueueTimeout => SubmitErrorKind::QueueTimeout,
            EngineErrorKind::TenantBusy => SubmitErrorKind::TenantBusy,
            EngineErrorKind::Unavailable => SubmitErrorKind::Unavailable,
            EngineErrorKind::StructuredOutput => SubmitErrorKind::StructuredOutput,
            EngineErrorKind::Internal => SubmitErrorKind::Internal,
        })
    }
}

impl EngineAdapter {
    /// One prompt's engine request, its sink and the receiving end of its channel.
    fn prepare(
        &self,
        request: GenerateRequest,
    ) -> (
        RequestOptions,
        Box<dyn OutputSink>,
        mpsc::Receiver<EngineEvent>,
    ) {
        let sibling_failure = request.sibling_failure.clone();
        let s = &request.sampling;
        let sampling = SamplingParams {
            temperature: s.temperature,
            top_p: s.top_p,
            top_k: s.top_k,
            min_p: s.min_p,
            seed: s.seed,
            repetition_penalty: s.repetition_penalty,
            presence_penalty: s.presence_penalty,
            frequency_penalty: s.frequency_penalty,
            logit_bias: s.logit_bias.clone(),
            min_tokens: s.min_tokens,
            ignore_eos: s.ignore_eos,
            stop_token_ids: s.stop_token_ids.clone(),
            eos_token_ids: self.tokenizer.eos_token_ids().to_vec(),
            logprobs: request.logprobs,
            ..SamplingParams::default()
        };
        let prompt = match request.prompt {
            port::PromptInput::Text(t) => PromptSource::Text(t),
            port::PromptInput::Tokens(t) => PromptSource::Tokens(t),
            port::PromptInput::Chat {
                messages,
                template_kwargs,
                client_kwargs,
                ending,
            } => chat_source(messages, template_kwargs, client_kwargs, ending),
        };
        let (tx, rx) = mpsc::channel(CHANNEL_CAPACITY);
        let options = RequestOptions {
            prompt,
            sampling,
            stop: request.stop,
            include_stop_str_in_output: request.include_stop_str_in_output,
            skip_special_tokens: request.skip_special_tokens,
            keep_special_tokens: request.keep_special_tokens,
            n: request.n,
            max_tokens: request.max_tokens.filter(|_| !request.max_tokens_defaulted),
            default_max_tokens: request.max_tokens.filter(|_| request.max_tokens_defaulted),
            priority: switchyard_policies::request_priority(
                request.priority,
                self.tier_priorities.read().get(&request.tier).copied(),
            ),
            tier: request.tier,
            tenant: request.tenant,
            prompt_logprobs: request.prompt_logprobs,
            cache_salt: request.cache_salt,
            embed: request.embed,
            beam: request.beam_search.map(|b| BeamOptions {
                length_penalty: b.length_penalty,
            }),
            lora: request.lora,
            filters: TokenFilters {
                allowed_token_ids: s.allowed_token_ids.clone().map(Arc::from),
                bad_words: s.bad_words.clone(),
            },
            structured: request.structured.map(|s| match s {
                port::StructuredOutputSpec::JsonObject => StructuredOutput::JsonObject,
                port::StructuredOutputSpec::JsonSchema(v) => StructuredOutput::JsonSchema(v),
                port::StructuredOutputSpec::Regex(r) => StructuredOutput::Regex(r),
                port::StructuredOutputSpec::Choice(c) => StructuredOutput::Choice(c),
                port::StructuredOutputSpec::Grammar(g) => StructuredOutput::Grammar(g),
                port::StructuredOutputSpec::ToolCalls(g) => StructuredOutput::ToolCalls(g),
            }),
        };
        let sink = Box::new(ChannelSink {
            tx,
            tokenizer: self.tokenizer.clone(),
            sibling_failure,
            cut_off: false,
        });
        (options, sink, rx)
    }
}

impl port::Engine for EngineAdapter {
    fn model_name(&self) -> &str {
        &self.model_name
    }

    fn max_model_len(&self) -> usize {
        self.max_model_len
    }

    fn embedding_size(&self) -> Option<usize> {
        self.embedding_size
    }

    fn is_ready(&self) -> bool {
        self.ready.load(Ordering::Acquire)
    }

    fn is_alive(&self) -> bool {
        self.engine.is_alive()
    }

    fn stall(&self) -> Option<port::EngineStall> {
        self.engine.stall().map(|s| port::EngineStall {
            call: s.running.call.as_str(),
            running: s.running.running,
            limit: s.limit,
        })
    }

    fn submit(
        &self,
        requests: Vec<GenerateRequest>,
    ) -> Result<Vec<mpsc::Receiver<EngineEvent>>, EngineError> {
        let mut receivers = Vec::with_capacity(requests.len());
        let prompts = requests
            .into_iter()
            .map(|request| {
                let (options, sink, rx) = self.prepare(request);
                receivers.push(rx);
                (options, sink)
            })
            .collect();
        // Admitted together or refused together (every channel then gets the refusal).
        self.engine.submit_all(prompts);
        Ok(receivers)
    }

    fn tokenize(&self, input: TokenizeInput) -> EngineFuture<Vec<u32>> {
        let engine = self.engine.clone();
        Box::pin(async move {
            let (source, add_special) = match input {
                TokenizeInput::Text {
                    text,
                    add_special_tokens,
                } => (PromptSource::Text(text), add_special_tokens),
                TokenizeInput::Chat {
                    messages,
                    ending,
                    template_kwargs,
                    client_kwargs,
                } => (
                    chat_source(messages, template_kwargs, client_kwargs, ending),
                    true,
                ),
            };
            engine
                .tokenize(source, add_special)
                .await
                .map_err(to_port_error)
        })
    }

    fn detokenize(&self, token_ids: Vec<u32>) -> EngineFuture<String> {
        let engine = self.engine.clone();
        Box::pin(async move { engine.detokenize(token_ids).await.map_err(to_port_error) })
    }

    fn policy(&self) -> EngineFuture<PolicyInfo> {
        let info = self.policy.lock().clone();
        Box::pin(async move { Ok(info) })
    }

    fn swap_policy(&self, spec: PolicySpec) -> EngineFuture<PolicySwap> {
        let result = self.swap(spec);
        Box::pin(async move { result })
    }

    fn speculative(&self) -> EngineFuture<Option<SpeculativeSettings>> {
        let slot = self.speculative.clone();
        Box::pin(async move { Ok(slot.lock().await.clone()) })
    }

    fn set_speculative(
        &self,
        settings: Option<SpeculativeSettings>,
    ) -> EngineFuture<Option<SpeculativeSettings>> {
        let engine = self.engine.clone();
        let config = settings
            .as_ref()
            .map(|s| switchyard_policies::SpeculativeConfig {
                num_speculative_tokens: s.num_speculative_tokens,
                prompt_lookup_min: s.prompt_lookup_min,
                prompt_lookup_max: s.prompt_lookup_max,
                max_running: s.max_running,
            });
        // The scheduler checks the settings (a refusal is an invalid request).
        let slot = self.speculative.clone();
        Box::pin(async move {
            // Held from the send to the record: changes reach the scheduler and the record in
            // the same order, so `GET /admin/speculative` shows the settings in force.
            let mut current = slot.lock().await;
            engine
                .set_speculative(config)
                .await
                .map_err(to_port_error)?;
            // Recorded once the scheduler took them.
            *current = settings.clone();
            tracing::info!(settings = ?settings, "speculative decoding set");
            Ok(settings)
        })
    }

    fn has_lora_adapter(&self, name: &str) -> bool {
        self.engine.has_adapter(name)
    }

    fn find_lora_adapter(&self, name: String) -> EngineFuture<bool> {
        let engine = self.engine.clone();
        Box::pin(async move { engine.find_adapter(&name).await.map_err(to_port_error) })
    }

    fn lora_adapters_in_directories(&self) -> EngineFuture<Vec<String>> {
        let engine = self.engine.clone();
        Box::pin(async move { Ok(engine.adapters_in_directories().await.to_vec()) })
    }

    fn lora_adapters(&self) -> Vec<LoraAdapterInfo> {
        self.engine
            .adapters()
            .into_iter()
            .map(port_adapter)
            .collect()
    }

    fn load_lora(
        &self,
        name: String,
        path: String,
        in_place: bool,
        pinned: bool,
    ) -> EngineFuture<LoraAdapterInfo> {
        let engine = self.engine.clone();
        Box::pin(async move {
            let path = switchyard_config::expand_home(&path);
            let loaded = if in_place {
                engine.replace_adapter(name, path, pinned).await
            } else {
                engine.register_adapter(name, path, pinned).await
            };
            loaded.map(port_adapter).map_err(to_port_error)
        })
    }

    fn unload_lora(&self, name: String) -> EngineFuture<()> {
        let engine = self.engine.clone();
        Box::pin(async move { engine.unregister_adapter(name).await.map_err(to_port_error) })
    }
}

fn port_adapter(a: AdapterInfo) -> LoraAdapterInfo {
    LoraAdapterInfo {
        name: a.name,
        path: a.path.display().to_string(),
        rank: a.rank,
        discovered: a.discovered,
        pinned: a.pinned,
        base_model: a.base_model,
        base_model_differs: a.base_model_differs,
    }
}

/// Sets `switchyard:cache_config_info` (vLLM's `cache_config_info`): 1, with the KV cache's
/// configuration in its labels ([`switchyard_api::metrics::CACHE_CONFIG_LABELS`]), once the
/// backend has sized the cache.
fn cache_config_info(
    cache: &switchyard_config::CacheSection,
    block_size: usize,
    num_blocks: usize,
) {
    let dtype = match cache.kv_cache_dtype {
        switchyard_config::KvCacheDtype::Auto => "auto",
        switchyard_config::KvCacheDtype::Fp8 => "fp8",
    };
    let sharing = match cache.prefix_sharing {
        switchyard_config::PrefixSharing::Tenant => "tenant",
        switchyard_config::PrefixSharing::Global => "global",
    };
    let values = [
        block_size.to_string(),
        num_blocks.to_string(),
        dtype.to_owned(),
        cache.prefix_caching.to_string(),
        sharing.to_owned(),
    ];
    let labels: Vec<metrics::Label> = switchyard_api::metrics::CACHE_CONFIG_LABELS
        .iter()
        .zip(values)
        .map(|(&k, v)| metrics::Label::new(k, v))
        .collect();
    metrics::gauge!(switchyard_api::metrics::CACHE_CONFIG_INFO, labels).set(1.0);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn delta(index: u32) -> EngineOutput {
        EngineOutput::Delta(ChoiceDelta {
            index,
            text: "a".into(),
            token_ids: vec![1],
            logprobs: Vec::new(),
            finish: None,
            cached_prompt_tokens: 0,
            embedding: None,
        })
    }

    /// The engine's chat message keeps the ranges of its text the API's server wrote (its
    /// tool markers, which stay tokens where the client's text is escaped).
    #[test]
    fn a_chat_source_keeps_the_servers_text() {
        let mut m = port::ChatMessage::text(port::ChatRole::User, "[TOOL_RESULTS] 1");
        let marker = 0.."[TOOL_RESULTS] ".len();
        m.server_text = vec![marker.clone()];
        let source = chat_source(
            vec![m],
            Default::default(),
            Vec::new(),
            port::ChatEnding::Closed,
        );
        let PromptSource::Chat { messages, .. } = source else {
            panic!("{source:?}")
        };
        assert_eq!(messages[0].server_text, vec![marker]);
        assert_eq!(messages[0].content, "[TOOL_RESULTS] 1");
    }

    /// Each tenant of the keys comes once per tier its keys' requests carry in the metrics:
    /// a key without a tier has `standard`'s, which is no metrics tier here (not configured).
    /// Every built-in policy labels `policy_info` by its own name (a policy added to the
    /// registry and not here would read "other").
    #[test]
    fn every_builtin_policy_has_its_own_label() {
        for name in PolicyRegistry::with_builtins().names() {
            assert_eq!(policy_label(name), name);
        }
        assert_eq!(policy_label("custom"), "other");
    }

    #[test]
    fn key_tenants_pair_each_tenant_with_its_keys_metrics_tiers() {
        let config = Config::from_yaml_str(
            concat!(
                "tiers:\n  gold: {}\nserver:\n  api_keys:\n",
                "    - { key: acme-key-0001, tenant: acme, tier: gold }\n",
                "    - { key: acme-key-0002, tenant: acme, tier: gold }\n",
                "    - { key: acme-key-0003, tenant: acme }\n",
                "    - { key: bob-key-00001, tenant: bob }\n",
            ),
            "test.yaml",
        )
        .unwrap();
        let keys = config.load_api_keys().unwrap();
        let pairs = key_tenants(&config, &keys);
        let pairs: Vec<(&str, &str)> = pairs
            .iter()
            .map(|(t, tier)| (t.as_str(), tier.as_str()))
            .collect();
        assert_eq!(pairs, [("acme", ""), ("acme", "gold"), ("bob", "")]);
    }

    #[test]
    fn a_client_too_slow_to_read_is_cut_off_with_a_reason() {
        let (tx, mut rx) = mpsc::channel(4);
        let json = r#"{"version":"1.0","truncation":null,"padding":null,"added_tokens":[],
            "normalizer":null,"pre_tokenizer":null,"post_processor":null,"decoder":null,
            "model":{"type":"WordLevel","vocab":{"a":0,"b":1},"unk_token":"a"}}"#;
        let tokenizer = Arc::new(Tokenizer::from_json_bytes(json.as_bytes()).unwrap());
        let mut sink = ChannelSink {
            tx,
            tokenizer,
            sibling_failure: Default::default(),
            cut_off: false,
        };
        // Nobody reads: three deltas fit, the fourth finds only the slot kept for the reason.
        assert!(sink.send(delta(0)));
        assert!(sink.send(delta(0)));
        assert!(sink.will_deliver());
        assert!(sink.send(delta(0)));
        // The next output would be cut off: the engine hears it before sending a last delta,
        // so that a choice whose end the client never reads is not counted a success.
        assert!(!sink.will_deliver());
        assert!(!sink.send(delta(0)));
        assert!(!sink.send(delta(0)));
        // The client is still connected, but the engine must treat its request as ended,
        // and the server's cut-off as the reason (request_failed_total{reason="unavailable"}),
        // not as a client that went away (request_aborted_total).
        assert!(sink.is_closed());
        assert_eq!(sink.abandoned_for(), Some(SubmitErrorKind::Unavailable));
        for _ in 0..3 {
            assert!(matches!(rx.try_recv(), Ok(EngineEvent::Delta(_))));
        }
        match rx.try_recv() {
            Ok(EngineEvent::Error(e)) => {
                assert_eq!(e.kind, EngineErrorKind::Unavailable);
                assert!(
                    e.message.contains("3 events waited unread"),
                    "{}",
                    e.message
                );
            }
            other => panic!("expected the cut-off error, got {other:?}"),
        }
        assert!(rx.try_recv().is_err());
    }
}
