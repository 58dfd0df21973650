//! One step's inputs for the device: the batch checked (as the CPU backend checks it), then
//! flattened into the arrays the kernels read (tokens, positions, KV slots, attention tiles,
//! block tables, logit rows, sampling parameters), packed into one host buffer with a fixed
//! layout and copied to the device in one transfer.
//!
//! The layout depends only on the capacities it is built for, so a CUDA graph captured for a
//! decode bucket of `B` sequences finds every array at the same address on each replay; the
//! block tables come last, with their stride in the `meta` words the kernels read.

use crate::backend::{Batch, MAX_LOGIT_ROWS};
use crate::error::GpuError;

/// Query rows one attention block holds (`MMA_ROWS` in the kernels): tokens x the query
/// heads of one KV head.
pub(crate) const ATT_ROWS: usize = 64;
/// Keys per shared-memory chunk in the attention kernel (`MMA_KEYS`); split lengths are
/// multiples of it.
pub(crate) const ATT_KEYS: usize = 64;
/// Tiles of at most this many rows run in the one-warp attention blocks.
pub(crate) const ATT_SMALL_ROWS: usize = 16;
/// Most splits of the key range (split-K decoding).
pub(crate) const MAX_SPLITS: usize = 32;
/// Attention blocks worth launching at least (about two per multiprocessor on an H100/H200).
const TARGET_BLOCKS: usize = 264;

/// Byte offsets of the arrays of a step buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Layout {
    pub meta: usize,
    pub tokens: usize,
    pub pos: usize,
    pub slots: usize,
    pub tile_seq: usize,
    pub tile_q0: usize,
    pub tile_qn: usize,
    pub logit_rows: usize,
    pub sample_rows: usize,
    pub temperature: usize,
    pub top_k: usize,
    pub top_p: usize,
    pub min_p: usize,
    pub seeds: usize,
    pub counters: usize,
    pub tables: usize,
}

impl Layout {
    /// Offsets for `tokens` tokens, `tiles` tiles, `rows` logit rows and `samples` sampled rows.
    pub fn new(tokens: usize, tiles: usize, rows: usize, samples: usize) -> Self {
        let mut off = 0usize;
        let mut take = |bytes: usize| {
            let at = off;
            off += bytes.div_ceil(8) * 8;
            at
        };
        Layout {
            meta: take(16),
            tokens: take(4 * tokens),
            pos: take(4 * tokens),
            slots: take(8 * tokens),
            tile_seq: take(4 * tiles),
            tile_q0: take(4 * tiles),
            tile_qn: take(4 * tiles),
            logit_rows: take(4 * rows),
            sample_rows: take(4 * samples),
            temperature: take(4 * samples),
            top_k: take(4 * samples),
            top_p: take(4 * samples),
            min_p: take(4 * samples),
            seeds: take(8 * samples),
            counters: take(8 * samples),
            tables: take(0),
        }
    }
}

/// Per-sampled-row parameters (filled by the sampling side).
#[derive(Clone, Debug, Default)]
pub(crate) struct SampleRow {
    /// Row of the logits buffer.
    pub row: i32,
    pub temperature: f32,
    pub top_k: i32,
    pub top_p: f32,
    pub min_p: f32,
    pub seed: u64,
    pub counter: u64,
}

/// A flattened step.
#[derive(Debug, Default)]
pub(crate) struct StepData {
    pub tokens: Vec<i32>,
    pub pos: Vec<i32>,
    pub slots: Vec<i64>,
    pub tile_seq: Vec<i32>,
    pub tile_q0: Vec<i32>,
    pub tile_qn: Vec<i32>,
    /// Flattened token index of each logits row.
    pub logit_rows: Vec<i32>,
    /// Block tables, `stride` entries per sequence.
    pub tables: Vec<i32>,
    pub stride: usize,
    /// Longest key range of any tile (position of its last query + 1).
    pub max_keys: usize,
    /// The first `small_tiles` tiles have at most [`ATT_SMALL_ROWS`] rows (one-warp blocks);
    /// the larger ones follow.
    pub small_tiles: usize,
}

impl StepData {
    /// Whether every sequence has exactly one query token in the step (decode steps; see
    /// `Launch::early_kv`). Sequences are numbered 0.. and each has at least one tile, so one
    /// tile of one token per sequence means as many tiles as sequences, each of one token.
    pub fn one_token_per_seq(&self) -> bool {
        let seqs = self.tile_seq.iter().max().map_or(0, |&m| m as usize + 1);
        self.tile_qn.len() == seqs && self.tile_qn.iter().all(|&q| q == 1)
    }
}

/// Flattens a checked batch; `rows(i)` names the chunk rows of sequence `i` needing logits.
pub(crate) fn flatten(
    batch: &Batch,
    group: usize,
    block_size: usize,
    rows: impl Fn(usize) -> Vec<usize>,
) -> Result<StepData, GpuError> {
    if group == 0 || group > ATT_ROWS {
        return Err(GpuError::InvalidConfig(format!(
            "{group} query heads per KV head: the attention kernel takes 1 to {ATT_ROWS}"
        )));
    }
    let qt = ATT_ROWS / group;
    let mut large: Vec<(i32, i32, i32)> = Vec::new();
    let mut d = StepData {
        stride: batch
            .seqs
            .iter()
            .map(|s| (s.num_computed_tokens + s.tokens.len() - 1) / block_size + 1)
            .max()
            .unwrap_or(1),
        ..StepData::default()
    };
    for (i, s) in batch.seqs.iter().enumerate() {
        let base = d.tokens.len();
        for r in rows(i) {
            d.logit_rows.push((base + r) as i32);
        }
        for (j, &t) in s.tokens.iter().enumerate() {
            let p = s.num_computed_tokens + j;
            d.tokens.push(t as i32);
            d.pos.push(p as i32);
            let block = s.block_table[p / block_size] as i64;
            d.slots
                .push(block * block_size as i64 + (p % block_size) as i64);
        }
        let n = s.tokens.len();
        let mut j = 0;
        while j < n {
            let qn = qt.min(n - j);
            if qn * group <= ATT_SMALL_ROWS {
                d.tile_seq.push(i as i32);
                d.tile_q0.push((base + j) as i32);
                d.tile_qn.push(qn as i32);
            } else {
                large.push((i as i32, (base + j) as i32, qn as i32));
            }
            j += qn;
        }
        d.max_keys = d.max_keys.max(s.num_computed_tokens + n);
        let need = d.stride;
        d.tables
            .extend(s.block_table.iter().take(need).map(|&b| b as i32));
        d.tables
            .extend(std::iter::repeat_n(0, need - s.block_table.len().min(need)));
    }
    d.small_tiles = d.tile_qn.len();
    for (seq, q0, qn) in large {
        d.tile_seq.push(seq);
        d.tile_q0.push(q0);
        d.tile_qn.push(qn);
    }
    if d.logit_rows.len() > MAX_LOGIT_ROWS {
        return Err(GpuError::BadBatch(format!(
            "{} rows of logits (prompt logprobs) exceed {MAX_LOGIT_ROWS} per step",
            d.logit_rows.len()
        )));
    }
    Ok(d)
}

/// Splits of the key range for `tiles` tiles of `kv_heads` heads, at most `max_splits`.
pub(crate) fn grid_splits(tiles: usize, kv_heads: usize, max_splits: usize) -> usize {
    TARGET_BLOCKS
        .div_ceil((tiles * kv_heads).max(1))
        .clamp(1, max_splits.max(1))
}

/// How many of the `small` tiles (listed first) run in one-warp blocks: all of them when they
/// bring enough blocks to fill the device (decode batches, bound by memory throughput), none
/// otherwise (a few tiles finish sooner in four-warp blocks, which share the loads). Both
/// kernels compute every row with the same operations, so the choice never changes a result.
pub(crate) fn one_warp_tiles(small: usize, kv_heads: usize) -> usize {
    if small * kv_heads >= TARGET_BLOCKS {
        small
    } else {
        0
    }
}

/// (split length, splits in use) for keys up to `max_keys` and a grid of `z` splits.
pub(crate) fn split_plan(max_keys: usize, z: usize) -> (usize, usize) {
    let len = max_keys.div_ceil(z.max(1)).div_ceil(ATT_KEYS).max(1) * ATT_KEYS;
    (len, max_keys.div_ceil(len).max(1))
}

/// Packs `d` (padded to the capacities of `lay`, which must hold it) and the sampled rows into
/// `out`; `z` is the attention grid's split count. Padding tokens have no KV slot and padding
/// tiles no queries.
pub(crate) fn pack(
    d: &StepData,
    samples: &[SampleRow],
    lay: &Layout,
    caps: (usize, usize, usize, usize),
    z: usize,
    out: &mut Vec<u8>,
) {
    let (cap_t, cap_tiles, cap_r, cap_s) = caps;
    let (split_len, nsplit) = split_plan(d.max_keys, z);
    out.clear();
    out.resize(lay.tables + 4 * d.tables.len(), 0);
    fn put<T: Copy, const N: usize>(
        out: &mut [u8],
        at: usize,
        v: &[T],
        pad: T,
        cap: usize,
        b: fn(T) -> [u8; N],
    ) {
        for i in 0..cap {
            let x = v.get(i).copied().unwrap_or(pad);
            out[at + i * N..at + (i + 1) * N].copy_from_slice(&b(x));
        }
    }
    let meta = [d.stride as i32, split_len as i32, nsplit as i32, 0];
    put(out, lay.meta, &meta, 0, 4, i32::to_ne_bytes);
    put(out, lay.tokens, &d.tokens, 0, cap_t, i32::to_ne_bytes);
    put(out, lay.pos, &d.pos, 0, cap_t, i32::to_ne_bytes);
    put(out, lay.slots, &d.slots, -1, cap_t, i64::to_ne_bytes);
    put(
        out,
        lay.tile_seq,
        &d.tile_seq,
        0,
        cap_tiles,
        i32::to_ne_bytes,
    );
    put(out, lay.tile_q0, &d.tile_q0, 0, cap_tiles, i32::to_ne_bytes);
    put(out, lay.tile_qn, &d.tile_qn, 0, cap_tiles, i32::to_ne_bytes);
    // Padding rows point at token 0 (their logits are computed and ignored).
    put(
        out,
        lay.logit_rows,
        &d.logit_rows,
        0,
        cap_r,
        i32::to_ne_bytes,
    );
    let col = |f: fn(&SampleRow) -> i32| samples.iter().map(f).collect::<Vec<i32>>();
    let colf = |f: fn(&SampleRow) -> f32| samples.iter().map(f).collect::<Vec<f32>>();
    let colu = |f: fn(&SampleRow) -> u64| samples.iter().map(f).collect::<Vec<u64>>();
    put(
        out,
        lay.sample_rows,
        &col(|s| s.row),
        0,
        cap_s,
        i32::to_ne_bytes,
    );
    put(
        out,
        lay.temperature,
        &colf(|s| s.temperature),
        0.0,
        cap_s,
        f32::to_ne_bytes,
    );
    put(
        out,
        lay.top_k,
        &col(|s| s.top_k),
        0,
        cap_s,
        i32::to_ne_bytes,
    );
    put(
        out,
        lay.top_p,
        &colf(|s| s.top_p),
        1.0,
        cap_s,
        f32::to_ne_bytes,
    );
    put(
        out,
        lay.min_p,
        &colf(|s| s.min_p),
        0.0,
        cap_s,
        f32::to_ne_bytes,
    );
    put(
        out,
        lay.seeds,
        &colu(|s| s.seed),
        0,
        cap_s,
        u64::to_ne_bytes,
    );
    put(
        out,
        lay.counters,
        &colu(|s| s.counter),
        0,
        cap_s,
        u64::to_ne_bytes,
    );
    put(
        out,
        lay.tables,
        &d.tables,
        0,
        d.tables.len(),
        i32::to_ne_bytes,
    );
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::backend::validate_batch;
    use crate::backend::{SamplingParams, SeqInput};
    use crate::model::LlamaConfig;

    fn seq(id: u64, computed: usize, n: usize, table: Vec<u32>) -> SeqInput {
        SeqInput {
            seq_id: id,
            num_computed_tokens: computed,
            tokens: (0..n as u32).map(|t| t + 5).collect(),
            block_table: table,
            sample: true,
            num_drafts: 0,
            sampling: Arc::new(SamplingParams::greedy()),
            adapter: None,
            cached_prompt: None,
        }
    }

    #[test]
    fn flatten_tiles_slots_and_tables() {
        let batch = Batch {
            seqs: vec![seq(1, 30, 20, vec![4, 7, 9, 2]), seq(2, 3, 1, vec![5])],
        };
        let d = flatten(&batch, 4, 16, |i| if i == 0 { vec![19] } else { vec![0] }).unwrap();
        assert_eq!(d.tokens.len(), 21);
        assert_eq!(d.pos[0], 30);
        // Position 30 is block 1 (id 7), offset 14; position 49 is block 3 (id 2), offset 1.
        assert_eq!(d.slots[0], 7 * 16 + 14);
        assert_eq!(d.slots[19], 2 * 16 + 1);
        assert_eq!(d.slots[20], 5 * 16 + 3);
        // 16 queries per tile with 4 heads per group: 16 + 4, then the decode; the tiles of
        // at most 16 rows (the 4-token rest and the decode) first.
        assert_eq!(d.tile_qn, vec![4, 1, 16]);
        assert_eq!(d.tile_q0, vec![16, 20, 0]);
        assert_eq!(d.tile_seq, vec![0, 1, 0]);
        assert_eq!(d.small_tiles, 2);
        assert_eq!(d.stride, 4);
        assert_eq!(d.tables, vec![4, 7, 9, 2, 5, 0, 0, 0]);
        assert_eq!(d.logit_rows, vec![19, 20]);
        assert_eq!(d.max_keys, 50);
        // Groups of 3 (SmolLM2): 21 tokens per tile; groups over 64 heads are refused.
        let d = flatten(&batch, 3, 16, |_| vec![0]).unwrap();
        assert_eq!((d.tile_qn.clone(), d.small_tiles), (vec![1, 20], 1));
        assert!(flatten(&batch, 65, 16, |_| vec![0]).is_err());
    }

    #[test]
    fn one_token_per_seq_only_for_decode_steps() {
        let decode = Batch {
            seqs: vec![seq(1, 30, 1, vec![4, 7]), seq(2, 3, 1, vec![5])],
        };
        assert!(flatten(&decode, 4, 16, |_| vec![0])
            .unwrap()
            .one_token_per_seq());
        // A sequence with two tokens (one tile of two), and, with 64 heads per group, a
        // chunk cut into tiles of one token each.
        let chunk = Batch {
            seqs: vec![seq(1, 30, 2, vec![4, 7, 9]), seq(2, 3, 1, vec![5])],
        };
        assert!(!flatten(&chunk, 4, 16, |_| vec![0])
            .unwrap()
            .one_token_per_seq());
        let d = flatten(&chunk, 64, 16, |_| vec![0]).unwrap();
        assert_eq!(d.tile_qn, vec![1, 1, 1]);
        assert!(!d.one_token_per_seq());
    }

    #[test]
    fn validation_rejects_what_the_cpu_backend_rejects() {
        let c = LlamaConfig::smollm2_135m();
        let ok = Batch {
            seqs: vec![seq(1, 0, 3, vec![0])],
        };
        assert!(validate_batch(&ok, &c, 4, 16, 100, false).is_ok());
        for bad in [
            Batch {
                seqs: vec![seq(1, 0, 3, vec![0]), seq(1, 0, 1, vec![1])],
            },
            Batch {
                seqs: vec![seq(1, 0, 3, vec![9])],
            },
            Batch {
                seqs: vec![seq(1, 16, 3, vec![0])],
            },
            Batch {
                seqs: vec![seq(1, 0, 0, vec![0])],
            },
            Batch { seqs: Vec::new() },
        ] {
            assert!(
                validate_batch(&bad, &c, 4, 16, 100, false).is_err(),
                "{bad:?}"
            );
        }
        assert!(validate_batch(&ok, &c, 4, 16, 2, false).is_err());
    }

    #[test]
    fn small_tiles_take_one_warp_blocks_only_when_they_fill_the_device() {
        // 264 blocks (about two per multiprocessor) is the line: 33 tiles x 8 KV heads.
        assert_eq!(one_warp_tiles(1, 8), 0);
        assert_eq!(one_warp_tiles(32, 8), 0);
        assert_eq!(one_warp_tiles(33, 8), 33);
        assert_eq!(one_warp_tiles(256, 3), 256);
        assert_eq!(one_warp_tiles(0, 8), 0);
    }

    #[test]
    fn split_plans_cover_the_keys() {
        for keys in [1, 31, 32, 33, 200, 4096, 8191] {
            for z in [1, 2, 7, 32] {
                let (len, n) = split_plan(keys, z);
                assert_eq!(len % ATT_KEYS, 0);
                assert!(
                    n <= z && n * len >= keys && (n - 1) * len < keys,
                    "{keys} {z}"
                );
            }
        }
        assert_eq!(grid_splits(1, 8, MAX_SPLITS), 32);
        assert_eq!(grid_splits(256, 8, MAX_SPLITS), 1);
    }

    #[test]
    fn packing_pads_to_the_capacities() {
        let batch = Batch {
            seqs: vec![seq(1, 3, 1, vec![6])],
        };
        let d = flatten(&batch, 3, 16, |_| vec![0]).unwrap();
        let lay = Layout::new(4, 4, 4, 4);
        let mut out = Vec::new();
        let rows = [SampleRow {
            row: 0,
            temperature: 0.5,
            seed: 9,
            ..SampleRow::default()
        }];
        pack(&d, &rows, &lay, (4, 4, 4, 4), 1, &mut out);
        let word = |at: usize| i32::from_ne_bytes(out[at..at + 4].try_into().unwrap());
        assert_eq!(word(lay.tokens), 5);
        assert_eq!(word(lay.tokens + 4), 0);
        let slot = |i: usize| {
            i64::from_ne_bytes(
                out[lay.slots + 8 * i..lay.slots + 8 * i + 8]
                    .try_into()
                    .unwrap(),
            )
        };
        assert_eq!((slot(0), slot(1)), (6 * 16 + 3, -1));
        assert_eq!((word(lay.tile_qn), word(lay.tile_qn + 4)), (1, 0));
        assert_eq!(word(lay.meta + 8), 1);
        assert_eq!(word(lay.tables), 6);
        assert_eq!(out.len(), lay.tables + 4);
    }
}
