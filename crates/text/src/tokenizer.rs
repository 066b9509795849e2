use std::path::{Path, PathBuf};

use serde_json::Value;

use crate::{tokenizer_cache, TextError};

/// The tokenizer of an install: HF `tokenizer.json` (BPE, byte fallback / byte level), loaded with the
/// pure-Rust `tokenizers` crate, plus the special tokens named in `tokenizer_config.json`.
///
/// Ids are `u32` token ids; text is UTF-8. Wrapped in our own type so the `tokenizers` 1.0 API change
/// stays inside this crate.
pub struct Tokenizer {
    pub(crate) inner: tokenizers::Tokenizer,
    bos_token: Option<String>,
    eos_token: Option<String>,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("vocab_size", &self.vocab_size())
            .field("bos_token", &self.bos_token)
            .field("eos_token", &self.eos_token)
            .finish()
    }
}

impl Tokenizer {
    /// Loads `dir/tokenizer.json` and, when present, `dir/tokenizer_config.json` (for `bos_token` and
    /// `eos_token`).
    ///
    /// Errors: [`TextError::NoTokenizer`] when `tokenizer.json` does not exist, [`TextError::Io`]
    /// when it cannot be read, [`TextError::TokenizerLoad`] when it is not a valid HF tokenizer,
    /// [`TextError::Json`] when `tokenizer_config.json` is not valid JSON.
    pub fn from_dir(dir: &Path) -> Result<Self, TextError> {
        let (path, bytes) = read_tokenizer_json(dir, true)?;
        Self::with_config(dir, parse_json(&path, &bytes)?)
    }

    /// [`Tokenizer::from_dir`] through the compact form at `cache` (an install keeps it in
    /// `cache/tokenizer.bin`): used when it was made from this `tokenizer.json` (SHA-256) and is
    /// intact; otherwise `tokenizer.json` is parsed and the cache written (through a temporary
    /// file and a rename, so a reader never sees half of one). The tokenizer is the same either
    /// way; the [`TokenizerCache`] says which way it came.
    ///
    /// `json_sha256`: the SHA-256 (hex) of `tokenizer.json` when the caller checks the file
    /// against it itself (an install's manifest digest, under a check that runs beside this
    /// and stops the caller if it fails); `None`: the file is hashed here.
    ///
    /// Errors: those of [`Tokenizer::from_dir`]; a cache that cannot be read or written is not
    /// an error (the tokenizer is parsed from `tokenizer.json`, and the outcome says why).
    pub fn from_dir_cached(
        dir: &Path,
        cache: &Path,
        json_sha256: Option<&str>,
    ) -> Result<(Self, TokenizerCache), TextError> {
        // tokenizer.json is hashed (unless its digest is given: then only its presence is
        // checked now, and its bytes are read if the cache is not used) while the cache is read
        // and built; the cache is used only if the digests then agree.
        let (json, cached) = std::thread::scope(|s| {
            let json = s.spawn(|| match json_sha256 {
                Some(d) => read_tokenizer_json(dir, false)
                    .map(|(path, _)| (path, d.to_ascii_lowercase(), None)),
                None => read_tokenizer_json(dir, true).map(|(path, bytes)| {
                    let sha = mference_format::hash::sha256_hex(&bytes);
                    (path, sha, Some(bytes))
                }),
            });
            let cached = match std::fs::read(cache) {
                Ok(c) => Some(tokenizer_cache::decode(&c)),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
                Err(e) => Some(Err(tokenizer_cache::Stale::Invalid(e.to_string()))),
            };
            (
                json.join().expect("hashing tokenizer.json panicked"),
                cached,
            )
        });
        let (path, sha, bytes) = json?;
        let stale = match cached {
            Some(Ok((bound, inner))) if bound == sha => {
                return Ok((Self::with_config(dir, inner)?, TokenizerCache::Used));
            }
            Some(Ok(_)) => Some(tokenizer_cache::Stale::OtherSource),
            Some(Err(why)) => Some(why),
            None => None,
        };
        let bytes = match bytes {
            Some(b) => b,
            None => read_tokenizer_json(dir, true)?.1,
        };
        // The cache's form is made while the `tokenizers` crate parses the same bytes; it is
        // written only if that parse succeeds.
        let (inner, encoded) = std::thread::scope(|s| {
            let encoded = s.spawn(|| tokenizer_cache::encode(&bytes, &sha));
            let inner = parse_json(&path, &bytes);
            (
                inner,
                encoded
                    .join()
                    .expect("encoding the tokenizer cache panicked"),
            )
        });
        let inner = inner?;
        let outcome = match encoded {
            Err(why) => TokenizerCache::NotCacheable(why),
            Ok(c) => match write_atomically(cache, &c) {
                Ok(()) => TokenizerCache::Written {
                    replaced: stale.map(|s| s.to_string()),
                },
                Err(e) => TokenizerCache::NotWritten(format!("{}: {e}", cache.display())),
            },
        };
        Ok((Self::with_config(dir, inner)?, outcome))
    }

    /// The tokenizer `inner` with the special tokens of `dir/tokenizer_config.json`.
    fn with_config(dir: &Path, inner: tokenizers::Tokenizer) -> Result<Self, TextError> {
        let config = read_tokenizer_config(dir)?;
        let bos_token = config.as_ref().and_then(|c| special_token(c, "bos_token"));
        let eos_token = config.as_ref().and_then(|c| special_token(c, "eos_token"));
        Ok(Tokenizer {
            inner,
            bos_token,
            eos_token,
        })
    }

    /// Encodes `text` to token ids. `add_special_tokens` applies the tokenizer's post-processor
    /// (Gemma 4 prepends `<bos>`; Qwen and DeepSeek add nothing). Special-token strings inside `text`
    /// become their single ids, as in HF. A rendered chat template already contains BOS: encode it
    /// with `false`.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, TextError> {
        let enc = self
            .inner
            .encode(text, add_special_tokens)
            .map_err(|e| TextError::Tokenize(e.to_string()))?;
        Ok(enc.get_ids().to_vec())
    }

    /// Decodes token ids to text. With `skip_special`, tokens marked `special` in `tokenizer.json`
    /// (Gemma `<turn|>`, ChatML `<|im_end|>`, ...) are dropped; non-special added tokens such as
    /// Gemma's `<|tool_call>` are always kept. Byte-fallback sequences that are not valid UTF-8
    /// decode to U+FFFD.
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String, TextError> {
        self.inner
            .decode(ids, skip_special)
            .map_err(|e| TextError::Tokenize(e.to_string()))
    }

    /// The id of a vocabulary or added token given as its exact string (`"<turn|>"`), if any.
    pub fn token_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// The token string of an id, if the id is in the vocabulary.
    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// The id of `tokenizer_config.json`'s `bos_token` (Gemma `<bos>` 2, DeepSeek 0); `None` for
    /// families without one (Qwen).
    pub fn bos_id(&self) -> Option<u32> {
        self.bos_token.as_deref().and_then(|t| self.token_id(t))
    }

    /// The id of `tokenizer_config.json`'s `eos_token`, if any. Use [`crate::stop_token_ids`] for the
    /// full set of ids that end generation.
    pub fn eos_id(&self) -> Option<u32> {
        self.eos_token.as_deref().and_then(|t| self.token_id(t))
    }

    /// Number of ids, added tokens included (Gemma 4: 262,144). The model's embedding may have more
    /// rows (Qwen 3.6: 248,320) than the tokenizer has ids.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }
}

/// What [`Tokenizer::from_dir_cached`] did with the cache of `tokenizer.json`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TokenizerCache {
    /// The cache was made from this `tokenizer.json`, was intact, and was used.
    Used,
    /// `tokenizer.json` was parsed and the cache written; `replaced` says why an existing cache
    /// was not used (made from another `tokenizer.json`, damaged, another format).
    Written {
        /// Why the cache that was there was not used; `None` when there was none.
        replaced: Option<String>,
    },
    /// `tokenizer.json` has no compact form (not a BPE model in the current layout): it is
    /// parsed on every load. The reason.
    NotCacheable(String),
    /// `tokenizer.json` was parsed, and writing the cache failed (a read-only install): the
    /// next load parses it again. The path and the I/O error.
    NotWritten(String),
}

/// `dir/tokenizer.json` and its bytes (`read`), or only whether it is there (`!read`: no
/// bytes), with the error that says why it cannot be had.
fn read_tokenizer_json(dir: &Path, read: bool) -> Result<(PathBuf, Vec<u8>), TextError> {
    let path = dir.join("tokenizer.json");
    let got = match read {
        true => std::fs::read(&path),
        false => std::fs::metadata(&path).map(|_| Vec::new()),
    };
    match got {
        Ok(bytes) => Ok((path, bytes)),
        Err(source) if source.kind() != std::io::ErrorKind::NotFound => {
            Err(TextError::Io { path, source })
        }
        Err(_) if listed_in_manifest(dir) => Err(TextError::TokenizerMissing { path }),
        Err(_) => {
            let missing: Vec<&str> = ["tokenizer.json", "tokenizer_config.json"]
                .into_iter()
                .filter(|f| !dir.join(f).exists())
                .collect();
            Err(TextError::NoTokenizer {
                dir: dir.to_path_buf(),
                missing: missing.join(", "),
            })
        }
    }
}

/// Whether the manifest of the install holding the tokenizer folder `dir` lists
/// `tokenizer/tokenizer.json` (an install made with a tokenizer), so that its absence is damage
/// rather than a checkpoint that had none.
fn listed_in_manifest(dir: &Path) -> bool {
    let Some(install) = dir.parent() else {
        return false;
    };
    std::fs::read(install.join("manifest.json"))
        .ok()
        .and_then(|b| serde_json::from_slice::<serde_json::Value>(&b).ok())
        .is_some_and(|m| m["files"].get("tokenizer/tokenizer.json").is_some())
}

/// The `tokenizers` crate's own reading of `tokenizer.json` (the reference the cache is held to).
fn parse_json(path: &Path, bytes: &[u8]) -> Result<tokenizers::Tokenizer, TextError> {
    tokenizers::Tokenizer::from_bytes(bytes).map_err(|e| TextError::TokenizerLoad {
        path: path.to_path_buf(),
        message: e.to_string(),
    })
}

/// Writes `bytes` to `path` through a temporary file in the same folder (created if missing)
/// and a rename. The temporary name is this process's and this call's own, so that processes and
/// threads (a test binary's) writing the same cache at once never write one file together.
fn write_atomically(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    static CALLS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let call = CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let dir = path.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir)?;
    let name = path.file_name().unwrap_or_default().to_string_lossy();
    let tmp = dir.join(format!(".{name}.{}.{call}.tmp", std::process::id()));
    let written = std::fs::write(&tmp, bytes).and_then(|()| std::fs::rename(&tmp, path));
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    written
}

/// Reads `dir/tokenizer_config.json` as a JSON object; `Ok(None)` when the file does not exist.
pub(crate) fn read_tokenizer_config(
    dir: &Path,
) -> Result<Option<serde_json::Map<String, Value>>, TextError> {
    let path = dir.join("tokenizer_config.json");
    let text = match std::fs::read_to_string(&path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(source) => return Err(TextError::Io { path, source }),
    };
    match serde_json::from_str::<Value>(&text) {
        Ok(Value::Object(map)) => Ok(Some(map)),
        Ok(_) => Err(json_error(path, "top level is not an object")),
        Err(e) => Err(json_error(path, &e.to_string())),
    }
}

fn json_error(path: PathBuf, message: &str) -> TextError {
    TextError::Json {
        path,
        message: message.to_string(),
    }
}

/// A special token of `tokenizer_config.json`: either a plain string or an `AddedToken` object with
/// a `content` field (both forms occur in HF configs).
pub(crate) fn special_token(config: &serde_json::Map<String, Value>, key: &str) -> Option<String> {
    match config.get(key)? {
        Value::String(s) => Some(s.clone()),
        Value::Object(o) => o.get("content")?.as_str().map(str::to_string),
        _ => None,
    }
}
