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
