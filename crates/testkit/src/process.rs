//! The `mference` binary as a child process. Test crates pass the binary's path
//! (`env!("CARGO_BIN_EXE_mference")`, which only the binary's own crate sees).

use std::io::{BufRead, BufReader, Write};
use std::net::SocketAddr;
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::sync::{mpsc, Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Runs `cmd` to completion; a failure to start or a non-zero exit fails the test with the
/// command line and its stderr.
pub fn output_ok(cmd: &mut Command) -> Output {
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("cannot run {cmd:?}: {e}"));
    succeeded(out, cmd)
}

/// `out` if its process exited 0; otherwise fails the test with `what` and the stderr.
fn succeeded(out: Output, what: &dyn std::fmt::Debug) -> Output {
    assert!(
        out.status.success(),
        "{what:?} failed ({}): {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// Runs `bin ARGS` (the `mference` binary) to completion, which must succeed.
pub fn run_ok(bin: &str, args: &[&str]) -> Output {
    output_ok(Command::new(bin).args(args))
}

/// Runs `bin ARGS`, which must fail with `msg` in its stderr; returns the stderr.
pub fn run_refused(bin: &str, args: &[&str], msg: &str) -> String {
    let out = Command::new(bin)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("cannot run {bin}: {e}"));
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!out.status.success(), "{args:?} accepted: {err}");
    assert!(err.contains(msg), "{args:?}: expected {msg:?} in: {err}");
    err
}

/// Runs `bin ARGS` with `input` on its stdin (then closed), to completion, which must succeed
/// (an interactive session such as `run --chat`).
pub fn run_ok_with_stdin(bin: &str, args: &[&str], input: &str) -> Output {
    let mut cmd = Command::new(bin);
    cmd.args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = cmd
        .spawn()
        .unwrap_or_else(|e| panic!("cannot run {cmd:?}: {e}"));
    // Dropping stdin after the write is the end of the input.
    child
        .stdin
        .take()
        .unwrap()
        .write_all(input.as_bytes())
        .expect("writing the session's input");
    let out = child.wait_with_output().expect("waiting for the session");
    succeeded(out, &cmd)
}

/// What `mference serve` prints on stderr once the port is open.
const READY: &str = "MferenceServer ready on http://";

/// A running `mference serve --port 0 ARGS`: its address (from the ready line) and its stderr so
/// far. Dropping it kills the process if it is still running.
pub struct ServeProcess {
    child: Child,
    addr: SocketAddr,
    log: Arc<Mutex<String>>,
    /// The thread copying stderr into `log`; it ends at EOF, once the process has exited.
    reader: Option<JoinHandle<()>>,
}

impl ServeProcess {
    /// Starts `bin serve --port 0 ARGS` and waits (up to `timeout`) for the ready line. The
    /// process exiting first, or no ready line in time, fails the test with its stderr.
    pub fn start(bin: &str, args: &[&str], timeout: Duration) -> Self {
        let mut child = Command::new(bin)
            .args(["serve", "--port", "0"])
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawning mference serve");
        let log = Arc::new(Mutex::new(String::new()));
        let (ready_tx, ready_rx) = mpsc::channel::<SocketAddr>();
        let stderr = child.stderr.take().unwrap();
        let sink = Arc::clone(&log);
        // Keeps draining stderr for the process's whole life, so a full pipe never blocks it.
        let reader = std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines() {
                let Ok(line) = line else { break };
                if let Some(rest) = line.strip_prefix(READY) {
                    if let Some(addr) = rest.split_whitespace().next().and_then(|a| a.parse().ok())
                    {
                        let _ = ready_tx.send(addr);
                    }
                }
                let mut l = sink.lock().unwrap();
                l.push_str(&line);
                l.push('\n');
            }
        });
        let addr = match ready_rx.recv_timeout(timeout) {
            Ok(addr) => addr,
            Err(_) => {
                let _ = child.kill();
                let status = child.wait().ok();
                // The process is gone, so the reader reaches EOF with every line in the log.
                let _ = reader.join();
                panic!(
                    "mference serve {args:?}: no ready line within {timeout:?} (exit {status:?}):\n{}",
                    log.lock().unwrap()
                );
            }
        };
        ServeProcess {
            child,
            addr,
            log,
            reader: Some(reader),
        }
    }

    /// The bound address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Sends `signal` (a `kill -s` name: `TERM`, `INT`, …) to the process.
    pub fn signal(&self, signal: &str) {
        let st = Command::new("kill")
            .args(["-s", signal, &self.child.id().to_string()])
            .status()
            .expect("running kill");
        assert!(st.success(), "kill -s {signal} failed");
    }

    /// Waits up to `timeout` for the process to exit; `None` if it is still running. After an
    /// exit, [`ServeProcess::log`] holds all of its stderr.
    pub fn wait_exit(&mut self, timeout: Duration) -> Option<ExitStatus> {
        let t0 = Instant::now();
        loop {
            if let Some(st) = self.child.try_wait().expect("waiting for mference serve") {
                if let Some(r) = self.reader.take() {
                    let _ = r.join();
                }
                return Some(st);
            }
            if t0.elapsed() >= timeout {
                return None;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Everything the process wrote to stderr so far.
    pub fn log(&self) -> String {
        self.log.lock().unwrap().clone()
    }
}

impl Drop for ServeProcess {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}
