//! The generation loop shared by the CLI and the server: prefill the prompt, then decode one token
//! at a time until a stop token, the new-token budget, the context, or the caller says stop.

use std::time::{Duration, Instant};

use mference_runtime::Sampler;

use crate::{Logits, Model, ModelError, PrefixCache, Want};

/// Why generation ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StopReason {
    /// A stop token (end of turn / end of sequence) was sampled; it is not part of the output.
    StopToken(u32),
    /// The caller asked to stop (a stop string matched, a client went away).
    Caller,
    /// `max_new` tokens were generated.
    MaxNew,
    /// The KV cache is full.
    Context,
}

/// Timings and counts of one generation.
#[derive(Clone, Debug, Default)]
pub struct GenStats {
    pub prompt_tokens: usize,
    /// Prompt tokens whose state came from the retained prefix (not prefilled again).
    pub cached_tokens: usize,
    pub prefill: Duration,
    pub new_tokens: usize,
    pub decode: Duration,
}

/// Prefills `prompt` after the part of it `cache` already holds ([`PrefixCache::reuse`]; for a
/// recurrent model with a checkpoint before the last `turn_open` token) and samples up to
/// `max_new` tokens. `on_token(id)` sees every generated token that is not a stop token and
/// returns `false` to stop. Returns the stop reason and stats.
///
/// Errors: the model's (context overflow during prefill is an error; during decode it ends
/// generation with [`StopReason::Context`]).
#[allow(clippy::too_many_arguments)]
pub fn generate(
    model: &mut dyn Model,
    cache: &mut PrefixCache,
    prompt: &[u32],
    turn_open: Option<u32>,
    sampler: &mut Sampler,
    max_new: usize,
    stop_ids: &[u32],
    mut on_token: impl FnMut(u32) -> bool,
) -> Result<(StopReason, GenStats), ModelError> {
    let mut stats = GenStats {
        prompt_tokens: prompt.len(),
        ..Default::default()
    };
    let greedy = sampler.config().is_greedy();
    let want = if greedy { Want::Argmax } else { Want::Last };
    let mut history: Vec<u32> = prompt.to_vec();
    let t0 = Instant::now();
    stats.cached_tokens = cache.reuse(model, prompt);
    let mut out = cache.prefill(model, prompt, stats.cached_tokens, turn_open, want)?;
    stats.prefill = t0.elapsed();
    let t1 = Instant::now();
    let mut reason = StopReason::MaxNew;
    let max_context = model.engine().max_context;
    while stats.new_tokens < max_new {
        let pos = model.position();
        let next = match out {
            Logits::Argmax(id) => id,
            Logits::Rows(mut l) => sampler.sample(&mut l, &history, pos),
            Logits::None => unreachable!("forward asked for logits"),
        };
        if stop_ids.contains(&next) {
            reason = StopReason::StopToken(next);
            break;
        }
        stats.new_tokens += 1;
        history.push(next);
        if !on_token(next) {
            reason = StopReason::Caller;
            break;
        }
        if stats.new_tokens == max_new {
            break;
        }
        if pos + 1 > max_context {
            reason = StopReason::Context;
            break;
        }
        out = cache.forward(model, &[next], want)?;
    }
    stats.decode = t1.elapsed();
    Ok((reason, stats))
}
