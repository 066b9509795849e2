//! Checking source bytes against the digest the source publishes for each file, as
//! huggingface_hub does (`file_download.py`, and its PR #3644 that made the check the default): a
//! Git LFS file's SHA-256 is the resolve response's `X-Linked-Etag`; a small file kept in git
//! itself has the git blob id as its `ETag`, `sha1("blob <len>\0" + bytes)`; a local Hugging Face
//! cache snapshot links each file to `blobs/<that same digest>`. Every byte of a source file goes
//! through a [`FileHasher`] in order, whether it is copied or not.

use crate::InstallError;
use mference_format::hash::hex;
use mference_format::receipt::SourceFile;
use sha1::Sha1;
use sha2::{Digest, Sha256};

/// The kind of a published digest.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Algo {
    /// SHA-256 of the file's bytes (a Git LFS object id).
    Sha256,
    /// The git blob id: SHA-1 of `"blob <len>\0"` followed by the bytes.
    GitBlobSha1,
}

/// A digest a source publishes for one file, and where it was read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Published {
    pub algo: Algo,
    /// Lower-case hex.
    pub hex: String,
    /// The header or name it came from (`X-Linked-Etag`, `ETag`, `the HF cache blob name`).
    pub from: &'static str,
}

impl Published {
    /// Parse an entity tag or blob name: quotes and a weak `W/` prefix dropped, 64 hex digits are
    /// a SHA-256, 40 a git blob id; anything else (a CDN's MD5, an opaque tag) is no digest.
    pub fn parse(value: &str, from: &'static str) -> Option<Published> {
        let v = value.trim();
        let v = v.strip_prefix("W/").unwrap_or(v).trim_matches('"');
        if !v.bytes().all(|b| b.is_ascii_hexdigit()) {
            return None;
        }
        let algo = match v.len() {
            64 => Algo::Sha256,
            40 => Algo::GitBlobSha1,
            _ => return None,
        };
        Some(Published {
            algo,
            hex: v.to_ascii_lowercase(),
            from,
        })
    }

    /// `sha256:<hex> from X-Linked-Etag` (the receipt's `verifiedAgainst`).
    pub fn describe(&self) -> String {
        let kind = match self.algo {
            Algo::Sha256 => "sha256",
            Algo::GitBlobSha1 => "git-blob-sha1",
        };
        format!("{kind}:{} from {}", self.hex, self.from)
    }
}

/// What one source file was checked against ([`SourceFile`] in the receipt).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SourceCheck {
    pub file: String,
    pub size: u64,
    /// SHA-256 (hex) of every byte read.
    pub sha256: String,
    /// The published digest the bytes matched; `None` when the source published none.
    pub against: Option<Published>,
}

impl SourceCheck {
    /// The receipt's record of this file.
    pub fn record(&self) -> SourceFile {
        SourceFile {
            size: self.size,
            sha256: self.sha256.clone(),
            verified_against: self.against.as_ref().map(Published::describe),
        }
    }
}

/// Hashes one source file as it streams by: always SHA-256 (for the receipt), and the git blob
/// id when that is what the source published.
pub struct FileHasher {
    file: String,
    size: u64,
    seen: u64,
    sha256: Sha256,
    sha1: Option<Sha1>,
    expected: Option<Published>,
}

impl FileHasher {
    /// A hasher for `file` of `size` bytes, to be checked against `expected`.
    pub fn new(file: &str, size: u64, expected: Option<Published>) -> FileHasher {
        let sha1 = expected
            .as_ref()
            .filter(|p| p.algo == Algo::GitBlobSha1)
            .map(|_| {
                let mut h = Sha1::new();
                h.update(format!("blob {size}\0").as_bytes());
                h
            });
        FileHasher {
            file: file.to_string(),
            size,
            seen: 0,
            sha256: Sha256::new(),
            sha1,
            expected,
        }
    }

    /// Bytes hashed so far (the next byte's offset in the file).
    pub fn position(&self) -> u64 {
        self.seen
    }

    /// Add the next bytes of the file.
    pub fn update(&mut self, bytes: &[u8]) {
        self.seen += bytes.len() as u64;
        self.sha256.update(bytes);
        if let Some(h) = &mut self.sha1 {
            h.update(bytes);
        }
    }

    /// Compare with the published digest. Errors: [`InstallError::SourceDigestMismatch`] naming the
    /// file and both digests; [`InstallError::SourceInvalid`] if not exactly `size` bytes went by.
    pub fn finish(self) -> Result<SourceCheck, InstallError> {
        if self.seen != self.size {
            return Err(InstallError::SourceInvalid {
                detail: format!(
                    "{}: {} bytes were read, the file has {}",
                    self.file, self.seen, self.size
                ),
            });
        }
        let sha256 = hex(&self.sha256.finalize());
        if let Some(p) = &self.expected {
            let actual = match (p.algo, self.sha1) {
                (Algo::GitBlobSha1, Some(h)) => hex(&h.finalize()),
                _ => sha256.clone(),
            };
            if actual != p.hex {
                return Err(InstallError::SourceDigestMismatch {
                    file: self.file,
                    expected: p.describe(),
                    actual,
                });
            }
        }
        Ok(SourceCheck {
            file: self.file,
            size: self.size,
            sha256,
            against: self.expected,
        })
    }
}

/// Check a whole file already in memory (config, index, tokenizer files).
pub fn check_bytes(
    file: &str,
    bytes: &[u8],
    expected: Option<Published>,
) -> Result<SourceCheck, InstallError> {
    let mut h = FileHasher::new(file, bytes.len() as u64, expected);
    h.update(bytes);
    h.finish()
}

/// A source whose files should each carry a digest (HTTP) but where `file` has none: refused
/// unless `allow_unverified`.
pub fn require(
    file: &str,
    published: Option<Published>,
    expected_here: bool,
    allow_unverified: bool,
) -> Result<Option<Published>, InstallError> {
    if published.is_none() && expected_here && !allow_unverified {
        return Err(InstallError::SourceDigestMissing { file: file.into() });
    }
    Ok(published)
}

/// A reader that feeds every byte it yields to a [`FileHasher`].
pub struct HashingReader<'a, R: ?Sized> {
    pub inner: &'a mut R,
    pub hasher: &'a mut FileHasher,
}

impl<R: std::io::Read + ?Sized> std::io::Read for HashingReader<'_, R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.hasher.update(&buf[..n]);
        Ok(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn etags_parse_as_hub_digests() {
        let lfs = "\"8143ae115ed6babe5e5ada8fb8c5b769d8f417802b2db042ad98b4f7ed73975b\"";
        let p = Published::parse(lfs, "X-Linked-Etag").unwrap();
        assert_eq!(p.algo, Algo::Sha256);
        let p = Published::parse("W/\"74a4482afd52515c89ae8d7d388a537a16f5d350\"", "ETag").unwrap();
        assert_eq!(p.algo, Algo::GitBlobSha1);
        // An S3-style MD5 tag or an opaque tag is not a digest.
        assert!(Published::parse("\"98398ed3a69b873756404fa68edbd39a\"", "ETag").is_none());
        assert!(Published::parse("\"abc-123\"", "ETag").is_none());
    }

    #[test]
    fn git_blob_ids_match_git_hash_object() {
        // `printf 'hello\n' | git hash-object --stdin`
        let p = Published::parse("ce013625030ba8dba906f756967f9e9ca394464a", "ETag").unwrap();
        check_bytes("a.txt", b"hello\n", Some(p.clone())).unwrap();
        let err = check_bytes("a.txt", b"hellO\n", Some(p)).unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains("a.txt") && msg.contains("ce013625"), "{msg}");
    }

    #[test]
    fn sha256_digests_are_checked() {
        // SHA-256 of the empty string (FIPS 180-4 test value).
        let e = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855";
        let p = Published::parse(e, "X-Linked-Etag").unwrap();
        assert_eq!(check_bytes("f", b"", Some(p.clone())).unwrap().sha256, e);
        assert!(check_bytes("f", b"x", Some(p)).is_err());
    }
}
