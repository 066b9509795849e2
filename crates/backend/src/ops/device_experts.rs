//! The hooks of a backend's own expert cache (a GPU slot slab) that the MoE step
//! ([`crate::moe::routed_experts`]) calls; every default says "no cache of its own".

use super::CoreOps;
use crate::{Act, DeviceExpertStats, Mlp, OpResult, RouterSpec, Routes, Weights};

/// The backend's own expert cache (a GPU slot slab; `moe::routed_experts`). The defaults are a
/// backend without one: nothing held, every expert computed from its host slot.
#[allow(unused_variables)]
pub trait DeviceExpertOps: CoreOps {
    /// Which of the distinct `experts` of MoE layer `layer` the backend holds in its own memory,
    /// each counted as one use. Held experts are computed from [`Weights::Held`] and are not
    /// asked of the host streamer; the caller computes every one it is told is held (a held
    /// expert stays in place, whatever this step loads, until it is read). Default: none (the
    /// CPU computes from the host slots).
    fn held_experts(&self, layer: usize, experts: &[usize]) -> OpResult<Vec<bool>> {
        Ok(vec![false; experts.len()])
    }
    /// The weights to compute expert `expert` of `layer` from, given its bytes in a host slot.
    /// A backend with its own cache starts copying `blob` into a slot of it and returns
    /// [`Weights::Held`]; `blob` must then stay unchanged until
    /// [`expert_copies_done`](DeviceExpertOps::expert_copies_done). Default: `blob` itself.
    fn load_expert<'a>(
        &self,
        layer: usize,
        expert: usize,
        blob: &'a [u8],
    ) -> OpResult<Weights<'a>> {
        Ok(Weights::Blob(blob))
    }
    /// Router lookahead: starts copying `blob` (expert `expert` of `layer`, in a host slot,
    /// predicted for that layer's next step) into the backend's own cache, unless the backend
    /// would rather not (it holds the expert, or would evict a more used one). `blob` must then
    /// stay unchanged until [`expert_copies_done`](DeviceExpertOps::expert_copies_done). The
    /// cached bytes are the blob's, so results do not change (with a split,
    /// [`host_misses`](DeviceExpertOps::host_misses) then picks among fewer misses). Returns
    /// whether a copy started.
    /// Default: no cache, nothing copied.
    fn prefetch_expert(&self, layer: usize, expert: usize, blob: &[u8]) -> OpResult<bool> {
        Ok(false)
    }
    /// Waits until every copy [`load_expert`](DeviceExpertOps::load_expert) (or
    /// [`prefetch_expert`](DeviceExpertOps::prefetch_expert)) started has left its host
    /// slot, so the host streamer may refill it. Default: nothing to wait for.
    fn expert_copies_done(&self) -> OpResult<()> {
        Ok(())
    }
    /// Shows the backend the host slot memory of `layer`'s streamer (called on every MoE step;
    /// a GPU backend page-locks it once, so copies from it run at full bus speed).
    fn attach_host_slots(&self, layer: usize, slots: &[u8]) -> OpResult<()> {
        Ok(())
    }
    /// The counters of the backend's own expert cache, if it has one.
    fn device_expert_stats(&self) -> Option<DeviceExpertStats> {
        None
    }
    /// Whether the backend computes experts in place from the host's memory (the CPU): then a
    /// prefill step whose layer file is mapped reads and copies nothing, and may run its experts
    /// in fewer, larger tiles ([`crate::moe::in_place_tiles`]). A backend that copies each tile's
    /// experts into memory of its own (a GPU's staging) keeps the tiles the host slots allow.
    fn computes_in_place(&self) -> bool {
        false
    }
    /// The experts of MoE layer `layer` the backend's own cache has room to hold for good
    /// (every expert of the layer fits, e.g. `--gpu-expert-budget resident`) but does not hold
    /// yet: the decode step loads them once ([`moe::route_and_run`]), so that
    /// [`routes_on_device`](DeviceExpertOps::routes_on_device) holds from then on. Default: none.
    fn experts_to_complete(&self, layer: usize) -> OpResult<Vec<usize>> {
        Ok(Vec::new())
    }
    /// Whether [`routed_experts_held`](DeviceExpertOps::routed_experts_held) can run a decode step of
    /// MoE layer `layer` with `top_k` experts per token: the backend holds every expert of the
    /// layer for good, so the router's choice needs no readback. Default: no.
    fn routes_on_device(&self, layer: usize, top_k: usize) -> OpResult<bool> {
        Ok(false)
    }
    /// A decode step's routed experts without a readback (only after
    /// [`routes_on_device`](DeviceExpertOps::routes_on_device) said yes): routes the one row of `logits`
    /// (`[1, num_experts]`, as [`CoreOps::route`]; `spec.trace` must be off), computes the chosen
    /// experts of `layer` from its held copies on the one row `x` (as
    /// [`CoreOps::glu_mlp_rows`]) and adds each output times its weight to `acc` (`[1, hidden]`)
    /// in ascending expert id, as [`moe::routed_experts`] does after the readback: the same
    /// arithmetic in the same order, so the result is bit-identical to that path's.
    #[allow(clippy::too_many_arguments)]
    fn routed_experts_held(
        &self,
        layer: usize,
        experts: &Mlp,
        act: Act,
        x: &Self::Tensor,
        logits: &Self::Tensor,
        spec: &RouterSpec,
        acc: &mut Self::Tensor,
    ) -> OpResult<()> {
        Err(self.missing("routed_experts_held"))
    }
    /// Allocates the backend's own expert cache from what memory is left (called once the
    /// weights and the KV cache are placed; later calls do nothing). Default: nothing to size.
    fn size_expert_cache(&self) -> OpResult<()> {
        Ok(())
    }
    /// Which of a decode row's `misses` in MoE layer `layer` (routed experts its own cache does
    /// not hold, ascending) the backend would rather have computed on the host CPU, from their
    /// host slots, than copied in
    /// ([`glu_mlp_combine_split`](DeviceExpertOps::glu_mlp_combine_split)): a function of the
    /// routing so far and of settings fixed at load, never of timing. Default: none (every miss
    /// copied).
    fn host_misses(&self, layer: usize, misses: &[usize]) -> OpResult<Vec<bool>> {
        Ok(vec![false; misses.len()])
    }
    /// Whether [`host_misses`](DeviceExpertOps::host_misses) may name any miss (a split is on):
    /// a decode step then reads its row back with the routing
    /// ([`route_and_read`](DeviceExpertOps::route_and_read)). Default: no.
    fn splits_misses(&self) -> bool {
        false
    }
    /// [`CoreOps::route`] of `logits` and the values of `x`, in one readback where the backend
    /// can (the decode step of a split needs both). Default: one after the other.
    fn route_and_read(
        &self,
        logits: &Self::Tensor,
        spec: &RouterSpec,
        x: &Self::Tensor,
    ) -> OpResult<(Routes, Vec<f32>)> {
        Ok((self.route(logits, spec)?, self.read(x)?))
    }
    /// [`CoreOps::glu_mlp_combine`] with the experts `on_host[j]` computed on the host CPU from
    /// `srcs[j]` (a [`Weights::Blob`] in a host slot) on `x_host` (the one row of `x`, read
    /// before the step's other work was queued), while the others are copied in and computed
    /// by the backend; every output is added to `acc` in `j` order (ascending expert id) on the
    /// backend. The host products round differently from the backend's, so the sum is within
    /// the op tolerances of [`CoreOps::glu_mlp_combine`], not its bits. Default: refused unless
    /// nothing is on the host.
    #[allow(clippy::too_many_arguments)]
    fn glu_mlp_combine_split(
        &self,
        mlp: &Mlp,
        act: Act,
        srcs: &[Weights],
        weights: &[f32],
        on_host: &[bool],
        x: &Self::Tensor,
        x_host: &[f32],
        acc: &mut Self::Tensor,
    ) -> OpResult<()> {
        if on_host.iter().any(|&h| h) {
            return Err(self.missing("glu_mlp_combine_split (no host experts)"));
        }
        self.glu_mlp_combine(mlp, act, srcs, weights, x, acc)
    }
    /// Starts a prefill chunk's MoE step of `layer`: a backend with a staging area for a whole
    /// layer copies the step's misses ([`load_expert`](DeviceExpertOps::load_expert)) there
    /// instead of into its slots until
    /// [`end_prefill_staging`](DeviceExpertOps::end_prefill_staging). Same bytes, same results.
    /// Returns whether it does. Default: no.
    fn begin_prefill_staging(&self, layer: usize) -> OpResult<bool> {
        Ok(false)
    }
    /// Ends what [`begin_prefill_staging`](DeviceExpertOps::begin_prefill_staging) started, once
    /// the step's kernels are queued: `uses` are the step's routed experts with their row counts
    /// (empty after a failed step), and the slots are left holding the most used of them, as the
    /// tile path's copies would have. Default: nothing.
    fn end_prefill_staging(&self, layer: usize, uses: &[(usize, u64)]) -> OpResult<()> {
        Ok(())
    }
    /// Whether [`calibrate_host_misses`](DeviceExpertOps::calibrate_host_misses) would measure
    /// anything (the load reads an expert for it only then). Default: no.
    fn wants_host_calibration(&self) -> bool {
        false
    }
    /// Measures, for [`host_misses`](DeviceExpertOps::host_misses) in its automatic setting, what
    /// one expert costs copied in and computed on the host CPU: `blob` is one expert of the
    /// model in a host slot (already shown with
    /// [`attach_host_slots`](DeviceExpertOps::attach_host_slots)), `mlp` its matrices. Called once
    /// at load; does nothing unless the backend splits its misses. Default: nothing.
    fn calibrate_host_misses(&self, mlp: &Mlp, blob: &[u8]) -> OpResult<()> {
        Ok(())
    }
}
