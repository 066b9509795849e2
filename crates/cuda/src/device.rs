//! The device: probing the driver, creating the context and stream, loading the kernels (compiled by
//! NVRTC, `compile.rs`), the profile, and [`CudaBackend`] itself.

use crate::*;

/// Every kernel of `ops/`, loaded at startup (a missing one fails [`CudaBackend::new`]).
pub(crate) const KERNELS: [&str; 88] = [
    "all_finite",
    "matmul_bf16",
    "linear",
    "gather_rows",
    "gather_rows_many",
    "join_parts",
    "split_parts",
    "unary",
    "mul_cols",
    "mul_sigmoid",
    "mul_silu",
    "mul_rows_sigmoid",
    "add_scaled",
    "scatter_add",
    "scatter_add_many",
    "glu_act",
    "rms_norm",
    "rms_norm_add",
    "rms_norm_rope",
    "rms_norm_rope_kv_f16",
    "rms_norm_rope_kv_f32",
    "rms_norm_add_pre",
    "rms_norm2_add_pre",
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
    "qmv2_p",
    "qmv4_p",
    "qmv8_p",
    "qmv_ids2_p",
    "qmv_ids4_p",
    "qmv_ids8_p",
    "qmv_glu2_p",
    "qmv_glu4_p",
    "qmv_glu8_p",
    "qmv_glu_ids2_p",
    "qmv_glu_ids4_p",
    "qmv_glu_ids8_p",
    "qgemm",
    "qgemm_tc",
    "qgemm_tc4",
    "qt_split_x",
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
    "place_cols",
    "hc_mix_parts",
    "hc_pre_row",
    "hc_post",
    "compress_pool",
    "index_scores",
    "attention_tiled4_f16",
    "attention_tiled8_f16",
    "attention_tiled16_f16",
    "attention_tiled4_f32",
    "attention_tiled8_f32",
    "attention_tiled16_f32",
    "conv1d_causal",
    "conv1d_causal_rows",
    "conv1d_keep",
    "delta_gates",
    "gated_delta_rule",
    "route",
    "route_one",
    "route_warps",
    "qmv_down_combine2",
    "qmv_down_combine4",
    "qmv_down_combine8",
    "qmv_down_combine_ids2",
    "qmv_down_combine_ids4",
    "qmv_down_combine_ids8",
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

/// The CUDA backend: one device, one stream, the resident bytes in device memory.
pub struct CudaBackend {
    pub(crate) stream: Arc<CudaStream>,
    pub(crate) _module: Arc<CudaModule>,
    pub(crate) funcs: HashMap<&'static str, CudaFunction>,
    pub(crate) resident: CudaSlice<u8>,
    /// An expert blob's device copy (grown to the largest blob seen).
    pub(crate) staging: Mutex<Option<CudaSlice<u8>>>,
    /// Host constants already uploaded, by their bit patterns.
    pub(crate) consts: Mutex<Vec<Constant>>,
    /// The GPU expert slots ([`CudaBackend::with_expert_cache`]).
    pub(crate) experts: Option<Mutex<GpuExperts>>,
    pub(crate) name: String,
    pub(crate) origin: KernelOrigin,
    /// Launches and their time per (op, kernel), with `MFERENCE_CUDA_PROFILE` set: `host` times
    /// only the host's side of each launch (and each readback's wait); any other value
    /// synchronizes every launch before and after, timing the device (slow; for finding where
    /// the time goes).
    pub(crate) profile: Option<(bool, Mutex<Profile>)>,
    /// Freed activation buffers kept for reuse.
    pub(crate) reuse: Arc<Reuse>,
    /// Kernel launches since load (every op, counted by `launch!`).
    pub(crate) launches: std::sync::atomic::AtomicU64,
    /// Programmatic dependent launch: each kernel may start (and wait in `grid_dep_wait`) while
    /// the previous one runs. On for compute capability 9.0 and later unless
    /// `MFERENCE_CUDA_PDL=0`.
    pub(crate) pdl: bool,
    /// The share of decode misses computed on the host CPU (`--gpu-miss-split`), if any.
    pub(crate) host: Option<crate::host_experts::HostExperts>,
}

/// (op, kernel) → (launches, time from launch to its end).
type Profile = BTreeMap<(&'static str, &'static str), (u64, std::time::Duration)>;

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
            launches: Default::default(),
            pdl: major >= 9 && std::env::var_os("MFERENCE_CUDA_PDL").is_none_or(|v| v != "0"),
            host: None,
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

    pub(crate) fn cache_err(&self, op: &'static str, e: CacheError) -> OpError {
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
    pub(crate) fn cache(&self) -> Option<std::sync::MutexGuard<'_, GpuExperts>> {
        self.experts
            .as_ref()
            .map(|m| m.lock().unwrap_or_else(|e| e.into_inner()))
    }

    /// Where the kernels came from (cache entry or a fresh compile).
    pub fn kernel_origin(&self) -> &KernelOrigin {
        &self.origin
    }

    /// With profiling on: waits for the queued work, returns the start of the next launch.
    pub(crate) fn profile_start(&self) -> Option<std::time::Instant> {
        let (sync, _) = self.profile.as_ref()?;
        if *sync {
            let _ = self.stream.synchronize();
        }
        Some(std::time::Instant::now())
    }

    /// With profiling on: waits for the launch begun at `t0`, adds its time.
    pub(crate) fn profile_end(
        &self,
        op: &'static str,
        kernel: &'static str,
        t0: Option<std::time::Instant>,
    ) {
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

    pub(crate) fn dev(&self, op: &'static str, e: DriverError) -> OpError {
        OpError::Device {
            backend: self.name.clone(),
            op,
            why: e.to_string(),
        }
    }
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
pub(crate) fn keep_pool_memory(ctx: &Arc<CudaContext>) -> Result<(), CudaError> {
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
pub(crate) fn load_kernels(
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
