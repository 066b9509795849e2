//! Launching kernels: the `launch!` macro, the kernels' compile-time sizes mirrored on the host,
//! the by-value argument structs (`repr(C)` twins of the `.cu` structs) and the grid helpers.

use crate::*;

/// Launches kernel `$k` for op `$op` with `$cfg` and the arguments (references to locals or
/// device buffers, in the order of the kernel's parameters); an empty grid launches nothing.
/// With [`CudaBackend::pdl`] on, the launch lets the kernel start while the stream's previous
/// kernel runs (programmatic dependent launch): every kernel waits for its predecessor's
/// completion with `grid_dep_wait` (ops/common.cuh) before it reads or writes memory.
macro_rules! launch {
    ($be:expr, $op:expr, $k:expr, $cfg:expr, $($arg:expr),+ $(,)?) => {{
        let cfg: LaunchConfig = $cfg;
        if cfg.grid_dim.0 == 0 || cfg.grid_dim.1 == 0 {
            Ok(())
        } else {
            let kernel: &'static str = $k;
            $be.launches.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let t0 = $be.profile_start();
            let args = [$( $crate::launch::KernelArg::addr($arg, &$be.stream) ),+];
            // SAFETY: the arguments follow the kernel's parameter list in ops/*.cu (device
            // buffers, or their `u64` addresses, as pointers; `i32` as int, `u64` as u64, `f32`
            // as float; `QJobs` / `Pairs` by value), and the op checked that every buffer holds
            // what the launch's shape reads or writes.
            let r = unsafe {
                $crate::launch::launch_kernel(&$be.stream, &$be.funcs[kernel], cfg, $be.pdl, &args)
            }
            .map_err(|e| $be.dev($op, e));
            $be.profile_end($op, kernel, t0);
            r
        }
    }};
}

/// Where `cuLaunchKernelEx` finds one kernel argument: the address of a host value (a scalar
/// or a by-value struct, borrowed for the launch) or a device buffer's address, copied.
#[derive(Clone, Copy)]
pub(crate) enum ArgAddr {
    At(*const std::ffi::c_void),
    Device(u64),
}

/// A value a kernel takes by value (the `repr(C)` twins of the `.cu` structs, and scalars).
///
/// # Safety
/// The type's bytes are what the kernel's parameter of that type reads: the same size and
/// layout, no padding the kernel reads, no pointers to host memory.
pub(crate) unsafe trait Scalar {}

/// One argument of [`launch!`]: a reference to a [`Scalar`] or to a device buffer.
pub(crate) trait KernelArg {
    fn addr(self, stream: &CudaStream) -> ArgAddr;
}

impl<T: Scalar> KernelArg for &T {
    fn addr(self, _: &CudaStream) -> ArgAddr {
        ArgAddr::At(self as *const T as *const std::ffi::c_void)
    }
}

impl<T> KernelArg for &CudaSlice<T> {
    fn addr(self, stream: &CudaStream) -> ArgAddr {
        ArgAddr::Device(self.device_ptr(stream).0)
    }
}

impl<T> KernelArg for &mut CudaSlice<T> {
    fn addr(self, stream: &CudaStream) -> ArgAddr {
        ArgAddr::Device(self.device_ptr_mut(stream).0)
    }
}

// SAFETY: C's int, unsigned, unsigned long long and float.
unsafe impl Scalar for i32 {}
unsafe impl Scalar for u32 {}
unsafe impl Scalar for u64 {}
unsafe impl Scalar for f32 {}

/// Most arguments of one kernel.
const MAX_ARGS: usize = 24;

/// Launches `f` on `stream` with `cfg` and `args` through `cuLaunchKernelEx`, with the
/// programmatic stream serialization attribute when `pdl`.
///
/// # Safety
/// `args` match `f`'s parameters in number, order and type, and the buffers they name hold
/// what the kernel reads and writes; every host value `args` points at lives until this returns.
pub(crate) unsafe fn launch_kernel(
    stream: &CudaStream,
    f: &CudaFunction,
    cfg: LaunchConfig,
    pdl: bool,
    args: &[ArgAddr],
) -> Result<(), DriverError> {
    use cudarc::driver::sys;
    assert!(
        args.len() <= MAX_ARGS,
        "a kernel of more than {MAX_ARGS} arguments"
    );
    stream.context().bind_to_thread()?;
    let mut dev = [0u64; MAX_ARGS];
    for (d, a) in dev.iter_mut().zip(args) {
        if let ArgAddr::Device(p) = *a {
            *d = p;
        }
    }
    let mut ptrs: [*mut std::ffi::c_void; MAX_ARGS] = [std::ptr::null_mut(); MAX_ARGS];
    for (i, a) in args.iter().enumerate() {
        ptrs[i] = match *a {
            ArgAddr::At(p) => p as *mut _,
            ArgAddr::Device(_) => &mut dev[i] as *mut u64 as *mut _,
        };
    }
    // SAFETY: a zeroed attribute is a valid "ignore" entry; its id and value are set below.
    let mut attr: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
    attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
    attr.value.programmaticStreamSerializationAllowed = 1;
    let config = sys::CUlaunchConfig {
        gridDimX: cfg.grid_dim.0,
        gridDimY: cfg.grid_dim.1,
        gridDimZ: cfg.grid_dim.2,
        blockDimX: cfg.block_dim.0,
        blockDimY: cfg.block_dim.1,
        blockDimZ: cfg.block_dim.2,
        sharedMemBytes: cfg.shared_mem_bytes,
        hStream: stream.cu_stream(),
        attrs: &mut attr,
        numAttrs: pdl as u32,
    };
    // SAFETY: the caller's contract; `ptrs` and `dev` outlive the call, which copies the values.
    unsafe {
        sys::cuLaunchKernelEx(
            &config,
            f.cu_function(),
            ptrs.as_mut_ptr(),
            std::ptr::null_mut(),
        )
    }
    .result()
}

/// `qmatmul` (ops/quant.cu): output rows per block (a warp each), products per launch, rows
/// of x per pass over a weight row.
pub(crate) const QM_ROWS: usize = 8;
pub(crate) const QM_JOBS: usize = 32;
pub(crate) const QM_TT: usize = 4;
/// `qmv2/4/8` (ops/quant.cu): warps per block.
pub(crate) const QV_WARPS: usize = 4;
/// Blocks a `qmatmul` launch aims for before it splits the rows of x over more of them (two per
/// SM of an H200).
pub(crate) const QM_BLOCKS: usize = 264;
/// (row, weight) pairs per `scatter_add` launch (`SCATTER_PAIRS` in ops/elementwise.cu).
pub(crate) const SCATTER_PAIRS: usize = 64;
/// The attention kernel keeps 16 dimensions of a head per lane: `head_dim <= 32 * 16`.
pub(crate) const ATTN_MAX_HEAD_DIM: usize = 512;
/// Warps per block of the attention kernel (`ATTN_WARPS` in ops/attention.cu).
pub(crate) const ATTN_WARPS: u32 = 16;
/// Attention launches with fewer (row, head) items than this (decode) split the visible
/// positions over blocks of about `ATTN_SPLIT_POSITIONS` each, at most `ATTN_MAX_SPLITS`.
pub(crate) const ATTN_SPLIT_BELOW_ITEMS: usize = 132;
pub(crate) const ATTN_SPLIT_POSITIONS: usize = 64;
pub(crate) const ATTN_MAX_SPLITS: usize = 16;
/// `attention_tiled` (ops/attention.cu `AT_WARPS`, `AT_ITEMS`): warps per block, (row, head)
/// items per block.
pub(crate) const AT_WARPS: u32 = 4;
pub(crate) const AT_ITEMS: usize = 16;
/// `gated_delta_rule` (ops/recurrent.cu `GDR_COLS`, `GDR_WARPS`): state columns a lane keeps
/// (`head_k_dim <= 32 * GDR_COLS`), warps (state rows) per block.
pub(crate) const GDR_COLS: usize = 8;
pub(crate) const GDR_WARPS: usize = 8;
/// Most experts per token the router kernel keeps per row.
pub(crate) const ROUTE_MAX_K: usize = 64;
/// Most experts `route_one` holds in shared memory (ops/router.cu `ROUTE_ONE_MAX_N`).
pub(crate) const ROUTE_ONE_MAX_N: usize = 1024;
/// Columns of an mHC row per `hc_mix_parts` block (ops/deepseek_v4.cu `HC_SPLIT`).
pub(crate) const HC_SPLIT: usize = 256;
/// Columns of `col` per `hc_pre_row` block, one per thread (ops/deepseek_v4.cu `HC_COLS`).
pub(crate) const HC_COLS: usize = 256;
/// Small constant vectors kept on the device (RoPE frequencies, attention sinks).
pub(crate) const CONSTS_KEPT: usize = 64;

/// The `QJobs` argument of `qmatmul`: device addresses of each product's codes, scales, biases,
/// input rows and output rows.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub(crate) struct QJobs {
    pub(crate) w: [u64; QM_JOBS],
    pub(crate) s: [u64; QM_JOBS],
    pub(crate) b: [u64; QM_JOBS],
    pub(crate) x: [u64; QM_JOBS],
    pub(crate) y: [u64; QM_JOBS],
}

// SAFETY: plain `repr(C)` u64 arrays, laid out as `struct QJobs` in ops/quant.cu.
unsafe impl Scalar for QJobs {}

/// The `QvRows` argument of `qmv`: each job's output rows.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub(crate) struct QvRows {
    pub(crate) rows: [i32; QM_JOBS],
}

// SAFETY: a plain `repr(C)` i32 array, laid out as `struct QvRows` in ops/quant.cu.
unsafe impl Scalar for QvRows {}

/// The `QIdJobs` argument of `qmv_ids`: byte offsets of up to two matrices in an expert
/// blob, and per product the input and output rows, the place of its expert among the device-side
/// ids and which matrix it multiplies.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub(crate) struct QIdJobs {
    pub(crate) w_off: [u64; 2],
    pub(crate) s_off: [u64; 2],
    pub(crate) b_off: [u64; 2],
    pub(crate) x: [u64; QM_JOBS],
    pub(crate) y: [u64; QM_JOBS],
    pub(crate) pick: [i32; QM_JOBS],
    pub(crate) mat: [i32; QM_JOBS],
}

// SAFETY: plain `repr(C)` arrays of u64 and i32, laid out as `struct QIdJobs` in ops/quant.cu.
unsafe impl Scalar for QIdJobs {}

/// The `ForcedIds` argument of `route_one`.
#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct ForcedIds {
    pub(crate) ids: [u32; ROUTE_MAX_K],
}

// SAFETY: a plain `repr(C)` u32 array, laid out as `struct ForcedIds` in ops/router.cu.
unsafe impl Scalar for ForcedIds {}

/// The `RelArgs` argument of the attention kernels (ops/attention.cu): Inkling's relative-position
/// bias, `rel` = 0 for plain attention.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub(crate) struct RelArgs {
    /// `[T, n_heads, d_rel]` f32 coefficients (device address).
    pub(crate) rel: u64,
    /// `[d_rel, extent]` f32 profiles (device address).
    pub(crate) proj: u64,
    pub(crate) d_rel: i32,
    pub(crate) extent: i32,
    /// The log position scale's `alpha` and `n_floor` (0: none).
    pub(crate) alpha: f32,
    pub(crate) n_floor: f32,
}

// SAFETY: `repr(C)` u64, u64, i32, i32, f32, f32, laid out as `struct RelArgs` in ops/attention.cu.
unsafe impl Scalar for RelArgs {}

/// The `SparseArgs` argument of the split attention kernel (ops/attention.cu): DeepSeek-V4's
/// compressed entries and each row's visible ones, `ent` = 0 for plain attention.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub(crate) struct SparseArgs {
    /// `[N, n_kv_heads · head_dim]` f32 entries (device address).
    pub(crate) ent: u64,
    /// `[T + 1]` i32: row `r`'s indices are `vis_idx[vis_off[r] .. vis_off[r + 1]]`.
    pub(crate) vis_off: u64,
    pub(crate) vis_idx: u64,
}

// SAFETY: `repr(C)` u64 x 3, laid out as `struct SparseArgs` in ops/attention.cu.
unsafe impl Scalar for SparseArgs {}

/// Parts one `split_parts` launch writes (ops/elementwise.cu `SPLIT_PARTS`).
pub(crate) const SPLIT_PARTS: usize = 4;

/// The `SplitParts` argument of `split_parts`: each part's output address, its offset and length
/// inside a group of columns, and the number of parts.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub(crate) struct SplitParts {
    pub(crate) out: [u64; SPLIT_PARTS],
    pub(crate) off: [i32; SPLIT_PARTS],
    pub(crate) len: [i32; SPLIT_PARTS],
    pub(crate) n: i32,
}

// SAFETY: plain `repr(C)` arrays and an i32, laid out as `struct SplitParts` in
// ops/elementwise.cu.
unsafe impl Scalar for SplitParts {}

/// Pre-norms one `rms_norm_add_pre` launch writes (ops/norm.cu `PRE_NORMS`).
pub(crate) const PRE_NORMS: usize = 4;

/// The `PreNorms` argument of `rms_norm_add_pre`: per pre-norm its output's device address, its
/// norm's weight offset, mode and constant, and its column scale (offset, constant, whether).
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub(crate) struct PreNorms {
    pub(crate) out: [u64; PRE_NORMS],
    pub(crate) w_off: [u64; PRE_NORMS],
    pub(crate) col_off: [u64; PRE_NORMS],
    pub(crate) c: [f32; PRE_NORMS],
    pub(crate) col_c: [f32; PRE_NORMS],
    pub(crate) mode: [i32; PRE_NORMS],
    pub(crate) has_col: [i32; PRE_NORMS],
    pub(crate) n: i32,
}

// SAFETY: plain `repr(C)` arrays of u64, f32 and i32 and an i32, laid out as `struct PreNorms` in
// ops/norm.cu.
unsafe impl Scalar for PreNorms {}

/// The `QkvNorms` argument of `rms_norm_rope_kv_*` (ops/norm.cu): the mode, weight offset and
/// constant of q's, k's and v's per-head norms (v's mode -1: none).
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub(crate) struct QkvNorms {
    pub(crate) w_off: [u64; 3],
    pub(crate) c: [f32; 3],
    pub(crate) mode: [i32; 3],
}

// SAFETY: plain `repr(C)` arrays of u64, f32 and i32, laid out as `struct QkvNorms` in
// ops/norm.cu.
unsafe impl Scalar for QkvNorms {}

/// The `Pairs` argument of `scatter_add`.
#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct Pairs {
    pub(crate) rows: [u32; SCATTER_PAIRS],
    pub(crate) w: [f32; SCATTER_PAIRS],
}

// SAFETY: plain `repr(C)` arrays of u32 and f32, laid out as `struct Pairs` in the kernel.
unsafe impl Scalar for Pairs {}

/// One product of a `qmatmul` launch: matrix `w` in the bytes at device address `buf` (`len` of
/// them valid), the rows of x at device address `x`, the output rows at `y`.
#[derive(Clone, Copy)]
pub(crate) struct QJob<'a> {
    pub(crate) w: &'a QRef,
    pub(crate) buf: u64,
    pub(crate) len: usize,
    pub(crate) x: u64,
    pub(crate) y: u64,
}

/// Where the bytes of a launch's sources are ([`CudaBackend::sources`]).
pub(crate) struct Sources<'a> {
    /// Device address and valid length of each source, in order.
    pub(crate) at: Vec<(u64, usize)>,
    /// `(layer, slot)` of each held source.
    pub(crate) held: Vec<(usize, usize)>,
    /// The expert cache, locked until the held slots' reads are recorded.
    pub(crate) cache: Option<std::sync::MutexGuard<'a, GpuExperts>>,
}

/// A small host vector (by its bit patterns) and its device copy.
pub(crate) type Constant = (Vec<u32>, Arc<CudaSlice<f32>>);

/// A 1-D grid of 256-thread blocks over `n` elements (kernels loop if the grid is capped).
pub(crate) fn elems(n: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (n.div_ceil(256).min(1 << 20) as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// A grid over `jobs` jobs of `total` elements in all (blockIdx.y = job): 256-thread blocks for
/// the average job's elements, at most 1024 a job (kernels loop over a larger job). Sized by the
/// largest job instead, a launch of 256 experts was mostly blocks with nothing to do.
pub(crate) fn elems_per_job(total: usize, jobs: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (
            (total / jobs.max(1)).div_ceil(256).clamp(1, 1024) as u32,
            jobs as u32,
            1,
        ),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Lanes per output row of a `qmv` launch: 32, or fewer (down to 4) for short rows, so that a lane
/// has at least 4 of the row's 8-byte words.
pub(crate) fn qmv_lanes(cols: usize, bits: usize) -> usize {
    let words = cols * bits / 64;
    let mut lanes = 32;
    while lanes > 4 && words < 4 * lanes {
        lanes /= 2;
    }
    lanes
}

/// The `QJobs` argument for up to `QM_JOBS` products.
pub(crate) fn qjobs<'a, 'b: 'a>(
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
/// `qmv_glu` lane group: one shape and bit width (the group sizes may differ: `qmv_glu`'s
/// `up_group`), and the same alignment modulo 8 (so a lane's words hold the same columns of both).
pub(crate) fn pairs_fuse(gate: &QRef, up: &QRef, gate_at: u64, up_at: u64) -> bool {
    (gate.rows, gate.cols, gate.bits) == (up.rows, up.cols, up.bits) && gate_at % 8 == up_at % 8
}

/// The shapes the quantized product kernels take: 2/4/8 bits, a multiple of 32 columns, groups
/// a power of two.
pub(crate) fn check_qshape(op: &'static str, w: &QRef) -> OpResult<()> {
    let (cols, bits, group) = (w.cols, w.bits, w.group_size);
    check(
        op,
        cols.is_multiple_of(32) && matches!(bits, 2 | 4 | 8) && group.is_power_of_two(),
        || {
            format!("a {bits}-bit matrix of {cols} columns in groups of {group} (2/4/8 bits, a multiple of 32 columns, groups a power of two)")
        },
    )
}

/// `glu_f`'s act code and limit (ops/common.cuh).
pub(crate) fn act_code(act: Act) -> (i32, f32) {
    match act {
        Act::GeluTanh => (0, 0.0),
        Act::Silu => (1, 0.0),
        Act::SiluClamped(l) => (2, l),
    }
}

/// The most dynamic shared memory a `qmv` launch stages x in (ops/quant.cu `QV_SMEM_MAX`).
const QV_SMEM_MAX: usize = 49152;

/// Shared memory bytes of a `qmv` launch of `cols` columns at `bits` bits (ops/quant.cu
/// `qv_stage_bytes`: x staged for the words a row can touch, `16 / bits` chunks of 4 floats and
/// one of piece sums each, at [`compile::qv_stage`] bits or fewer), 0 when x is read from global
/// memory.
pub(crate) fn qv_stage_bytes(cols: usize, bits: usize) -> usize {
    let bytes = (cols * bits / 64 + 1) * (16 / bits + 1) * 16;
    if bits <= compile::qv_stage() && bytes <= QV_SMEM_MAX {
        bytes
    } else {
        0
    }
}

/// Blocks a staged `qmv` launch keeps when it gives each block several passes (~8 per SM of
/// an H100 / H200, so that the SMs stay full).
const QV_MIN_BLOCKS: usize = 1024;

/// Passes of a `_p` qmv kernel (ops/quant.cu `QV_PASSES`).
const QV_PASSES: usize = 4;

/// The grid of a `qmv` launch over `jobs` products (`nm = 1`) or gated pairs (`nm = 2`) of
/// `rows` rows and `cols` columns at `bits` bits, `lanes` lanes per row, and its passes per
/// block: [`QV_PASSES`] (the `_p` kernels, [`qmv_kernel`]) where x is staged, passes are allowed
/// ([`compile::qv_passes`]) and [`QV_MIN_BLOCKS`] blocks remain, else 1.
pub(crate) fn qmv_grid(
    rows: usize,
    cols: usize,
    bits: usize,
    lanes: usize,
    jobs: usize,
    nm: usize,
) -> (LaunchConfig, usize) {
    let rows_per_pass = QV_WARPS * 32 / lanes * (compile::qv_rows() / nm);
    let smem = qv_stage_bytes(cols, bits);
    let passes = if smem > 0
        && compile::qv_passes() >= QV_PASSES
        && rows.div_ceil(rows_per_pass * QV_PASSES) * jobs >= QV_MIN_BLOCKS
    {
        QV_PASSES
    } else {
        1
    };
    let cfg = LaunchConfig {
        grid_dim: (rows.div_ceil(rows_per_pass * passes) as u32, jobs as u32, 1),
        block_dim: (32 * QV_WARPS as u32, 1, 1),
        shared_mem_bytes: smem as u32,
    };
    (cfg, passes)
}

/// The kernel of a `qmv` launch at `bits` bits: `one[bits / 4]`, or `multi[bits / 4]` for
/// [`QV_PASSES`] passes.
pub(crate) fn qmv_kernel(
    one: [&'static str; 3],
    multi: [&'static str; 3],
    bits: usize,
    passes: usize,
) -> &'static str {
    if passes > 1 {
        multi[bits / 4]
    } else {
        one[bits / 4]
    }
}

/// Logits per block of `argmax_parts` (4 per thread; a 262,144-token vocabulary is 64 parts).
pub(crate) const ARGMAX_CHUNK: usize = 4096;

/// A warp per item of `n` (kernels that stride over `gridDim.x * blockDim.x / 32` warps), 8 per
/// block.
pub(crate) fn warps(n: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (n.div_ceil(8).clamp(1, 1 << 16) as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// One block of `DOT_THREADS` (ops/elementwise.cu) per output of a `linear` / `matmul_bf16`
/// launch of `n` outputs (a grid-stride loop past 2^20 blocks).
pub(crate) fn dot_blocks(n: usize) -> LaunchConfig {
    blocks(n.clamp(1, 1 << 20), DOT_THREADS)
}

/// `DOT_THREADS` in ops/elementwise.cu.
pub(crate) const DOT_THREADS: u32 = 128;

pub(crate) fn blocks(n: usize, threads: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (n as u32, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    }
}

pub(crate) fn same_shape(op: &'static str, a: &CudaTensor, b: &CudaTensor) -> OpResult<()> {
    check(op, a.rows == b.rows && a.cols == b.cols, || {
        format!("[{}, {}] vs [{}, {}]", a.rows, a.cols, b.rows, b.cols)
    })
}

/// The byte offsets of a matrix's weights, scales and biases, checked to lie in a buffer of
/// `len` bytes at even offsets (the kernels read u16s).
pub(crate) fn qref_offsets(op: &'static str, w: &QRef, len: usize) -> OpResult<[u64; 3]> {
    let r = w.byte_ranges();
    check(
        op,
        r.iter().all(|&(o, l)| o.is_multiple_of(2) && o + l <= len),
        || format!("matrix ranges {r:?} do not lie 2-byte aligned in {len} bytes"),
    )?;
    Ok(r.map(|(o, _)| o as u64))
}
