//! A blocking HTTP client for the server tests: every status is returned (4xx/5xx are not
//! errors), bodies come back as JSON, and SSE streams can be read event by event.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use serde_json::Value;

/// A client that reports every status (no error on 4xx/5xx), with a 300 s overall timeout.
pub fn agent() -> ureq::Agent {
    ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(Duration::from_secs(300)))
        .build()
        .into()
}

/// The status and the body as JSON (or as a JSON string when it is not JSON).
fn status_and_json(mut r: ureq::http::Response<ureq::Body>) -> (u16, Value) {
    let status = r.status().as_u16();
    let text = r.body_mut().read_to_string().unwrap();
    (
        status,
        serde_json::from_str(&text).unwrap_or(Value::String(text)),
    )
}

/// POSTs `body` as JSON; returns the status and the body as JSON (a JSON string when it is not
/// JSON).
pub fn post(addr: SocketAddr, path: &str, body: &Value) -> (u16, Value) {
    let r = agent()
        .post(format!("http://{addr}{path}"))
        .header("content-type", "application/json")
        .send(body.to_string())
        .unwrap();
    status_and_json(r)
}

/// [`post`], plus the value of the response header `header` (if sent).
pub fn post_header(
    addr: SocketAddr,
    path: &str,
    body: &Value,
    header: &str,
) -> (u16, Value, Option<String>) {
    let r = agent()
        .post(format!("http://{addr}{path}"))
        .header("content-type", "application/json")
        .send(body.to_string())
        .unwrap();
    let h = r
        .headers()
        .get(header)
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    let (s, b) = status_and_json(r);
    (s, b, h)
}

/// GETs `path`; returns the status and the body as JSON (a JSON string when it is not JSON).
pub fn get(addr: SocketAddr, path: &str) -> (u16, Value) {
    status_and_json(agent().get(format!("http://{addr}{path}")).call().unwrap())
}

/// A whole streamed response: status, content type, and the raw SSE text.
pub struct Sse {
    pub status: u16,
    pub content_type: String,
    pub raw: String,
}

impl Sse {
    /// The `data:` payloads in order (`[DONE]` included as a string).
    pub fn data(&self) -> Vec<String> {
        self.raw
            .split("\n\n")
            .filter_map(|ev| ev.strip_prefix("data: "))
            .map(str::to_string)
            .collect()
    }

    /// The JSON chunks (every `data:` but `[DONE]`).
    pub fn chunks(&self) -> Vec<Value> {
        self.data()
            .iter()
            .filter(|d| d.as_str() != "[DONE]")
            .map(|d| serde_json::from_str(d).unwrap())
            .collect()
    }

    /// The `finish_reason`s that are set, in order (one for a stream that finished, none for one
    /// that was ended by an error).
    pub fn finish_reasons(&self) -> Vec<Value> {
        self.chunks()
            .iter()
            .filter_map(|c| c["choices"].get(0).map(|ch| ch["finish_reason"].clone()))
            .filter(|f| !f.is_null())
            .collect()
    }

    /// The object of an in-band error that ended the stream (`data: {"error": {…}}` then
    /// `data: [DONE]`); fails the test when the stream does not end that way.
    pub fn final_error(&self) -> Value {
        let data = self.data();
        assert!(
            data.len() >= 2 && data[data.len() - 1] == "[DONE]",
            "the stream does not end with data: [DONE]: {}",
            self.raw
        );
        let last: Value = serde_json::from_str(&data[data.len() - 2]).unwrap();
        assert!(
            last["error"].is_object(),
            "no in-band error before [DONE]: {}",
            self.raw
        );
        last["error"].clone()
    }

    /// The concatenated `delta.content` (chat) or `text` (completions).
    pub fn text(&self) -> String {
        self.chunks()
            .iter()
            .filter_map(|c| {
                let ch = c["choices"].get(0)?;
                ch["delta"]["content"]
                    .as_str()
                    .or(ch["text"].as_str())
                    .map(str::to_string)
            })
            .collect()
    }
}

/// A streamed response being read: the head has arrived, the events are read on demand.
pub struct SseStream {
    pub status: u16,
    pub content_type: String,
    reader: BufReader<ureq::BodyReader<'static>>,
    raw: String,
}

impl SseStream {
    /// Reads up to the end of the next `data:` event and returns its payload (comments such as
    /// `: ping` are skipped); `None` once the stream has ended. A connection cut before the
    /// chunked body's end fails the test.
    pub fn next_data(&mut self) -> Option<String> {
        let mut event = String::new();
        loop {
            let mut line = String::new();
            let n = self
                .reader
                .read_line(&mut line)
                .expect("the stream ended without its last chunk");
            if n == 0 {
                self.raw.push_str(&event);
                return None;
            }
            event.push_str(&line);
            if line == "\n" {
                self.raw.push_str(&event);
                if let Some(d) = event.strip_prefix("data: ") {
                    return Some(d.trim_end_matches('\n').to_string());
                }
                event.clear();
            }
        }
    }

    /// Reads the rest of the stream; the whole response so far and after.
    pub fn finish(mut self) -> Sse {
        self.reader
            .read_to_string(&mut self.raw)
            .expect("the stream ended without its last chunk");
        Sse {
            status: self.status,
            content_type: self.content_type,
            raw: self.raw,
        }
    }
}

/// POSTs `body` as JSON and returns once the response head has arrived.
pub fn open_stream(addr: SocketAddr, path: &str, body: &Value) -> SseStream {
    let r = agent()
        .post(format!("http://{addr}{path}"))
        .header("content-type", "application/json")
        .send(body.to_string())
        .unwrap();
    let status = r.status().as_u16();
    let content_type = r
        .headers()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_string();
    SseStream {
        status,
        content_type,
        reader: BufReader::new(r.into_body().into_reader()),
        raw: String::new(),
    }
}

/// POSTs `body` as JSON and reads the whole streamed response.
pub fn post_stream(addr: SocketAddr, path: &str, body: &Value) -> Sse {
    open_stream(addr, path, body).finish()
}

/// Sends raw bytes and returns the status line's code and the rest of the response (the
/// connection is closed by the request's `Connection: close`).
pub fn raw_request(addr: SocketAddr, head: &str, body: &[u8]) -> (u16, String) {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    s.write_all(head.as_bytes()).unwrap();
    let _ = s.write_all(body);
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out);
    let text = String::from_utf8_lossy(&out).to_string();
    let code = text
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    (code, text)
}
