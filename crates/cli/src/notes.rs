//! Notes on stderr that a command's `--quiet` silences: the load's sizing notes are printed by
//! code every command shares ([`crate::load_options`]), which does not see the command's flags.

use std::sync::atomic::{AtomicBool, Ordering};

static QUIET: AtomicBool = AtomicBool::new(false);

/// Silences [`note!`] for the rest of the process (`run --quiet`).
pub(crate) fn set_quiet(quiet: bool) {
    QUIET.store(quiet, Ordering::Relaxed);
}

/// Whether [`note!`] is silenced.
pub(crate) fn quiet() -> bool {
    QUIET.load(Ordering::Relaxed)
}

/// `eprintln!` that never panics: a line stderr cannot take (a closed pipe, as in `install ... 2>&1
/// | head`) is dropped and the command goes on (the server's own log macro).
pub(crate) use mference_server::log_line as say;

/// `println!` that never panics: a reader that has gone (`| head`) drops the line.
macro_rules! out {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stdout(), $($arg)*);
    }};
}
pub(crate) use out;

/// [`say!`] unless `--quiet` was given.
macro_rules! note {
    ($($arg:tt)*) => {
        if !$crate::notes::quiet() {
            $crate::notes::say!($($arg)*);
        }
    };
}
pub(crate) use note;
