//! mference-cuda: the CUDA backend of the op layer (`docs/ARCHITECTURE.md`, issue 11's first
//! slice): every op of [`mference_backend::Backend`] as a kernel or a composition of kernels,
//! correct first, on one device and one stream.
//!
//! - Kernels: the `.cu` sources of `kernels/` (one translation unit), compiled at startup by
//!   NVRTC into a cubin for the device's compute capability and cached on disk (`compile.rs`).
//!   Only the driver (`libcuda`) and NVRTC (`libnvrtc`) are needed at run time, both loaded
//!   dynamically: the crate builds and its tests run on a machine without CUDA.
//! - Buffers: the resident bytes (`model_weights.bin`) are copied to the device once, and
//!   [`QRef`] / [`VRef`] offsets index that copy, so [`Weights::Resident`] reads no host data.
//!   With [`CudaBackend::with_expert_cache`], routed experts live in GPU slots (`experts.rs`:
//!   `--gpu-expert-budget`, LFU as on the CPU, misses copied in from the page-locked host slots
//!   on a copy stream ordered by events); without it, a [`Weights::Blob`] is copied to a device
//!   staging buffer on every call.
//! - Quantized products: `qmatmul` (kernels/quant.cu, a warp per output row) for decode and
//!   short products, `qgemm` (kernels/gemm.cu, `gemm.rs`: a tiled GEMM) from 16 rows of x on;
//!   the prefill experts a layer's GPU slots hold run together ([`CoreOps::glu_mlp_experts`]).
//! - Activations are [`CudaTensor`]s (`CudaSlice<f32>` + shape), the KV cache a [`CudaKv`]
//!   (device K and V, FP16 or FP32, ring or linear, indexed as `mference_runtime::KvLayer`),
//!   recurrent state a [`CudaState`].
//! - Device → host copies happen only in `read`, `all_finite`, `head_argmax` and `route`.

mod compile;
mod experts;

pub use compile::default_cache_dir;
pub use experts::{auto_margin, ExpertCacheOptions, ExpertGeometry, GpuExpertBudget};

use std::collections::{BTreeMap, HashMap};
use std::mem::ManuallyDrop;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use cudarc::driver::{
    CudaContext, CudaFunction, CudaModule, CudaSlice, CudaStream, DevicePtr, DriverError,
    LaunchConfig, PushKernelArg,
};
use cudarc::nvrtc::Ptx;
use experts::{CacheError, GpuExperts};
use mference_backend::cpu::ResidentBytes;
use mference_backend::{
    check, check_forced, check_glu_rows, check_mlp, Act, AttnShape, CoreOps, DeepSeekV4Ops,
    DeltaShape, DeviceExpertOps, DeviceExpertStats, InklingOps, KvDtype, KvState, Mlp, Norm, Op,
    OpError, OpResult, PreNorm, QRef, RecurrentOps, Rope, RopeStyle, RouterSpec, Routes, Scoring,
    Tensor, Unary, VRef, Weights,
};

/// Why the CUDA backend could not start. Each names what is missing and what to do.
#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    /// `libcuda.so` could not be loaded.
    #[error(
        "no CUDA driver: libcuda.so could not be loaded (install the NVIDIA driver, or run on the CPU)"
    )]
    NoDriver,
    /// `libnvrtc.so` could not be loaded.
    #[error(
        "no NVRTC: libnvrtc.so could not be loaded; it ships with the CUDA toolkit (for example in \
         /usr/local/cuda/targets/x86_64-linux/lib or /usr/local/cuda/lib64): add that folder to \
         LD_LIBRARY_PATH"
    )]
    NoNvrtc,
    /// The ordinal names no device.
    #[error("no CUDA device {ordinal}: the driver sees {count} device(s)")]
    NoDevice { ordinal: usize, count: usize },
    /// A driver call failed.
    #[error("CUDA driver: {what}: {err}")]
    Driver {
        what: &'static str,
        err: DriverError,
    },
    /// NVRTC failed (its log is included).
    #[error("NVRTC could not compile the kernels for {arch}: {log}")]
    Compile { arch: String, log: String },
}

impl CudaError {
    /// Whether CUDA is simply not there (no driver, no NVRTC, no device), as opposed to failing:
    /// `--device auto` then runs on the CPU.
    pub fn is_unavailable(&self) -> bool {
        matches!(
            self,
            Self::NoDriver | Self::NoNvrtc | Self::NoDevice { count: 0, .. }
        )
    }
}

fn driver(what: &'static str) -> impl FnOnce(DriverError) -> CudaError {
    move |err| CudaError::Driver { what, err }
}

/// Activations `[rows, cols]` f32 in device memory, row-major.
pub struct CudaTensor {
    buf: ManuallyDrop<CudaSlice<f32>>,
    rows: usize,
    cols: usize,
    /// Where the buffer goes when the tensor is dropped.
    reuse: Arc<Reuse>,
}

impl Drop for CudaTensor {
    fn drop(&mut self) {
        // SAFETY: `buf` is taken once, here, and never used again.
        let buf = unsafe { ManuallyDrop::take(&mut self.buf) };
        self.reuse.put(buf);
    }
}

/// Activation buffers given back by dropped tensors, kept by length for the next op that asks
/// for one of that length (decode asks for the same shapes every token): an op then costs one
/// driver call, its launch, instead of an allocation, a launch and a free. Every tensor lives
/// on the one compute stream, so a buffer handed out again while queued kernels still use it
/// is only touched by kernels queued after them.
#[derive(Default)]
struct Reuse(Mutex<ReuseInner>);

#[derive(Default)]
struct ReuseInner {
    free: HashMap<usize, Vec<CudaSlice<f32>>>,
    bytes: usize,
}

/// Bytes of freed activations kept for reuse; beyond it buffers go back to the driver's pool.
const REUSE_BYTES: usize = 256 << 20;

impl Reuse {
    fn take(&self, len: usize) -> Option<CudaSlice<f32>> {
        let mut r = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let buf = r.free.get_mut(&len)?.pop()?;
        r.bytes -= 4 * len;
        Some(buf)
    }

    fn put(&self, buf: CudaSlice<f32>) {
        let len = buf.len();
        let mut r = self.0.lock().unwrap_or_else(|e| e.into_inner());
        if len == 0 || r.bytes + 4 * len > REUSE_BYTES {
            return; // dropped: freed in stream order
        }
        r.bytes += 4 * len;
        r.free.entry(len).or_default().push(buf);
    }
}

impl Tensor for CudaTensor {
    fn rows(&self) -> usize {
        self.rows
    }
    fn cols(&self) -> usize {
        self.cols
    }
}

impl CudaTensor {
    fn len(&self) -> usize {
        self.rows * self.cols
    }
}

/// K or V rows on the device.
enum Store {
    F16(CudaSlice<u16>),
    F32(CudaSlice<f32>),
}

/// One attention layer's K and V on the device: `rows` rows of `[n_kv_heads, head_dim]`,
/// position `p` in row `p % rows` of a ring (sliding window) or row `p` of a linear layer.
pub struct CudaKv {
    rows: usize,
    ring: bool,
    n_kv_heads: usize,
    head_dim: usize,
    k: Store,
    v: Store,
}

impl CudaKv {
    fn width(&self) -> usize {
        self.n_kv_heads * self.head_dim
    }
}

impl KvState for CudaKv {
    fn rows(&self) -> usize {
        self.rows
    }
    fn is_ring(&self) -> bool {
        self.ring
    }
    fn bytes(&self) -> usize {
        let elem = match self.k {
            Store::F16(_) => 2,
            Store::F32(_) => 4,
        };
        2 * self.rows * self.width() * elem
    }
}

/// A recurrent f32 state on the device. `clone` is a device-to-device copy (it panics only if
/// the device fails the copy, as `Clone` cannot return an error).
#[derive(Clone)]
pub struct CudaState {
    buf: CudaSlice<f32>,
}

/// Every kernel of `kernels/`, loaded at startup (a missing one fails [`CudaBackend::new`]).
const KERNELS: [&str; 46] = [
    "all_finite",
    "matmul_bf16",
    "gather_rows",
    "split_part",
    "unary",
    "mul_cols",
    "mul_sigmoid",
    "mul_silu",
    "mul_rows_sigmoid",
    "add_scaled",
    "scatter_add",
    "glu_act",
    "rms_norm",
    "rms_norm_add",
    "rms_norm_rope",
    "rms_norm_add_pre",
    "qmatmul",
    "qmv2",
    "qmv4",
    "qmv8",
    "qmv_ids2",
    "qmv_ids4",
    "qmv_ids8",
    "qmv_glu2",
    "qmv_glu4",
    "qmv_glu8",
    "qmv_glu_ids2",
    "qmv_glu_ids4",
    "qmv_glu_ids8",
    "qgemm",
    "qgemm_sum",
    "qembed",
    "argmax",
    "argmax_parts",
    "rope",
    "kv_write_f16",
    "kv_write_f32",
    "attention_f16",
    "attention_f32",
    "attention_merge",
    "conv1d_silu",
    "delta_gates",
    "gated_delta_rule",
    "route",
    "route_one",
    "combine_ids",
];

/// Where the kernels came from at startup.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum KernelOrigin {
    /// Loaded from this cache entry.
    Cached(PathBuf),
    /// Compiled by NVRTC, then written to this entry (`None`: no cache directory, or the write
    /// failed).
    Compiled(Option<PathBuf>),
}

/// `qmatmul` (kernels/quant.cu): output rows per block (a warp each), products per launch, rows
/// of x per pass over a weight row.
const QM_ROWS: usize = 8;
const QM_JOBS: usize = 32;
const QM_TT: usize = 4;
/// `qmv2/4/8` (kernels/qmv.cu): warps per block.
const QV_WARPS: usize = 4;
/// Blocks a `qmatmul` launch aims for before it splits the rows of x over more of them (two per
/// SM of an H200).
const QM_BLOCKS: usize = 264;
/// (row, weight) pairs per `scatter_add` launch (`SCATTER_PAIRS` in kernels/elementwise.cu).
const SCATTER_PAIRS: usize = 64;
/// The attention kernel keeps 16 dimensions of a head per lane: `head_dim <= 32 * 16`.
const ATTN_MAX_HEAD_DIM: usize = 512;
/// Warps per block of the attention kernel (`ATTN_WARPS` in kernels/attention.cu).
const ATTN_WARPS: u32 = 16;
/// Attention launches with fewer (row, head) items than this (decode) split the visible
/// positions over blocks of about `ATTN_SPLIT_POSITIONS` each, at most `ATTN_MAX_SPLITS`.
const ATTN_SPLIT_BELOW_ITEMS: usize = 132;
const ATTN_SPLIT_POSITIONS: usize = 64;
const ATTN_MAX_SPLITS: usize = 16;
/// Most experts per token the router kernel keeps per row.
const ROUTE_MAX_K: usize = 64;
/// Small constant vectors kept on the device (RoPE frequencies, attention sinks).
const CONSTS_KEPT: usize = 64;

/// The `QJobs` argument of `qmatmul`: device addresses of each product's codes, scales, biases,
/// input rows and output rows.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct QJobs {
    w: [u64; QM_JOBS],
    s: [u64; QM_JOBS],
    b: [u64; QM_JOBS],
    x: [u64; QM_JOBS],
    y: [u64; QM_JOBS],
}

// SAFETY: plain `repr(C)` u64 arrays, laid out as `struct QJobs` in kernels/quant.cu.
unsafe impl cudarc::driver::DeviceRepr for QJobs {}

/// The `QIdJobs` argument of `qmv_ids`: byte offsets of up to two matrices in an expert
/// blob, and per product the input and output rows, the place of its expert among the device-side
/// ids and which matrix it multiplies.
#[repr(C)]
#[derive(Clone, Copy)]
struct QIdJobs {
    w_off: [u64; 2],
    s_off: [u64; 2],
    b_off: [u64; 2],
    x: [u64; QM_JOBS],
    y: [u64; QM_JOBS],
    pick: [i32; QM_JOBS],
    mat: [i32; QM_JOBS],
}

// SAFETY: plain `repr(C)` arrays of u64 and i32, laid out as `struct QIdJobs` in kernels/qmv.cu.
unsafe impl cudarc::driver::DeviceRepr for QIdJobs {}

/// The `ForcedIds` argument of `route_one`.
#[repr(C)]
#[derive(Clone, Copy)]
struct ForcedIds {
    ids: [u32; ROUTE_MAX_K],
}

// SAFETY: a plain `repr(C)` u32 array, laid out as `struct ForcedIds` in kernels/router.cu.
unsafe impl cudarc::driver::DeviceRepr for ForcedIds {}

/// Pre-norms one `rms_norm_add_pre` launch writes (kernels/elementwise.cu `PRE_NORMS`).
const PRE_NORMS: usize = 4;

/// The `PreNorms` argument of `rms_norm_add_pre`: per pre-norm its output's device address, its
/// norm's weight offset, mode and constant, and its column scale (offset, constant, whether).
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct PreNorms {
    out: [u64; PRE_NORMS],
    w_off: [u64; PRE_NORMS],
    col_off: [u64; PRE_NORMS],
    c: [f32; PRE_NORMS],
    col_c: [f32; PRE_NORMS],
    mode: [i32; PRE_NORMS],
    has_col: [i32; PRE_NORMS],
    n: i32,
}

// SAFETY: plain `repr(C)` arrays of u64, f32 and i32 and an i32, laid out as `struct PreNorms` in
// kernels/elementwise.cu.
unsafe impl cudarc::driver::DeviceRepr for PreNorms {}

/// The `Pairs` argument of `scatter_add`.
#[repr(C)]
#[derive(Clone, Copy)]
struct Pairs {
    rows: [u32; SCATTER_PAIRS],
    w: [f32; SCATTER_PAIRS],
}

// SAFETY: plain `repr(C)` arrays of u32 and f32, laid out as `struct Pairs` in the kernel.
unsafe impl cudarc::driver::DeviceRepr for Pairs {}

/// One product of a `qmatmul` launch: matrix `w` in the bytes at device address `buf` (`len` of
/// them valid), the rows of x at device address `x`, the output rows at `y`.
#[derive(Clone, Copy)]
struct QJob<'a> {
    w: &'a QRef,
    buf: u64,
    len: usize,
    x: u64,
    y: u64,
}

/// Where the bytes of a launch's sources are ([`CudaBackend::sources`]).
struct Sources<'a> {
    /// Device address and valid length of each source, in order.
    at: Vec<(u64, usize)>,
    /// `(layer, slot)` of each held source.
    held: Vec<(usize, usize)>,
    /// The expert cache, locked until the held slots' reads are recorded.
    cache: Option<std::sync::MutexGuard<'a, GpuExperts>>,
}

/// A small host vector (by its bit patterns) and its device copy.
type Constant = (Vec<u32>, Arc<CudaSlice<f32>>);

/// The CUDA backend: one device, one stream, the resident bytes in device memory.
pub struct CudaBackend {
    stream: Arc<CudaStream>,
    _module: Arc<CudaModule>,
    funcs: HashMap<&'static str, CudaFunction>,
    resident: CudaSlice<u8>,
    /// An expert blob's device copy (grown to the largest blob seen).
    staging: Mutex<Option<CudaSlice<u8>>>,
    /// Host constants already uploaded, by their bit patterns.
    consts: Mutex<Vec<Constant>>,
    /// The GPU expert slots ([`CudaBackend::with_expert_cache`]).
    experts: Option<Mutex<GpuExperts>>,
    name: String,
    origin: KernelOrigin,
    /// Launches and their time per (op, kernel), with `MFERENCE_CUDA_PROFILE` set: `host` times
    /// only the host's side of each launch (and each readback's wait); any other value
    /// synchronizes every launch before and after, timing the device (slow; for finding where
    /// the time goes).
    profile: Option<(bool, Mutex<Profile>)>,
    /// Freed activation buffers kept for reuse.
    reuse: Arc<Reuse>,
}

/// (op, kernel) → (launches, time from launch to its end).
type Profile = BTreeMap<(&'static str, &'static str), (u64, std::time::Duration)>;

/// Launches kernel `$k` for op `$op` with `$cfg` and the arguments (references to locals or
/// device buffers, in the order of the kernel's parameters); an empty grid launches nothing.
macro_rules! launch {
    ($be:expr, $op:expr, $k:expr, $cfg:expr, $($arg:expr),+ $(,)?) => {{
        let cfg: LaunchConfig = $cfg;
        if cfg.grid_dim.0 == 0 || cfg.grid_dim.1 == 0 {
            Ok(())
        } else {
            let kernel: &'static str = $k;
            let t0 = $be.profile_start();
            let mut b = $be.stream.launch_builder(&$be.funcs[kernel]);
            $( b.arg($arg); )+
            // SAFETY: the arguments follow the kernel's parameter list in kernels/*.cu (device
            // buffers, or their `u64` addresses, as pointers; `i32` as int, `u64` as u64, `f32`
            // as float; `QJobs` / `Pairs` by value), and the op checked that every buffer holds
            // what the launch's shape reads or writes.
            let r = unsafe { b.launch(cfg) }.map(|_| ()).map_err(|e| $be.dev($op, e));
            $be.profile_end($op, kernel, t0);
            r
        }
    }};
}

// After `launch!`, which it uses.
mod gemm;

/// A 1-D grid of 256-thread blocks over `n` elements (kernels loop if the grid is capped).
fn elems(n: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (n.div_ceil(256).min(1 << 20) as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Lanes per output row of a `qmv` launch: 32, or fewer (down to 4) for short rows, so that a lane
/// has at least 4 of the row's 8-byte words.
fn qmv_lanes(cols: usize, bits: usize) -> usize {
    let words = cols * bits / 64;
    let mut lanes = 32;
    while lanes > 4 && words < 4 * lanes {
        lanes /= 2;
    }
    lanes
}

/// The `QJobs` argument for up to `QM_JOBS` products.
fn qjobs<'a, 'b: 'a>(
    op: &'static str,
    jobs: impl Iterator<Item = &'a QJob<'b>>,
) -> OpResult<QJobs> {
    let mut a = QJobs {
        w: [0; QM_JOBS],
        s: [0; QM_JOBS],
        b: [0; QM_JOBS],
        x: [0; QM_JOBS],
        y: [0; QM_JOBS],
    };
    for (i, j) in jobs.enumerate().take(QM_JOBS) {
        let [wo, so, bo] = qref_offsets(op, j.w, j.len)?;
        (a.w[i], a.s[i], a.b[i]) = (j.buf + wo, j.buf + so, j.buf + bo);
        (a.x[i], a.y[i]) = (j.x, j.y);
    }
    Ok(a)
}

/// Whether a gate and an up matrix (codes at device addresses `gate_at`, `up_at`) can share a
/// `qmv_glu` lane group: one shape, and the same alignment modulo 8 (so a lane's words hold the
/// same columns of both).
fn pairs_fuse(gate: &QRef, up: &QRef, gate_at: u64, up_at: u64) -> bool {
    (gate.rows, gate.cols, gate.bits, gate.group_size) == (up.rows, up.cols, up.bits, up.group_size)
        && gate_at % 8 == up_at % 8
}

/// The shapes the quantized product kernels take: 2/4/8 bits, a multiple of 32 columns, groups
/// a power of two.
fn check_qshape(op: &'static str, w: &QRef) -> OpResult<()> {
    let (cols, bits, group) = (w.cols, w.bits, w.group_size);
    check(
        op,
        cols.is_multiple_of(32) && matches!(bits, 2 | 4 | 8) && group.is_power_of_two(),
        || {
            format!("a {bits}-bit matrix of {cols} columns in groups of {group} (2/4/8 bits, a multiple of 32 columns, groups a power of two)")
        },
    )
}

/// `glu_f`'s act code and limit (kernels/common.cuh).
fn act_code(act: Act) -> (i32, f32) {
    match act {
        Act::GeluTanh => (0, 0.0),
        Act::Silu => (1, 0.0),
        Act::SiluClamped(l) => (2, l),
    }
}

/// The grid of a `qmv` launch over `jobs` products (`nm = 1`) or gated pairs (`nm = 2`) of
/// `rows` rows, `lanes` lanes per row.
fn qmv_grid(rows: usize, lanes: usize, jobs: usize, nm: usize) -> LaunchConfig {
    let rows_per_block = QV_WARPS * 32 / lanes * (compile::qv_rows() / nm);
    LaunchConfig {
        grid_dim: (rows.div_ceil(rows_per_block) as u32, jobs as u32, 1),
        block_dim: (32 * QV_WARPS as u32, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Logits per block of `argmax_parts` (4 per thread; a 262,144-token vocabulary is 64 parts).
const ARGMAX_CHUNK: usize = 4096;

fn blocks(n: usize, threads: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (n as u32, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    }
}

fn same_shape(op: &'static str, a: &CudaTensor, b: &CudaTensor) -> OpResult<()> {
    check(op, a.rows == b.rows && a.cols == b.cols, || {
        format!("[{}, {}] vs [{}, {}]", a.rows, a.cols, b.rows, b.cols)
    })
}

impl CudaBackend {
    /// A backend on CUDA device `device_ordinal` holding a device copy of `resident` (the
    /// mapped `model_weights.bin`), kernels cached under [`default_cache_dir`].
    ///
    /// Errors: the driver or NVRTC library cannot be loaded, the ordinal names no device, a
    /// driver call fails (e.g. out of device memory), or NVRTC fails. Never falls back to the CPU.
    pub fn new(device_ordinal: usize, resident: ResidentBytes) -> Result<Self, CudaError> {
        Self::with_cache(device_ordinal, resident, default_cache_dir())
    }

    /// Whether CUDA device `device_ordinal` can be used, creating nothing: the driver library
    /// loads, the driver sees the device, NVRTC loads. Cheap: the load asks before it reads the
    /// weights, so what is missing is named at once.
    pub fn probe(device_ordinal: usize) -> Result<(), CudaError> {
        // SAFETY: the probes only open and close the candidate libraries (cudarc's loaders
        // would panic on a missing one instead of returning an error).
        if !unsafe { cudarc::driver::sys::is_culib_present() } {
            return Err(CudaError::NoDriver);
        }
        // A driver on a host without a GPU fails cuInit with CUDA_ERROR_NO_DEVICE: no device.
        let count = match CudaContext::device_count() {
            Err(DriverError(cudarc::driver::sys::CUresult::CUDA_ERROR_NO_DEVICE)) => 0,
            r => r.map_err(driver("cuInit / cuDeviceGetCount"))?,
        };
        if device_ordinal >= count.max(0) as usize {
            return Err(CudaError::NoDevice {
                ordinal: device_ordinal,
                count: count.max(0) as usize,
            });
        }
        // SAFETY: as above.
        if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
            return Err(CudaError::NoNvrtc);
        }
        Ok(())
    }

    /// [`CudaBackend::new`] with the kernel cache in `cache` (`None`: compile, keep nothing).
    pub fn with_cache(
        device_ordinal: usize,
        resident: ResidentBytes,
        cache: Option<PathBuf>,
    ) -> Result<Self, CudaError> {
        Self::probe(device_ordinal)?;
        let ctx = CudaContext::new(device_ordinal).map_err(driver("cuCtx (primary context)"))?;
        // SAFETY: every buffer of this backend is allocated, used and freed on its one stream,
        // in stream order, so the per-buffer events cudarc records for multi-stream use are
        // not needed.
        unsafe { ctx.disable_event_tracking() };
        keep_pool_memory(&ctx)?;
        let stream = ctx.new_stream().map_err(driver("cuStreamCreate"))?;
        let (major, minor) = ctx
            .compute_capability()
            .map_err(driver("compute capability"))?;
        let mut driver_version = 0;
        // SAFETY: one valid out-pointer; the driver library is loaded.
        unsafe { cudarc::driver::sys::cuDriverGetVersion(&mut driver_version) }
            .result()
            .map_err(driver("cuDriverGetVersion"))?;
        let target = compile::Target {
            arch: format!("sm_{major}{minor}"),
            nvrtc: compile::nvrtc_version()?,
            driver: driver_version,
        };
        let (module, origin) = load_kernels(&ctx, &target, cache)?;
        let mut funcs = HashMap::new();
        for k in KERNELS {
            let f = module
                .load_function(k)
                .map_err(driver("cuModuleGetFunction"))?;
            funcs.insert(k, f);
        }
        let resident = stream
            .clone_htod(&resident[..])
            .map_err(driver("copying the resident weights to the device"))?;
        stream
            .synchronize()
            .map_err(driver("cuStreamSynchronize"))?;
        let dev = ctx.name().unwrap_or_else(|_| "unknown device".into());
        Ok(Self {
            stream,
            _module: module,
            funcs,
            resident,
            staging: Mutex::new(None),
            consts: Mutex::new(Vec::new()),
            experts: None,
            name: format!("cuda:{device_ordinal} {dev} {}", target.arch),
            origin,
            profile: std::env::var_os("MFERENCE_CUDA_PROFILE")
                .map(|v| (v != "host", Mutex::new(BTreeMap::new()))),
            reuse: Arc::default(),
        })
    }

    /// Keeps routed experts in GPU slots (sized on the first MoE step from `opts.budget`), fed
    /// from the host streamer's slots on a copy stream of their own.
    ///
    /// Errors: the copy stream cannot be created.
    pub fn with_expert_cache(mut self, opts: ExpertCacheOptions) -> Result<Self, CudaError> {
        let cache = GpuExperts::new(self.stream.context(), opts)
            .map_err(driver("cuStreamCreate (expert copies)"))?;
        self.experts = Some(Mutex::new(cache));
        Ok(self)
    }

    fn cache_err(&self, op: &'static str, e: CacheError) -> OpError {
        let why = match e {
            CacheError::Driver(what, err) => format!("{what}: {err}"),
            CacheError::Refused(why) => why,
        };
        OpError::Device {
            backend: self.name.clone(),
            op,
            why,
        }
    }

    /// The expert cache, locked; `None` without one.
    fn cache(&self) -> Option<std::sync::MutexGuard<'_, GpuExperts>> {
        self.experts
            .as_ref()
            .map(|m| m.lock().unwrap_or_else(|e| e.into_inner()))
    }

    /// Where the kernels came from (cache entry or a fresh compile).
    pub fn kernel_origin(&self) -> &KernelOrigin {
        &self.origin
    }

    /// With profiling on: waits for the queued work, returns the start of the next launch.
    fn profile_start(&self) -> Option<std::time::Instant> {
        let (sync, _) = self.profile.as_ref()?;
        if *sync {
            let _ = self.stream.synchronize();
        }
        Some(std::time::Instant::now())
    }

    /// With profiling on: waits for the launch begun at `t0`, adds its time.
    fn profile_end(&self, op: &'static str, kernel: &'static str, t0: Option<std::time::Instant>) {
        let (Some((sync, p)), Some(t0)) = (&self.profile, t0) else {
            return;
        };
        if *sync {
            let _ = self.stream.synchronize();
        }
        let mut p = p.lock().unwrap_or_else(|e| e.into_inner());
        let e = p.entry((op, kernel)).or_default();
        e.0 += 1;
        e.1 += t0.elapsed();
    }

    fn dev(&self, op: &'static str, e: DriverError) -> OpError {
        OpError::Device {
            backend: self.name.clone(),
            op,
            why: e.to_string(),
        }
    }

    fn zeros_f32(&self, op: &'static str, n: usize) -> OpResult<CudaSlice<f32>> {
        self.stream.alloc_zeros(n).map_err(|e| self.dev(op, e))
    }

    /// A tensor over `buf`, given back to the reuse pool when dropped.
    fn wrap(&self, buf: CudaSlice<f32>, rows: usize, cols: usize) -> CudaTensor {
        CudaTensor {
            buf: ManuallyDrop::new(buf),
            rows,
            cols,
            reuse: Arc::clone(&self.reuse),
        }
    }

    /// A tensor the caller's kernel writes in full (no zeroing pass): a reused buffer of that
    /// length, else a fresh one.
    fn uninit_tensor(&self, op: &'static str, rows: usize, cols: usize) -> OpResult<CudaTensor> {
        let len = rows * cols;
        let buf = match self.reuse.take(len) {
            Some(b) => b,
            // SAFETY: the one kernel that writes it covers every element before anything
            // reads it (stream order).
            None => unsafe { self.stream.alloc::<f32>(len) }.map_err(|e| self.dev(op, e))?,
        };
        Ok(self.wrap(buf, rows, cols))
    }

    fn tensor(&self, op: &'static str, rows: usize, cols: usize) -> OpResult<CudaTensor> {
        let mut t = self.uninit_tensor(op, rows, cols)?;
        self.stream
            .memset_zeros(&mut *t.buf)
            .map_err(|e| self.dev(op, e))?;
        Ok(t)
    }

    fn to_device<T: cudarc::driver::DeviceRepr>(
        &self,
        op: &'static str,
        v: &[T],
    ) -> OpResult<CudaSlice<T>> {
        self.stream.clone_htod(v).map_err(|e| self.dev(op, e))
    }

    fn to_host<T: cudarc::driver::DeviceRepr + Default + Clone>(
        &self,
        op: &'static str,
        v: &CudaSlice<T>,
    ) -> OpResult<Vec<T>> {
        let t0 = self.profile.as_ref().map(|_| std::time::Instant::now());
        let out = self.stream.clone_dtoh(v).map_err(|e| self.dev(op, e))?;
        self.stream.synchronize().map_err(|e| self.dev(op, e))?;
        if let (Some((_, p)), Some(t0)) = (&self.profile, t0) {
            let mut p = p.lock().unwrap_or_else(|e| e.into_inner());
            let e = p.entry((op, "(readback)")).or_default();
            e.0 += 1;
            e.1 += t0.elapsed();
        }
        Ok(out)
    }

    /// A device copy of a small host constant, uploaded once per distinct value.
    fn constant(&self, op: &'static str, v: &[f32]) -> OpResult<Arc<CudaSlice<f32>>> {
        let key: Vec<u32> = v.iter().map(|x| x.to_bits()).collect();
        let mut kept = self.consts.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((_, s)) = kept.iter().find(|(k, _)| *k == key) {
            return Ok(s.clone());
        }
        let s = Arc::new(self.to_device(op, v)?);
        if kept.len() >= CONSTS_KEPT {
            // Frees in stream order: a queued kernel still reading it is unaffected.
            kept.remove(0);
        }
        kept.push((key, s.clone()));
        Ok(s)
    }

    /// The device address of a buffer (event tracking is off, so no guard is needed).
    fn addr<T>(&self, s: &CudaSlice<T>) -> u64 {
        let (p, _sync) = s.device_ptr(&self.stream);
        p
    }

    /// The kernel for `kv`'s dtype (`f16` or `f32`) and the device addresses of its K and V.
    fn kv_ptrs(
        &self,
        kv: &CudaKv,
        f16: &'static str,
        f32: &'static str,
    ) -> (&'static str, u64, u64) {
        match (&kv.k, &kv.v) {
            (Store::F16(k), Store::F16(v)) => (f16, self.addr(k), self.addr(v)),
            (Store::F32(k), Store::F32(v)) => (f32, self.addr(k), self.addr(v)),
            _ => unreachable!("new_kv gives K and V one dtype"),
        }
    }

    /// Checks a BF16 vector lies in the resident copy, 2-byte aligned; returns its offset.
    fn vref(&self, op: &'static str, w: &VRef, len: usize) -> OpResult<u64> {
        let off = w.offset();
        check(
            op,
            w.len == len && off.is_multiple_of(2) && off + 2 * len <= self.resident.len(),
            || {
                format!(
                    "a BF16 vector of {} at byte {off} for {len} values in {} resident bytes",
                    w.len,
                    self.resident.len()
                )
            },
        )?;
        Ok(off as u64)
    }

    /// Runs `f` on the device address and valid length of the bytes `src` names: the resident
    /// copy, a GPU expert slot, or the staging buffer after copying the blob into it.
    fn with_weights<R>(
        &self,
        op: &'static str,
        src: Weights,
        f: impl FnOnce(u64, usize) -> OpResult<R>,
    ) -> OpResult<R> {
        match src {
            Weights::Resident => f(self.addr(&self.resident), self.resident.len()),
            Weights::Held { layer, expert } => {
                let mut cache = self.cache();
                let (addr, len, slot) = self.held_addr(op, cache.as_deref(), layer, expert)?;
                let cache = cache.as_mut().expect("held_addr found the cache");
                let r = f(addr, len);
                cache
                    .after_read(&self.stream, layer, slot)
                    .map_err(|e| self.cache_err(op, e))?;
                r
            }
            Weights::Blob(b) => {
                let at = self.stage(op, &[b])?;
                f(at[0], b.len())
            }
        }
    }

    /// The device address, valid length and slot of expert `expert` of `layer` in `cache`, the
    /// compute stream made to wait for its copy (the caller calls `after_read` once the kernels
    /// reading it are queued).
    fn held_addr(
        &self,
        op: &'static str,
        cache: Option<&GpuExperts>,
        layer: usize,
        expert: usize,
    ) -> OpResult<(u64, usize, usize)> {
        let Some(c) = cache else {
            return Err(OpError::Shape {
                op,
                why: format!("expert {expert} of layer {layer}: no GPU expert cache"),
            });
        };
        let (addr, slot) = c
            .slot_addr(&self.stream, layer, expert)
            .map_err(|e| self.cache_err(op, e))?;
        Ok((addr, c.stride(), slot))
    }

    /// Where each source's bytes are: the resident copy, a GPU slot (the compute stream made to
    /// wait for its copy) or the staging buffer (the blobs staged together). The caller queues
    /// the kernels reading them, then calls [`CudaBackend::after_reads`].
    fn sources(&self, op: &'static str, srcs: &[Weights]) -> OpResult<Sources<'_>> {
        let blobs: Vec<&[u8]> = srcs
            .iter()
            .filter_map(|s| match s {
                Weights::Blob(b) => Some(*b),
                _ => None,
            })
            .collect();
        let staged = self.stage(op, &blobs)?;
        let mut staged = staged.iter().zip(&blobs);
        let cache = self.cache();
        let mut held = Vec::new();
        let mut at = Vec::with_capacity(srcs.len());
        for src in srcs {
            at.push(match *src {
                Weights::Resident => (self.addr(&self.resident), self.resident.len()),
                Weights::Blob(_) => {
                    let (&a, b) = staged.next().expect("one staged copy per blob");
                    (a, b.len())
                }
                Weights::Held { layer, expert } => {
                    let (a, len, slot) = self.held_addr(op, cache.as_deref(), layer, expert)?;
                    held.push((layer, slot));
                    (a, len)
                }
            });
        }
        Ok(Sources { at, held, cache })
    }

    /// Records the reads of the held slots of `src` after the kernels queued so far.
    fn after_reads(&self, op: &'static str, mut src: Sources) -> OpResult<()> {
        if let Some(c) = src.cache.as_mut() {
            for &(layer, slot) in &src.held {
                c.after_read(&self.stream, layer, slot)
                    .map_err(|e| self.cache_err(op, e))?;
            }
        }
        Ok(())
    }

    /// `y[T, w.rows] = x · wᵀ` from the bytes at device address `buf` (`len` of them valid).
    fn qmatmul(
        &self,
        op: &'static str,
        w: &QRef,
        buf: u64,
        len: usize,
        x: &CudaTensor,
    ) -> OpResult<CudaTensor> {
        check(op, w.cols == x.cols, || {
            format!("a [{}, {}] matrix for rows of {}", w.rows, w.cols, x.cols)
        })?;
        // Every element is written by the kernel: no zeroing pass.
        let y = self.uninit_tensor(op, x.rows, w.rows)?;
        let job = QJob {
            w,
            buf,
            len,
            x: self.addr(&*x.buf),
            y: self.addr(&*y.buf),
        };
        self.products(op, &[job], x.rows)?;
        Ok(y)
    }

    /// Runs `jobs` (each `[t_rows, cols]` rows of x into `[t_rows, rows]` outputs; the caller
    /// gives every job an input and an output of that size), one `qmatmul` launch per shape and
    /// at most `QM_JOBS` jobs; products of `gemm::min_rows()` or more rows run on `qgemm`
    /// instead where it takes the shape (`gemm.rs`).
    fn products(&self, op: &'static str, jobs: &[QJob], t_rows: usize) -> OpResult<()> {
        let rest;
        let jobs = if t_rows >= gemm::min_rows() {
            rest = self.gemm_products(op, jobs, t_rows)?;
            &rest[..]
        } else {
            jobs
        };
        let shape = |w: &QRef| (w.rows, w.cols, w.bits as usize, w.group_size);
        let mut shapes: Vec<(usize, usize, usize, usize)> =
            jobs.iter().map(|j| shape(j.w)).collect();
        shapes.sort_unstable();
        shapes.dedup();
        for sh in shapes {
            let (rows, cols, bits, group) = sh;
            let same: Vec<&QJob> = jobs.iter().filter(|j| shape(j.w) == sh).collect();
            // Rows of x start 16-byte aligned (the kernels read them as float2/float4).
            check_qshape(op, same[0].w)?;
            for chunk in same.chunks(QM_JOBS) {
                let a = qjobs(op, chunk.iter().copied())?;
                let (ri, ci, bi, gi) = (rows as i32, cols as i32, bits as i32, group as i32);
                if t_rows == 1 {
                    let lanes = qmv_lanes(cols, bits);
                    let li = lanes as i32;
                    launch!(
                        self,
                        op,
                        ["qmv2", "qmv4", "qmv8"][bits / 4],
                        qmv_grid(rows, lanes, chunk.len(), 1),
                        &a,
                        &ri,
                        &ci,
                        &gi,
                        &li
                    )?;
                    continue;
                }
                let blocks = rows.div_ceil(QM_ROWS);
                let tiles = t_rows.div_ceil(QM_TT).max(1);
                let z = QM_BLOCKS
                    .div_ceil(blocks * chunk.len())
                    .clamp(1, tiles.min(65535));
                let ti = t_rows as i32;
                launch!(
                    self,
                    op,
                    "qmatmul",
                    LaunchConfig {
                        grid_dim: (blocks as u32, chunk.len() as u32, z as u32),
                        block_dim: (32 * QM_ROWS as u32, 1, 1),
                        shared_mem_bytes: 0,
                    },
                    &a,
                    &ri,
                    &ci,
                    &bi,
                    &gi,
                    &ti
                )?;
            }
        }
        Ok(())
    }

    /// `g ← act(g) ⊙ u` over every element.
    /// `g ← act(x·gateᵀ) ⊙ (x·upᵀ)` for `jobs` = gate, up, gate, up, ... (each pair with one x;
    /// the gate job's output rows are in `g`, the up job's in `u`): for one row of x, when every
    /// pair fuses ([`pairs_fuse`]) and the pairs share one shape, one `qmv_glu` launch per 16
    /// pairs (the same sums, `u` unused); else the products, then `glu_act`.
    fn gated(
        &self,
        op: &'static str,
        act: Act,
        jobs: &[QJob],
        t_rows: usize,
        g: &mut CudaTensor,
        u: &CudaTensor,
    ) -> OpResult<()> {
        let shape = |w: &QRef| (w.rows, w.cols, w.bits, w.group_size);
        let mut codes = Vec::with_capacity(jobs.len());
        for j in jobs {
            codes.push(j.buf + qref_offsets(op, j.w, j.len)?[0]);
        }
        let fused = t_rows == 1
            && jobs.len().is_multiple_of(2)
            && jobs.iter().all(|j| shape(j.w) == shape(jobs[0].w))
            && jobs
                .chunks(2)
                .zip(codes.chunks(2))
                .all(|(p, c)| pairs_fuse(p[0].w, p[1].w, c[0], c[1]));
        if !fused {
            self.products(op, jobs, t_rows)?;
            return self.glu_act(op, act, g, u);
        }
        let w = jobs[0].w;
        check_qshape(op, w)?;
        let (rows, cols, bits) = (w.rows, w.cols, w.bits as usize);
        let lanes = qmv_lanes(cols, bits);
        let (code, limit) = act_code(act);
        let (ri, ci, gi, li) = (rows as i32, cols as i32, w.group_size as i32, lanes as i32);
        for chunk in jobs.chunks(QM_JOBS) {
            let a = qjobs(op, chunk.iter())?;
            launch!(
                self,
                op,
                ["qmv_glu2", "qmv_glu4", "qmv_glu8"][bits / 4],
                qmv_grid(rows, lanes, chunk.len() / 2, 2),
                &a,
                &ri,
                &ci,
                &gi,
                &li,
                &code,
                &limit
            )?;
        }
        Ok(())
    }

    fn glu_act(
        &self,
        op: &'static str,
        act: Act,
        g: &mut CudaTensor,
        u: &CudaTensor,
    ) -> OpResult<()> {
        let (code, limit) = act_code(act);
        let n = g.len() as u64;
        launch!(
            self,
            op,
            "glu_act",
            elems(g.len()),
            &mut *g.buf,
            &*u.buf,
            &n,
            &code,
            &limit
        )
    }

    /// Copies the blobs into the staging buffer, each at a 256-byte boundary (their alignment
    /// modulo 256 is that of a GPU slot); returns each one's device address.
    fn stage(&self, op: &'static str, blobs: &[&[u8]]) -> OpResult<Vec<u64>> {
        let at: Vec<usize> = blobs
            .iter()
            .scan(0usize, |end, b| {
                let o = *end;
                *end += b.len().div_ceil(256) * 256;
                Some(o)
            })
            .collect();
        let total = blobs
            .last()
            .map_or(0, |b| at[at.len() - 1] + b.len().div_ceil(256) * 256);
        let mut g = self.staging.lock().unwrap_or_else(|e| e.into_inner());
        if g.as_ref().is_none_or(|s| s.len() < total) {
            *g = None; // free the smaller buffer first
            *g = Some(
                self.stream
                    .alloc_zeros(total)
                    .map_err(|e| self.dev(op, e))?,
            );
        }
        let base = self.addr(g.as_ref().expect("allocated above"));
        for (b, &o) in blobs.iter().zip(&at) {
            // SAFETY: the destination lies in the staging buffer (`total` bytes checked above).
            // From pageable memory the copy is staged before this returns, and it is ordered
            // after every queued kernel that reads the previous contents.
            unsafe {
                cudarc::driver::result::memcpy_htod_async(
                    base + o as u64,
                    b,
                    self.stream.cu_stream(),
                )
            }
            .map_err(|e| self.dev(op, e))?;
        }
        Ok(at.iter().map(|&o| base + o as u64).collect())
    }

    /// The `route` / `route_one` kernels' scoring code, renormalisation flag and per-expert
    /// scale (offset, present) for `spec` over `n_exp` experts, after checking top-k and the
    /// forced ids of `rows` rows.
    fn route_args(
        &self,
        op: &'static str,
        spec: &RouterSpec,
        rows: usize,
        n_exp: usize,
    ) -> OpResult<(i32, i32, u64, i32)> {
        let k = spec.top_k;
        check(op, k > 0 && k <= n_exp && k <= ROUTE_MAX_K, || {
            format!("top-{k} of {n_exp} experts (at most {ROUTE_MAX_K})")
        })?;
        let pes = match spec.per_expert_scale {
            Some(p) => Some(self.vref(op, p, n_exp)?),
            None => None,
        };
        check_forced(op, spec, rows, n_exp)?;
        let (scoring, norm) = match spec.scoring {
            Scoring::SoftmaxOfTopK => (0i32, 0i32),
            Scoring::TopKOfSoftmax { norm_topk_prob } => (1, norm_topk_prob as i32),
            Scoring::SqrtSoftplus { .. } => return Err(self.missing("route (sqrt-softplus)")),
        };
        Ok((scoring, norm, pes.unwrap_or(0), pes.is_some() as i32))
    }

    /// One `qmv_ids` launch: `jobs` (matrix index 0/1 into `mats`, place among the ids at
    /// `ids`, input rows, output rows; one row of x each) over expert blobs of `stride` bytes
    /// whose addresses by expert id are at `slots`. The matrices share one shape. With `glu`, one
    /// `qmv_glu_ids` launch instead: each job's output row is act(gate row) ⊙ (up row) of `mats`
    /// = [gate, up] (which share their alignment modulo 8; the matrix index is unused).
    #[allow(clippy::too_many_arguments)]
    fn products_by_id(
        &self,
        op: &'static str,
        mats: &[&QRef],
        jobs: &[(usize, usize, u64, u64)],
        slots: u64,
        ids: u64,
        stride: usize,
        glu: Option<Act>,
    ) -> OpResult<()> {
        let w = mats[0];
        check(
            op,
            jobs.len() <= QM_JOBS
                && mats.len() <= 2
                && w.cols.is_multiple_of(32)
                && matches!(w.bits, 2 | 4 | 8)
                && w.group_size.is_power_of_two()
                && mats.iter().all(|m| {
                    (m.rows, m.cols, m.bits, m.group_size) == (w.rows, w.cols, w.bits, w.group_size)
                }),
            || {
                format!(
                    "{} products of {} matrices of one shape",
                    jobs.len(),
                    mats.len()
                )
            },
        )?;
        let mut a = QIdJobs {
            w_off: [0; 2],
            s_off: [0; 2],
            b_off: [0; 2],
            x: [0; QM_JOBS],
            y: [0; QM_JOBS],
            pick: [0; QM_JOBS],
            mat: [0; QM_JOBS],
        };
        for (i, m) in mats.iter().enumerate() {
            [a.w_off[i], a.s_off[i], a.b_off[i]] = qref_offsets(op, m, stride)?;
        }
        for (i, &(mat, pick, x, y)) in jobs.iter().enumerate() {
            a.mat[i] = mat as i32;
            a.pick[i] = pick as i32;
            a.x[i] = x;
            a.y[i] = y;
        }
        let lanes = qmv_lanes(w.cols, w.bits as usize);
        let (ri, ci, gi, li) = (
            w.rows as i32,
            w.cols as i32,
            w.group_size as i32,
            lanes as i32,
        );
        let bits = w.bits as usize / 4;
        match glu {
            None => launch!(
                self,
                op,
                ["qmv_ids2", "qmv_ids4", "qmv_ids8"][bits],
                qmv_grid(w.rows, lanes, jobs.len(), 1),
                &a,
                &slots,
                &ids,
                &ri,
                &ci,
                &gi,
                &li
            ),
            Some(act) => {
                let (code, limit) = act_code(act);
                launch!(
                    self,
                    op,
                    ["qmv_glu_ids2", "qmv_glu_ids4", "qmv_glu_ids8"][bits],
                    qmv_grid(w.rows, lanes, jobs.len(), 2),
                    &a,
                    &slots,
                    &ids,
                    &ri,
                    &ci,
                    &gi,
                    &li,
                    &code,
                    &limit
                )
            }
        }
    }

    /// The `rms_norm` kernels' mode, weight offset and constant for `norm` over `dim` values.
    fn norm_args(&self, op: &'static str, norm: Norm, dim: usize) -> OpResult<(i32, u64, f32)> {
        Ok(match norm {
            Norm::NoScale => (0, 0, 1.0),
            Norm::Weight(w) => (1, self.vref(op, w, dim)?, 1.0),
            Norm::OnePlusWeight(w) => (2, self.vref(op, w, dim)?, 1.0),
            Norm::Scaled(c) => (3, 0, c),
        })
    }

    /// RoPE's checks, and its kernel arguments (frequencies on the device, style code); `None`
    /// when nothing rotates.
    fn rope_args(
        &self,
        op: &'static str,
        x: &CudaTensor,
        rope: &Rope,
        head_dim: usize,
    ) -> OpResult<Option<(Arc<CudaSlice<f32>>, i32)>> {
        check(
            op,
            head_dim > 0
                && x.cols.is_multiple_of(head_dim)
                && rope.rotated <= head_dim
                && rope.inv_freq.len() == rope.rotated / 2,
            || {
                format!(
                    "heads of {head_dim} (rotating {}, {} frequencies) in rows of {}",
                    rope.rotated,
                    rope.inv_freq.len(),
                    x.cols
                )
            },
        )?;
        if rope.inv_freq.is_empty() {
            return Ok(None);
        }
        let style = match rope.style {
            RopeStyle::NeoX => 0i32,
            RopeStyle::Interleaved => 1,
        };
        Ok(Some((self.constant(op, &rope.inv_freq)?, style)))
    }

    /// RMSNorm of `src`'s pieces into `x` (`src = None`: in place); the shapes are equal.
    fn rms_norm_impl(
        &self,
        op: &'static str,
        src: Option<&CudaTensor>,
        x: &mut CudaTensor,
        dim: usize,
        norm: Norm,
        eps: f32,
    ) -> OpResult<()> {
        check(op, dim > 0 && x.cols.is_multiple_of(dim), || {
            format!("pieces of {dim} in rows of {}", x.cols)
        })?;
        let (mode, w_off, c) = self.norm_args(op, norm, dim)?;
        let d = dim as i32;
        let from = self.addr(&*src.unwrap_or(&*x).buf);
        launch!(
            self,
            op,
            "rms_norm",
            blocks(x.len() / dim, 256),
            &from,
            &mut *x.buf,
            &d,
            &mode,
            &self.resident,
            &w_off,
            &c,
            &eps
        )
    }
}

/// The byte offsets of a matrix's weights, scales and biases, checked to lie in a buffer of
/// `len` bytes at even offsets (the kernels read u16s).
fn qref_offsets(op: &'static str, w: &QRef, len: usize) -> OpResult<[u64; 3]> {
    let r = w.byte_ranges();
    check(
        op,
        r.iter().all(|&(o, l)| o.is_multiple_of(2) && o + l <= len),
        || format!("matrix ranges {r:?} do not lie 2-byte aligned in {len} bytes"),
    )?;
    Ok(r.map(|(o, _)| o as u64))
}

impl Drop for CudaBackend {
    /// Prints the profile (`MFERENCE_CUDA_PROFILE`) to stderr.
    fn drop(&mut self) {
        let Some((sync, p)) = self.profile.take() else {
            return;
        };
        let p = p.into_inner().unwrap_or_else(|e| e.into_inner());
        let total: f64 = p.values().map(|(_, d)| d.as_secs_f64()).sum();
        let how = if sync {
            "each launch synchronized"
        } else {
            "host side only"
        };
        eprintln!("cuda profile: {:.1} ms ({how})", 1e3 * total);
        let mut rows: Vec<_> = p.into_iter().collect();
        rows.sort_by_key(|r| std::cmp::Reverse(r.1 .1));
        for ((op, kernel), (n, d)) in rows {
            eprintln!(
                "  {op:<18} {kernel:<18} {n:>8} launches {:>10.2} ms {:>8.1} µs each",
                1e3 * d.as_secs_f64(),
                1e6 * d.as_secs_f64() / n as f64
            );
        }
    }
}

/// Makes the device's default memory pool keep freed memory instead of returning it to the
/// driver at every synchronization (its default threshold is 0): activations are allocated and
/// freed in stream order every op, and each layer synchronizes once for the router's readback.
fn keep_pool_memory(ctx: &Arc<CudaContext>) -> Result<(), CudaError> {
    use cudarc::driver::sys;
    let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
    let mut keep = u64::MAX;
    // SAFETY: valid out-pointers; the device handle belongs to the live context.
    unsafe {
        sys::cuDeviceGetDefaultMemPool(&mut pool, ctx.cu_device())
            .result()
            .map_err(driver("cuDeviceGetDefaultMemPool"))?;
        sys::cuMemPoolSetAttribute(
            pool,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            &mut keep as *mut u64 as *mut std::ffi::c_void,
        )
        .result()
        .map_err(driver("cuMemPoolSetAttribute (release threshold)"))
    }
}

/// Loads the kernel module: a valid cache entry, else a fresh NVRTC compile (written back).
fn load_kernels(
    ctx: &Arc<CudaContext>,
    target: &compile::Target,
    cache: Option<PathBuf>,
) -> Result<(Arc<CudaModule>, KernelOrigin), CudaError> {
    let src = compile::source();
    let entry = cache.map(|d| compile::entry_path(&d, &src, target));
    if let Some(path) = &entry {
        if let Some(image) = compile::read_entry(path) {
            // A checksummed entry the driver still refuses (e.g. written by a broken
            // compiler) is recompiled below.
            if let Ok(m) = ctx.load_module(Ptx::from_binary(image)) {
                return Ok((m, KernelOrigin::Cached(path.clone())));
            }
        }
    }
    let image = compile::compile_cubin(&src, &target.arch)?;
    let m = ctx
        .load_module(Ptx::from_binary(image.clone()))
        .map_err(driver("cuModuleLoadData (freshly compiled kernels)"))?;
    let written = entry.filter(|p| compile::write_entry(p, &image).is_ok());
    Ok((m, KernelOrigin::Compiled(written)))
}

impl CoreOps for CudaBackend {
    type Tensor = CudaTensor;

    type Kv = CudaKv;

    type State = CudaState;

    fn name(&self) -> String {
        self.name.clone()
    }

    /// What the kernels of `kernels/` cover: every core and recurrent op except `linear`,
    /// `set_rows`, DeepSeek-V4's router scoring and Inkling's `conv1d`; none of DeepSeek-V4's or
    /// Inkling's own ops yet.
    fn supports(op: Op) -> bool {
        !matches!(
            op,
            Op::Linear
                | Op::SetRows
                | Op::RouteSqrtSoftplus
                | Op::Conv1d
                | Op::RopeAt
                | Op::MatmulGrouped
                | Op::HcPre
                | Op::HcPost
                | Op::CompressPool
                | Op::AttentionSparse
                | Op::IndexTopK
                | Op::AttentionRel
                | Op::RouteSinks
        )
    }

    fn upload(&self, data: &[f32], cols: usize) -> OpResult<CudaTensor> {
        check(
            "upload",
            cols > 0 && data.len().is_multiple_of(cols),
            || format!("{} values do not fill rows of {cols}", data.len()),
        )?;
        let buf = self.to_device("upload", data)?;
        Ok(self.wrap(buf, data.len() / cols, cols))
    }

    fn zeros(&self, rows: usize, cols: usize) -> OpResult<CudaTensor> {
        check("zeros", cols > 0, || "zero columns".into())?;
        self.tensor("zeros", rows, cols)
    }

    fn copy(&self, x: &CudaTensor) -> OpResult<CudaTensor> {
        let mut y = self.uninit_tensor("copy", x.rows, x.cols)?;
        self.stream
            .memcpy_dtod(&*x.buf, &mut *y.buf)
            .map_err(|e| self.dev("copy", e))?;
        Ok(y)
    }

    fn read(&self, x: &CudaTensor) -> OpResult<Vec<f32>> {
        self.to_host("read", &*x.buf)
    }

    fn all_finite(&self, x: &CudaTensor) -> OpResult<bool> {
        let op = "all_finite";
        let mut flag = self
            .stream
            .alloc_zeros::<i32>(1)
            .map_err(|e| self.dev(op, e))?;
        let n = x.len() as u64;
        launch!(
            self,
            op,
            "all_finite",
            elems(x.len()),
            &*x.buf,
            &n,
            &mut flag
        )?;
        Ok(self.to_host(op, &flag)?[0] == 0)
    }

    fn gather_rows(&self, x: &CudaTensor, rows: &[usize]) -> OpResult<CudaTensor> {
        let op = "gather_rows";
        check(op, rows.iter().all(|&r| r < x.rows), || {
            format!("a row index is outside {} rows", x.rows)
        })?;
        let idx: Vec<u32> = rows.iter().map(|&r| r as u32).collect();
        let idx = self.to_device(op, &idx)?;
        let mut out = self.uninit_tensor(op, rows.len(), x.cols)?;
        let (cols, n) = (x.cols as u64, rows.len() as u64);
        launch!(
            self,
            op,
            "gather_rows",
            elems(out.len()),
            &*x.buf,
            &cols,
            &idx,
            &n,
            &mut *out.buf
        )?;
        Ok(out)
    }

    fn split(&self, x: &CudaTensor, group: usize, parts: &[usize]) -> OpResult<Vec<CudaTensor>> {
        let op = "split";
        check(
            op,
            group > 0 && parts.iter().sum::<usize>() == group && x.cols.is_multiple_of(group),
            || format!("parts {parts:?} of groups of {group} in rows of {}", x.cols),
        )?;
        let n_groups = (x.len() / group) as u64;
        let per_row = x.cols / group;
        let mut out = Vec::with_capacity(parts.len());
        let mut off = 0usize;
        for &p in parts {
            let mut t = self.uninit_tensor(op, x.rows, per_row * p)?;
            let (g, o, pp) = (group as i32, off as i32, p as i32);
            launch!(
                self,
                op,
                "split_part",
                elems(t.len()),
                &*x.buf,
                &n_groups,
                &g,
                &o,
                &pp,
                &mut *t.buf
            )?;
            out.push(t);
            off += p;
        }
        Ok(out)
    }

    fn embed(&self, table: &QRef, ids: &[u32], scale: Option<f32>) -> OpResult<CudaTensor> {
        let op = "embed";
        check(op, ids.iter().all(|&i| (i as usize) < table.rows), || {
            format!("a token id is outside the table's {} rows", table.rows)
        })?;
        let [wo, so, bo] = qref_offsets(op, table, self.resident.len())?;
        let d_ids = self.to_device(op, ids)?;
        let mut out = self.uninit_tensor(op, ids.len(), table.cols)?;
        let (cols, bits, group) = (
            table.cols as i32,
            table.bits as i32,
            table.group_size as i32,
        );
        let (n, s) = (ids.len() as u64, scale.unwrap_or(1.0));
        launch!(
            self,
            op,
            "qembed",
            elems(out.len()),
            &self.resident,
            &wo,
            &so,
            &bo,
            &cols,
            &bits,
            &group,
            &d_ids,
            &n,
            &s,
            &mut *out.buf
        )?;
        Ok(out)
    }

    fn matmul(&self, ws: &[&QRef], src: Weights, x: &CudaTensor) -> OpResult<Vec<CudaTensor>> {
        let op = "matmul";
        for w in ws {
            check(op, w.cols == x.cols, || {
                format!("a [{}, {}] matrix for rows of {}", w.rows, w.cols, x.cols)
            })?;
        }
        let ys = ws
            .iter()
            .map(|w| self.uninit_tensor(op, x.rows, w.rows))
            .collect::<OpResult<Vec<_>>>()?;
        self.with_weights(op, src, |buf, len| {
            let xa = self.addr(&*x.buf);
            let jobs: Vec<QJob> = ws
                .iter()
                .zip(&ys)
                .map(|(w, y)| QJob {
                    w,
                    buf,
                    len,
                    x: xa,
                    y: self.addr(&*y.buf),
                })
                .collect();
            self.products(op, &jobs, x.rows)
        })?;
        Ok(ys)
    }

    fn glu_mlp(&self, mlp: &Mlp, act: Act, src: Weights, x: &CudaTensor) -> OpResult<CudaTensor> {
        let op = "glu_mlp";
        check_mlp(op, mlp, x.cols)?;
        let mut g = self.uninit_tensor(op, x.rows, mlp.gate_proj.rows)?;
        let u = self.uninit_tensor(op, x.rows, mlp.up_proj.rows)?;
        let y = self.uninit_tensor(op, x.rows, mlp.down_proj.rows)?;
        self.with_weights(op, src, |buf, len| {
            let xa = self.addr(&*x.buf);
            let job = |w, x, y| QJob { w, buf, len, x, y };
            let pair = [
                job(&mlp.gate_proj, xa, self.addr(&*g.buf)),
                job(&mlp.up_proj, xa, self.addr(&*u.buf)),
            ];
            self.gated(op, act, &pair, x.rows, &mut g, &u)?;
            self.products(
                op,
                &[job(&mlp.down_proj, self.addr(&*g.buf), self.addr(&*y.buf))],
                x.rows,
            )
        })?;
        Ok(y)
    }

    fn glu_mlp_rows(
        &self,
        mlp: &Mlp,
        act: Act,
        srcs: &[Weights],
        x: &CudaTensor,
        out: &mut CudaTensor,
        rows: &[usize],
    ) -> OpResult<()> {
        let op = "glu_mlp_rows";
        check_glu_rows(op, mlp, srcs.len(), x, out, rows)?;
        let n = srcs.len();
        if n == 0 {
            return Ok(());
        }
        let src = self.sources(op, srcs)?;
        let at = &src.at;
        let (inner, h) = (mlp.gate_proj.rows, mlp.down_proj.rows);
        let mut g = self.uninit_tensor(op, n, inner)?;
        let u = self.uninit_tensor(op, n, inner)?;
        let (xa, ga, ua, oa) = (
            self.addr(&*x.buf),
            self.addr(&*g.buf),
            self.addr(&*u.buf),
            self.addr(&*out.buf),
        );
        let row = |base: u64, r: usize, width: usize| base + (4 * r * width) as u64;
        let job = |w, (buf, len): (u64, usize), x, y| QJob { w, buf, len, x, y };
        let mut gate_up = Vec::with_capacity(2 * n);
        for (j, &a) in at.iter().enumerate() {
            gate_up.push(job(&mlp.gate_proj, a, xa, row(ga, j, inner)));
            gate_up.push(job(&mlp.up_proj, a, xa, row(ua, j, inner)));
        }
        self.gated(op, act, &gate_up, 1, &mut g, &u)?;
        let down: Vec<QJob> = at
            .iter()
            .zip(rows)
            .enumerate()
            .map(|(j, (&a, &r))| job(&mlp.down_proj, a, row(ga, j, inner), row(oa, r, h)))
            .collect();
        self.products(op, &down, 1)?;
        self.after_reads(op, src)
    }

    fn glu_mlp_experts(
        &self,
        mlp: &Mlp,
        act: Act,
        srcs: &[Weights],
        xs: &[&CudaTensor],
    ) -> OpResult<Vec<CudaTensor>> {
        self.gemm_glu_experts(mlp, act, srcs, xs)
    }

    fn head_argmax(&self, w: &QRef, x: &CudaTensor) -> OpResult<(u32, f32)> {
        let op = "head_argmax";
        check(op, x.rows == 1 && x.cols == w.cols, || {
            format!(
                "expected one row of {}, got [{}, {}]",
                w.cols, x.rows, x.cols
            )
        })?;
        let logits = self.qmatmul(op, w, self.addr(&self.resident), self.resident.len(), x)?;
        let nparts = w.rows.div_ceil(ARGMAX_CHUNK).max(1);
        let mut parts = self
            .stream
            .alloc_zeros::<u32>(2 * nparts)
            .map_err(|e| self.dev(op, e))?;
        let mut out = self
            .stream
            .alloc_zeros::<u32>(2)
            .map_err(|e| self.dev(op, e))?;
        let (n, chunk) = (w.rows as i32, ARGMAX_CHUNK as i32);
        launch!(
            self,
            op,
            "argmax_parts",
            blocks(nparts, 1024),
            &*logits.buf,
            &n,
            &chunk,
            &mut parts
        )?;
        let np = nparts as i32;
        launch!(self, op, "argmax", blocks(1, 1024), &parts, &np, &mut out)?;
        let r = self.to_host(op, &out)?;
        Ok(if r[0] == u32::MAX {
            (0, f32::NAN)
        } else {
            (r[0], f32::from_bits(r[1]))
        })
    }

    fn rms_norm(&self, x: &mut CudaTensor, dim: usize, norm: Norm, eps: f32) -> OpResult<()> {
        self.rms_norm_impl("rms_norm", None, x, dim, norm, eps)
    }

    fn rms_norm_to(
        &self,
        x: &CudaTensor,
        dim: usize,
        norm: Norm,
        eps: f32,
    ) -> OpResult<CudaTensor> {
        let mut y = self.uninit_tensor("rms_norm_to", x.rows, x.cols)?;
        self.rms_norm_impl("rms_norm_to", Some(x), &mut y, dim, norm, eps)?;
        Ok(y)
    }

    fn add_rms_norm(
        &self,
        x: &mut CudaTensor,
        y: &CudaTensor,
        dim: usize,
        norm: Norm,
        eps: f32,
        s: f32,
    ) -> OpResult<()> {
        let op = "add_rms_norm";
        same_shape(op, x, y)?;
        check(op, dim > 0 && x.cols.is_multiple_of(dim), || {
            format!("pieces of {dim} in rows of {}", x.cols)
        })?;
        let (mode, w_off, c) = self.norm_args(op, norm, dim)?;
        let d = dim as i32;
        launch!(
            self,
            op,
            "rms_norm_add",
            blocks(x.len() / dim, 256),
            &*y.buf,
            &mut *x.buf,
            &d,
            &mode,
            &self.resident,
            &w_off,
            &c,
            &eps,
            &s
        )
    }

    fn add_rms_norm_pre(
        &self,
        x: &mut CudaTensor,
        y: &CudaTensor,
        dim: usize,
        post: Option<Norm>,
        eps: f32,
        s: f32,
        pre: &[PreNorm],
    ) -> OpResult<Vec<CudaTensor>> {
        let op = "add_rms_norm_pre";
        same_shape(op, x, y)?;
        check(op, dim > 0 && x.cols.is_multiple_of(dim), || {
            format!("pieces of {dim} in rows of {}", x.cols)
        })?;
        check(op, pre.len() <= PRE_NORMS, || {
            format!("{} pre-norms, at most {PRE_NORMS} in one launch", pre.len())
        })?;
        // Mode -1: the plain residual add.
        let (mode, w_off, c) = match post {
            Some(post) => self.norm_args(op, post, dim)?,
            None => (-1, 0, 1.0),
        };
        let mut args = PreNorms {
            n: pre.len() as i32,
            ..Default::default()
        };
        let mut outs = Vec::with_capacity(pre.len());
        for (o, p) in pre.iter().enumerate() {
            let t = self.uninit_tensor(op, x.rows, x.cols)?;
            let (m, w, k) = self.norm_args(op, p.norm, dim)?;
            (args.out[o], args.mode[o], args.w_off[o], args.c[o]) = (self.addr(&*t.buf), m, w, k);
            if let Some((v, k)) = p.cols {
                (args.col_off[o], args.col_c[o], args.has_col[o]) =
                    (self.vref(op, v, x.cols)?, k, 1);
            }
            outs.push(t);
        }
        let (d, cols) = (dim as i32, x.cols as u64);
        launch!(
            self,
            op,
            "rms_norm_add_pre",
            blocks(x.len() / dim, 256),
            &*y.buf,
            &mut *x.buf,
            &d,
            &mode,
            &self.resident,
            &w_off,
            &c,
            &eps,
            &s,
            &cols,
            &args
        )?;
        Ok(outs)
    }

    fn rms_norm_rope(
        &self,
        x: &mut CudaTensor,
        norm: Norm,
        eps: f32,
        rope: &Rope,
        head_dim: usize,
        pos0: usize,
    ) -> OpResult<()> {
        let op = "rms_norm_rope";
        let Some((freq, style)) = self.rope_args(op, x, rope, head_dim)? else {
            return self.rms_norm_impl(op, None, x, head_dim, norm, eps);
        };
        check(op, head_dim <= 512, || {
            format!("heads of {head_dim} (at most 512)")
        })?;
        let (mode, w_off, c) = self.norm_args(op, norm, head_dim)?;
        let heads = x.cols / head_dim;
        let (d, hs, rot, p0) = (
            head_dim as i32,
            heads as i32,
            rope.rotated as i32,
            pos0 as i32,
        );
        launch!(
            self,
            op,
            "rms_norm_rope",
            blocks(x.rows * heads, 128),
            &mut *x.buf,
            &d,
            &mode,
            &self.resident,
            &w_off,
            &c,
            &eps,
            &hs,
            &rot,
            &style,
            &*freq,
            &p0,
            &rope.mscale
        )
    }

    fn unary(&self, x: &mut CudaTensor, op: Unary) -> OpResult<()> {
        let (code, a, b) = match op {
            Unary::Scale(c) => (0i32, c, 0.0f32),
            Unary::Softcap(c) => (1, c, 0.0),
            Unary::Clamp(lo, hi) => (2, lo, hi),
            Unary::Silu => (3, 0.0, 0.0),
            Unary::GeluTanh => (4, 0.0, 0.0),
            Unary::Sigmoid => (5, 0.0, 0.0),
        };
        let n = x.len() as u64;
        launch!(
            self,
            "unary",
            "unary",
            elems(x.len()),
            &mut *x.buf,
            &n,
            &code,
            &a,
            &b
        )
    }

    fn matmul_bf16(&self, w: &VRef, rows: usize, x: &CudaTensor) -> OpResult<CudaTensor> {
        let op = "matmul_bf16";
        let off = self.vref(op, w, rows * x.cols)?;
        let mut out = self.tensor(op, x.rows(), rows)?;
        let (t, r, c) = (x.rows() as u64, rows as u64, x.cols as u64);
        launch!(
            self,
            op,
            "matmul_bf16",
            elems(out.len()),
            &*x.buf,
            &t,
            &r,
            &c,
            &self.resident,
            &off,
            &mut *out.buf
        )?;
        Ok(out)
    }

    fn mul_cols(&self, x: &mut CudaTensor, w: &VRef, c: f32) -> OpResult<()> {
        let op = "mul_cols";
        let off = self.vref(op, w, x.cols)?;
        let (n, cols) = (x.len() as u64, x.cols as u64);
        launch!(
            self,
            op,
            "mul_cols",
            elems(x.len()),
            &mut *x.buf,
            &n,
            &cols,
            &self.resident,
            &off,
            &c
        )
    }

    fn mul_sigmoid(&self, x: &mut CudaTensor, g: &CudaTensor) -> OpResult<()> {
        let op = "mul_sigmoid";
        same_shape(op, x, g)?;
        let n = x.len() as u64;
        launch!(
            self,
            op,
            "mul_sigmoid",
            elems(x.len()),
            &mut *x.buf,
            &*g.buf,
            &n
        )
    }

    fn mul_rows_sigmoid(&self, x: &mut CudaTensor, g: &CudaTensor) -> OpResult<()> {
        let op = "mul_rows_sigmoid";
        check(op, g.cols == 1 && g.rows == x.rows, || {
            format!("gate [{}, {}] for {} rows", g.rows, g.cols, x.rows)
        })?;
        let (n, cols) = (x.len() as u64, x.cols as u64);
        launch!(
            self,
            op,
            "mul_rows_sigmoid",
            elems(x.len()),
            &mut *x.buf,
            &*g.buf,
            &n,
            &cols
        )
    }

    fn add(&self, x: &mut CudaTensor, y: &CudaTensor, s: f32) -> OpResult<()> {
        let op = "add";
        same_shape(op, x, y)?;
        let n = x.len() as u64;
        launch!(
            self,
            op,
            "add_scaled",
            elems(x.len()),
            &mut *x.buf,
            &*y.buf,
            &n,
            &s
        )
    }

    fn scatter_add(
        &self,
        acc: &mut CudaTensor,
        y: &CudaTensor,
        rows: &[(usize, f32)],
    ) -> OpResult<()> {
        let op = "scatter_add";
        let (h, n) = (acc.cols, acc.rows);
        check(
            op,
            y.cols == h && y.rows == rows.len() && rows.iter().all(|&(r, _)| r < n),
            || format!("[{}, {}] rows into [{n}, {h}]", y.rows, y.cols),
        )?;
        if rows.is_empty() {
            return Ok(());
        }
        let cols = h as u64;
        let ya = self.addr(&*y.buf);
        for (ci, chunk) in rows.chunks(SCATTER_PAIRS).enumerate() {
            let mut p = Pairs {
                rows: [0; SCATTER_PAIRS],
                w: [0.0; SCATTER_PAIRS],
            };
            for (i, &(r, w)) in chunk.iter().enumerate() {
                p.rows[i] = r as u32;
                p.w[i] = w;
            }
            let (np, yc) = (chunk.len() as i32, ya + (4 * ci * SCATTER_PAIRS * h) as u64);
            launch!(
                self,
                op,
                "scatter_add",
                elems(h),
                &mut *acc.buf,
                &yc,
                &p,
                &np,
                &cols
            )?;
        }
        Ok(())
    }

    fn new_kv(
        &self,
        rows: usize,
        ring: bool,
        n_kv_heads: usize,
        head_dim: usize,
        dtype: KvDtype,
    ) -> OpResult<CudaKv> {
        let op = "new_kv";
        let n = rows * n_kv_heads * head_dim;
        let store = || -> OpResult<Store> {
            Ok(match dtype {
                KvDtype::F16 => {
                    Store::F16(self.stream.alloc_zeros(n).map_err(|e| self.dev(op, e))?)
                }
                KvDtype::F32 => Store::F32(self.zeros_f32(op, n)?),
            })
        };
        Ok(CudaKv {
            rows,
            ring,
            n_kv_heads,
            head_dim,
            k: store()?,
            v: store()?,
        })
    }

    fn rope(&self, x: &mut CudaTensor, rope: &Rope, head_dim: usize, pos0: usize) -> OpResult<()> {
        let op = "rope";
        let Some((freq, style)) = self.rope_args(op, x, rope, head_dim)? else {
            return Ok(());
        };
        let (t, cols, hd, rot, p0) = (
            x.rows as u64,
            x.cols as i32,
            head_dim as i32,
            rope.rotated as i32,
            pos0 as i32,
        );
        let n = x.rows * (x.cols / head_dim) * (rope.rotated / 2);
        launch!(
            self,
            op,
            "rope",
            elems(n),
            &mut *x.buf,
            &t,
            &cols,
            &hd,
            &rot,
            &style,
            &*freq,
            &p0,
            &rope.mscale
        )
    }

    fn kv_clone(&self, kv: &CudaKv) -> OpResult<CudaKv> {
        let op = "kv_clone";
        let copy = |s: &Store| -> OpResult<Store> {
            Ok(match s {
                Store::F16(x) => {
                    Store::F16(self.stream.clone_dtod(x).map_err(|e| self.dev(op, e))?)
                }
                Store::F32(x) => {
                    Store::F32(self.stream.clone_dtod(x).map_err(|e| self.dev(op, e))?)
                }
            })
        };
        Ok(CudaKv {
            rows: kv.rows,
            ring: kv.ring,
            n_kv_heads: kv.n_kv_heads,
            head_dim: kv.head_dim,
            k: copy(&kv.k)?,
            v: copy(&kv.v)?,
        })
    }

    fn kv_write(
        &self,
        kv: &mut CudaKv,
        pos0: usize,
        k: &CudaTensor,
        v: &CudaTensor,
    ) -> OpResult<()> {
        let op = "kv_write";
        same_shape(op, k, v)?;
        let w = kv.width();
        check(op, k.cols == w, || {
            format!("rows of {} into a KV row of {w}", k.cols)
        })?;
        check(op, kv.ring || pos0 + k.rows <= kv.rows, || {
            format!(
                "positions {pos0}..{} beyond the {}-row KV cache",
                pos0 + k.rows,
                kv.rows
            )
        })?;
        let (t, wi, rows, ring, p0) = (
            k.rows as i32,
            w as i32,
            kv.rows as i32,
            kv.ring as i32,
            pos0 as i32,
        );
        let (kernel, ks, vs) = self.kv_ptrs(kv, "kv_write_f16", "kv_write_f32");
        launch!(
            self,
            op,
            kernel,
            elems(k.len()),
            &ks,
            &vs,
            &*k.buf,
            &*v.buf,
            &t,
            &wi,
            &rows,
            &ring,
            &p0
        )
    }

    fn attention(
        &self,
        q: &CudaTensor,
        kv: &CudaKv,
        pos0: usize,
        s: &AttnShape,
    ) -> OpResult<CudaTensor> {
        let op = "attention";
        check(
            op,
            q.cols == s.n_heads * s.head_dim
                && s.n_kv_heads > 0
                && s.n_heads.is_multiple_of(s.n_kv_heads)
                && kv.width() == s.n_kv_heads * s.head_dim
                && s.head_dim <= ATTN_MAX_HEAD_DIM
                && s.sinks.as_ref().is_none_or(|v| v.len() == s.n_heads),
            || {
                format!(
                    "q rows of {} for {} heads of {} (at most {ATTN_MAX_HEAD_DIM}) over KV rows of {}",
                    q.cols,
                    s.n_heads,
                    s.head_dim,
                    kv.width()
                )
            },
        )?;
        check(
            op,
            if kv.ring {
                s.window.is_some()
            } else {
                pos0 + q.rows <= kv.rows
            },
            || {
                format!(
                    "positions {pos0}..{} over a {}-row {} KV cache (window {:?})",
                    pos0 + q.rows,
                    kv.rows,
                    if kv.ring { "ring" } else { "linear" },
                    s.window
                )
            },
        )?;
        let sinks = match &s.sinks {
            Some(v) => Some(self.constant(op, v)?),
            None => None,
        };
        let sp = sinks.as_deref().map_or(0, |b| self.addr(b));
        let mut out = self.uninit_tensor(op, q.rows, q.cols)?;
        // Few (row, head) items (decode): the visible positions are cut into runs of about
        // ATTN_SPLIT_POSITIONS, one block each, merged by a second kernel.
        let items = q.rows * s.n_heads;
        let last = pos0 + q.rows - 1;
        let visible = match s.window {
            Some(w) => (last + 1).min(w),
            None => last + 1,
        };
        let splits = if items >= ATTN_SPLIT_BELOW_ITEMS {
            1
        } else {
            visible
                .div_ceil(ATTN_SPLIT_POSITIONS)
                .clamp(1, ATTN_MAX_SPLITS)
        };
        // (maximum, sum) per part, then each part's output row.
        let parts = self.uninit_tensor(op, items * splits, s.head_dim + 2)?;
        let pa = self.addr(&*parts.buf);
        let (pm, pl, po) = (
            pa,
            pa + (4 * items * splits) as u64,
            pa + (8 * items * splits) as u64,
        );
        let (t, nh, nkv, d, rows, ring, p0, win) = (
            q.rows as i32,
            s.n_heads as i32,
            s.n_kv_heads as i32,
            s.head_dim as i32,
            kv.rows as i32,
            kv.ring as i32,
            pos0 as i32,
            s.window.unwrap_or(0) as i32,
        );
        let (ni, si) = (items as i32, splits as i32);
        let (kernel, ks, vs) = self.kv_ptrs(kv, "attention_f16", "attention_f32");
        launch!(
            self,
            op,
            kernel,
            LaunchConfig {
                grid_dim: (items as u32, splits as u32, 1),
                block_dim: (32 * ATTN_WARPS, 1, 1),
                shared_mem_bytes: 0,
            },
            &*q.buf,
            &ks,
            &vs,
            &t,
            &nh,
            &nkv,
            &d,
            &rows,
            &ring,
            &p0,
            &win,
            &s.scale,
            &si,
            &pm,
            &pl,
            &po
        )?;
        launch!(
            self,
            op,
            "attention_merge",
            blocks(items, 256),
            &pm,
            &pl,
            &po,
            &ni,
            &nh,
            &d,
            &si,
            &sp,
            &mut *out.buf
        )?;
        Ok(out)
    }

    fn route(&self, logits: &CudaTensor, spec: &RouterSpec) -> OpResult<Routes> {
        let op = "route";
        let (t, n_exp, k) = (logits.rows, logits.cols, spec.top_k);
        let (scoring, norm, pes_off, has_pes) = self.route_args(op, spec, t, n_exp)?;
        // One readback: ids, then weight bits, then margin bits.
        let out = self
            .stream
            .alloc_zeros::<u32>(2 * t * k + t.max(1))
            .map_err(|e| self.dev(op, e))?;
        let base = self.addr(&out);
        let (ids_at, wts_at, margins_at) =
            (base, base + (4 * t * k) as u64, base + (8 * t * k) as u64);
        let forced = match spec.forced {
            Some(f) => {
                let v: Vec<u32> = f.iter().map(|&e| e as u32).collect();
                Some(self.to_device(op, &v)?)
            }
            None => None,
        };
        // Without forced ids the kernel never reads the pointer.
        let forced_at = forced.as_ref().map_or(base, |f| self.addr(f));
        let has_forced = spec.forced.is_some() as i32;
        let (ti, ni, ki) = (t as i32, n_exp as i32, k as i32);
        let trace = spec.trace as i32;
        launch!(
            self,
            op,
            "route",
            LaunchConfig {
                grid_dim: (t.div_ceil(128) as u32, 1, 1),
                block_dim: (128, 1, 1),
                shared_mem_bytes: 0,
            },
            &*logits.buf,
            &ti,
            &ni,
            &ki,
            &scoring,
            &norm,
            &self.resident,
            &pes_off,
            &has_pes,
            &trace,
            &forced_at,
            &has_forced,
            &ids_at,
            &wts_at,
            &margins_at
        )?;
        let back = self.to_host(op, &out)?;
        let (ids, rest) = back.split_at(t * k);
        let (wts, margins) = rest.split_at(t * k);
        let wts: Vec<f32> = wts.iter().map(|&b| f32::from_bits(b)).collect();
        let mut experts: BTreeMap<usize, Vec<(usize, f32)>> = BTreeMap::new();
        for (row, (ri, rw)) in ids.chunks_exact(k).zip(wts.chunks_exact(k)).enumerate() {
            for (&e, &w) in ri.iter().zip(rw) {
                experts.entry(e as usize).or_default().push((row, w));
            }
        }
        let margins = if spec.trace {
            margins.iter().map(|&b| f32::from_bits(b)).collect()
        } else {
            Vec::new()
        };
        Ok(Routes { experts, margins })
    }
}

impl RecurrentOps for CudaBackend {
    fn rms_norm_gated(
        &self,
        x: &mut CudaTensor,
        dim: usize,
        w: &VRef,
        z: &CudaTensor,
        eps: f32,
    ) -> OpResult<()> {
        let op = "rms_norm_gated";
        same_shape(op, x, z)?;
        self.rms_norm_impl(op, None, x, dim, Norm::Weight(w), eps)?;
        let n = x.len() as u64;
        launch!(
            self,
            op,
            "mul_silu",
            elems(x.len()),
            &mut *x.buf,
            &*z.buf,
            &n
        )
    }

    fn new_state(&self, len: usize) -> OpResult<CudaState> {
        Ok(CudaState {
            buf: self.zeros_f32("new_state", len)?,
        })
    }

    fn zero_state(&self, s: &mut CudaState) -> OpResult<()> {
        self.stream
            .memset_zeros(&mut s.buf)
            .map_err(|e| self.dev("zero_state", e))
    }

    fn state_bytes(&self, s: &CudaState) -> usize {
        4 * s.buf.len()
    }

    fn conv1d_silu(
        &self,
        x: &CudaTensor,
        state: &mut CudaState,
        w: &CudaTensor,
        kernel: usize,
    ) -> OpResult<CudaTensor> {
        let op = "conv1d_silu";
        let c = x.cols;
        check(
            op,
            kernel >= 2 && w.len() == c * kernel && state.buf.len() == (kernel - 1) * c,
            || format!("kernel {kernel} over {c} channels"),
        )?;
        let mut out = self.tensor(op, x.rows, c)?;
        let (t, ci, ki) = (x.rows as i32, c as i32, kernel as i32);
        launch!(
            self,
            op,
            "conv1d_silu",
            elems(c),
            &*x.buf,
            &mut state.buf,
            &*w.buf,
            &t,
            &ci,
            &ki,
            &mut *out.buf
        )?;
        Ok(out)
    }

    fn delta_gates(
        &self,
        b: &CudaTensor,
        alpha: &CudaTensor,
        a: &CudaTensor,
        dt_bias: &CudaTensor,
    ) -> OpResult<(CudaTensor, CudaTensor)> {
        let op = "delta_gates";
        same_shape(op, b, alpha)?;
        let nv = b.cols;
        check(op, a.len() == nv && dt_bias.len() == nv, || {
            format!("a / dt_bias for {nv} heads")
        })?;
        let mut beta = self.tensor(op, b.rows, nv)?;
        let mut decay = self.tensor(op, b.rows, nv)?;
        let (n, nvi) = (b.len() as u64, nv as i32);
        launch!(
            self,
            op,
            "delta_gates",
            elems(b.len()),
            &*b.buf,
            &*alpha.buf,
            &*a.buf,
            &*dt_bias.buf,
            &n,
            &nvi,
            &mut *beta.buf,
            &mut *decay.buf
        )?;
        Ok((beta, decay))
    }

    fn gated_delta_rule(
        &self,
        q: &CudaTensor,
        k: &CudaTensor,
        v: &CudaTensor,
        decay: &CudaTensor,
        beta: &CudaTensor,
        state: &mut CudaState,
        s: &DeltaShape,
    ) -> OpResult<CudaTensor> {
        let op = "gated_delta_rule";
        let (nk, nv, dk, dv) = (s.n_k_heads, s.n_v_heads, s.head_k_dim, s.head_v_dim);
        same_shape(op, q, k)?;
        same_shape(op, decay, beta)?;
        check(
            op,
            q.cols == nk * dk
                && v.cols == nv * dv
                && decay.cols == nv
                && nk > 0
                && nv.is_multiple_of(nk)
                && state.buf.len() == nv * dv * dk
                && q.rows == v.rows
                && q.rows == decay.rows,
            || format!("operands do not fit {s:?}"),
        )?;
        let mut out = self.tensor(op, q.rows, nv * dv)?;
        let (t, nki, nvi, dki, dvi) = (q.rows as i32, nk as i32, nv as i32, dk as i32, dv as i32);
        launch!(
            self,
            op,
            "gated_delta_rule",
            blocks(nv, 128),
            &*q.buf,
            &*k.buf,
            &*v.buf,
            &*decay.buf,
            &*beta.buf,
            &mut state.buf,
            &t,
            &nki,
            &nvi,
            &dki,
            &dvi,
            &mut *out.buf
        )?;
        Ok(out)
    }
}

impl DeepSeekV4Ops for CudaBackend {}

impl InklingOps for CudaBackend {}

impl DeviceExpertOps for CudaBackend {
    fn held_experts(&self, layer: usize, experts: &[usize]) -> OpResult<Vec<bool>> {
        match self.cache() {
            Some(mut c) => c
                .held(&self.stream, layer, experts)
                .map_err(|e| self.cache_err("held_experts", e)),
            None => Ok(vec![false; experts.len()]),
        }
    }

    fn load_expert<'a>(
        &self,
        layer: usize,
        expert: usize,
        blob: &'a [u8],
    ) -> OpResult<Weights<'a>> {
        match self.cache() {
            Some(mut c) => {
                c.load(layer, expert, blob)
                    .map_err(|e| self.cache_err("load_expert", e))?;
                Ok(Weights::Held { layer, expert })
            }
            None => Ok(Weights::Blob(blob)),
        }
    }

    fn expert_copies_done(&self) -> OpResult<()> {
        match self.cache() {
            Some(mut c) => c
                .copies_done()
                .map_err(|e| self.cache_err("expert_copies_done", e)),
            None => Ok(()),
        }
    }

    fn attach_host_slots(&self, layer: usize, slots: &[u8]) -> OpResult<()> {
        match self.cache() {
            Some(mut c) => c
                .pin_host(layer, slots)
                .map_err(|e| self.cache_err("attach_host_slots", e)),
            None => Ok(()),
        }
    }

    fn device_expert_stats(&self) -> Option<DeviceExpertStats> {
        self.cache().map(|c| c.stats())
    }

    fn experts_to_complete(&self, layer: usize) -> OpResult<Vec<usize>> {
        match self.cache() {
            Some(mut c) => c
                .not_yet_held(&self.stream, layer)
                .map_err(|e| self.cache_err("experts_to_complete", e)),
            None => Ok(Vec::new()),
        }
    }

    fn routes_on_device(&self, layer: usize, top_k: usize) -> OpResult<bool> {
        if 2 * top_k > QM_JOBS {
            return Ok(false);
        }
        match self.cache() {
            Some(mut c) => Ok(c
                .slots_by_id(&self.stream, layer)
                .map_err(|e| self.cache_err("routes_on_device", e))?
                .is_some()),
            None => Ok(false),
        }
    }

    fn routed_experts_held(
        &self,
        layer: usize,
        mlp: &Mlp,
        act: Act,
        x: &CudaTensor,
        logits: &CudaTensor,
        spec: &RouterSpec,
        acc: &mut CudaTensor,
    ) -> OpResult<()> {
        let op = "routed_experts_held";
        let (n_exp, k) = (logits.cols, spec.top_k);
        check_mlp(op, mlp, x.cols)?;
        let (inner, h) = (mlp.gate_proj.rows, mlp.down_proj.rows);
        check(
            op,
            x.rows == 1
                && logits.rows == 1
                && (acc.rows, acc.cols) == (1, h)
                && !spec.trace
                && 2 * k <= QM_JOBS,
            || {
                format!(
                    "one row of {} into [1, {h}] by [1, {n_exp}] logits, top-{k} (at most {}), \
                     no trace; got x [{}, {}], logits [{}, {n_exp}], acc [{}, {}]",
                    x.cols,
                    QM_JOBS / 2,
                    x.rows,
                    x.cols,
                    logits.rows,
                    acc.rows,
                    acc.cols
                )
            },
        )?;
        let (scoring, norm, pes_off, has_pes) = self.route_args(op, spec, 1, n_exp)?;
        let (slots, stride) = {
            let mut cache = self.cache();
            let Some(c) = cache.as_mut() else {
                return Err(self.missing("routed_experts_held (no GPU expert cache)"));
            };
            let slots = c
                .slots_by_id(&self.stream, layer)
                .map_err(|e| self.cache_err(op, e))?;
            let experts = c.experts();
            check(op, slots.is_some() && experts == n_exp, || {
                format!("layer {layer}: not every one of its {experts} experts is held for {n_exp} logits")
            })?;
            c.count_device_step(k);
            (slots.expect("checked"), c.stride())
        };
        let mut forced = ForcedIds {
            ids: [0; ROUTE_MAX_K],
        };
        if let Some(f) = spec.forced {
            for (d, &e) in forced.ids.iter_mut().zip(f) {
                *d = e as u32;
            }
        }
        let has_forced = spec.forced.is_some() as i32;
        // The chosen ids, then their weights' bits.
        // SAFETY: `route_one` writes all 2k values before anything reads them (stream order).
        let sel = unsafe { self.stream.alloc::<u32>(2 * k) }.map_err(|e| self.dev(op, e))?;
        let ids = self.addr(&sel);
        let wts = ids + 4 * k as u64;
        let (ni, ki) = (n_exp as i32, k as i32);
        launch!(
            self,
            op,
            "route_one",
            blocks(1, 32),
            &*logits.buf,
            &ni,
            &ki,
            &scoring,
            &norm,
            &self.resident,
            &pes_off,
            &has_pes,
            &forced,
            &has_forced,
            &ids,
            &wts
        )?;
        let mut g = self.uninit_tensor(op, k, inner)?;
        let u = self.uninit_tensor(op, k, inner)?;
        let stack = self.uninit_tensor(op, k, h)?;
        let (xa, ga, ua, sa) = (
            self.addr(&*x.buf),
            self.addr(&*g.buf),
            self.addr(&*u.buf),
            self.addr(&*stack.buf),
        );
        let row = |base: u64, r: usize, width: usize| base + (4 * r * width) as u64;
        let (gate, up) = (&mlp.gate_proj, &mlp.up_proj);
        let gate_jobs: Vec<_> = (0..k).map(|i| (0, i, xa, row(ga, i, inner))).collect();
        let up_jobs: Vec<_> = (0..k).map(|i| (1, i, xa, row(ua, i, inner))).collect();
        let [gw, ..] = qref_offsets(op, gate, stride)?;
        let [uw, ..] = qref_offsets(op, up, stride)?;
        if pairs_fuse(gate, up, gw, uw) {
            self.products_by_id(op, &[gate, up], &gate_jobs, slots, ids, stride, Some(act))?;
        } else {
            if (gate.bits, gate.group_size) == (up.bits, up.group_size) {
                let both: Vec<_> = gate_jobs.iter().chain(&up_jobs).copied().collect();
                self.products_by_id(op, &[gate, up], &both, slots, ids, stride, None)?;
            } else {
                self.products_by_id(op, &[gate], &gate_jobs, slots, ids, stride, None)?;
                let up_jobs: Vec<_> = up_jobs.iter().map(|&(_, i, x, y)| (0, i, x, y)).collect();
                self.products_by_id(op, &[up], &up_jobs, slots, ids, stride, None)?;
            }
            self.glu_act(op, act, &mut g, &u)?;
        }
        let down: Vec<_> = (0..k)
            .map(|i| (0, i, row(ga, i, inner), row(sa, i, h)))
            .collect();
        self.products_by_id(op, &[&mlp.down_proj], &down, slots, ids, stride, None)?;
        let cols = h as u64;
        launch!(
            self,
            op,
            "combine_ids",
            elems(h),
            &mut *acc.buf,
            &*stack.buf,
            &ids,
            &wts,
            &ki,
            &cols
        )
    }

    fn size_expert_cache(&self) -> OpResult<()> {
        match self.cache() {
            Some(mut c) => c
                .ensure_sized(&self.stream)
                .map_err(|e| self.cache_err("size_expert_cache", e)),
            None => Ok(()),
        }
    }
}
