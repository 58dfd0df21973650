//! cuBLASLt matrix products with the algorithm chosen once per shape.
//!
//! `cublasGemmEx` picks its kernel again on every call from a small built-in table; cuBLASLt lets
//! us ask its heuristic once per shape (`cublasLtMatmulAlgoGetHeuristic`, with our workspace size
//! and the operands' alignment as preferences), keep the answer with the descriptors, and replay
//! it: a cached call is one hash lookup and one `cublasLtMatmul`, with no allocation and no
//! synchronisation, so it can be captured in a CUDA graph.
//!
//! The product is [`super::device::Gpu::gemm_cublas`]'s, `C[n, m] = A[n, k] · W[m, k]^T + beta C`
//! row-major, seen column-major as `C^T (m x n) = W^T · A^T` with `W` a `k x m` column-major
//! matrix used transposed (`TRANSA = T`) and `A^T` a `k x n` one (`TRANSB = N`); A and W bf16,
//! C f32 or bf16, compute and scale type f32.
//!
//! **fp8.** A product whose `fp8` is set reads W and A as e4m3 (this "TN" arrangement is the one
//! Hopper's fp8 kernels take) with a vector of f32 scales each (outer-vector scaling, cuBLAS
//! 12.9 and later: one per row of W, one per token), whose device addresses are set on the
//! plan's descriptor before each call (they change from layer to layer; cuBLASLt reads them
//! when the kernel runs, so graphs replay whatever the scales hold then). Fast accumulation
//! (`CUBLASLT_MATMUL_DESC_FAST_ACCUM`) is on unless `SWITCHYARD_CUDA_FP8_FAST_ACCUM=0`. fp8
//! products have no GemmEx fallback: a shape cuBLASLt declines is an error.
//!
//! **Graph capture.** Decode graphs are captured the first time a batch bucket occurs, usually
//! before any eager step of that many tokens, so the first call of a shape often comes while the
//! stream is capturing. Falling back to GemmEx there would freeze GemmEx into every such graph,
//! so the heuristic is queried during capture too: descriptor creation and the heuristic are
//! host-only calls (PyTorch's cuBLASLt path makes them on every captured call). What capture
//! changes is only that a *failure* seen while the stream captures is not remembered: that call
//! runs on GemmEx (which captures as well: its workspace is set explicitly) and the next eager
//! call of the shape asks again. The capture status is only queried on a cache miss.
//!
//! **Bounds.** The cache holds at most [`MAX_PLANS`] entries (shapes come from batch sizes, a
//! few per projection and step size); nothing is evicted, and uncached shapes beyond the cap run
//! on GemmEx. Shapes for which cuBLASLt has no algorithm, or whose setup fails, are remembered
//! as GemmEx (logged once at debug level).

use std::cell::RefCell;
use std::collections::HashMap;
use std::ffi::c_void;

use cudarc::cublas::sys::cublasOperation_t;
use cudarc::cublaslt::{result as lt, sys as lt_sys};

use super::device::{Fp8Scaling, Product};
use crate::error::GpuError;

/// Most shapes the cache holds (Lt plans and shapes remembered as GemmEx together).
pub(crate) const MAX_PLANS: usize = 4096;

/// Largest alignment told to the heuristic (the heuristic's own default assumption).
const MAX_ALIGN_LOG2: u32 = 8;

/// What identifies a plan: the product's shape, output type, whether it reads C, and the
/// alignment of W, A and C (the heuristic may pick kernels that need more alignment than a
/// pointer has, so it is told each pointer's, and the plan is only reused for pointers at least
/// that aligned).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct PlanKey {
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub c_f32: bool,
    /// `beta != 0`.
    pub accumulate: bool,
    /// W and A are e4m3, scaled so.
    pub fp8: Option<Fp8Scaling>,
    /// log2 of the alignment in bytes of W, A and C, at most 8 (256 bytes).
    pub align_log2: [u8; 3],
}

impl PlanKey {
    /// The key of a product (its shape, output type, accumulation and operand alignment).
    pub fn new(p: &Product) -> Self {
        PlanKey {
            m: p.m,
            n: p.n,
            k: p.k,
            c_f32: p.c_f32,
            accumulate: p.beta != 0.0,
            fp8: p.fp8.map(|s| s.scaling),
            align_log2: [align_log2(p.w), align_log2(p.a), align_log2(p.c)],
        }
    }

    /// Alignment in bytes of operand `i` (0: W, 1: A, 2: C).
    fn align_bytes(&self, i: usize) -> u32 {
        1 << self.align_log2[i]
    }
}

/// log2 of the largest power of two (at most 256) dividing `ptr`.
fn align_log2(ptr: u64) -> u8 {
    ptr.trailing_zeros().min(MAX_ALIGN_LOG2) as u8
}

/// A cache entry.
#[derive(Debug)]
pub(crate) enum Slot<P> {
    /// Run on cuBLASLt with this plan.
    Lt(P),
    /// Run on GemmEx (no algorithm, or setup failed).
    GemmEx,
}

/// The bounded shape cache: the policy, apart from the CUDA objects it holds.
#[derive(Debug)]
pub(crate) struct PlanCache<P> {
    map: HashMap<PlanKey, Slot<P>>,
    cap: usize,
}

impl<P> PlanCache<P> {
    pub fn new(cap: usize) -> Self {
        PlanCache {
            map: HashMap::new(),
            cap,
        }
    }

    pub fn get(&self, key: &PlanKey) -> Option<&Slot<P>> {
        self.map.get(key)
    }

    /// Whether a new shape may still be added.
    pub fn has_room(&self) -> bool {
        self.map.len() < self.cap
    }

    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// Records `plan` for `key`; returns false (dropping the plan) when the cache is full.
    pub fn insert_plan(&mut self, key: PlanKey, plan: P) -> bool {
        if !self.map.contains_key(&key) && !self.has_room() {
            return false;
        }
        self.map.insert(key, Slot::Lt(plan));
        true
    }

    /// Remembers that `key` runs on GemmEx (replacing a plan that failed), unless the failure
    /// was seen while capturing (it may be the capture's doing: the next eager call asks again)
    /// or a new entry would exceed the cap. Returns whether it was recorded.
    pub fn mark_gemm_ex(&mut self, key: PlanKey, capturing: bool) -> bool {
        if capturing || (!self.map.contains_key(&key) && !self.has_room()) {
            return false;
        }
        self.map.insert(key, Slot::GemmEx);
        true
    }
}

/// The descriptors and chosen algorithm of one shape; destroyed on drop.
struct Plan {
    desc: lt_sys::cublasLtMatmulDesc_t,
    /// W: bf16 `k x m`, ld k (used transposed).
    w: lt_sys::cublasLtMatrixLayout_t,
    /// A^T: bf16 `k x n`, ld k.
    a: lt_sys::cublasLtMatrixLayout_t,
    /// C^T and D^T (the same buffer): `m x n`, ld m.
    c: lt_sys::cublasLtMatrixLayout_t,
    algo: lt_sys::cublasLtMatmulAlgo_t,
}

impl Drop for Plan {
    fn drop(&mut self) {
        // SAFETY: each descriptor was created by this plan (null ones were never created) and
        // is destroyed once; no enqueued work reads descriptors (cublasLtMatmul copies what it
        // needs at call time).
        unsafe {
            for l in [self.w, self.a, self.c] {
                if !l.is_null() {
                    let _ = lt::destroy_matrix_layout(l);
                }
            }
            if !self.desc.is_null() {
                let _ = lt::destroy_matmul_desc(self.desc);
            }
        }
    }
}

/// A heuristic-search preference, destroyed on drop.
struct Pref(lt_sys::cublasLtMatmulPreference_t);

impl Drop for Pref {
    fn drop(&mut self) {
        // SAFETY: created by `create_matmul_pref`, destroyed once.
        let _ = unsafe { lt::destroy_matmul_pref(self.0) };
    }
}

fn lt_err(what: &str, e: impl std::fmt::Debug) -> GpuError {
    GpuError::Cuda(format!("{what}: {e:?}"))
}

/// Sets attribute `attr` of the matmul descriptor `desc` to `value` (`what` names it in errors).
///
/// # Safety
/// `desc` must be live and `T` the attribute's type (int32: operations, scale modes; int8: fast
/// accumulation; a u64 device address: scale pointers).
unsafe fn set_desc<T: Copy>(
    desc: lt_sys::cublasLtMatmulDesc_t,
    attr: lt_sys::cublasLtMatmulDescAttributes_t,
    value: T,
    what: &str,
) -> Result<(), GpuError> {
    // SAFETY: as the caller promises; the value is read during the call.
    unsafe {
        lt::set_matmul_desc_attribute(
            desc,
            attr,
            &value as *const T as *const c_void,
            std::mem::size_of::<T>(),
        )
    }
    .map_err(|e| lt_err(&format!("cublasLtMatmulDescSetAttribute ({what})"), e))
}

/// One cuBLASLt handle, the shared workspace and the plan cache.
pub(crate) struct Lt {
    // Field order is drop order: the plans before the handle.
    cache: RefCell<PlanCache<Plan>>,
    handle: lt_sys::cublasLtHandle_t,
    workspace: u64,
    workspace_bytes: usize,
    /// `CUBLASLT_MATMUL_DESC_FAST_ACCUM` for fp8 plans.
    fp8_fast_accum: bool,
}

// SAFETY: the handle and descriptors are host-side objects that cuBLASLt allows to be used from
// any thread, one at a time; `Lt` lives inside the `Gpu`, which is not `Sync` (and neither is
// `Lt`, through its `RefCell`), so at most one thread uses them at a time; the GPU work they
// enqueue goes to the stream passed in, with the context bound by the caller.
unsafe impl Send for Lt {}

/// What [`Lt::gemm`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum LtOutcome {
    /// The product was enqueued on cuBLASLt.
    Ran,
    /// cuBLASLt declined the shape (remembered, beyond the cap, or while capturing): the
    /// caller runs it on GemmEx.
    UseGemmEx,
}

impl Lt {
    /// Creates the handle when libcublasLt is present (never panics: a missing library gives
    /// `None`, and the products run on GemmEx). `workspace` (device address, `workspace_bytes`
    /// long) must outlive the returned value; it may be shared with the cuBLAS handle because
    /// both enqueue on the one stream, so their kernels never overlap.
    pub fn new(workspace: u64, workspace_bytes: usize) -> Option<Self> {
        // SAFETY: only tries to open the shared library.
        if !unsafe { lt_sys::is_culib_present() } {
            tracing::info!("libcublasLt not found; matrix products run on cublasGemmEx");
            return None;
        }
        match lt::create_handle() {
            Ok(handle) => Some(Lt {
                cache: RefCell::new(PlanCache::new(MAX_PLANS)),
                handle,
                workspace,
                workspace_bytes,
                fp8_fast_accum: super::device::env_switch("SWITCHYARD_CUDA_FP8_FAST_ACCUM", true),
            }),
            Err(e) => {
                tracing::warn!(error = ?e, "cublasLtCreate failed; matrix products run on cublasGemmEx");
                None
            }
        }
    }

    /// Number of cached shapes.
    pub fn cached(&self) -> usize {
        self.cache.borrow().len()
    }

    /// `C[n, m] = A[n, k] · W[m, k]^T + beta C` (see the module doc) on `stream`, if cuBLASLt
    /// takes the shape. `capturing` is asked only on a cache miss.
    pub fn gemm(
        &self,
        stream: lt_sys::cudaStream_t,
        capturing: impl Fn() -> bool,
        p: &Product,
    ) -> Result<LtOutcome, GpuError> {
        let key = PlanKey::new(p);
        let mut cache = self.cache.borrow_mut();
        if cache.get(&key).is_none() {
            if !cache.has_room() {
                if key.fp8.is_none() {
                    return Ok(LtOutcome::UseGemmEx);
                }
                // fp8 has no GemmEx to fall back on: plan this call alone (the descriptors are
                // destroyed after the call, which copies what it needs).
                let plan = self.plan(&key).map_err(|e| {
                    GpuError::Cuda(format!(
                        "no cuBLASLt fp8 algorithm for {} x {} x {}: {e}",
                        key.m, key.n, key.k
                    ))
                })?;
                drop(cache);
                return self.run(stream, &capturing, p, &key, &plan);
            }
            match self.plan(&key) {
                Ok(p) => {
                    tracing::debug!(?key, cached = cache.len() + 1, "cuBLASLt plan");
                    cache.insert_plan(key, p);
                    if !cache.has_room() {
                        tracing::info!(
                            cap = MAX_PLANS,
                            "cuBLASLt plan cache full; new shapes run on cublasGemmEx"
                        );
                    }
                }
                Err(e) if key.fp8.is_some() => {
                    // No fallback to take: say why.
                    return Err(GpuError::Cuda(format!(
                        "no cuBLASLt fp8 algorithm for {} x {} x {}: {e}",
                        key.m, key.n, key.k
                    )));
                }
                Err(e) => {
                    let capturing = capturing();
                    tracing::debug!(
                        ?key,
                        error = %e,
                        capturing,
                        "no cuBLASLt algorithm (or its setup failed) for this shape; it runs on cublasGemmEx"
                    );
                    cache.mark_gemm_ex(key, capturing);
                    return Ok(LtOutcome::UseGemmEx);
                }
            }
        }
        let plan = match cache.get(&key) {
            Some(Slot::Lt(p)) => p,
            Some(Slot::GemmEx) | None => return Ok(LtOutcome::UseGemmEx),
        };
        let outcome = self.run(stream, &capturing, p, &key, plan);
        if outcome.as_ref().is_ok_and(|o| *o == LtOutcome::UseGemmEx) && key.fp8.is_none() {
            cache.mark_gemm_ex(key, capturing());
        }
        outcome
    }

    /// Enqueues `p` with `plan` (the plan of `key`); `UseGemmEx` when cuBLASLt fails it (an
    /// error for fp8 products, which have no fallback).
    fn run(
        &self,
        stream: lt_sys::cudaStream_t,
        capturing: &dyn Fn() -> bool,
        p: &Product,
        key: &PlanKey,
        plan: &Plan,
    ) -> Result<LtOutcome, GpuError> {
        let Product { w, a, c, beta, .. } = *p;
        if let Some(s) = p.fp8 {
            type Attr = lt_sys::cublasLtMatmulDescAttributes_t;
            for (attr, ptr) in [
                (Attr::CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, s.w),
                (Attr::CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, s.a),
            ] {
                // SAFETY: `desc` is live; the attribute is a device pointer (8 bytes) to the f32
                // scales the caller keeps alive until the product has run.
                unsafe { set_desc(plan.desc, attr, ptr, "fp8 scale")? };
            }
        }
        let alpha = 1.0f32;
        // SAFETY: the descriptors describe the buffers the caller passes (live device memory of
        // the stated shapes, at least as aligned as the key says); the workspace is live and
        // `workspace_bytes` long; alpha and beta are host scalars read during the call.
        let r = unsafe {
            lt::matmul(
                self.handle,
                plan.desc,
                &alpha as *const f32 as *const c_void,
                &beta as *const f32 as *const c_void,
                w as *const c_void,
                plan.w,
                a as *const c_void,
                plan.a,
                c as *const c_void,
                plan.c,
                c as *mut c_void,
                plan.c,
                &plan.algo,
                self.workspace as *mut c_void,
                self.workspace_bytes,
                stream,
            )
        };
        match r {
            Ok(()) => Ok(LtOutcome::Ran),
            Err(e) if key.fp8.is_some() => Err(lt_err("cublasLtMatmul (fp8)", e)),
            Err(e) => {
                tracing::warn!(
                    ?key,
                    error = ?e,
                    capturing = capturing(),
                    "cublasLtMatmul failed; this shape runs on cublasGemmEx"
                );
                Ok(LtOutcome::UseGemmEx)
            }
        }
    }

    /// Whether the heuristic has algorithms for the fp8 `products` (m, k, f32 output,
    /// accumulate) with `scaling` at each step size of `ns` (256-byte aligned operands, as the
    /// backend's buffers are); host-only, nothing runs, nothing is cached.
    pub fn fp8_supported(
        &self,
        scaling: Fp8Scaling,
        products: &[(usize, usize, bool, bool)],
        ns: &[usize],
    ) -> Result<(), GpuError> {
        for &(m, k, c_f32, accumulate) in products {
            for &n in ns {
                self.plan(&PlanKey {
                    m,
                    n,
                    k,
                    c_f32,
                    accumulate,
                    fp8: Some(scaling),
                    align_log2: [8, 8, 8],
                })
                .map_err(|e| GpuError::Cuda(format!("fp8 {m} x {n} x {k}: {e}")))?;
            }
        }
        Ok(())
    }

    /// Creates the descriptors of `key` and asks the heuristic for its best algorithm (host-only
    /// calls: allowed while the stream captures).
    fn plan(&self, key: &PlanKey) -> Result<Plan, GpuError> {
        let d = |v: usize| v as u64;
        let ld =
            |v: usize| i64::try_from(v).map_err(|_| GpuError::Internal(format!("GEMM size {v}")));
        let c_type = if key.c_f32 {
            lt_sys::cudaDataType::CUDA_R_32F
        } else {
            lt_sys::cudaDataType::CUDA_R_16BF
        };
        let mut p = Plan {
            desc: std::ptr::null_mut(),
            w: std::ptr::null_mut(),
            a: std::ptr::null_mut(),
            c: std::ptr::null_mut(),
            algo: lt_sys::cublasLtMatmulAlgo_t { data: [0; 8] },
        };
        // Each descriptor goes into `p` as soon as it exists, so an error frees what was made.
        p.desc = lt::create_matmul_desc(
            lt_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            lt_sys::cudaDataType::CUDA_R_32F,
        )
        .map_err(|e| lt_err("cublasLtMatmulDescCreate", e))?;
        for (attr, op) in [
            (
                lt_sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSA,
                cublasOperation_t::CUBLAS_OP_T,
            ),
            (
                lt_sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSB,
                cublasOperation_t::CUBLAS_OP_N,
            ),
        ] {
            // SAFETY: `desc` is live; the attribute is an int32 (cublasOperation_t).
            unsafe { set_desc(p.desc, attr, op as i32, "operation")? };
        }
        if let Some(scaling) = key.fp8 {
            type Attr = lt_sys::cublasLtMatmulDescAttributes_t;
            type Mode = lt_sys::cublasLtMatmulMatrixScale_t;
            let fast = i8::from(self.fp8_fast_accum);
            let outer = Mode::CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F as i32;
            // Placeholder scale addresses (any aligned device address) for the heuristic, which
            // may check them; each call sets the real ones.
            let placeholder = self.workspace;
            // SAFETY: `desc` is live; fast accumulation is an int8, the scale modes int32, the
            // scale pointers 8-byte device addresses.
            unsafe {
                for attr in [
                    Attr::CUBLASLT_MATMUL_DESC_A_SCALE_POINTER,
                    Attr::CUBLASLT_MATMUL_DESC_B_SCALE_POINTER,
                ] {
                    set_desc(p.desc, attr, placeholder, "scale pointer")?;
                }
                set_desc(
                    p.desc,
                    Attr::CUBLASLT_MATMUL_DESC_FAST_ACCUM,
                    fast,
                    "fast accumulation",
                )?;
                // Scalar scales are the default (and older cuBLASLt builds have no scale-mode
                // attribute at all): only outer-vector scaling is set.
                if scaling == Fp8Scaling::Row {
                    for attr in [
                        Attr::CUBLASLT_MATMUL_DESC_A_SCALE_MODE,
                        Attr::CUBLASLT_MATMUL_DESC_B_SCALE_MODE,
                    ] {
                        set_desc(p.desc, attr, outer, "scale mode")?;
                    }
                }
            }
        }
        let in_type = if key.fp8.is_some() {
            lt_sys::cudaDataType::CUDA_R_8F_E4M3
        } else {
            lt_sys::cudaDataType::CUDA_R_16BF
        };
        p.w = lt::create_matrix_layout(in_type, d(key.k), d(key.m), ld(key.k)?)
            .map_err(|e| lt_err("cublasLtMatrixLayoutCreate", e))?;
        p.a = lt::create_matrix_layout(in_type, d(key.k), d(key.n), ld(key.k)?)
            .map_err(|e| lt_err("cublasLtMatrixLayoutCreate", e))?;
        p.c = lt::create_matrix_layout(c_type, d(key.m), d(key.n), ld(key.m)?)
            .map_err(|e| lt_err("cublasLtMatrixLayoutCreate", e))?;

        let pref = Pref(
            lt::create_matmul_pref().map_err(|e| lt_err("cublasLtMatmulPreferenceCreate", e))?,
        );
        let ws = self.workspace_bytes as u64;
        type PrefAttr = lt_sys::cublasLtMatmulPreferenceAttributes_t;
        // SAFETY: `pref` is live; the workspace limit is a uint64, the alignments uint32.
        unsafe {
            lt::set_matmul_pref_attribute(
                pref.0,
                PrefAttr::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                &ws as *const u64 as *const c_void,
                std::mem::size_of::<u64>(),
            )
            .map_err(|e| lt_err("cublasLtMatmulPreferenceSetAttribute", e))?;
            for (attr, align) in [
                (
                    PrefAttr::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES,
                    key.align_bytes(0),
                ),
                (
                    PrefAttr::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                    key.align_bytes(1),
                ),
                (
                    PrefAttr::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES,
                    key.align_bytes(2),
                ),
                (
                    PrefAttr::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES,
                    key.align_bytes(2),
                ),
            ] {
                lt::set_matmul_pref_attribute(
                    pref.0,
                    attr,
                    &align as *const u32 as *const c_void,
                    std::mem::size_of::<u32>(),
                )
                .map_err(|e| lt_err("cublasLtMatmulPreferenceSetAttribute", e))?;
            }
        }
        // SAFETY: every descriptor is live; the heuristic only reads them (host-only).
        let h = unsafe {
            lt::get_matmul_algo_heuristic(self.handle, p.desc, p.w, p.a, p.c, p.c, pref.0)
        }
        .map_err(|e| lt_err("cublasLtMatmulAlgoGetHeuristic", e))?;
        if h.workspaceSize > self.workspace_bytes {
            return Err(GpuError::Cuda(format!(
                "cuBLASLt algorithm wants {} bytes of workspace",
                h.workspaceSize
            )));
        }
        p.algo = h.algo;
        Ok(p)
    }
}

impl Drop for Lt {
    fn drop(&mut self) {
        // The plans first (their descriptors belong to no handle, but keep the order plain).
        self.cache.get_mut().map.clear();
        if !self.handle.is_null() {
            // SAFETY: created by `create_handle`, destroyed once.
            let _ = unsafe { lt::destroy_handle(self.handle) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[allow(clippy::too_many_arguments)]
    fn product(
        m: usize,
        n: usize,
        k: usize,
        c_f32: bool,
        beta: f32,
        w: u64,
        a: u64,
        c: u64,
    ) -> PlanKey {
        PlanKey::new(&Product {
            w,
            a,
            c,
            m,
            n,
            k,
            beta,
            c_f32,
            fp8: None,
        })
    }

    fn key(n: usize) -> PlanKey {
        product(4096, n, 4096, true, 0.0, 0x1000, 0x2000, 0x3000)
    }

    #[test]
    fn key_separates_what_changes_the_plan() {
        const W: u64 = 0x7f00_0000;
        const A: u64 = 0x7f10_0000;
        const C: u64 = 0x7f20_0000;
        let key = |m, n, k, c_f32, beta, c| product(m, n, k, c_f32, beta, W, A, c);
        let base = key(6144, 7, 4096, true, 0.0, C);
        assert_eq!(base.align_log2, [8, 8, 8]);
        assert!(!base.accumulate);
        // beta only matters as zero / nonzero.
        let acc = key(6144, 7, 4096, true, 1.0, C);
        assert_eq!(acc, key(6144, 7, 4096, true, 0.5, C));
        assert!(acc.accumulate);
        assert_ne!(base, acc);
        // fp8 operands (whatever their scales' addresses).
        let fp8 = |w_scale: u64| {
            PlanKey::new(&Product {
                fp8: Some(super::super::device::Fp8Scales {
                    w: w_scale,
                    a: 0x10,
                    scaling: Fp8Scaling::Row,
                }),
                w: W,
                a: A,
                c: C,
                m: 6144,
                n: 7,
                k: 4096,
                beta: 0.0,
                c_f32: true,
            })
        };
        assert!(fp8(0x100).fp8.is_some() && base.fp8.is_none());
        assert_ne!(base, fp8(0x100));
        assert_eq!(fp8(0x100), fp8(0x200));
        // Output type and every dimension.
        assert_ne!(base, key(6144, 7, 4096, false, 0.0, C));
        assert_ne!(base, key(6144, 8, 4096, true, 0.0, C));
        assert_ne!(base, key(4096, 7, 6144, true, 0.0, C));
        // Each operand's alignment.
        let offset_c = key(6144, 7, 4096, true, 0.0, C + 0x10);
        assert_eq!(offset_c.align_log2, [8, 8, 4]);
        assert_eq!(offset_c.align_bytes(2), 16);
        assert_ne!(base, offset_c);
        let offset_a = product(6144, 7, 4096, true, 0.0, W, A + 2, C);
        assert_eq!(offset_a.align_log2, [8, 1, 8]);
        // Alignment is capped at 256 bytes, so any two 256-aligned buffers share the plan.
        assert_eq!(
            base,
            product(6144, 7, 4096, true, 0.0, 0x100, A + 0x100, C + 0x1000)
        );
    }

    #[test]
    fn alignment_is_the_largest_power_of_two_up_to_256() {
        assert_eq!(align_log2(0), 8);
        assert_eq!(align_log2(1), 0);
        assert_eq!(align_log2(2), 1);
        assert_eq!(align_log2(0x7f00_0006), 1);
        assert_eq!(align_log2(0x40), 6);
        assert_eq!(align_log2(0x100), 8);
        assert_eq!(align_log2(1 << 40), 8);
    }

    #[test]
    fn cache_is_capped_and_evicts_nothing() {
        let mut c: PlanCache<usize> = PlanCache::new(3);
        assert!(c.insert_plan(key(1), 1));
        assert!(c.mark_gemm_ex(key(2), false));
        assert!(c.insert_plan(key(3), 3));
        assert!(!c.has_room());
        // Full: a new shape is neither planned nor remembered; the old ones stay.
        assert!(!c.insert_plan(key(4), 4));
        assert!(!c.mark_gemm_ex(key(4), false));
        assert!(c.get(&key(4)).is_none());
        assert_eq!(c.len(), 3);
        assert!(matches!(c.get(&key(1)), Some(Slot::Lt(1))));
        assert!(matches!(c.get(&key(2)), Some(Slot::GemmEx)));
        // An existing entry may still change (a plan that failed at launch becomes GemmEx).
        assert!(c.mark_gemm_ex(key(3), false));
        assert!(matches!(c.get(&key(3)), Some(Slot::GemmEx)));
        assert_eq!(c.len(), 3);
    }

    #[test]
    fn failures_while_capturing_are_not_remembered() {
        let mut c: PlanCache<usize> = PlanCache::new(8);
        assert!(!c.mark_gemm_ex(key(1), true));
        assert!(c.get(&key(1)).is_none());
        // A plan made during capture is kept like any other.
        assert!(c.insert_plan(key(1), 1));
        assert!(!c.mark_gemm_ex(key(1), true));
        assert!(matches!(c.get(&key(1)), Some(Slot::Lt(1))));
        assert!(c.mark_gemm_ex(key(1), false));
        assert!(matches!(c.get(&key(1)), Some(Slot::GemmEx)));
    }
}
