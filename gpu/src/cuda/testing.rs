//! Entry points into single kernels for the CUDA test binary (`gpu/tests/cuda_*.rs`): paged
//! attention over a cache the test fills, the matrix products (GEMV kernels, cuBLASLt and
//! cublasGemmEx, eagerly or replayed from a CUDA graph) over weights the test chooses, and the
//! logit edits plus sampling kernels over logits the test chooses. Not part of the serving path.

use std::sync::Arc;

use half::bf16;

use super::device::{DevMem, GemvInput, GemvOutput, Gpu, Product, RopeOut};
use super::forward::{self, Launch};
use super::sampling::{self, Edits, SampleArrays, SeqState};
use super::step::{self, Layout, MAX_SPLITS};
use crate::backend::{Batch, SeqInput};
use crate::error::GpuError;
use crate::sampler::SamplingParams;

/// One sequence of an attention check.
#[derive(Clone, Debug)]
pub struct AttentionSeq {
    /// Tokens already in the cache before this chunk.
    pub computed: usize,
    /// Query tokens of this chunk.
    pub queries: usize,
    /// Block table (covering `computed + queries` positions).
    pub table: Vec<u32>,
}

/// Shapes of an attention check.
#[derive(Clone, Debug)]
pub struct AttentionShape {
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub block_size: usize,
    pub num_blocks: usize,
    /// Splits of the key range (grid z); `None` picks as the backend does.
    pub splits: Option<usize>,
    /// Tiles of at most 16 rows in one-warp blocks (else every tile in four-warp blocks).
    pub one_warp: bool,
    /// An fp8 cache (`kv_cache_dtype: fp8`): each (slot, KV head) vector quantized by the
    /// backend's kernel (e4m3, a scale per vector).
    pub fp8_kv: bool,
    /// A sliding window: each query attends to its last `window` positions.
    pub window: Option<usize>,
}

/// What [`paged_attention`] returns: the output `[tokens, heads, head_dim]` and, over an fp8
/// cache, the keys' and the values' e4m3 bytes and scales (one per slot and KV head) as the
/// kernel wrote them.
pub struct AttentionRun {
    pub out: Vec<f32>,
    pub fp8: Option<[(Vec<u8>, Vec<f32>); 2]>,
}

/// Runs the paged attention kernel: `q` is `[tokens, heads, head_dim]` (the sequences' chunks
/// one after the other), `k` and `v` are the whole cache `[blocks * block_size, kv_heads,
/// head_dim]`. Inputs are rounded to bf16 as the backend stores them (and, with `fp8_kv`, the
/// cache quantized).
pub fn paged_attention(
    s: &AttentionShape,
    seqs: &[AttentionSeq],
    q: &[f32],
    k: &[f32],
    v: &[f32],
) -> Result<AttentionRun, GpuError> {
    let gpu = Gpu::open(0)?;
    let (nh, nkv, hd) = (s.num_heads, s.num_kv_heads, s.head_dim);
    let batch = Batch {
        seqs: seqs
            .iter()
            .enumerate()
            .map(|(i, a)| SeqInput {
                seq_id: i as u64,
                num_computed_tokens: a.computed,
                tokens: vec![0; a.queries],
                block_table: a.table.clone(),
                sample: false,
                num_drafts: 0,
                sampling: Arc::new(SamplingParams::greedy()),
                adapter: None,
                cached_prompt: None,
            })
            .collect(),
    };
    let d = step::flatten(&batch, nh / nkv, s.block_size, |_| Vec::new())?;
    let t = d.tokens.len();
    let slots = s.num_blocks * s.block_size;
    if q.len() != t * nh * hd || k.len() != slots * nkv * hd || v.len() != k.len() {
        return Err(GpuError::BadBatch("attention check: sizes disagree".into()));
    }
    let tiles = d.tile_qn.len();
    let z = s
        .splits
        .unwrap_or_else(|| step::grid_splits(tiles, nkv, MAX_SPLITS))
        .clamp(1, MAX_SPLITS);
    let lay = Layout::new(t, tiles, 0, 0);
    let mut host = Vec::new();
    step::pack(&d, &[], &lay, (t, tiles, 0, 0), z, &mut host);
    let to_bf16 = |x: &[f32]| x.iter().map(|&f| bf16::from_f32(f)).collect::<Vec<bf16>>();
    let (qb, kb, vb) = (to_bf16(q), to_bf16(k), to_bf16(v));
    let stepbuf = gpu.alloc(host.len())?;
    let qd = gpu.alloc(qb.len() * 2)?;
    let out = gpu.alloc(t * nh * hd * 2)?;
    let pacc = gpu.alloc(t * nh * z * hd * 4)?;
    let pml = gpu.alloc(t * nh * z * 2 * 4)?;
    gpu.upload(stepbuf.ptr(), &host)?;
    gpu.upload(qd.ptr(), &qb)?;
    // The cache: bf16, or quantized per (slot, KV head) vector by the backend's kernel (the
    // values rope_store_kv_f8 would write for these bf16 ones), synchronised before attention
    // asks for its first keys.
    enum Cache {
        Bf16(DevMem, DevMem),
        Fp8(DeviceFp8, DeviceFp8),
    }
    let cache = if s.fp8_kv {
        let rows = (slots * nkv, hd);
        let row = super::Fp8Scaling::Row;
        Cache::Fp8(
            DeviceFp8::new(&gpu, &kb, rows, row)?,
            DeviceFp8::new(&gpu, &vb, rows, row)?,
        )
    } else {
        let (kd, vd) = (gpu.alloc(kb.len() * 2)?, gpu.alloc(vb.len() * 2)?);
        gpu.upload(kd.ptr(), &kb)?;
        gpu.upload(vd.ptr(), &vb)?;
        Cache::Bf16(kd, vd)
    };
    let kv = match &cache {
        Cache::Bf16(kd, vd) => forward::KvLayer {
            k: kd.ptr(),
            v: vd.ptr(),
            scales: None,
        },
        Cache::Fp8(kq, vq) => forward::KvLayer {
            k: kq.q.ptr(),
            v: vq.q.ptr(),
            scales: Some((kq.scales.ptr(), vq.scales.ptr())),
        },
    };
    let launch = Launch {
        tokens: t,
        tiles,
        small_tiles: if s.one_warp { d.small_tiles } else { 0 },
        rows: 0,
        z,
        // Every decode-only check takes the early path, whatever its size (the engine only
        // for small steps), so the kernels' split first chunk is covered.
        early_kv: d.one_token_per_seq(),
        layout: lay,
    };
    forward::attention(
        &gpu,
        &forward::AttentionIo {
            q: qd.ptr(),
            kv,
            out: out.ptr(),
            part_acc: pacc.ptr(),
            part_ml: pml.ptr(),
            step: &stepbuf,
        },
        &launch,
        (nh, nkv, hd),
        s.block_size,
        1.0 / (hd as f32).sqrt(),
        s.window,
    )?;
    let mut o = vec![bf16::ZERO; t * nh * hd];
    gpu.download(&mut o, out.ptr())?;
    Ok(AttentionRun {
        out: o.iter().map(|x| x.to_f32()).collect(),
        fp8: match &cache {
            Cache::Bf16(..) => None,
            Cache::Fp8(kq, vq) => Some([kq.download(&gpu)?, vq.download(&gpu)?]),
        },
    })
}

/// What [`rope_store`] returns: Q and the cache as `rope_store_kv` writes them into a bf16
/// cache and as `rope_store_kv_f8` writes them into an fp8 one (token `t` in slot `t`).
pub struct RopeStoreRun {
    /// `[tokens, heads, head_dim]`, from the bf16 kernel and from the fp8 one.
    pub q: [Vec<bf16>; 2],
    /// `[tokens, kv_heads, head_dim]`: the bf16 cache's keys and values.
    pub k: Vec<bf16>,
    pub v: Vec<bf16>,
    /// The fp8 cache: e4m3 bytes and one scale per (token, KV head).
    pub k8: (Vec<u8>, Vec<f32>),
    pub v8: (Vec<u8>, Vec<f32>),
}

/// Runs the backend's RoPE-and-store kernels, bf16 and fp8, over the f32 QKV product `qkv`
/// (`[tokens, (heads + 2 kv_heads) head_dim]`, Q and K rows in the kernels' pair order) at
/// positions `pos`, with RoPE frequencies `theta^(-2j / head_dim)`.
pub fn rope_store(
    qkv: &[f32],
    (nh, nkv, hd): (usize, usize, usize),
    pos: &[i32],
    theta: f32,
    interleaved: bool,
) -> Result<RopeStoreRun, GpuError> {
    let t = pos.len();
    if t == 0
        || qkv.len() != t * (nh + 2 * nkv) * hd
        || super::device::attention_kernel_index(hd).is_none()
    {
        return Err(GpuError::BadBatch("rope check: sizes disagree".into()));
    }
    let gpu = Gpu::open(0)?;
    // The frequencies, then the pairs' amplitudes (1: a full rotary embedding).
    let inv_freq: Vec<f32> = (0..hd / 2)
        .map(|j| theta.powf(-2.0 * j as f32 / hd as f32))
        .chain(std::iter::repeat_n(1.0, hd / 2))
        .collect();
    let slots: Vec<i64> = (0..t as i64).collect();
    let up = |bytes: usize| gpu.alloc(bytes);
    let (qkv_d, pos_d, slots_d, freq_d) = (up(qkv.len() * 4)?, up(t * 4)?, up(t * 8)?, up(hd * 4)?);
    gpu.upload(qkv_d.ptr(), qkv)?;
    gpu.upload(pos_d.ptr(), pos)?;
    gpu.upload(slots_d.ptr(), &slots)?;
    gpu.upload(freq_d.ptr(), &inv_freq)?;
    let (qn, kvn) = (t * nh * hd, t * nkv * hd);
    let (q_b, kc, vc) = (up(qn * 2)?, up(kvn * 2)?, up(kvn * 2)?);
    let (q_f, k8, v8, ks, vs) = (
        up(qn * 2)?,
        up(kvn)?,
        up(kvn)?,
        up(t * nkv * 4)?,
        up(t * nkv * 4)?,
    );
    let out = |q: &DevMem, k: &DevMem, v: &DevMem| RopeOut {
        q: q.ptr(),
        k_cache: k.ptr(),
        v_cache: v.ptr(),
        pos: pos_d.ptr(),
        slots: slots_d.ptr(),
        inv_freq: freq_d.ptr(),
        heads: (nh, nkv, hd),
        interleaved,
        bias: 0,
    };
    gpu.rope_store(qkv_d.ptr(), t, &out(&q_b, &kc, &vc), None)?;
    gpu.rope_store(
        qkv_d.ptr(),
        t,
        &out(&q_f, &k8, &v8),
        Some((ks.ptr(), vs.ptr())),
    )?;
    gpu.sync()?;
    let bf = |d: &DevMem, n: usize| -> Result<Vec<bf16>, GpuError> {
        let mut v = vec![bf16::ZERO; n];
        gpu.download(&mut v, d.ptr())?;
        Ok(v)
    };
    let bytes = |d: &DevMem, s: &DevMem| -> Result<(Vec<u8>, Vec<f32>), GpuError> {
        let (mut b, mut f) = (vec![0u8; kvn], vec![0f32; t * nkv]);
        gpu.download(&mut b, d.ptr())?;
        gpu.download(&mut f, s.ptr())?;
        Ok((b, f))
    };
    Ok(RopeStoreRun {
        q: [bf(&q_b, qn)?, bf(&q_f, qn)?],
        k: bf(&kc, kvn)?,
        v: bf(&vc, kvn)?,
        k8: bytes(&k8, &ks)?,
        v8: bytes(&v8, &vs)?,
    })
}

/// Applies each row's sampling parameters (edits from a fresh state that has seen `prompt`)
/// to `logits` (`rows x vocab`) and samples one token per row, row `r` with seed `seed + r`
/// and stream counter `counter`; with `split`, greedy rows take the split path where the
/// backend would (`argmax_split`, few rows of a large vocabulary).
pub fn sample(
    logits: &[f32],
    vocab: usize,
    params: &[SamplingParams],
    prompt: &[u32],
    seed: u64,
    counter: u64,
    split: bool,
) -> Result<Vec<u32>, GpuError> {
    let gpu = Gpu::open(0)?;
    let rows = params.len();
    if logits.len() != rows * vocab {
        return Err(GpuError::BadBatch("sample check: sizes disagree".into()));
    }
    let mut edits = Edits::default();
    let mut samples = Vec::new();
    for (r, p) in params.iter().enumerate() {
        p.validate(vocab)?;
        let mut st = SeqState::new(seed.wrapping_add(r as u64));
        st.observe(&SeqInput {
            seq_id: 0,
            num_computed_tokens: 0,
            tokens: prompt.to_vec(),
            block_table: Vec::new(),
            sample: true,
            num_drafts: 0,
            sampling: Arc::new(p.clone()),
            adapter: None,
            cached_prompt: None,
        });
        st.sampled = counter;
        st.edits(r, p, None, &mut edits);
        samples.push(st.sample_row(r, p));
    }
    let lay = Layout::new(0, 0, 0, rows);
    let mut host = Vec::new();
    step::pack(
        &step::StepData::default(),
        &samples,
        &lay,
        (0, 0, 0, rows),
        1,
        &mut host,
    );
    let stepbuf = gpu.alloc(host.len())?;
    let ld = gpu.alloc(logits.len() * 4)?;
    let out = gpu.alloc(rows * 4)?;
    gpu.upload(stepbuf.ptr(), &host)?;
    gpu.upload(ld.ptr(), logits)?;
    let mut ebuf = None;
    edits.apply(&gpu, &mut ebuf, ld.ptr(), vocab)?;
    let arrays = SampleArrays::at(&lay, |o| stepbuf.at(o))?;
    let scratch = if split {
        Some(sampling::ArgmaxScratch::new(&gpu, rows)?)
    } else {
        None
    };
    sampling::sample(
        &gpu,
        ld.ptr(),
        vocab,
        &arrays,
        &samples,
        out.ptr(),
        scratch.as_ref(),
    )?;
    let mut t = vec![0i32; rows];
    gpu.download(&mut t, out.ptr())?;
    Ok(t.iter().map(|&x| x as u32).collect())
}

/// The activations of a [`MatmulRig`] product.
#[derive(Clone, Copy, Debug)]
pub enum MatmulInput<'a> {
    /// bf16 rows `[n, k]`.
    Bf16(&'a [bf16]),
    /// f32 residual rows `[n, k]`, RMS-normalised with `weight` (k values) on the way in, as
    /// the fused QKV and gate|up products of small steps do.
    Norm {
        x: &'a [f32],
        weight: &'a [f32],
        eps: f32,
    },
}

/// What a [`MatmulRig`] product writes.
#[derive(Clone, Copy, Debug)]
pub enum MatmulOutput {
    /// `[n, m]` f32, `C = A · W^T + beta C`.
    F32 { beta: f32 },
    /// `[n, m]` bf16, `C = A · W^T + beta C`.
    Bf16 { beta: f32 },
    /// `[n, m]` bf16 `silu(gate) * up`, the weights holding `m` gate rows then `m` up rows.
    Glu,
}

/// Which implementation a [`MatmulRig`] product runs on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MatmulPath {
    /// As the forward pass routes it (`Gpu::gemm`: the GEMV kernels for at most 8 rows).
    Routed,
    /// cuBLAS as the forward pass's large products run it (`Gpu::gemm_cublas`: cuBLASLt unless
    /// `SWITCHYARD_CUDA_BLASLT=0`). This and the next three: plain bf16 inputs only.
    Cublas,
    /// cuBLASLt with its per-shape plan (an error if it declines the shape).
    CublasLt,
    /// cublasGemmEx.
    GemmEx,
    /// cuBLASLt captured in a CUDA graph (a shape the rig has not run yet is planned during
    /// the capture, as for a decode graph's first capture) and replayed.
    CublasLtCaptured,
}

/// Values written past the output to catch stray stores.
const GUARD: usize = 64;

/// Weights on the device and the products of the forward pass over them.
pub struct MatmulRig {
    gpu: Gpu,
    w: DevMem,
    m: usize,
    k: usize,
}

impl MatmulRig {
    /// Runs the GEMV kernels of steps of at most 8 tokens with each block starting at its own
    /// batch along k, as the backend does for models above hidden size 2048
    /// (`Gpu::gemv_rotate`).
    pub fn set_rotation(&mut self, on: bool) {
        self.gpu.gemv_rotate = if on { super::device::GEMV_ROTATE } else { 0 };
    }

    /// Uploads `w` (`rows x k` bf16, row-major; `rows` = m, or 2m for [`MatmulOutput::Glu`]).
    pub fn new(w: &[bf16], k: usize) -> Result<Self, GpuError> {
        if k == 0 || w.is_empty() || !w.len().is_multiple_of(k) {
            return Err(GpuError::BadBatch("matmul check: W is not rows x k".into()));
        }
        let gpu = Gpu::open(0)?;
        let wd = gpu.alloc(w.len() * 2)?;
        gpu.upload(wd.ptr(), w)?;
        gpu.sync()?;
        Ok(MatmulRig {
            gpu,
            w: wd,
            m: w.len() / k,
            k,
        })
    }

    /// Shapes in the cuBLASLt plan cache of the rig's device.
    pub fn lt_cached_shapes(&self) -> usize {
        self.gpu.lt_cached_shapes()
    }

    /// Runs one product over `n` rows of `input`, the output starting as `init` (`n x m`
    /// values, rounded to bf16 for bf16 outputs; NaN is fine where beta is 0), and returns
    /// the output as f32. Fails if the kernel wrote past the output.
    pub fn run(
        &self,
        input: MatmulInput<'_>,
        n: usize,
        output: MatmulOutput,
        init: &[f32],
        path: MatmulPath,
    ) -> Result<Vec<f32>, GpuError> {
        Ok(self.product(input, n, output, init, path, 0)?.0)
    }

    /// Mean milliseconds of one product over `iters` launches back to back (after 3 warm-up
    /// launches), timed with CUDA events; the output then holds no meaningful values.
    pub fn time(
        &self,
        input: MatmulInput<'_>,
        n: usize,
        output: MatmulOutput,
        init: &[f32],
        path: MatmulPath,
        iters: usize,
    ) -> Result<f64, GpuError> {
        Ok(self.product(input, n, output, init, path, iters.max(1))?.1)
    }

    fn product(
        &self,
        input: MatmulInput<'_>,
        n: usize,
        output: MatmulOutput,
        init: &[f32],
        path: MatmulPath,
        timing_iters: usize,
    ) -> Result<(Vec<f32>, f64), GpuError> {
        let gpu = &self.gpu;
        let k = self.k;
        let m = match output {
            MatmulOutput::Glu if self.m.is_multiple_of(2) => self.m / 2,
            MatmulOutput::Glu => {
                return Err(GpuError::BadBatch("matmul check: GLU needs 2m rows".into()))
            }
            _ => self.m,
        };
        if init.len() != n * m {
            return Err(GpuError::BadBatch("matmul check: init is not n x m".into()));
        }
        let f32_out = matches!(output, MatmulOutput::F32 { .. });
        let elem = if f32_out { 4 } else { 2 };
        let out = gpu.alloc((n * m + GUARD) * elem)?;
        let guard = 12_345.0f32;
        let mut init_g = init.to_vec();
        init_g.extend(std::iter::repeat_n(guard, GUARD));
        if f32_out {
            gpu.upload(out.ptr(), &init_g)?;
        } else {
            let b: Vec<bf16> = init_g.iter().map(|&v| bf16::from_f32(v)).collect();
            gpu.upload(out.ptr(), &b)?;
            gpu.sync()?;
        }
        gpu.sync()?;

        // Inputs.
        let (gin, _bufs): (GemvInput, Vec<DevMem>) = match input {
            MatmulInput::Bf16(a) => {
                if a.len() != n * k {
                    return Err(GpuError::BadBatch("matmul check: A is not n x k".into()));
                }
                let ad = gpu.alloc(a.len() * 2)?;
                gpu.upload(ad.ptr(), a)?;
                (GemvInput::Bf16(ad.ptr()), vec![ad])
            }
            MatmulInput::Norm { x, weight, eps } => {
                if x.len() != n * k || weight.len() != k {
                    return Err(GpuError::BadBatch("matmul check: norm input sizes".into()));
                }
                let xd = gpu.alloc(x.len() * 4)?;
                let wd = gpu.alloc(weight.len() * 4)?;
                gpu.upload(xd.ptr(), x)?;
                gpu.upload(wd.ptr(), weight)?;
                (
                    GemvInput::Norm {
                        x: xd.ptr(),
                        weight: wd.ptr(),
                        eps,
                    },
                    vec![xd, wd],
                )
            }
        };
        gpu.sync()?;
        let product = |a: u64, beta: f32| Product {
            w: self.w.ptr(),
            a,
            c: out.ptr(),
            m,
            n,
            k,
            beta,
            c_f32: f32_out,
            fp8: None,
        };
        let launch = || -> Result<(), GpuError> {
            match (path, gin, output) {
                (MatmulPath::Routed, GemvInput::Bf16(a), MatmulOutput::F32 { beta })
                | (MatmulPath::Routed, GemvInput::Bf16(a), MatmulOutput::Bf16 { beta }) => {
                    gpu.gemm(product(a, beta))?
                }
                (MatmulPath::Cublas, GemvInput::Bf16(a), MatmulOutput::F32 { beta })
                | (MatmulPath::Cublas, GemvInput::Bf16(a), MatmulOutput::Bf16 { beta }) => {
                    gpu.gemm_cublas(product(a, beta))?
                }
                (MatmulPath::GemmEx, GemvInput::Bf16(a), MatmulOutput::F32 { beta })
                | (MatmulPath::GemmEx, GemvInput::Bf16(a), MatmulOutput::Bf16 { beta }) => {
                    gpu.gemm_ex(product(a, beta))?
                }
                (
                    MatmulPath::CublasLt | MatmulPath::CublasLtCaptured,
                    GemvInput::Bf16(a),
                    MatmulOutput::F32 { beta } | MatmulOutput::Bf16 { beta },
                ) => {
                    if !gpu.gemm_lt(product(a, beta))? {
                        return Err(GpuError::Internal(format!(
                            "matmul check: cuBLASLt declined m={m} n={n} k={k}"
                        )));
                    }
                }
                (MatmulPath::Routed, gin, output) => {
                    let o = match output {
                        MatmulOutput::F32 { beta } => GemvOutput::Plain {
                            beta,
                            f32_out: true,
                        },
                        MatmulOutput::Bf16 { beta } => GemvOutput::Plain {
                            beta,
                            f32_out: false,
                        },
                        MatmulOutput::Glu => GemvOutput::Glu,
                    };
                    gpu.gemv((self.w.ptr(), None), gin, out.ptr(), m, n, k, o, None)?
                }
                (
                    MatmulPath::Cublas
                    | MatmulPath::CublasLt
                    | MatmulPath::GemmEx
                    | MatmulPath::CublasLtCaptured,
                    _,
                    _,
                ) => {
                    return Err(GpuError::BadBatch(
                        "matmul check: cuBLAS takes plain bf16 products only".into(),
                    ))
                }
            }
            Ok(())
        };
        // The captured path: record the launch once, then every launch replays the graph.
        let graph = if path == MatmulPath::CublasLtCaptured {
            use cudarc::driver::sys;
            gpu.stream
                .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
                .map_err(|e| super::device::cuda_err("begin capture", e))?;
            let enq = launch();
            let end = gpu.stream.end_capture(sys::CUgraphInstantiate_flags(0));
            enq?;
            Some(
                end.map_err(|e| super::device::cuda_err("end capture", e))?
                    .ok_or_else(|| GpuError::Internal("matmul check: empty graph".into()))?,
            )
        } else {
            None
        };
        let launch = || -> Result<(), GpuError> {
            match &graph {
                Some(g) => g
                    .launch()
                    .map_err(|e| super::device::cuda_err("graph launch", e)),
                None => launch(),
            }
        };
        let mut ms = 0.0;
        if timing_iters == 0 {
            launch()?;
        } else {
            for _ in 0..3 {
                launch()?;
            }
            let ev = || {
                gpu.ctx
                    .new_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT))
                    .map_err(|e| super::device::cuda_err("event", e))
            };
            let (start, end) = (ev()?, ev()?);
            start
                .record(&gpu.stream)
                .map_err(|e| super::device::cuda_err("event record", e))?;
            for _ in 0..timing_iters {
                launch()?;
            }
            end.record(&gpu.stream)
                .map_err(|e| super::device::cuda_err("event record", e))?;
            ms = f64::from(
                start
                    .elapsed_ms(&end)
                    .map_err(|e| super::device::cuda_err("event time", e))?,
            ) / timing_iters as f64;
        }
        let mut all = vec![0f32; n * m + GUARD];
        if f32_out {
            gpu.download(&mut all, out.ptr())?;
        } else {
            let mut b = vec![bf16::ZERO; n * m + GUARD];
            gpu.download(&mut b, out.ptr())?;
            all = b.iter().map(|v| v.to_f32()).collect();
        }
        let guard_back = if f32_out {
            guard
        } else {
            bf16::from_f32(guard).to_f32()
        };
        if all[n * m..].iter().any(|&v| v != guard_back) {
            return Err(GpuError::Internal(
                "matmul check: a kernel wrote past the output".into(),
            ));
        }
        all.truncate(n * m);
        Ok((all, ms))
    }
}

/// The fp8 scalings this GPU's cuBLASLt runs (see [`super::Fp8Scaling`]).
pub fn fp8_scalings() -> Result<Vec<super::Fp8Scaling>, GpuError> {
    let gpu = Gpu::open(0)?;
    Ok([super::Fp8Scaling::Row, super::Fp8Scaling::Tensor]
        .into_iter()
        .filter(|&s| {
            // The shapes of the checks (f32 output, accumulated; bf16 output).
            let products = vec![
                (256, 256, true, false),
                (256, 256, true, true),
                (256, 256, false, false),
            ];
            gpu.fp8_supported(s, &(products, vec![1, 64])).is_ok()
        })
        .collect())
}

/// A bf16 matrix quantized on the device by the backend's kernel, and where its e4m3 bytes and
/// scales are.
struct DeviceFp8 {
    q: DevMem,
    scales: DevMem,
    rows: usize,
    k: usize,
    scaling: super::Fp8Scaling,
}

impl DeviceFp8 {
    /// Uploads `x` (`rows x k`) and quantizes it; waits for both (the GEMV kernels read
    /// weights before their wait on the kernel before them, as weights are written at load).
    fn new(
        gpu: &Gpu,
        x: &[bf16],
        (rows, k): (usize, usize),
        scaling: super::Fp8Scaling,
    ) -> Result<Self, GpuError> {
        let xd = gpu.alloc(x.len() * 2)?;
        gpu.upload(xd.ptr(), x)?;
        let (q, scales) = (gpu.alloc(rows * k)?, gpu.alloc(rows * 4)?);
        let parts = gpu.alloc(super::device::FP8_MAX_PARTS * 4)?;
        gpu.quantize_fp8(
            xd.ptr(),
            (rows, k),
            (q.ptr(), scales.ptr(), parts.ptr()),
            scaling,
        )?;
        gpu.sync()?;
        Ok(DeviceFp8 {
            q,
            scales,
            rows,
            k,
            scaling,
        })
    }

    /// The bytes and one scale per row (the tensor's repeated with `Tensor` scaling).
    fn download(&self, gpu: &Gpu) -> Result<(Vec<u8>, Vec<f32>), GpuError> {
        let mut q = vec![0u8; self.rows * self.k];
        let mut s = vec![0f32; self.rows];
        gpu.download(&mut q, self.q.ptr())?;
        gpu.download(&mut s, self.scales.ptr())?;
        if self.scaling == super::Fp8Scaling::Tensor {
            let s0 = s[0];
            s.fill(s0);
        }
        Ok((q, s))
    }
}

/// `len` values at `ptr`, f32 or bf16 (`f32`), as f32.
fn download_values(gpu: &Gpu, ptr: u64, len: usize, f32: bool) -> Result<Vec<f32>, GpuError> {
    if f32 {
        let mut v = vec![0f32; len];
        gpu.download(&mut v, ptr)?;
        return Ok(v);
    }
    let mut b = vec![bf16::ZERO; len];
    gpu.download(&mut b, ptr)?;
    Ok(b.iter().map(|v| v.to_f32()).collect())
}

/// What [`fp8_product`] returns: both operands as the backend quantized them (e4m3 bytes, one
/// f32 scale per row, or one in all with [`super::Fp8Scaling::Tensor`]) and the product
/// cuBLASLt computed from them.
pub struct Fp8Product {
    pub wq: Vec<u8>,
    pub w_scales: Vec<f32>,
    pub aq: Vec<u8>,
    pub a_scales: Vec<f32>,
    /// `c[t, r] = beta c0[t, r] + sum_k a[t, k] w[r, k]`, `n x m`.
    pub c: Vec<f32>,
}

/// Quantizes `w` (`m x k`) and `a` (`n x k`) with the backend's fp8 kernel and multiplies them
/// as an fp8 layer does (cuBLASLt, f32 or bf16 (`c_f32`) output onto `c0` with `beta`).
pub fn fp8_product(
    w: &[bf16],
    a: &[bf16],
    (m, n, k): (usize, usize, usize),
    (c0, beta, c_f32): (&[f32], f32, bool),
    scaling: super::Fp8Scaling,
) -> Result<Fp8Product, GpuError> {
    if w.len() != m * k || a.len() != n * k || c0.len() != n * m {
        return Err(GpuError::BadBatch("fp8 check: operand sizes".into()));
    }
    let gpu = Gpu::open(0)?;
    let wq = DeviceFp8::new(&gpu, w, (m, k), scaling)?;
    let aq = DeviceFp8::new(&gpu, a, (n, k), scaling)?;
    let c = gpu.alloc(n * m * 4)?;
    if c_f32 {
        gpu.upload(c.ptr(), c0)?;
    } else {
        let b: Vec<bf16> = c0.iter().map(|&v| bf16::from_f32(v)).collect();
        gpu.upload(c.ptr(), &b)?;
    }
    gpu.sync()?;
    gpu.gemm_cublas(Product {
        w: wq.q.ptr(),
        a: aq.q.ptr(),
        c: c.ptr(),
        m,
        n,
        k,
        beta,
        c_f32,
        fp8: Some(super::device::Fp8Scales {
            w: wq.scales.ptr(),
            a: aq.scales.ptr(),
            scaling,
        }),
    })?;
    gpu.sync()?;
    let ((wq_bytes, w_scales), (aq_bytes, a_scales)) = (wq.download(&gpu)?, aq.download(&gpu)?);
    Ok(Fp8Product {
        wq: wq_bytes,
        w_scales,
        aq: aq_bytes,
        a_scales,
        c: download_values(&gpu, c.ptr(), n * m, c_f32)?,
    })
}

/// What [`fp8_gemv`] returns: W as the backend quantized it (e4m3 bytes and one scale per row,
/// the matrix's one repeated with [`super::Fp8Scaling::Tensor`]) and the kernel's output.
pub struct Fp8Gemv {
    pub wq: Vec<u8>,
    pub w_scales: Vec<f32>,
    /// `n x m`: f32 `x W^T`, or with `glu` bf16 `silu(gate) * up` (W being `[gate; up]`,
    /// `2m x k`).
    pub y: Vec<f32>,
}

/// Quantizes `w` (`m x k`, `2m x k` with `glu`) with the backend's fp8 kernel and runs the
/// fp8 GEMV kernel (`n` <= 64 tokens of bf16 activations `a`, `n x k`) as a small step of an
/// fp8 layer does.
pub fn fp8_gemv(
    w: &[bf16],
    a: &[bf16],
    (m, n, k): (usize, usize, usize),
    glu: bool,
    scaling: super::Fp8Scaling,
) -> Result<Fp8Gemv, GpuError> {
    let rows = if glu { 2 * m } else { m };
    if w.len() != rows * k || a.len() != n * k {
        return Err(GpuError::BadBatch("fp8 GEMV check: operand sizes".into()));
    }
    let gpu = Gpu::open(0)?;
    let wq = DeviceFp8::new(&gpu, w, (rows, k), scaling)?;
    let ad = gpu.alloc(a.len() * 2)?;
    gpu.upload(ad.ptr(), a)?;
    let y = gpu.alloc(n * m * 4)?;
    let output = if glu {
        GemvOutput::Glu
    } else {
        GemvOutput::Plain {
            beta: 0.0,
            f32_out: true,
        }
    };
    if !gpu.gemv_fits(n, k, &[wq.q.ptr(), ad.ptr()]) {
        return Err(GpuError::BadBatch(
            "fp8 GEMV check: not a GEMV shape".into(),
        ));
    }
    let scales = super::device::Fp8Scales {
        w: wq.scales.ptr(),
        a: 0,
        scaling,
    };
    let input = GemvInput::Bf16(ad.ptr());
    gpu.gemv(
        (wq.q.ptr(), Some(scales)),
        input,
        y.ptr(),
        m,
        n,
        k,
        output,
        None,
    )?;
    gpu.sync()?;
    let (wq_bytes, w_scales) = wq.download(&gpu)?;
    Ok(Fp8Gemv {
        wq: wq_bytes,
        w_scales,
        y: download_values(&gpu, y.ptr(), n * m, !glu)?,
    })
}
