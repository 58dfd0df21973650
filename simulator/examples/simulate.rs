//! Runs a simulation spec and prints the comparison table:
//! `cargo run --release -p switchyard-simulator --example simulate -- SPEC.yaml OUT_DIR`.

use std::path::Path;
use std::time::Instant;
use switchyard_simulator::{run, SimError, SimulationSpec};

fn main() -> Result<(), SimError> {
    let args: Vec<String> = std::env::args().collect();
    let (Some(spec), Some(out)) = (args.get(1), args.get(2)) else {
        eprintln!("usage: simulate SPEC.yaml OUT_DIR");
        std::process::exit(2);
    };
    let spec = SimulationSpec::from_yaml_file(Path::new(spec))?;
    let start = Instant::now();
    let (comparison, _) = run(&spec, Path::new(out), true)?;
    print!("{}", comparison.to_text());
    eprintln!("wall time {:.2} s", start.elapsed().as_secs_f64());
    Ok(())
}
