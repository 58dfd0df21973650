//! Model weights in device memory, bf16: from loaded tensors (any stored type is converted to
//! f32 on the host, then to bf16, one tensor at a time) or random (`load_format: dummy`,
//! generated on the GPU from a seed, so an 8B model needs no host buffer).
//!
//! The projections that read the same input are stored fused, rows concatenated: Q|K|V as one
//! `[(nh + 2 nkv) hd, hidden]` matrix and gate|up as one `[2 inter, hidden]` matrix, so a layer
//! runs four GEMMs.

use half::bf16;

use super::device::{Arg, DevMem, Gpu};
use crate::error::GpuError;
use crate::model::{LlamaConfig, ModelWeights};

/// One transformer block on the device.
pub(crate) struct GpuLayer {
    pub attn_norm: DevMem,
    pub qkv: DevMem,
    pub o: DevMem,
    pub ffn_norm: DevMem,
    pub gate_up: DevMem,
    pub down: DevMem,
}

/// A Llama model's weights on the device.
pub(crate) struct GpuWeights {
    pub embed: DevMem,
    /// `None`: tied to the embedding.
    pub lm_head: Option<DevMem>,
    pub norm: DevMem,
    pub layers: Vec<GpuLayer>,
    /// RoPE inverse frequencies (f32, head_dim / 2).
    pub inv_freq: DevMem,
}

impl GpuWeights {
    /// The output projection.
    pub fn lm_head(&self) -> u64 {
        self.lm_head.as_ref().unwrap_or(&self.embed).ptr()
    }

    /// Bytes of weights held.
    pub fn bytes(&self) -> usize {
        let l: usize = self
            .layers
            .iter()
            .map(|l| {
                l.attn_norm.bytes()
                    + l.qkv.bytes()
                    + l.o.bytes()
                    + l.ffn_norm.bytes()
                    + l.gate_up.bytes()
                    + l.down.bytes()
            })
            .sum();
        l + self.embed.bytes() + self.lm_head.as_ref().map_or(0, DevMem::bytes) + self.norm.bytes()
    }
}

fn inv_freq(gpu: &Gpu, c: &LlamaConfig) -> Result<DevMem, GpuError> {
    let f = crate::cpu::ops::Rope::new(c).inv_freq;
    let m = gpu.alloc(f.len() * 4)?;
    gpu.upload(m.ptr(), &f)?;
    gpu.sync()?;
    Ok(m)
}

/// Reads tensor `name` as f32, checking its element count.
fn tensor_f32(w: &ModelWeights, name: &str, len: usize) -> Result<Vec<f32>, GpuError> {
    let t = w.get(name)?;
    if t.num_elements() != len {
        return Err(GpuError::BadTensor {
            tensor: name.into(),
            reason: format!("expected {len} values, found {}", t.num_elements()),
        });
    }
    Ok(t.to_f32_vec())
}

/// Uploads the concatenation of `parts` (each `rows x cols`) as one bf16 matrix.
fn upload_bf16(
    gpu: &Gpu,
    w: &ModelWeights,
    parts: &[(String, usize)],
    cols: usize,
) -> Result<DevMem, GpuError> {
    let rows: usize = parts.iter().map(|p| p.1).sum();
    let m = gpu.alloc(rows * cols * 2)?;
    let mut off = 0usize;
    for (name, r) in parts {
        let f = tensor_f32(w, name, r * cols)?;
        let b: Vec<bf16> = f.iter().map(|&x| bf16::from_f32(x)).collect();
        gpu.upload(m.at(off)?, &b)?;
        // The host buffer must outlive the asynchronous copy.
        gpu.sync()?;
        off += b.len() * 2;
    }
    Ok(m)
}

fn upload_f32(gpu: &Gpu, w: &ModelWeights, name: &str, len: usize) -> Result<DevMem, GpuError> {
    let f = tensor_f32(w, name, len)?;
    let m = gpu.alloc(len * 4)?;
    gpu.upload(m.ptr(), &f)?;
    gpu.sync()?;
    Ok(m)
}

/// Uploads loaded weights (canonical GGUF tensor names).
pub(crate) fn from_model(
    gpu: &Gpu,
    c: &LlamaConfig,
    w: &ModelWeights,
) -> Result<GpuWeights, GpuError> {
    crate::model::loader::validate_weights(c, w, false)?;
    let (h, hd) = (c.hidden_size, c.head_dim);
    let (q, kv, inter) = (c.num_heads * hd, c.num_kv_heads * hd, c.intermediate_size);
    let mut layers = Vec::with_capacity(c.num_layers);
    for i in 0..c.num_layers {
        let n = |s: &str| format!("blk.{i}.{s}.weight");
        layers.push(GpuLayer {
            attn_norm: upload_f32(gpu, w, &n("attn_norm"), h)?,
            qkv: upload_bf16(
                gpu,
                w,
                &[(n("attn_q"), q), (n("attn_k"), kv), (n("attn_v"), kv)],
                h,
            )?,
            o: upload_bf16(gpu, w, &[(n("attn_output"), h)], q)?,
            ffn_norm: upload_f32(gpu, w, &n("ffn_norm"), h)?,
            gate_up: upload_bf16(gpu, w, &[(n("ffn_gate"), inter), (n("ffn_up"), inter)], h)?,
            down: upload_bf16(gpu, w, &[(n("ffn_down"), h)], inter)?,
        });
    }
    let embed = upload_bf16(gpu, w, &[("token_embd.weight".into(), c.vocab_size)], h)?;
    let lm_head = if w.contains("output.weight") {
        Some(upload_bf16(
            gpu,
            w,
            &[("output.weight".into(), c.vocab_size)],
            h,
        )?)
    } else {
        None
    };
    Ok(GpuWeights {
        embed,
        lm_head,
        norm: upload_f32(gpu, w, "output_norm.weight", h)?,
        layers,
        inv_freq: inv_freq(gpu, c)?,
    })
}

/// Random weights of the shape of `c`, generated on the device from `seed`: matrices uniform in
/// `±1/sqrt(fan_in)` (outputs of a projection keep about a third of the input's variance, so
/// activations stay finite over any depth), the embedding uniform in `±1`, norms 1.
pub(crate) fn dummy(gpu: &Gpu, c: &LlamaConfig, seed: u64) -> Result<GpuWeights, GpuError> {
    c.validate()?;
    let (h, hd) = (c.hidden_size, c.head_dim);
    let (q, kv, inter) = (c.num_heads * hd, c.num_kv_heads * hd, c.intermediate_size);
    let mut stream_id = 0u64;
    let mut matrix = |rows: usize, cols: usize, scale: f32| -> Result<DevMem, GpuError> {
        let n = rows * cols;
        let m = gpu.alloc(n * 2)?;
        stream_id += 1;
        let blocks = n.div_ceil(256).min(65_536) as u32;
        gpu.launch(
            &gpu.k.init_uniform_bf16,
            (blocks, 1, 1),
            256,
            &[
                Arg::Ptr(m.ptr()),
                Arg::U64(n as u64),
                Arg::U64(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ stream_id),
                Arg::F32(scale),
            ],
        )?;
        Ok(m)
    };
    let ones = |n: usize| -> Result<DevMem, GpuError> {
        let m = gpu.alloc(n * 4)?;
        gpu.launch(
            &gpu.k.fill_f32,
            (n.div_ceil(256) as u32, 1, 1),
            256,
            &[Arg::Ptr(m.ptr()), Arg::U64(n as u64), Arg::F32(1.0)],
        )?;
        Ok(m)
    };
    let fan = |n: usize| 1.0 / (n as f32).sqrt();
    let mut layers = Vec::with_capacity(c.num_layers);
    for _ in 0..c.num_layers {
        layers.push(GpuLayer {
            attn_norm: ones(h)?,
            qkv: matrix(q + 2 * kv, h, fan(h))?,
            o: matrix(h, q, fan(q))?,
            ffn_norm: ones(h)?,
            gate_up: matrix(2 * inter, h, fan(h))?,
            down: matrix(h, inter, fan(inter))?,
        });
    }
    let embed = matrix(c.vocab_size, h, 1.0)?;
    let lm_head = if c.tie_word_embeddings {
        None
    } else {
        Some(matrix(c.vocab_size, h, fan(h))?)
    };
    let norm = ones(h)?;
    gpu.sync()?;
    Ok(GpuWeights {
        embed,
        lm_head,
        norm,
        layers,
        inv_freq: inv_freq(gpu, c)?,
    })
}
