#![allow(dead_code)]
use mference_install::{InstallOptions, ProgressMode};
use std::path::PathBuf;

pub fn asset(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../assets/models")
        .join(name)
}

pub fn quiet() -> InstallOptions {
    InstallOptions {
        progress: ProgressMode::Quiet,
        disk_reserve_bytes: 0,
        ..InstallOptions::default()
    }
}

pub mod server;

use mference_install::source::http::{HttpConfig, HttpSource};

pub const REPO: &str = "test-org/tiny";
pub const REV: &str = "0123456789abcdef0123456789abcdef01234567";

pub fn http_source(base: &str, token: Option<&str>) -> HttpSource {
    HttpSource::new(HttpConfig {
        base_url: base.to_string(),
        repo: REPO.into(),
        revision: REV.into(),
        token: token.map(str::to_string),
        retry_base_delay: std::time::Duration::from_millis(5),
        ..HttpConfig::default()
    })
    .unwrap()
}

/// Every file of an install, relative path → bytes' SHA-256 (receipt excluded: it has a
/// timestamp and the directory path).
pub fn tree_digest(dir: &std::path::Path) -> std::collections::BTreeMap<String, String> {
    let mut out = std::collections::BTreeMap::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                stack.push(p);
            } else {
                let rel = p.strip_prefix(dir).unwrap().to_string_lossy().into_owned();
                if rel != "verified-install.json" {
                    out.insert(rel, mference_format::hash::sha256_file(&p).unwrap().1);
                }
            }
        }
    }
    out
}
