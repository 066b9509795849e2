//! Opening an install with the load-time checks (`docs/FORMAT.md`,
//! "Loading").

use crate::hash::{read_capped, sha256_file, sha256_hex};
use crate::layout::LAYOUT_MAX_BYTES;
use crate::manifest::MANIFEST_MAX_BYTES;
use crate::receipt::RECEIPT_MAX_BYTES;
use crate::{
    ArchInfo, Family, FormatError, Layout, Manifest, Receipt, ResidentIndex, FORMAT_PAGE_BYTES,
    LAYOUT_FILE, MANIFEST_FILE, RECEIPT_FILE, TOKENIZER_DIR, WEIGHTS_FILE,
};
use std::io::Read;
use std::path::{Path, PathBuf};

/// Integrity policy at load.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum VerifyPolicy {
    /// Hash `manifest.json`, `model_weights.bin`, `layout.json` and every file under
    /// `tokenizer/` (tokenizer, chat template, config) at open, and each layer file on first use
    /// ([`Install::check_layer_file`]). The default.
    FullSha256,
    /// Hash `manifest.json`, `model_weights.bin` and `layout.json` at open, require a receipt
    /// bound to this directory and manifest, and check only the sizes of the layer files and the
    /// `tokenizer/` files.
    TrustedReceipt,
}

/// Options for [`Install::open_with`].
#[derive(Clone, Debug)]
pub struct OpenOptions {
    pub policy: VerifyPolicy,
    /// The directory the receipt must be bound to; defaults to the canonical `dir`. The
    /// installer verifies a staged `<out>.partial/` against the final path.
    pub bound_dir: Option<PathBuf>,
    /// Family the caller expects; a different `arch.family` is an architecture mismatch.
    pub expect_family: Option<Family>,
}

/// An opened, validated install.
#[derive(Clone, Debug)]
pub struct Install {
    /// The install directory.
    pub dir: PathBuf,
    pub manifest: Manifest,
    pub layout: Layout,
    /// `tokenizer/config.json` (the checkpoint's config, copied at install).
    pub config_json: serde_json::Value,
    /// The receipt, if one is present and valid.
    pub receipt: Option<Receipt>,
    /// Lower-case hex SHA-256 of `manifest.json`.
    pub manifest_sha256: String,
    policy: VerifyPolicy,
    /// Layers whose file passed [`Install::check_layer_file`] (checked once per open install).
    checked_layers: std::sync::Arc<std::sync::Mutex<std::collections::BTreeSet<usize>>>,
}

fn size_of(path: &Path) -> Result<u64, FormatError> {
    match std::fs::metadata(path) {
        Ok(m) => Ok(m.len()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Err(FormatError::MissingFile {
            path: path.to_path_buf(),
        }),
        Err(e) => Err(FormatError::io(path, e)),
    }
}

/// Host page size in bytes.
pub fn host_page_size() -> u64 {
    rustix::param::page_size() as u64
}

impl Install {
    /// Open `dir` with `policy`: see [`Install::open_with`].
    pub fn open(dir: &Path, policy: VerifyPolicy) -> Result<Install, FormatError> {
        Self::open_with(
            dir,
            &OpenOptions {
                policy,
                bound_dir: None,
                expect_family: None,
            },
        )
    }

    /// Open and validate an install. Checks, in order: manifest size cap, magic/version,
    /// unknown flags; expert stride a multiple of 16 KiB and of the host page size; every
    /// manifest file present with its recorded size; SHA-256 of `model_weights.bin` and
    /// `layout.json` (both policies); the receipt binding (required for
    /// [`VerifyPolicy::TrustedReceipt`]); the resident index header against the file size;
    /// layout consistent with the manifest; `arch` equal to the one derived from
    /// `tokenizer/config.json` and to `expect_family`. Layer files are hashed later, on
    /// first use ([`Install::check_layer_file`]).
    pub fn open_with(dir: &Path, opts: &OpenOptions) -> Result<Install, FormatError> {
        let dir = std::fs::canonicalize(dir).map_err(|e| {
            if e.kind() == std::io::ErrorKind::NotFound {
                FormatError::MissingFile {
                    path: dir.to_path_buf(),
                }
            } else {
                FormatError::io(dir, e)
            }
        })?;
        let mbytes = read_capped(&dir.join(MANIFEST_FILE), MANIFEST_FILE, MANIFEST_MAX_BYTES)?;
        let manifest_sha256 = sha256_hex(&mbytes);
        let manifest = Manifest::parse(&mbytes)?;
        let page = host_page_size();
        if manifest.experts_per_layer > 0
            && (manifest.expert_stride % FORMAT_PAGE_BYTES != 0
                || manifest.expert_stride % page != 0)
        {
            return Err(FormatError::StrideNotPageAligned {
                stride: manifest.expert_stride,
                page: page.max(FORMAT_PAGE_BYTES),
            });
        }
        for required in [WEIGHTS_FILE, LAYOUT_FILE] {
            if !manifest.files.contains_key(required) {
                return Err(FormatError::ManifestInvalid {
                    detail: format!("files has no entry for {required}"),
                });
            }
        }
        for (rel, entry) in &manifest.files {
            let actual = size_of(&dir.join(rel))?;
            if actual != entry.size {
                return Err(FormatError::SizeMismatch {
                    rel: rel.clone(),
                    expected: entry.size,
                    actual,
                });
            }
        }
        for rel in [WEIGHTS_FILE, LAYOUT_FILE] {
            check_sha(&dir, rel, &manifest.files[rel].sha256)?;
        }
        // The text side (tokenizer, chat template, config) is read from these files: under the
        // default policy a same-size edit must not change tokenization silently.
        if opts.policy == VerifyPolicy::FullSha256 {
            let prefix = format!("{TOKENIZER_DIR}/");
            for (rel, entry) in manifest
                .files
                .iter()
                .filter(|(r, _)| r.starts_with(&prefix))
            {
                check_sha(&dir, rel, &entry.sha256)?;
            }
        }
        let bound = opts.bound_dir.clone().unwrap_or_else(|| dir.clone());
        let receipt_path = dir.join(RECEIPT_FILE);
        let receipt = match opts.policy {
            VerifyPolicy::TrustedReceipt => {
                let r = Receipt::parse(
                    &read_capped(&receipt_path, RECEIPT_FILE, RECEIPT_MAX_BYTES).map_err(|e| {
                        match e {
                            FormatError::MissingFile { .. } => FormatError::ReceiptInvalid {
                                detail: "verified-install.json is missing".into(),
                            },
                            other => other,
                        }
                    })?,
                )?;
                r.validate(&bound, &manifest, &manifest_sha256, mbytes.len() as u64)?;
                Some(r)
            }
            VerifyPolicy::FullSha256 => read_capped(&receipt_path, RECEIPT_FILE, RECEIPT_MAX_BYTES)
                .ok()
                .and_then(|b| Receipt::parse(&b).ok())
                .filter(|r| {
                    r.validate(&bound, &manifest, &manifest_sha256, mbytes.len() as u64)
                        .is_ok()
                }),
        };
        check_resident_header(&dir)?;
        let layout = Layout::parse(&read_capped(
            &dir.join(LAYOUT_FILE),
            LAYOUT_FILE,
            LAYOUT_MAX_BYTES,
        )?)?;
        check_layout_against_manifest(&layout, &manifest)?;
        let cfg_rel = format!("{TOKENIZER_DIR}/config.json");
        let cfg_bytes = read_capped(&dir.join(&cfg_rel), &cfg_rel, MANIFEST_MAX_BYTES)?;
        let config_json: serde_json::Value =
            serde_json::from_slice(&cfg_bytes).map_err(|e| FormatError::ConfigInvalid {
                detail: format!("{cfg_rel}: {e}"),
            })?;
        let derived = ArchInfo::from_config(&config_json)?;
        manifest
            .arch
            .check_matches(&derived, "tokenizer/config.json")?;
        if let Some(f) = opts.expect_family {
            if manifest.arch.family != f {
                return Err(FormatError::ArchMismatch {
                    field: "family".into(),
                    manifest: manifest.arch.family.to_string(),
                    against: "the requested model".into(),
                    other: f.to_string(),
                });
            }
        }
        Ok(Install {
            dir,
            manifest,
            layout,
            config_json,
            receipt,
            manifest_sha256,
            policy: opts.policy,
            checked_layers: Default::default(),
        })
    }

    /// Path of `model_weights.bin`.
    pub fn weights_path(&self) -> PathBuf {
        self.dir.join(WEIGHTS_FILE)
    }

    /// Path of the expert file of `layer` (may not exist for a dense layer).
    pub fn layer_path(&self, layer: usize) -> PathBuf {
        self.dir.join(crate::layer_file_name(layer))
    }

    /// The integrity policy the install was opened with.
    pub fn policy(&self) -> VerifyPolicy {
        self.policy
    }

    /// First-use check of a layer file: SHA-256 against the manifest
    /// ([`VerifyPolicy::FullSha256`]) or the size recorded in the manifest and receipt
    /// ([`VerifyPolicy::TrustedReceipt`]). Errors: [`FormatError::NoSuchLayer`] for a
    /// dense or out-of-range layer, missing file, size or SHA mismatch.
    /// A layer that passed once is not checked again.
    pub fn check_layer_file(&self, layer: usize) -> Result<(), FormatError> {
        let checked = || {
            self.checked_layers
                .lock()
                .unwrap_or_else(|e| e.into_inner())
        };
        if checked().contains(&layer) {
            return Ok(());
        }
        self.check_layer_file_now(layer)?;
        checked().insert(layer);
        Ok(())
    }

    /// [`Install::check_layer_file`] for every layer that has an expert file, in layer order;
    /// returns how many files were checked. A long-running process (`serve`) calls it before it
    /// says it is ready, so a damaged file fails the start instead of every request.
    pub fn check_layer_files(&self) -> Result<usize, FormatError> {
        let layers: Vec<usize> = self
            .layout
            .layers
            .iter()
            .filter(|l| l.blob.is_some())
            .map(|l| l.layer)
            .collect();
        for &l in &layers {
            self.check_layer_file(l)?;
        }
        Ok(layers.len())
    }

    fn check_layer_file_now(&self, layer: usize) -> Result<(), FormatError> {
        let rel = crate::layer_file_name(layer);
        let entry = self
            .manifest
            .files
            .get(&rel)
            .ok_or(FormatError::NoSuchLayer { layer })?;
        let actual = size_of(&self.dir.join(&rel))?;
        if actual != entry.size {
            return Err(FormatError::SizeMismatch {
                rel,
                expected: entry.size,
                actual,
            });
        }
        match self.policy {
            VerifyPolicy::FullSha256 => check_sha(&self.dir, &rel, &entry.sha256),
            VerifyPolicy::TrustedReceipt => Ok(()),
        }
    }
}

fn check_sha(dir: &Path, rel: &str, expected: &str) -> Result<(), FormatError> {
    let (_, actual) = sha256_file(&dir.join(rel))?;
    if !actual.eq_ignore_ascii_case(expected) {
        return Err(FormatError::ShaMismatch {
            rel: rel.to_string(),
            expected: expected.to_string(),
            actual,
        });
    }
    Ok(())
}

fn check_resident_header(dir: &Path) -> Result<(), FormatError> {
    let path = dir.join(WEIGHTS_FILE);
    let mut f = std::fs::File::open(&path).map_err(|e| FormatError::io(&path, e))?;
    let mut head = [0u8; 24];
    f.read_exact(&mut head)
        .map_err(|e| FormatError::io(&path, e))?;
    let (index_size, resident_size, _) = ResidentIndex::parse_header(&head)?;
    let len = size_of(&path)?;
    if index_size.checked_add(resident_size) != Some(len) {
        return Err(FormatError::ResidentIndexInvalid {
            detail: format!(
                "indexSize {index_size} + residentSize {resident_size} != file size {len}"
            ),
        });
    }
    Ok(())
}

fn check_layout_against_manifest(layout: &Layout, m: &Manifest) -> Result<(), FormatError> {
    let bad = |d: String| FormatError::LayoutInvalid { detail: d };
    if layout.expert_stride != m.expert_stride
        || layout.experts_per_layer != m.experts_per_layer
        || layout.num_layers != m.num_layers
    {
        return Err(bad(format!(
            "stride/experts/layers {}/{}/{} disagree with the manifest {}/{}/{}",
            layout.expert_stride,
            layout.experts_per_layer,
            layout.num_layers,
            m.expert_stride,
            m.experts_per_layer,
            m.num_layers
        )));
    }
    for l in &layout.layers {
        if l.layer >= m.num_layers {
            return Err(bad(format!(
                "layer {} is beyond numLayers {}",
                l.layer, m.num_layers
            )));
        }
        if l.blob.is_some() {
            let entry = m
                .files
                .get(&l.file)
                .ok_or_else(|| bad(format!("{} is not listed in the manifest", l.file)))?;
            let want = m.experts_per_layer as u64 * m.expert_stride;
            if entry.size != want {
                return Err(bad(format!(
                    "{} is {} bytes, expected experts × stride = {want}",
                    l.file, entry.size
                )));
            }
        }
    }
    Ok(())
}
