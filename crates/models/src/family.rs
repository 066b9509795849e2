//! What a family writes and what follows from it: a family implements [`FamilyModel`] (its
//! forward over one chunk, where its shared parts live, its per-sequence state) and the blanket
//! impl gives it [`Model`] (chunking, position, vocabulary, stats, the device expert hooks).

use mference_backend::{Backend, DeviceExpertOps, DeviceExpertStats, KvCache};
use mference_runtime::StreamerStats;

use crate::{
    run_chunked, ChunkWant, Engine, Logits, Model, ModelError, RingSnapshot, StepTimes, Streamers,
    Want,
};

/// The parts every family holds: the engine, the backend, the expert streamers and the KV cache
/// (whose `len` is the sequence's position), and for a family whose whole state is its KV cache
/// the checkpoint of its rings.
pub struct Parts<'a, B: Backend> {
    pub engine: &'a Engine,
    pub be: &'a B,
    pub streamers: &'a Streamers,
    pub kv: &'a KvCache<B::Kv>,
    pub rings: Option<&'a RingSnapshot<B>>,
}

/// [`Parts`] with the streamers and the state mutable.
pub struct PartsMut<'a, B: Backend> {
    pub engine: &'a Engine,
    pub be: &'a B,
    pub streamers: &'a mut Streamers,
    pub kv: &'a mut KvCache<B::Kv>,
    pub rings: Option<&'a mut RingSnapshot<B>>,
}

/// The [`FamilyModel::parts`] and [`FamilyModel::parts_mut`] of a family struct whose fields are
/// named `engine`, `be`, `streamers` and `kv`, as every family's are; `family_parts!(rings)` for
/// one whose field `rings` ([`RingSnapshot`]) keeps its checkpoint.
#[macro_export]
#[doc(hidden)]
macro_rules! family_parts {
    ($($rings:ident)?) => {
        fn parts(&self) -> $crate::Parts<'_, Self::Backend> {
            $crate::Parts {
                engine: &self.engine,
                be: &self.be,
                streamers: &self.streamers,
                kv: &self.kv,
                rings: None $(.or(Some(&self.$rings)))?,
            }
        }

        fn parts_mut(&mut self) -> $crate::PartsMut<'_, Self::Backend> {
            $crate::PartsMut {
                engine: &self.engine,
                be: &self.be,
                streamers: &mut self.streamers,
                kv: &mut self.kv,
                rings: None $(.or(Some(&mut self.$rings)))?,
            }
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
    /// The shared parts, the streamers and the state mutable.
    fn parts_mut(&mut self) -> PartsMut<'_, Self::Backend>;
    /// Logits per row (the unpadded vocabulary).
    fn vocab(&self) -> usize;
    /// Time per layer and in the head, for a family that records it.
    fn times(&self) -> Option<&StepTimes> {
        None
    }
    /// [`Model::truncate`]; by default the KV cache's rule, with the rings' checkpoint if the
    /// family keeps one ([`RingSnapshot::truncate`]).
    fn truncate_state(&mut self, n: usize) -> bool {
        let p = self.parts_mut();
        match p.rings {
            Some(rings) => rings.truncate(p.be, p.kv, n),
            None => p.kv.truncate(n),
        }
    }
    /// [`Model::checkpoint`]; by default a copy of the rings if the family keeps one.
    fn checkpoint_state(&mut self) {
        let p = self.parts_mut();
        if let Some(rings) = p.rings {
            rings.checkpoint(p.be, p.kv);
        }
    }
    /// [`Model::is_recurrent`]; by default whether the family keeps a rings' checkpoint and has a
    /// ring.
    fn state_is_recurrent(&self) -> bool {
        let p = self.parts();
        p.rings.is_some() && RingSnapshot::<Self::Backend>::is_recurrent(p.kv)
    }
    /// [`Model::rewind_point`].
    fn state_rewind_point(&self, n: usize) -> usize {
        let p = self.parts();
        match p.rings {
            Some(rings) => rings.rewind_point(p.kv, n),
            None => n.min(p.kv.len),
        }
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
        let p = self.parts_mut();
        p.streamers.preload(p.be, p.engine)
    }

    fn kv_bytes(&self) -> usize {
        self.state_bytes()
    }

    fn step_times(&self) -> StepTimes {
        self.times().cloned().unwrap_or_default()
    }
}
