//! `switchyard config check`, and reading a configuration as `serve` does.

use std::sync::Arc;

use crate::cli::ConfigCommand;
use switchyard_api::cors::{AllowList, CorsSettings};
use switchyard_api::tls::{CertifiedKey, TlsError};
use switchyard_config::{env_overrides, Config, CorsSection, Override, PolicySpec};
use switchyard_policies::{Policy, PolicyError, PolicyRegistry, TierSpec};

pub fn run(cmd: ConfigCommand) -> anyhow::Result<()> {
    match cmd {
        ConfigCommand::Check { file, overrides } => {
            // What `serve` checks before it loads the model, so that a configuration that
            // passes here does not fail there: the policy and its parameters (by the registry
            // that will run them), that `model.path` is a model the loader reads, that
            // `model.chat_template` reads and compiles, each `lora.adapters` entry's files and
            // `adapter_config.json` (its rank within `lora.max_lora_rank`), the TLS
            // certificate and key, and the API keys file.
            let Checked { config, tls } = load_checked(&file, &overrides)?;
            let keys = config.load_api_keys()?;
            // Keys are secrets: the printed configuration leaves them out.
            println!("# API keys and the admin key are shown as <redacted>.");
            print!("{}", config.redacted().to_yaml());
            if let Some(f) = &config.server.api_keys_file {
                eprintln!(
                    "{}: {} API key(s), {} from {f}",
                    file.display(),
                    keys.len(),
                    keys.len() - config.server.api_keys.len()
                );
            }
            if let (Some(key), Some(section)) = (&tls, &config.server.tls) {
                use switchyard_api::tls::expiry;
                let now = std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(0, |d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX));
                let until = match key.cert.first().map(|leaf| expiry::not_after(leaf)) {
                    Some(Ok(t)) if t < now => format!(", EXPIRED at {}", expiry::rfc3339(t)),
                    Some(Ok(t)) => format!(", valid until {}", expiry::rfc3339(t)),
                    _ => String::new(),
                };
                eprintln!(
                    "{}: HTTPS with {} certificate(s) from {}{until}",
                    file.display(),
                    key.cert.len(),
                    section.cert_file
                );
            }
            eprintln!("{}: ok", file.display());
            Ok(())
        }
    }
}

/// Reads a configuration with `SWITCHYARD__*` environment overrides, then CLI `--set` ones.
/// Only variables with that prefix are read, so others may hold anything (even bytes that are
/// not UTF-8); one with the prefix that is not UTF-8 is an error naming it.
pub fn load(file: &std::path::Path, cli_overrides: &[String]) -> anyhow::Result<Config> {
    load_with(file, cli_overrides, |_| Ok(()))
}

/// [`load`] of `file`, or without one the built-in defaults, with the same overrides.
pub fn load_or_defaults(
    file: Option<&std::path::Path>,
    cli_overrides: &[String],
) -> anyhow::Result<Config> {
    match file {
        Some(file) => load(file, cli_overrides),
        None => {
            let mut all = env_overrides(std::env::vars_os())?;
            all.extend(cli_overrides.iter().cloned().map(Override::flag));
            Ok(Config::from_yaml_with_overrides("", "<defaults>", &all)?)
        }
    }
}

/// A configuration read as `serve` starts, and what its start-up checks made of it.
pub struct Checked {
    /// The configuration.
    pub config: Config,
    /// The certificate and key of `server.tls`, parsed and matched (`None` without it).
    pub tls: Option<Arc<CertifiedKey>>,
}

/// [`load`], with `scheduler.policy` built too (by the registry that runs it, with the
/// configured tiers), `server.cors` checked as the HTTP layer builds it and the files of
/// `server.tls` read and parsed: an error names the field (`scheduler.policy.name`,
/// `scheduler.policy.params.token_budget`, `server.tls.key_file`) and the override that set
/// it, or the file's line. What `config check` and `serve`'s start read.
pub fn load_checked(file: &std::path::Path, cli_overrides: &[String]) -> anyhow::Result<Checked> {
    let mut tls = None;
    let config = load_with(file, cli_overrides, |config| {
        model_path_readable(&config.model.path).map_err(|why| ("model.path".to_string(), why))?;
        if let Some(file) = &config.model.chat_template {
            let file = switchyard_config::expand_home(file);
            switchyard_gpu::model::chat_template::ChatTemplate::check_file(&file).map_err(|e| {
                let note = missing_note(&file);
                ("model.chat_template".to_string(), format!("{e}{note}"))
            })?;
        }
        for (i, dir) in config.lora.adapter_dirs.iter().enumerate() {
            adapter_dir_readable(dir).map_err(|why| (format!("lora.adapter_dirs[{i}]"), why))?;
        }
        let limits = switchyard_gpu::LoraLimits {
            max_rank: config.lora.max_lora_rank,
            ..switchyard_gpu::LoraLimits::default()
        };
        for (i, a) in config.lora.adapters.iter().enumerate() {
            adapter_files_present(&a.path)
                .and_then(|()| adapter_config_valid(&a.path, &limits))
                .map_err(|why| (format!("lora.adapters[{i}].path"), why))?;
        }
        let spec = &config.scheduler.policy;
        build_policy(spec, &tier_specs(config))
            .map(drop)
            .map_err(policy_field_error)?;
        if let Some(cors) = &config.server.cors {
            cors_settings(cors)
                .check()
                .map_err(|(field, why)| (format!("server.cors.{field}"), why))?;
        }
        tls = tls_certificate(config)?;
        if let Some(dir) = &config.server.responses.path {
            let dir = switchyard_config::expand_home(dir);
            switchyard_api::response_store::journal::check_directory(&dir).map_err(|why| {
                let note = missing_note(&dir);
                ("server.responses.path".to_string(), format!("{why}{note}"))
            })?;
        }
        Ok(())
    })?;
    Ok(Checked { config, tls })
}

/// The certificate chain and key of `server.tls`, read (regular files, bounded) and parsed,
/// the key checked against the first certificate; `None` without the section. An error names
/// the field at fault (`server.tls.cert_file`, `server.tls.key_file`) and why, with the path.
/// `serve`'s start, `config check` and SIGHUP all read them through here.
pub fn tls_certificate(config: &Config) -> Result<Option<Arc<CertifiedKey>>, (String, String)> {
    let (Some(section), Some(files)) = (&config.server.tls, config.read_tls_files()?) else {
        return Ok(None);
    };
    let cert = switchyard_config::expand_home(&section.cert_file);
    let key = switchyard_config::expand_home(&section.key_file);
    switchyard_api::tls::certified_key(&files.cert_pem, &files.key_pem)
        .map(Some)
        .map_err(|e| match e {
            TlsError::Certificate(_) => (
                "server.tls.cert_file".into(),
                format!("`{}`: {e}", cert.display()),
            ),
            TlsError::Key(_) => (
                "server.tls.key_file".into(),
                format!("`{}`: {e}", key.display()),
            ),
            TlsError::KeyMismatch => (
                "server.tls.key_file".into(),
                format!(
                    "`{}` is not the key of `{}`: {e}",
                    key.display(),
                    cert.display()
                ),
            ),
            TlsError::Setup(_) => ("server.tls".into(), e.to_string()),
        })
}

/// The HTTP layer's CORS settings of a `server.cors` section (`["*"]` is any).
pub fn cors_settings(section: &CorsSection) -> CorsSettings {
    CorsSettings {
        allowed_origins: AllowList::from_config(&section.allowed_origins),
        allowed_methods: AllowList::from_config(&section.allowed_methods),
        allowed_headers: AllowList::from_config(&section.allowed_headers),
        allow_credentials: section.allow_credentials,
        max_age_s: section.max_age_s,
    }
}

/// Where the value of `field` (dotted, `server.port`) in force comes from, as errors about it
/// name it: the override that set it (`override `--set server.port=9000``), else the file's
/// line (`config.yaml:10`), else `default, not set in config.yaml`. For errors found after the
/// configuration loaded (a port in use), so the file is read again, as the load read it (a
/// regular file of at most [`switchyard_config::MAX_CONFIG_BYTES`]: it may have changed
/// since), and the environment too. A file that no longer reads is named with why.
pub fn field_origin(file: &std::path::Path, cli_overrides: &[String], field: &str) -> String {
    let mut all = env_overrides(std::env::vars_os()).unwrap_or_default();
    all.extend(cli_overrides.iter().cloned().map(Override::flag));
    if let Some(o) = all.iter().rev().find(|o| o.covers(field)) {
        return format!("override `{o}`");
    }
    let text = switchyard_config::read_bytes(file, switchyard_config::MAX_CONFIG_BYTES)
        .map_err(|e| e.to_string())
        .and_then(|b| String::from_utf8(b).map_err(|_| "not UTF-8 text".to_string()));
    let text = match text {
        Ok(text) => text,
        Err(why) => return format!("{}, which no longer reads: {why}", file.display()),
    };
    match switchyard_config::locate(&text, field) {
        Some(line) => format!("{}:{line}", file.display()),
        None => format!("default, not set in {}", file.display()),
    }
}

fn load_with(
    file: &std::path::Path,
    cli_overrides: &[String],
    check: impl FnOnce(&Config) -> Result<(), (String, String)>,
) -> anyhow::Result<Config> {
    let mut all = env_overrides(std::env::vars_os())?;
    all.extend(cli_overrides.iter().cloned().map(Override::flag));
    Config::from_file_checked(file, &all, check)
        .map_err(|e| with_kind_hint(e.into(), file, FileKind::Server))
}

/// The two kinds of YAML file the commands read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FileKind {
    /// A server configuration (`serve`, `config check`, `calibrate --config`).
    Server,
    /// A simulation spec (`simulate --config`).
    Simulation,
}

/// Top-level keys that only a server configuration has.
const SERVER_ONLY_KEYS: &[&str] = &["server", "logging", "lora", "speculative"];
/// Top-level keys that only a simulation spec has.
const SIMULATION_ONLY_KEYS: &[&str] = &[
    "seed",
    "hardware",
    "calibration",
    "policies",
    "workload",
    "changes",
];
/// The most of a file read again for [`kind_hint`] (configurations are a few KiB).
const KIND_HINT_MAX_BYTES: u64 = 1 << 20;

/// When `file`, read as `expected` and refused, is the other kind of file (by a top-level key
/// only that kind has), what to run instead. Reads the file again: on the error path only.
pub fn kind_hint(file: &std::path::Path, expected: FileKind) -> Option<String> {
    // Read as the configuration was: a regular file only, its kind checked before it is
    // opened (opening a FIFO that no one writes blocks, and the hint would hang the command
    // after its read refused the FIFO).
    let bytes = switchyard_config::read_bytes(file, KIND_HINT_MAX_BYTES).ok()?;
    let text = String::from_utf8(bytes).ok()?;
    let top: serde_yaml::Mapping = serde_yaml::from_str(&text).ok()?;
    let has = |keys: &[&'static str]| {
        keys.iter()
            .copied()
            .find(|k| top.contains_key(serde_yaml::Value::from(*k)))
    };
    let f = file.display();
    match expected {
        FileKind::Server => has(SIMULATION_ONLY_KEYS).map(|k| {
            format!(
                "{f} is a simulation spec (it has `{k}`): run it with `switchyard simulate --config {f}`"
            )
        }),
        FileKind::Simulation => has(SERVER_ONLY_KEYS).map(|k| {
            format!(
                "{f} is a server configuration (it has `{k}`): serve it with `switchyard serve --config {f}`; \
                 `simulate --config` takes a simulation spec (config/examples/sim-*.yaml), and \
                 `simulate --trace` takes a server configuration's tiers with `--tiers {f}`"
            )
        }),
    }
}

/// `err`, with [`kind_hint`]'s hint on a line of its own when there is one.
pub fn with_kind_hint(
    err: anyhow::Error,
    file: &std::path::Path,
    expected: FileKind,
) -> anyhow::Error {
    match kind_hint(file, expected) {
        Some(hint) => anyhow::anyhow!("{err:#}\n  hint: {hint}"),
        None => err,
    }
}

/// Refuses a `model.path` that is not there or cannot be read (`~` expanded), or is not what
/// the loader reads (a GGUF file, a directory holding one, or a Hugging Face checkpoint:
/// [`switchyard_gpu::model::check_model_path`], a few bytes read), without loading anything.
/// An empty path is the embedded default, which may be fetched after the check (`serve`
/// says to fetch it when it is missing).
fn model_path_readable(path: &str) -> Result<(), String> {
    if path.is_empty() {
        return Ok(());
    }
    let full = switchyard_config::expand_home(path);
    let readable = std::fs::metadata(&full).and_then(|m| {
        if m.is_dir() {
            std::fs::read_dir(&full).map(drop)
        } else {
            std::fs::File::open(&full).map(drop)
        }
    });
    readable.map_err(|e| cannot_read(&full, &e))?;
    switchyard_gpu::model::check_model_path(&full).map_err(|e| e.to_string())
}

/// `cannot read `PATH`: why`, saying against which directory a relative path was read.
fn cannot_read(path: &std::path::Path, e: &std::io::Error) -> String {
    format!(
        "cannot read `{}`{}: {}",
        path.display(),
        switchyard_config::relative_note(path),
        io_reason(e)
    )
}

/// [`switchyard_config::relative_note`] of a path that is not there (nothing otherwise: the
/// error is about what the file holds).
fn missing_note(path: &std::path::Path) -> String {
    match std::fs::symlink_metadata(path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            switchyard_config::relative_note(path)
        }
        _ => String::new(),
    }
}

/// Refuses an entry of `lora.adapter_dirs` that is not a directory this process can list
/// (`~` expanded); its adapters are read as requests name them.
fn adapter_dir_readable(dir: &str) -> Result<(), String> {
    let full = switchyard_config::expand_home(dir);
    match std::fs::metadata(&full) {
        Ok(m) if !m.is_dir() => Err(format!("`{}` is not a directory", full.display())),
        Ok(_) => std::fs::read_dir(&full)
            .map(drop)
            .map_err(|e| cannot_read(&full, &e)),
        Err(e) => Err(cannot_read(&full, &e)),
    }
}

/// Refuses a `lora.adapters` entry whose path (`~` expanded) is not a directory holding
/// `adapter_config.json` and `adapter_model.safetensors` as regular files, as the adapter
/// loader refuses it once the model has loaded; the files' contents (the rank, the modules
/// against the model's) are checked as the adapter loads. Nothing is opened.
fn adapter_files_present(path: &str) -> Result<(), String> {
    let full = switchyard_config::expand_home(path);
    match std::fs::metadata(&full) {
        Ok(m) if !m.is_dir() => {
            return Err(format!(
                "`{}` is not a directory (a PEFT adapter is one)",
                full.display()
            ))
        }
        Ok(_) => {}
        Err(e) => return Err(cannot_read(&full, &e)),
    }
    for name in ["adapter_config.json", "adapter_model.safetensors"] {
        match std::fs::metadata(full.join(name)) {
            Ok(m) if m.is_file() => {}
            Ok(_) => {
                return Err(format!(
                    "`{}`: {name} is not a regular file",
                    full.display()
                ))
            }
            Err(e) => return Err(format!("`{}`: {name}: {}", full.display(), io_reason(&e))),
        }
    }
    Ok(())
}

/// Refuses a `lora.adapters` entry (`~` expanded) whose `adapter_config.json` the adapter
/// loader would refuse, read as it reads it ([`switchyard_gpu::LoraAdapter::check_files`]: a
/// regular file of at most 1 MiB, the rank within `lora.max_lora_rank`, nothing it does not
/// support); the weights are checked against the model as the adapter loads.
fn adapter_config_valid(path: &str, limits: &switchyard_gpu::LoraLimits) -> Result<(), String> {
    let full = switchyard_config::expand_home(path);
    switchyard_gpu::LoraAdapter::check_files(&full, limits)
        .map(drop)
        .map_err(|e| e.to_string())
}

/// `--lora DIR` (`generate`, `bench throughput`, `calibrate`) checked before the model loads
/// (minutes for a large one) as `config check` checks a `lora.adapters` entry: a directory
/// holding the PEFT files, and its `adapter_config.json` read as the adapter loader reads it
/// (the rank at most `max_rank`, the command's bound). A path that is not UTF-8 is left to the
/// loader, which names it.
pub fn check_lora_flag(dir: &std::path::Path, max_rank: usize) -> anyhow::Result<()> {
    let Some(d) = dir.to_str() else {
        return Ok(());
    };
    let limits = switchyard_gpu::LoraLimits {
        max_rank: max_rank.min(switchyard_gpu::lora::MAX_LORA_RANK),
        ..switchyard_gpu::LoraLimits::default()
    };
    adapter_files_present(d)
        .and_then(|()| adapter_config_valid(d, &limits))
        .map_err(|why| anyhow::anyhow!("--lora: {why}"))
}

/// An I/O error's reason as a message part: lower case, without the OS error number.
fn io_reason(e: &std::io::Error) -> String {
    let reason = e.to_string();
    reason
        .split(" (os error")
        .next()
        .unwrap_or(&reason)
        .to_lowercase()
}

/// The field of `scheduler.policy` a policy error is about, and the message.
fn policy_field_error(e: PolicyError) -> (String, String) {
    match e {
        PolicyError::UnknownPolicy { .. } => ("scheduler.policy.name".into(), e.to_string()),
        PolicyError::InvalidParam {
            policy,
            field,
            reason,
        } if field == "params" => (
            "scheduler.policy.params".into(),
            format!("policy `{policy}`: {reason}"),
        ),
        PolicyError::InvalidParam {
            policy,
            field,
            reason,
        } if !field.is_empty()
            && field
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-') =>
        {
            (
                format!("scheduler.policy.params.{field}"),
                format!("policy `{policy}`: parameter `{field}`: {reason}"),
            )
        }
        other => ("scheduler.policy".into(), other.to_string()),
    }
}

/// Builds the policy a `scheduler.policy` section names, with its parameters checked by the
/// registry that runs it: `config check`, `serve`'s start and its SIGHUP reload all go
/// through here, so they accept and refuse the same sections.
pub fn build_policy(
    spec: &PolicySpec,
    tiers: &[TierSpec],
) -> Result<Box<dyn Policy>, switchyard_policies::PolicyError> {
    PolicyRegistry::with_builtins().create(&spec.name, &spec.params, tiers)
}

/// The tiers with a bound of their own on requests in flight (`tiers.<name>.max_pending_requests`).
pub fn tier_pending_limits(config: &Config) -> Vec<(String, usize)> {
    config
        .tiers
        .iter()
        .filter_map(|(name, t)| Some((name.clone(), t.max_pending_requests?)))
        .collect()
}

/// The configured per-tenant bounds on requests in flight, by tier.
pub fn tier_pending_per_tenant_limits(config: &Config) -> Vec<(String, usize)> {
    config
        .tiers
        .iter()
        .filter_map(|(name, t)| Some((name.clone(), t.max_pending_per_tenant?)))
        .collect()
}

/// The configured shares of LoRA adapter memory per tenant (`max_cpu_loras_per_tenant`), by
/// tier.
pub fn tier_lora_share_limits(config: &Config) -> Vec<(String, usize)> {
    config
        .tiers
        .iter()
        .filter_map(|(name, t)| Some((name.clone(), t.max_cpu_loras_per_tenant?)))
        .collect()
}

/// The configured tiers as the scheduling core sees them.
pub fn tier_specs(config: &Config) -> Vec<TierSpec> {
    config
        .tiers
        .iter()
        .map(|(name, t)| TierSpec {
            name: name.clone(),
            ttft_ms: t.ttft_ms,
            tpot_ms: t.tpot_ms,
            weight: t.weight,
            preemptible: t.preemptible,
            max_queue_ms: t.max_queue_ms,
            max_kv_fraction: t.max_kv_fraction,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `--lora DIR` is refused before the model loads for what the adapter loader would refuse
    /// in its configuration (a rank above the command's bound, DoRA), not only for missing
    /// files; a directory the loader would take passes.
    #[test]
    fn the_lora_flag_reads_the_adapter_configuration_before_the_load() {
        let dir = crate::scratch::ScratchDir::new("lora-flag");
        let d = dir.join("adapter");
        std::fs::create_dir(&d).unwrap();
        let e = check_lora_flag(&d, 64).unwrap_err().to_string();
        assert!(
            e.starts_with("--lora: ") && e.contains("adapter_config.json"),
            "{e}"
        );
        std::fs::write(
            d.join("adapter_config.json"),
            r#"{"r": 8, "lora_alpha": 16, "target_modules": ["q_proj"]}"#,
        )
        .unwrap();
        std::fs::write(
            d.join("adapter_model.safetensors"),
            b"weights left to the load",
        )
        .unwrap();
        check_lora_flag(&d, 64).unwrap();
        let e = check_lora_flag(&d, 4).unwrap_err().to_string();
        assert!(
            e.starts_with("--lora: ") && e.ends_with("rank 8 is outside 1..=4 (max_lora_rank)"),
            "{e}"
        );
        std::fs::write(
            d.join("adapter_config.json"),
            r#"{"r": 8, "use_dora": true}"#,
        )
        .unwrap();
        let e = check_lora_flag(&d, 64).unwrap_err().to_string();
        assert!(e.contains("DoRA"), "{e}");
    }

    /// The file is read again as the load read it: one grown past the bound (or replaced by
    /// something other than a regular file) is named with why, never read whole.
    #[test]
    fn field_origin_reads_the_file_again_within_the_bound() {
        let dir = crate::scratch::ScratchDir::new("field-origin");
        let file = dir.join("config.yaml");
        std::fs::write(&file, "model:\n  path: m\nserver:\n  port: 9000\n").unwrap();
        let f = file.display();
        assert_eq!(field_origin(&file, &[], "server.port"), format!("{f}:4"));
        assert_eq!(
            field_origin(&file, &[], "server.host"),
            format!("default, not set in {f}")
        );
        let over = ["server.port=9001".to_string()];
        assert_eq!(
            field_origin(&file, &over, "server.port"),
            "override `--set server.port=9001`"
        );
        // Past the bound, with the field on its last line: not read (it was found before).
        let mut big = "#".repeat(switchyard_config::MAX_CONFIG_BYTES as usize);
        big.push_str("\nserver:\n  port: 9000\n");
        std::fs::write(&file, big).unwrap();
        let origin = field_origin(&file, &[], "server.port");
        assert!(
            origin.starts_with(&format!("{f}, which no longer reads: "))
                && origin.contains("too large"),
            "{origin}"
        );
        std::fs::remove_file(&file).unwrap();
        std::fs::create_dir(&file).unwrap();
        let origin = field_origin(&file, &[], "server.port");
        assert!(origin.contains("not a regular file"), "{origin}");
    }
}
