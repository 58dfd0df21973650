//! Sampling on the GPU with the semantics of [`crate::sampler`]: the host keeps each
//! sequence's small state (seed, tokens sampled, the token sets the penalties read) and turns
//! logit bias, `min_tokens` masking and the repetition / presence / frequency penalties into a
//! sparse list of edits, one per (row, token), merged in the CPU sampler's order; the GPU
//! applies them and samples (greedy, or temperature with top-k, top-p and min-p).
//!
//! The random number of a sequence's `n`-th sampled token is a hash of (seed, n), so a seed
//! reproduces the same tokens whatever else is batched (the stream differs from the CPU
//! backend's ChaCha stream). Logprobs are the log-softmax of the raw logits rows, copied to the
//! host only when a request asks for logprobs or prompt logprobs.

use std::collections::{HashMap, HashSet};

use super::device::{Arg, DevMem, Gpu};
use super::step::{Layout, SampleRow};
use crate::backend::SeqInput;
use crate::error::GpuError;
use crate::sampler::SamplingParams;

/// Sampling state of one sequence across steps.
pub(crate) struct SeqState {
    /// Seed of the sequence's stream.
    pub seed: u64,
    /// Tokens sampled so far (also the stream counter).
    pub sampled: u64,
    /// No token sampled yet: fed tokens are prompt tokens.
    pub in_prompt: bool,
    /// Log-softmax of the last row of the previous prompt chunk (for prompt logprobs).
    pub pending: Option<crate::backend::HeldRow>,
    /// Prompt tokens (repetition penalty only).
    seen: HashSet<u32>,
    /// Output token counts (penalties only).
    counts: HashMap<u32, u32>,
}

impl SeqState {
    /// A fresh state.
    pub fn new(seed: u64) -> Self {
        SeqState {
            seed,
            sampled: 0,
            in_prompt: true,
            pending: None,
            seen: HashSet::new(),
            counts: HashMap::new(),
        }
    }

    /// Records this step's fed tokens (prompt tokens while in the prompt).
    pub fn observe(&mut self, s: &SeqInput) {
        if self.in_prompt && s.sampling.repetition_penalty != 1.0 {
            if let Some(prompt) = &s.cached_prompt {
                let cached = s.num_computed_tokens.min(prompt.len());
                self.seen.extend(prompt[..cached].iter().copied());
            }
            let known = s.tokens.len().saturating_sub(s.num_drafts);
            self.seen.extend(s.tokens[..known].iter().copied());
        }
    }

    /// Records a sampled token (its row was asked for by [`SeqState::sample_row`]); a draft is
    /// recorded before its step runs, so the penalties of the rows after it see it.
    pub fn record(&mut self, token: u32, p: &SamplingParams) {
        if p.repetition_penalty != 1.0 || p.presence_penalty != 0.0 || p.frequency_penalty != 0.0 {
            *self.counts.entry(token).or_insert(0) += 1;
        }
    }

    /// Takes back a [`SeqState::record`] (a rejected draft).
    pub fn unrecord(&mut self, token: u32, p: &SamplingParams) {
        if p.repetition_penalty != 1.0 || p.presence_penalty != 0.0 || p.frequency_penalty != 0.0 {
            if let Some(c) = self.counts.get_mut(&token) {
                *c -= 1;
                if *c == 0 {
                    self.counts.remove(&token);
                }
            }
        }
    }

    /// The sampling row of this sequence at logits row `row`: the next draw of its stream.
    /// Counts the token as sampled (the next step may be submitted before this one's token
    /// is read), so call it after [`SeqState::edits`] for the same row.
    pub fn sample_row(&mut self, row: usize, p: &SamplingParams) -> SampleRow {
        let counter = self.sampled;
        self.sampled += 1;
        self.in_prompt = false;
        SampleRow {
            row: row as i32,
            // The kernels' greedy rows are those of temperature 0.
            temperature: if p.is_greedy() { 0.0 } else { p.temperature },
            top_k: i32::try_from(p.top_k).unwrap_or(i32::MAX),
            top_p: p.top_p,
            min_p: p.min_p,
            seed: self.seed,
            counter,
        }
    }

    /// Appends this row's logit edits (merged per token, in the CPU sampler's order: bias,
    /// `min_tokens` mask, repetition penalty, presence and frequency penalties). With a
    /// constraint's `allowed` set that the `min_tokens` mask would empty, the mask is left out
    /// (the grammar wins, as in the CPU sampler).
    pub fn edits(&self, row: usize, p: &SamplingParams, allowed: Option<&[u32]>, out: &mut Edits) {
        self.edits_at(row, p, allowed, self.sampled, out);
    }

    /// [`SeqState::edits`] for the row sampled when `sampled` tokens had been (a row whose
    /// edits are made after [`SeqState::sample_row`] counted it).
    pub fn edits_at(
        &self,
        row: usize,
        p: &SamplingParams,
        allowed: Option<&[u32]>,
        sampled: u64,
        out: &mut Edits,
    ) {
        let mut m: HashMap<u32, Edit> = HashMap::new();
        for &(id, b) in &p.logit_bias {
            m.entry(id).or_default().bias += b;
        }
        if sampled < u64::from(p.min_tokens) && !allowed.is_some_and(|a| p.grammar_needs_a_stop(a))
        {
            for id in p.stop_ids() {
                m.entry(id).or_default().mask = true;
            }
        }
        if p.repetition_penalty != 1.0 {
            for &id in self.seen.iter().chain(self.counts.keys()) {
                m.entry(id).or_default().rep = p.repetition_penalty;
            }
        }
        if p.presence_penalty != 0.0 || p.frequency_penalty != 0.0 {
            for (&id, &c) in &self.counts {
                m.entry(id).or_default().sub = p.frequency_penalty * c as f32 + p.presence_penalty;
            }
        }
        let mut ids: Vec<u32> = m.keys().copied().collect();
        ids.sort_unstable();
        for id in ids {
            let e = m[&id];
            out.rows.push(row as i32);
            out.tokens.push(id as i32);
            out.bias.push(e.bias);
            out.mask.push(i32::from(e.mask));
            out.rep.push(e.rep);
            out.sub.push(e.sub);
        }
    }
}

/// One merged logit edit.
#[derive(Clone, Copy, Debug)]
struct Edit {
    bias: f32,
    mask: bool,
    rep: f32,
    sub: f32,
}

impl Default for Edit {
    fn default() -> Self {
        Edit {
            bias: 0.0,
            mask: false,
            rep: 1.0,
            sub: 0.0,
        }
    }
}

/// `buf`, reallocated at twice `bytes` when it holds fewer than `bytes`. The old buffer may
/// still be read by a step in flight (the edits of the step submitted before): the device
/// finishes its queued work before it is freed (rare: the buffer grows geometrically), rather
/// than relying on `cuMemFree`'s implicit synchronisation, which the driver does not promise.
fn grown<'a>(gpu: &Gpu, buf: &'a mut Option<DevMem>, bytes: usize) -> Result<&'a DevMem, GpuError> {
    if buf.as_ref().is_none_or(|b| b.bytes() < bytes) {
        if buf.is_some() {
            gpu.sync()?;
        }
        *buf = None;
        *buf = Some(gpu.alloc(bytes * 2)?);
    }
    buf.as_ref()
        .ok_or_else(|| GpuError::Internal("step buffer missing".into()))
}

/// The edits of one step, as columns.
#[derive(Debug, Default)]
pub(crate) struct Edits {
    rows: Vec<i32>,
    tokens: Vec<i32>,
    bias: Vec<f32>,
    mask: Vec<i32>,
    rep: Vec<f32>,
    sub: Vec<f32>,
}

impl Edits {
    /// Number of edits.
    pub fn len(&self) -> usize {
        self.rows.len()
    }

    /// Uploads the edits to `buf` (grown as needed) and applies them to the logits.
    pub fn apply(
        &self,
        gpu: &Gpu,
        buf: &mut Option<DevMem>,
        logits: u64,
        vocab: usize,
    ) -> Result<(), GpuError> {
        let n = self.len();
        if n == 0 {
            return Ok(());
        }
        let col = n.div_ceil(2) * 8;
        let b = grown(gpu, buf, 6 * col)?;
        gpu.upload(b.at(0)?, &self.rows)?;
        gpu.upload(b.at(col)?, &self.tokens)?;
        gpu.upload(b.at(2 * col)?, &self.bias)?;
        gpu.upload(b.at(3 * col)?, &self.mask)?;
        gpu.upload(b.at(4 * col)?, &self.rep)?;
        gpu.upload(b.at(5 * col)?, &self.sub)?;
        gpu.launch(
            &gpu.k.apply_logit_edits,
            (n.div_ceil(256) as u32, 1, 1),
            256,
            &[
                Arg::Ptr(logits),
                Arg::U64(vocab as u64),
                Arg::Ptr(b.at(0)?),
                Arg::Ptr(b.at(col)?),
                Arg::Ptr(b.at(2 * col)?),
                Arg::Ptr(b.at(3 * col)?),
                Arg::Ptr(b.at(4 * col)?),
                Arg::Ptr(b.at(5 * col)?),
                Arg::I32(n as i32),
            ],
        )?;
        // The host columns are pageable memory: the copies are complete once the kernel that
        // reads them has been ordered after them, but keep them alive until the step syncs.
        Ok(())
    }
}

/// The allowed sets of a step's constrained rows (structured output).
#[derive(Debug, Default)]
pub(crate) struct TokenMasks {
    rows: Vec<i32>,
    words: Vec<u32>,
}

impl TokenMasks {
    /// Adds logits row `row` with its allowed set (`vocab.div_ceil(32)` words).
    pub fn push(&mut self, row: usize, allowed: &[u32]) {
        self.rows.push(row as i32);
        self.words.extend_from_slice(allowed);
    }

    /// Uploads the masks to `buf` (grown as needed) and sets the logits of disallowed tokens
    /// to -inf.
    pub fn apply(
        &self,
        gpu: &Gpu,
        buf: &mut Option<DevMem>,
        logits: u64,
        vocab: usize,
    ) -> Result<(), GpuError> {
        let n = self.rows.len();
        if n == 0 {
            return Ok(());
        }
        let words = vocab.div_ceil(32);
        if self.words.len() != n * words {
            return Err(GpuError::Internal("token masks of the wrong size".into()));
        }
        let rows_bytes = n.div_ceil(4) * 16;
        let b = grown(gpu, buf, rows_bytes + self.words.len() * 4)?;
        gpu.upload(b.at(0)?, &self.rows)?;
        gpu.upload(b.at(rows_bytes)?, &self.words)?;
        gpu.launch(
            &gpu.k.apply_token_masks,
            (vocab.div_ceil(256) as u32, n as u32, 1),
            256,
            &[
                Arg::Ptr(logits),
                Arg::U64(vocab as u64),
                Arg::Ptr(b.at(0)?),
                Arg::Ptr(b.at(rows_bytes)?),
                Arg::I32(words as i32),
                Arg::I32(n as i32),
            ],
        )
    }
}

/// Device addresses of the sampling arrays of a step buffer.
pub(crate) struct SampleArrays {
    pub rows: u64,
    pub temperature: u64,
    pub top_k: u64,
    pub top_p: u64,
    pub min_p: u64,
    pub seeds: u64,
    pub counters: u64,
}

impl SampleArrays {
    /// The device addresses of the sampling arrays of a step buffer laid out as `lay`;
    /// `at` turns a byte offset into the buffer into a device address.
    pub(crate) fn at(
        lay: &Layout,
        at: impl Fn(usize) -> Result<u64, GpuError>,
    ) -> Result<Self, GpuError> {
        Ok(Self {
            rows: at(lay.sample_rows)?,
            temperature: at(lay.temperature)?,
            top_k: at(lay.top_k)?,
            top_p: at(lay.top_p)?,
            min_p: at(lay.min_p)?,
            seeds: at(lay.seeds)?,
            counters: at(lay.counters)?,
        })
    }
}

/// Most blocks one greedy row is split over (`argmax_split`).
const ARGMAX_MAX_SPLITS: usize = 32;

/// Logits each block of a split greedy row reads at least.
const ARGMAX_MIN_SLICE: usize = 1024;

/// Blocks per greedy row for `rows` sampled rows of `vocab` logits on `sm_count`
/// multiprocessors: enough to give every multiprocessor two blocks, at most
/// [`ARGMAX_MAX_SPLITS`], each slice at least [`ARGMAX_MIN_SLICE`] logits. 1: no split (one
/// `sample_rows` block per row, which already fills the GPU at that many rows).
pub(crate) fn argmax_splits(rows: usize, vocab: usize, sm_count: usize) -> usize {
    if rows == 0 {
        return 1;
    }
    (2 * sm_count / rows)
        .min(ARGMAX_MAX_SPLITS)
        .min(vocab / ARGMAX_MIN_SLICE)
        .max(1)
}

/// Threads of `sample_rows` (`SAMPLE_THREADS`): the chunks its rows are summed in.
const SAMPLE_CHUNKS: usize = 1024;

/// Most rows a split step holds: `argmax_splits` splits only when every row gets two blocks.
const SPLIT_MAX_ROWS: usize = 256;

/// Device scratch of the split path: one 64-bit key per (row, split) and one ticket per row
/// (zero between launches: the last block of a row resets it); for plain tempered rows the
/// row's max and its `SAMPLE_CHUNKS` chunk sums.
pub(crate) struct ArgmaxScratch {
    part: DevMem,
    tickets: DevMem,
    row_max: DevMem,
    sums: DevMem,
    rows: usize,
}

impl ArgmaxScratch {
    /// Scratch for split steps of up to `rows` sampled rows (at most [`SPLIT_MAX_ROWS`]).
    pub(crate) fn new(gpu: &Gpu, rows: usize) -> Result<Self, GpuError> {
        let rows = rows.clamp(1, SPLIT_MAX_ROWS);
        let part = gpu.alloc(rows * ARGMAX_MAX_SPLITS * 8)?;
        let tickets = gpu.alloc(rows * 4)?;
        let row_max = gpu.alloc(rows * 4)?;
        let sums = gpu.alloc(rows * SAMPLE_CHUNKS * 4)?;
        gpu.upload(tickets.ptr(), &vec![0u32; rows])?;
        gpu.sync()?;
        Ok(Self {
            part,
            tickets,
            row_max,
            sums,
            rows,
        })
    }

    /// Bytes of device memory for `rows` rows.
    pub(crate) fn bytes(rows: usize) -> usize {
        rows.clamp(1, SPLIT_MAX_ROWS) * (ARGMAX_MAX_SPLITS * 8 + 8 + SAMPLE_CHUNKS * 4)
    }
}

/// Whether a row is tempered without a top-k or top-p cut (`plain_tempered` in the kernels):
/// its chunk sums can be computed over several blocks before `sample_rows` runs.
fn plain_tempered(r: &SampleRow, vocab: usize) -> bool {
    r.temperature > 0.0 && !(r.top_k > 0 && (r.top_k as usize) < vocab) && r.top_p >= 1.0
}

/// Samples the rows of `samples` (the host's view of the arrays in `a`) into `out` (i32 per
/// row). With `split`, in a step of few rows, greedy rows run on `argmax_split` (each row over
/// several blocks) and plain tempered rows (no top-k or top-p cut) take their max from it and
/// their chunk sums from `sample_partials` before `sample_rows` draws their token; the other
/// rows run on `sample_rows` alone. The tokens are the same bits either way.
pub(crate) fn sample(
    gpu: &Gpu,
    logits: u64,
    vocab: usize,
    a: &SampleArrays,
    samples: &[SampleRow],
    out: u64,
    split: Option<&ArgmaxScratch>,
) -> Result<(), GpuError> {
    let n = samples.len();
    let greedy = samples.iter().filter(|r| r.temperature == 0.0).count();
    let plain = samples.iter().filter(|r| plain_tempered(r, vocab)).count();
    let splits = argmax_splits(n, vocab, gpu.sm_count);
    let split = split.filter(|sc| (greedy > 0 || plain > 0) && splits > 1 && n <= sc.rows);
    // The arguments every sampling kernel starts with: the logits and the rows' parameters.
    let rows = [
        Arg::Ptr(logits),
        Arg::U64(vocab as u64),
        Arg::Ptr(a.rows),
        Arg::Ptr(a.temperature),
        Arg::Ptr(a.top_k),
        Arg::Ptr(a.top_p),
    ];
    let (skip_greedy, row_max, sums) = match split {
        Some(sc) => {
            let (row_max, sums) = if plain > 0 {
                (sc.row_max.ptr(), sc.sums.ptr())
            } else {
                (0, 0)
            };
            gpu.launch(
                &gpu.k.argmax_split,
                (n as u32, splits as u32, 1),
                256,
                &[
                    &rows[..],
                    &[
                        Arg::Ptr(sc.part.ptr()),
                        Arg::Ptr(sc.tickets.ptr()),
                        Arg::Ptr(out),
                        Arg::Ptr(row_max),
                    ],
                ]
                .concat(),
            )?;
            if plain > 0 {
                gpu.launch(
                    &gpu.k.sample_partials,
                    (n as u32, (SAMPLE_CHUNKS / 32) as u32, 1),
                    32,
                    &[
                        &rows[..],
                        &[Arg::Ptr(a.min_p), Arg::Ptr(row_max), Arg::Ptr(sums)],
                    ]
                    .concat(),
                )?;
            }
            (true, row_max, sums)
        }
        None => (false, 0, 0),
    };
    if skip_greedy && greedy == n {
        return Ok(());
    }
    gpu.launch(
        &gpu.k.sample_rows,
        (n as u32, 1, 1),
        1024,
        &[
            &rows[..],
            &[
                Arg::Ptr(a.min_p),
                Arg::Ptr(a.seeds),
                Arg::Ptr(a.counters),
                Arg::Ptr(out),
                Arg::I32(i32::from(skip_greedy)),
                Arg::Ptr(row_max),
                Arg::Ptr(sums),
            ],
        ]
        .concat(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_rows_split_only_where_rows_are_few() {
        // H200: 132 multiprocessors. One row of Llama-3's vocabulary: 32 blocks; SmolLM2's
        // 49,152: 32 (48 slices of 1024 fit); 8 rows: 32; 64 rows: 4; 200 rows: 1 (no split).
        assert_eq!(argmax_splits(1, 128_256, 132), 32);
        assert_eq!(argmax_splits(1, 49_152, 132), 32);
        assert_eq!(argmax_splits(8, 128_256, 132), 32);
        assert_eq!(argmax_splits(64, 128_256, 132), 4);
        assert_eq!(argmax_splits(200, 128_256, 132), 1);
        // Small vocabularies: every slice keeps 1024 logits; below that, no split.
        assert_eq!(argmax_splits(1, 5_000, 132), 4);
        assert_eq!(argmax_splits(1, 1_000, 132), 1);
        assert_eq!(argmax_splits(0, 128_256, 132), 1);
    }

    #[test]
    fn prompt_tokens_from_the_prefix_cache_are_penalised_like_fed_ones() {
        let p = SamplingParams {
            repetition_penalty: 2.0,
            ..SamplingParams::default()
        };
        // Positions 0..4 came from the prefix cache; 4..6 are fed.
        let mut st = SeqState::new(1);
        st.observe(&SeqInput {
            seq_id: 1,
            num_computed_tokens: 4,
            tokens: vec![8, 9],
            block_table: vec![0, 1],
            sample: true,
            num_drafts: 0,
            sampling: std::sync::Arc::new(p.clone()),
            adapter: None,
            cached_prompt: Some(std::sync::Arc::from(vec![3u32, 4, 5, 6, 8, 9])),
        });
        let mut e = Edits::default();
        st.edits(0, &p, None, &mut e);
        assert_eq!(e.tokens, vec![3, 4, 5, 6, 8, 9]);
    }

    #[test]
    fn edits_merge_in_the_cpu_order() {
        let p = SamplingParams {
            logit_bias: vec![(3, 1.0), (3, 0.5), (7, -2.0)],
            min_tokens: 1,
            eos_token_ids: vec![2],
            repetition_penalty: 1.5,
            presence_penalty: 0.25,
            frequency_penalty: 0.5,
            ..SamplingParams::default()
        };
        let mut st = SeqState::new(1);
        let s = SeqInput {
            seq_id: 1,
            num_computed_tokens: 0,
            tokens: vec![3, 4],
            block_table: vec![0],
            sample: true,
            num_drafts: 0,
            sampling: std::sync::Arc::new(p.clone()),
            adapter: None,
            cached_prompt: None,
        };
        st.observe(&s);
        let mut e = Edits::default();
        st.edits(0, &p, None, &mut e);
        // Tokens 2 (masked), 3 (bias 1.5, seen), 4 (seen), 7 (bias).
        assert_eq!(e.tokens, vec![2, 3, 4, 7]);
        assert_eq!(e.mask, vec![1, 0, 0, 0]);
        assert_eq!(e.bias, vec![0.0, 1.5, 0.0, -2.0]);
        assert_eq!(e.rep, vec![1.0, 1.5, 1.5, 1.0]);
        // Two tokens: each row asked for (the stream advances), then its token recorded.
        assert_eq!(st.sample_row(0, &p).counter, 0);
        st.record(9, &p);
        assert_eq!(st.sample_row(0, &p).counter, 1);
        assert!(!st.in_prompt);
        st.record(9, &p);
        let mut e = Edits::default();
        st.edits(5, &p, None, &mut e);
        // min_tokens reached: no mask; 9 is an output token twice.
        assert_eq!(e.tokens, vec![3, 4, 7, 9]);
        assert!(e.mask.iter().all(|&m| m == 0));
        assert_eq!(e.sub[3], 0.5 * 2.0 + 0.25);
        assert_eq!(e.rep[3], 1.5);
        assert!(e.rows.iter().all(|&r| r == 5));
        assert_eq!(st.sample_row(5, &p).counter, 2);
    }
}
