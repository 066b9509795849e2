//! `perplexity`: llama-perplexity's protocol over a text file.

use crate::notes::say;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::Args;

use mference_models::{Logits, Want};

use crate::flags::{count, ModelArgs};
use crate::load_options::load_options;
use crate::run_cmd::{load_text, lookahead_note};

/// `mference perplexity`.
#[derive(Args, Debug)]
pub struct PerplexityArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// UTF-8 text file to score.
    #[arg(long)]
    pub file: PathBuf,
    /// Tokens per chunk, at least 4 (the first is replaced by BOS; the second half is scored).
    #[arg(long, default_value_t = 512, value_parser = count(4, usize::MAX))]
    pub ctx: usize,
    /// Score only the first N tokens of the stream (BOS included).
    #[arg(long, value_parser = count(1, usize::MAX))]
    pub max_tokens: Option<usize>,
    /// Tokenize without a leading BOS (the stream llama-perplexity sees has one when the
    /// vocabulary adds BOS; chunk-initial BOS is set either way).
    #[arg(long)]
    pub no_stream_bos: bool,
}

/// Scored positions per forward call in `perplexity` (256 × a 262k vocabulary = 256 MiB of logits).
const SCORED_ROWS: usize = 256;

/// `mference perplexity`: llama-perplexity's protocol — chunks of `ctx` tokens, the first token of
/// each chunk replaced by BOS, the second half of each chunk scored.
pub fn perplexity(a: PerplexityArgs) -> Result<()> {
    let text = load_text(&a.model.model)?;
    if let Some(m) = text.max_positions {
        if a.ctx > m {
            bail!(
                "--ctx {} exceeds the model's max_position_embeddings {m}",
                a.ctx
            );
        }
    }
    let body = std::fs::read_to_string(&a.file)
        .with_context(|| format!("reading {}", a.file.display()))?;
    if let Some(m) = a.max_tokens {
        if m < a.ctx {
            bail!(
                "--max-tokens {m} is less than one --ctx {} chunk: raise --max-tokens or lower --ctx",
                a.ctx
            );
        }
    }
    // llama-perplexity's stream: `common_tokenize(text, add_special = true)`, so BOS first when
    // the vocabulary adds one; then every chunk's first token becomes BOS.
    let bos = text.tokenizer.bos_id();
    let mut ids: Vec<u32> = bos.filter(|_| !a.no_stream_bos).into_iter().collect();
    ids.extend(text.tokenizer.encode(&body, false)?);
    if let Some(m) = a.max_tokens {
        ids.truncate(m);
    }
    let chunks = ids.len() / a.ctx;
    if chunks == 0 {
        bail!(
            "{} has {} token{}, fewer than one --ctx {} chunk",
            a.file.display(),
            ids.len(),
            if ids.len() == 1 { "" } else { "s" },
            a.ctx
        );
    }
    let t_load = Instant::now();
    let mut model = mference_models::load(
        &a.model.model,
        &load_options(&a.model, a.ctx.clamp(32, 512).next_power_of_two(), a.ctx)?,
    )?;
    // The load line `run` prints: the device (and its kernel table) before the first chunk.
    say!(
        "[loaded {} in {:.2}s, device {}, expert cache {}; {chunks} chunks of {} tokens to score]",
        a.model.model.display(),
        t_load.elapsed().as_secs_f64(),
        model.device(),
        model.engine().expert_cache(),
        a.ctx
    );
    let vocab = model.vocab_size();
    let first = a.ctx / 2;
    let (mut nll, mut count) = (0.0f64, 0usize);
    let t0 = Instant::now();
    for c in 0..chunks {
        let mut chunk = ids[c * a.ctx..(c + 1) * a.ctx].to_vec();
        if let Some(b) = bos {
            chunk[0] = b;
        }
        model.truncate(0);
        model.forward(&chunk[..first], Want::None)?;
        // The scored half in pieces of at most SCORED_ROWS positions, so the logits held at once
        // stay bounded (rows · vocab floats) whatever --ctx is.
        for j0 in (first..a.ctx).step_by(SCORED_ROWS) {
            let j1 = (j0 + SCORED_ROWS).min(a.ctx);
            let Logits::Rows(logits) = model.forward(&chunk[j0..j1], Want::All)? else {
                bail!("model returned no logits")
            };
            for j in j0..j1.min(a.ctx - 1) {
                let row = &logits[(j - j0) * vocab..(j - j0 + 1) * vocab];
                let m = row.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
                let lse = m + row.iter().map(|&z| (z as f64 - m).exp()).sum::<f64>().ln();
                nll += lse - row[chunk[j + 1] as usize] as f64;
                count += 1;
            }
        }
        say!(
            "[chunk {}/{chunks}: running perplexity {:.4}]",
            c + 1,
            (nll / count as f64).exp()
        );
    }
    println!("perplexity: {:.4}", (nll / count as f64).exp());
    say!(
        "[{} chunks of {}, {} scored tokens, mean NLL {:.6}, {:.1}s, device {}, expert cache {}, kernels {}{}]",
        chunks,
        a.ctx,
        count,
        nll / count as f64,
        t0.elapsed().as_secs_f64(),
        model.device(),
        model.engine().expert_cache(),
        model.engine().kernels_label,
        lookahead_note(a.model.router_lookahead)
    );
    Ok(())
}
