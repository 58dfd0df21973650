//! `switchyard simulate`: replays a trace against scheduling policies with a virtual clock.

use switchyard_simulator::{CliOptions, SimulationSpec, TraceFormat};

use crate::cli::{SimulateArgs, TraceFormat as CliFormat};

pub fn run(args: SimulateArgs) -> anyhow::Result<()> {
    // `SimulationSpec::from_cli` checks the flags' ranges (--rate, --load, --time-scale).
    let spec = match (&args.config, &args.trace) {
        (Some(file), _) => SimulationSpec::from_yaml_file(file).map_err(|e| {
            super::config::with_kind_hint(e.into(), file, super::config::FileKind::Simulation)
        })?,
        (None, Some(trace)) => {
            let format = match args.format {
                Some(CliFormat::Azure) => TraceFormat::Azure,
                Some(CliFormat::Mooncake) => TraceFormat::Mooncake,
                Some(CliFormat::Sharegpt) => TraceFormat::Sharegpt,
                Some(CliFormat::Jsonl) => TraceFormat::Jsonl,
                None => anyhow::bail!("--trace needs --format azure|mooncake|sharegpt|jsonl"),
            };
            SimulationSpec::from_cli(&CliOptions {
                trace: trace.clone(),
                format,
                policies: args.policies.clone(),
                seed: args.seed,
                model: args.model.clone(),
                hardware: args.hardware.clone(),
                limit: args.limit,
                rate: args.rate,
                load: args.load,
                time_scale: args.time_scale,
                tiers: match &args.tiers {
                    Some(file) => SimulationSpec::tiers_from_file(file)?,
                    None => Default::default(),
                },
            })?
        }
        (None, None) => anyhow::bail!("give --config FILE, or --trace FILE --format F"),
    };
    // A pipe is read as it comes (a named pipe's open waits for its writer): said first, so
    // that a wait for a writer that never comes is not a silent hang.
    let trace = &spec.workload.trace;
    if std::fs::metadata(trace).is_ok_and(|m| !m.is_file() && !m.is_dir()) {
        eprintln!(
            "reading the trace {} as a stream (not a regular file: at most {} bytes)",
            trace.display(),
            switchyard_simulator::trace::MAX_STREAM_BYTES
        );
    }
    let (comparison, files) = switchyard_simulator::run(&spec, &args.out, true)?;
    for w in &comparison.warnings {
        eprintln!("warning: {w}");
    }
    if args.json {
        println!("{}", serde_json::to_string_pretty(&comparison)?);
    } else {
        print!("{}", comparison.to_text());
        eprintln!(
            "wrote summary, per-request JSONL and SVG plots to {}",
            args.out.display()
        );
    }
    // Said in both modes, on stderr: files disappearing from a directory is worth a line.
    if !files.removed.is_empty() {
        eprintln!(
            "removed an earlier run's files there that this run does not write: {}",
            files.removed.join(", ")
        );
    }
    Ok(())
}
