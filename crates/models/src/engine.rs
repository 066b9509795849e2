//! The [`Engine`]: what every family shares (install, mapped resident weights, settings, I/O).

use std::sync::Arc;

use mference_backend::cpu::CpuBackend;
use mference_format::{ExpertBlobLayout, Install, ResidentIndex};
use mference_kernels::Kernels;
use mference_runtime::streamer::IoPool;
use mference_runtime::{CacheSlots, ExpertPolicy, RoutingTrace};

use crate::{Device, LoadOptions, ModelError};

/// What every family shares: the install, the mapped resident file, the settings and the I/O pool.
pub struct Engine {
    pub install: Install,
    pub map: Arc<memmap2::Mmap>,
    pub index: ResidentIndex,
    /// The CPU kernel table the backend runs.
    pub kernels: &'static Kernels,
    /// Worker threads of the backend (the caller included).
    pub threads: usize,
    /// The backend the model runs on, as it names itself (`cpu avx512 x2`, `cuda:0 NVIDIA H200 sm_90`).
    pub device: String,
    /// What runs the model's products, as the backend names them ([`CoreOps::kernels`]: the CPU
    /// table's name, or `cuda`, whose own kernels leave the CPU table idle), for reports; set with
    /// `device` when the backend is attached.
    ///
    /// [`CoreOps::kernels`]: mference_backend::CoreOps::kernels
    pub kernels_label: &'static str,
    /// Why `--device auto` ran on the CPU (what CUDA lacked), if it did.
    pub device_fallback: Option<String>,
    /// Why `--kernels auto` kept the exact table where this CPU has a faster rounded one (a
    /// family not checked with it), for the load line.
    pub kernels_note: Option<String>,
    pub io: Arc<IoPool>,
    pub slots: CacheSlots,
    pub expert_policy: ExpertPolicy,
    pub direct_io: bool,
    pub prefill_chunk: usize,
    pub max_context: usize,
    /// [`LoadOptions::router_lookahead`].
    pub router_lookahead: usize,
    /// Per position, the smallest top-k margin seen by any layer's router (traced runs only).
    router_margins: Option<std::sync::Mutex<Vec<f32>>>,
    /// Recorded routing replayed instead of the routers' top-k ([`LoadOptions::routing_trace`]).
    routing: Option<RoutingTrace>,
    routing_path: String,
}

impl Engine {
    /// Whether routers should report their top-k margins ([`Engine::note_router_margins`]).
    pub fn traces_router(&self) -> bool {
        self.router_margins.is_some()
    }

    /// Records one layer's router top-k margins (the k-th largest logit minus the (k+1)-th, in
    /// logit units) of the rows at positions `pos0..`, keeping each position's smallest. A no-op
    /// unless the model was loaded with `trace_router`.
    pub fn note_router_margins(&self, pos0: usize, margins: &[f32]) {
        let Some(m) = &self.router_margins else {
            return;
        };
        let mut m = m.lock().unwrap_or_else(|e| e.into_inner());
        if m.len() < pos0 + margins.len() {
            m.resize(pos0 + margins.len(), f32::INFINITY);
        }
        for (i, &v) in margins.iter().enumerate() {
            m[pos0 + i] = m[pos0 + i].min(v);
        }
    }

    /// With a routing trace loaded: the recorded expert ids of `layer` for positions
    /// `pos0..pos0 + t` (`[t, top_k]`, the trace wrapping around at its end).
    pub fn forced_routes(&self, layer: usize, pos0: usize, t: usize) -> Option<Vec<usize>> {
        let tr = self.routing.as_ref()?;
        Some(
            (pos0..pos0 + t)
                .flat_map(|p| tr.ids(p, layer).iter().map(|&e| e as usize))
                .collect(),
        )
    }

    /// The host expert cache as the load line and the bench print it: slots per layer (or
    /// `resident`), the policy and the I/O mode, e.g. `22 slots/layer, policy pool, O_DIRECT`.
    pub fn expert_cache(&self) -> String {
        let slots = match self.slots {
            CacheSlots::Fixed(n) => format!("{n} slots/layer"),
            CacheSlots::Resident => "resident".into(),
        };
        let io = if self.direct_io { "O_DIRECT" } else { "pread" };
        format!("{slots}, policy {}, {io}", self.expert_policy.name())
    }

    /// Which routing runs: `"router"`, or `"trace FILE"`.
    pub fn routing(&self) -> String {
        match &self.routing {
            None => "router".into(),
            Some(_) => format!("trace {}", self.routing_path),
        }
    }

    /// The MoE checks every family makes at load, before anything is allocated: layout.json holds
    /// `experts` experts per layer, the slot cache can hold the `top_k` experts of one token, and a
    /// routing trace (if any) was recorded for `layers` layers, `experts` experts and `top_k`.
    pub fn check_moe(&self, layers: usize, experts: usize, top_k: usize) -> Result<(), ModelError> {
        let per_layer = self.install.layout.experts_per_layer;
        if per_layer != experts {
            return Err(ModelError::Config(format!(
                "layout.json has {per_layer} experts per layer, config.json {experts}"
            )));
        }
        if self.slots.count(experts) < top_k {
            return Err(ModelError::Config(format!(
                "{} expert cache slots cannot hold the {top_k} experts one token routes to",
                self.slots.count(experts)
            )));
        }
        let Some(t) = &self.routing else {
            return Ok(());
        };
        if t.layers != layers || t.top_k != top_k || t.max_id() as usize >= experts {
            return Err(ModelError::Config(format!(
                "routing trace {} is [{} tokens, {} layers, top-{}] with ids up to {}; this model \
                 has {layers} MoE layers, {experts} experts, top-{top_k}",
                self.routing_path,
                t.tokens,
                t.layers,
                t.top_k,
                t.max_id()
            )));
        }
        Ok(())
    }

    /// Where the expert tensors of MoE layer `layer` sit inside each expert blob (layout.json).
    pub fn expert_blob(&self, layer: usize) -> Result<&ExpertBlobLayout, ModelError> {
        self.install
            .layout
            .layer(layer)
            .and_then(|l| l.blob.as_ref())
            .ok_or_else(|| {
                ModelError::Config(format!("layout.json has no experts for MoE layer {layer}"))
            })
    }

    /// The CPU backend over this install's resident bytes.
    pub fn cpu_backend(&self) -> CpuBackend {
        CpuBackend::new(self.kernels, self.threads, self.map.clone())
    }

    /// Per absolute position, the smallest router top-k margin recorded (empty when untraced).
    pub fn router_margins(&self) -> Vec<f32> {
        self.router_margins
            .as_ref()
            .map(|m| m.lock().unwrap_or_else(|e| e.into_inner()).clone())
            .unwrap_or_default()
    }

    /// Maps the install's resident weights and checks the settings.
    pub fn new(install: Install, opts: &LoadOptions) -> Result<Self, ModelError> {
        let path = install.weights_path();
        let file = std::fs::File::open(&path).map_err(|source| ModelError::Map {
            path: path.display().to_string(),
            source,
        })?;
        // SAFETY: the install is read-only by contract; nothing in this process writes or truncates
        // model_weights.bin while it is mapped.
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|source| ModelError::Map {
            path: path.display().to_string(),
            source,
        })?;
        let index = ResidentIndex::parse(&map)?;
        let kernels = match &opts.kernels {
            Some(name) => {
                // MFERENCE_KERNELS applies to `auto` only: say so where it is set and passed over.
                if let Some(env) = std::env::var("MFERENCE_KERNELS")
                    .ok()
                    // (A value this CPU does not run was already said to be ignored.)
                    .filter(|v| v.trim() != name && Kernels::by_name(v.trim()).is_some())
                {
                    eprintln!(
                        "mference: --kernels {name} is used, not MFERENCE_KERNELS={env} (which \
                         applies to --kernels auto)"
                    );
                }
                Kernels::by_name(name).ok_or_else(|| {
                    ModelError::Config(format!(
                        "kernel variant '{name}' is not available on this CPU"
                    ))
                })?
            }
            None => Kernels::detect(),
        };
        const MAX_CONTEXT: usize = 1 << 24;
        if opts.max_context > MAX_CONTEXT {
            return Err(ModelError::Config(format!(
                "max context {} is beyond the supported {MAX_CONTEXT} positions",
                opts.max_context
            )));
        }
        if opts.expert_policy == ExpertPolicy::Pool && opts.device != Device::Cpu {
            // A GPU backend pins each layer's host slots; a pool's layers share one slab.
            return Err(ModelError::Config(
                "--expert-cache-policy pool runs on the CPU backend only (--device cpu); with a \
                 GPU use lfu or lru"
                    .into(),
            ));
        }
        if opts.prefill_chunk == 0 || opts.max_context == 0 {
            return Err(ModelError::Config(
                "prefill chunk and max context must be positive".into(),
            ));
        }
        // More slots than a layer has experts hold nothing more (the streamer uses
        // `count(experts)`): the engine states the slots that exist.
        let slots = match (opts.slots, install.layout.experts_per_layer) {
            (CacheSlots::Fixed(n), experts) if experts > 0 && n > experts => {
                CacheSlots::Fixed(experts)
            }
            (s, _) => s,
        };
        Ok(Self {
            install,
            map: Arc::new(map),
            index,
            kernels,
            threads: opts.threads.max(1),
            device: String::new(),
            kernels_label: "",
            device_fallback: None,
            kernels_note: None,
            io: IoPool::new(4),
            slots,
            expert_policy: opts.expert_policy,
            direct_io: opts.direct_io,
            prefill_chunk: opts.prefill_chunk,
            max_context: opts.max_context,
            router_lookahead: opts.router_lookahead,
            router_margins: opts.trace_router.then(|| std::sync::Mutex::new(Vec::new())),
            routing: opts
                .routing_trace
                .as_deref()
                .map(RoutingTrace::open)
                .transpose()?,
            routing_path: opts
                .routing_trace
                .as_ref()
                .map(|p| p.display().to_string())
                .unwrap_or_default(),
        })
    }
}
