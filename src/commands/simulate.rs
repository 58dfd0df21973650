//! `switchyard simulate`: replays a trace against scheduling policies with a virtual clock.

use switchyard_simulator::{CliOptions, SimulationSpec, TraceFormat};

use crate::cli::{SimulateArgs, TraceFormat as CliFormat};

pub fn run(args: SimulateArgs) -> anyhow::Result<()> {
    // `--time-scale t` divides arrival times (2 = twice as fast), as `workload.time_scale` does.
    let time_scale = match args.time_scale {
        Some(t) => {
            anyhow::ensure!(
                t.is_finite() && t > 0.0 && (1.0 / t).is_finite(),
                "--time-scale must be a finite number > 0 (2 = twice as fast), not {t}"
            );
            Some(t)
        }
        None => None,
    };
    let spec = match (&args.config, &args.trace) {
        (Some(file), _) => SimulationSpec::from_yaml_file(file)?,
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
                time_scale,
            })?
        }
        (None, None) => anyhow::bail!("give --config FILE, or --trace FILE --format F"),
    };
    let comparison = switchyard_simulator::run(&spec, &args.out, super::progress_enabled())?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&comparison)?);
    } else {
        print!("{}", comparison.to_text());
        eprintln!(
            "wrote summary, per-request JSONL and SVG plots to {}",
            args.out.display()
        );
    }
    Ok(())
}
