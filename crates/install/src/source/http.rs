//! HTTP(S) source in Hugging Face's layout: `{base}/{repo}/resolve/{revision}/{file}`.
//! Only byte ranges are requested; every response must be `206` with a matching
//! `Content-Range` (a `200` to a ranged request is an error). Redirects are followed by hand
//! so `Range` is kept; `HF_TOKEN` is sent only after the base host answered `401`, and
//! never to another host. Transient failures (connection errors, short or mismatched
//! bodies, 5xx, 429) are retried with exponential backoff, resuming at the first missing
//! byte. Each file's published digest (`X-Linked-Etag`, else the base host's `ETag`,
//! [`crate::verify`]) is remembered and must not change during the install.

use super::{Source, SourceId};
use crate::verify::Published;
use crate::InstallError;
use std::collections::HashMap;
use std::io::Read;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

/// Configuration of an [`HttpSource`].
#[derive(Clone, Debug)]
pub struct HttpConfig {
    /// `https://huggingface.co`, `$HF_ENDPOINT`, or a mirror; must be http(s).
    pub base_url: String,
    /// `owner/name`.
    pub repo: String,
    /// Branch, tag or 40-hex commit.
    pub revision: String,
    /// Bearer token, sent only when the base host asks for authentication.
    pub token: Option<String>,
    /// Consecutive failed attempts allowed per request (default 4).
    pub attempts: u32,
    /// First retry delay; doubles each attempt (default 1 s).
    pub retry_base_delay: Duration,
    /// Redirects followed per request (default 10).
    pub max_redirects: u32,
    /// Limit for receiving one response body (default 600 s).
    pub body_timeout: Duration,
}

impl Default for HttpConfig {
    fn default() -> Self {
        HttpConfig {
            base_url: "https://huggingface.co".into(),
            repo: String::new(),
            revision: "main".into(),
            token: None,
            attempts: 4,
            retry_base_delay: Duration::from_secs(1),
            max_redirects: 10,
            body_timeout: Duration::from_secs(600),
        }
    }
}

/// A Hugging Face-layout HTTP(S) source.
pub struct HttpSource {
    cfg: HttpConfig,
    agent: ureq::Agent,
    base_host: String,
    auth_requested: AtomicBool,
    requests: AtomicU64,
    commit: Mutex<Option<String>>,
    /// Published digest by resolve URL, from the first response that carried one.
    digests: Mutex<HashMap<String, Published>>,
}

enum Failure {
    /// No HTTP answer at all (refused, reset, DNS, TLS, timeout): retried, then
    /// [`InstallError::SourceUnreachable`].
    Connect(String),
    Transient(String),
    Fatal(String),
}

/// The error inside the `std::io::Error` a range reader returns, so that callers can report an
/// unreachable server as such ([`super::read_error`]).
#[derive(Debug)]
pub struct HttpReadError {
    pub url: String,
    pub detail: String,
    pub unreachable: bool,
}

impl std::fmt::Display for HttpReadError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.url, self.detail)
    }
}

impl std::error::Error for HttpReadError {}

impl HttpReadError {
    /// The install error this read failure means.
    pub fn to_install_error(&self) -> InstallError {
        let (url, detail) = (self.url.clone(), self.detail.clone());
        if self.unreachable {
            InstallError::SourceUnreachable { url, detail }
        } else {
            InstallError::Http { url, detail }
        }
    }
}

/// `"" ` when `cur` is the URL asked for, else `"redirected to {cur}: "`: messages name the
/// requested URL once (in [`InstallError::Http`]) and a redirect target only when there was one.
fn at(cur: &str, url: &str) -> String {
    if cur == url {
        String::new()
    } else {
        format!("redirected to {cur}: ")
    }
}

fn host_of(url: &str) -> &str {
    let rest = url.split_once("://").map_or(url, |(_, r)| r);
    rest.split('/').next().unwrap_or("")
}

fn resolve_location(current: &str, loc: &str) -> String {
    if loc.contains("://") {
        return loc.to_string();
    }
    let (scheme, rest) = current.split_once("://").unwrap_or(("http", current));
    let host = rest.split('/').next().unwrap_or("");
    if loc.starts_with('/') {
        format!("{scheme}://{host}{loc}")
    } else {
        let dir = current.rsplit_once('/').map_or(current, |(d, _)| d);
        format!("{dir}/{loc}")
    }
}

/// A 206 answer with its `Content-Range`: (response, first, last inclusive, total size).
type Ranged = (ureq::http::Response<ureq::Body>, u64, u64, Option<u64>);

/// Parse `bytes a-b/total` → (a, b inclusive, total).
fn parse_content_range(v: &str) -> Option<(u64, u64, Option<u64>)> {
    let v = v.trim().strip_prefix("bytes ")?;
    let (span, total) = v.split_once('/')?;
    let (a, b) = span.split_once('-')?;
    Some((a.parse().ok()?, b.parse().ok()?, total.parse().ok()))
}

impl HttpSource {
    /// Build a source. Errors: base URL not http(s).
    pub fn new(cfg: HttpConfig) -> Result<Self, InstallError> {
        if !(cfg.base_url.starts_with("http://") || cfg.base_url.starts_with("https://")) {
            return Err(InstallError::BadOption {
                detail: format!("--base-url {} must be http(s)", cfg.base_url),
            });
        }
        let agent: ureq::Agent = ureq::Agent::config_builder()
            .max_redirects(0)
            .http_status_as_error(false)
            .timeout_connect(Some(Duration::from_secs(30)))
            .timeout_recv_response(Some(Duration::from_secs(120)))
            .timeout_recv_body(Some(cfg.body_timeout))
            .build()
            .into();
        Ok(HttpSource {
            base_host: host_of(&cfg.base_url).to_string(),
            cfg,
            agent,
            auth_requested: AtomicBool::new(false),
            requests: AtomicU64::new(0),
            commit: Mutex::new(None),
            digests: Mutex::new(HashMap::new()),
        })
    }

    /// Remember the digest a response to `url` published (`X-Linked-Etag` on any hop, else
    /// `ETag` from the base host: another host's tag is a CDN's own); a different digest for the
    /// same URL later in the install is an error.
    fn note_digest(
        &self,
        url: &str,
        cur: &str,
        headers: &ureq::http::HeaderMap,
    ) -> Result<(), Failure> {
        let get = |k: &str| headers.get(k).and_then(|v| v.to_str().ok());
        let p = get("x-linked-etag")
            .and_then(|v| Published::parse(v, "X-Linked-Etag"))
            .or_else(|| {
                (host_of(cur) == self.base_host)
                    .then(|| get("etag").and_then(|v| Published::parse(v, "ETag")))
                    .flatten()
            });
        let Some(p) = p else { return Ok(()) };
        let mut map = self.digests.lock().expect("lock");
        match map.get(url) {
            Some(old) if old.hex != p.hex => Err(Failure::Fatal(format!(
                "the published digest changed during the install: {} before, {} now (the revision \
                 moved, or the mirror serves mixed versions); install a pinned commit",
                old.describe(),
                p.describe()
            ))),
            Some(_) => Ok(()),
            None => {
                map.insert(url.to_string(), p);
                Ok(())
            }
        }
    }

    fn url(&self, rel: &str) -> String {
        format!(
            "{}/{}/resolve/{}/{}",
            self.cfg.base_url.trim_end_matches('/'),
            self.cfg.repo,
            self.cfg.revision,
            rel
        )
    }

    /// One ranged GET (inclusive `last`), following redirects. `Ok(None)` on 404.
    fn get_once(
        &self,
        url: &str,
        first: u64,
        last: Option<u64>,
    ) -> Result<Option<Ranged>, Failure> {
        let range = match last {
            Some(l) => format!("bytes={first}-{l}"),
            None => format!("bytes={first}-"),
        };
        let mut cur = url.to_string();
        let mut redirects = 0;
        loop {
            let mut req = self.agent.get(&cur).header("Range", &range);
            let same_host = host_of(&cur) == self.base_host;
            if let (Some(t), true, true) = (
                &self.cfg.token,
                self.auth_requested.load(Ordering::Relaxed),
                same_host,
            ) {
                req = req.header("Authorization", &format!("Bearer {t}"));
            }
            let resp = req
                .call()
                .map_err(|e| Failure::Connect(format!("{}{e}", at(&cur, url))))?;
            let status = resp.status().as_u16();
            let here = at(&cur, url);
            if let Some(c) = resp
                .headers()
                .get("x-repo-commit")
                .and_then(|v| v.to_str().ok())
            {
                *self.commit.lock().expect("lock") = Some(c.to_string());
            }
            match status {
                401 if self.cfg.token.is_some()
                    && same_host
                    && !self.auth_requested.swap(true, Ordering::Relaxed) =>
                {
                    continue
                }
                401 | 403 => {
                    return Err(Failure::Fatal(format!(
                        "{here}{status}: authentication required; set HF_TOKEN"
                    )))
                }
                404 => return Ok(None),
                301 | 302 | 303 | 307 | 308 => {
                    self.note_digest(url, &cur, resp.headers())?;
                    redirects += 1;
                    if redirects > self.cfg.max_redirects {
                        return Err(Failure::Fatal("too many redirects".into()));
                    }
                    let loc = resp
                        .headers()
                        .get("location")
                        .and_then(|v| v.to_str().ok())
                        .ok_or_else(|| {
                            Failure::Fatal(format!("{here}redirect without Location"))
                        })?;
                    cur = resolve_location(&cur, loc);
                    continue;
                }
                206 => self.note_digest(url, &cur, resp.headers())?,
                200 => {
                    return Err(Failure::Fatal(format!(
                        "{here}server answered 200 to a ranged request (Range ignored)"
                    )))
                }
                416 => {
                    return Err(Failure::Fatal(format!(
                        "{here}range {range} not satisfiable"
                    )))
                }
                429 | 500..=599 => return Err(Failure::Transient(format!("{here}HTTP {status}"))),
                s => return Err(Failure::Fatal(format!("{here}HTTP {s}"))),
            }
            let cr = resp
                .headers()
                .get("content-range")
                .and_then(|v| v.to_str().ok())
                .and_then(parse_content_range);
            let (a, b, total) = cr.ok_or_else(|| {
                Failure::Transient(format!("{here}206 without a valid Content-Range"))
            })?;
            // A server may clamp the end of the range to the end of the file.
            let clamped = |l: u64| b < l && total == Some(b + 1);
            if a != first || last.is_some_and(|l| b != l && !clamped(l)) || b < a {
                return Err(Failure::Transient(format!(
                    "{here}asked for {range}, got bytes {a}-{b}"
                )));
            }
            if let Some(len) = resp
                .headers()
                .get("content-length")
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.parse::<u64>().ok())
            {
                if len != b - a + 1 {
                    return Err(Failure::Transient(format!(
                        "{here}Content-Length {len} does not match Content-Range {a}-{b}"
                    )));
                }
            }
            return Ok(Some((resp, a, b, total)));
        }
    }

    fn with_retries<T>(
        &self,
        url: &str,
        mut f: impl FnMut() -> Result<T, Failure>,
    ) -> Result<T, InstallError> {
        let mut attempt = 0;
        loop {
            let (d, unreachable) = match f() {
                Ok(v) => return Ok(v),
                Err(Failure::Fatal(d)) => {
                    return Err(InstallError::Http {
                        url: url.into(),
                        detail: d,
                    })
                }
                Err(Failure::Transient(d)) => (d, false),
                Err(Failure::Connect(d)) => (d, true),
            };
            attempt += 1;
            if attempt >= self.cfg.attempts {
                return Err(HttpReadError {
                    url: url.into(),
                    detail: format!("{d} (gave up after {attempt} attempts)"),
                    unreachable,
                }
                .to_install_error());
            }
            std::thread::sleep(self.cfg.retry_base_delay * (1 << (attempt - 1)));
        }
    }
}

impl Source for HttpSource {
    fn id(&self) -> SourceId {
        SourceId {
            repo_id: self.cfg.repo.clone(),
            revision: self.cfg.revision.clone(),
            resolved_commit: self
                .commit
                .lock()
                .expect("lock")
                .clone()
                .unwrap_or_else(|| self.cfg.revision.clone()),
            base_url: (self.cfg.base_url.trim_end_matches('/') != HttpConfig::default().base_url)
                .then(|| self.cfg.base_url.clone()),
        }
    }

    fn read_small(&self, rel: &str, cap: u64) -> Result<Option<Vec<u8>>, InstallError> {
        let url = self.url(rel);
        self.with_retries(&url, || {
            let Some((resp, a, b, total)) = self.get_once(&url, 0, Some(cap.saturating_sub(1)))?
            else {
                return Ok(None);
            };
            if total.is_some_and(|t| t > cap) {
                return Err(Failure::Fatal(format!(
                    "{rel} is larger than the {cap}-byte cap"
                )));
            }
            let mut out = Vec::with_capacity((b - a + 1) as usize);
            resp.into_body()
                .into_reader()
                .take(cap)
                .read_to_end(&mut out)
                .map_err(|e| Failure::Transient(e.to_string()))?;
            if out.len() as u64 != b - a + 1 {
                return Err(Failure::Transient("short body".into()));
            }
            Ok(Some(out))
        })
    }

    fn size_of(&self, rel: &str) -> Result<Option<u64>, InstallError> {
        let url = self.url(rel);
        self.with_retries(&url, || match self.get_once(&url, 0, Some(0))? {
            None => Ok(None),
            Some((_, _, _, Some(total))) => Ok(Some(total)),
            Some(_) => Err(Failure::Fatal("Content-Range without a total size".into())),
        })
    }

    fn open_range(
        &self,
        rel: &str,
        start: u64,
        end: u64,
    ) -> Result<Box<dyn Read + Send + '_>, InstallError> {
        Ok(Box::new(RangeReader {
            src: self,
            url: self.url(rel),
            pos: start,
            end,
            body: None,
        }))
    }

    fn range_requests(&self) -> u64 {
        self.requests.load(Ordering::Relaxed)
    }

    fn published_digest(&self, rel: &str) -> Result<Option<Published>, InstallError> {
        let url = self.url(rel);
        let known = |s: &Self| s.digests.lock().expect("lock").get(&url).cloned();
        if let Some(p) = known(self) {
            return Ok(Some(p));
        }
        // Not requested yet (or answered without one): ask once for its first byte.
        self.size_of(rel)?;
        Ok(known(self))
    }

    fn publishes_digests(&self) -> bool {
        true
    }
}

/// Streams `pos..end`, reconnecting at `pos` after a transient failure.
struct RangeReader<'a> {
    src: &'a HttpSource,
    url: String,
    pos: u64,
    end: u64,
    body: Option<Box<dyn Read + Send>>,
}

impl RangeReader<'_> {
    fn connect(&mut self) -> Result<(), Failure> {
        self.src.requests.fetch_add(1, Ordering::Relaxed);
        match self.src.get_once(&self.url, self.pos, Some(self.end - 1))? {
            None => Err(Failure::Fatal("404 Not Found".into())),
            Some((resp, _, _, _)) => {
                self.body = Some(Box::new(resp.into_body().into_reader()));
                Ok(())
            }
        }
    }
}

impl Read for RangeReader<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        if self.pos >= self.end || buf.is_empty() {
            return Ok(0);
        }
        let want = buf.len().min((self.end - self.pos) as usize);
        let mut attempt = 0;
        loop {
            let r = match self.body.as_mut() {
                Some(b) => match b.read(&mut buf[..want]) {
                    Ok(0) => Err(Failure::Transient(format!(
                        "body ended at byte {} of ..{}",
                        self.pos, self.end
                    ))),
                    Ok(n) => Ok(n),
                    Err(e) => Err(Failure::Transient(e.to_string())),
                },
                None => self.connect().map(|_| 0),
            };
            let err = |detail: String, unreachable: bool| {
                std::io::Error::other(HttpReadError {
                    url: self.url.clone(),
                    detail,
                    unreachable,
                })
            };
            let (d, unreachable) = match r {
                Ok(0) => continue,
                Ok(n) => {
                    self.pos += n as u64;
                    return Ok(n);
                }
                Err(Failure::Fatal(d)) => return Err(err(d, false)),
                Err(Failure::Transient(d)) => (d, false),
                Err(Failure::Connect(d)) => (d, true),
            };
            self.body = None;
            attempt += 1;
            if attempt >= self.src.cfg.attempts {
                return Err(err(
                    format!("{d} (gave up after {attempt} attempts)"),
                    unreachable,
                ));
            }
            std::thread::sleep(self.src.cfg.retry_base_delay * (1 << (attempt - 1)));
        }
    }
}
