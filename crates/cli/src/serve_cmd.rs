//! `serve`: the OpenAI-compatible HTTP server (`mference-server`).

use crate::notes::say;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Args;

use mference_server::{BindMode, PromptCacheMode, ServerConfig};

use crate::flags::{count, typed, ModelArgs};
use crate::load_options::{load_options_for, open_install};

/// Context sizes the server accepts, as the original (`ServerArguments.swift`).
const CONTEXTS: [usize; 6] = [4096, 8192, 16384, 32768, 65536, 128000];

/// `mference serve`.
#[derive(Args, Debug)]
pub struct ServeArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// TCP port.
    #[arg(long, default_value_t = 8080)]
    pub port: u16,
    /// loopback (127.0.0.1) or tailnet (the one 100.64.0.0/10 address of `tailscale ip -4`).
    #[arg(long, default_value = "loopback")]
    pub bind: String,
    /// The id clients send as `model` (default: the family's id, e.g. gemma-4-26b-a4b-it).
    #[arg(long, value_parser = typed(model_id))]
    pub model_id: Option<String>,
    /// KV cache positions: 4096, 8192, 16384, 32768, 65536 or 128000 (default 16384, or the
    /// largest of these the model's max_position_embeddings allows).
    #[arg(long, value_parser = typed(context_size))]
    pub max_context: Option<usize>,
    /// Requests that may wait behind the running one (at least 1); more get 429.
    #[arg(long, default_value_t = 4, value_parser = count(1, usize::MAX))]
    pub queue_limit: usize,
    /// off or single-prefix (reuse the KV of the previous prompt's shared prefix).
    #[arg(long, default_value = "single-prefix")]
    pub prompt_cache_mode: String,
    /// Prefill chunk rows: 32, 64, 128, 256, 512, 1024, 2048, 4096 or auto (128 here: request
    /// lengths are not known in advance).
    #[arg(long, default_value = "auto", value_parser = crate::run_cmd::prefill_chunk_flag())]
    pub prefill_chunk: String,
}

/// `--model-id`: any text but blank.
fn model_id(s: &str) -> Result<String, String> {
    if s.trim().is_empty() {
        return Err("--model-id must not be empty (leave it out for the family's id)".into());
    }
    Ok(s.to_string())
}

/// `--max-context`: one of [`CONTEXTS`].
fn context_size(s: &str) -> Result<usize, String> {
    match s.trim().parse::<usize>() {
        Ok(c) if CONTEXTS.contains(&c) => Ok(c),
        _ => Err(format!(
            "invalid --max-context {s}: allowed values are 4096, 8192, 16384, 32768, 65536, 128000"
        )),
    }
}

/// `mference serve`: validate, load the model, then open the port and print the ready line; on
/// SIGTERM or SIGINT shut down gracefully and exit 0.
pub fn serve(a: ServeArgs) -> Result<()> {
    let prefill_chunk = crate::run_cmd::parse_prefill_chunk(&a.prefill_chunk, None)?;
    crate::run_cmd::check_install_dir(&a.model.model)?;
    let bind = BindMode::parse(&a.bind).map_err(anyhow::Error::msg)?;
    let cache = PromptCacheMode::parse(&a.prompt_cache_mode).map_err(anyhow::Error::msg)?;
    // The port first: a tailnet failure or a port in use fails now, before anything is read.
    let ip = bind.resolve()?;
    let listener = mference_server::bind(SocketAddr::new(ip, a.port))?;
    // The load time on the ready line counts the tokenizer too, as `run`'s load line does. The
    // text side is built while the install's files are checked, as in `run`.
    let t0 = Instant::now();
    let (text, install) = std::thread::scope(|s| {
        let text = s.spawn(|| crate::run_cmd::load_text_beside_check(&a.model));
        let install = open_install(&a.model);
        (
            text.join().expect("loading the text side panicked"),
            install,
        )
    });
    let text = text?;
    crate::run_cmd::cache_note(&text);
    let max_context = match (a.max_context, text.max_positions) {
        (Some(c), Some(m)) if c > m => {
            bail!("--max-context {c} exceeds the model's max_position_embeddings {m}")
        }
        (Some(c), _) => c,
        (None, Some(m)) => CONTEXTS
            .iter()
            .copied()
            .filter(|&c| c <= m.min(16384))
            .max()
            .with_context(|| format!("the model's max_position_embeddings {m} is below the smallest --max-context 4096"))?,
        (None, None) => 16384,
    };
    let model_id = a
        .model_id
        .clone()
        .unwrap_or_else(|| mference_server::default_model_id(text.family).to_string());
    let install = install?;
    let opts = load_options_for(&a.model, &install, prefill_chunk, max_context)?;
    let model = mference_models::load_install(install, &opts)?;
    // Every expert file is checked (under the verify policy) before the ready line, so a damaged
    // install fails here instead of failing every request.
    let install = &model.engine().install;
    let files = install
        .check_layer_files()
        .with_context(|| format!("checking the expert files of {}", a.model.model.display()))?;
    let loaded = t0.elapsed().as_secs_f64();
    say!(
        "[model on {}, expert cache {}; {files} expert layer files checked: {}]",
        model.device(),
        model.engine().expert_cache(),
        match install.policy() {
            mference_format::VerifyPolicy::FullSha256 => "sha256",
            mference_format::VerifyPolicy::TrustedReceipt => "sizes (trusted-receipt)",
        }
    );
    let cfg = ServerConfig {
        model_id: model_id.clone(),
        queue_limit: a.queue_limit,
        prompt_cache: cache,
        heartbeat: Duration::from_secs(5),
        stop_on_signals: true,
    };
    let server = mference_server::start_on(model, text, cfg, listener)?;
    say!(
        "MferenceServer ready on http://{} model={model_id} context={} queue={} prompt-cache={} (loaded in {loaded:.2}s)",
        server.local_addr(),
        max_context,
        a.queue_limit,
        a.prompt_cache_mode
    );
    // Returns after SIGTERM/SIGINT and the graceful shutdown (open streams end in-band).
    server.wait();
    say!("MferenceServer stopped");
    Ok(())
}
