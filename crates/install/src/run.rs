//! The install driver: plan, state checks, copy with journal, finalize, promote
//! (`docs/FORMAT.md`, "Installer").

use crate::checkpoint::{self, Checkpoint, Pin};
use crate::copy::{digest_destinations, Dests};
use crate::journal::{fsync_dir, fsync_parent, write_atomic, Journal};
use crate::lock::InstallLock;
use crate::plan::{self, Plan, MAX_RANGE_BYTES, TILE_BYTES};
use crate::progress::{Progress, ProgressMode};
pub use crate::receipt::{source_trust, write_receipt, SourceRecord};
use crate::sidecars::{self, Sidecars};
use crate::source::Source;
use crate::verify::{self, SourceCheck};
use crate::InstallError;
use mference_format::hash::sha256_file;
use mference_format::manifest::{FileEntry, Flags, Manifest, MAGIC, VERSION_MAJOR, VERSION_MINOR};
use mference_format::{
    Install, OpenOptions, VerifyPolicy, LAYOUT_FILE, MANIFEST_FILE, TOKENIZER_DIR,
};
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

pub use crate::receipt::TOOL_VERSION;

/// Options of one install.
#[derive(Clone, Debug)]
pub struct InstallOptions {
    /// Continue a saved partial install (`--resume`).
    pub resume: bool,
    /// Replace an existing install at the output path (`--overwrite`).
    pub overwrite: bool,
    /// Plan only; write nothing (`--dry-run`).
    pub dry_run: bool,
    /// Largest coalesced range in bytes (1..=64 MiB; default 64 MiB).
    pub max_range_bytes: u64,
    /// Free-disk reserve kept on top of the remaining output, bytes; `None` (the default): 1/16
    /// of the output, at least 16 MiB and at most 1 GiB ([`disk_reserve`]).
    pub disk_reserve_bytes: Option<u64>,
    /// Accept source files for which an HTTP source publishes no digest (`--allow-unverified`);
    /// the receipt then lists them without `verifiedAgainst`.
    pub allow_unverified: bool,
    pub progress: ProgressMode,
    /// `modelID` for the manifest; default: the repo id, or the directory name.
    pub model_id: Option<String>,
    /// Expected index SHA-256 (presets).
    pub pin: Option<Pin>,
}

impl Default for InstallOptions {
    fn default() -> Self {
        InstallOptions {
            resume: false,
            overwrite: false,
            dry_run: false,
            max_range_bytes: MAX_RANGE_BYTES,
            disk_reserve_bytes: None,
            allow_unverified: false,
            progress: ProgressMode::Auto,
            model_id: None,
            pin: None,
        }
    }
}

/// What an install did (or, for a dry run, would do).
#[derive(Clone, Debug)]
pub struct InstallReport {
    /// Final install directory.
    pub output: PathBuf,
    pub dry_run: bool,
    pub family: mference_format::Family,
    pub source_revision: String,
    pub ranges_total: usize,
    /// Ranges fetched by this run.
    pub ranges_fetched: usize,
    /// Journaled ranges that verified and were kept.
    pub ranges_reused: usize,
    /// Source bytes of all ranges (gaps included).
    pub source_bytes: u64,
    /// Source bytes of the ranges written by this run.
    pub fetched_bytes: u64,
    /// Source bytes read by this run only to be hashed against the published digests: safetensors
    /// headers, tensors left out, gaps between ranges, ranges written by an earlier run.
    pub hashed_only_bytes: u64,
    /// Source files whose bytes matched a digest the source published, and those it published
    /// none for (a plain local directory, or `allow_unverified`).
    pub verified_files: Vec<String>,
    pub unverified_files: Vec<String>,
    /// The install's size: the bytes of the files its manifest lists (what `inspect` and
    /// `verify` report); for a dry run the planned weights, expert and tokenizer files
    /// (`layout.json` not counted).
    pub output_bytes: u64,
    pub resident_entries: usize,
    pub expert_layers: usize,
    pub expert_stride: u64,
    /// Multimodal tensors left out.
    pub excluded: Vec<String>,
    /// Dry run only: what is at the output that the install would replace, continue or stop
    /// at (one sentence each, with the option that changes it).
    pub notes: Vec<String>,
    /// What the install lacks that some commands need (a checkpoint without tokenizer files), one
    /// sentence each; the install itself succeeds.
    pub warnings: Vec<String>,
}

/// The paths next to an output `<out>`: `<out>.partial/`, `<out>.resume.json`,
/// `<out>.install.lock`.
#[derive(Clone, Debug)]
pub struct OutPaths {
    pub out: PathBuf,
    pub partial: PathBuf,
    pub journal: PathBuf,
    pub lock: PathBuf,
}

impl OutPaths {
    /// `<out>.old`: the previous install while `--overwrite` promotes a new one.
    pub fn old(&self) -> PathBuf {
        let mut n = self.out.clone().into_os_string();
        n.push(".old");
        PathBuf::from(n)
    }

    /// Absolute paths for `out`, with symlinks in its existing ancestors resolved. Nothing is
    /// created: [`install`] creates a missing parent when it starts.
    pub fn new(out: &Path) -> Result<OutPaths, InstallError> {
        let name = out.file_name().ok_or_else(|| InstallError::BadOption {
            detail: format!("{} has no file name", out.display()),
        })?;
        let parent = out
            .parent()
            .filter(|p| !p.as_os_str().is_empty())
            .unwrap_or(Path::new("."));
        let parent = resolve(parent)?;
        let with = |suffix: &str| {
            let mut n = name.to_os_string();
            n.push(suffix);
            parent.join(n)
        };
        Ok(OutPaths {
            out: parent.join(name),
            partial: with(".partial"),
            journal: with(".resume.json"),
            lock: with(".install.lock"),
        })
    }
}

/// `dir` made absolute: its deepest existing ancestor canonicalized, then the missing
/// components (which cannot be symlinks yet) with `.` and `..` applied.
fn resolve(dir: &Path) -> Result<PathBuf, InstallError> {
    let abs = std::path::absolute(dir).map_err(|e| InstallError::io("cannot resolve", dir, e))?;
    let base = abs
        .ancestors()
        .find(|a| a.exists())
        .unwrap_or(Path::new("/"));
    let mut out =
        std::fs::canonicalize(base).map_err(|e| InstallError::io("cannot resolve", base, e))?;
    for c in abs.strip_prefix(base).unwrap_or(Path::new("")).components() {
        match c {
            std::path::Component::ParentDir => {
                out.pop();
            }
            std::path::Component::Normal(n) => out.push(n),
            _ => {}
        }
    }
    Ok(out)
}

/// Create the missing ancestors of `paths.out`; returns them, deepest first.
fn create_parent(paths: &OutPaths) -> Result<Vec<PathBuf>, InstallError> {
    let parent = paths.out.parent().unwrap_or(Path::new("/"));
    let missing: Vec<PathBuf> = parent
        .ancestors()
        .take_while(|a| !a.exists())
        .map(Path::to_path_buf)
        .collect();
    std::fs::create_dir_all(parent).map_err(|e| InstallError::io("cannot create", parent, e))?;
    Ok(missing)
}

/// Install from any [`Source`] into `output`. See the crate docs for the sequence. A
/// failure that leaves no install state (a preflight error: source, plan, free disk, a
/// refused output) leaves nothing on disk: no lock file, no directory created for `output`.
pub fn install(
    source: &dyn Source,
    output: &Path,
    opts: &InstallOptions,
) -> Result<InstallReport, InstallError> {
    let paths = OutPaths::new(output)?;
    if opts.dry_run {
        return install_locked(source, &paths, opts);
    }
    let created = create_parent(&paths)?;
    // The lock comes first so a second installer touches nothing, not even the source.
    let result =
        InstallLock::acquire(&paths).and_then(|_lock| install_locked(source, &paths, opts));
    if result.is_err() {
        for dir in &created {
            // Only directories left empty go: anything in them is install state or not ours.
            if std::fs::remove_dir(dir).is_err() {
                break;
            }
        }
    }
    result
}

/// [`install`] once the output's parent exists and the lock is held (none for a dry run).
fn install_locked(
    source: &dyn Source,
    paths: &OutPaths,
    opts: &InstallOptions,
) -> Result<InstallReport, InstallError> {
    let mut progress = Progress::new(if opts.dry_run {
        ProgressMode::Quiet
    } else {
        opts.progress
    });
    // What is already at the output is refused before the source is read.
    let finishing = opts.resume && promoted_with_journal(paths);
    if !opts.dry_run && !finishing {
        refuse_existing(paths, opts)?;
    }
    progress.stage("reading source metadata");
    let ck = checkpoint::load(source, opts.pin.as_ref())?;
    progress.stage("planning");
    let plan = plan::build(&ck, opts.max_range_bytes)?;
    let sid = source.id();
    let mut report = InstallReport {
        output: paths.out.clone(),
        dry_run: opts.dry_run,
        family: plan.family,
        source_revision: sid.revision.clone(),
        ranges_total: plan.ranges.len(),
        ranges_fetched: 0,
        ranges_reused: 0,
        source_bytes: plan.source_bytes(),
        fetched_bytes: 0,
        hashed_only_bytes: 0,
        verified_files: Vec::new(),
        unverified_files: Vec::new(),
        output_bytes: plan.output_bytes() + ck.sidecars.iter().map(|(_, s)| s).sum::<u64>(),
        resident_entries: plan.resident.entries.len(),
        expert_layers: plan.expert_layers(),
        expert_stride: plan.layout.expert_stride,
        excluded: plan.excluded.clone(),
        notes: Vec::new(),
        warnings: ck.tokenizer_warning().into_iter().collect(),
    };
    if opts.dry_run {
        report.notes = dry_run_notes(paths, opts);
        return Ok(report);
    }
    let fresh_journal = Journal {
        schema: 1,
        repo_id: sid.repo_id.clone(),
        requested_revision: sid.revision.clone(),
        resolved_commit: sid.resolved_commit.clone(),
        source_index_sha256: ck.index_sha256.clone(),
        plan_fingerprint: plan.fingerprint.clone(),
        total_source_bytes: plan.source_bytes(),
        completed_ranges: Vec::new(),
        base_url: sid.base_url.clone(),
        verified_source_files: BTreeMap::new(),
    };
    let (has_partial, has_journal) = (paths.partial.exists(), paths.journal.exists());
    if opts.resume && promoted_with_journal(paths) {
        std::fs::remove_file(&paths.journal)
            .map_err(|e| InstallError::io("cannot remove", &paths.journal, e))?;
        fsync_parent(&paths.journal)?;
        report.ranges_reused = plan.ranges.len();
        return Ok(report);
    }
    // Every small file is read, checked and parsed before anything is written.
    let side = sidecars::fetch(source, &ck, opts.allow_unverified, &mut progress)?;
    sidecars::check_text(&side.files, plan.arch.vocab_size)?;
    let expected = ck
        .shards
        .iter()
        .map(|s| {
            verify::require(
                &s.file,
                source.published_digest(&s.file)?,
                source.publishes_digests(),
                opts.allow_unverified,
            )
        })
        .collect::<Result<Vec<_>, _>>()?;
    if opts.resume && !has_journal && !has_partial {
        // A mistyped --output with --resume would otherwise start over unnoticed.
        progress.stage(&format!(
            "--resume: no saved partial install of {}; starting a new install",
            paths.out.display()
        ));
    }
    let mut journal = if opts.resume && has_journal {
        let j = Journal::load(&paths.journal)?;
        check_resume_identity(&j, &fresh_journal, &paths.out)?;
        j
    } else {
        fresh_journal.clone()
    };
    if !has_partial {
        // A partial directory without journaled ranges is rebuilt from nothing.
        journal.completed_ranges.clear();
        journal.verified_source_files.clear();
    }
    let written: u64 = journal
        .completed_ranges
        .iter()
        .map(|c| c.destination_bytes)
        .sum();
    // The tokenizer files are written again on every run (a resume included): they count whole.
    let sidecar_bytes: u64 = ck.sidecars.iter().map(|(_, s)| s).sum();
    crate::disk::check(
        &paths.out,
        plan.output_bytes().saturating_sub(written) + sidecar_bytes,
        plan.output_bytes() + sidecar_bytes,
        opts.disk_reserve_bytes,
    )?;

    // Journal before directory: a crash in between leaves a journal with no ranges, which
    // --resume accepts.
    journal.store(&paths.journal)?;
    std::fs::create_dir_all(paths.partial.join(mference_format::EXPERTS_DIR))
        .and_then(|_| std::fs::create_dir_all(paths.partial.join(TOKENIZER_DIR)))
        .map_err(|e| InstallError::io("cannot create", &paths.partial, e))?;
    fsync_parent(&paths.partial)?;
    let (dests, resized) = open_dests(&paths.partial, &plan)?;
    if resized {
        journal.completed_ranges.clear();
        journal.verified_source_files.clear();
    }
    let mut tile = vec![0u8; TILE_BYTES];
    progress.stage("writing index, layout and tokenizer files");
    write_generated(&side, &plan, &paths.partial, &dests)?;

    // Keep only journaled ranges whose destinations still hash to the recorded digest.
    let by_id: HashMap<&str, usize> = plan
        .ranges
        .iter()
        .enumerate()
        .map(|(i, r)| (r.id.as_str(), i))
        .collect();
    let before = journal.completed_ranges.len();
    let mut done = vec![false; plan.ranges.len()];
    if before > 0 {
        progress.stage(&format!("re-hashing {before} journaled ranges"));
    }
    let mut kept = Vec::with_capacity(before);
    for c in std::mem::take(&mut journal.completed_ranges) {
        let Some(&i) = by_id.get(c.id.as_str()) else {
            continue;
        };
        if !done[i]
            && digest_destinations(&plan.ranges[i], &plan.copies, &dests, &mut tile)?
                == c.destination_digest
        {
            done[i] = true;
            kept.push(c);
        }
    }
    journal.completed_ranges = kept;
    if journal.completed_ranges.len() != before {
        progress.stage(&format!(
            "{} journaled ranges failed verification and will be fetched again",
            before - journal.completed_ranges.len()
        ));
        journal.store(&paths.journal)?;
    }
    report.ranges_reused = journal.completed_ranges.len();

    let shard_sizes: Vec<u64> = ck.shards.iter().map(|s| s.size).collect();
    let job = crate::stream::Job {
        source,
        plan: &plan,
        shard_sizes: &shard_sizes,
        expected: &expected,
        dests: &dests,
        done: &done,
        journal_path: &paths.journal,
    };
    let streamed = crate::stream::copy_shards(&job, &mut journal, &mut progress)?;
    report.ranges_fetched = streamed.ranges_fetched;
    report.ranges_reused -= streamed.ranges_rewritten;
    report.fetched_bytes = streamed.fetched_bytes;
    report.hashed_only_bytes = streamed.hashed_only_bytes;
    drop(dests);
    let mut checks = side.checks;
    checks.extend(streamed.checks);
    for c in &checks {
        match c.against {
            Some(_) => report.verified_files.push(c.file.clone()),
            None => report.unverified_files.push(c.file.clone()),
        }
    }

    progress.stage("hashing output files and writing manifest and receipt");
    report.output_bytes = finalize(&ck, &plan, &sid, &checks, opts, paths)?;
    progress.stage(&format!("promoting {}", paths.out.display()));
    promote(paths, opts.overwrite)?;
    std::fs::remove_file(&paths.journal)
        .map_err(|e| InstallError::io("cannot remove", &paths.journal, e))?;
    fsync_parent(&paths.journal)?;
    Ok(report)
}

/// Refuse to meet what is already at the output: a complete install without `--overwrite`, a
/// saved partial install without `--resume`.
fn refuse_existing(paths: &OutPaths, opts: &InstallOptions) -> Result<(), InstallError> {
    if paths.out.exists() && !opts.overwrite {
        return Err(InstallError::OutputExists {
            out: paths.out.clone(),
        });
    }
    // --overwrite replaces an install, never an arbitrary directory (a checkpoint, a home folder).
    if paths.out.exists() && !is_install(&paths.out) {
        return Err(InstallError::OverwriteRefused {
            out: paths.out.clone(),
        });
    }
    if !opts.resume && (paths.partial.exists() || paths.journal.exists()) {
        return Err(InstallError::PartialExists {
            partial: paths.partial.clone(),
            out: paths.out.clone(),
        });
    }
    Ok(())
}

/// Whether `dir` holds an install: a `manifest.json` that parses as a GTURBO manifest.
fn is_install(dir: &Path) -> bool {
    std::fs::read(dir.join(mference_format::MANIFEST_FILE))
        .ok()
        .is_some_and(|b| mference_format::Manifest::parse(&b).is_ok())
}

/// Killed after promotion, before the journal was removed: `--resume` only removes the journal.
fn promoted_with_journal(paths: &OutPaths) -> bool {
    paths.out.exists() && paths.journal.exists() && !paths.partial.exists()
}

/// What a real install with `opts` would do with what is at the output ([`InstallReport::notes`]).
fn dry_run_notes(paths: &OutPaths, opts: &InstallOptions) -> Vec<String> {
    if opts.resume && promoted_with_journal(paths) {
        return vec![format!(
            "{} is installed; --resume would only remove its leftover journal",
            paths.out.display()
        )];
    }
    if let Err(e) = refuse_existing(paths, opts) {
        return vec![format!("without --dry-run this install would fail: {e}")];
    }
    let mut notes = Vec::new();
    if paths.out.exists() {
        notes.push(format!(
            "{} already exists; --overwrite would replace it",
            paths.out.display()
        ));
    }
    if opts.resume && (paths.partial.exists() || paths.journal.exists()) {
        notes.push(format!(
            "--resume would continue the saved partial install at {}",
            paths.partial.display()
        ));
    }
    notes
}

fn check_resume_identity(saved: &Journal, now: &Journal, out: &Path) -> Result<(), InstallError> {
    let fields = [
        ("repo", &saved.repo_id, &now.repo_id),
        (
            "revision",
            &saved.requested_revision,
            &now.requested_revision,
        ),
        ("commit", &saved.resolved_commit, &now.resolved_commit),
        (
            "index SHA-256",
            &saved.source_index_sha256,
            &now.source_index_sha256,
        ),
        (
            "plan fingerprint",
            &saved.plan_fingerprint,
            &now.plan_fingerprint,
        ),
    ];
    for (what, a, b) in fields {
        if a != b {
            return Err(InstallError::ResumeMismatch {
                out: out.to_path_buf(),
                detail: format!("{what} was {a}, now {b}"),
            });
        }
    }
    if saved.total_source_bytes != now.total_source_bytes {
        return Err(InstallError::ResumeMismatch {
            out: out.to_path_buf(),
            detail: "total source bytes differ".into(),
        });
    }
    Ok(())
}

/// Open (creating or resizing) every destination file; `true` if any existing file had a
/// different size (then every journaled range is void).
fn open_dests(partial: &Path, plan: &Plan) -> Result<(Dests, bool), InstallError> {
    let mut files = Vec::new();
    let mut paths = Vec::new();
    let mut resized = false;
    for (rel, size) in &plan.dest_files {
        let p = partial.join(rel);
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&p)
            .map_err(|e| InstallError::io("cannot open", &p, e))?;
        let cur = f
            .metadata()
            .map_err(|e| InstallError::io("cannot stat", &p, e))?
            .len();
        if cur != *size {
            resized |= cur != 0;
            f.set_len(*size)
                .map_err(|e| InstallError::io("cannot size", &p, e))?;
        }
        files.push(f);
        paths.push(p);
    }
    fsync_dir(&partial.join(mference_format::EXPERTS_DIR))?;
    fsync_dir(partial)?;
    let enospc_after = std::env::var("MFERENCE_FAILPOINT_ENOSPC_AFTER")
        .ok()
        .and_then(|v| v.parse().ok())
        .map(std::sync::atomic::AtomicU64::new);
    Ok((
        Dests {
            files,
            paths,
            enospc_after,
        },
        resized,
    ))
}

/// Write what the plan generates (resident index, layout.json) and the sidecars.
fn write_generated(
    side: &Sidecars,
    plan: &Plan,
    partial: &Path,
    dests: &Dests,
) -> Result<(), InstallError> {
    use std::os::unix::fs::FileExt;
    let index = plan.resident.encode()?;
    dests.files[0]
        .write_all_at(&index, 0)
        .and_then(|_| dests.files[0].sync_data())
        .map_err(|e| InstallError::io("cannot write", &dests.paths[0], e))?;
    write_atomic(&partial.join(LAYOUT_FILE), &plan.layout.to_bytes())?;
    for (name, bytes) in &side.files {
        write_atomic(&partial.join(TOKENIZER_DIR).join(name), bytes)?;
    }
    fsync_dir(&partial.join(TOKENIZER_DIR))
}

fn finalize(
    ck: &Checkpoint,
    plan: &Plan,
    sid: &crate::source::SourceId,
    checks: &[SourceCheck],
    opts: &InstallOptions,
    paths: &OutPaths,
) -> Result<u64, InstallError> {
    let mut rels: Vec<String> = plan.dest_files.iter().map(|(r, _)| r.clone()).collect();
    rels.push(LAYOUT_FILE.to_string());
    rels.extend(
        ck.sidecars
            .iter()
            .map(|(n, _)| format!("{TOKENIZER_DIR}/{n}")),
    );
    let mut files = BTreeMap::new();
    for rel in rels {
        let (size, sha256) = sha256_file(&paths.partial.join(&rel))?;
        files.insert(rel, FileEntry { size, sha256 });
    }
    let model_id =
        opts.model_id
            .clone()
            .unwrap_or_else(|| match sid.repo_id.strip_prefix("local:") {
                Some(p) => Path::new(p)
                    .file_name()
                    .map(|n| n.to_string_lossy().into_owned())
                    .unwrap_or_default(),
                None => sid.repo_id.clone(),
            });
    let manifest = Manifest {
        magic: MAGIC.into(),
        version_major: VERSION_MAJOR,
        version_minor: VERSION_MINOR,
        flags: Flags {
            streaming_present: true,
            turbo_quant_kv: false,
            ane_shared_expert: false,
        },
        model_id,
        source_snapshot_hash: format!("sha256:{}", ck.index_sha256),
        arch: plan.arch.clone(),
        quant: Some(plan.quant_slots.clone()),
        files,
        experts_per_layer: plan.layout.experts_per_layer,
        num_layers: plan.layout.num_layers,
        expert_stride: plan.layout.expert_stride,
        bit_width_overrides_honored: plan.quant.overrides.len() as u64,
        extra: BTreeMap::new(),
    };
    let mbytes = manifest.to_bytes();
    write_atomic(&paths.partial.join(MANIFEST_FILE), &mbytes)?;
    let record = SourceRecord::new(sid, checks);
    write_receipt(
        &paths.partial,
        &paths.out,
        &manifest,
        &mbytes,
        Some(&record),
    )?;
    // Verify the staged install against the final path before promoting it.
    let opened = Install::open_with(
        &paths.partial,
        &OpenOptions {
            policy: VerifyPolicy::TrustedReceipt,
            bound_dir: Some(paths.out.clone()),
            expect_family: Some(plan.family),
        },
    )?;
    opened.check_layer_files()?;
    Ok(manifest.files.values().map(|f| f.size).sum())
}

fn promote(paths: &OutPaths, overwrite: bool) -> Result<(), InstallError> {
    // `<out>.old` is where --overwrite moves the previous install aside. One left by an interrupted
    // promotion is either stale (the new install is in place) or the previous install (the new one
    // is about to take its place): both go once the new install is promoted.
    let old = paths.old();
    let mut aside = old.exists();
    if overwrite && paths.out.exists() {
        if aside {
            std::fs::remove_dir_all(&old)
                .map_err(|e| InstallError::io("cannot remove", &old, e))?;
        }
        std::fs::rename(&paths.out, &old)
            .map_err(|e| InstallError::io("cannot move aside", &paths.out, e))?;
        aside = true;
    }
    std::fs::rename(&paths.partial, &paths.out)
        .map_err(|e| InstallError::io("cannot promote", &paths.partial, e))?;
    fsync_parent(&paths.out)?;
    if aside {
        std::fs::remove_dir_all(&old).map_err(|e| InstallError::io("cannot remove", &old, e))?;
        fsync_parent(&paths.out)?;
    }
    Ok(())
}
