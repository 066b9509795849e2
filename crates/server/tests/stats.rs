//! `GET /v1/stats` and `GET /metrics` against a real server on the demo model (8 expert slots per
//! layer, so the cache misses and allocates slots), with every figure checked against a source
//! outside the statistics code: token counts against the responses' `usage`, the MoE shape
//! (layers with a layer file, `top_k_experts`, the expert stride) against the install, sizes
//! against the files on disk, the RSS against this process's `/proc/self/status`, and the
//! `/metrics` text through the official Prometheus client's parser
//! (`prometheus_client.parser`, in the reference venv). Also: the chat page and its files are
//! served from the binary under a Content-Security-Policy that allows only this server.

mod common;

use std::process::Command;
use std::time::{Duration, Instant};

use mference_models::LoadOptions;
use mference_runtime::CacheSlots;
use mference_testkit::http::{get, open_stream, post};
use mference_testkit::{demo_install, demo_source, output_ok, python};
use serde_json::{json, Value};

use common::{chat_body, rss, Opts};

const SLOTS: usize = 8;

fn start(delay: Duration) -> mference_server::Server {
    common::start_with(
        Opts {
            delay,
            ..Default::default()
        },
        |max_context| {
            mference_models::load(
                demo_install(),
                &LoadOptions {
                    slots: CacheSlots::Fixed(SLOTS),
                    threads: 1,
                    max_context,
                    ..Default::default()
                },
            )
            .unwrap()
        },
    )
}

/// `top_k_experts`, `num_experts` of the demo checkpoint's config.json.
fn moe_config() -> (u64, u64) {
    let c: Value =
        serde_json::from_slice(&std::fs::read(demo_source().join("config.json")).unwrap()).unwrap();
    let t = &c["text_config"];
    (
        t["top_k_experts"].as_u64().unwrap(),
        t["num_experts"].as_u64().unwrap(),
    )
}

/// Layer files (`packed_experts/layer_NN.bin`) of the install and the size of one (all are `experts × stride` bytes).
fn layer_files() -> (u64, u64) {
    let dir = demo_install().join("packed_experts");
    let sizes: Vec<u64> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap())
        .filter(|e| {
            let name = e.file_name().to_string_lossy().to_string();
            name.starts_with("layer_") && name.ends_with(".bin")
        })
        .map(|e| e.metadata().unwrap().len())
        .collect();
    (sizes.len() as u64, sizes[0])
}

fn u(v: &Value) -> u64 {
    v.as_u64().unwrap_or_else(|| panic!("not a count: {v}"))
}

/// Every sample of a Prometheus text page as `name{labels}` → value, parsed by
/// `prometheus_client`, with each family's type under `# TYPE name`.
fn parse_metrics(text: &str) -> serde_json::Map<String, Value> {
    let code = "import json, sys\n\
        from prometheus_client.parser import text_string_to_metric_families\n\
        out = {}\n\
        for f in text_string_to_metric_families(sys.argv[1]):\n\
        \x20   out['# TYPE ' + f.name] = f.type\n\
        \x20   for s in f.samples:\n\
        \x20       labels = ','.join(f'{k}={v}' for k, v in sorted(s.labels.items()))\n\
        \x20       out[s.name + '{' + labels + '}'] = s.value\n\
        print(json.dumps(out))";
    let out = output_ok(Command::new(python()).args(["-c", code, text]));
    serde_json::from_slice::<Value>(&out.stdout)
        .unwrap()
        .as_object()
        .unwrap()
        .clone()
}

#[test]
fn stats_and_metrics_report_the_servers_real_counters() {
    let server = start(Duration::ZERO);
    let addr = server.local_addr();
    let (top_k, experts) = moe_config();
    let (moe_layers, layer_bytes) = layer_files();
    let stride = layer_bytes / experts;

    let (status, s) = get(addr, "/v1/stats");
    assert_eq!(status, 200);
    let info = &s["server"];
    assert_eq!(info["model"], common::MODEL_ID);
    assert!(info["device"].as_str().unwrap().starts_with("cpu"));
    assert_eq!(u(&info["moe_layers"]), moe_layers);
    assert_eq!(u(&info["experts_per_layer"]), experts);
    assert_eq!(u(&info["slots_per_layer"]), SLOTS as u64);
    assert_eq!(u(&info["expert_stride_bytes"]), stride);
    assert_eq!(info["io"], "pread");
    let weights = std::fs::metadata(demo_install().join("model_weights.bin"))
        .unwrap()
        .len();
    assert_eq!(u(&s["memory"]["resident_weights_bytes"]), weights);
    assert_eq!(
        u(&s["memory"]["expert_slot_capacity_bytes"]),
        moe_layers * SLOTS as u64 * stride
    );
    assert_eq!(u(&s["memory"]["expert_slot_bytes"]), 0, "no layer used yet");
    assert!(s["last"].is_null());

    // Two greedy requests; the second repeats the first's prompt (prefix reuse).
    let body = chat_body(json!([{"role": "user", "content": "Tell me about the sea."}]));
    let mut usages = Vec::new();
    for _ in 0..2 {
        let (status, r) = post(addr, "/v1/chat/completions", &body);
        assert_eq!(status, 200, "{r}");
        assert_eq!(r["choices"][0]["finish_reason"], "length");
        usages.push(r["usage"].clone());
    }
    let before = rss().0;
    let (_, s) = get(addr, "/v1/stats");
    let after = rss().0;
    let last = &s["last"];
    let usage = &usages[1];
    assert_eq!(last["phase"], "done");
    assert_eq!(last["finish_reason"], "length");
    assert_eq!(last["prompt_tokens"], usage["prompt_tokens"]);
    assert_eq!(
        last["cached_tokens"],
        usage["prompt_tokens_details"]["cached_tokens"]
    );
    assert!(
        u(&last["cached_tokens"]) > 0,
        "the repeated prompt was cached"
    );
    assert_eq!(last["completion_tokens"], usage["completion_tokens"]);
    // The first token comes from prefill; a reply cut by max_tokens stops before its last forward.
    let completion = u(&usage["completion_tokens"]);
    let decode = &last["decode"];
    assert_eq!(u(&decode["tokens"]), completion - 1);
    assert_eq!(
        u(&last["prefill"]["tokens"]),
        u(&usage["prompt_tokens"]) - u(&last["cached_tokens"])
    );
    // Each decode token routes to top_k distinct experts in every MoE layer; each miss reads one
    // stride.
    let x = &decode["experts"];
    assert_eq!(
        u(&x["hits"]) + u(&x["misses"]),
        u(&decode["tokens"]) * moe_layers * top_k
    );
    let all = &s["session"]["experts"];
    assert!(u(&all["misses"]) > 0, "8 of 16 slots must miss");
    assert_eq!(u(&all["bytes_read"]), u(&all["misses"]) * stride);
    assert!(last["ttft_s"].as_f64().unwrap() > 0.0);
    assert!(decode["tokens_per_s"].as_f64().unwrap() > 0.0);
    assert_eq!(
        u(&s["memory"]["expert_slot_bytes"]),
        moe_layers * SLOTS as u64 * stride,
        "every MoE layer was used"
    );
    let kv = u(&s["memory"]["kv_cache_bytes"]);
    assert!(kv > 0);
    // The KV cache holds the last prompt and every generated token but the last.
    assert_eq!(
        u(&s["kv_cache_tokens"]),
        u(&usage["prompt_tokens"]) + completion - 1
    );
    let server_rss = u(&s["memory"]["rss_bytes"]);
    let slack = 32 << 20;
    assert!(
        server_rss + slack >= before.min(after) && server_rss <= before.max(after) + slack,
        "server rss {server_rss}, this process {before}..{after}"
    );
    let session = &s["session"];
    let sum = |k: &str| usages.iter().map(|u| u[k].as_u64().unwrap()).sum::<u64>();
    assert_eq!(u(&session["prompt_tokens"]), sum("prompt_tokens"));
    assert_eq!(u(&session["completion_tokens"]), sum("completion_tokens"));
    assert_eq!(u(&session["requests"]["length"]), 2);

    // A refused request counts by its status, not as a generation.
    let mut bad = body.clone();
    bad["temperature"] = json!(5);
    assert_eq!(post(addr, "/v1/chat/completions", &bad).0, 400);
    let (_, s) = get(addr, "/v1/stats");
    assert_eq!(s["session"]["rejected"], json!({"400": 1}));
    assert_eq!(u(&s["session"]["requests"]["length"]), 2);

    // /metrics: the same numbers, in a text the official parser reads.
    let r = mference_testkit::http::agent()
        .get(format!("http://{addr}/metrics"))
        .call()
        .unwrap();
    let ctype = r.headers()["content-type"].to_str().unwrap().to_string();
    assert!(ctype.starts_with("text/plain; version=0.0.4"), "{ctype}");
    let text = r.into_body().read_to_string().unwrap();
    let m = parse_metrics(&text);
    let (_, s) = get(addr, "/v1/stats");
    let val = |k: &str| {
        m.get(k)
            .and_then(Value::as_f64)
            .unwrap_or_else(|| panic!("{k} missing from /metrics:\n{text}"))
    };
    let session = &s["session"];
    for (name, want) in [
        ("mference_prompt_tokens_total{}", &session["prompt_tokens"]),
        (
            "mference_prompt_tokens_cached_total{}",
            &session["cached_tokens"],
        ),
        (
            "mference_generation_tokens_total{}",
            &session["completion_tokens"],
        ),
        (
            "mference_prefill_tokens_total{}",
            &session["prefill"]["tokens"],
        ),
        (
            "mference_decode_tokens_total{}",
            &session["decode"]["tokens"],
        ),
        (
            "mference_expert_cache_hits_total{}",
            &session["experts"]["hits"],
        ),
        (
            "mference_expert_cache_misses_total{}",
            &session["experts"]["misses"],
        ),
        (
            "mference_expert_bytes_read_total{}",
            &session["experts"]["bytes_read"],
        ),
        ("mference_requests_total{finish_reason=length}", &json!(2)),
        ("mference_requests_rejected_total{status=400}", &json!(1)),
        ("mference_time_to_first_token_seconds_count{}", &json!(2)),
        (
            "mference_time_to_first_token_seconds_bucket{le=+Inf}",
            &json!(2),
        ),
        ("mference_resident_weights_bytes{}", &json!(weights)),
        ("mference_requests_running{}", &json!(0)),
        ("mference_kv_cache_tokens{}", &s["kv_cache_tokens"]),
    ] {
        assert_eq!(val(name), want.as_f64().unwrap(), "{name}");
    }
    for (family, kind) in [
        ("mference_prompt_tokens", "counter"),
        ("mference_requests", "counter"),
        ("mference_time_to_first_token_seconds", "histogram"),
        ("mference_process_resident_memory_bytes", "gauge"),
        ("mference_info", "gauge"),
    ] {
        assert_eq!(m[&format!("# TYPE {family}")], kind, "{family}");
    }
    let info_key = m.keys().find(|k| k.starts_with("mference_info{")).unwrap();
    assert!(info_key.contains("expert_slots=8") && info_key.contains("io=pread"));
    let ttft = val("mference_time_to_first_token_seconds_sum{}");
    assert!(ttft > 0.0);
}

#[test]
fn stats_follow_a_running_stream_and_its_cancellation() {
    let server = start(Duration::from_millis(30));
    let addr = server.local_addr();
    let mut body = chat_body(json!([{"role": "user", "content": "Sing."}]));
    body["stream"] = json!(true);
    body["max_tokens"] = json!(2000);
    let mut stream = open_stream(addr, "/v1/chat/completions", &body);
    let mut id = None;
    let mut deltas = 0;
    while deltas < 3 {
        let data = stream.next_data().expect("a chunk");
        let chunk: Value = serde_json::from_str(&data).unwrap();
        id = chunk["id"].as_str().map(str::to_string);
        deltas += 1;
    }
    let (_, s) = get(addr, "/v1/stats");
    let last = &s["last"];
    assert_eq!(last["id"].as_str(), id.as_deref());
    assert_eq!(last["phase"], "decode");
    assert!(last["completion_tokens"].is_null());
    assert!(u(&last["decode"]["tokens"]) >= 1);
    assert_eq!(u(&s["queue"]["running"]), 1);
    // The running request already counts in the session's decode figures.
    assert_eq!(s["session"]["decode"]["tokens"], last["decode"]["tokens"]);

    drop(stream);
    let t0 = Instant::now();
    let last = loop {
        let (_, s) = get(addr, "/v1/stats");
        if s["last"]["phase"] == "done" {
            break s;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "the cancelled stream did not end"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_eq!(last["last"]["finish_reason"], "cancelled");
    assert!(u(&last["last"]["completion_tokens"]) < 2000);
    assert_eq!(u(&last["session"]["requests"]["cancelled"]), 1);
    assert_eq!(u(&last["queue"]["running"]), 0);
}

#[test]
fn the_chat_page_comes_from_the_binary_and_may_reach_only_this_server() {
    let server = common::start(Opts::default());
    let addr = server.local_addr();
    let agent = mference_testkit::http::agent();
    let fetch = |path: &str| {
        let r = agent.get(format!("http://{addr}{path}")).call().unwrap();
        assert_eq!(r.status(), 200, "{path}");
        let h = |k: &str| {
            r.headers()
                .get(k)
                .map(|v| v.to_str().unwrap().to_string())
                .unwrap_or_default()
        };
        let (ctype, csp) = (h("content-type"), h("content-security-policy"));
        (ctype, csp, r.into_body().read_to_string().unwrap())
    };
    let (ctype, csp, html) = fetch("/");
    assert!(ctype.starts_with("text/html"), "{ctype}");
    for rule in [
        "default-src 'none'",
        "script-src 'self'",
        "connect-src 'self'",
    ] {
        assert!(csp.contains(rule), "{rule} missing from {csp}");
    }
    // Every file the page loads is one of ours, by path.
    let refs: Vec<&str> = html
        .split(['"', '\''])
        .filter(|s| s.starts_with('/') || s.contains("://"))
        .collect();
    assert!(!refs.is_empty());
    for r in &refs {
        assert!(r.starts_with("/ui/"), "the page loads {r}");
        let (ctype, _, body) = fetch(r);
        let want = if r.ends_with(".js") {
            "text/javascript"
        } else {
            "text/css"
        };
        assert!(ctype.starts_with(want), "{r}: {ctype}");
        assert!(!body.contains("://"), "{r} names another origin");
    }
}
