//! A local mlx-community-style checkpoint directory.

use super::{Source, SourceId};
use crate::verify::Published;
use crate::InstallError;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

/// A checkpoint directory on a local filesystem.
pub struct LocalSource {
    dir: PathBuf,
    requests: AtomicU64,
}

impl LocalSource {
    /// Open `dir` (must exist). Errors: [`InstallError::SourceInvalid`].
    pub fn new(dir: &Path) -> Result<Self, InstallError> {
        let dir = std::fs::canonicalize(dir).map_err(|e| InstallError::SourceInvalid {
            detail: format!("{}: {e}", dir.display()),
        })?;
        if !dir.is_dir() {
            return Err(InstallError::SourceInvalid {
                detail: format!("{} is not a directory", dir.display()),
            });
        }
        Ok(LocalSource {
            dir,
            requests: AtomicU64::new(0),
        })
    }

    /// The file `rel` names, after pointer files. A symlink is followed (the Hugging Face cache
    /// links snapshot files into `blobs/`), but only to a regular file: a device or a pipe
    /// would give endless bytes or block forever.
    fn path(&self, rel: &str) -> Result<PathBuf, InstallError> {
        if rel.starts_with('/') || rel.split('/').any(|c| c == "..") {
            return Err(InstallError::SourceInvalid {
                detail: format!("file name \"{rel}\" escapes the checkpoint directory"),
            });
        }
        let p =
            resolve_pointer(&self.dir.join(rel)).map_err(|target| InstallError::SourceInvalid {
                detail: format!(
                    "{rel} is a pointer file to {target}, which is not there (from {} or the \
                     file it links to): a copy of a bundled model needs the files it points \
                     at; install from its own folder",
                    self.dir.display()
                ),
            })?;
        match std::fs::metadata(&p) {
            Ok(m) if !m.is_file() => Err(InstallError::SourceInvalid {
                detail: format!(
                    "{rel} is not a regular file (a directory, device or pipe): refusing to read it"
                ),
            }),
            _ => Ok(p),
        }
    }
}

/// Follow a "pointer file": a tiny file whose whole content is a relative path to a file
/// with the same name (how a checkout without symlink support stores a symlink; the
/// bundled tiny checkpoints point their tokenizer files at `assets/tokenizers/`), relative to
/// the file's folder or, where the file is a symlink, to the folder of the file it links to.
///
/// Errors: the pointer's target, when it names one that exists at neither place.
fn resolve_pointer(path: &Path) -> Result<PathBuf, String> {
    let small = std::fs::metadata(path)
        .map(|m| m.is_file() && m.len() < 1024)
        .unwrap_or(false);
    if !small {
        return Ok(path.to_path_buf());
    }
    let Ok(text) = std::fs::read_to_string(path) else {
        return Ok(path.to_path_buf());
    };
    let target = text.trim();
    let same_name = Path::new(target).file_name() == path.file_name();
    if same_name && !target.contains('\n') && !target.starts_with('/') {
        let real = std::fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf());
        let dirs = [path.parent(), real.parent()];
        return dirs
            .into_iter()
            .flatten()
            .map(|d| d.join(target))
            .find(|c| c.is_file())
            .ok_or_else(|| target.to_string());
    }
    Ok(path.to_path_buf())
}

impl Source for LocalSource {
    fn id(&self) -> SourceId {
        SourceId {
            repo_id: format!("local:{}", self.dir.display()),
            revision: "local".into(),
            resolved_commit: "local".into(),
            base_url: None,
        }
    }

    fn read_small(&self, rel: &str, cap: u64) -> Result<Option<Vec<u8>>, InstallError> {
        let p = self.path(rel)?;
        let meta = match std::fs::metadata(&p) {
            Ok(m) => m,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(InstallError::io("cannot read", p, e)),
        };
        if meta.len() > cap {
            return Err(InstallError::SourceInvalid {
                detail: format!("{rel} is {} bytes, above the {cap}-byte cap", meta.len()),
            });
        }
        std::fs::read(&p)
            .map(Some)
            .map_err(|e| InstallError::io("cannot read", p, e))
    }

    fn size_of(&self, rel: &str) -> Result<Option<u64>, InstallError> {
        let p = self.path(rel)?;
        match std::fs::metadata(&p) {
            Ok(m) if m.is_file() => Ok(Some(m.len())),
            Ok(_) => Ok(None),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(InstallError::io("cannot stat", p, e)),
        }
    }

    fn open_range(
        &self,
        rel: &str,
        start: u64,
        end: u64,
    ) -> Result<Box<dyn Read + Send + '_>, InstallError> {
        let p = self.path(rel)?;
        let mut f = std::fs::File::open(&p).map_err(|e| InstallError::io("cannot open", &p, e))?;
        let len = f
            .metadata()
            .map_err(|e| InstallError::io("cannot stat", &p, e))?
            .len();
        if end > len || start > end {
            return Err(InstallError::SourceInvalid {
                detail: format!("{rel}: range {start}..{end} is beyond the file size {len}"),
            });
        }
        f.seek(SeekFrom::Start(start))
            .map_err(|e| InstallError::io("cannot seek", &p, e))?;
        self.requests.fetch_add(1, Ordering::Relaxed);
        Ok(Box::new(f.take(end - start)))
    }

    fn range_requests(&self) -> u64 {
        self.requests.load(Ordering::Relaxed)
    }

    /// A Hugging Face cache snapshot (`snapshots/<commit>/<file>` → `../../blobs/<digest>`)
    /// names each blob by the digest the Hub published for it: the SHA-256 of an LFS file, the
    /// git blob id of another. A plain directory publishes nothing.
    fn published_digest(&self, rel: &str) -> Result<Option<Published>, InstallError> {
        // The snapshot's own link names the blob; what the blob may link to further is not
        // the cache's business.
        let Ok(target) = std::fs::read_link(self.dir.join(rel)) else {
            return Ok(None);
        };
        let in_blobs = target
            .parent()
            .and_then(|p| p.file_name())
            .is_some_and(|n| n == "blobs");
        Ok(target
            .file_name()
            .and_then(|n| n.to_str())
            .filter(|_| in_blobs)
            .and_then(|n| Published::parse(n, "the HF cache blob name")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A pointer file is read through to its target next to it, or next to the file a symlink to
    /// it links to; one whose target is at neither place is an error naming the target (it used
    /// to be read as the file itself: "tokenizer.json does not parse").
    #[test]
    fn pointer_files_resolve_beside_the_file_or_its_link_target_or_say_so() {
        let d = tempfile::tempdir().unwrap();
        let (model, shared, copy) = (d.path().join("m"), d.path().join("t"), d.path().join("c"));
        for p in [&model, &shared, &copy] {
            std::fs::create_dir(p).unwrap();
        }
        std::fs::write(shared.join("tokenizer.json"), b"{\"real\": 1}").unwrap();
        std::fs::write(model.join("tokenizer.json"), b"../t/tokenizer.json\n").unwrap();
        let src = LocalSource::new(&model).unwrap();
        let got = src.read_small("tokenizer.json", 1 << 20).unwrap().unwrap();
        assert_eq!(got, b"{\"real\": 1}");
        // A symlink to the pointer, from a folder where ../t does not exist.
        let deeper = copy.join("x");
        std::fs::create_dir(&deeper).unwrap();
        std::os::unix::fs::symlink(model.join("tokenizer.json"), deeper.join("tokenizer.json"))
            .unwrap();
        let src = LocalSource::new(&deeper).unwrap();
        let got = src.read_small("tokenizer.json", 1 << 20).unwrap().unwrap();
        assert_eq!(got, b"{\"real\": 1}");
        // A copy of the pointer where its target is missing.
        std::fs::copy(model.join("tokenizer.json"), deeper.join("t2")).unwrap();
        std::fs::remove_file(deeper.join("tokenizer.json")).unwrap();
        std::fs::rename(deeper.join("t2"), deeper.join("tokenizer.json")).unwrap();
        let src = LocalSource::new(&deeper).unwrap();
        let e = src
            .read_small("tokenizer.json", 1 << 20)
            .unwrap_err()
            .to_string();
        assert!(e.contains("pointer file to ../t/tokenizer.json"), "{e}");
    }
}
