//! Structured output (`response_format`) on the bundled models, Gemma tiny and Qwen tiny: JSON
//! mode and JSON Schema (strict and not), chat and completions, streamed and not. Every reply
//! that ends with `stop` must parse and validate under its schema, checked by the independent
//! `jsonschema` crate; a budget cut ends as `length` with the JSON so far; a schema llguidance
//! cannot compile gets a 400 naming `response_format` and the reason.

mod common;

use std::net::SocketAddr;

use mference_models::LoadOptions;
use mference_runtime::CacheSlots;
use mference_server::PromptCacheMode;
use mference_testkit::http::{post, post_stream};
use mference_testkit::installed_asset;
use serde_json::{json, Value};

/// Bounded everywhere (string lengths, integer range, item count), so even a weak model's reply
/// completes well inside the budget.
fn person_schema() -> Value {
    json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
            "member": {"type": "boolean"},
            "role": {"enum": ["reader", "writer", "editor"]}
        },
        "required": ["name", "age", "member", "role"],
        "additionalProperties": false
    })
}

fn json_schema_format(schema: &Value, strict: bool) -> Value {
    json!({"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": strict}})
}

/// The reply text of a chat or completion response.
fn reply_text(r: &Value) -> String {
    let c = &r["choices"][0];
    c["message"]["content"]
        .as_str()
        .or(c["text"].as_str())
        .unwrap_or_else(|| panic!("no text in {r}"))
        .to_string()
}

/// Asserts `text` parses as JSON and validates under `schema`.
fn assert_valid(text: &str, schema: &Value, what: &str) -> Value {
    let v: Value = serde_json::from_str(text)
        .unwrap_or_else(|e| panic!("{what}: the reply is not JSON ({e}): {text:?}"));
    let validator = jsonschema::validator_for(schema).expect("the test schema is valid");
    let errors: Vec<String> = validator.iter_errors(&v).map(|e| e.to_string()).collect();
    assert!(
        errors.is_empty(),
        "{what}: {text} does not validate: {errors:?}"
    );
    v
}

/// Closes a JSON prefix the way a cut reply would have gone on: an open string, a dangling
/// `:` or `,`, open arrays and objects. Written from RFC 8259's grammar, independent of the
/// server's constraint code.
fn close_json(prefix: &str) -> String {
    let (mut stack, mut in_str, mut esc) = (Vec::new(), false, false);
    // The last string opened is an object key (it follows `{` or `,` inside an object).
    let (mut key, mut prev) = (false, ' ');
    for c in prefix.chars() {
        match (in_str, esc, c) {
            (true, true, _) => esc = false,
            (true, false, '\\') => esc = true,
            (true, false, '"') => in_str = false,
            (true, false, _) => {}
            (false, _, '"') => {
                in_str = true;
                key = stack.last() == Some(&'}') && matches!(prev, '{' | ',');
            }
            (false, _, '{') => stack.push('}'),
            (false, _, '[') => stack.push(']'),
            (false, _, '}' | ']') => {
                stack.pop();
            }
            _ => {}
        }
        if !in_str && !c.is_whitespace() {
            prev = c;
        }
    }
    let mut out = prefix.to_string();
    if esc {
        out.push('n');
    }
    if in_str {
        out.push('"');
        prev = '"';
    }
    if prev == ':' {
        out.push_str("null");
    } else if prev == ',' {
        out.truncate(out.trim_end().len() - 1);
    } else if prev == '"' && key {
        out.push_str(":null");
    }
    out.extend(stack.iter().rev());
    out
}

/// Asserts a reply that ended as `finish` is valid: complete and valid under `schema` for
/// `stop`; for `length` (allowed only when `cut_ok`, JSON mode, whose strings a weak model can
/// fill forever) a prefix of a JSON object.
fn assert_reply(text: &str, finish: &Value, schema: &Value, cut_ok: bool, what: &str) {
    if finish == "length" && cut_ok {
        assert!(text.starts_with('{'), "{what}: {text:?}");
        let closed = close_json(text);
        let v: Value = serde_json::from_str(&closed)
            .unwrap_or_else(|e| panic!("{what}: the cut reply is no JSON prefix ({e}): {text:?}"));
        assert!(v.is_object(), "{what}: {closed}");
        return;
    }
    assert_eq!(finish, "stop", "{what}: the reply did not complete: {text}");
    assert_valid(text, schema, what);
}

/// One request, JSON and streamed: both end the same way, their texts are equal when greedy,
/// and the text validates ([`assert_reply`]). Returns the text.
fn check(addr: SocketAddr, path: &str, body: Value, schema: &Value, what: &str) -> String {
    let cut_ok = body["response_format"]["type"] == "json_object";
    let (s, r) = post(addr, path, &body);
    assert_eq!(s, 200, "{what}: {r}");
    let finish = r["choices"][0]["finish_reason"].clone();
    let text = reply_text(&r);
    assert_reply(&text, &finish, schema, cut_ok, what);
    let mut sbody = body.clone();
    sbody["stream"] = json!(true);
    let sse = post_stream(addr, path, &sbody);
    assert_eq!(sse.status, 200, "{what} streamed: {}", sse.raw);
    let finishes = sse.finish_reasons();
    assert_eq!(finishes.len(), 1, "{what} streamed");
    let streamed = sse.text();
    assert_reply(
        &streamed,
        &finishes[0],
        schema,
        cut_ok,
        &format!("{what} streamed"),
    );
    if body["temperature"] == 0 {
        assert_eq!(streamed, text, "{what}: streamed and JSON replies differ");
    }
    text
}

/// Every format, endpoint and sampling mode against the server at `addr` (`model` is its id).
fn structured_replies(addr: SocketAddr, model: &str) {
    let person = person_schema();
    let chat = |format: Value, temperature: f64| {
        json!({"model": model, "temperature": temperature, "seed": 7, "max_tokens": 200,
            "messages": [{"role": "user", "content": "Describe Elizabeth Bennet as a JSON object."}],
            "response_format": format})
    };
    let object = json!({"type": "object"});
    for (format, schema, what) in [
        (json!({"type": "json_object"}), &object, "json_object"),
        (json_schema_format(&person, true), &person, "strict schema"),
        (json_schema_format(&person, false), &person, "schema"),
    ] {
        for temperature in [0.0, 1.0] {
            let what = format!("{model} chat {what} t={temperature}");
            let text = check(
                addr,
                "/v1/chat/completions",
                chat(format.clone(), temperature),
                schema,
                &what,
            );
            eprintln!("{what}: {text}");
        }
    }
    let completion = json!({"model": model, "temperature": 0, "max_tokens": 200,
        "prompt": "Mr. Darcy, as a JSON record:", "response_format": json_schema_format(&person, true)});
    let text = check(
        addr,
        "/v1/completions",
        completion.clone(),
        &person,
        &format!("{model} completion"),
    );
    eprintln!("{model} completion: {text}");

    // A budget too small for any object: `length`, and the JSON so far is a prefix that does not
    // parse yet (OpenAI's behaviour).
    let mut short = chat(json_schema_format(&person, true), 0.0);
    short["max_tokens"] = json!(3);
    let (s, r) = post(addr, "/v1/chat/completions", &short);
    assert_eq!(s, 200, "{r}");
    assert_eq!(r["choices"][0]["finish_reason"], "length", "{r}");
    let cut = reply_text(&r);
    assert!(cut.starts_with('{'), "{cut:?}");
    assert!(serde_json::from_str::<Value>(&cut).is_err(), "{cut:?}");

    // Schemas llguidance refuses: 400, `response_format`, its reason on one line (no parser
    // state). A `$ref` loop compiles but can produce no first token: refused before generating.
    let looped = json!({"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}},
                        "$ref": "#/$defs/a"});
    for (schema, strict, reason) in [
        (json!({"$ref": "#/$defs/missing"}), true, "missing"),
        (
            json!({"type": "integer", "minimum": 5, "maximum": 1}),
            true,
            "nsatisfiable",
        ),
        (looped, false, ""),
    ] {
        let (s, b) = post(
            addr,
            "/v1/chat/completions",
            &chat(json_schema_format(&schema, strict), 0.0),
        );
        assert_eq!(s, 400, "{schema}: {b}");
        assert_eq!(b["error"]["param"], "response_format", "{b}");
        let msg = b["error"]["message"].as_str().unwrap();
        assert!(msg.contains(reason), "{schema}: {msg}");
        assert!(!msg.contains('\n'), "one line, no parser state: {msg}");
    }
    // A stop string could cut the JSON: the combination is refused.
    let mut body = chat(json_schema_format(&person_schema(), true), 0.0);
    body["stop"] = json!([","]);
    let (s, b) = post(addr, "/v1/chat/completions", &body);
    assert_eq!(s, 400, "stop + response_format: {b}");
    assert_eq!(b["error"]["param"], "stop", "{b}");
}

#[test]
fn closing_a_json_prefix() {
    for (prefix, want) in [
        (r#"{"a":"x"#, json!({"a": "x"})),
        (r#"{"a":[1,{"b":"#, json!({"a": [1, {"b": null}]})),
        (r#"{"a":1,"#, json!({"a": 1})),
        (r#"{"a"#, json!({"a": null})),
        (r#"{"a":"\"#, json!({"a": "\n"})),
    ] {
        assert_eq!(
            serde_json::from_str::<Value>(&close_json(prefix)).unwrap(),
            want,
            "{prefix}"
        );
    }
    assert!(serde_json::from_str::<Value>(&close_json(r#"{"a" 1"#)).is_err());
}

#[test]
fn gemma_tiny_replies_validate() {
    let srv = common::start(common::Opts::default());
    structured_replies(srv.local_addr(), common::MODEL_ID);
    srv.shutdown();
}

#[test]
fn qwen_tiny_replies_validate() {
    let dir = installed_asset("qwen3_6-tiny");
    let opts = LoadOptions {
        slots: CacheSlots::Resident,
        threads: 1,
        prefill_chunk: 128,
        max_context: 2048,
        ..Default::default()
    };
    let srv = common::start_install(dir, &opts, PromptCacheMode::SinglePrefix, "qwen-tiny");
    structured_replies(srv.local_addr(), "qwen-tiny");
    srv.shutdown();
}

/// The official `openai` Python client's structured-output helpers with a Pydantic model
/// (`structured_client.py` has the assertions), on both bundled models.
#[test]
fn openai_client_parse_helpers() {
    let run = |addr: SocketAddr, model: &str| {
        let out = std::process::Command::new(mference_testkit::python())
            .arg(mference_testkit::repo().join("crates/server/tests/structured_client.py"))
            .env("MFERENCE_BASE_URL", format!("http://{addr}"))
            .env("MFERENCE_MODEL", model)
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "structured_client.py on {model} failed:\n{stdout}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        eprintln!("{model}: {stdout}");
    };
    let srv = common::start(common::Opts::default());
    run(srv.local_addr(), common::MODEL_ID);
    srv.shutdown();
    let opts = LoadOptions {
        slots: CacheSlots::Resident,
        threads: 1,
        prefill_chunk: 128,
        max_context: 2048,
        ..Default::default()
    };
    let dir = installed_asset("qwen3_6-tiny");
    let srv = common::start_install(dir, &opts, PromptCacheMode::SinglePrefix, "qwen-tiny");
    run(srv.local_addr(), "qwen-tiny");
    srv.shutdown();
}
