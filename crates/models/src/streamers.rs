//! The per-layer expert streamers a family reads its routed experts through.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use mference_backend::{Backend, Mlp, QRef};
use mference_runtime::{CachePlan, CacheSlots, ExpertStreamer, StreamerStats};

use crate::{Engine, ModelError};

/// The per-layer expert streamers, opened on a layer's first use (after its file is checked),
/// with their slots as the engine's policy hands them out ([`CachePlan`]).
pub struct Streamers {
    layers: Vec<Option<ExpertStreamer>>,
    plan: Option<CachePlan>,
}

impl Streamers {
    pub(crate) fn new(n: usize) -> Self {
        Self {
            layers: (0..n).map(|_| None).collect(),
            plan: None,
        }
    }

    /// The streamer of `layer`, its file checked per the verify policy on first use and opened
    /// then unless it was opened at load (a `resident` layer mapped by
    /// [`Streamers::populate_mapped`]): a file damaged after the load still fails the request
    /// that first reads it. Later calls find the check done (one lookup).
    pub fn get(
        &mut self,
        layer: usize,
        engine: &Engine,
    ) -> Result<&mut ExpertStreamer, ModelError> {
        engine.install.check_layer_file(layer)?;
        self.open(layer, engine)
    }

    /// The streamer of `layer`, opened on first use, its file not checked here.
    fn open(&mut self, layer: usize, engine: &Engine) -> Result<&mut ExpertStreamer, ModelError> {
        if self.layers[layer].is_none() {
            let l = &engine.install.layout;
            if self.plan.is_none() {
                let moe_layers = l.layers.iter().filter(|x| x.blob.is_some()).count();
                self.plan = Some(CachePlan::new(
                    engine.expert_policy,
                    engine.slots,
                    l.experts_per_layer,
                    l.expert_stride,
                    moe_layers,
                    self.layers.len(),
                )?);
            }
            let plan = self.plan.as_ref().expect("made above");
            let s = plan.open(
                layer,
                &engine.install.layer_path(layer),
                engine.direct_io,
                Arc::clone(&engine.io),
            )?;
            self.layers[layer] = Some(s);
        }
        Ok(self.layers[layer].as_mut().expect("opened above"))
    }

    /// Fills the backend's own expert cache at load where it holds every expert of a layer
    /// ([`crate::Model::preload_device_experts`]). Where it does not (a GPU expert budget below
    /// the layer) but the host tier has a slot for every expert of the layer, the host tier is
    /// read and page-locked now ([`mference_backend::moe::fill_host`]), as llama.cpp holds its
    /// host-side experts from the start: the first prompt then streams them from pinned memory
    /// instead of reading and pinning them on the way. A CPU backend's `resident` layers are
    /// opened and mapped here ([`Streamers::populate_mapped`]); other layers open their file (and
    /// check it) on first use.
    ///
    /// The first layer whose experts the backend does not hold for good also gives the backend
    /// one of its experts to time ([`mference_backend::DeviceExpertOps::calibrate_host_misses`]:
    /// `--gpu-miss-split auto` weighs a copy against the host CPU's product).
    pub fn preload<B: Backend>(&mut self, be: &B, engine: &Engine) -> Result<(), ModelError> {
        if be.device_expert_stats().is_none() {
            self.populate_mapped(engine)?;
        }
        let experts = engine.install.layout.experts_per_layer;
        let mut calibrated = false;
        for layer in 0..self.layers.len() {
            let Some(blob) = &engine.install.layout.layers[layer].blob else {
                continue;
            };
            let missing = be.experts_to_complete(layer)?;
            if !missing.is_empty() {
                mference_backend::moe::complete::<B, ModelError>(
                    be,
                    self.get(layer, engine)?,
                    &missing,
                )?;
            } else if be.device_expert_stats().is_some() && !be.routes_on_device(layer, 1)? {
                let s = self.get(layer, engine)?;
                if s.slots() >= experts && !s.slot_memory().is_empty() {
                    mference_backend::moe::fill_host::<B, ModelError>(be, s, experts)?;
                }
                if !calibrated && be.wants_host_calibration() {
                    let stride = engine.install.layout.expert_stride as usize;
                    let ex = |part: &str, t| {
                        QRef::expert(&format!("layer {layer} experts' {part}"), t, stride)
                            .map_err(ModelError::from)
                    };
                    let mlp = Mlp {
                        gate_proj: ex("gate_proj", &blob.gate)?,
                        up_proj: ex("up_proj", &blob.up)?,
                        down_proj: ex("down_proj", &blob.down)?,
                    };
                    be.attach_host_slots(layer, s.slot_memory())?;
                    let slots = s.acquire(&[0])?;
                    s.wait()?;
                    be.calibrate_host_misses(&mlp, s.blob(slots[0].0))?;
                    s.release(&[0]);
                    calibrated = true;
                }
            }
        }
        Ok(())
    }

    /// Where the install's expert files are mapped (`resident` slots without O_DIRECT) and the
    /// backend computes from the host's memory, opens every MoE layer now and maps its pages
    /// ([`ExpertStreamer::populate`]), the layers shared out over the engine's threads: the load
    /// pays for the mapping, as llama.cpp's does, instead of the first prompt. Not where the
    /// expert files exceed the memory this process can use (a `resident` asked for on a smaller
    /// machine): their pages map on first use then, and the load says so.
    fn populate_mapped(&mut self, engine: &Engine) -> Result<(), ModelError> {
        if engine.slots != CacheSlots::Resident || engine.direct_io {
            return Ok(());
        }
        let moe: Vec<usize> = (0..self.layers.len())
            .filter(|&l| engine.install.layout.layers[l].blob.is_some())
            .collect();
        let l = &engine.install.layout;
        let bytes = moe.len() as u64 * l.experts_per_layer as u64 * l.expert_stride;
        let (usable, from) = mference_runtime::sizing::usable_memory();
        if bytes > usable {
            eprintln!(
                "mference: the expert files ({:.2} GB) exceed the memory this process can use \
                 ({:.2} GB, {from}): they are not mapped at load, their pages map on first use",
                bytes as f64 / 1e9,
                usable as f64 / 1e9
            );
            return Ok(());
        }
        // Opened, not checked: each layer's file is checked at its first use, as before.
        for &l in &moe {
            self.open(l, engine)?;
        }
        let (next, unmapped, layers) = (AtomicUsize::new(0), AtomicUsize::new(0), &self.layers);
        let work = || -> Result<(), ModelError> {
            while let Some(&l) = moe.get(next.fetch_add(1, Ordering::Relaxed)) {
                let Some(s) = &layers[l] else { continue };
                match s.populate() {
                    Ok(true) => {}
                    Ok(false) => {
                        unmapped.fetch_add(1, Ordering::Relaxed);
                    }
                    Err(e) => {
                        // The other threads stop at their next layer.
                        next.store(moe.len(), Ordering::Relaxed);
                        return Err(e.into());
                    }
                }
            }
            Ok(())
        };
        std::thread::scope(|sc| {
            let helpers: Vec<_> = (1..engine.threads.min(moe.len()))
                .map(|_| sc.spawn(work))
                .collect();
            let mine = work();
            helpers
                .into_iter()
                .map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
                .chain([mine])
                .collect::<Result<(), ModelError>>()
        })?;
        let n = unmapped.into_inner();
        if n > 0 {
            eprintln!(
                "mference: {n} of {} expert files could not be mapped at load (this kernel refused \
                 MADV_POPULATE_READ): their pages map on first use",
                moe.len()
            );
        }
        Ok(())
    }

    /// The streamer of `layer` and, when `next` and a layer follows, the one of `layer + 1` (both
    /// opened as by [`Streamers::get`]): the router lookahead prefetches into the second while the
    /// first serves the current layer.
    pub fn with_next(
        &mut self,
        layer: usize,
        next: bool,
        engine: &Engine,
    ) -> Result<(&mut ExpertStreamer, Option<&mut ExpertStreamer>), ModelError> {
        let next = next && layer + 1 < self.layers.len();
        if next {
            self.get(layer + 1, engine)?;
        }
        self.get(layer, engine)?;
        let (this, rest) = self.layers.split_at_mut(layer + 1);
        let this = this[layer].as_mut().expect("opened above");
        Ok((
            this,
            rest.first_mut().filter(|_| next).and_then(Option::as_mut),
        ))
    }

    /// Counters per layer.
    pub fn stats(&self) -> Vec<StreamerStats> {
        self.layers
            .iter()
            .map(|s| s.as_ref().map(|s| s.stats()).unwrap_or_default())
            .collect()
    }
}
