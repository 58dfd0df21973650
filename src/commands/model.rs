//! `switchyard model fetch`.

use crate::cli::ModelCommand;

pub fn run(cmd: ModelCommand) -> anyhow::Result<()> {
    match cmd {
        ModelCommand::Fetch { name, cache_dir } => {
            let path = switchyard_gpu::model::fetch::fetch_model(
                &name,
                cache_dir.as_deref(),
                &super::StderrProgress,
            )?;
            println!("{}", path.display());
            Ok(())
        }
    }
}
