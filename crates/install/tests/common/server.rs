//! A loopback HTTP/1.1 server in Hugging Face's `/{repo}/resolve/{revision}/{file}` layout,
//! with `Range` support, request logging and fault injection. Like the Hub it publishes each
//! file's digest: `.safetensors` files and files of 10 MiB or more are "LFS files" with their
//! SHA-256 in `X-Linked-Etag` (and `ETag`), the others have their git blob id as `ETag`.
#![allow(dead_code)]

use std::collections::{HashMap, VecDeque};
use std::io::{BufRead, BufReader, Read, Seek, SeekFrom, Write};
use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// A fault applied to the next data request (a `.safetensors` range starting past byte 8
/// that is not a header read).
#[derive(Clone, Debug, PartialEq)]
pub enum Fault {
    /// Serve normally (used to let some requests through before a fault).
    Pass,
    /// Send headers and half the body, then close.
    DropMidBody,
    /// Answer with bytes from another offset (honest Content-Range for those bytes).
    WrongRange,
    /// Ignore Range, answer 200 with the whole file.
    IgnoreRange,
    /// Answer 503.
    Status5xx,
    /// Send the body in small pieces with pauses.
    SlowBody,
    /// Close the connection without an answer (as a server that went away).
    Close,
}

/// One logged request.
#[derive(Clone, Debug)]
pub struct Logged {
    pub path: String,
    pub range: Option<(u64, u64)>,
    pub status: u16,
    pub authorized: bool,
    pub at: std::time::Instant,
}

pub struct Server {
    pub base: String,
    /// Serve this byte of this file flipped (`(file name, offset)`), headers unchanged.
    pub corrupt: Arc<Mutex<Option<(String, u64)>>>,
    /// Publish the digest headers (default true).
    pub publish_digests: Arc<std::sync::atomic::AtomicBool>,
    /// Pause after every 64 KiB of a `.safetensors` body, milliseconds (0 = none).
    pub throttle_ms: Arc<std::sync::atomic::AtomicU64>,
    pub log: Arc<Mutex<Vec<Logged>>>,
    pub faults: Arc<Mutex<VecDeque<Fault>>>,
}

#[derive(Clone)]
struct State {
    files: Arc<HashMap<String, PathBuf>>,
    corrupt: Arc<Mutex<Option<(String, u64)>>>,
    publish_digests: Arc<std::sync::atomic::AtomicBool>,
    prefix: String,
    log: Arc<Mutex<Vec<Logged>>>,
    faults: Arc<Mutex<VecDeque<Fault>>>,
    throttle_ms: Arc<std::sync::atomic::AtomicU64>,
    token: Option<String>,
    redirect_to: Option<String>,
}

impl Server {
    /// Serve `files` (name → path) as `repo@revision`. With `token`, every request without
    /// `Authorization: Bearer <token>` gets 401. With `redirect_to`, every file request is
    /// answered 302 to `{redirect_to}/{same path}`.
    pub fn start(
        addr: &str,
        repo: &str,
        revision: &str,
        files: HashMap<String, PathBuf>,
        token: Option<&str>,
        redirect_to: Option<String>,
    ) -> Server {
        let listener = TcpListener::bind(addr).unwrap();
        let base = format!("http://{}", listener.local_addr().unwrap());
        let st = State {
            files: Arc::new(files),
            corrupt: Arc::new(Mutex::new(None)),
            publish_digests: Arc::new(std::sync::atomic::AtomicBool::new(true)),
            prefix: format!("/{repo}/resolve/{revision}/"),
            log: Arc::new(Mutex::new(Vec::new())),
            faults: Arc::new(Mutex::new(VecDeque::new())),
            throttle_ms: Arc::new(std::sync::atomic::AtomicU64::new(0)),
            token: token.map(str::to_string),
            redirect_to,
        };
        let (log, faults, throttle_ms) =
            (st.log.clone(), st.faults.clone(), st.throttle_ms.clone());
        let (corrupt, publish_digests) = (st.corrupt.clone(), st.publish_digests.clone());
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                let Ok(conn) = conn else { continue };
                let st = st.clone();
                std::thread::spawn(move || {
                    let _ = handle(conn, &st);
                });
            }
        });
        Server {
            base,
            corrupt,
            publish_digests,
            throttle_ms,
            log,
            faults,
        }
    }

    pub fn push_fault(&self, f: Fault) {
        self.faults.lock().unwrap().push_back(f);
    }

    /// Logged data-range requests (206 responses for .safetensors past the header).
    pub fn data_ranges(&self) -> Vec<(u64, u64)> {
        self.log
            .lock()
            .unwrap()
            .iter()
            .filter(|l| l.path.ends_with(".safetensors") && l.status == 206)
            .filter_map(|l| l.range)
            .filter(|r| r.0 > 8)
            .collect()
    }
}

fn handle(mut conn: TcpStream, st: &State) -> std::io::Result<()> {
    conn.set_read_timeout(Some(Duration::from_secs(30)))?;
    let mut rd = BufReader::new(conn.try_clone()?);
    let mut line = String::new();
    rd.read_line(&mut line)?;
    let path = line.split_whitespace().nth(1).unwrap_or("").to_string();
    let mut range = None;
    let mut auth = None;
    loop {
        let mut h = String::new();
        if rd.read_line(&mut h)? == 0 || h == "\r\n" {
            break;
        }
        let (k, v) = h.split_once(':').unwrap_or((&h, ""));
        let v = v.trim();
        match k.to_ascii_lowercase().as_str() {
            "range" => {
                let spec = v.strip_prefix("bytes=").unwrap_or("");
                let (a, b) = spec.split_once('-').unwrap_or(("0", ""));
                range = Some((a.parse::<u64>().unwrap_or(0), b.parse::<u64>().ok()));
            }
            "authorization" => auth = Some(v.to_string()),
            _ => {}
        }
    }
    let authorized = st
        .token
        .as_ref()
        .is_some_and(|t| auth.as_deref() == Some(&format!("Bearer {t}")));
    let req_range = range.map(|(a, b)| (a, b.unwrap_or(u64::MAX)));
    let log = |status: u16, r: Option<(u64, u64)>| {
        st.log.lock().unwrap().push(Logged {
            path: path.clone(),
            range: r,
            status,
            authorized: auth.is_some(),
            at: std::time::Instant::now(),
        });
    };
    let respond = |conn: &mut TcpStream, status: &str, headers: &str| -> std::io::Result<()> {
        write!(
            conn,
            "HTTP/1.1 {status}\r\n{headers}Connection: close\r\nContent-Length: 0\r\n\r\n"
        )
    };
    if st.token.is_some() && !authorized {
        log(401, req_range);
        return respond(
            &mut conn,
            "401 Unauthorized",
            "WWW-Authenticate: Bearer\r\n",
        );
    }
    let name = path.strip_prefix(&st.prefix).unwrap_or("").to_string();
    let publish = st
        .publish_digests
        .load(std::sync::atomic::Ordering::Relaxed);
    if let Some(to) = &st.redirect_to {
        log(302, req_range);
        // The Hub answers an LFS file's resolve URL with a redirect that carries its SHA-256.
        let digest = match st.files.get(&name) {
            Some(p) if publish => format!("X-Linked-Etag: \"{}\"\r\n", digests_of(p).0),
            _ => String::new(),
        };
        return respond(
            &mut conn,
            "302 Found",
            &format!("Location: {to}{path}\r\n{digest}"),
        );
    }
    let Some(file) = st.files.get(&name) else {
        log(404, req_range);
        return respond(&mut conn, "404 Not Found", "");
    };
    let digest_headers = if !publish {
        String::new()
    } else {
        let (sha256, git) = digests_of(file);
        let lfs = name.ends_with(".safetensors") || file.metadata()?.len() >= 10 << 20;
        if lfs {
            format!("X-Linked-Etag: \"{sha256}\"\r\nETag: \"{sha256}\"\r\n")
        } else {
            format!("ETag: \"{git}\"\r\n")
        }
    };
    let flip = st
        .corrupt
        .lock()
        .unwrap()
        .as_ref()
        .filter(|(f, _)| *f == name)
        .map(|(_, at)| *at);
    let mut f = std::fs::File::open(file)?;
    let len = f.metadata()?.len();
    let Some((a, b)) = range else {
        log(400, req_range);
        return respond(&mut conn, "400 Bad Request", "");
    };
    let b = b
        .unwrap_or(len.saturating_sub(1))
        .min(len.saturating_sub(1));
    if a >= len {
        log(416, req_range);
        return respond(
            &mut conn,
            "416 Range Not Satisfiable",
            &format!("Content-Range: bytes */{len}\r\n"),
        );
    }
    let data_req = path.ends_with(".safetensors") && a > 8 && b > a + 16;
    let fault = if data_req {
        st.faults.lock().unwrap().pop_front()
    } else {
        None
    };
    let (mut a, mut b) = (a, b);
    match fault {
        Some(Fault::Close) => {
            log(0, Some((a, b)));
            return Ok(());
        }
        Some(Fault::Status5xx) => {
            log(503, Some((a, b)));
            return respond(&mut conn, "503 Service Unavailable", "");
        }
        Some(Fault::IgnoreRange) => {
            log(200, Some((a, b)));
            write!(
                conn,
                "HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: {len}\r\n\r\n"
            )?;
            return copy(&mut f, &mut conn, 0, len, 0, None);
        }
        Some(Fault::WrongRange) => {
            let shift = (b - a + 1).min(a);
            a -= shift;
            b -= shift;
        }
        _ => {}
    }
    log(206, Some((a, b)));
    let n = b - a + 1;
    write!(conn, "HTTP/1.1 206 Partial Content\r\nConnection: close\r\nX-Repo-Commit: 0123456789abcdef0123456789abcdef01234567\r\n{digest_headers}Content-Range: bytes {a}-{b}/{len}\r\nContent-Length: {n}\r\n\r\n")?;
    f.seek(SeekFrom::Start(a))?;
    // The throttle stretches the copy of the weights, not the small files before it.
    let pause = match name.ends_with(".safetensors") {
        true => st.throttle_ms.load(std::sync::atomic::Ordering::Relaxed),
        false => 0,
    };
    match fault {
        Some(Fault::DropMidBody) => copy(&mut f, &mut conn, a, n / 2, 0, flip),
        Some(Fault::SlowBody) => copy(&mut f, &mut conn, a, n, 5, flip),
        _ => copy(&mut f, &mut conn, a, n, pause, flip),
    }
}

/// SHA-256 and git blob id (`sha1("blob <len>\0" + bytes)`) of a file, hex; computed once per path.
pub fn digests_of(p: &std::path::Path) -> (String, String) {
    use sha1::Digest as _;
    static CACHE: std::sync::OnceLock<Mutex<HashMap<PathBuf, (String, String)>>> =
        std::sync::OnceLock::new();
    let cache = CACHE.get_or_init(Default::default);
    if let Some(d) = cache.lock().unwrap().get(p) {
        return d.clone();
    }
    let bytes = std::fs::read(p).unwrap();
    let hex = |d: &[u8]| d.iter().map(|b| format!("{b:02x}")).collect::<String>();
    let sha256 = hex(&sha2::Sha256::digest(&bytes));
    let mut g = sha1::Sha1::new();
    g.update(format!("blob {}\0", bytes.len()).as_bytes());
    g.update(&bytes);
    let d = (sha256, hex(&g.finalize()));
    cache.lock().unwrap().insert(p.to_path_buf(), d.clone());
    d
}

/// Send `n` bytes of `f` from `at`, the byte at file offset `flip` (if in the span) inverted.
fn copy(
    f: &mut std::fs::File,
    conn: &mut TcpStream,
    at: u64,
    n: u64,
    pause_ms: u64,
    flip: Option<u64>,
) -> std::io::Result<()> {
    f.seek(SeekFrom::Start(at))?;
    let mut left = n;
    let mut pos = at;
    let mut buf = vec![0u8; 64 << 10];
    while left > 0 {
        let k = (left as usize).min(buf.len());
        f.read_exact(&mut buf[..k])?;
        if let Some(x) = flip.filter(|x| (pos..pos + k as u64).contains(x)) {
            buf[(x - pos) as usize] ^= 0xff;
        }
        conn.write_all(&buf[..k])?;
        left -= k as u64;
        pos += k as u64;
        if pause_ms > 0 {
            std::thread::sleep(Duration::from_millis(pause_ms));
        }
    }
    conn.flush()
}

/// Files of a bundled tiny checkpoint, with the tokenizer pointer files resolved.
pub fn checkpoint_files(dir: &std::path::Path) -> HashMap<String, PathBuf> {
    let mut m = HashMap::new();
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        let name = p.file_name().unwrap().to_string_lossy().into_owned();
        let mut target = p.clone();
        if p.metadata().unwrap().len() < 1024 {
            let t = std::fs::read_to_string(&p).unwrap_or_default();
            let cand = dir.join(t.trim());
            if t.trim().ends_with(&name) && cand.is_file() {
                target = cand;
            }
        }
        m.insert(name, target);
    }
    m
}
