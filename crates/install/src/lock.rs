//! The advisory install lock `<out>.install.lock` (`flock(LOCK_EX|LOCK_NB)`). The lock file
//! itself survives a successful install.

use crate::InstallError;
use rustix::fs::{flock, FlockOperation};
use std::path::{Path, PathBuf};

/// A held lock; released on drop (when the file is closed).
pub struct InstallLock {
    _file: std::fs::File,
    pub path: PathBuf,
}

impl InstallLock {
    /// Take the lock without waiting. Errors: [`InstallError::Busy`] if another process
    /// holds it.
    pub fn acquire(path: &Path) -> Result<InstallLock, InstallError> {
        let file = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(path)
            .map_err(|e| InstallError::io("cannot open lock", path, e))?;
        match flock(&file, FlockOperation::NonBlockingLockExclusive) {
            Ok(()) => Ok(InstallLock {
                _file: file,
                path: path.to_path_buf(),
            }),
            Err(e) if e == rustix::io::Errno::WOULDBLOCK => Err(InstallError::Busy {
                lock: path.to_path_buf(),
            }),
            Err(e) => Err(InstallError::io("cannot lock", path, e.into())),
        }
    }
}
