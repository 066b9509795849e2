//! Headless Chromium over WebDriver (`chromedriver`, the `fantoccini` client) for the chat-page
//! tests: start the driver and a browser, run script in the page, wait for it, act as a user.
#![allow(dead_code)]

use std::net::SocketAddr;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use fantoccini::{Client, ClientBuilder, Locator};
use mference_testkit::repo;
use serde_json::{json, Value};

const CHROMIUM: &str = "/usr/bin/chromium";
const CHROMEDRIVER: &str = "/usr/bin/chromedriver";
/// How long any one thing the page does may take before the test fails.
pub const PATIENCE: Duration = Duration::from_secs(60);

/// Whether the browser is here; `false` (test skipped) only when it is absent and not required.
pub fn browser_present() -> bool {
    let missing: Vec<&str> = [CHROMIUM, CHROMEDRIVER]
        .into_iter()
        .filter(|p| !Path::new(p).exists())
        .collect();
    if missing.is_empty() {
        return true;
    }
    let msg = format!(
        "{} missing: install Debian's chromium and chromium-driver (`apt-get install -y chromium chromium-driver`)",
        missing.join(" and ")
    );
    assert!(
        std::env::var_os("MFERENCE_REQUIRE_BROWSER").is_none_or(|v| v != "1"),
        "MFERENCE_REQUIRE_BROWSER=1 but {msg}"
    );
    eprintln!("SKIPPED the chat-page browser test: {msg}");
    false
}

/// A `chromedriver` child on a free loopback port, killed on drop.
pub struct Driver {
    child: Child,
    url: String,
}

impl Driver {
    pub fn start() -> Driver {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free port")
            .port();
        let child = Command::new(CHROMEDRIVER)
            .arg(format!("--port={port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("starting chromedriver");
        let d = Driver {
            child,
            url: format!("http://127.0.0.1:{port}"),
        };
        let t0 = Instant::now();
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(t0.elapsed() < PATIENCE, "chromedriver did not listen");
            std::thread::sleep(Duration::from_millis(50));
        }
        d
    }
}

impl Drop for Driver {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A headless Chromium session with a fresh profile in `profile`.
pub async fn browser(driver: &Driver, profile: &Path) -> Client {
    let mut caps = serde_json::Map::new();
    caps.insert("browserName".into(), json!("chrome"));
    caps.insert(
        "goog:chromeOptions".into(),
        json!({
            "binary": CHROMIUM,
            "args": [
                "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                "--window-size=1400,1000",
                format!("--user-data-dir={}", profile.display()),
            ],
        }),
    );
    ClientBuilder::new(hyper_util::client::legacy::connect::HttpConnector::new())
        .capabilities(caps)
        .connect(&driver.url)
        .await
        .expect("a WebDriver session")
}

/// Runs `script` (a function body that returns a value) in the page.
pub async fn js(c: &Client, script: &str) -> Value {
    c.execute(script, vec![])
        .await
        .unwrap_or_else(|e| panic!("{script}: {e}"))
}

/// Waits until `script` returns `true`; fails with `what` after [`PATIENCE`].
pub async fn until(c: &Client, what: &str, script: &str) {
    let t0 = Instant::now();
    while js(c, script).await != Value::Bool(true) {
        assert!(t0.elapsed() < PATIENCE, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Waits until the page has set itself up (`body[data-ready]`, after `/v1/models` answered).
pub async fn loaded(c: &Client) {
    until(
        c,
        "the page to load",
        "return document.body.dataset.ready === '1';",
    )
    .await;
}

pub async fn reload(c: &Client) {
    c.refresh().await.unwrap();
    loaded(c).await;
}

/// The conversation the page keeps in localStorage.
pub async fn stored(c: &Client) -> Vec<Value> {
    let v = js(
        c,
        "return JSON.parse(localStorage.getItem('mference.chat.v1') || '{\"messages\": []}').messages;",
    )
    .await;
    v.as_array().cloned().unwrap_or_default()
}

/// Replaces the value of the input `id` as a user would.
pub async fn type_into(c: &Client, id: &str, text: &str) {
    let e = c.find(Locator::Id(id)).await.unwrap();
    e.clear().await.unwrap();
    e.send_keys(text).await.unwrap();
}

pub async fn click(c: &Client, id: &str) {
    c.find(Locator::Id(id))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
}

/// Saves the page as `target/chat-page/NAME` (a test artifact) and prints where.
pub async fn screenshot(c: &Client, name: &str) {
    let png = c.screenshot().await.unwrap();
    let path = repo().join("target/chat-page").join(name);
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    std::fs::write(&path, &png).unwrap();
    println!("screenshot: {}", path.display());
}

/// The current value of the input `id`.
pub async fn input_value(c: &Client, id: &str) -> String {
    c.find(Locator::Id(id))
        .await
        .unwrap()
        .prop("value")
        .await
        .unwrap()
        .unwrap_or_default()
}

/// A headless Chromium on the chat page at `addr`, loaded. The driver and the browser profile
/// live as long as the returned guards.
pub async fn open_page(addr: SocketAddr) -> (Client, Driver, tempfile::TempDir) {
    let driver = Driver::start();
    let profile = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let c = browser(&driver, profile.path()).await;
    c.goto(&format!("http://{addr}/")).await.unwrap();
    loaded(&c).await;
    (c, driver, profile)
}

/// Waits for the page to finish a reply: the Stop button hidden, `n` messages, and the last
/// one's footer filled in.
pub async fn reply_done(c: &Client, n: usize) {
    until(
        c,
        "the reply to finish",
        &format!(
            "return document.getElementById('stop').hidden && \
             document.querySelectorAll('.msg').length === {n} && \
             !!document.querySelector('.msg:last-child .foot');"
        ),
    )
    .await;
}

/// Sends `text` from the page with greedy settings (temperature 0, seed 7) and `max_tokens`, and
/// waits for the reply, after which the page holds `n` messages.
pub async fn send_greedy(c: &Client, text: &str, max_tokens: usize, n: usize) {
    type_into(c, "temperature", "0").await;
    type_into(c, "seed", "7").await;
    send(c, text, max_tokens).await;
    reply_done(c, n).await;
}

/// Sends `text` from the page with `max_tokens` (the other settings as they are).
pub async fn send(c: &Client, text: &str, max_tokens: usize) {
    type_into(c, "max_tokens", &max_tokens.to_string()).await;
    type_into(c, "input", text).await;
    click(c, "send").await;
}
