//! The chat page in a real browser: Debian's headless Chromium, driven over WebDriver
//! (`chromedriver`, the `fantoccini` client), against `mference serve` on the demo model.
//!
//! A message typed into the page must stream back exactly the API's greedy reply for the same
//! request; the HUD must show the server's figures (prompt tokens equal to the API's usage, TTFT
//! and decode tok/s above zero, the resident weights equal to `model_weights.bin`); Regenerate
//! must give the same greedy reply again; Stop must cut a long reply short (a prefix of the greedy
//! reply to the same messages, the page's system prompt included; finish `cancelled`) and leave
//! the server healthy; a reload must bring the conversation back; a reasoning block must show
//! folded; Clear must empty it. Screenshots go to `target/chat-page/` (`chat.png`,
//! `streaming.png`, `reasoning.png`).
//!
//! Without `/usr/bin/chromium` and `/usr/bin/chromedriver` the test is skipped with a message,
//! unless `MFERENCE_REQUIRE_BROWSER=1` (set by `.ci/run`, which installs both) makes that a failure.

mod browser;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use browser::{
    browser_present, click, input_value, js, open_page, reload, reply_done, screenshot, send,
    send_greedy, stored, type_into, until, PATIENCE,
};
use fantoccini::{Client, Locator};
use mference_testkit::demo_install;
use mference_testkit::http::{get, post};
use mference_testkit::ServeProcess;
use serde_json::{json, Value};

const BIN: &str = env!("CARGO_BIN_EXE_mference");
const MODEL: &str = "gemma-4-26b-a4b-it";
const PROMPT: &str = "Tell me about the king.";
const SYSTEM: &str = "You are a herald of the court.";
/// The HUD's numbers (`data-value` of every cell with an id), read at one instant: the page
/// redraws the HUD on every poll.
struct Hud(serde_json::Map<String, Value>);

impl Hud {
    async fn read(c: &Client) -> Hud {
        let v = js(
            c,
            "const o = {}; for (const e of document.querySelectorAll('#hud [id]')) \
             o[e.id] = e.dataset.value === undefined ? null : e.dataset.value; return o;",
        )
        .await;
        Hud(v.as_object().cloned().expect("an object"))
    }

    /// The cell `id`'s number; `None` when it shows none.
    fn get(&self, id: &str) -> Option<f64> {
        let v = self.0.get(id).unwrap_or_else(|| panic!("no HUD cell {id}"));
        v.as_str()
            .filter(|v| !v.is_empty())
            .map(|v| v.parse().unwrap_or_else(|_| panic!("{id}: {v:?}")))
    }
}

/// Whitespace-insensitive text (rendered paragraphs vs the raw reply).
fn words(s: &str) -> String {
    s.split_whitespace().collect::<Vec<_>>().join(" ")
}

fn chat(messages: Value, max_tokens: usize) -> Value {
    json!({"model": MODEL, "messages": messages, "temperature": 0, "seed": 7, "max_tokens": max_tokens})
}

fn api_reply(addr: SocketAddr, body: &Value) -> Value {
    let (status, v) = post(addr, "/v1/chat/completions", body);
    assert_eq!(status, 200, "{v}");
    v
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_page_streams_the_greedy_reply_shows_the_hud_stops_and_survives_a_reload() {
    if !browser_present() {
        return;
    }
    let install = demo_install();
    let serve = ServeProcess::start(
        BIN,
        // Fewer slots than experts: the cache misses and its slots take memory.
        &[
            "--model",
            install.to_str().unwrap(),
            "--expert-cache-slots",
            "8",
        ],
        Duration::from_secs(120),
    );
    let addr = serve.addr();
    let user = json!([{"role": "user", "content": PROMPT}]);
    let want = api_reply(addr, &chat(user.clone(), 40));
    let want_text = want["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(!want_text.trim().is_empty(), "the greedy reply is empty");

    let (c, _driver, _profile) = open_page(addr).await;

    // The Markdown renderer escapes HTML and keeps only the markup it makes.
    let html = js(
        &c,
        "return mferenceMarkdown.render('<img src=x onerror=alert(1)> **b** `<i>`\\n```\\n<b>\\n```');",
    )
    .await;
    assert_eq!(
        html,
        "<p>&lt;img src=x onerror=alert(1)&gt; <strong>b</strong> <code>&lt;i&gt;</code></p>\n\
         <pre><code>&lt;b&gt;</code></pre>"
    );
    let html = js(
        &c,
        "return mferenceMarkdown.render('# T\\n- a\\n- *b*\\n\\n3. x\\n4. y\\n\
         [l](https://e.org/?a=1&b=2) [j](javascript:alert(1)) [k](https://a.b/\"onclick=\"x)');",
    )
    .await;
    assert_eq!(
        html,
        "<h1>T</h1>\n<ul><li>a</li><li><em>b</em></li></ul>\n<ol start=\"3\"><li>x</li><li>y</li></ol>\n\
         <p><a href=\"https://e.org/?a=1&amp;b=2\" target=\"_blank\" rel=\"noopener noreferrer\">l</a> \
         [j](javascript:alert(1)) \
         <a href=\"https://a.b/&quot;onclick=&quot;x\" target=\"_blank\" rel=\"noopener noreferrer\">k</a></p>"
    );
    let split = js(
        &c,
        "return mferenceChat.splitReasoning('<|channel>thought\\nhmm<channel|>Yes.');",
    )
    .await;
    assert_eq!(
        split,
        json!({"reasoning": "hmm", "open": false, "answer": "Yes."})
    );

    // Greedy from the page: the same request as the API's.
    send_greedy(&c, PROMPT, 40, 2).await;
    let conv = stored(&c).await;
    assert_eq!(conv.len(), 2);
    assert_eq!(conv[0]["content"], PROMPT);
    assert_eq!(conv[1]["content"], want_text.as_str(), "streamed reply");
    let shown = c
        .find(Locator::Css(".msg.assistant .answer"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert_eq!(words(&shown), words(&want_text), "rendered reply");

    // The HUD: this reply's figures are the server's, the session counts both requests.
    let hud = Hud::read(&c).await;
    let prompt = want["usage"]["prompt_tokens"].as_f64().unwrap();
    let completion = want["usage"]["completion_tokens"].as_f64().unwrap();
    assert_eq!(hud.get("hud-reply-prompt"), Some(prompt));
    assert_eq!(hud.get("hud-reply-completion"), Some(completion));
    // The page sent the API's prompt again, so the retained prefix holds all of it but the
    // token that must be prefilled to produce logits.
    let cached = hud.get("hud-reply-cached").unwrap();
    assert!(
        cached > 0.0 && cached < prompt,
        "cached {cached} of {prompt}"
    );
    assert!(hud.get("hud-reply-ttft").unwrap() > 0.0);
    assert!(hud.get("hud-reply-prefill-tps").unwrap() > 0.0);
    assert!(hud.get("hud-reply-decode-tps").unwrap() > 0.0);
    let hit = hud.get("hud-session-hit-rate").unwrap();
    assert!((0.0..=1.0).contains(&hit), "hit rate {hit}");
    assert_eq!(hud.get("hud-session-prompt"), Some(2.0 * prompt));
    assert_eq!(hud.get("hud-session-completion"), Some(2.0 * completion));
    let weights = std::fs::metadata(install.join("model_weights.bin"))
        .unwrap()
        .len();
    assert_eq!(hud.get("hud-weights"), Some(weights as f64));
    assert!(hud.get("hud-slots").unwrap() > 0.0);
    assert!(hud.get("hud-session-bytes-read").unwrap() > 0.0);
    let rss = hud.get("hud-rss").unwrap();
    assert!(rss > weights as f64 / 2.0, "rss {rss}");
    let device = js(
        &c,
        "return document.getElementById('hud-device').textContent;",
    )
    .await;
    assert!(device.as_str().unwrap().starts_with("cpu"), "{device}");
    screenshot(&c, "chat.png").await;

    // Copy answers (the clipboard itself is the browser's).
    js(
        &c,
        "document.querySelector('.msg.assistant .copy').click(); return true;",
    )
    .await;
    until(
        &c,
        "the copy button's answer",
        "return document.querySelector('.msg.assistant .copy').textContent === 'copied';",
    )
    .await;

    // Regenerate replaces the reply with the same greedy one.
    click(&c, "regenerate").await;
    reply_done(&c, 2).await;
    assert_eq!(stored(&c).await[1]["content"], want_text.as_str());

    // Stop a long reply once some of it has arrived (with a system prompt from now on).
    type_into(&c, "system", SYSTEM).await;
    send(&c, "And the queen?", 3000).await;
    until(
        &c,
        "part of the long reply",
        "const m = JSON.parse(localStorage.getItem('mference.chat.v1')).messages; \
         return m.length === 4 && m[3].content.length > 40;",
    )
    .await;
    screenshot(&c, "streaming.png").await;
    click(&c, "stop").await;
    until(
        &c,
        "the stop",
        "return document.getElementById('stop').hidden;",
    )
    .await;
    let conv = stored(&c).await;
    let cut = conv[3]["content"].as_str().unwrap().to_string();
    assert_eq!(conv[3]["stopped"], true);
    // The server ends the generation at its next token; its counters say where.
    let t0 = Instant::now();
    let last = loop {
        let (_, s) = get(addr, "/v1/stats");
        if s["last"]["phase"] == "done" {
            break s["last"].clone();
        }
        assert!(t0.elapsed() < PATIENCE, "the stopped request did not end");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(last["finish_reason"], "cancelled");
    let made = last["completion_tokens"].as_u64().unwrap() as usize;
    assert!(made < 3000, "{made} tokens: the reply was not stopped");
    let (status, _) = get(addr, "/health");
    assert_eq!(status, 200, "the server after a stop");
    let history = json!([
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": PROMPT},
        {"role": "assistant", "content": want_text},
        {"role": "user", "content": "And the queen?"},
    ]);
    let full = api_reply(addr, &chat(history, made + 8));
    let full = full["choices"][0]["message"]["content"].as_str().unwrap();
    assert!(
        full.starts_with(&cut) && cut.len() < full.len(),
        "the stopped reply {cut:?} is not a strict prefix of the greedy reply {full:?}"
    );

    // A reload brings the conversation back from the browser's storage.
    reload(&c).await;
    let roles: Vec<String> = {
        let mut v = Vec::new();
        for e in c.find_all(Locator::Css(".msg")).await.unwrap() {
            v.push(e.attr("data-role").await.unwrap().unwrap_or_default());
        }
        v
    };
    assert_eq!(roles, ["user", "assistant", "user", "assistant"]);
    let texts = c.find_all(Locator::Css(".msg .body")).await.unwrap();
    assert_eq!(words(&texts[0].text().await.unwrap()), PROMPT);
    assert_eq!(words(&texts[1].text().await.unwrap()), words(&want_text));
    assert_eq!(words(&texts[3].text().await.unwrap()), words(&cut));
    assert_eq!(
        input_value(&c, "max_tokens").await,
        "3000",
        "settings survive too"
    );
    assert_eq!(input_value(&c, "system").await, SYSTEM);

    // A Gemma thought channel shows folded above the answer, and the answer's Markdown renders.
    js(
        &c,
        "localStorage.setItem('mference.chat.v1', JSON.stringify({messages: [\
           {role: 'user', content: 'Why?'},\
           {role: 'assistant', content: '<|channel>thought\\nBecause.<channel|>So **this** <b>.'}]}));\
         return true;",
    )
    .await;
    reload(&c).await;
    let folded = js(
        &c,
        "const d = document.querySelector('.msg.assistant details.reasoning'); \
         const a = document.querySelector('.msg.assistant .answer'); \
         return [d.open, d.querySelector('.thought').textContent, a.innerHTML];",
    )
    .await;
    assert_eq!(
        folded,
        json!([
            false,
            "Because.",
            "<p>So <strong>this</strong> &lt;b&gt;.</p>"
        ])
    );
    screenshot(&c, "reasoning.png").await;

    // Clear empties the conversation, also after a reload.
    click(&c, "clear").await;
    reload(&c).await;
    assert!(stored(&c).await.is_empty());
    assert!(c.find_all(Locator::Css(".msg")).await.unwrap().is_empty());
    c.close().await.unwrap();
}
