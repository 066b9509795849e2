//! Crash safety: kill -9 at random points and resume; corrupt a journaled range; a second
//! installer is refused; a killed installer's lock file is never "busy" and never outlives the
//! install; a fresh install over a saved partial is refused, verify names it, discard clears it.

mod common;
use mference_install::journal::Journal;
use mference_install::{InstallError, InstallOptions, OutPaths};
use rand::{RngExt, SeedableRng};
use std::collections::{BTreeMap, HashSet};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const RANGE: u64 = 1 << 20;

fn opts() -> InstallOptions {
    common::tiny_opts(RANGE)
}

/// Range start offset → range id, from the same plan the installer builds.
fn range_ids(model: &str) -> BTreeMap<u64, String> {
    let p = common::plan_of(model, RANGE);
    assert_eq!(p.shard_files.len(), 1);
    p.ranges.iter().map(|r| (r.start, r.id.clone())).collect()
}

fn child(base: &str, out: &std::path::Path, resume: bool) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_gturbo-install"));
    c.args([
        "--url",
        base,
        "--repo",
        common::REPO,
        "--revision",
        common::REV,
        "--range-bytes",
        &RANGE.to_string(),
    ])
    .args(["--retry-ms", "5", "--model-id", "tiny", "--quiet", "--out"])
    .arg(out)
    .stdout(Stdio::null())
    .stderr(Stdio::piped());
    if resume {
        c.arg("--resume");
    }
    c
}

fn journaled(paths: &OutPaths) -> HashSet<String> {
    Journal::load(&paths.journal)
        .map(|j| j.completed_ranges.into_iter().map(|c| c.id).collect())
        .unwrap_or_default()
}

#[test]
fn kill_dash_nine_at_random_points_then_resume_gives_an_identical_install() {
    let tmp = tempfile::tempdir().unwrap();
    // The weights alone: each of the many runs would otherwise read and parse the tokenizer.
    let src = common::weights_only("gemma4-tiny", tmp.path());
    let reference = common::local_digest_of(&src, tmp.path(), &opts());
    let ids = range_ids("gemma4-tiny");
    let srv = common::serve_dir(&src);
    srv.throttle_ms
        .store(3, std::sync::atomic::Ordering::Relaxed);
    // An uninterrupted run's duration sets the scale of the kill points.
    let probe = tmp.path().join("probe.gturbo");
    let t0 = Instant::now();
    assert!(child(&srv.base, &probe, false).status().unwrap().success());
    let full = t0.elapsed();
    // Time from spawn to the first data range: kill points are spread over the copy phase
    // (and a little before it), where a kill can land mid-range.
    let first_data = srv
        .log
        .lock()
        .unwrap()
        .iter()
        .find(|l| l.status == 206 && l.range.is_some_and(|r| ids.contains_key(&r.0)))
        .unwrap()
        .at;
    let startup = first_data.duration_since(t0).as_millis() as u64;
    let copy_ms = full.as_millis() as u64 - startup;
    srv.log.lock().unwrap().clear();

    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(20);
    let (lo, hi) = (
        startup.saturating_sub(20).max(5),
        startup + (copy_ms / 12).max(20),
    );
    // A loaded machine can finish an install in fewer kills than wanted (each resumed run
    // copies more than the probe predicted); then a fresh install starts, until enough kills.
    let (mut kills, mut mid_range, mut installs) = (0, false, 0);
    while kills < 20 {
        assert!(installs < 8, "only {kills} kills over {installs} installs");
        let out = tmp.path().join(format!("crash{installs}.gturbo"));
        installs += 1;
        let (k, fetched, n) = kill_until_installed(&srv, &out, &ids, &mut rng, lo..hi, 24 - kills);
        kills += k;
        mid_range |= fetched > ids.len();
        let paths = OutPaths::new(&out).unwrap();
        assert_eq!(common::tree_digest(&out), reference);
        assert!(!paths.journal.exists() && !paths.partial.exists());
        // Each kill can waste at most the one range in flight (fsynced but not yet journaled).
        assert!(
            fetched <= ids.len() + k,
            "fetched {fetched} ranges for {} with {k} kills",
            ids.len()
        );
        eprintln!(
            "install {installs}: {k} kills over {n} runs; {fetched} range fetches for {} ranges",
            ids.len()
        );
    }
    assert!(
        mid_range,
        "no kill landed inside a range: the test did not exercise resume"
    );
}

/// Starts an install into `out`, SIGKILLs it after a random delay from `delays`, resumes, up
/// to `max_kills` times, then lets the last run finish. Checks that no run fetched a range
/// journaled when it started. Returns (kills, range fetches, runs).
fn kill_until_installed(
    srv: &common::server::Server,
    out: &std::path::Path,
    ids: &BTreeMap<u64, String>,
    rng: &mut rand_chacha::ChaCha8Rng,
    delays: std::ops::Range<u64>,
    max_kills: usize,
) -> (usize, usize, usize) {
    let paths = OutPaths::new(out).unwrap();
    let (mut kills, mut fetched_total, mut runs) = (0, 0usize, 0);
    loop {
        let last = kills >= max_kills;
        let before = journaled(&paths);
        let log_start = srv.log.lock().unwrap().len();
        let mut c = child(&srv.base, out, runs > 0).spawn().unwrap();
        runs += 1;
        let delay = Duration::from_millis(rng.random_range(delays.clone()));
        if last {
            c.wait().unwrap();
        } else {
            std::thread::sleep(delay);
        }
        let finished = c.try_wait().unwrap().is_some();
        if !finished {
            c.kill().unwrap(); // SIGKILL
            kills += 1;
        }
        let status = c.wait().unwrap();
        // This run wrote only ranges that were not journaled when it started: it reads the
        // journaled ones of a shard it has not verified again, once each, to hash them (their
        // destinations stay as they are: the final tree digest below checks that).
        let log = srv.log.lock().unwrap()[log_start..].to_vec();
        let mut reread = HashSet::new();
        for l in log
            .iter()
            .filter(|l| l.status == 206 && l.path.ends_with(".safetensors"))
        {
            if let Some(id) = l.range.and_then(|(a, _)| ids.get(&a)) {
                if before.contains(id) {
                    assert!(reread.insert(id), "run {runs} read journaled {id} twice");
                } else {
                    fetched_total += 1;
                }
            }
        }
        if finished {
            assert!(status.success(), "run {runs} failed");
            return (kills, fetched_total, runs);
        }
    }
}

#[test]
fn a_corrupted_journaled_range_is_detected_and_fetched_again() {
    let tmp = tempfile::tempdir().unwrap();
    let srv = common::serve("gemma4-tiny");
    let out = tmp.path().join("c.gturbo");
    let paths = OutPaths::new(&out).unwrap();
    common::interrupted_install(&srv, &out, &opts(), 5);
    let j = Journal::load(&paths.journal).unwrap();
    assert_eq!(j.completed_ranges.len(), 5);

    // Flip one byte inside the destination of the third journaled range.
    let p = common::plan_of("gemma4-tiny", RANGE);
    let victim = &j.completed_ranges[2].id;
    let r = p.ranges.iter().find(|r| &r.id == victim).unwrap();
    let c = p.copies[r.copies.clone()][0];
    let file = paths.partial.join(&p.dest_files[c.dest].0);
    let mut bytes = std::fs::read(&file).unwrap();
    bytes[(c.dst + c.len / 2) as usize] ^= 0x5a;
    std::fs::write(&file, bytes).unwrap();

    let log_start = srv.log.lock().unwrap().len();
    let rep = common::install_from(
        &srv,
        &out,
        &InstallOptions {
            resume: true,
            ..opts()
        },
    )
    .unwrap();
    assert_eq!(rep.ranges_reused, 4);
    assert_eq!(rep.ranges_fetched, p.ranges.len() - 4);
    let refetched = srv.log.lock().unwrap()[log_start..]
        .iter()
        .any(|l| l.status == 206 && l.range.map(|x| x.0) == Some(r.start));
    assert!(refetched, "the corrupted range was not fetched again");
    common::assert_same_as_local(&out, "gemma4-tiny", &opts());
}

#[test]
fn a_second_installer_is_refused_as_busy_and_touches_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("b.gturbo");
    let paths = OutPaths::new(&out).unwrap();
    let held = mference_install::lock::InstallLock::acquire(&paths).unwrap();
    let o = Command::new(env!("CARGO_BIN_EXE_gturbo-install"))
        .arg("--dir")
        .arg(common::asset("gemma4-tiny"))
        .arg("--out")
        .arg(&out)
        .output()
        .unwrap();
    assert!(!o.status.success());
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("install busy"),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(!out.exists() && !paths.partial.exists() && !paths.journal.exists());
    let err =
        mference_install::install_local(&common::asset("gemma4-tiny"), &out, &opts()).unwrap_err();
    assert!(matches!(err, InstallError::Busy { .. }));
    assert!(
        paths.lock.exists(),
        "a refused installer removed the held lock"
    );
    // `inspect` sees a running install (not an interrupted one) through the held lock.
    assert!(mference_install::lock::held_elsewhere(&paths));
    // Released, the lock file goes, and the next one takes a new one.
    drop(held);
    assert!(!mference_install::lock::held_elsewhere(&paths));
    assert!(
        !paths.lock.exists(),
        "the released lock file was left behind"
    );
    let again = mference_install::lock::InstallLock::acquire(&paths).unwrap();
    assert!(paths.lock.exists());
    drop(again);
}

#[test]
fn a_lock_file_left_by_a_killed_installer_is_never_busy_and_never_outlives_the_install() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("s.gturbo");
    let paths = OutPaths::new(&out).unwrap();
    let kill_leftover = || std::fs::write(&paths.lock, b"").unwrap();
    let leftovers = || common::listing(tmp.path());

    kill_leftover();
    assert!(mference_install::state::discard(&out).unwrap());
    assert_eq!(leftovers(), Vec::<String>::new(), "discard left files");

    // A preflight failure (free disk) reports itself, not the lock, and leaves nothing.
    kill_leftover();
    let o = InstallOptions {
        disk_reserve_bytes: Some(u64::MAX / 4),
        ..opts()
    };
    let err = mference_install::install_local(&common::asset("gemma4-tiny"), &out, &o).unwrap_err();
    assert!(matches!(err, InstallError::DiskFull { .. }), "{err}");
    assert!(!err.to_string().contains("lock"), "{err}");
    assert_eq!(
        leftovers(),
        Vec::<String>::new(),
        "a failed install left files"
    );

    kill_leftover();
    let resume = InstallOptions {
        resume: true,
        ..opts()
    };
    mference_install::install_local(&common::asset("gemma4-tiny"), &out, &resume).unwrap();
    assert_eq!(leftovers(), ["s.gturbo"]);
    assert!(!mference_install::state::discard(&out).unwrap());
    assert_eq!(leftovers(), ["s.gturbo"]);
}

#[test]
fn a_fresh_install_over_a_saved_partial_refuses_and_discard_clears_it() {
    let tmp = tempfile::tempdir().unwrap();
    let srv = common::serve("qwen3_6-tiny");
    let out = tmp.path().join("q.gturbo");
    let paths = OutPaths::new(&out).unwrap();
    common::interrupted_install(&srv, &out, &opts(), 1);
    assert!(
        !paths.lock.exists(),
        "the failed install left its lock file next to the saved partial"
    );
    let before = common::tree_digest(&paths.partial);
    let err = common::install_from(&srv, &out, &opts()).unwrap_err();
    assert!(err.to_string().contains("resume or discard"), "{err}");
    assert_eq!(
        common::tree_digest(&paths.partial),
        before,
        "the refused install changed the partial"
    );
    let insp = mference_install::state::inspect(&out).unwrap();
    assert!(insp.partial && insp.journal.as_ref().unwrap().completed_ranges.len() == 1);
    // verify names the interrupted install and what to run, for `<out>` and `<out>.partial`.
    // The journal recorded the mirror's base URL, so the hint can name it.
    let resume = format!(
        "mference install --repo {} --revision {} --base-url {} --output {} --resume",
        common::REPO,
        common::REV,
        srv.base,
        paths.out.display()
    );
    let discard = format!("mference discard {}", paths.out.display());
    assert!(
        insp.partial_hint
            .as_ref()
            .is_some_and(|h| h.contains(&resume) && h.contains(&discard)),
        "{:?}",
        insp.partial_hint
    );
    for p in [&out, &paths.partial] {
        let err = mference_install::state::verify(p).unwrap_err();
        let msg = err.to_string();
        assert!(matches!(err, InstallError::PartialInstall { .. }), "{msg}");
        assert!(
            msg.contains("interrupted") && msg.contains(&resume) && msg.contains(&discard),
            "{msg}"
        );
    }
    assert!(mference_install::state::discard(&out).unwrap());
    assert_eq!(
        std::fs::read_dir(tmp.path()).unwrap().count(),
        0,
        "discard left files next to {}",
        out.display()
    );
    common::install_from(&srv, &out, &opts()).unwrap();
}
