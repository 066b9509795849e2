//! `install`, `verify`, `inspect`, `discard`: argument parsing and printing only; the work
//! is in `mference-install`.

use crate::notes::{out, say};
use anyhow::{bail, Context};
use clap::Args;
use mference_install::checkpoint::Pin;
use mference_install::source::http::{HttpConfig, HttpSource};
use mference_install::{
    presets, state, InstallError, InstallOptions, InstallReport, LocalSource, ProgressMode, Source,
};
use std::path::{Path, PathBuf};

#[derive(Args)]
pub struct InstallArgs {
    /// Local mlx-community-style checkpoint directory (config.json, *.safetensors, tokenizer files;
    /// without tokenizer files the install takes token ids only: `logits`, `bench`). Without a
    /// SOURCE, --model or --repo the default preset (gemma4, a 14 GB download) is installed; at a
    /// terminal you are asked first.
    pub source: Option<PathBuf>,
    /// Pinned preset to download instead of a local directory: gemma4, qwen36, deepseekv4flash, inklingsmall, maple.
    #[arg(long, conflicts_with = "source")]
    pub model: Option<String>,
    /// Output install directory, e.g. gemma4.gturbo.
    #[arg(long)]
    pub output: PathBuf,
    /// HTTP(S) mirror in Hugging Face layout ({base}/{repo}/resolve/{revision}/{file}); default $HF_ENDPOINT or https://huggingface.co.
    #[arg(long)]
    pub base_url: Option<String>,
    /// Repository for a remote install without a preset (with --revision; no index pin).
    #[arg(long, conflicts_with_all = ["source", "model"])]
    pub repo: Option<String>,
    /// Revision for --repo (branch, tag or commit).
    #[arg(long, requires = "repo")]
    pub revision: Option<String>,
    /// Print the plan (ranges, source bytes, output bytes, resident entries, expert layers, excluded tensors) and write nothing.
    #[arg(long)]
    pub dry_run: bool,
    /// Continue a saved partial install.
    #[arg(long, conflicts_with = "overwrite")]
    pub resume: bool,
    /// Replace an existing install at --output.
    #[arg(long)]
    pub overwrite: bool,
    /// modelID recorded in the manifest (default: repo id or directory name).
    #[arg(long)]
    pub model_id: Option<String>,
    /// Largest coalesced range in bytes (≤ 64 MiB).
    #[arg(long, hide = true, default_value_t = mference_install::plan::MAX_RANGE_BYTES)]
    pub range_bytes: u64,
    /// Free-disk reserve on top of the remaining output, bytes (default: 1/16 of the output, at
    /// least 16 MiB, at most 1 GiB).
    #[arg(long, hide = true)]
    pub disk_reserve_bytes: Option<u64>,
    /// Install from an HTTP source even where it publishes no digest (X-Linked-Etag / ETag) for a
    /// file; the receipt lists such files as not verified.
    #[arg(long)]
    pub allow_unverified: bool,
    /// Base delay of the HTTP retry backoff, milliseconds.
    #[arg(long, hide = true, default_value_t = 1000)]
    pub retry_delay_ms: u64,
    /// No progress output.
    #[arg(long)]
    pub quiet: bool,
}

#[derive(Args)]
pub struct VerifyArgs {
    /// Install directory.
    pub dir: PathBuf,
}

#[derive(Args)]
pub struct InspectArgs {
    /// Install directory (or its output path while a partial install is saved).
    pub dir: PathBuf,
}

#[derive(Args)]
pub struct DiscardArgs {
    /// Output path of the install whose saved partial state should be removed.
    pub dir: PathBuf,
}

pub fn install(a: InstallArgs) -> anyhow::Result<()> {
    let mut opts = InstallOptions {
        resume: a.resume,
        overwrite: a.overwrite,
        dry_run: a.dry_run,
        max_range_bytes: a.range_bytes,
        disk_reserve_bytes: a.disk_reserve_bytes,
        allow_unverified: a.allow_unverified,
        progress: if a.quiet {
            ProgressMode::Quiet
        } else {
            ProgressMode::Auto
        },
        model_id: a.model_id,
        pin: None,
    };
    let source: Box<dyn Source> = if let Some(dir) = &a.source {
        // The load's own check of the config, before any weight is copied (a config the runtime
        // cannot run would otherwise fail only at the end, or at the first load).
        if let Ok(bytes) = std::fs::read(dir.join("config.json")) {
            if let Ok(v) = serde_json::from_slice::<serde_json::Value>(&bytes) {
                if let Err(e) = mference_models::check_config(&v) {
                    bail!(
                        "{}: {e}; nothing was installed",
                        dir.join("config.json").display()
                    );
                }
            }
        }
        Box::new(LocalSource::new(dir)?)
    } else {
        let (repo, revision) = if let Some(repo) = a.repo {
            (repo, a.revision.unwrap_or_else(|| "main".into()))
        } else {
            let name = a.model.as_deref().unwrap_or("gemma4");
            let p = presets::preset(name).with_context(|| {
                let names: Vec<&str> = presets::PRESETS.iter().map(|p| p.name).collect();
                format!("unknown --model {name}; choose one of {}", names.join(", "))
            })?;
            if a.model.is_none() {
                // The original's default; say so, since a forgotten SOURCE starts a download,
                // and at a terminal ask first (a pipe or script gets the default as before).
                say!(
                    "no SOURCE directory given: installing the default preset --model {name} ({} @ {}) over HTTP",
                    p.repo, p.revision
                );
                if !a.dry_run && std::io::IsTerminal::is_terminal(&std::io::stdin()) {
                    eprint!("download it now? [y/N] ");
                    let mut answer = String::new();
                    std::io::stdin().read_line(&mut answer)?;
                    if !matches!(answer.trim(), "y" | "Y" | "yes") {
                        bail!("nothing installed: give a checkpoint directory, or --model NAME (one of {}) to download a preset", presets::PRESETS.iter().map(|p| p.name).collect::<Vec<_>>().join(", "));
                    }
                }
            }
            opts.pin = Some(Pin {
                index_sha256: p.index_sha256.into(),
            });
            (p.repo.to_string(), p.revision.to_string())
        };
        let base = a
            .base_url
            .or_else(|| std::env::var("HF_ENDPOINT").ok().filter(|s| !s.is_empty()))
            .unwrap_or_else(|| "https://huggingface.co".into());
        let cfg = HttpConfig {
            base_url: base,
            repo,
            revision,
            token: std::env::var("HF_TOKEN").ok().filter(|s| !s.is_empty()),
            retry_base_delay: std::time::Duration::from_millis(a.retry_delay_ms),
            ..HttpConfig::default()
        };
        Box::new(HttpSource::new(cfg)?)
    };
    let report =
        mference_install::install(source.as_ref(), &a.output, &opts).map_err(|e| {
            match (&e, a.source.as_deref().map(nested_checkpoints)) {
                (InstallError::SourceInvalid { .. }, Some(found)) if !found.is_empty() => {
                    let dir = a.source.as_deref().unwrap_or(Path::new("")).display();
                    let names: Vec<String> =
                        found.iter().map(|p| p.display().to_string()).collect();
                    anyhow::anyhow!("{e} in {dir}; did you mean {}?", names.join(" or "))
                }
                _ => e.into(),
            }
        })?;
    print_report(&report);
    Ok(())
}

/// Where `dir` has no `config.json`, its subdirectories that have one (a fixture's
/// `assets/fixtures/deepseek_v4/A` given for `A/checkpoint`), sorted; otherwise none.
fn nested_checkpoints(dir: &Path) -> Vec<PathBuf> {
    if dir.join("config.json").exists() {
        return Vec::new();
    }
    let mut found: Vec<PathBuf> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| dir.join(e.file_name()))
        .filter(|p| p.join("config.json").is_file())
        .collect();
    found.sort();
    found
}

fn print_report(r: &InstallReport) {
    for w in &r.warnings {
        say!("warning: {w}");
    }
    if r.dry_run {
        out!("dry run: nothing written");
        out!("family:            {}", r.family);
        out!("source revision:   {}", r.source_revision);
        out!("range requests:    {}", r.ranges_total);
        out!("source bytes:      {}", r.source_bytes);
        out!(
            "output bytes:      {} (layout.json not counted)",
            r.output_bytes
        );
        out!("resident entries:  {}", r.resident_entries);
        out!(
            "expert layers:     {} (stride {} bytes)",
            r.expert_layers,
            r.expert_stride
        );
        out!("excluded tensors:  {}", r.excluded.len());
        for n in &r.excluded {
            out!("  {n}");
        }
        for n in &r.notes {
            out!("note: {n}");
        }
    } else {
        out!(
            "installed {} ({} bytes): {} ranges fetched ({} bytes), {} reused from the journal",
            r.output.display(),
            r.output_bytes,
            r.ranges_fetched,
            r.fetched_bytes,
            r.ranges_reused
        );
        out!(
            "{}",
            source_check_line(&r.verified_files, &r.unverified_files, r.hashed_only_bytes)
        );
    }
}

/// The summary's line on the source files: how many matched a digest their source published,
/// and which had none to match (a plain local folder publishes none: its files are copied as
/// they are, and the install's own manifest hashes what was written).
fn source_check_line(verified: &[String], unverified: &[String], hashed_only: u64) -> String {
    match (verified.len(), unverified.len()) {
        (0, 0) => "source files: none".to_string(),
        (0, _) => format!(
            "source files: the source publishes no digests, so none was checked against one \
             (the install's manifest hashes what was written): {}",
            unverified.join(", ")
        ),
        (n, 0) => format!(
            "source files: all {n} matched the digests the source publishes ({hashed_only} bytes \
             read only to be hashed)"
        ),
        (n, _) => format!(
            "source files: {n} matched the digests the source publishes ({hashed_only} bytes read \
             only to be hashed); none published for: {}",
            unverified.join(", ")
        ),
    }
}

pub fn verify(a: VerifyArgs) -> anyhow::Result<()> {
    let s = state::verify(&a.dir)?;
    out!(
        "Verified manifest.json and the {} files it lists ({} bytes); wrote verified-install.json",
        s.files,
        s.bytes
    );
    Ok(())
}

pub fn inspect(a: InspectArgs) -> anyhow::Result<()> {
    let r = state::inspect(&a.dir)?;
    out!("install: {}", r.out.display());
    match &r.manifest {
        Some(m) => {
            let ar = &m.arch;
            out!("model:   {} (family {})", m.model_id, ar.family);
            out!(
                "arch:    {} layers, hidden {}, {} heads / {} kv (head_dim {}), vocab {}, {} experts top-{}, expert width {}",
                ar.num_layers, ar.hidden_size, ar.num_heads, ar.num_kv_heads, ar.head_dim, ar.vocab_size,
                ar.num_experts, ar.top_k_experts, ar.moe_intermediate_size
            );
            if let Some(q) = &m.quant {
                out!(
                    "quant:   embedding {}b, attention {}b, router {}b, shared {}b, routed {}b (group {})",
                    q.embedding.weight_bits, q.attention.weight_bits, q.router.weight_bits,
                    q.shared_expert.weight_bits, q.routed_expert.weight_bits, q.routed_expert.group_size
                );
            }
            let resident = m
                .files
                .get(mference_format::WEIGHTS_FILE)
                .map(|f| f.size)
                .unwrap_or(0);
            out!(
                "sizes:   {} bytes total, model_weights.bin {} bytes, {} expert layers × {} experts × {} bytes stride",
                r.installed_bytes,
                resident,
                m.expert_layer_files(),
                m.experts_per_layer,
                m.expert_stride
            );
        }
        None => out!("no complete install at this path"),
    }
    let receipt = std::fs::read(r.out.join("verified-install.json"))
        .ok()
        .and_then(|b| mference_format::Receipt::parse(&b).ok());
    if let Some(rc) = receipt {
        let from = match (&rc.source_repo_id, &rc.source_revision) {
            (Some(repo), Some(rev)) => format!("{repo}@{rev}"),
            (Some(repo), None) => repo.clone(),
            _ => "unknown".into(),
        };
        let bytes = rc
            .source_bytes
            .clone()
            .or_else(|| {
                rc.source_repo_id
                    .as_deref()
                    .map(|r| mference_install::run::source_trust(r).to_string())
            })
            .unwrap_or_else(|| "not recorded".into());
        out!("source:  {from}; source bytes {bytes}");
    }
    let hint = r.partial_hint.as_deref().unwrap_or_default();
    match (&r.journal, r.partial) {
        (Some(j), _) if r.running => {
            let done: u64 = j.completed_ranges.iter().map(|c| c.source_bytes).sum();
            out!(
                "partial: an install from {}@{} is running now (another process holds its install lock): {} ranges done, {} of {} source bytes",
                j.repo_id, j.requested_revision, j.completed_ranges.len(), done, j.total_source_bytes
            );
        }
        (None, true) if r.running => {
            out!("partial: an install is running now (another process holds its lock)")
        }
        (Some(j), _) => {
            let done: u64 = j.completed_ranges.iter().map(|c| c.source_bytes).sum();
            out!(
                "partial: an interrupted install from {}@{}: {} ranges done, {} of {} source bytes; {hint}",
                j.repo_id, j.requested_revision, j.completed_ranges.len(), done, j.total_source_bytes
            );
        }
        (None, true) => {
            out!("partial: an interrupted install without a journal (it starts over); {hint}")
        }
        (None, false) => out!("partial: none"),
    }
    Ok(())
}

pub fn discard(a: DiscardArgs) -> anyhow::Result<()> {
    if state::discard(&a.dir)? {
        out!("discarded the saved partial install of {}", a.dir.display());
    } else {
        bail!("nothing to discard at {}", a.dir.display());
    }
    Ok(())
}
