//! The chat page (`GET /`) and the statistics it polls (`GET /v1/stats`, `GET /metrics`).
//!
//! The page is plain HTML, CSS and JavaScript under `crates/server/ui/`, built into the binary;
//! it talks only to this server (`/v1/chat/completions` with SSE, `/v1/stats`), which its
//! Content-Security-Policy enforces: no CDN, no other origin.

use axum::extract::State;
use axum::http::header;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};

use crate::http::Shared;

const INDEX: &str = include_str!("../ui/index.html");
const APP: &str = include_str!("../ui/app.js");
const MARKDOWN: &str = include_str!("../ui/markdown.js");
const STYLE: &str = include_str!("../ui/style.css");

/// Same origin only; inline scripts and styles are refused, so a reply rendered into the page
/// cannot run code even if an escape were missed.
const CSP: &str = "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; \
                   connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'";

/// The page and its files.
pub(crate) fn routes() -> Router<Shared> {
    Router::new()
        .route("/", get(|| file(INDEX, "text/html; charset=utf-8")))
        .route(
            "/ui/app.js",
            get(|| file(APP, "text/javascript; charset=utf-8")),
        )
        .route(
            "/ui/markdown.js",
            get(|| file(MARKDOWN, "text/javascript; charset=utf-8")),
        )
        .route(
            "/ui/style.css",
            get(|| file(STYLE, "text/css; charset=utf-8")),
        )
}

async fn file(body: &'static str, content_type: &'static str) -> Response {
    (
        [
            (header::CONTENT_TYPE, content_type),
            (header::CONTENT_SECURITY_POLICY, CSP),
            (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
            // The files change with the binary; a restarted server must not serve stale ones.
            (header::CACHE_CONTROL, "no-cache"),
        ],
        body,
    )
        .into_response()
}

/// Requests queued behind the running one.
fn waiting(st: &Shared) -> u64 {
    (st.jobs.max_capacity() - st.jobs.capacity()) as u64
}

/// `GET /v1/stats`: the [`crate::stats::Snapshot`] as JSON (`docs/STATS.md` has the fields).
pub(crate) async fn stats(State(st): State<Shared>) -> Response {
    let snap = st.live.snapshot(waiting(&st));
    ([(header::CACHE_CONTROL, "no-store")], Json(snap)).into_response()
}

/// `GET /metrics`: the same figures in the Prometheus text format.
pub(crate) async fn metrics(State(st): State<Shared>) -> Response {
    let snap = st.live.snapshot(waiting(&st));
    (
        [(header::CONTENT_TYPE, crate::metrics::CONTENT_TYPE)],
        crate::metrics::render(&snap),
    )
        .into_response()
}
