//! Progress: an indicatif bar (bytes, rate, ETA) on a terminal, otherwise one plain line
//! per stage on stderr. Quiet mode prints nothing.

use indicatif::{ProgressBar, ProgressStyle};
use std::io::IsTerminal;

/// How progress is shown.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ProgressMode {
    /// Bar if stderr is a terminal, plain lines otherwise.
    Auto,
    /// Plain stage lines.
    Plain,
    /// Nothing.
    Quiet,
}

/// Progress reporter for one install.
pub struct Progress {
    mode: ProgressMode,
    bar: Option<ProgressBar>,
}

impl Progress {
    pub fn new(mode: ProgressMode) -> Self {
        let mode = match mode {
            ProgressMode::Auto if std::io::stderr().is_terminal() => ProgressMode::Auto,
            ProgressMode::Auto => ProgressMode::Plain,
            m => m,
        };
        Progress { mode, bar: None }
    }

    /// A stage line (`planning`, `copying`, `verifying`, ...).
    pub fn stage(&self, msg: &str) {
        match (&self.bar, self.mode) {
            (Some(b), _) => b.println(msg),
            (None, ProgressMode::Quiet) => {}
            // A closed stderr (`install ... 2>&1 | head`) drops the line; the install goes on.
            (None, _) => {
                use std::io::Write as _;
                let _ = writeln!(std::io::stderr(), "{msg}");
            }
        }
    }

    /// Start the byte counter for the copy stage (`total` source bytes, `done` already done).
    pub fn start_bytes(&mut self, total: u64, done: u64) {
        if self.mode == ProgressMode::Auto {
            let b = ProgressBar::new(total);
            b.set_style(
                ProgressStyle::with_template(
                    "{bar:40} {bytes}/{total_bytes} {bytes_per_sec} ETA {eta}",
                )
                .expect("valid template"),
            );
            b.set_position(done);
            self.bar = Some(b);
        }
    }

    /// Add copied source bytes.
    pub fn inc(&self, n: u64) {
        if let Some(b) = &self.bar {
            b.inc(n);
        }
    }

    /// Stop the bar.
    pub fn finish(&mut self) {
        if let Some(b) = self.bar.take() {
            b.finish_and_clear();
        }
    }
}
