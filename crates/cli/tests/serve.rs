//! `serve` through the binary on the demo install: graceful shutdown on SIGTERM / SIGINT with
//! streams ended in band, a closed stderr pipe, and what the start checks before its ready line.

use std::process::Command;
use std::time::Duration;

use mference_testkit::http::{open_stream, post};
use mference_testkit::{demo_install, run_refused, ServeProcess};
use serde_json::json;

const BIN: &str = env!("CARGO_BIN_EXE_mference");

/// `mference ARGS` must fail with `msg` in its stderr.
fn refused(args: &[&str], msg: &str) {
    run_refused(BIN, args, msg);
}

/// `mference serve` on the demo model gets SIGTERM (then, in a second run, SIGINT) while a stream
/// is generating and a JSON request waits behind it: the stream ends with the in-band
/// `server_shutting_down` error and `data: [DONE]` (not a cut connection), the JSON request gets a
/// 503 OpenAI error object, and the process exits 0 with its port closed.
#[test]
fn serve_shuts_down_gracefully_on_sigterm_and_sigint() {
    let model = demo_install().to_str().unwrap();
    for signal in ["TERM", "INT"] {
        let mut srv = ServeProcess::start(
            BIN,
            &[
                "--model",
                model,
                "--model-id",
                "demo",
                "--max-context",
                "4096",
                "--prefill-chunk",
                "auto",
            ],
            Duration::from_secs(120),
        );
        let a = srv.addr();
        // Greedy on this prompt runs past 3,000 tokens without a stop token (thousands of tokens
        // after the first chunk, when the signal goes out).
        let long = |stream: bool| json!({"model": "demo", "prompt": "It is a truth universally acknowledged, that", "max_tokens": 4000, "temperature": 0, "stream": stream});
        let mut stream = open_stream(a, "/v1/completions", &long(true));
        assert_eq!(stream.status, 200, "{}", srv.log());
        stream.next_data().expect("a first chunk");
        let waiting = std::thread::spawn(move || post(a, "/v1/completions", &long(false)));
        // The JSON request has no head to wait for; give it time to reach the queue.
        std::thread::sleep(Duration::from_secs(1));

        srv.signal(signal);

        let st = stream.finish();
        let err = st.final_error();
        assert_eq!(
            err["code"], "server_shutting_down",
            "SIG{signal}: {}",
            st.raw
        );
        assert!(
            err["message"]
                .as_str()
                .is_some_and(|m| m.contains("shutting down")),
            "{err}"
        );
        assert_eq!(
            st.finish_reasons(),
            [] as [serde_json::Value; 0],
            "SIG{signal}: the stream finished before the signal: {}",
            st.raw
        );
        let (status, body) = waiting.join().unwrap();
        assert_eq!(status, 503, "SIG{signal}: {body}");
        assert_eq!(body["error"]["code"], "server_shutting_down", "{body}");
        assert_eq!(body["error"]["type"], "server_error", "{body}");

        let exit = srv.wait_exit(Duration::from_secs(60));
        let log = srv.log();
        assert!(
            exit.is_some_and(|e| e.success()),
            "SIG{signal}: exit {exit:?}:\n{log}"
        );
        assert!(
            log.contains(&format!("received SIG{signal}"))
                && log.contains("MferenceServer stopped"),
            "{log}"
        );
        assert!(
            std::net::TcpStream::connect(a).is_err(),
            "SIG{signal}: port still open"
        );
    }
}

/// `serve 2>&1 | head -3`: once nothing reads its stderr, the server still answers generation
/// requests (each logs a line it can no longer write) and still stops on SIGTERM; it used to drop
/// every request's connection (a panic printing the log line) while `/health` said ok, and to
/// ignore the signal. Likewise `run ... | head -c N` ends quietly.
#[test]
fn serve_and_run_survive_a_closed_output_pipe() {
    use std::io::{BufRead, BufReader};
    let model = demo_install().to_str().unwrap();
    let mut child = Command::new(BIN)
        .args([
            "serve",
            "--model",
            model,
            "--model-id",
            "demo",
            "--port",
            "0",
        ])
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
    let addr: std::net::SocketAddr = loop {
        let line = lines
            .next()
            .expect("serve ended before its ready line")
            .unwrap();
        if let Some(rest) = line.strip_prefix("MferenceServer ready on http://") {
            break rest.split_whitespace().next().unwrap().parse().unwrap();
        }
    };
    drop(lines); // the reader goes away, as `head` does
    let body =
        json!({"model": "demo", "prompt": "It is a truth", "max_tokens": 3, "temperature": 0});
    for _ in 0..2 {
        let (status, v) = post(addr, "/v1/completions", &body);
        assert_eq!(status, 200, "{v}");
        assert!(v["choices"][0]["text"].is_string(), "{v}");
    }
    let (status, _) = post(
        addr,
        "/v1/completions",
        &json!({"model": "nope", "prompt": "x"}),
    );
    assert_eq!(status, 404);
    Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let exit = loop {
        if let Some(e) = child.try_wait().unwrap() {
            break Some(e);
        }
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            break None;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    assert!(
        exit.is_some(),
        "serve ignored SIGTERM once its stderr was closed"
    );

    // `run` whose reader stops after a few bytes: no panic, no exit 101.
    let out = Command::new("sh")
        .arg("-c")
        .arg(format!(
            "'{BIN}' run --model '{model}' --prompt 'The king said' --max-new 30 --temperature 0.9 \
             --seed 99 --quiet | head -c 10 >/dev/null"
        ))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!err.contains("panicked"), "{err}");
}

/// `serve` checks what a load can check before it says it is ready: a port in use fails before
/// the model loads, and a damaged expert file fails the start (it used to print the ready line,
/// answer `/health` ok and then fail every request).
#[test]
fn serve_refuses_a_busy_port_and_a_damaged_layer_file_before_its_ready_line() {
    let busy = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = busy.local_addr().unwrap().port().to_string();
    let model = demo_install().to_str().unwrap();
    let t0 = std::time::Instant::now();
    refused(
        &["serve", "--model", model, "--port", &port],
        "cannot listen on",
    );
    assert!(
        t0.elapsed() < Duration::from_secs(20),
        "the busy port was found only after {:?}",
        t0.elapsed()
    );
    drop(busy);

    let work = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let copy = work.path().join("damaged.gturbo");
    let ok = Command::new("cp")
        .args(["-r", model, copy.to_str().unwrap()])
        .status()
        .unwrap();
    assert!(ok.success());
    let layer = copy.join("packed_experts/layer_03.bin");
    let mut bytes = std::fs::read(&layer).unwrap();
    let at = bytes.len() / 2;
    bytes[at] ^= 0x10;
    std::fs::write(&layer, bytes).unwrap();
    let out = Command::new(BIN)
        .args(["serve", "--model", copy.to_str().unwrap(), "--port", "0"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(!err.contains("ready on"), "{err}");
    assert!(
        err.contains("layer_03.bin") && err.contains("SHA-256"),
        "{err}"
    );
}
