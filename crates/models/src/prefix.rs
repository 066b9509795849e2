//! The one retained conversation prefix, shared by `serve` (single-prefix prompt cache) and
//! `run --chat`: which token ids the model's state holds, how much of a new prompt they cover,
//! and, for a family with a recurrent state, the checkpoint a follow-up turn rewinds to.

use crate::{Logits, Model, ModelError, Want};

/// Exactly the token ids whose state (KV cache, recurrent state) a model holds at positions
/// `0..held().len()`.
#[derive(Debug, Default)]
pub struct PrefixCache {
    held: Vec<u32>,
}

impl PrefixCache {
    pub fn new() -> Self {
        Self::default()
    }

    /// The ids the model holds.
    pub fn held(&self) -> &[u32] {
        &self.held
    }

    /// Cuts the model to the longest prefix it shares with `prompt` that it can cut to
    /// ([`Model::rewind_point`]), leaving at least one prompt token to run (for the logits);
    /// returns how many prompt tokens are reused (0: the model was cleared).
    pub fn reuse(&mut self, model: &mut dyn Model, prompt: &[u32]) -> usize {
        let shared = self
            .held
            .iter()
            .zip(prompt)
            .take_while(|(a, b)| a == b)
            .count();
        let keep = model.rewind_point(shared.min(prompt.len().saturating_sub(1)));
        if keep > 0 && model.truncate(keep) {
            self.held.truncate(keep);
            return keep;
        }
        self.clear(model);
        0
    }

    /// Runs `tokens` through the model and records them; after a failure the state is unknown,
    /// so the model is cleared.
    pub fn forward(
        &mut self,
        model: &mut dyn Model,
        tokens: &[u32],
        want: Want,
    ) -> Result<Logits, ModelError> {
        match model.forward(tokens, want) {
            Ok(l) => {
                self.held.extend_from_slice(tokens);
                Ok(l)
            }
            Err(e) => {
                self.clear(model);
                Err(e)
            }
        }
    }

    /// Runs `prompt[start..]`. A recurrent state can only be rewound to a checkpoint, so for such
    /// a model the prompt runs in two pieces with a checkpoint before its last `turn_open` token
    /// (the assistant-turn opener, where the conversation's next prompt departs from this one).
    pub fn prefill(
        &mut self,
        model: &mut dyn Model,
        prompt: &[u32],
        start: usize,
        turn_open: Option<u32>,
        want: Want,
    ) -> Result<Logits, ModelError> {
        let mut start = start;
        if model.is_recurrent() {
            if let Some(cut) = prompt.iter().rposition(|&t| Some(t) == turn_open) {
                if cut > start {
                    self.forward(model, &prompt[start..cut], Want::None)?;
                    model.checkpoint();
                    start = cut;
                }
            }
        }
        self.forward(model, &prompt[start..], want)
    }

    /// Forgets everything (position 0 is always a valid cut).
    pub fn clear(&mut self, model: &mut dyn Model) {
        self.held.clear();
        let ok = model.truncate(0);
        debug_assert!(ok, "the model refused to clear");
    }
}
