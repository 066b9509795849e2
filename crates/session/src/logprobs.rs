//! Log-probabilities of generated tokens, as the OpenAI `logprobs` fields report them.

use crate::TextSide;

/// Log-probability of one generated token under the model's distribution: log-softmax of the
/// post-softcap logits, before the response-format mask, repetition penalty, top-k/top-p and
/// temperature.
#[derive(Debug, Clone)]
pub struct TokenLogprob {
    /// The token's text ([`TextSide::token_text`]).
    pub token: String,
    /// The token's bytes.
    pub bytes: Vec<u8>,
    /// Natural log of its probability (≤ 0).
    pub logprob: f32,
    /// The most likely tokens at this step, most likely first: text, bytes, logprob.
    pub top: Vec<(String, Vec<u8>, f32)>,
}

/// Log-softmax of `row` (`[vocab]`) at `id`, plus the `n` largest entries (f64 sums).
pub(crate) fn logprob(text: &TextSide, row: &[f32], id: u32, n: usize) -> TokenLogprob {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let lse = max
        + row
            .iter()
            .map(|&z| (z as f64 - max).exp())
            .sum::<f64>()
            .ln();
    let mut top: Vec<(f32, u32)> = Vec::with_capacity(n + 1);
    if n > 0 {
        for (i, &z) in row.iter().enumerate() {
            if top.len() < n || z > top[top.len() - 1].0 {
                let at = top.partition_point(|&(v, _)| v >= z);
                top.insert(at, (z, i as u32));
                top.truncate(n);
            }
        }
    }
    let (token, bytes) = text.token_text(id);
    TokenLogprob {
        token,
        bytes,
        logprob: (row[id as usize] as f64 - lse) as f32,
        top: top
            .into_iter()
            .map(|(z, i)| {
                let (t, b) = text.token_text(i);
                (t, b, (z as f64 - lse) as f32)
            })
            .collect(),
    }
}
