//! What a family writes and what follows from it: a family implements [`FamilyModel`] (its
//! forward over one chunk, where its shared parts live, its per-sequence state) and the blanket
//! impl gives it [`Model`] (chunking, position, vocabulary, stats, the device expert hooks).

use mference_backend::{Backend, DeviceExpertOps, DeviceExpertStats};
use mference_runtime::StreamerStats;

use crate::{
    run_chunked, ChunkWant, Engine, Logits, Model, ModelError, SequenceState, StepTimes, Streamers,
    Want,
};

/// The parts every family holds: the engine, the backend, the expert streamers and the
/// sequence's state (whose `kv.len` is the sequence's position).
pub struct Parts<'a, B: Backend> {
    pub engine: &'a Engine,
    pub be: &'a B,
    pub streamers: &'a Streamers,
    pub state: &'a SequenceState<B>,
}

/// [`Parts`] with the streamers and the state mutable.
pub struct PartsMut<'a, B: Backend> {
    pub engine: &'a Engine,
    pub be: &'a B,
    pub streamers: &'a mut Streamers,
    pub state: &'a mut SequenceState<B>,
}

/// The [`FamilyModel::parts`] and [`FamilyModel::parts_mut`] of a family struct whose fields are
/// named `engine`, `be`, `streamers` and `state`, as every family's are.
#[macro_export]
#[doc(hidden)]
macro_rules! family_parts {
    () => {
        fn parts(&self) -> $crate::Parts<'_, Self::Backend> {
            $crate::Parts {
                engine: &self.engine,
                be: &self.be,
                streamers: &self.streamers,
                state: &self.state,
            }
        }

        fn parts_mut(&mut self) -> $crate::PartsMut<'_, Self::Backend> {
            $crate::PartsMut {
                engine: &self.engine,
                be: &self.be,
                streamers: &mut self.streamers,
                state: &mut self.state,
            }
        }
    };
}

/// A family's math and accessors; [`Model`] follows by the blanket impl below.
pub trait FamilyModel: Send + 'static {
    type Backend: Backend;

    /// Runs `tokens` (one chunk, at most the prefill chunk) at the next positions.
    fn forward_chunk(&mut self, tokens: &[u32], want: ChunkWant) -> Result<Logits, ModelError>;
    /// Called once per [`Model::forward`] before its chunks run (Maple notes single-token decode).
    fn begin_forward(&mut self, _tokens: &[u32]) {}
    /// The shared parts, read-only.
    fn parts(&self) -> Parts<'_, Self::Backend>;
    /// The shared parts, the streamers and the state mutable.
    fn parts_mut(&mut self) -> PartsMut<'_, Self::Backend>;
    /// Logits per row (the unpadded vocabulary).
    fn vocab(&self) -> usize;
    /// Time per layer and in the head, for a family that records it.
    fn times(&self) -> Option<&StepTimes> {
        None
    }
}

impl<F: FamilyModel> Model for F {
    fn forward(&mut self, tokens: &[u32], want: Want) -> Result<Logits, ModelError> {
        let p = self.parts();
        let (chunk, max, pos) = (p.engine.prefill_chunk, p.engine.max_context, p.state.kv.len);
        self.begin_forward(tokens);
        run_chunked(tokens, pos, chunk, max, want, |c, w| {
            self.forward_chunk(c, w)
        })
    }

    fn position(&self) -> usize {
        self.parts().state.kv.len
    }

    fn truncate(&mut self, n: usize) -> bool {
        let p = self.parts_mut();
        p.state.truncate(p.be, n)
    }

    fn checkpoint(&mut self) {
        let p = self.parts_mut();
        p.state.checkpoint(p.be)
    }

    fn is_recurrent(&self) -> bool {
        self.parts().state.is_recurrent()
    }

    fn rewind_point(&self, n: usize) -> usize {
        self.parts().state.rewind_point(n)
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
        let p = self.parts_mut();
        p.streamers.preload(p.be, p.engine)
    }

    fn kv_bytes(&self) -> usize {
        let p = self.parts();
        p.state.bytes(p.be)
    }

    fn step_times(&self) -> StepTimes {
        self.times().cloned().unwrap_or_default()
    }
}
