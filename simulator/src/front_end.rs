//! The front end's time per request: what the server spends on a request outside the engine's
//! steps before the request can be scheduled (its HTTP body and JSON, the chat template,
//! tokenization in the tokenizer pool, the hops to the detokenizer and the scheduler).
//!
//! ```text
//! ready_s = arrival_s + front_end_us * 1e-6 + front_end_per_token_us * 1e-6 * prompt_tokens
//! ```
//!
//! The simulator queues a request at `ready_s`, not at its arrival; its TTFT and E2E latency
//! still run from its arrival, and the delay occupies no engine step: other requests' steps go
//! on meanwhile, as the server's tokenizer threads work beside its engine. This is the term the
//! step-cost models leave out: at light load, where a request rarely waits for another, it is a
//! large part of a small TTFT (v0.32.0 measured the simulator's TTFT at 0.39x the server's on
//! an H200 without it). The server measures it on its own requests
//! (`switchyard:request_front_end_seconds`), and `switchyard calibrate` times the tokenizer
//! on prompts of several lengths to fit both parts ([`fit`]).

/// Largest fixed front-end time, in microseconds (10 s).
pub const MAX_FRONT_END_US: f64 = 1e7;
/// Largest front-end time per prompt token, in microseconds (10 ms).
pub const MAX_FRONT_END_PER_TOKEN_US: f64 = 1e4;

/// A request's time in the front end before it is queued.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct FrontEnd {
    /// Fixed time per request, in microseconds.
    pub fixed_us: f64,
    /// Time per prompt token, in microseconds.
    pub per_token_us: f64,
}

impl FrontEnd {
    /// Microseconds a request of `prompt_tokens` spends in the front end (whole microseconds,
    /// at most [`MAX_FRONT_END_US`] plus the per-token part of `prompt_tokens`).
    pub fn delay_us(&self, prompt_tokens: usize) -> u64 {
        let us = self.fixed_us + self.per_token_us * prompt_tokens as f64;
        // Both parts are validated finite and not negative; `as` saturates what is left.
        us.max(0.0).round() as u64
    }

    /// Whether it delays no request.
    pub fn is_zero(&self) -> bool {
        self.fixed_us == 0.0 && self.per_token_us == 0.0
    }
}

/// Checks a fixed front-end time (`what` names it in the message).
pub fn check_fixed_us(what: &str, us: f64) -> Result<(), String> {
    if (0.0..=MAX_FRONT_END_US).contains(&us) {
        Ok(())
    } else {
        Err(format!(
            "{what} {us} outside 0..={MAX_FRONT_END_US} (microseconds per request)"
        ))
    }
}

/// Checks a front-end time per prompt token (`what` names it in the message).
pub fn check_per_token_us(what: &str, us: f64) -> Result<(), String> {
    if (0.0..=MAX_FRONT_END_PER_TOKEN_US).contains(&us) {
        Ok(())
    } else {
        Err(format!(
            "{what} {us} outside 0..={MAX_FRONT_END_PER_TOKEN_US} (microseconds per prompt token)"
        ))
    }
}

/// Fits the front end's two parts to measured (prompt tokens, microseconds) pairs by least
/// squares, with neither part negative: a negative slope (noise over prompts of one length)
/// leaves the mean as the fixed part, a negative intercept fits the line through the origin.
/// `None` without a finite measurement.
pub fn fit(samples: &[(usize, f64)]) -> Option<FrontEnd> {
    let pts: Vec<(f64, f64)> = samples
        .iter()
        .filter(|(_, us)| us.is_finite() && *us >= 0.0)
        .map(|&(n, us)| (n as f64, us))
        .collect();
    if pts.is_empty() {
        return None;
    }
    let len = pts.len() as f64;
    let (mx, my) = (
        pts.iter().map(|p| p.0).sum::<f64>() / len,
        pts.iter().map(|p| p.1).sum::<f64>() / len,
    );
    let sxx: f64 = pts.iter().map(|p| (p.0 - mx) * (p.0 - mx)).sum();
    let sxy: f64 = pts.iter().map(|p| (p.0 - mx) * (p.1 - my)).sum();
    let slope = if sxx > 0.0 { sxy / sxx } else { 0.0 };
    let (fixed_us, per_token_us) = if slope <= 0.0 {
        (my, 0.0)
    } else if my - slope * mx < 0.0 {
        let sxx0: f64 = pts.iter().map(|p| p.0 * p.0).sum();
        let sxy0: f64 = pts.iter().map(|p| p.0 * p.1).sum();
        (0.0, sxy0 / sxx0)
    } else {
        (my - slope * mx, slope)
    };
    Some(FrontEnd {
        fixed_us: fixed_us.min(MAX_FRONT_END_US),
        per_token_us: per_token_us.min(MAX_FRONT_END_PER_TOKEN_US),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_delay_is_the_fixed_part_plus_the_prompts_part() {
        let f = FrontEnd {
            fixed_us: 250.0,
            per_token_us: 1.5,
        };
        assert_eq!(f.delay_us(0), 250);
        // 250 + 1.5 * 101 = 401.5, rounded.
        assert_eq!(f.delay_us(101), 402);
        assert_eq!(FrontEnd::default().delay_us(100_000), 0);
        assert!(FrontEnd::default().is_zero() && !f.is_zero());
        // The largest validated parts on the largest prompt stay exact integers.
        let max = FrontEnd {
            fixed_us: MAX_FRONT_END_US,
            per_token_us: MAX_FRONT_END_PER_TOKEN_US,
        };
        assert_eq!(max.delay_us(1 << 20), 10_000_000 + 10_000 * (1 << 20));
    }

    #[test]
    fn the_fit_recovers_a_line_and_never_goes_negative() {
        let line: Vec<(usize, f64)> = [16, 64, 256, 1024]
            .iter()
            .map(|&n| (n, 120.0 + 0.75 * n as f64))
            .collect();
        let f = fit(&line).unwrap();
        assert!((f.fixed_us - 120.0).abs() < 1e-9, "{f:?}");
        assert!((f.per_token_us - 0.75).abs() < 1e-12, "{f:?}");
        // Falling with the prompt (noise): the mean, no slope.
        let f = fit(&[(10, 300.0), (1000, 100.0)]).unwrap();
        assert_eq!((f.fixed_us, f.per_token_us), (200.0, 0.0));
        // A line below the origin: through it.
        let f = fit(&[(100, 10.0), (200, 30.0)]).unwrap();
        assert_eq!(f.fixed_us, 0.0);
        assert!((f.per_token_us - 0.14).abs() < 1e-12, "{f:?}");
        // One prompt length: its mean, fixed.
        let f = fit(&[(64, 80.0), (64, 100.0)]).unwrap();
        assert_eq!((f.fixed_us, f.per_token_us), (90.0, 0.0));
        assert_eq!(fit(&[]), None);
        assert_eq!(fit(&[(1, f64::NAN), (2, -1.0)]), None);
    }

    #[test]
    fn bounds_are_checked_by_name() {
        assert!(check_fixed_us("front_end_us", 0.0).is_ok());
        assert!(check_fixed_us("front_end_us", MAX_FRONT_END_US).is_ok());
        for bad in [-1.0, f64::NAN, f64::INFINITY, 1e8] {
            let e = check_fixed_us("scheduler.front_end_us", bad).unwrap_err();
            assert!(e.starts_with("scheduler.front_end_us"), "{e}");
            let e = check_per_token_us("front_end_per_token_us", bad).unwrap_err();
            assert!(e.starts_with("front_end_per_token_us"), "{e}");
        }
    }
}
