//! `switchyard config check`.

use crate::cli::ConfigCommand;
use switchyard_config::{env_overrides, Config};

pub fn run(cmd: ConfigCommand) -> anyhow::Result<()> {
    match cmd {
        ConfigCommand::Check { file, overrides } => {
            let config = load(&file, &overrides)?;
            // The policy and its parameters are validated by the registry that will run them.
            switchyard_policies::PolicyRegistry::with_builtins()
                .create(
                    &config.scheduler.policy.name,
                    &config.scheduler.policy.params,
                    &tier_specs(&config),
                )
                .map_err(|e| anyhow::anyhow!("{}: scheduler.policy: {e}", file.display()))?;
            print!("{}", config.to_yaml());
            eprintln!("{}: ok", file.display());
            Ok(())
        }
    }
}

/// Reads a configuration with `SWITCHYARD__*` environment overrides, then CLI `--set` ones.
pub fn load(file: &std::path::Path, cli_overrides: &[String]) -> anyhow::Result<Config> {
    let mut all = env_overrides(std::env::vars());
    all.extend(cli_overrides.iter().cloned());
    Ok(Config::from_file_with_overrides(file, &all)?)
}

/// The configured tiers as the scheduling core sees them.
pub fn tier_specs(config: &Config) -> Vec<switchyard_policies::TierSpec> {
    config
        .tiers
        .iter()
        .map(|(name, t)| switchyard_policies::TierSpec {
            name: name.clone(),
            ttft_ms: t.ttft_ms,
            tpot_ms: t.tpot_ms,
            weight: t.weight,
            preemptible: t.preemptible,
        })
        .collect()
}
