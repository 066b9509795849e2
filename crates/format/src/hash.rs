//! Streaming SHA-256 of files through a bounded buffer.

use crate::FormatError;
use sha2::{Digest, Sha256};
use std::io::Read;
use std::path::Path;

/// Read buffer used for hashing, in bytes (bounded so hashing never holds a whole file).
pub const HASH_TILE_BYTES: usize = 512 * 1024;

/// Lower-case hex encoding of `bytes`.
pub fn hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        s.push(DIGITS[(b >> 4) as usize] as char);
        s.push(DIGITS[(b & 15) as usize] as char);
    }
    s
}

/// SHA-256 (lower-case hex) of a byte slice.
pub fn sha256_hex(bytes: &[u8]) -> String {
    hex(&Sha256::digest(bytes))
}

/// Size in bytes and SHA-256 (lower-case hex) of the file at `path`, read in
/// [`HASH_TILE_BYTES`] tiles. Errors: the file cannot be opened or read.
pub fn sha256_file(path: &Path) -> Result<(u64, String), FormatError> {
    let mut f = std::fs::File::open(path).map_err(|e| FormatError::io(path, e))?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; HASH_TILE_BYTES];
    let mut total = 0u64;
    loop {
        let n = f.read(&mut buf).map_err(|e| FormatError::io(path, e))?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
        total += n as u64;
    }
    Ok((total, hex(&h.finalize())))
}

/// Read a whole small file, refusing files larger than `cap` bytes (metadata caps:
/// manifest 4 MiB, layout 64 MiB, receipt 4 MiB).
pub fn read_capped(path: &Path, rel: &str, cap: u64) -> Result<Vec<u8>, FormatError> {
    let meta = std::fs::metadata(path).map_err(|e| {
        if e.kind() == std::io::ErrorKind::NotFound {
            FormatError::MissingFile {
                path: path.to_path_buf(),
            }
        } else {
            FormatError::io(path, e)
        }
    })?;
    if meta.len() > cap {
        return Err(FormatError::TooLarge {
            rel: rel.to_string(),
            size: meta.len(),
            cap,
        });
    }
    std::fs::read(path).map_err(|e| FormatError::io(path, e))
}
