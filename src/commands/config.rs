//! `switchyard config check`.

use crate::cli::ConfigCommand;
use switchyard_config::{env_overrides, Config};

pub fn run(cmd: ConfigCommand) -> anyhow::Result<()> {
    match cmd {
        ConfigCommand::Check { file, overrides } => {
            let config = load(&file, &overrides)?;
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
