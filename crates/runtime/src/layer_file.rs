//! A layer's packed expert file: opened (O_DIRECT when asked) with its size checked against
//! `experts × stride`, mapped read-only for a `resident` layer, and its mapping populated at load.

use std::fs::File;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

use crate::RuntimeError;

/// Opens a layer file (O_DIRECT when asked) and checks it holds `experts × stride` bytes.
pub(crate) fn open(
    path: &Path,
    experts: usize,
    stride: u64,
    direct_io: bool,
) -> Result<(File, String), RuntimeError> {
    let mut opts = std::fs::OpenOptions::new();
    opts.read(true);
    if direct_io {
        opts.custom_flags(libc::O_DIRECT);
    }
    let shown = path.display().to_string();
    let file = opts.open(path).map_err(|source| RuntimeError::OpenLayer {
        path: shown.clone(),
        source,
    })?;
    let actual = file
        .metadata()
        .map_err(|source| RuntimeError::OpenLayer {
            path: shown.clone(),
            source,
        })?
        .len();
    let expected = experts as u64 * stride;
    if actual != expected {
        return Err(RuntimeError::LayerSize {
            path: shown,
            actual,
            expected,
            experts,
            stride,
        });
    }
    Ok((file, shown))
}

/// `file` mapped read-only (`shown`: its path, for the error).
pub(crate) fn map(file: &File, shown: &str) -> Result<memmap2::Mmap, RuntimeError> {
    // SAFETY: installs are read-only by contract; nothing in this process writes or truncates the
    // layer file while it is mapped.
    unsafe { memmap2::Mmap::map(file) }.map_err(|source| RuntimeError::OpenLayer {
        path: shown.to_string(),
        source,
    })
}

/// [`crate::ExpertStreamer::populate`] of the mapping `map` of the file at `path`.
pub(crate) fn populate(map: &memmap2::Mmap, path: &Path) -> Result<bool, RuntimeError> {
    match map.advise(memmap2::Advice::PopulateRead) {
        Ok(()) => Ok(true),
        Err(e)
            if matches!(
                e.raw_os_error(),
                Some(libc::EFAULT | libc::EIO | libc::EHWPOISON)
            ) =>
        {
            Err(RuntimeError::OpenLayer {
                path: path.display().to_string(),
                source: e,
            })
        }
        Err(_) => {
            // A hint only: the pages still map on first use if this fails too.
            let _ = map.advise(memmap2::Advice::WillNeed);
            Ok(false)
        }
    }
}
