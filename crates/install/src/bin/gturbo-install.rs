//! A minimal installer front end used by the crash tests and the RSS benchmark (the user
//! CLI is `mference install`). Usage:
//! `gturbo-install (--dir D | --url BASE --repo R --revision V) --out O [--resume]
//!  [--overwrite] [--range-bytes N] [--retry-ms N] [--model-id ID] [--allow-unverified]`

use mference_install::source::http::{HttpConfig, HttpSource};
use mference_install::{InstallOptions, LocalSource, ProgressMode, Source};
use std::path::PathBuf;

fn main() -> std::process::ExitCode {
    match run() {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let (mut dir, mut url, mut repo, mut rev, mut out) = (None, None, None, None, None);
    let mut opts = InstallOptions {
        progress: ProgressMode::Plain,
        disk_reserve_bytes: Some(0),
        ..InstallOptions::default()
    };
    let mut retry_ms = 1000;
    while let Some(a) = args.next() {
        let mut val = || args.next().ok_or(format!("{a} needs a value"));
        match a.as_str() {
            "--dir" => dir = Some(PathBuf::from(val()?)),
            "--url" => url = Some(val()?),
            "--repo" => repo = Some(val()?),
            "--revision" => rev = Some(val()?),
            "--out" => out = Some(PathBuf::from(val()?)),
            "--range-bytes" => opts.max_range_bytes = val()?.parse()?,
            "--retry-ms" => retry_ms = val()?.parse()?,
            "--model-id" => opts.model_id = Some(val()?),
            "--resume" => opts.resume = true,
            "--overwrite" => opts.overwrite = true,
            "--quiet" => opts.progress = ProgressMode::Quiet,
            "--allow-unverified" => opts.allow_unverified = true,
            other => return Err(format!("unknown argument {other}").into()),
        }
    }
    let out = out.ok_or("--out is required")?;
    let source: Box<dyn Source> = match (dir, url) {
        (Some(d), None) => Box::new(LocalSource::new(&d)?),
        (None, Some(u)) => Box::new(HttpSource::new(HttpConfig {
            base_url: u,
            repo: repo.ok_or("--repo is required with --url")?,
            revision: rev.unwrap_or_else(|| "main".into()),
            retry_base_delay: std::time::Duration::from_millis(retry_ms),
            ..HttpConfig::default()
        })?),
        _ => return Err("give exactly one of --dir and --url".into()),
    };
    let r = mference_install::install(source.as_ref(), &out, &opts)?;
    eprintln!(
        "fetched {} ranges ({} bytes), reused {}; {} source bytes read only to be hashed; {} files \
         verified, {} not",
        r.ranges_fetched,
        r.fetched_bytes,
        r.ranges_reused,
        r.hashed_only_bytes,
        r.verified_files.len(),
        r.unverified_files.len()
    );
    Ok(())
}
