//! ShareGPT length CSV as processed by Sarathi-Serve (Agrawal et al., OSDI'24;
//! `microsoft/sarathi-serve` `data/processed_traces/`): `num_prefill_tokens`,
//! `num_decode_tokens` per conversation turn, no timestamps. Arrivals come from
//! a seeded Poisson process, or a Gamma renewal process with a chosen
//! coefficient of variation (shape `1/cv²`, as Vidur's gamma request-interval
//! generator does), at a chosen rate.

use super::azure::parse_u64;
use super::{
    add_total, check_output_len, check_prompt_len, for_each_line, unique_prompt, LoadOptions,
    TraceRequest,
};
use crate::error::SimError;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use rand_distr::{Distribution, Exp, Gamma};
use serde::{Deserialize, Serialize};
use std::io::BufRead;
use std::path::Path;

const COLUMNS: [&str; 2] = ["num_prefill_tokens", "num_decode_tokens"];

/// How arrival times are generated for traces without timestamps.
#[derive(Copy, Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "process", rename_all = "lowercase", deny_unknown_fields)]
pub enum ArrivalProcess {
    /// Exponential inter-arrival gaps (coefficient of variation 1).
    Poisson {
        /// Mean arrivals per second.
        rate: f64,
    },
    /// Gamma inter-arrival gaps with shape `1/cv²`: burstier than Poisson for `cv > 1`.
    Gamma {
        /// Mean arrivals per second.
        rate: f64,
        /// Coefficient of variation of the gaps.
        cv: f64,
    },
}

impl ArrivalProcess {
    /// The mean rate in requests per second.
    pub fn rate(&self) -> f64 {
        match *self {
            ArrivalProcess::Poisson { rate } | ArrivalProcess::Gamma { rate, .. } => rate,
        }
    }

    /// The same process at another rate.
    pub fn with_rate(self, rate: f64) -> Self {
        match self {
            ArrivalProcess::Poisson { .. } => ArrivalProcess::Poisson { rate },
            ArrivalProcess::Gamma { cv, .. } => ArrivalProcess::Gamma { rate, cv },
        }
    }

    /// `n` arrival times in seconds, the first at 0, from a ChaCha8 generator seeded by `seed`.
    pub fn arrival_times(&self, n: usize, seed: u64) -> Result<Vec<f64>, String> {
        let rate = self.rate();
        if !(rate.is_finite() && rate > 0.0 && rate <= 1e9) {
            return Err(format!(
                "arrival rate {rate} must be in (0, 1e9] requests/s"
            ));
        }
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        rng.set_stream(3);
        let mut gaps: Box<dyn FnMut(&mut ChaCha8Rng) -> f64> = match *self {
            ArrivalProcess::Poisson { .. } => {
                let d = Exp::new(rate).map_err(|e| e.to_string())?;
                Box::new(move |r| d.sample(r))
            }
            ArrivalProcess::Gamma { cv, .. } => {
                if !(cv.is_finite() && cv > 0.0 && cv <= 100.0) {
                    return Err(format!(
                        "gamma cv {} must be in (0, 100]",
                        crate::spec::short_number(cv)
                    ));
                }
                let shape = 1.0 / (cv * cv);
                let d = Gamma::new(shape, 1.0 / (rate * shape)).map_err(|e| e.to_string())?;
                Box::new(move |r| d.sample(r))
            }
        };
        let mut t = 0.0;
        Ok((0..n)
            .map(|i| {
                if i > 0 {
                    t += gaps(&mut rng);
                }
                t
            })
            .collect())
    }
}

/// Loads a ShareGPT length CSV and stamps arrivals from `arrivals` seeded by `seed`.
pub fn load_sharegpt(
    reader: impl BufRead,
    path: &Path,
    options: &LoadOptions,
    arrivals: &ArrivalProcess,
    seed: u64,
) -> Result<Vec<TraceRequest>, SimError> {
    let mut out = Vec::new();
    let mut cols: Option<[usize; 2]> = None;
    let mut total = 0usize;
    for_each_line(reader, path, |line, text| {
        let fields: Vec<&str> = text.split(',').map(str::trim).collect();
        let Some(idx) = cols else {
            let mut idx = [0usize; 2];
            for (slot, name) in idx.iter_mut().zip(COLUMNS) {
                *slot = fields
                    .iter()
                    .position(|f| *f == name)
                    .ok_or_else(|| super::missing_column(path, line, &fields, name, "sharegpt"))?;
            }
            cols = Some(idx);
            return Ok(true);
        };
        let get = |i: usize| {
            fields
                .get(idx[i])
                .copied()
                .ok_or_else(|| SimError::trace(path, line, COLUMNS[i], "missing column"))
        };
        let p = check_prompt_len(
            path,
            line,
            COLUMNS[0],
            parse_u64(get(0)?, path, line, COLUMNS[0])?,
        )?;
        let o = check_output_len(
            path,
            line,
            COLUMNS[1],
            parse_u64(get(1)?, path, line, COLUMNS[1])?,
        )?;
        if options.full(out.len()) {
            // Reached only with a limit of 0: otherwise reading stops right after the push
            // that fills the trace.
            return Ok(false);
        }
        add_total(&mut total, p, path, line)?;
        out.push(TraceRequest::untagged(
            0.0,
            unique_prompt(out.len() as u64, p),
            o,
        ));
        Ok(!options.full(out.len()))
    })?;
    if cols.is_none() {
        return Err(SimError::trace(
            path,
            1,
            "<header>",
            "empty file, expected a CSV header",
        ));
    }
    let times = arrivals
        .arrival_times(out.len(), seed)
        .map_err(|m| SimError::spec(path, m))?;
    for (r, t) in out.iter_mut().zip(times) {
        r.arrival_s = t;
    }
    out.retain(|r| options.in_window(r.arrival_s));
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stats(xs: &[f64]) -> (f64, f64) {
        let gaps: Vec<f64> = xs.windows(2).map(|w| w[1] - w[0]).collect();
        let n = gaps.len() as f64;
        let mean = gaps.iter().sum::<f64>() / n;
        let var = gaps.iter().map(|g| (g - mean).powi(2)).sum::<f64>() / n;
        (mean, var.sqrt() / mean)
    }

    #[test]
    fn poisson_and_gamma_have_the_requested_rate_and_cv() {
        let p = ArrivalProcess::Poisson { rate: 4.0 }
            .arrival_times(20_001, 1)
            .unwrap();
        let (mean, cv) = stats(&p);
        assert!((mean - 0.25).abs() < 0.01, "{mean}");
        assert!((cv - 1.0).abs() < 0.05, "{cv}");
        let g = ArrivalProcess::Gamma { rate: 2.0, cv: 3.0 }
            .arrival_times(50_001, 1)
            .unwrap();
        let (mean, cv) = stats(&g);
        assert!((mean - 0.5).abs() < 0.05, "{mean}");
        assert!((cv - 3.0).abs() < 0.3, "{cv}");
        assert_eq!(
            ArrivalProcess::Poisson { rate: 4.0 }
                .arrival_times(20_001, 1)
                .unwrap(),
            p
        );
        assert!(ArrivalProcess::Poisson { rate: 0.0 }
            .arrival_times(2, 1)
            .is_err());
        assert!(ArrivalProcess::Gamma {
            rate: 1.0,
            cv: -1.0
        }
        .arrival_times(2, 1)
        .is_err());
    }

    #[test]
    fn loads_lengths_and_names_bad_fields() {
        let text = "num_prefill_tokens,num_decode_tokens,num_total_tokens,pd_ratio\n74,918,992,0.08\n290,905,1195,0.32\n";
        let rs = load_sharegpt(
            text.as_bytes(),
            Path::new("s.csv"),
            &LoadOptions::default(),
            &ArrivalProcess::Poisson { rate: 1.0 },
            0,
        )
        .unwrap();
        assert_eq!(rs.len(), 2);
        assert_eq!((rs[0].prompt.len(), rs[0].output_len), (74, 918));
        assert_eq!(rs[0].arrival_s, 0.0);
        assert!(rs[1].arrival_s > 0.0);
        let bad = "num_prefill_tokens,num_decode_tokens\n74,-3\n";
        let err = load_sharegpt(
            bad.as_bytes(),
            Path::new("s.csv"),
            &LoadOptions::default(),
            &ArrivalProcess::Poisson { rate: 1.0 },
            0,
        )
        .unwrap_err();
        assert!(
            err.to_string()
                .starts_with("s.csv:2: field `num_decode_tokens`"),
            "{err}"
        );
    }
}
