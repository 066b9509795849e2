//! Source bytes checked against the digests the source publishes (issue 32 item 1): a mirror
//! that serves one flipped byte with the true headers is refused, naming the file and both
//! digests, whether the byte is in a shard or a tokenizer file; a resume reads the shard again
//! and checks it again; a clean mirror installs and its receipt says what each file was checked
//! against; a local Hugging Face cache snapshot is checked against its blob names.

mod common;
use common::server::digests_of;
use mference_install::journal::Journal;
use mference_install::{InstallError, InstallOptions, OutPaths};
use std::path::{Path, PathBuf};

const MODEL: &str = "gemma4-tiny";
const RANGE: u64 = 1 << 20;

fn opts() -> InstallOptions {
    common::tiny_opts(RANGE)
}

fn resume() -> InstallOptions {
    InstallOptions {
        resume: true,
        ..opts()
    }
}

fn receipt(out: &Path) -> mference_format::Receipt {
    mference_format::Receipt::parse(&std::fs::read(out.join("verified-install.json")).unwrap())
        .unwrap()
}

/// The served file `name` of the tiny checkpoint, as a path.
fn served(name: &str) -> PathBuf {
    common::server::checkpoint_files(&common::asset(MODEL))[name].clone()
}

/// Expect a digest mismatch for `file` whose true SHA-256 is `sha256`; returns the message.
fn mismatch(err: InstallError, file: &str, sha256: &str) -> String {
    let msg = err.to_string();
    match &err {
        InstallError::SourceDigestMismatch {
            file: f,
            expected,
            actual,
        } => {
            assert_eq!(f, file);
            assert_eq!(expected, &format!("sha256:{sha256} from X-Linked-Etag"));
            assert!(actual.len() == 64 && actual != sha256, "{actual}");
            assert!(
                msg.contains(sha256) && msg.contains(actual.as_str()),
                "{msg}"
            );
        }
        _ => panic!("not a digest mismatch: {err}"),
    }
    msg
}

#[test]
fn a_clean_mirror_installs_and_the_receipt_says_what_each_file_was_checked_against() {
    let tmp = tempfile::tempdir().unwrap();
    let srv = common::serve(MODEL);
    let out = tmp.path().join("clean.gturbo");
    let rep = common::install_from(&srv, &out, &opts()).unwrap();
    common::assert_same_as_local(&out, MODEL, &opts());
    assert!(
        rep.unverified_files.is_empty(),
        "{:?}",
        rep.unverified_files
    );
    let r = receipt(&out);
    assert!(r.source_bytes.as_deref().unwrap().starts_with("verified"));
    let files = &r.source_files;
    // Every file the server has that the install reads, each against its own digest.
    for name in [
        "config.json",
        "model.safetensors.index.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
    ] {
        let f = files
            .get(name)
            .unwrap_or_else(|| panic!("{name} not in {files:?}"));
        let (sha256, git) = digests_of(&served(name));
        assert_eq!(f.sha256, sha256, "{name}");
        let against = f.verified_against.as_deref().unwrap();
        let lfs = name == "model.safetensors" || name == "tokenizer.json";
        let want = match lfs {
            true => format!("sha256:{sha256} from X-Linked-Etag"),
            false => format!("git-blob-sha1:{git} from ETag"),
        };
        assert_eq!(against, want);
    }
    assert_eq!(files.len(), 6, "{files:?}");
    // `verify` rewrites the receipt and keeps what the source was checked against.
    mference_install::state::verify(&out).unwrap();
    assert_eq!(receipt(&out).source_files, r.source_files);
    assert_eq!(receipt(&out).source_bytes, r.source_bytes);
}

#[test]
fn a_flipped_byte_in_a_shard_is_refused_and_a_resume_checks_the_shard_again() {
    let tmp = tempfile::tempdir().unwrap();
    let src = common::weights_only(MODEL, tmp.path());
    let srv = common::serve_dir(&src);
    let shard = served("model.safetensors");
    let (sha256, _) = digests_of(&shard);
    let len = shard.metadata().unwrap().len();
    // A byte inside a tensor, far from the header.
    *srv.corrupt.lock().unwrap() = Some(("model.safetensors".into(), len / 2));
    let out = tmp.path().join("flip.gturbo");
    let paths = OutPaths::new(&out).unwrap();
    let err = common::install_from(&srv, &out, &opts()).unwrap_err();
    mismatch(err, "model.safetensors", &sha256);
    assert!(!out.exists());
    let j = Journal::load(&paths.journal).unwrap();
    assert!(
        j.completed_ranges.is_empty() && j.verified_source_files.is_empty(),
        "ranges of the refused shard stayed journaled: {j:?}"
    );
    // The mirror still serves the flipped byte: the resume is refused the same way.
    let err = common::install_from(&srv, &out, &resume()).unwrap_err();
    mismatch(err, "model.safetensors", &sha256);
    // Fixed, the resume installs exactly the checkpoint's bytes.
    *srv.corrupt.lock().unwrap() = None;
    common::install_from(&srv, &out, &resume()).unwrap();
    common::assert_same_as_local_dir(&out, &src, &opts());
}

#[test]
fn a_resume_reads_the_ranges_written_before_again_and_refuses_changed_ones() {
    let tmp = tempfile::tempdir().unwrap();
    let src = common::weights_only(MODEL, tmp.path());
    let srv = common::serve_dir(&src);
    let (sha256, _) = digests_of(&served("model.safetensors"));
    let out = tmp.path().join("r.gturbo");
    let paths = OutPaths::new(&out).unwrap();
    common::interrupted_install(&srv, &out, &opts(), 5);
    let j = Journal::load(&paths.journal).unwrap();
    assert_eq!(j.completed_ranges.len(), 5);
    // The mirror now serves a changed byte inside a range written by the first run.
    let p = common::plan_of(MODEL, RANGE);
    let first = p
        .ranges
        .iter()
        .find(|r| r.id == j.completed_ranges[0].id)
        .unwrap();
    *srv.corrupt.lock().unwrap() = Some(("model.safetensors".into(), first.start + 10));
    let err = common::install_from(&srv, &out, &resume()).unwrap_err();
    mismatch(err, "model.safetensors", &sha256);
    *srv.corrupt.lock().unwrap() = None;
    let rep = common::install_from(&srv, &out, &resume()).unwrap();
    assert_eq!(
        rep.ranges_fetched,
        p.ranges.len(),
        "the refused shard is fetched whole"
    );
    common::assert_same_as_local_dir(&out, &src, &opts());
}

#[test]
fn a_flipped_byte_in_the_tokenizer_is_refused_before_anything_is_written() {
    let tmp = tempfile::tempdir().unwrap();
    let srv = common::serve(MODEL);
    let (sha256, _) = digests_of(&served("tokenizer.json"));
    *srv.corrupt.lock().unwrap() = Some(("tokenizer.json".into(), 1000));
    let err = common::install_from(&srv, &tmp.path().join("t/o.gturbo"), &opts()).unwrap_err();
    mismatch(err, "tokenizer.json", &sha256);
    assert!(
        common::listing(tmp.path()).is_empty(),
        "the refused install left files"
    );
    assert!(srv.data_ranges().is_empty(), "weights were read");
}

#[test]
fn a_mirror_that_publishes_no_digests_is_refused_unless_unverified_installs_are_allowed() {
    let tmp = tempfile::tempdir().unwrap();
    let srv = common::serve(MODEL);
    srv.publish_digests
        .store(false, std::sync::atomic::Ordering::Relaxed);
    let out = tmp.path().join("u.gturbo");
    let err = common::install_from(&srv, &out, &opts()).unwrap_err();
    assert!(
        matches!(&err, InstallError::SourceDigestMissing { file } if file == "model.safetensors.index.json"),
        "{err}"
    );
    assert!(err.to_string().contains("--allow-unverified"), "{err}");
    let allowed = InstallOptions {
        allow_unverified: true,
        ..opts()
    };
    let rep = common::install_from(&srv, &out, &allowed).unwrap();
    assert_eq!(rep.unverified_files.len(), 6, "{:?}", rep.unverified_files);
    let r = receipt(&out);
    let statement = r.source_bytes.unwrap();
    assert!(
        statement.starts_with("0 of 6 source files verified")
            && statement.contains("tokenizer.json"),
        "{statement}"
    );
    assert!(r
        .source_files
        .values()
        .all(|f| f.verified_against.is_none()));
}

/// A Hugging Face cache entry for the tiny checkpoint in `root`: `blobs/<digest>` (a link to the
/// asset, or the bytes `edit` returns for `config.json`) and `snapshots/<rev>/<file>` →
/// `../../blobs/<digest>`; LFS-sized files by SHA-256, the others by git blob id. Returns the
/// snapshot directory.
fn hf_cache(root: &Path, config_bytes: Option<Vec<u8>>) -> PathBuf {
    let blobs = root.join("blobs");
    let snap = root.join("snapshots").join(common::REV);
    std::fs::create_dir_all(&blobs).unwrap();
    std::fs::create_dir_all(&snap).unwrap();
    for (name, path) in common::server::checkpoint_files(&common::asset(MODEL)) {
        if name == "README.md" {
            continue;
        }
        let (sha256, git) = digests_of(&path);
        let lfs = name.ends_with(".safetensors") || path.metadata().unwrap().len() >= 10 << 20;
        let blob = if lfs { sha256 } else { git };
        match (&config_bytes, name.as_str()) {
            (Some(b), "config.json") => std::fs::write(blobs.join(&blob), b).unwrap(),
            _ => std::os::unix::fs::symlink(&path, blobs.join(&blob)).unwrap(),
        }
        std::os::unix::fs::symlink(format!("../../blobs/{blob}"), snap.join(&name)).unwrap();
    }
    snap
}

#[test]
fn an_hf_cache_snapshot_is_checked_against_its_blob_names() {
    let tmp = tempfile::tempdir().unwrap();
    let snap = hf_cache(&tmp.path().join("clean"), None);
    let out = tmp.path().join("cache.gturbo");
    let rep = mference_install::install_local(&snap, &out, &opts()).unwrap();
    assert!(
        rep.unverified_files.is_empty(),
        "{:?}",
        rep.unverified_files
    );
    let r = receipt(&out);
    let against = r.source_files["model.safetensors"]
        .verified_against
        .clone()
        .unwrap();
    assert!(
        against.ends_with("from the HF cache blob name"),
        "{against}"
    );
    // A blob whose bytes are not those its name says (still valid JSON) is refused.
    let mut cfg = std::fs::read(served("config.json")).unwrap();
    cfg.push(b'\n');
    let snap = hf_cache(&tmp.path().join("bad"), Some(cfg));
    let err = mference_install::install_local(&snap, &tmp.path().join("bad.gturbo"), &opts())
        .unwrap_err();
    assert!(
        matches!(&err, InstallError::SourceDigestMismatch { file, .. } if file == "config.json"),
        "{err}"
    );
}

#[test]
fn a_plain_local_directory_installs_and_its_receipt_says_nothing_was_published() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("plain.gturbo");
    mference_install::install_local(&common::asset(MODEL), &out, &opts()).unwrap();
    let r = receipt(&out);
    assert!(
        r.source_bytes
            .unwrap()
            .starts_with("read from a local directory"),
        "{:?}",
        r.source_files
    );
    let (sha256, _) = digests_of(&served("model.safetensors"));
    assert_eq!(r.source_files["model.safetensors"].sha256, sha256);
}
