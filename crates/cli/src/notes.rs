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

/// `eprintln!` unless `--quiet` was given.
macro_rules! note {
    ($($arg:tt)*) => {
        if !$crate::notes::quiet() {
            eprintln!($($arg)*);
        }
    };
}
pub(crate) use note;
