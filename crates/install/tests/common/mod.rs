//! Fixtures shared by the installer's integration tests: the bundled tiny checkpoints, the
//! loopback HTTP server serving them, installs (complete, interrupted, reference) and ways to
//! compare what they leave on disk. Each test file keeps only its scenarios.
#![allow(dead_code)]

pub mod server;

use mference_install::source::http::{HttpConfig, HttpSource};
use mference_install::source::local::LocalSource;
use mference_install::{
    checkpoint, plan, InstallError, InstallOptions, InstallReport, ProgressMode,
};
use server::{checkpoint_files, Fault, Server};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

pub const REPO: &str = "test-org/tiny";
pub const REV: &str = "0123456789abcdef0123456789abcdef01234567";

/// A bundled tiny checkpoint, `assets/models/<name>`.
pub fn asset(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../assets/models")
        .join(name)
}

/// No progress output, no free-disk reserve.
pub fn quiet() -> InstallOptions {
    InstallOptions {
        progress: ProgressMode::Quiet,
        disk_reserve_bytes: Some(0),
        ..InstallOptions::default()
    }
}

/// [`quiet`] with ranges of at most `range_bytes` and modelID "tiny": a local and a remote
/// install with these options write the same bytes.
pub fn tiny_opts(range_bytes: u64) -> InstallOptions {
    InstallOptions {
        max_range_bytes: range_bytes,
        model_id: Some("tiny".into()),
        ..quiet()
    }
}

/// The plan the installer builds for the bundled checkpoint `model`.
pub fn plan_of(model: &str, range_bytes: u64) -> plan::Plan {
    let ck = checkpoint::load(&LocalSource::new(&asset(model)).unwrap(), None).unwrap();
    plan::build(&ck, range_bytes).unwrap()
}

/// A loopback server (127.0.0.1) serving the bundled checkpoint `model` as [`REPO`]@[`REV`],
/// without authentication or redirects.
pub fn serve(model: &str) -> Server {
    serve_dir(&asset(model))
}

/// [`serve`] for the checkpoint directory `dir`.
pub fn serve_dir(dir: &Path) -> Server {
    Server::start("127.0.0.1:0", REPO, REV, checkpoint_files(dir), None, None)
}

/// A source for [`REPO`]@[`REV`] at `base`, retrying after 5 ms.
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

/// Install from `srv` (no token) into `out`.
pub fn install_from(
    srv: &Server,
    out: &Path,
    opts: &InstallOptions,
) -> Result<InstallReport, InstallError> {
    mference_install::install(&http_source(&srv.base, None), out, opts)
}

/// Install from `srv` into `out` and let a fatal fault (a 200 answer to a ranged request)
/// stop it after `ranges` data ranges: a saved partial install with `ranges` journaled.
pub fn interrupted_install(
    srv: &Server,
    out: &Path,
    opts: &InstallOptions,
    ranges: usize,
) -> InstallError {
    for _ in 0..ranges {
        srv.push_fault(Fault::Pass);
    }
    srv.push_fault(Fault::IgnoreRange);
    install_from(srv, out, opts).expect_err("the install survived a fatal fault")
}

/// [`tree_digest`] of a local install of the bundled checkpoint `model` made in `dir`.
pub fn local_digest(model: &str, dir: &Path, opts: &InstallOptions) -> BTreeMap<String, String> {
    local_digest_of(&asset(model), dir, opts)
}

/// [`tree_digest`] of a local install of the checkpoint directory `src` made in `dir`.
pub fn local_digest_of(src: &Path, dir: &Path, opts: &InstallOptions) -> BTreeMap<String, String> {
    let name = src.file_name().unwrap().to_string_lossy();
    let out = dir.join(format!("{name}-reference.gturbo"));
    mference_install::install_local(src, &out, opts).unwrap();
    tree_digest(&out)
}

/// The weights of the bundled checkpoint `model` without its tokenizer files (config, index and
/// shards linked into `dir/<model>-weights`): for tests of the copy itself, which then skip the
/// tokenizer's read and parse.
pub fn weights_only(model: &str, dir: &Path) -> PathBuf {
    let out = dir.join(format!("{model}-weights"));
    std::fs::create_dir_all(&out).unwrap();
    for (name, path) in checkpoint_files(&asset(model)) {
        if name == "config.json" || name.contains("safetensors") {
            std::os::unix::fs::symlink(path, out.join(name)).unwrap();
        }
    }
    out
}

/// Assert that the install at `out` holds exactly the bytes of a local install of the bundled
/// checkpoint `model` with `opts` (made next to `out`).
pub fn assert_same_as_local(out: &Path, model: &str, opts: &InstallOptions) {
    assert_same_as_local_dir(out, &asset(model), opts)
}

/// [`assert_same_as_local`] for the checkpoint directory `src`.
pub fn assert_same_as_local_dir(out: &Path, src: &Path, opts: &InstallOptions) {
    let reference = local_digest_of(src, out.parent().unwrap(), opts);
    assert_eq!(
        tree_digest(out),
        reference,
        "{} differs from a local install of {}",
        out.display(),
        src.display()
    );
}

/// Every file of an install, relative path → bytes' SHA-256 (receipt excluded: it has a
/// timestamp and the directory path).
pub fn tree_digest(dir: &Path) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
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

/// The names in `dir`, sorted.
pub fn listing(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}
