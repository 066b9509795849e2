//! A bounded load test on loopback (its own test binary, so the RSS numbers are this server's).

mod common;

use common::*;
use mference_testkit::http::{get, post, post_stream};
use serde_json::json;

/// 50 concurrent clients, four rounds: every request gets 200 or 429, the server survives, and
/// memory stays bounded (RSS after the last round within 64 MiB of after the first).
#[test]
fn load_50_concurrent_clients() {
    let srv = start(Opts::default());
    let a = srv.local_addr();
    let (mut ok, mut busy) = (0usize, 0usize);
    let mut rss_after = Vec::new();
    for round in 0..4 {
        let handles: Vec<_> = (0..50)
            .map(|i| {
                std::thread::spawn(move || {
                    let stream = i % 2 == 0;
                    let body = json!({"model": MODEL_ID, "messages": [{"role": "user", "content": format!("Client {i} of round {round}: tell me a story.")}],
                        "max_tokens": 12, "temperature": 0.8, "seed": i, "stream": stream});
                    if stream {
                        let s = post_stream(a, "/v1/chat/completions", &body);
                        if s.status == 200 {
                            assert_eq!(s.data().last().map(String::as_str), Some("[DONE]"), "{}", s.raw);
                        }
                        s.status
                    } else {
                        post(a, "/v1/chat/completions", &body).0
                    }
                })
            })
            .collect();
        for h in handles {
            match h.join().unwrap() {
                200 => ok += 1,
                429 => busy += 1,
                other => panic!("status {other} under load"),
            }
        }
        rss_after.push(rss().0);
    }
    let (_, peak) = rss();
    eprintln!(
        "load: {} requests, {ok} × 200, {busy} × 429; RSS after each round {:?} MiB, peak {} MiB",
        ok + busy,
        rss_after.iter().map(|b| b >> 20).collect::<Vec<_>>(),
        peak >> 20
    );
    assert_eq!(ok + busy, 200);
    assert!(
        ok >= 4 * 4,
        "at least the 4 queued requests per round succeed"
    );
    assert!(
        rss_after[3] < rss_after[0] + (64 << 20),
        "RSS grew: {rss_after:?}"
    );
    assert_eq!(get(a, "/health").0, 200);
    srv.shutdown();
}
