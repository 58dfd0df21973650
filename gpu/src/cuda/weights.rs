//! Model weights in device memory, bf16: from loaded tensors (any stored type is converted to
//! f32 on the host, then to bf16, one tensor at a time) or random (`load_format: dummy`,
//! generated on the GPU from a seed, so an 8B model needs no host buffer).
//!
//! The projections that read the same input are stored fused, rows concatenated: Q|K|V as one
//! `[(nh + 2 nkv) hd, hidden]` matrix and gate|up as one `[2 inter, hidden]` matrix, so a layer
//! runs four GEMMs. Within each head, the Q and K rows are stored in RoPE pair order
//! ([`rope_row_order`]); random weights are generated in that order directly (a permutation of
//! random rows is as random).
//!
//! With `quantization: fp8` ([`Fp8Quantizer`]), the four matrices of every layer are then
//! converted on the device to e4m3 with one f32 scale per output channel (the row's max |w| /
//! 448; activations get one per token at run time), or one per matrix where cuBLASLt lacks
//! outer-vector scaling ([`Fp8Scaling`]), and the bf16 copies are freed; the embedding, the
//! norms and the lm_head stay bf16 (as vLLM's fp8 mode keeps them).

use half::bf16;

use super::device::{Arg, DevMem, Fp8Scales, Fp8Scaling, Gpu, FP8_MAX_PARTS};
use crate::error::GpuError;
use crate::model::{LlamaConfig, ModelWeights, RopeStyle};

/// One transformer block on the device.
pub(crate) struct GpuLayer {
    pub attn_norm: DevMem,
    pub qkv: DevMem,
    pub o: DevMem,
    pub ffn_norm: DevMem,
    pub gate_up: DevMem,
    pub down: DevMem,
    /// With fp8 weights (qkv, o, gate|up and down then hold e4m3): their row scales.
    pub fp8: Option<Fp8Layer>,
    /// The Q, K and V biases (Qwen2): f32, one QKV row, Q and K in `qkv`'s row order.
    pub qkv_bias: Option<DevMem>,
    /// The query and key head norms' weights (Qwen3): f32, the query's then the key's, each
    /// in `qkv`'s row order within a head.
    pub qk_norm: Option<DevMem>,
}

/// The f32 scales of a layer's four fp8 matrices, in one allocation.
pub(crate) struct Fp8Layer {
    scales: DevMem,
    /// Byte offset of each matrix's scales, by [`Proj`].
    offsets: [u64; 4],
    scaling: Fp8Scaling,
}

/// The matrices of a layer, in the order of [`GpuLayer::fp8`]'s scales.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Proj {
    Qkv = 0,
    O = 1,
    GateUp = 2,
    Down = 3,
}

impl GpuLayer {
    /// The scales of `p` (with `a`, the activations' scales), when the layer is fp8.
    pub fn fp8_scales(&self, p: Proj, a: u64) -> Option<Fp8Scales> {
        self.fp8.as_ref().map(|f| Fp8Scales {
            w: f.scales.ptr() + f.offsets[p as usize],
            a,
            scaling: f.scaling,
        })
    }
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
                    + l.fp8.as_ref().map_or(0, |f| f.scales.bytes())
                    + l.qkv_bias.as_ref().map_or(0, DevMem::bytes)
                    + l.qk_norm.as_ref().map_or(0, DevMem::bytes)
            })
            .sum();
        l + self.embed.bytes() + self.lm_head.as_ref().map_or(0, DevMem::bytes) + self.norm.bytes()
    }
}

/// The RoPE kernels' table: `head_dim / 2` inverse frequencies (0 for the pairs a partial
/// rotary embedding leaves as they are), then each pair's amplitude: 1, or for a partial rotary
/// embedding the RoPE scaling's attention factor on the rotated pairs
/// ([`LlamaConfig::rope_amplitudes`]).
fn inv_freq(gpu: &Gpu, c: &LlamaConfig) -> Result<DevMem, GpuError> {
    let mut f = crate::cpu::ops::Rope::new(c).inv_freq;
    f.extend(c.rope_amplitudes());
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

/// The order in which the backend stores the rows of one head of the Q and K weights: stored
/// row `p` is the checkpoint's row `order[p]`. The two rows of RoPE pair `j` (`j` and
/// `j + head_dim / 2`, or `2j` and `2j + 1` for interleaved checkpoints) go to rows
/// `16 (j / 8) + j % 8` and that `+ 8`: the rows `g` and `g + 8` of one 16-row tile of the GEMV
/// kernels, whose epilogue rotates them (`rope_pair_row` and `gemv_rope_out` in the CUDA
/// source). `head_dim` must be a multiple of 16.
pub(crate) fn rope_row_order(head_dim: usize, interleaved: bool) -> Vec<usize> {
    let mut order = vec![0; head_dim];
    for j in 0..head_dim / 2 {
        let (a, b) = if interleaved {
            (2 * j, 2 * j + 1)
        } else {
            (j, j + head_dim / 2)
        };
        let p = 16 * (j / 8) + j % 8;
        order[p] = a;
        order[p + 8] = b;
    }
    order
}

/// One part of a matrix upload: the tensor, its rows, and optionally the order of the rows
/// within each head (`order.len()` rows per head; see [`rope_row_order`]).
struct Part<'a> {
    name: String,
    rows: usize,
    order: Option<&'a [usize]>,
}

impl Part<'_> {
    fn plain(name: String, rows: usize) -> Self {
        Part {
            name,
            rows,
            order: None,
        }
    }
}

/// A `rows x cols` tensor as the bf16 rows the device stores: in the checkpoint's order, or
/// with the rows of each head in `order` (stored row `head * hd + p` is the checkpoint's row
/// `head * hd + order[p]`), converted in one pass.
fn stored_bf16(
    name: &str,
    f: &[f32],
    rows: usize,
    cols: usize,
    order: Option<&[usize]>,
) -> Result<Vec<bf16>, GpuError> {
    let Some(order) = order else {
        return Ok(f.iter().map(|&x| bf16::from_f32(x)).collect());
    };
    let hd = order.len();
    if hd == 0 || !rows.is_multiple_of(hd) {
        return Err(GpuError::BadTensor {
            tensor: name.to_string(),
            reason: format!("{rows} rows are not whole heads of {hd}"),
        });
    }
    Ok((0..rows / hd)
        .flat_map(|head| order.iter().map(move |&from| head * hd + from))
        .flat_map(|row| &f[row * cols..(row + 1) * cols])
        .map(|&x| bf16::from_f32(x))
        .collect())
}

/// Uploads the concatenation of `parts` (each `rows x cols`) as one bf16 matrix.
fn upload_bf16(
    gpu: &Gpu,
    w: &ModelWeights,
    parts: &[Part],
    cols: usize,
) -> Result<DevMem, GpuError> {
    let rows: usize = parts.iter().map(|p| p.rows).sum();
    let m = gpu.alloc(rows * cols * 2)?;
    let mut off = 0usize;
    for Part {
        name,
        rows: r,
        order,
    } in parts
    {
        let f = tensor_f32(w, name, r * cols)?;
        let b = stored_bf16(name, &f, *r, cols, *order)?;
        gpu.upload(m.at(off)?, &b)?;
        // The host buffer must outlive the asynchronous copy.
        gpu.sync()?;
        off += b.len() * 2;
    }
    Ok(m)
}

fn upload_f32(gpu: &Gpu, w: &ModelWeights, name: &str, len: usize) -> Result<DevMem, GpuError> {
    let f = tensor_f32(w, name, len)?;
    f32_to_device(gpu, &f)
}

fn f32_to_device(gpu: &Gpu, f: &[f32]) -> Result<DevMem, GpuError> {
    let m = gpu.alloc(f.len() * 4)?;
    gpu.upload(m.ptr(), f)?;
    // The host buffer must outlive the asynchronous copy.
    gpu.sync()?;
    Ok(m)
}

/// `values`, whole heads of `order.len()`, with each head's values in `order` (as
/// [`stored_bf16`] stores a head's rows).
fn in_row_order<'a>(values: &'a [f32], order: &'a [usize]) -> impl Iterator<Item = f32> + 'a {
    values
        .chunks_exact(order.len())
        .flat_map(move |head| order.iter().map(move |&from| head[from]))
}

/// Layer `i`'s Q, K and V biases as one QKV row, each Q and K head in row order.
fn upload_qkv_bias(
    gpu: &Gpu,
    w: &ModelWeights,
    c: &LlamaConfig,
    i: usize,
    order: &[usize],
) -> Result<DevMem, GpuError> {
    let hd = c.head_dim;
    let mut row = Vec::with_capacity((c.num_heads + 2 * c.num_kv_heads) * hd);
    for (name, heads, rotated) in [
        ("attn_q", c.num_heads, true),
        ("attn_k", c.num_kv_heads, true),
        ("attn_v", c.num_kv_heads, false),
    ] {
        let b = tensor_f32(w, &format!("blk.{i}.{name}.bias"), heads * hd)?;
        if rotated {
            row.extend(in_row_order(&b, order));
        } else {
            row.extend(b);
        }
    }
    f32_to_device(gpu, &row)
}

/// Layer `i`'s query and key norm weights (one head's each), in row order.
fn upload_qk_norm(
    gpu: &Gpu,
    w: &ModelWeights,
    c: &LlamaConfig,
    i: usize,
    order: &[usize],
) -> Result<DevMem, GpuError> {
    let mut both = Vec::with_capacity(2 * c.head_dim);
    for name in ["attn_q_norm", "attn_k_norm"] {
        let g = tensor_f32(w, &format!("blk.{i}.{name}.weight"), c.head_dim)?;
        both.extend(in_row_order(&g, order));
    }
    f32_to_device(gpu, &both)
}

/// Uploads loaded weights (canonical GGUF tensor names).
pub(crate) fn from_model(
    gpu: &Gpu,
    c: &LlamaConfig,
    w: &ModelWeights,
    fp8: Option<&Fp8Quantizer>,
) -> Result<GpuWeights, GpuError> {
    crate::model::loader::validate_weights(c, w, &crate::progress::NoProgress)?;
    let (h, hd) = (c.hidden_size, c.head_dim);
    let (q, kv, inter) = (c.num_heads * hd, c.num_kv_heads * hd, c.intermediate_size);
    if super::device::attention_kernel_index(hd).is_none() {
        return Err(GpuError::InvalidConfig(format!(
            "the CUDA backend runs head dimensions {:?}, not {hd}",
            super::device::ATTENTION_HEAD_DIMS
        )));
    }
    let order = rope_row_order(hd, c.rope_style == RopeStyle::Interleaved);
    let mut layers = Vec::with_capacity(c.num_layers);
    for i in 0..c.num_layers {
        let n = |s: &str| format!("blk.{i}.{s}.weight");
        let mut layer = GpuLayer {
            attn_norm: upload_f32(gpu, w, &n("attn_norm"), h)?,
            qkv: upload_bf16(
                gpu,
                w,
                &[
                    Part {
                        name: n("attn_q"),
                        rows: q,
                        order: Some(&order),
                    },
                    Part {
                        name: n("attn_k"),
                        rows: kv,
                        order: Some(&order),
                    },
                    Part::plain(n("attn_v"), kv),
                ],
                h,
            )?,
            o: upload_bf16(gpu, w, &[Part::plain(n("attn_output"), h)], q)?,
            ffn_norm: upload_f32(gpu, w, &n("ffn_norm"), h)?,
            gate_up: upload_bf16(
                gpu,
                w,
                &[
                    Part::plain(n("ffn_gate"), inter),
                    Part::plain(n("ffn_up"), inter),
                ],
                h,
            )?,
            down: upload_bf16(gpu, w, &[Part::plain(n("ffn_down"), h)], inter)?,
            fp8: None,
            qkv_bias: if c.qkv_bias {
                Some(upload_qkv_bias(gpu, w, c, i, &order)?)
            } else {
                None
            },
            qk_norm: if c.qk_norm {
                Some(upload_qk_norm(gpu, w, c, i, &order)?)
            } else {
                None
            },
        };
        if let Some(q) = fp8 {
            q.layer(gpu, &mut layer)?;
        }
        layers.push(layer);
    }
    let embed = upload_bf16(
        gpu,
        w,
        &[Part::plain("token_embd.weight".into(), c.vocab_size)],
        h,
    )?;
    let lm_head = if w.contains("output.weight") {
        Some(upload_bf16(
            gpu,
            w,
            &[Part::plain("output.weight".into(), c.vocab_size)],
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
pub(crate) fn dummy(
    gpu: &Gpu,
    c: &LlamaConfig,
    seed: u64,
    fp8: Option<&Fp8Quantizer>,
) -> Result<GpuWeights, GpuError> {
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
    for li in 0..c.num_layers {
        // Biases uniform in ±0.5, from a hash of (seed, layer, index).
        let bias = |len: usize| -> Vec<f32> {
            (0..len as u64)
                .map(|j| {
                    let mut x = seed ^ (li as u64) << 40 ^ j;
                    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
                    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
                    (x >> 40) as f32 / (1u64 << 24) as f32 - 0.5
                })
                .collect()
        };
        let mut layer = GpuLayer {
            attn_norm: ones(h)?,
            qkv: matrix(q + 2 * kv, h, fan(h))?,
            o: matrix(h, q, fan(q))?,
            ffn_norm: ones(h)?,
            gate_up: matrix(2 * inter, h, fan(h))?,
            down: matrix(h, inter, fan(inter))?,
            fp8: None,
            qkv_bias: if c.qkv_bias {
                Some(f32_to_device(gpu, &bias(q + 2 * kv))?)
            } else {
                None
            },
            // Weights in [0.5, 1.5).
            qk_norm: if c.qk_norm {
                let w: Vec<f32> = bias(2 * hd).into_iter().map(|b| b + 1.0).collect();
                Some(f32_to_device(gpu, &w)?)
            } else {
                None
            },
        };
        if let Some(q) = fp8 {
            q.layer(gpu, &mut layer)?;
        }
        layers.push(layer);
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

/// Converts layers' four matrices to e4m3 with a scale per row (or one per matrix: see the
/// module doc), each layer as it is loaded, so loading holds at most one layer in bf16 beside
/// the fp8 ones.
pub(crate) struct Fp8Quantizer {
    /// (rows, cols) by [`Proj`].
    shapes: [(usize, usize); 4],
    /// Byte offsets of each matrix's scales (256-byte aligned) and the bytes of all four.
    offsets: [u64; 4],
    bytes: usize,
    parts: DevMem,
    scaling: Fp8Scaling,
}

impl Fp8Quantizer {
    pub fn new(gpu: &Gpu, c: &LlamaConfig, scaling: Fp8Scaling) -> Result<Self, GpuError> {
        let (h, hd) = (c.hidden_size, c.head_dim);
        let (q, kv, inter) = (c.num_heads * hd, c.num_kv_heads * hd, c.intermediate_size);
        if h % 16 != 0 || q % 16 != 0 || inter % 16 != 0 {
            return Err(GpuError::InvalidConfig(format!(
                "fp8 weights need hidden, attention and intermediate sizes that are multiples of 16 (here {h}, {q}, {inter})"
            )));
        }
        let shapes = [(q + 2 * kv, h), (h, q), (2 * inter, h), (h, inter)];
        let mut offsets = [0u64; 4];
        let mut bytes = 0usize;
        for (o, &(rows, _)) in offsets.iter_mut().zip(&shapes) {
            *o = bytes as u64;
            bytes += (rows * 4).next_multiple_of(256);
        }
        Ok(Fp8Quantizer {
            shapes,
            offsets,
            bytes,
            parts: gpu.alloc(FP8_MAX_PARTS * 4)?,
            scaling,
        })
    }

    /// Quantizes `layer`'s matrices, freeing each bf16 copy once converted.
    pub fn layer(&self, gpu: &Gpu, layer: &mut GpuLayer) -> Result<(), GpuError> {
        let scales = gpu.alloc(self.bytes)?;
        let mats = [
            &mut layer.qkv,
            &mut layer.o,
            &mut layer.gate_up,
            &mut layer.down,
        ];
        for ((m, &(rows, cols)), &off) in mats.into_iter().zip(&self.shapes).zip(&self.offsets) {
            let out = gpu.alloc(rows * cols)?;
            let to = (out.ptr(), scales.ptr() + off, self.parts.ptr());
            gpu.quantize_fp8(m.ptr(), (rows, cols), to, self.scaling)?;
            // The bf16 copy may only be freed once the conversion has read it.
            gpu.sync()?;
            *m = out;
        }
        layer.fp8 = Some(Fp8Layer {
            scales,
            offsets: self.offsets,
            scaling: self.scaling,
        });
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::rope_row_order;

    /// The stored order is a permutation whose tile rows g and g + 8 hold the two elements of
    /// one rotation pair, and the kernels' index arithmetic (`rope_pair_row`, and the pair index
    /// the GEMV epilogue derives from a stored row) agrees with it.
    #[test]
    fn stored_rows_follow_the_order_in_every_head() {
        // 2 heads of 16 rows, 3 columns; each value encodes (row, column).
        let (rows, cols) = (32, 3);
        let f: Vec<f32> = (0..rows * cols).map(|i| i as f32).collect();
        let order = super::rope_row_order(16, false);
        let got = super::stored_bf16("t", &f, rows, cols, Some(&order)).unwrap();
        for head in 0..2 {
            for (p, &from) in order.iter().enumerate() {
                for c in 0..cols {
                    let want = ((head * 16 + from) * cols + c) as f32;
                    assert_eq!(got[(head * 16 + p) * cols + c].to_f32(), want);
                }
            }
        }
        let plain = super::stored_bf16("t", &f, rows, cols, None).unwrap();
        assert!(plain.iter().zip(&f).all(|(b, x)| b.to_f32() == *x));
        assert!(super::stored_bf16("t", &f[..24 * cols], 24, cols, Some(&order)).is_err());
    }

    #[test]
    fn rope_rows_pair_up_eight_apart_in_each_tile() {
        for hd in [16usize, 64, 128] {
            for interleaved in [false, true] {
                let order = rope_row_order(hd, interleaved);
                let mut seen = vec![false; hd];
                for &r in &order {
                    assert!(!seen[r], "row {r} twice");
                    seen[r] = true;
                }
                for j in 0..hd / 2 {
                    let (a, b) = if interleaved {
                        (2 * j, 2 * j + 1)
                    } else {
                        (j, j + hd / 2)
                    };
                    // rope_pair_row in llama.cu.
                    let p = 16 * (j >> 3) + (j & 7);
                    assert_eq!((order[p], order[p + 8]), (a, b), "hd {hd} pair {j}");
                    assert_eq!(p / 16, (p + 8) / 16, "pair {j} split across tiles");
                    // gemv_rope_out: the pair index from the first row.
                    assert_eq!(8 * (p >> 4) + (p & 7), j);
                    assert!(p % 16 < 8);
                }
            }
        }
        assert_eq!(
            &rope_row_order(16, false)[..],
            &[0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15]
        );
        assert_eq!(
            &rope_row_order(16, true)[..],
            &[0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15]
        );
    }

    /// The kernels' view, emulated end to end: a head's Q rows stored in this order, the
    /// product with an input, then the GEMV epilogue's rotation of each tile's rows g and
    /// g + 8 written to the checkpoint positions — against rotating the checkpoint-order
    /// product directly (the CPU backend's convention), for both RoPE styles.
    #[test]
    fn rotating_stored_rows_in_place_equals_rotating_the_checkpoint_rows() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
        let (hd, cols, pos) = (64usize, 24usize, 37.0f64);
        let freq: Vec<f64> = (0..hd / 2)
            .map(|j| 10000f64.powf(-2.0 * j as f64 / hd as f64))
            .collect();
        let w: Vec<Vec<f64>> = (0..hd)
            .map(|_| (0..cols).map(|_| rng.random_range(-1.0..1.0)).collect())
            .collect();
        let x: Vec<f64> = (0..cols).map(|_| rng.random_range(-1.0..1.0)).collect();
        let dot = |row: &[f64]| row.iter().zip(&x).map(|(a, b)| a * b).sum::<f64>();
        let rotate = |x0: f64, x1: f64, j: usize| {
            let (s, c) = (pos * freq[j]).sin_cos();
            (x0 * c - x1 * s, x1 * c + x0 * s)
        };
        for interleaved in [false, true] {
            let pair = |j: usize| {
                if interleaved {
                    (2 * j, 2 * j + 1)
                } else {
                    (j, j + hd / 2)
                }
            };
            // The reference: the checkpoint-order product, each pair rotated.
            let y: Vec<f64> = w.iter().map(|r| dot(r)).collect();
            let mut want = vec![0.0; hd];
            for j in 0..hd / 2 {
                let (a, b) = pair(j);
                (want[a], want[b]) = rotate(y[a], y[b], j);
            }
            // The backend: stored rows, their product, the epilogue per tile row pair.
            let order = rope_row_order(hd, interleaved);
            let stored: Vec<f64> = order.iter().map(|&r| dot(&w[r])).collect();
            let mut got = vec![f64::NAN; hd];
            for ra in (0..hd).filter(|ra| ra % 16 < 8) {
                let j = 8 * (ra >> 4) + (ra & 7);
                let (a, b) = pair(j);
                (got[a], got[b]) = rotate(stored[ra], stored[ra + 8], j);
            }
            for (g, w) in got.iter().zip(&want) {
                assert!(
                    (g - w).abs() < 1e-12,
                    "interleaved {interleaved}: {g} vs {w}"
                );
            }
        }
    }
}
