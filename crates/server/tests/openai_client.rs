//! The real `openai` Python client (pinned in tools/ref/requirements.txt, installed in `.venv`)
//! against the server on the demo model: chat, streaming, logprobs, a tool-call round trip,
//! completions, and error statuses (`tests/openai_client.py` has the assertions).

mod common;

use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::*;
use mference_testkit::{python, repo};

#[test]
fn openai_python_client() {
    let py = python();
    let script = Arc::new(Mutex::new(String::from(
        "<|tool_call>call:get_weather{city:<|\"|>London<|\"|>,days:3}<tool_call|>",
    )));
    let srv = start(Opts {
        queue_limit: 1,
        delay: Duration::from_millis(20),
        tool_script: Some(script),
        ..Opts::default()
    });
    let out = Command::new(py)
        .arg(repo().join("crates/server/tests/openai_client.py"))
        .env("MFERENCE_BASE_URL", format!("http://{}", srv.local_addr()))
        .env("MFERENCE_MODEL", MODEL_ID)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "openai_client.py failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    eprintln!("openai client: {stdout}");
    srv.shutdown();
}
