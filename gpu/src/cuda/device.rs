//! The CUDA device: library checks that never panic, the context and its one stream, cuBLAS,
//! the kernels of `gpu/kernels/llama.cu` compiled by NVRTC for the device's architecture and
//! cached on disk, device memory that frees itself, and raw kernel launches.
//!
//! cudarc loads libcuda, libnvrtc and libcublas at run time (`dynamic-loading`), so a binary
//! built on a machine without CUDA runs on one with it; a missing library would panic inside
//! cudarc, so [`probe`] checks for each before anything touches them.

use std::ffi::c_void;
use std::path::PathBuf;
use std::sync::Arc;

use cudarc::cublas::{result as blas_result, sys as blas_sys, CudaBlas};
use cudarc::driver::{result as drv, sys, CudaContext, CudaFunction, CudaModule, CudaStream};
use cudarc::nvrtc::{CompileOptions, Ptx};
use sha2::{Digest, Sha256};

use crate::error::GpuError;

/// The CUDA C source of every kernel.
const KERNELS: &str = include_str!("../../kernels/llama.cu");

/// Wraps any CUDA-side error.
pub(crate) fn cuda_err(what: &str, e: impl std::fmt::Debug) -> GpuError {
    GpuError::Cuda(format!("{what}: {e:?}"))
}

/// What [`probe`] found.
#[derive(Clone, Debug)]
pub struct DeviceInfo {
    /// The GPU's name.
    pub name: String,
    /// Compute capability (major, minor).
    pub compute_capability: (i32, i32),
    /// Total device memory in bytes.
    pub total_memory: usize,
}

/// Whether a CUDA GPU and the libraries the backend needs (driver, NVRTC, cuBLAS) are present;
/// never panics. Returns why not as the error.
pub fn probe() -> Result<DeviceInfo, GpuError> {
    // SAFETY: each check only tries to open the shared library with libloading.
    let (cuda, nvrtc, cublas) = unsafe {
        (
            sys::is_culib_present(),
            cudarc::nvrtc::sys::is_culib_present(),
            blas_sys::is_culib_present(),
        )
    };
    let missing: Vec<&str> = [
        (cuda, "libcuda (the NVIDIA driver)"),
        (nvrtc, "libnvrtc"),
        (cublas, "libcublas"),
    ]
    .iter()
    .filter(|(present, _)| !present)
    .map(|(_, n)| *n)
    .collect();
    if !missing.is_empty() {
        return Err(GpuError::Cuda(format!("not found: {}", missing.join(", "))));
    }
    let count = CudaContext::device_count().map_err(|e| cuda_err("cuDeviceGetCount", e))?;
    if count < 1 {
        return Err(GpuError::Cuda("no CUDA device".into()));
    }
    let ctx = CudaContext::new(0).map_err(|e| cuda_err("creating a context", e))?;
    Ok(DeviceInfo {
        name: ctx.name().map_err(|e| cuda_err("device name", e))?,
        compute_capability: ctx
            .compute_capability()
            .map_err(|e| cuda_err("compute capability", e))?,
        total_memory: ctx.total_mem().map_err(|e| cuda_err("total memory", e))?,
    })
}

/// Device memory that frees itself.
pub(crate) struct DevMem {
    ptr: u64,
    bytes: usize,
    ctx: Arc<CudaContext>,
}

impl DevMem {
    /// The device address.
    pub(crate) fn ptr(&self) -> u64 {
        self.ptr
    }

    /// The address `offset` bytes in (checked against the size).
    pub(crate) fn at(&self, offset: usize) -> Result<u64, GpuError> {
        if offset > self.bytes {
            return Err(GpuError::Internal(format!(
                "offset {offset} past a {}-byte buffer",
                self.bytes
            )));
        }
        Ok(self.ptr + offset as u64)
    }

    /// Size in bytes.
    pub(crate) fn bytes(&self) -> usize {
        self.bytes
    }
}

impl Drop for DevMem {
    fn drop(&mut self) {
        if self.ptr != 0 && self.ctx.bind_to_thread().is_ok() {
            // SAFETY: `ptr` came from cuMemAlloc in this context and is freed once.
            let _ = unsafe { drv::free_sync(self.ptr) };
        }
    }
}

/// One kernel argument.
#[derive(Copy, Clone, Debug)]
pub(crate) enum Arg {
    /// A device address (or 0 for null).
    Ptr(u64),
    /// A 32-bit integer.
    I32(i32),
    /// A 64-bit unsigned integer.
    U64(u64),
    /// A float.
    F32(f32),
}

/// The kernels, by name.
pub(crate) struct Kernels {
    pub init_uniform_bf16: CudaFunction,
    pub fill_f32: CudaFunction,
    pub embed: CudaFunction,
    pub rms_norm: CudaFunction,
    pub rope_store_kv: CudaFunction,
    pub silu_mul: CudaFunction,
    pub attention_64: CudaFunction,
    pub attention_128: CudaFunction,
    pub attention_combine: CudaFunction,
    pub apply_logit_edits: CudaFunction,
    pub sample_rows: CudaFunction,
    _module: Arc<CudaModule>,
}

/// Time per kernel class, measured with CUDA events around each launch (each one waited for,
/// like `CUDA_LAUNCH_BLOCKING=1`): a breakdown of where a step's time goes, not a speed.
#[derive(Default)]
pub(crate) struct Profile {
    /// Milliseconds and launches by kernel class.
    pub totals: std::collections::BTreeMap<&'static str, (f64, u64)>,
}

/// The context, its stream, cuBLAS and the kernels.
pub(crate) struct Gpu {
    /// Per-kernel timing, when `SWITCHYARD_CUDA_PROFILE` is set.
    pub prof: Option<std::cell::RefCell<Profile>>,
    pub ctx: Arc<CudaContext>,
    pub stream: Arc<CudaStream>,
    pub blas: CudaBlas,
    pub k: Kernels,
    pub info: DeviceInfo,
    /// cuBLAS workspace (set explicitly so that GEMMs can be captured in CUDA graphs).
    _workspace: DevMem,
}

/// Bytes of cuBLAS workspace (Hopper wants 32 MiB for its best kernels).
const CUBLAS_WORKSPACE: usize = 32 << 20;

impl Gpu {
    /// Opens device `ordinal` (after [`probe`] succeeded) and compiles or loads the kernels.
    pub fn open(ordinal: usize) -> Result<Self, GpuError> {
        let info = probe()?;
        let ctx = CudaContext::new(ordinal).map_err(|e| cuda_err("creating a context", e))?;
        // One stream, ordered by us: cudarc's per-buffer event tracking is not needed.
        // SAFETY: every launch and copy of this backend goes to `stream`, in order.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx
            .new_stream()
            .map_err(|e| cuda_err("creating a stream", e))?;
        let blas = CudaBlas::new(stream.clone()).map_err(|e| cuda_err("cublasCreate", e))?;
        let workspace = alloc(&ctx, CUBLAS_WORKSPACE)?;
        // SAFETY: the workspace outlives the handle (both are fields of `Gpu`; the handle is
        // destroyed first because fields drop in declaration order).
        unsafe {
            blas_sys::cublasSetWorkspace_v2(
                *blas.handle(),
                workspace.ptr() as *mut c_void,
                CUBLAS_WORKSPACE,
            )
            .result()
            .map_err(|e| cuda_err("cublasSetWorkspace", e))?;
        }
        let module = load_kernels(&ctx, info.compute_capability)?;
        let f = |name: &str| {
            module
                .load_function(name)
                .map_err(|e| cuda_err(&format!("kernel {name}"), e))
        };
        let k = Kernels {
            init_uniform_bf16: f("init_uniform_bf16")?,
            fill_f32: f("fill_f32")?,
            embed: f("embed")?,
            rms_norm: f("rms_norm")?,
            rope_store_kv: f("rope_store_kv")?,
            silu_mul: f("silu_mul")?,
            attention_64: f("attention_64")?,
            attention_128: f("attention_128")?,
            attention_combine: f("attention_combine")?,
            apply_logit_edits: f("apply_logit_edits")?,
            sample_rows: f("sample_rows")?,
            _module: module,
        };
        let prof = std::env::var_os("SWITCHYARD_CUDA_PROFILE")
            .map(|_| std::cell::RefCell::new(Profile::default()));
        Ok(Gpu {
            prof,
            ctx,
            stream,
            blas,
            k,
            info,
            _workspace: workspace,
        })
    }

    /// Runs `f` (which enqueues work); with profiling on, times it with events and waits.
    pub fn timed(
        &self,
        name: &'static str,
        f: impl FnOnce() -> Result<(), GpuError>,
    ) -> Result<(), GpuError> {
        let Some(prof) = &self.prof else {
            return f();
        };
        let ev = || {
            self.ctx
                .new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))
                .map_err(|e| cuda_err("event", e))
        };
        let (start, end) = (ev()?, ev()?);
        start
            .record(&self.stream)
            .map_err(|e| cuda_err("event record", e))?;
        f()?;
        end.record(&self.stream)
            .map_err(|e| cuda_err("event record", e))?;
        let ms = start
            .elapsed_ms(&end)
            .map_err(|e| cuda_err("event time", e))?;
        let mut p = prof.borrow_mut();
        let e = p.totals.entry(name).or_insert((0.0, 0));
        e.0 += f64::from(ms);
        e.1 += 1;
        Ok(())
    }

    /// The profile as text lines, largest first.
    pub fn profile_report(&self) -> Option<String> {
        let p = self.prof.as_ref()?.borrow();
        let total: f64 = p.totals.values().map(|v| v.0).sum();
        let mut rows: Vec<_> = p.totals.iter().collect();
        rows.sort_by(|a, b| b.1 .0.total_cmp(&a.1 .0));
        let mut out = format!("CUDA kernel time by class (total {total:.1} ms):\n");
        for (name, (ms, n)) in rows {
            out.push_str(&format!(
                "  {name:<22} {ms:>10.2} ms {:>5.1}% {n:>8} launches {:>9.1} us each\n",
                100.0 * ms / total.max(1e-9),
                1000.0 * ms / (*n).max(1) as f64
            ));
        }
        Some(out)
    }

    /// Makes the context current on the calling thread (the backend may move between threads).
    pub fn bind(&self) -> Result<(), GpuError> {
        self.ctx
            .bind_to_thread()
            .map_err(|e| cuda_err("binding the context", e))
    }

    /// Allocates `bytes` of device memory.
    pub fn alloc(&self, bytes: usize) -> Result<DevMem, GpuError> {
        alloc(&self.ctx, bytes)
    }

    /// Free and total device memory.
    pub fn mem_info(&self) -> Result<(usize, usize), GpuError> {
        self.ctx
            .mem_get_info()
            .map_err(|e| cuda_err("cuMemGetInfo", e))
    }

    /// Launches `f` on the stream.
    pub fn launch(
        &self,
        f: &CudaFunction,
        grid: (u32, u32, u32),
        block: u32,
        args: &[Arg],
    ) -> Result<(), GpuError> {
        if grid.0 == 0 || grid.1 == 0 || grid.2 == 0 {
            return Ok(());
        }
        let mut vals: Vec<[u8; 8]> = args
            .iter()
            .map(|a| {
                let mut b = [0u8; 8];
                match *a {
                    Arg::Ptr(p) | Arg::U64(p) => b.copy_from_slice(&p.to_ne_bytes()),
                    Arg::I32(v) => b[..4].copy_from_slice(&v.to_ne_bytes()),
                    Arg::F32(v) => b[..4].copy_from_slice(&v.to_ne_bytes()),
                }
                b
            })
            .collect();
        let mut params: Vec<*mut c_void> = vals
            .iter_mut()
            .map(|v| v.as_mut_ptr() as *mut c_void)
            .collect();
        // SAFETY: the argument list matches the kernel's signature (each call site passes the
        // parameters of the kernel it names); every pointer is a live device allocation.
        unsafe {
            drv::launch_kernel(
                f.cu_function(),
                grid,
                (block, 1, 1),
                0,
                self.stream.cu_stream(),
                &mut params,
            )
        }
        .map_err(|e| cuda_err("kernel launch", e))
    }

    /// Copies `src` to device address `dst` (asynchronous on the stream; `src` must stay alive
    /// and unchanged until the stream is synchronised).
    pub fn upload<T: Copy>(&self, dst: u64, src: &[T]) -> Result<(), GpuError> {
        if src.is_empty() {
            return Ok(());
        }
        // SAFETY: the caller sized `dst` for `src`.
        unsafe { drv::memcpy_htod_async(dst, src, self.stream.cu_stream()) }
            .map_err(|e| cuda_err("copy to the device", e))
    }

    /// Copies from device address `src` into `dst` and waits for it.
    pub fn download<T: Copy>(&self, dst: &mut [T], src: u64) -> Result<(), GpuError> {
        if dst.is_empty() {
            return Ok(());
        }
        // SAFETY: `src` holds at least `dst.len()` values of `T`.
        unsafe { drv::memcpy_dtoh_async(dst, src, self.stream.cu_stream()) }
            .map_err(|e| cuda_err("copy from the device", e))?;
        self.sync()
    }

    /// Waits for the stream.
    pub fn sync(&self) -> Result<(), GpuError> {
        self.stream
            .synchronize()
            .map_err(|e| cuda_err("stream synchronise", e))
    }

    /// `C[n, m] (ldc) = alpha * A[n, k] · W[m, k]^T + beta * C`, row-major, A and W bf16,
    /// C bf16 or f32 (`c_f32`), accumulation in f32.
    #[allow(clippy::too_many_arguments)]
    pub fn gemm(
        &self,
        w: u64,
        a: u64,
        c: u64,
        m: usize,
        n: usize,
        k: usize,
        beta: f32,
        c_f32: bool,
    ) -> Result<(), GpuError> {
        if m == 0 || n == 0 {
            return Ok(());
        }
        let dim =
            |v: usize| i32::try_from(v).map_err(|_| GpuError::Internal(format!("GEMM size {v}")));
        let (mi, ni, ki) = (dim(m)?, dim(n)?, dim(k)?);
        let alpha = 1.0f32;
        let c_type = if c_f32 {
            blas_sys::cudaDataType::CUDA_R_32F
        } else {
            blas_sys::cudaDataType::CUDA_R_16BF
        };
        // Column-major view: C^T (m x n) = W (k x m)^T · A^T (k x n).
        // SAFETY: the pointers are live device buffers of the stated shapes.
        unsafe {
            blas_result::gemm_ex(
                *self.blas.handle(),
                blas_sys::cublasOperation_t::CUBLAS_OP_T,
                blas_sys::cublasOperation_t::CUBLAS_OP_N,
                mi,
                ni,
                ki,
                &alpha as *const f32 as *const c_void,
                w as *const c_void,
                blas_sys::cudaDataType::CUDA_R_16BF,
                ki,
                a as *const c_void,
                blas_sys::cudaDataType::CUDA_R_16BF,
                ki,
                &beta as *const f32 as *const c_void,
                c as *mut c_void,
                c_type,
                mi,
                blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                blas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(|e| cuda_err("cublasGemmEx", e))
    }
}

fn alloc(ctx: &Arc<CudaContext>, bytes: usize) -> Result<DevMem, GpuError> {
    ctx.bind_to_thread()
        .map_err(|e| cuda_err("binding the context", e))?;
    // SAFETY: a plain allocation; freed by DevMem's Drop.
    let ptr = unsafe { drv::malloc_sync(bytes.max(16)) }
        .map_err(|e| cuda_err(&format!("allocating {bytes} bytes"), e))?;
    Ok(DevMem {
        ptr,
        bytes,
        ctx: ctx.clone(),
    })
}

/// NVRTC's include directory for `cuda_bf16.h`: `$CUDA_HOME/include`, else
/// `/usr/local/cuda/include`.
fn cuda_include_dir() -> PathBuf {
    std::env::var_os("CUDA_HOME")
        .or_else(|| std::env::var_os("CUDA_PATH"))
        .map(|h| PathBuf::from(h).join("include"))
        .unwrap_or_else(|| PathBuf::from("/usr/local/cuda/include"))
}

/// Where compiled kernels are cached: `$SWITCHYARD_KERNEL_CACHE`, else
/// `~/.cache/switchyard/kernels`.
fn cache_dir() -> Option<PathBuf> {
    if let Some(d) = std::env::var_os("SWITCHYARD_KERNEL_CACHE") {
        return Some(PathBuf::from(d));
    }
    std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/switchyard/kernels"))
}

/// NVRTC options for an architecture.
fn compile_options(arch: &str) -> Vec<String> {
    vec![
        format!("--gpu-architecture={arch}"),
        format!("--include-path={}", cuda_include_dir().display()),
        "--std=c++17".into(),
        "-lineinfo".into(),
    ]
}

/// Compiles the kernels to PTX for `cc` (or reads them from the disk cache, keyed by a hash of
/// source, options and architecture) and loads the module.
fn load_kernels(ctx: &Arc<CudaContext>, cc: (i32, i32)) -> Result<Arc<CudaModule>, GpuError> {
    let ptx = compile_ptx(cc)?;
    ctx.load_module(Ptx::from_src(ptx))
        .map_err(|e| cuda_err("loading the kernel module", e))
}

/// The PTX of the kernels for compute capability `cc`, compiled or from the cache.
pub fn compile_ptx(cc: (i32, i32)) -> Result<String, GpuError> {
    let arch = format!("sm_{}{}", cc.0, cc.1);
    let opts = compile_options(&arch);
    let mut h = Sha256::new();
    h.update(KERNELS.as_bytes());
    for o in &opts {
        h.update([0u8]);
        h.update(o.as_bytes());
    }
    let key: String = h.finalize()[..12]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    let cached = cache_dir().map(|d| d.join(format!("llama-{arch}-{key}.ptx")));
    if let Some(p) = &cached {
        if let Ok(text) = std::fs::read_to_string(p) {
            if text.contains(".entry sample_rows") {
                tracing::debug!(path = %p.display(), "kernels from the cache");
                return Ok(text);
            }
        }
    }
    let started = std::time::Instant::now();
    // SAFETY: only opens the library.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return Err(GpuError::Cuda("libnvrtc not found".into()));
    }
    let options = CompileOptions {
        options: opts,
        name: Some("llama.cu".into()),
        ..CompileOptions::default()
    };
    let ptx = cudarc::nvrtc::compile_ptx_with_opts(KERNELS, options)
        .map_err(|e| GpuError::Cuda(format!("NVRTC failed to compile the kernels: {e}")))?
        .to_src();
    tracing::info!(
        arch,
        ms = started.elapsed().as_millis() as u64,
        "kernels compiled by NVRTC"
    );
    if let Some(p) = &cached {
        // A cache that cannot be written only costs a recompilation next time.
        if let Some(dir) = p.parent() {
            let _ = std::fs::create_dir_all(dir);
        }
        let tmp = p.with_extension(format!("tmp{}", std::process::id()));
        if std::fs::write(&tmp, &ptx).is_ok() {
            let _ = std::fs::rename(&tmp, p);
        }
    }
    Ok(ptx)
}
