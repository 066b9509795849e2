//! Executing one coalesced range through bounded tiles, and re-hashing its destinations.

use crate::plan::{CoalescedRange, RangeCopy, TILE_BYTES};
use crate::InstallError;
use sha2::{Digest, Sha256};
use std::collections::HashMap;
use std::fs::File;
use std::io::Read;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};

/// Open destination files (index = `RangeCopy::dest`).
pub struct Dests {
    pub files: Vec<File>,
    pub paths: Vec<PathBuf>,
    /// Test failpoint (`MFERENCE_FAILPOINT_ENOSPC_AFTER=N`): the write that would pass `N`
    /// destination bytes in this run fails with ENOSPC, as a full disk would.
    pub enospc_after: Option<AtomicU64>,
}

/// Stream `range` from `reader` (which yields exactly `range.end - range.start` bytes) in
/// tiles of at most [`TILE_BYTES`], writing each copy's bytes to its destination (only when
/// `write`; otherwise the digest alone is computed), then `fdatasync` the touched files. `tile`
/// is the caller's reusable buffer. A copy with an
/// [`Expand`](crate::plan::Expand) collects its source bytes (at most one tile) and writes their
/// expansion once complete. Returns the destination digest: SHA-256 of the copies' destination
/// bytes in copy order. `on_bytes` is told how many source bytes were consumed after each tile.
pub fn run_range(
    range: &CoalescedRange,
    copies: &[RangeCopy],
    reader: &mut dyn Read,
    dests: &Dests,
    write: bool,
    tile: &mut [u8],
    on_bytes: &mut dyn FnMut(u64),
) -> Result<String, InstallError> {
    let copies = &copies[range.copies.clone()];
    let mut h = Sha256::new();
    let mut touched = vec![false; dests.files.len()];
    let mut pos = range.start;
    let mut first = 0usize;
    // Source bytes of expanding copies not yet complete, by index in `copies`.
    let mut pending: HashMap<usize, Vec<u8>> = HashMap::new();
    let mut out = Vec::new();
    while pos < range.end {
        let n = ((range.end - pos) as usize).min(tile.len()).min(TILE_BYTES);
        reader.read_exact(&mut tile[..n]).map_err(|e| {
            crate::source::read_error(
                &format!("source range {} ({}..{})", range.id, range.start, range.end),
                &format!("read failed at byte {pos}"),
                e,
            )
        })?;
        let tile_end = pos + n as u64;
        while first < copies.len() && copies[first].src + copies[first].len <= pos {
            first += 1;
        }
        for (i, c) in copies.iter().enumerate().skip(first) {
            if c.src >= tile_end {
                break;
            }
            let a = c.src.max(pos);
            let b = (c.src + c.len).min(tile_end);
            let mut bytes = &tile[(a - pos) as usize..(b - pos) as usize];
            let mut dst = c.dst + (a - c.src);
            if let Some(e) = c.expand {
                let buf = pending.entry(i).or_default();
                buf.extend_from_slice(bytes);
                if b < c.src + c.len {
                    continue;
                }
                out.clear();
                crate::maple::expand_into(e, &pending.remove(&i).unwrap_or_default(), &mut out);
                (bytes, dst) = (&out, c.dst);
            }
            h.update(bytes);
            if !write {
                continue;
            }
            if let Some(left) = &dests.enospc_after {
                let n = bytes.len() as u64;
                if left
                    .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |l| l.checked_sub(n))
                    .is_err()
                {
                    let e = std::io::Error::from_raw_os_error(crate::error::ENOSPC);
                    return Err(InstallError::io("cannot write", &dests.paths[c.dest], e));
                }
            }
            dests.files[c.dest]
                .write_all_at(bytes, dst)
                .map_err(|e| InstallError::io("cannot write", &dests.paths[c.dest], e))?;
            touched[c.dest] = true;
        }
        pos = tile_end;
        on_bytes(n as u64);
    }
    for (i, t) in touched.iter().enumerate() {
        if *t {
            dests.files[i]
                .sync_data()
                .map_err(|e| InstallError::io("cannot fsync", &dests.paths[i], e))?;
        }
    }
    Ok(mference_format::hash::hex(&h.finalize()))
}

/// Re-read the destination bytes of `range` (tiles of at most [`TILE_BYTES`]) and return
/// their digest, as [`run_range`] computes it.
pub fn digest_destinations(
    range: &CoalescedRange,
    copies: &[RangeCopy],
    dests: &Dests,
    tile: &mut [u8],
) -> Result<String, InstallError> {
    let mut h = Sha256::new();
    for c in &copies[range.copies.clone()] {
        let mut off = 0u64;
        while off < c.dst_len() {
            let n = ((c.dst_len() - off) as usize)
                .min(tile.len())
                .min(TILE_BYTES);
            dests.files[c.dest]
                .read_exact_at(&mut tile[..n], c.dst + off)
                .map_err(|e| InstallError::io("cannot read back", &dests.paths[c.dest], e))?;
            h.update(&tile[..n]);
            off += n as u64;
        }
    }
    Ok(mference_format::hash::hex(&h.finalize()))
}
