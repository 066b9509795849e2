//! What a family writes and what follows from it: a family implements [`FamilyModel`] (its
//! forward over one chunk, where its shared parts live, its per-sequence state) and the blanket
//! impl gives it [`Model`] (chunking, position, vocabulary, stats, the device expert hooks).

use mference_backend::{Backend, DeviceExpertStats, KvCache};
use mference_runtime::StreamerStats;

use crate::{
    run_chunked, ChunkWant, Engine, Logits, Model, ModelError, StepTimes, Streamers, Want,
};

/// The parts every family holds: the engine, the backend, the expert streamers and the KV cache
/// (whose `len` is the sequence's position).
pub struct Parts<'a, B: Backend> {
    pub engine: &'a Engine,
    pub be: &'a B,
    pub streamers: &'a Streamers,
    pub kv: &'a KvCache<B::Kv>,
}

/// The [`FamilyModel::parts`] and [`FamilyModel::streamers_mut`] of a family struct whose fields
/// are named `engine`, `be`, `streamers` and `kv`, as every family's are.
#[macro_export]
#[doc(hidden)]
macro_rules! family_parts {
    () => {
        fn parts(&self) -> $crate::Parts<'_, Self::Backend> {
            $crate::Parts {
                engine: &self.engine,
                be: &self.be,
                streamers: &self.streamers,
                kv: &self.kv,
            }
        }

        fn streamers_mut(&mut self) -> (&Self::Backend, &$crate::Engine, &mut $crate::Streamers) {
            (&self.be, &self.engine, &mut self.streamers)
        }
    };
}

/// A family's math and accessors; [`Model`] follows by the blanket impl below.
pub trait FamilyModel: Send + 'static {
    type Backend: Backend;
    /// Whether the load fills the backend's own expert cache where it holds every expert of a
    /// layer ([`Model::preload_device_experts`]); families not yet run that way leave it off.
    const PRELOADS_DEVICE_EXPERTS: bool = false;

    /// Runs `tokens` (one chunk, at most the prefill chunk) at the next positions.
    fn forward_chunk(&mut self, tokens: &[u32], want: ChunkWant) -> Result<Logits, ModelError>;
    /// Called once per [`Model::forward`] before its chunks run (Maple notes single-token decode).
    fn begin_forward(&mut self, _tokens: &[u32]) {}
    /// The shared parts, read-only.
    fn parts(&self) -> Parts<'_, Self::Backend>;
    /// The backend, the engine and the expert streamers, the last mutable.
    fn streamers_mut(&mut self) -> (&Self::Backend, &Engine, &mut Streamers);
    /// Logits per row (the unpadded vocabulary).
    fn vocab(&self) -> usize;
    /// Time per layer and in the head, for a family that records it.
    fn times(&self) -> Option<&StepTimes> {
        None
    }
    /// [`Model::truncate`].
    fn truncate_state(&mut self, n: usize) -> bool;
    /// [`Model::checkpoint`].
    fn checkpoint_state(&mut self) {}
    /// [`Model::is_recurrent`].
    fn state_is_recurrent(&self) -> bool {
        false
    }
    /// [`Model::rewind_point`].
    fn state_rewind_point(&self, n: usize) -> usize {
        n.min(self.parts().kv.len)
    }
    /// [`Model::kv_bytes`].
    fn state_bytes(&self) -> usize {
        self.parts().kv.bytes()
    }
}

impl<F: FamilyModel> Model for F {
    fn forward(&mut self, tokens: &[u32], want: Want) -> Result<Logits, ModelError> {
        let p = self.parts();
        let (chunk, max, pos) = (p.engine.prefill_chunk, p.engine.max_context, p.kv.len);
        self.begin_forward(tokens);
        run_chunked(tokens, pos, chunk, max, want, |c, w| {
            self.forward_chunk(c, w)
        })
    }

    fn position(&self) -> usize {
        self.parts().kv.len
    }

    fn truncate(&mut self, n: usize) -> bool {
        self.truncate_state(n)
    }

    fn checkpoint(&mut self) {
        self.checkpoint_state()
    }

    fn is_recurrent(&self) -> bool {
        self.state_is_recurrent()
    }

    fn rewind_point(&self, n: usize) -> usize {
        self.state_rewind_point(n)
    }

    fn vocab_size(&self) -> usize {
        self.vocab()
    }

    fn engine(&self) -> &Engine {
        self.parts().engine
    }

    fn expert_stats(&self) -> Vec<StreamerStats> {
        self.parts().streamers.stats()
    }

    fn device_expert_stats(&self) -> Option<DeviceExpertStats> {
        self.parts().be.device_expert_stats()
    }

    fn size_device_experts(&self) -> Result<(), ModelError> {
        Ok(self.parts().be.size_expert_cache()?)
    }

    fn preload_device_experts(&mut self) -> Result<(), ModelError> {
        if !F::PRELOADS_DEVICE_EXPERTS {
            return Ok(());
        }
        let (be, engine, streamers) = self.streamers_mut();
        streamers.preload(be, engine)
    }

    fn kv_bytes(&self) -> usize {
        self.state_bytes()
    }

    fn step_times(&self) -> StepTimes {
        self.times().cloned().unwrap_or_default()
    }
}
