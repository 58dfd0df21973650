//! `switchyard config check`, and reading a configuration as `serve` does.

use crate::cli::ConfigCommand;
use switchyard_config::{env_overrides, Config, Override, PolicySpec};
use switchyard_policies::{Policy, PolicyRegistry, TierSpec};

pub fn run(cmd: ConfigCommand) -> anyhow::Result<()> {
    match cmd {
        ConfigCommand::Check { file, overrides } => {
            let config = load(&file, &overrides)?;
            // What `serve` checks before it loads the model, so that a configuration that
            // passes here does not fail there: the policy and its parameters (by the registry
            // that will run them) and the API keys file.
            build_policy(&config.scheduler.policy, &tier_specs(&config))
                .map_err(|e| anyhow::anyhow!("{}: scheduler.policy: {e}", file.display()))?;
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
            eprintln!("{}: ok", file.display());
            Ok(())
        }
    }
}

/// Reads a configuration with `SWITCHYARD__*` environment overrides, then CLI `--set` ones.
/// Only variables with that prefix are read, so others may hold anything (even bytes that are
/// not UTF-8); one with the prefix that is not UTF-8 is an error naming it.
pub fn load(file: &std::path::Path, cli_overrides: &[String]) -> anyhow::Result<Config> {
    let mut all = env_overrides(std::env::vars_os())?;
    all.extend(cli_overrides.iter().cloned().map(Override::flag));
    Ok(Config::from_file_with_overrides(file, &all)?)
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
        })
        .collect()
}
