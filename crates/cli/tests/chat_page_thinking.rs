//! The chat page's thinking switch and its behaviour when the server goes away, in headless
//! Chromium against `mference serve` on the trained tiny Qwen 3.6 (see `chat_page.rs` for the
//! browser setup and when the test is skipped).
//!
//! With "thinking" ticked the page sends `chat_template_kwargs {"enable_thinking": true}`: the
//! reply's reasoning must equal the API's `reasoning_content` for the same request, shown folded
//! above the answer. The seed field must show its whole placeholder. When the server is killed
//! during a reply, the page must say the server is unreachable (not the browser's "Failed to
//! fetch" / "network error") and its HUD must stop claiming a request is running.
//! Screenshots: `target/chat-page/thinking.png`, `server-gone.png`.

mod browser;

use std::time::Duration;

use browser::{
    browser_present, click, js, open_page, screenshot, send, send_greedy, stored, until,
};
use mference_testkit::http::post;
use mference_testkit::{installed_asset, ServeProcess};
use serde_json::{json, Value};

const BIN: &str = env!("CARGO_BIN_EXE_mference");
const MODEL: &str = "qwen3.6-35b-a3b";
const PROMPT: &str = "Tell me about the king.";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_thinking_switch_folds_the_reasoning_and_a_dead_server_is_named() {
    if !browser_present() {
        return;
    }
    let install = installed_asset("qwen3_6-tiny");
    let serve = ServeProcess::start(
        BIN,
        &["--model", install.to_str().unwrap()],
        Duration::from_secs(120),
    );
    let addr = serve.addr();
    let (status, want) = post(
        addr,
        "/v1/chat/completions",
        &json!({
            "model": MODEL, "messages": [{"role": "user", "content": PROMPT}],
            "temperature": 0, "seed": 7, "max_tokens": 24,
            "chat_template_kwargs": {"enable_thinking": true},
        }),
    );
    assert_eq!(status, 200, "{want}");
    let want = &want["choices"][0]["message"];
    let reasoning = want["reasoning_content"].as_str().unwrap().to_string();
    assert!(!reasoning.is_empty());

    let (c, _driver, _profile) = open_page(addr).await;

    // The placeholder fits inside the field, beside a number field's spin buttons (~15 px).
    let fits = js(
        &c,
        "const e = document.getElementById('seed'); const s = getComputedStyle(e); \
         const g = document.createElement('canvas').getContext('2d'); g.font = s.font; \
         const room = e.clientWidth - parseFloat(s.paddingLeft) - parseFloat(s.paddingRight); \
         return [g.measureText(e.placeholder).width + 24 <= room, room];",
    )
    .await;
    assert_eq!(fits[0], true, "the seed placeholder is cut: {fits}");

    click(&c, "thinking").await;
    send_greedy(&c, PROMPT, 24, 2).await;
    let conv = stored(&c).await;
    assert_eq!(
        conv[1]["reasoning"],
        reasoning.as_str(),
        "streamed reasoning"
    );
    assert_eq!(conv[1]["content"], want["content"], "streamed answer");
    let folded = js(
        &c,
        "const d = document.querySelector('.msg.assistant details.reasoning'); \
         return [d.open, d.querySelector('.thought').textContent];",
    )
    .await;
    assert_eq!(folded, json!([false, reasoning]));
    screenshot(&c, "thinking.png").await;

    // The server dies in the middle of a long reply.
    send(&c, "And the queen?", 3000).await;
    until(
        &c,
        "part of the long reply",
        "const m = JSON.parse(localStorage.getItem('mference.chat.v1')).messages; \
         return m.length === 4 && (m[3].reasoning || '').length > 40 && \
         document.getElementById('hud-queue').textContent.startsWith('1 running');",
    )
    .await;
    serve.signal("KILL");
    until(
        &c,
        "the page to notice",
        "return document.getElementById('stop').hidden && \
         !!document.querySelector('.msg:last-child .error');",
    )
    .await;
    let error = js(
        &c,
        "return document.querySelector('.msg:last-child .error').textContent;",
    )
    .await;
    let error = error.as_str().unwrap();
    assert!(
        error.contains("server is unreachable")
            && !error.contains("Failed to fetch")
            && !error.contains("network error"),
        "{error}"
    );
    until(
        &c,
        "the HUD to drop the running request",
        "const q = document.getElementById('hud-queue').textContent; \
         return !q.includes('running') && q.includes('unreachable');",
    )
    .await;
    // What had arrived is kept.
    let conv: Vec<Value> = stored(&c).await;
    assert!(conv[3]["reasoning"].as_str().unwrap().len() > 40);
    screenshot(&c, "server-gone.png").await;
    c.close().await.unwrap();
}
