//! LoRA adapters on the device: each adapter's matrices uploaded once (bf16, the rows of the q
//! and k `B` matrices in the order the backend stores the base weights' rows), kept while there
//! is room, and each step's table of them (`forward::LoraStep`).
//!
//! Steps whose batch names an adapter run their products on the usual route for their size
//! (GEMV kernels for small steps, cuBLAS for large ones); products no adapter of the step adapts
//! run as without adapters (`forward::enqueue`). An adapted product first has `lora_shrink`
//! compute `u = A x` per token, each token reading its own adapter's matrices through the
//! step's table; then, in steps of at most 8 tokens on bf16 weights, the GEMV kernel's epilogue
//! adds `B u` (the `*_lora` kernels), so the product keeps its fused norm prologue and RoPE /
//! SiLU epilogue; in larger steps `lora_expand` (`out += B u`) follows the product, and an
//! adapted QKV or gate|up product goes without its fused stages. Decode steps whose adapters
//! have at most [`GRAPH_MAX_RANK`] replay CUDA graphs of their own.

use std::sync::{Arc, Weak};

use half::bf16;

use super::device::{DevMem, Gpu};
use super::forward::{LoraStep, GRAPH_BUCKETS};
use super::weights::rope_row_order;
use crate::backend::Batch;
use crate::error::GpuError;
use crate::lora::{LoraAdapter, LoraTarget};
use crate::model::{LlamaConfig, RopeStyle};

/// Adapters kept on the device at most; the least recently used one not in the step goes.
pub(crate) const MAX_DEVICE_ADAPTERS: usize = 32;
/// Decode steps whose adapters have at most this rank can replay a graph: their table and
/// scratch use buffers of fixed size and address, with the scratch laid out for this rank.
pub(crate) const GRAPH_MAX_RANK: usize = 64;
/// Each matrix starts at a multiple of this many bytes.
const ALIGN: usize = 256;

struct DeviceAdapter {
    uid: u64,
    /// The adapter it copies: once the engine has dropped it (unloaded, or evicted from host
    /// memory, and no request left on it), the copy is freed.
    source: Weak<LoraAdapter>,
    /// Keeps the matrices alive.
    _mem: DevMem,
    /// Per layer and target: the device addresses of A and B, 0 where not adapted.
    ptrs: Vec<[u64; 2]>,
    rank: usize,
    /// The projections it adapts in any layer (bit `LoraTarget::index`).
    targets: u8,
    last_used: u64,
}

/// The adapters on the device and the buffers of a step's adapter table.
#[derive(Default)]
pub(crate) struct DeviceLoras {
    cache: Vec<DeviceAdapter>,
    clock: u64,
    /// Row slots, ranks and the address table of the step (device).
    table: Option<DevMem>,
    /// The shrink products (device, f32).
    u: Option<DevMem>,
    /// The table and scratch of steps that may replay a graph: allocated once, for the largest
    /// bucket, [`MAX_DEVICE_ADAPTERS`] slots and [`GRAPH_MAX_RANK`].
    graph: Option<(DevMem, DevMem)>,
    /// Host copies of the table, one per step parity (a copy may still be pending for the
    /// step submitted before).
    host: [Vec<u8>; 2],
}

/// The bits of `targets` (bit `LoraTarget::index`).
pub(crate) fn target_mask(targets: &[LoraTarget]) -> u8 {
    targets.iter().fold(0, |m, t| m | 1 << t.index())
}

fn align(n: usize) -> usize {
    n.div_ceil(ALIGN) * ALIGN
}

/// Uploads `a`'s matrices in one allocation.
fn upload(
    gpu: &Gpu,
    c: &LlamaConfig,
    a: &LoraAdapter,
) -> Result<(DevMem, Vec<[u64; 2]>), GpuError> {
    let order = rope_row_order(c.head_dim, c.rope_style == RopeStyle::Interleaved);
    let mut host: Vec<bf16> = Vec::new();
    let mut offsets = Vec::with_capacity(c.num_layers * 7);
    let pad = |host: &mut Vec<bf16>| host.resize(align(host.len() * 2) / 2, bf16::ZERO);
    for layer in 0..c.num_layers {
        for target in LoraTarget::ALL {
            let Some(p) = a.pair(layer, target) else {
                offsets.push(None);
                continue;
            };
            let r = p.rank();
            pad(&mut host);
            let at_a = host.len() * 2;
            host.extend(p.a().iter().map(|&x| bf16::from_f32(x)));
            pad(&mut host);
            let at_b = host.len() * 2;
            let b = p.b();
            match target {
                // Rows in the stored order of the base weights (see `rope_row_order`).
                LoraTarget::Q | LoraTarget::K => {
                    let hd = order.len();
                    for head in 0..b.len() / r / hd {
                        for &from in &order {
                            let row = head * hd + from;
                            host.extend(
                                b[row * r..(row + 1) * r].iter().map(|&x| bf16::from_f32(x)),
                            );
                        }
                    }
                }
                _ => host.extend(b.iter().map(|&x| bf16::from_f32(x))),
            }
            offsets.push(Some((at_a, at_b)));
        }
    }
    let mem = gpu.alloc(host.len().max(1) * 2)?;
    gpu.upload(mem.ptr(), &host)?;
    // The host copy must outlive the asynchronous upload.
    gpu.sync()?;
    let ptrs = offsets
        .into_iter()
        .map(|o| match o {
            Some((a, b)) => Ok([mem.at(a)?, mem.at(b)?]),
            None => Ok([0, 0]),
        })
        .collect::<Result<Vec<_>, GpuError>>()?;
    Ok((mem, ptrs))
}

impl DeviceLoras {
    /// The device table of the adapters of `batch` (`None` when it names none), uploading the
    /// adapters not on the device yet; `tokens` is the step's token count and `step` its number.
    /// With `bucket` (a decode step that may replay the graph of that many tokens), the table
    /// goes to the fixed graph buffers, padded to `bucket` tokens, when the step's ranks allow;
    /// the flag says whether it did (the table also serves an eager run).
    pub fn prepare(
        &mut self,
        gpu: &Gpu,
        c: &LlamaConfig,
        batch: &Batch,
        tokens: usize,
        step: u64,
        bucket: Option<usize>,
    ) -> Result<Option<(LoraStep, bool)>, GpuError> {
        // Copies of adapters the engine no longer holds go (a step in flight may still read
        // them: the device finishes first). Rare; a check of a few weak counts otherwise.
        if self.cache.iter().any(|d| d.source.strong_count() == 0) {
            gpu.sync()?;
            self.cache.retain(|d| d.source.strong_count() > 0);
        }
        if batch.seqs.iter().all(|s| s.adapter.is_none()) {
            return Ok(None);
        }
        self.clock += 1;
        // The step's adapters, in batch order, and each token's slot. When the device has no
        // memory for an adapter's copy, the copies of adapters outside the step go and the
        // step tries once more.
        let (slots, mut row_slot) = match self.assign_slots(gpu, c, batch, tokens) {
            Ok(assigned) => assigned,
            Err(e) => {
                let needed: Vec<u64> = batch
                    .seqs
                    .iter()
                    .filter_map(|s| s.adapter.as_ref().map(|a| a.uid()))
                    .collect();
                if self.cache.iter().all(|d| needed.contains(&d.uid)) {
                    return Err(e);
                }
                tracing::warn!(error = %e, "LoRA copies on the device: freeing those outside the step");
                gpu.sync()?;
                self.cache.retain(|d| needed.contains(&d.uid));
                self.assign_slots(gpu, c, batch, tokens)?
            }
        };
        if row_slot.len() != tokens {
            return Err(GpuError::Internal(format!(
                "{} LoRA rows for {tokens} tokens",
                row_slot.len()
            )));
        }
        let step_rank = slots.iter().map(|&i| self.cache[i].rank).max().unwrap_or(1);
        let graph = bucket.filter(|&b| b >= tokens && step_rank <= GRAPH_MAX_RANK);
        // A graph's table has room for every slot and its largest bucket's tokens.
        let (rows, table_slots) = match graph {
            Some(_) => (GRAPH_BUCKETS[GRAPH_BUCKETS.len() - 1], MAX_DEVICE_ADAPTERS),
            None => (tokens, slots.len()),
        };
        if let Some(b) = graph {
            // Padding tokens of the bucket have no adapter.
            row_slot.resize(b, -1);
        }
        let ranks_at = (4 * rows).div_ceil(8) * 8;
        let ptrs_at = ranks_at + (4 * table_slots).div_ceil(8) * 8;
        let bytes = ptrs_at + table_slots * c.num_layers * 7 * 16;
        let host = &mut self.host[(step % 2) as usize];
        host.clear();
        host.resize(bytes, 0);
        for (i, v) in row_slot.iter().enumerate() {
            host[4 * i..4 * i + 4].copy_from_slice(&v.to_le_bytes());
        }
        let max_rank = if graph.is_some() {
            GRAPH_MAX_RANK
        } else {
            step_rank
        };
        for (k, &i) in slots.iter().enumerate() {
            let d = &self.cache[i];
            host[ranks_at + 4 * k..ranks_at + 4 * k + 4]
                .copy_from_slice(&(d.rank as i32).to_le_bytes());
            for (j, pair) in d.ptrs.iter().enumerate() {
                let at = ptrs_at + (k * c.num_layers * 7 + j) * 16;
                host[at..at + 8].copy_from_slice(&pair[0].to_le_bytes());
                host[at + 8..at + 16].copy_from_slice(&pair[1].to_le_bytes());
            }
        }
        let u_bytes = rows * 3 * max_rank * 4;
        let (table, u) = if graph.is_some() {
            if self.graph.is_none() {
                self.graph = Some((gpu.alloc(bytes)?, gpu.alloc(u_bytes)?));
            }
            let Some((table, u)) = &self.graph else {
                return Err(GpuError::Internal("LoRA graph buffers missing".into()));
            };
            (table, u)
        } else {
            // Growing a buffer frees the old one, which the step in flight may still read.
            if self.table.as_ref().is_none_or(|m| m.bytes() < bytes)
                || self.u.as_ref().is_none_or(|m| m.bytes() < u_bytes)
            {
                gpu.sync()?;
            }
            if self.table.as_ref().is_none_or(|m| m.bytes() < bytes) {
                self.table = Some(gpu.alloc(bytes.next_power_of_two())?);
            }
            if self.u.as_ref().is_none_or(|m| m.bytes() < u_bytes) {
                self.u = Some(gpu.alloc(u_bytes.next_power_of_two())?);
            }
            let (Some(table), Some(u)) = (&self.table, &self.u) else {
                return Err(GpuError::Internal("LoRA buffers missing".into()));
            };
            (table, u)
        };
        gpu.upload(table.ptr(), host)?;
        let step = LoraStep {
            row_slot: table.ptr(),
            ranks: table.at(ranks_at)?,
            ptrs: table.at(ptrs_at)?,
            u: u.ptr(),
            max_rank,
            targets: slots.iter().fold(0, |m, &i| m | self.cache[i].targets),
        };
        Ok(Some((step, graph.is_some())))
    }

    /// The device entries of the step's adapters (uploading those not there yet), in batch
    /// order, and each token's index into them (-1: no adapter).
    fn assign_slots(
        &mut self,
        gpu: &Gpu,
        c: &LlamaConfig,
        batch: &Batch,
        tokens: usize,
    ) -> Result<(Vec<usize>, Vec<i32>), GpuError> {
        let mut slots: Vec<usize> = Vec::new();
        let mut row_slot: Vec<i32> = Vec::with_capacity(tokens);
        for s in &batch.seqs {
            let slot = match &s.adapter {
                None => -1,
                Some(a) => {
                    let i = match self.cache.iter().position(|d| d.uid == a.uid()) {
                        Some(i) => i,
                        None => self.insert(gpu, c, a, &slots)?,
                    };
                    self.cache[i].last_used = self.clock;
                    let k = match slots.iter().position(|&j| j == i) {
                        Some(k) => k,
                        None => {
                            slots.push(i);
                            slots.len() - 1
                        }
                    };
                    k as i32
                }
            };
            row_slot.extend(std::iter::repeat_n(slot, s.tokens.len()));
        }
        Ok((slots, row_slot))
    }

    /// Number of adapters with a copy on the device.
    pub fn len(&self) -> usize {
        self.cache.len()
    }

    /// Uploads `a` and returns its index: a new entry, or, when the device holds
    /// [`MAX_DEVICE_ADAPTERS`], the entry of the least recently used adapter outside `keep`
    /// (the step's adapters so far), replaced in place so no other index moves.
    fn insert(
        &mut self,
        gpu: &Gpu,
        c: &LlamaConfig,
        a: &Arc<LoraAdapter>,
        keep: &[usize],
    ) -> Result<usize, GpuError> {
        if !a.fits(c) {
            return Err(GpuError::BadBatch(
                "a LoRA adapter loaded for a model of another shape".into(),
            ));
        }
        let victim = if self.cache.len() >= MAX_DEVICE_ADAPTERS {
            let v = (0..self.cache.len())
                .filter(|i| !keep.contains(i))
                .min_by_key(|&i| self.cache[i].last_used)
                .ok_or_else(|| {
                    GpuError::BadBatch(format!(
                        "more than {MAX_DEVICE_ADAPTERS} LoRA adapters in one step"
                    ))
                })?;
            // A step in flight may still read the victim's matrices.
            gpu.sync()?;
            Some(v)
        } else {
            None
        };
        let (mem, ptrs) = upload(gpu, c, a)?;
        let entry = DeviceAdapter {
            uid: a.uid(),
            source: Arc::downgrade(a),
            _mem: mem,
            ptrs,
            rank: a.rank(),
            targets: target_mask(&a.targets()),
            last_used: self.clock,
        };
        Ok(match victim {
            Some(v) => {
                self.cache[v] = entry;
                v
            }
            None => {
                self.cache.push(entry);
                self.cache.len() - 1
            }
        })
    }
}
