//! `run --chat` at a terminal, through a pseudo-terminal: a 30,000-character paste arrives whole
//! (a terminal in cooked mode cuts a line at ~4 KiB), and, being longer than the context, is
//! refused with its token count, which equals the reference render's (transformers' template,
//! `tools/ref/encode.py`), as the same text piped in is; a multi-line paste is one message;
//! Up recalls the previous entry; `/think on` switches thinking on.

use std::ffi::CStr;
use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::FromRawFd;
use std::os::unix::process::CommandExt;
use std::process::{Child, Command};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use mference_testkit::{demo_install, demo_source, py, repo, run_ok_with_stdin};

const BIN: &str = env!("CARGO_BIN_EXE_mference");
const PATIENCE: Duration = Duration::from_secs(120);

/// `mference ARGS` on the slave side of a new pseudo-terminal (its controlling terminal, 120
/// columns); everything it writes is collected from the master side.
struct Tty {
    master: File,
    child: Child,
    seen: Arc<Mutex<Vec<u8>>>,
}

impl Tty {
    fn spawn(args: &[&str]) -> Tty {
        // SAFETY: plain libc calls on a descriptor this function owns; the pointers are to live
        // locals of the right size.
        let (master, slave_path) = unsafe {
            let m = libc::posix_openpt(libc::O_RDWR | libc::O_NOCTTY);
            assert!(m >= 0, "posix_openpt: {}", std::io::Error::last_os_error());
            assert_eq!(libc::grantpt(m), 0);
            assert_eq!(libc::unlockpt(m), 0);
            let mut name = [0 as libc::c_char; 128];
            assert_eq!(libc::ptsname_r(m, name.as_mut_ptr(), name.len()), 0);
            let ws = libc::winsize {
                ws_row: 40,
                ws_col: 120,
                ws_xpixel: 0,
                ws_ypixel: 0,
            };
            assert_eq!(libc::ioctl(m, libc::TIOCSWINSZ, &ws), 0);
            let path = CStr::from_ptr(name.as_ptr()).to_str().unwrap().to_string();
            (File::from_raw_fd(m), path)
        };
        let slave = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&slave_path)
            .unwrap();
        let mut cmd = Command::new(BIN);
        cmd.args(args)
            .env("TERM", "xterm")
            .stdin(slave.try_clone().unwrap())
            .stdout(slave.try_clone().unwrap())
            .stderr(slave);
        // SAFETY: only async-signal-safe calls between fork and exec.
        unsafe {
            cmd.pre_exec(|| {
                if libc::setsid() < 0 || libc::ioctl(0, libc::TIOCSCTTY, 0) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let child = cmd.spawn().expect("spawning mference in a pty");
        drop(cmd); // closes this process's copies of the slave
        let seen = Arc::new(Mutex::new(Vec::new()));
        let mut reader = master.try_clone().unwrap();
        let sink = Arc::clone(&seen);
        std::thread::spawn(move || {
            let mut buf = [0u8; 8192];
            // EIO once the child has exited and the slave is closed.
            while let Ok(n) = reader.read(&mut buf) {
                if n == 0 {
                    break;
                }
                sink.lock().unwrap().extend_from_slice(&buf[..n]);
            }
        });
        Tty {
            master,
            child,
            seen,
        }
    }

    fn output(&self) -> String {
        String::from_utf8_lossy(&self.seen.lock().unwrap()).into_owned()
    }

    /// Waits until the output holds `want` `n` times.
    fn wait_for(&self, want: &str, n: usize) {
        let t0 = Instant::now();
        while self.output().matches(want).count() < n {
            assert!(
                t0.elapsed() < PATIENCE,
                "timed out waiting for {want:?} x{n}; output so far:\n{}",
                tail(&self.output())
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn send(&mut self, keys: &str) {
        self.master.write_all(keys.as_bytes()).unwrap();
        self.master.flush().unwrap();
    }

    /// Pastes `text` as a terminal does with bracketed paste on.
    fn paste(&mut self, text: &str) {
        self.send(&format!("\x1b[200~{text}\x1b[201~"));
    }
}

impl Drop for Tty {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// The last 2,000 characters of `s`.
fn tail(s: &str) -> &str {
    let mut at = s.len().saturating_sub(2000);
    while !s.is_char_boundary(at) {
        at += 1;
    }
    &s[at..]
}

/// The first `n` characters of the Austen text with its line breaks.
fn long_text(n: usize) -> String {
    let all =
        std::fs::read_to_string(repo().join("assets/austen_pride_and_prejudice.txt")).unwrap();
    all.chars().take(n).collect::<String>().trim().to_string()
}

/// The token count of `user`'s chat prompt by the reference render (transformers' template on
/// the demo checkpoint, thinking off, then HF `tokenizers`).
fn reference_tokens(user: &str) -> usize {
    let r = py(&[
        "tools/ref/encode.py",
        "--model",
        demo_source().to_str().unwrap(),
        "--chat-user",
        user,
        "--thinking",
        "false",
    ]);
    r["prompt"].as_array().unwrap().len()
}

/// The refusal of a message too long for the context, with its token count and, since 4096 is
/// also the demo model's max_position_embeddings, that a larger --max-context would not help.
fn refusal(tokens: usize) -> String {
    format!("[the message is {tokens} tokens with the chat framing, which does not fit --max-context 4096 even alone (4096 is the model's own limit, max_position_embeddings)")
}

#[test]
fn a_long_paste_arrives_whole_and_multi_line_input_is_one_message() {
    let text = long_text(30_000);
    assert!(text.chars().count() > 29_000 && text.contains('\n'));
    let tokens = reference_tokens(&text);
    assert!(tokens > 4096, "{tokens} tokens: the text must not fit");
    let model = demo_install().to_str().unwrap();
    let args = [
        "run",
        "--model",
        model,
        "--chat",
        "--temperature",
        "0",
        "--max-new",
        "4",
        "--max-context",
        "4096",
    ];

    // Piped (one line per message): the same refusal, with the count of that line.
    let flat = text.replace('\n', " ");
    let out = run_ok_with_stdin(BIN, &args, &format!("{flat}\n/quit\n"));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains(&refusal(reference_tokens(&flat))),
        "{}",
        tail(&err)
    );

    let mut tty = Tty::spawn(&args);
    tty.wait_for("> ", 1);
    tty.paste(&text);
    tty.send("\r");
    tty.wait_for(&refusal(tokens), 1);
    tty.wait_for("> ", 2);
    tty.paste("first line\nsecond line");
    tty.send("\r");
    tty.wait_for("[stop=", 1);
    tty.send("/history\r");
    tty.wait_for("user: first line\r\nsecond line", 1);
    // Up recalls `/history`.
    tty.send("\x1b[A\r");
    tty.wait_for("user: first line\r\nsecond line", 2);
    tty.send("/think on\r");
    tty.wait_for("[thinking on]", 1);
    tty.send("/quit\r");
    let t0 = Instant::now();
    let status = loop {
        if let Some(st) = tty.child.try_wait().unwrap() {
            break st;
        }
        assert!(t0.elapsed() < PATIENCE, "no exit after /quit");
        std::thread::sleep(Duration::from_millis(50));
    };
    let all = tty.output();
    assert!(status.success(), "{status:?}: {}", tail(&all));
    assert!(
        !all.contains("user: second line"),
        "the paste was split: {}",
        tail(&all)
    );
    assert_eq!(all.matches("[stop=").count(), 1, "{}", tail(&all));
}
