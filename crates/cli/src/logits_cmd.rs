//! `logits`: the float32 logits of a JSON list of token ids, written as a NumPy `.npy`, for parity
//! and bit-identity checks against mlx-lm and against other builds. No tokenizer is involved, so
//! it runs on installs made from checkpoints without tokenizer files.

use crate::notes::say;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::Args;

use mference_models::{Logits, Want};

use crate::flags::{count, ModelArgs};
use crate::load_options::load_options;
use crate::run_cmd::{check_install_dir, max_positions, read_json_array};

/// `mference logits`.
#[derive(Args, Debug)]
pub struct LogitsArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// A JSON array of token ids: non-negative integers below the vocabulary size.
    #[arg(long)]
    pub ids: PathBuf,
    /// The `.npy` to write: float32 [T, vocab], C order (through a temporary file and a rename).
    #[arg(long)]
    pub out: PathBuf,
    /// prefill (one forward over all ids in one chunk), decode (one id per forward), or chunk:N
    /// (one forward in prefill chunks of N rows).
    #[arg(long, default_value = "prefill")]
    pub mode: String,
    /// Positions the KV cache holds (at least the number of ids).
    #[arg(long, default_value_t = 4096, value_parser = count(1, usize::MAX))]
    pub max_context: usize,
}

/// How the ids go through the model.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    /// One forward, prefill chunk = T.
    Prefill,
    /// T forwards of one id each.
    Decode,
    /// One forward, prefill chunk = N.
    Chunk(usize),
}

impl Mode {
    fn parse(s: &str) -> Result<Mode> {
        match s {
            "prefill" => Ok(Mode::Prefill),
            "decode" => Ok(Mode::Decode),
            _ => match s.strip_prefix("chunk:").map(str::parse::<usize>) {
                Some(Ok(n)) if n > 0 => Ok(Mode::Chunk(n)),
                _ => bail!("invalid --mode '{s}': allowed values are prefill, decode, chunk:N (N >= 1 rows per prefill chunk)"),
            },
        }
    }
}

/// The ids of `path`: a non-empty JSON array of integers in `0..=u32::MAX` (the vocabulary bound
/// is checked once the model is loaded).
fn read_ids(path: &Path) -> Result<Vec<u32>> {
    let arr = read_json_array(path, "token ids, e.g. [2, 651, 1234]", "id")?;
    arr.iter()
        .enumerate()
        .map(|(i, x)| {
            x.as_u64()
                .and_then(|n| u32::try_from(n).ok())
                .with_context(|| {
                    format!(
                        "{}: entry {i} is {x}, not a token id (a non-negative integer)",
                        path.display()
                    )
                })
        })
        .collect()
}

/// A NumPy format 1.0 file of `data` (`rows × cols` float32, row-major): magic, version, header
/// length (u16 LE), the header dict padded with spaces to a 64-byte boundary and ended by a
/// newline, then the values little-endian (`numpy/lib/format.py`).
fn npy_bytes(rows: usize, cols: usize, data: &[f32]) -> Vec<u8> {
    let mut header =
        format!("{{'descr': '<f4', 'fortran_order': False, 'shape': ({rows}, {cols}), }}");
    let prefix = 10; // b"\x93NUMPY", 1, 0, u16 header length
    let total = (prefix + header.len() + 1).div_ceil(64) * 64;
    header.push_str(&" ".repeat(total - prefix - header.len() - 1));
    header.push('\n');
    let mut out = Vec::with_capacity(total + data.len() * 4);
    out.extend_from_slice(b"\x93NUMPY\x01\x00");
    out.extend_from_slice(&(header.len() as u16).to_le_bytes());
    out.extend_from_slice(header.as_bytes());
    for v in data {
        out.extend_from_slice(&v.to_le_bytes());
    }
    out
}

/// `mference logits`: loads the install, runs the ids in the chosen mode and writes `[T, vocab]`.
pub fn logits(a: LogitsArgs) -> Result<()> {
    let t0 = Instant::now();
    let mode = Mode::parse(&a.mode)?;
    let dir = &a.model.model;
    check_install_dir(dir)?;
    let ids = read_ids(&a.ids)?;
    let model_max = max_positions(dir)?;
    if ids.len() > a.max_context {
        bail!(
            "{} holds {} ids, more than --max-context {}: {}",
            a.ids.display(),
            ids.len(),
            a.max_context,
            match model_max {
                Some(m) if ids.len() > m =>
                    format!("the model takes at most {m} positions (max_position_embeddings)"),
                _ => "raise --max-context".to_string(),
            }
        );
    }
    if let Some(m) = model_max {
        if a.max_context > m {
            bail!(
                "--max-context {} exceeds the model's max_position_embeddings {m}",
                a.max_context
            );
        }
    }
    let out_dir = match a.out.parent().filter(|p| !p.as_os_str().is_empty()) {
        Some(parent) => parent.to_path_buf(),
        None => PathBuf::from("."),
    };
    if !out_dir.is_dir() {
        bail!(
            "--out {}: {} is not a directory",
            a.out.display(),
            out_dir.display()
        );
    }
    // Never into the install being read (it would replace one of its files).
    if let (Ok(d), Ok(inst)) = (
        std::fs::canonicalize(&out_dir),
        std::fs::canonicalize(&a.model.model),
    ) {
        if d.starts_with(&inst) {
            bail!(
                "--out {} is inside the install {} it reads: choose a path outside it",
                a.out.display(),
                a.model.model.display()
            );
        }
    }
    // The output replaces a regular file or nothing: never a device, a directory or a symlink.
    if let Ok(m) = std::fs::symlink_metadata(&a.out) {
        if !m.file_type().is_file() {
            bail!(
                "--out {} exists and is not a regular file (a directory, device or symlink): \
                 choose a new path",
                a.out.display()
            );
        }
    }
    // A temporary file of its own in the output's directory: one is made now and removed (so an
    // unwritable directory fails before any compute), the one written is made once the logits
    // exist (an interrupted run leaves nothing behind), renamed into place at the end.
    let temp_file = || {
        tempfile::Builder::new()
            .prefix(".mference-logits-")
            .suffix(".tmp")
            .tempfile_in(&out_dir)
            .map_err(|e| {
                anyhow::anyhow!(
                    "--out {}: cannot write in {}: {e}",
                    a.out.display(),
                    dir.display()
                )
            })
    };
    drop(temp_file()?);
    let chunk = match mode {
        Mode::Prefill => ids.len(),
        Mode::Decode => 1,
        Mode::Chunk(n) => n,
    };
    let mut model = mference_models::load(dir, &load_options(&a.model, chunk, a.max_context)?)?;
    let vocab = model.vocab_size();
    if let Some((i, id)) = ids.iter().enumerate().find(|(_, &id)| id as usize >= vocab) {
        bail!(
            "{}: entry {i} is id {id}, outside the vocabulary of {vocab} tokens",
            a.ids.display()
        );
    }
    let rows = match mode {
        Mode::Decode => {
            let mut all = Vec::with_capacity(ids.len() * vocab);
            for &id in &ids {
                let Logits::Rows(r) = model.forward(&[id], Want::Last)? else {
                    bail!("the model returned no logits")
                };
                all.extend(r);
            }
            all
        }
        Mode::Prefill | Mode::Chunk(_) => {
            let Logits::Rows(r) = model.forward(&ids, Want::All)? else {
                bail!("the model returned no logits")
            };
            r
        }
    };
    if rows.len() != ids.len() * vocab {
        bail!(
            "the model returned {} logits for {} ids × vocabulary {vocab}",
            rows.len(),
            ids.len()
        );
    }
    let mut tmp = temp_file()?;
    {
        use std::io::Write;
        let f = tmp.as_file_mut();
        use std::os::unix::fs::PermissionsExt;
        f.write_all(&npy_bytes(ids.len(), vocab, &rows))
            .and_then(|_| f.set_permissions(std::fs::Permissions::from_mode(0o644)))
            .and_then(|_| f.sync_all())
            .map_err(|e| anyhow::anyhow!("writing {}: {e}", a.out.display()))?;
    }
    tmp.persist(&a.out)
        .map_err(|e| anyhow::anyhow!("cannot rename into {}: {}", a.out.display(), e.error))?;
    say!(
        "[wrote {}: {} x {vocab} float32 logits, mode {}, kernels {}, device {}, {:.2}s]",
        a.out.display(),
        ids.len(),
        a.mode,
        model.engine().kernels_label,
        model.device(),
        t0.elapsed().as_secs_f64()
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn modes_parse_and_bad_ones_name_the_allowed_values() {
        assert_eq!(Mode::parse("prefill").unwrap(), Mode::Prefill);
        assert_eq!(Mode::parse("decode").unwrap(), Mode::Decode);
        assert_eq!(Mode::parse("chunk:7").unwrap(), Mode::Chunk(7));
        for bad in ["chunk:0", "chunk:", "chunk:x", "chunks:3", "Prefill", ""] {
            let e = Mode::parse(bad).unwrap_err().to_string();
            assert!(e.contains("prefill, decode, chunk:N"), "{bad}: {e}");
        }
    }

    /// The header layout of numpy's format 1.0: 64-byte aligned data, newline-ended header.
    #[test]
    fn npy_header_is_aligned_and_data_follows_it() {
        let b = npy_bytes(2, 3, &[1.0, 2.0, 3.0, 4.0, 5.0, -6.5]);
        assert_eq!(&b[..8], b"\x93NUMPY\x01\x00");
        let hlen = u16::from_le_bytes([b[8], b[9]]) as usize;
        assert_eq!((10 + hlen) % 64, 0);
        let header = std::str::from_utf8(&b[10..10 + hlen]).unwrap();
        assert!(header.ends_with('\n'));
        assert!(header.starts_with("{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }"));
        assert_eq!(b.len(), 10 + hlen + 24);
        assert_eq!(&b[b.len() - 4..], &(-6.5f32).to_le_bytes());
    }
}
