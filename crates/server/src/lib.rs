#![warn(missing_docs)]
//! mference-server: an OpenAI-compatible HTTP server over one loaded model
//! (rules from the original Mference's server, github.com/NeelM0906/Mference; endpoints in `crates/server/README.md`).
//!
//! - `GET /health`, `GET /v1/models`, `POST /v1/chat/completions` and `POST /v1/completions`, JSON
//!   or SSE (`stream_options.include_usage`, `: ping` heartbeats, in-band errors after the head).
//! - `GET /` the chat page (built in), `GET /v1/stats` its HUD's live figures and `GET /metrics`
//!   the same in the Prometheus text format (`docs/STATS.md`).
//! - Every check (content type 415, body size 413, options 400, model 404, queue 429, context 400)
//!   runs before any byte of the response is written.
//! - One model, owned by one generation thread; requests wait in a bounded queue. The thread keeps
//!   one conversational KV prefix: a prompt that starts with the tokens already in the KV cache
//!   reuses them (`usage.prompt_tokens_details.cached_tokens`).
//! - Tool calls in the family's native syntax become OpenAI `tool_calls`; malformed call output is
//!   an error, never a half-parsed call.
//! - Shutdown ([`Server::shutdown`], or SIGTERM/SIGINT with [`ServerConfig::stop_on_signals`]) is
//!   graceful: the port closes at once, every open stream ends with an in-band
//!   `server_shutting_down` error and `data: [DONE]`, and a request still waiting for its JSON
//!   answer gets a 503 with the same code.
//!
//! [`start`] binds, spawns the generation thread and the HTTP runtime, and returns a [`Server`].

/// `eprintln!` that never panics: a line stderr cannot take (a closed pipe, as in `serve 2>&1 |
/// head`) is dropped and the server goes on answering and stopping on signals.
#[macro_export]
macro_rules! log_line {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stderr(), $($arg)*);
    }};
}

mod api;
mod error;
#[doc(hidden)]
pub mod fuzz;
mod http;
mod metrics;
mod respond;
mod stats;
mod ui;
mod worker;

use std::future::IntoFuture;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use mference_models::Model;
use mference_text::Family;

pub use error::ApiError;
/// The text side the server renders, tokenizes and generates with (`mference-session`).
pub use mference_session::TextSide;

/// Errors of starting the server. Request errors are [`ApiError`]s and never end the server.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    /// `--bind tailnet` could not find exactly one tailnet address.
    #[error("--bind tailnet: {0}")]
    Tailnet(String),
    /// Binding the port or starting a thread failed.
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        /// The address we tried.
        addr: SocketAddr,
        /// The OS error.
        source: std::io::Error,
    },
    /// Starting the generation thread or the HTTP runtime failed.
    #[error("cannot start the server: {0}")]
    Runtime(std::io::Error),
}

/// Where to listen (`--bind`). Never a wildcard address.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BindMode {
    /// `127.0.0.1`.
    Loopback,
    /// The one 100.64.0.0/10 address that `tailscale ip -4` prints.
    Tailnet,
}

impl BindMode {
    /// Parses `loopback|tailnet`.
    pub fn parse(s: &str) -> Result<Self, String> {
        match s {
            "loopback" => Ok(Self::Loopback),
            "tailnet" => Ok(Self::Tailnet),
            _ => Err(format!(
                "invalid --bind '{s}': allowed values are loopback, tailnet"
            )),
        }
    }

    /// The address to bind. `Tailnet` runs `tailscale ip -4` directly (no shell).
    ///
    /// Errors: [`ServerError::Tailnet`] when tailscale cannot run, fails, or prints anything but
    /// exactly one IPv4 address inside 100.64.0.0/10.
    pub fn resolve(self) -> Result<IpAddr, ServerError> {
        match self {
            Self::Loopback => Ok(IpAddr::V4(Ipv4Addr::LOCALHOST)),
            Self::Tailnet => {
                let out = std::process::Command::new("tailscale")
                    .args(["ip", "-4"])
                    .output()
                    .map_err(|e| {
                        ServerError::Tailnet(format!(
                            "cannot run `tailscale ip -4`: {e} (is Tailscale installed and up?)"
                        ))
                    })?;
                if !out.status.success() {
                    return Err(ServerError::Tailnet(format!(
                        "`tailscale ip -4` failed ({}): {}",
                        out.status,
                        String::from_utf8_lossy(&out.stderr).trim()
                    )));
                }
                parse_tailnet_ip(&String::from_utf8_lossy(&out.stdout))
                    .map(IpAddr::V4)
                    .map_err(ServerError::Tailnet)
            }
        }
    }
}

/// Checks the output of `tailscale ip -4`: exactly one IPv4 address, inside 100.64.0.0/10
/// (the CGNAT range Tailscale assigns from).
pub fn parse_tailnet_ip(output: &str) -> Result<Ipv4Addr, String> {
    let lines: Vec<&str> = output
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect();
    let [line] = lines.as_slice() else {
        return Err(format!(
            "`tailscale ip -4` printed {} addresses, expected exactly one: {:?}",
            lines.len(),
            output.trim()
        ));
    };
    let ip: Ipv4Addr = line
        .parse()
        .map_err(|_| format!("`tailscale ip -4` printed '{line}', which is not an IPv4 address"))?;
    let [a, b, ..] = ip.octets();
    if a != 100 || b & 0xC0 != 64 {
        return Err(format!(
            "{ip} is not a tailnet address (100.64.0.0/10); refusing to bind it"
        ));
    }
    Ok(ip)
}

/// Whether the server keeps a conversational KV prefix between requests (`--prompt-cache-mode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PromptCacheMode {
    /// Every request is prefilled from position 0.
    Off,
    /// One retained prefix: a prompt sharing a prefix with the tokens in the KV cache reuses them.
    SinglePrefix,
}

impl PromptCacheMode {
    /// Parses `off|single-prefix`.
    pub fn parse(s: &str) -> Result<Self, String> {
        match s {
            "off" => Ok(Self::Off),
            "single-prefix" => Ok(Self::SinglePrefix),
            _ => Err(format!(
                "invalid --prompt-cache-mode '{s}': allowed values are off, single-prefix"
            )),
        }
    }
}

/// The original's default model id per family (`ServerInference.swift` of
/// github.com/NeelM0906/Mference).
pub fn default_model_id(family: Family) -> &'static str {
    match family {
        Family::Gemma4 => "gemma-4-26b-a4b-it",
        Family::Qwen3_5Moe => "qwen3.6-35b-a3b",
        Family::DeepseekV4 => "deepseek-v4-flash-2bit-dq",
        Family::Maple => "maple-preview-2bit",
        Family::Inkling => "inkling-small",
    }
}

/// Server settings.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// The id clients must send as `model` (404 otherwise).
    pub model_id: String,
    /// Requests allowed to wait behind the running one; more get 429.
    pub queue_limit: usize,
    /// Conversational KV prefix reuse.
    pub prompt_cache: PromptCacheMode,
    /// Idle time after which a stream gets a `: ping` comment (5 s in the original).
    pub heartbeat: Duration,
    /// SIGTERM and SIGINT start the same graceful shutdown as [`Server::shutdown`] (for the
    /// `mference serve` process; off for servers embedded in another program).
    pub stop_on_signals: bool,
}

impl ServerConfig {
    /// The original's defaults for `model_id`: queue 4, single-prefix cache, 5 s heartbeat.
    pub fn new(model_id: impl Into<String>) -> Self {
        Self {
            model_id: model_id.into(),
            queue_limit: 4,
            prompt_cache: PromptCacheMode::SinglePrefix,
            heartbeat: Duration::from_secs(5),
            stop_on_signals: false,
        }
    }
}

/// How long a shutdown waits for open connections to finish after the in-band errors were sent
/// (a client that stopped reading holds its connection); then they are closed.
const DRAIN: Duration = Duration::from_secs(10);

/// A running server: the HTTP runtime thread and the generation thread. Dropping it starts a
/// shutdown without waiting for it.
pub struct Server {
    addr: SocketAddr,
    stop: Arc<tokio::sync::watch::Sender<bool>>,
    http: Option<std::thread::JoinHandle<()>>,
}

impl Server {
    /// The bound address (useful with port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Blocks until the server stops: after a signal's graceful shutdown
    /// ([`ServerConfig::stop_on_signals`]), or when the HTTP server fails.
    pub fn wait(mut self) {
        if let Some(h) = self.http.take() {
            let _ = h.join();
        }
    }

    /// Graceful shutdown: stops accepting connections, ends every open stream with an in-band
    /// `server_shutting_down` error and `data: [DONE]`, answers requests still waiting for JSON
    /// with a 503, and waits (at most about 10 s) for the connections to close.
    pub fn shutdown(mut self) {
        self.stop.send_replace(true);
        if let Some(h) = self.http.take() {
            let _ = h.join();
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop.send_replace(true);
    }
}

/// Binds `addr` (an already loaded model, so the port opens only when it can answer), starts the
/// generation thread and the HTTP runtime, and returns at once.
///
/// Errors: [`ServerError::Bind`] when the address cannot be bound, [`ServerError::Runtime`] when a
/// thread, the runtime or the signal handlers cannot start.
pub fn start(
    model: Box<dyn Model>,
    text: TextSide,
    cfg: ServerConfig,
    addr: SocketAddr,
) -> Result<Server, ServerError> {
    let listener = bind(addr)?;
    start_on(model, text, cfg, listener)
}

/// Binds `addr` for [`start_on`]: `serve` binds before its long model load, so a port in use
/// fails at once. Errors: [`ServerError::Bind`].
pub fn bind(addr: SocketAddr) -> Result<std::net::TcpListener, ServerError> {
    std::net::TcpListener::bind(addr).map_err(|source| ServerError::Bind { addr, source })
}

/// [`start`] on a listener bound by [`bind`].
pub fn start_on(
    model: Box<dyn Model>,
    text: TextSide,
    cfg: ServerConfig,
    listener: std::net::TcpListener,
) -> Result<Server, ServerError> {
    let addr = listener.local_addr().map_err(|source| ServerError::Bind {
        addr: SocketAddr::from(([0, 0, 0, 0], 0)),
        source,
    })?;
    let local = listener
        .local_addr()
        .map_err(|source| ServerError::Bind { addr, source })?;
    listener
        .set_nonblocking(true)
        .map_err(ServerError::Runtime)?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .thread_name("mference-http")
        .build()
        .map_err(ServerError::Runtime)?;
    let signals = if cfg.stop_on_signals {
        use tokio::signal::unix::{signal, SignalKind};
        let _rt = rt.enter();
        let term = signal(SignalKind::terminate()).map_err(ServerError::Runtime)?;
        let int = signal(SignalKind::interrupt()).map_err(ServerError::Runtime)?;
        Some((term, int))
    } else {
        None
    };
    let max_context = model.engine().max_context;
    let text = Arc::new(text);
    let broken = Arc::new(std::sync::Mutex::new(None));
    let live = Arc::new(stats::Live::new(stats::ServerInfo::of(
        model.as_ref(),
        &cfg.model_id,
        cfg.prompt_cache,
    )));
    let (jobs, _worker) = worker::spawn(
        model,
        Arc::clone(&text),
        cfg.prompt_cache,
        cfg.queue_limit,
        Arc::clone(&broken),
        Arc::clone(&live),
    )
    .map_err(ServerError::Runtime)?;
    let (stop, stop_rx) = tokio::sync::watch::channel(false);
    let stop = Arc::new(stop);
    let state = Arc::new(http::AppState {
        model_id: cfg.model_id.clone(),
        max_context,
        text,
        jobs,
        heartbeat: cfg.heartbeat,
        broken,
        live,
        started: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0),
        stop: stop_rx.clone(),
    });
    let signal_stop = Arc::clone(&stop);
    let http = std::thread::Builder::new()
        .name("mference-serve".into())
        .spawn(move || {
            rt.block_on(async move {
                let listener = match tokio::net::TcpListener::from_std(listener) {
                    Ok(l) => l,
                    Err(e) => {
                        log_line!("error: cannot register the listener: {e}");
                        return;
                    }
                };
                if let Some((mut term, mut int)) = signals {
                    tokio::spawn(async move {
                        let name = tokio::select! {
                            _ = term.recv() => "SIGTERM",
                            _ = int.recv() => "SIGINT",
                        };
                        log_line!(
                            "{} received {name}: shutting down (no new connections; open requests end with server_shutting_down)",
                            worker::timestamp()
                        );
                        signal_stop.send_replace(true);
                    });
                }
                let serve = axum::serve(listener, http::router(state))
                    .with_graceful_shutdown(http::stopping(stop_rx.clone()))
                    .into_future();
                let deadline = async {
                    http::stopping(stop_rx).await;
                    tokio::time::sleep(DRAIN).await;
                };
                tokio::select! {
                    res = serve => {
                        if let Err(e) = res {
                            log_line!("error: the HTTP server stopped: {e}");
                        }
                    }
                    _ = deadline => log_line!(
                        "{} connections still open {}s after the shutdown began; closing them",
                        worker::timestamp(),
                        DRAIN.as_secs()
                    ),
                }
            });
            // Tasks still running (a stream whose client stopped reading) are dropped.
            rt.shutdown_timeout(Duration::from_secs(1));
        })
        .map_err(ServerError::Runtime)?;
    Ok(Server {
        addr: local,
        stop,
        http: Some(http),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tailnet_output_must_be_one_cgnat_address() {
        assert_eq!(
            parse_tailnet_ip("100.101.102.103\n"),
            Ok(Ipv4Addr::new(100, 101, 102, 103))
        );
        assert_eq!(
            parse_tailnet_ip("100.64.0.1"),
            Ok(Ipv4Addr::new(100, 64, 0, 1))
        );
        assert_eq!(
            parse_tailnet_ip("100.127.255.254"),
            Ok(Ipv4Addr::new(100, 127, 255, 254))
        );
        for bad in [
            "",
            "\n",
            "100.63.255.255",
            "100.128.0.1",
            "192.168.1.2",
            "0.0.0.0",
            "100.64.0.1\n100.64.0.2\n",
            "fd7a:115c:a1e0::1",
            "not an ip",
        ] {
            assert!(parse_tailnet_ip(bad).is_err(), "{bad:?} was accepted");
        }
    }

    #[test]
    fn mode_parsers_refuse_unknown_values() {
        assert_eq!(BindMode::parse("loopback"), Ok(BindMode::Loopback));
        assert!(BindMode::parse("0.0.0.0").is_err());
        assert_eq!(PromptCacheMode::parse("off"), Ok(PromptCacheMode::Off));
        assert!(PromptCacheMode::parse("multi").is_err());
    }
}
