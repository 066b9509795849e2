//! The [`Model`] trait: one sequence of a loaded model, as the session and the CLI drive it.

use mference_runtime::StreamerStats;

use crate::{Engine, Logits, ModelError, Want};

/// One sequence of a loaded model: runs tokens through the layers and keeps the KV cache.
pub trait Model: Send {
    /// Runs `tokens` at the next positions (chunked by the prefill chunk), appending to the KV cache.
    fn forward(&mut self, tokens: &[u32], want: Want) -> Result<Logits, ModelError>;
    /// Positions in the KV cache.
    fn position(&self) -> usize;
    /// Keeps the first `n` cached positions; false when the cache cannot be cut there.
    fn truncate(&mut self, n: usize) -> bool;
    /// Saves what a later [`Model::truncate`] to the current position needs (a family with a
    /// recurrent state keeps one snapshot of it, replacing the previous one). A model whose whole
    /// state is its KV cache can be cut anywhere and does nothing.
    fn checkpoint(&mut self) {}
    /// Whether part of the state is recurrent or a sliding-window ring, so the cache can only be
    /// cut at 0, at the end or at a checkpoint once it has moved on (a ring that has wrapped): a
    /// caller that wants to rewind later runs its input in two pieces and calls
    /// [`Model::checkpoint`] between them.
    fn is_recurrent(&self) -> bool {
        false
    }
    /// The largest position `≤ n` that [`Model::truncate`] can cut to right now (0 always works).
    fn rewind_point(&self, n: usize) -> usize {
        n.min(self.position())
    }
    fn vocab_size(&self) -> usize;
    fn engine(&self) -> &Engine;
    /// Expert-cache counters per MoE layer (layers not opened yet report zeros).
    fn expert_stats(&self) -> Vec<StreamerStats>;
    /// The backend's own expert cache (GPU slots) counters, if it has one.
    fn device_expert_stats(&self) -> Option<mference_backend::DeviceExpertStats>;
    /// Where the model runs, for load lines: the backend's name, and on CUDA its expert slots
    /// (`cuda:0 NVIDIA H200 sm_90, GPU experts: 40 slots per layer, 12.03 GiB`).
    fn device(&self) -> String {
        let d = &self.engine().device;
        match self.device_expert_stats() {
            Some(g) => {
                let split = match (g.host_share, g.host_calibration) {
                    (Some(p), Some((copy, host))) => format!(
                        ", {p}% of each token's GPU misses on the CPU (--gpu-miss-split auto: one \
                         expert copied in {:.0} µs, on the CPU {:.0} µs)",
                        copy.as_secs_f64() * 1e6,
                        host.as_secs_f64() * 1e6
                    ),
                    (Some(p), None) => format!(", {p}% of each token's GPU misses on the CPU"),
                    _ => String::new(),
                };
                let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
                let staging = match g.staging_bytes {
                    0 => String::new(),
                    b => format!(" + {:.2} GiB prefill staging", gib(b)),
                };
                format!(
                    "{d}, GPU experts: {} slots per layer, {:.2} GiB{staging}{split}",
                    g.slots_per_layer,
                    gib(g.slab_bytes)
                )
            }
            None => {
                let e = self.engine();
                let note = e.kernels_note.as_ref().map(|n| format!(" ({n})"));
                match &e.device_fallback {
                    Some(why) => format!("{d}{} (--device auto: {why})", note.unwrap_or_default()),
                    None => format!("{d}{}", note.unwrap_or_default()),
                }
            }
        }
    }
    /// Sizes the backend's own expert cache now that the weights and the KV cache are placed
    /// (the load does this; a no-op without one).
    fn size_device_experts(&self) -> Result<(), ModelError>;
    /// Copies every routed expert into the backend's own cache where it holds all of a layer's
    /// experts (a `resident` GPU budget), as llama.cpp's full offload does at load; a no-op
    /// otherwise (and by default).
    fn preload_device_experts(&mut self) -> Result<(), ModelError> {
        Ok(())
    }
    /// Bytes of KV cache.
    fn kv_bytes(&self) -> usize;
    /// Time spent in each layer and in the head so far ([`StepTimes`]); empty for a family that
    /// does not record it.
    fn step_times(&self) -> StepTimes {
        StepTimes::default()
    }
}

/// Host time spent per layer (`[attention, ffn]`, the FFN's waits on expert reads included) and
/// in the head, summed over every forward pass: the per-layer cost a benchmark reports
/// (DeepSeek-V4 records it). On the CPU backend an op has finished when it returns, so this is
/// the layer's cost; on an asynchronous backend it would be launch time.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StepTimes {
    pub layers: Vec<[std::time::Duration; 2]>,
    pub head: std::time::Duration,
}
