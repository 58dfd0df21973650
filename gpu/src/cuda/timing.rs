//! Where a step's wall time goes between the host and the GPU (`SWITCHYARD_CUDA_STEP_TIMING=1`):
//! CUDA events mark when the GPU starts a step's first copy and finishes its sampling; the time
//! from one step's end to the next one's start is the GPU waiting on the host (the engine's
//! plan and apply, this backend's batch checks, packing and launches, the token copy back).
//! A step's events are read after its token copy, which waits for them anyway (a step that
//! samples nothing, a prompt chunk, waits for its end event here instead).
//! A measurement for `gpu/CUDA_NOTES.md`, printed when the backend is dropped.

use std::sync::Arc;

use cudarc::driver::{sys, CudaContext, CudaEvent, CudaStream};

use super::device::cuda_err;
use crate::error::GpuError;

/// Samples kept (a long-running server stops adding after this many steps).
const MAX_SAMPLES: usize = 1 << 20;

pub(crate) struct StepTiming {
    /// Events around each step, by step number modulo 3 (a step may start before the one
    /// before it is finished, and the gap reads the end of the one before that).
    start: [CudaEvent; 3],
    end: [CudaEvent; 3],
    /// Steps started and not finished (at most two: one submitted ahead).
    started: [Option<u64>; 3],
    /// The last finished step.
    last_finished: Option<u64>,
    gaps_us: Vec<f32>,
    spans_us: Vec<f32>,
}

impl StepTiming {
    pub fn from_env(ctx: &Arc<CudaContext>) -> Result<Option<Self>, GpuError> {
        match std::env::var("SWITCHYARD_CUDA_STEP_TIMING").as_deref() {
            Err(_) | Ok("0") | Ok("off") => return Ok(None),
            Ok(_) => {}
        }
        let ev = || {
            ctx.new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))
                .map_err(|e| cuda_err("event", e))
        };
        Ok(Some(StepTiming {
            start: [ev()?, ev()?, ev()?],
            end: [ev()?, ev()?, ev()?],
            started: [None; 3],
            last_finished: None,
            gaps_us: Vec::new(),
            spans_us: Vec::new(),
        }))
    }

    /// Marks the start of step `n` on the stream (once per step).
    pub fn start(&mut self, stream: &CudaStream, n: u64) -> Result<(), GpuError> {
        let i = (n % 3) as usize;
        if self.started[i] != Some(n) {
            self.start[i]
                .record(stream)
                .map_err(|e| cuda_err("event record", e))?;
            self.started[i] = Some(n);
        }
        Ok(())
    }

    /// Marks the end of step `n` on the stream.
    pub fn end(&mut self, stream: &CudaStream, n: u64) -> Result<(), GpuError> {
        self.end[(n % 3) as usize]
            .record(stream)
            .map_err(|e| cuda_err("event record", e))
    }

    /// Records step `n`'s time on the GPU and the GPU's idle time since step `n - 1` ended
    /// (when that one was timed too); waits for the step's end.
    pub fn finish(&mut self, n: u64) -> Result<(), GpuError> {
        let i = (n % 3) as usize;
        if self.started[i] != Some(n) {
            return Ok(());
        }
        self.started[i] = None;
        self.end[i]
            .synchronize()
            .map_err(|e| cuda_err("event wait", e))?;
        let ms =
            |a: &CudaEvent, b: &CudaEvent| a.elapsed_ms(b).map_err(|e| cuda_err("event time", e));
        if self.spans_us.len() < MAX_SAMPLES {
            self.spans_us
                .push(1000.0 * ms(&self.start[i], &self.end[i])?);
            if n > 0 && self.last_finished == Some(n - 1) {
                let prev = ((n - 1) % 3) as usize;
                self.gaps_us
                    .push(1000.0 * ms(&self.end[prev], &self.start[i])?.max(0.0));
            }
        }
        self.last_finished = Some(n);
        Ok(())
    }

    pub fn report(&self) -> String {
        let (g50, g90) = median_p90(&self.gaps_us);
        let (s50, s90) = median_p90(&self.spans_us);
        format!(
            "CUDA step timing over {} steps: GPU idle between steps median {g50:.1} us (p90 \
             {g90:.1}); step on the GPU median {s50:.1} us (p90 {s90:.1})",
            self.spans_us.len()
        )
    }
}

/// The median and the 90th percentile (nearest rank; zeros when empty).
fn median_p90(v: &[f32]) -> (f32, f32) {
    let mut s = v.to_vec();
    s.sort_by(f32::total_cmp);
    let at = |q: f64| {
        s.get(((s.len().max(1) - 1) as f64 * q).round() as usize)
            .copied()
            .unwrap_or(0.0)
    };
    (at(0.5), at(0.9))
}

#[cfg(test)]
mod tests {
    use super::median_p90;

    #[test]
    fn median_and_p90_by_nearest_rank() {
        assert_eq!(median_p90(&[]), (0.0, 0.0));
        assert_eq!(median_p90(&[7.0]), (7.0, 7.0));
        let v: Vec<f32> = (1..=11).rev().map(|x| x as f32).collect();
        assert_eq!(median_p90(&v), (6.0, 10.0));
    }
}
