//! The free-disk check before an install writes: the output still to write plus a reserve that
//! scales with the model (a fixed 1 GiB reserve refused an 80 MB install on a nearly full disk
//! that had room for it several times over).

use crate::InstallError;
use std::path::Path;

/// Smallest and largest automatic reserve, bytes.
pub const MIN_RESERVE: u64 = 16 << 20;
pub const MAX_RESERVE: u64 = 1 << 30;

/// The reserve kept free beyond the output for an install of `output_bytes`, and how it was
/// chosen: `explicit` if given, else 1/16 of the output within [`MIN_RESERVE`]..=[`MAX_RESERVE`]
/// (room for the journal, the manifest and whatever else writes to the disk meanwhile).
pub fn reserve(output_bytes: u64, explicit: Option<u64>) -> (u64, String) {
    match explicit {
        Some(r) => (r, "as given".into()),
        None => (
            (output_bytes / 16).clamp(MIN_RESERVE, MAX_RESERVE),
            "1/16 of the output, at least 16 MiB, at most 1 GiB".into(),
        ),
    }
}

/// Refuse unless the filesystem of `out`'s parent has `remaining` bytes plus the [`reserve`]
/// free. Errors: [`InstallError::DiskFull`] with every number of the sum.
pub fn check(
    out: &Path,
    remaining: u64,
    output_bytes: u64,
    explicit_reserve: Option<u64>,
) -> Result<(), InstallError> {
    let dir = out.parent().unwrap_or(Path::new("/"));
    let st =
        rustix::fs::statvfs(dir).map_err(|e| InstallError::io("cannot statvfs", dir, e.into()))?;
    let free = st.f_bavail.saturating_mul(st.f_frsize);
    let (reserve, reserve_rule) = reserve(output_bytes, explicit_reserve);
    let need = remaining.saturating_add(reserve);
    if free < need {
        return Err(InstallError::DiskFull {
            dir: dir.to_path_buf(),
            need,
            remaining,
            reserve,
            reserve_rule,
            free,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_reserve_scales_with_the_model() {
        // The demo model (about 80 MB installed) needs far less than the old fixed 1 GiB.
        let (r, _) = reserve(80 << 20, None);
        assert_eq!(r, MIN_RESERVE);
        assert!(r + (80 << 20) < 1 << 30);
        // A 14 GB model keeps a reserve near 1 GiB; beyond 16 GiB it stays at 1 GiB.
        assert_eq!(reserve(14 << 30, None).0, 14 << 26);
        assert_eq!(reserve(100 << 30, None).0, MAX_RESERVE);
        assert_eq!(reserve(80 << 20, Some(5)).0, 5);
    }
}
