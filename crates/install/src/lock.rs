//! The advisory install lock `<out>.install.lock` (`flock(LOCK_EX|LOCK_NB)`). The holder
//! removes the file when it releases the lock, so a finished, failed or discarded install leaves
//! no lock file behind. One left by a killed process is harmless: `flock` locks die with their
//! process.

use crate::run::OutPaths;
use crate::InstallError;
use rustix::fs::{flock, FlockOperation};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

/// A held lock; released on drop (when the file is closed).
pub struct InstallLock {
    file: std::fs::File,
    pub path: PathBuf,
}

impl InstallLock {
    /// Take the lock of `paths.out` without waiting. Errors: [`InstallError::Busy`] if
    /// another process holds it.
    pub fn acquire(paths: &OutPaths) -> Result<InstallLock, InstallError> {
        let path = &paths.lock;
        // A holder removes the file before closing it, so a file opened just before that is
        // no longer the lock: lock again through the path until the two agree.
        for _ in 0..100 {
            let file = open(path)?;
            match flock(&file, FlockOperation::NonBlockingLockExclusive) {
                Ok(()) => {}
                Err(e) if e == rustix::io::Errno::WOULDBLOCK => {
                    return Err(InstallError::Busy { lock: path.clone() })
                }
                Err(e) => return Err(InstallError::io("cannot lock", path, e.into())),
            }
            let held = file
                .metadata()
                .map_err(|e| InstallError::io("cannot stat", path, e))?;
            if std::fs::metadata(path).is_ok_and(|m| m.dev() == held.dev() && m.ino() == held.ino())
            {
                return Ok(InstallLock {
                    file,
                    path: path.clone(),
                });
            }
        }
        Err(InstallError::Busy { lock: path.clone() })
    }
}

/// Whether another process holds the lock of `paths.out` now (an install running), probed
/// without creating the lock file or taking the lock from anyone.
pub fn held_elsewhere(paths: &OutPaths) -> bool {
    let Ok(file) = std::fs::File::open(&paths.lock) else {
        return false;
    };
    match flock(&file, FlockOperation::NonBlockingLockShared) {
        Err(e) => e == rustix::io::Errno::WOULDBLOCK,
        Ok(()) => {
            let _ = flock(&file, FlockOperation::Unlock);
            false
        }
    }
}

/// Open (creating) the lock file; a lock file this user cannot write (left by another user)
/// still locks when opened read-only.
fn open(path: &Path) -> Result<std::fs::File, InstallError> {
    let rw = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(path);
    match rw {
        Err(e) if e.kind() == std::io::ErrorKind::PermissionDenied && path.exists() => {
            std::fs::File::open(path)
        }
        other => other,
    }
    .map_err(|e| InstallError::io("cannot create", path, e))
}

impl Drop for InstallLock {
    fn drop(&mut self) {
        // Removed while still held: whoever opened it meanwhile sees the path change and
        // retries. A failure to remove leaves a harmless file.
        let _ = std::fs::remove_file(&self.path);
        let _ = flock(&self.file, FlockOperation::Unlock);
    }
}
