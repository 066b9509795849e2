//! Remote installs against a loopback server: byte ranges only, 206 + Content-Range
//! checked, retries on transient faults, redirects with Range kept, token only on demand.

mod common;
use common::server::{checkpoint_files, Fault, Server};
use mference_install::InstallOptions;

fn opts() -> InstallOptions {
    common::tiny_opts(4 << 20)
}

#[test]
fn remote_install_equals_local_install_and_uses_only_ranges() {
    let tmp = tempfile::tempdir().unwrap();
    let srv = common::serve("gemma4-tiny");
    let out = tmp.path().join("remote.gturbo");
    let r = common::install_from(&srv, &out, &opts()).unwrap();
    common::assert_same_as_local(&out, "gemma4-tiny", &opts());
    let log = srv.log.lock().unwrap().clone();
    assert!(
        log.iter().all(|l| l.range.is_some() || l.status == 404),
        "every served request was ranged"
    );
    let data = srv.data_ranges();
    assert_eq!(data.len(), r.ranges_total);
    assert!(data.iter().all(|(a, b)| b - a < 4 << 20));
    // The receipt says that every source file was checked against its published digest.
    let receipt =
        mference_format::Receipt::parse(&std::fs::read(out.join("verified-install.json")).unwrap())
            .unwrap();
    assert!(
        receipt
            .source_bytes
            .as_deref()
            .is_some_and(|s| s.starts_with("verified")),
        "{receipt:?}"
    );
}

#[test]
fn transient_faults_are_retried_and_the_result_is_unchanged() {
    let tmp = tempfile::tempdir().unwrap();
    let srv = common::serve("gemma4-tiny");
    for f in [
        Fault::DropMidBody,
        Fault::WrongRange,
        Fault::Status5xx,
        Fault::SlowBody,
        Fault::DropMidBody,
    ] {
        srv.push_fault(f);
    }
    let out = tmp.path().join("remote.gturbo");
    common::install_from(&srv, &out, &opts()).unwrap();
    assert!(
        srv.faults.lock().unwrap().is_empty(),
        "all faults were exercised"
    );
    common::assert_same_as_local(&out, "gemma4-tiny", &opts());
}

#[test]
fn a_200_answer_to_a_ranged_request_is_an_error() {
    let tmp = tempfile::tempdir().unwrap();
    let srv = common::serve("gemma4-tiny");
    srv.push_fault(Fault::IgnoreRange);
    let err = common::install_from(&srv, &tmp.path().join("r.gturbo"), &opts()).unwrap_err();
    assert!(err.to_string().contains("200"), "{err}");
    // An HTTP error names the URL it asked for once (it was also repeated in the detail).
    assert_eq!(err.to_string().matches("http://").count(), 1, "{err}");
}

#[test]
fn redirects_keep_the_range_and_the_token_never_leaves_the_base_host() {
    let tmp = tempfile::tempdir().unwrap();
    // The file server is another host (127.0.0.2) and does not ask for authentication.
    let files = Server::start(
        "127.0.0.2:0",
        common::REPO,
        common::REV,
        checkpoint_files(&common::asset("qwen3_6-tiny")),
        None,
        None,
    );
    // Like the Hub, the front answers with a redirect that carries each file's SHA-256.
    let front = Server::start(
        "127.0.0.1:0",
        common::REPO,
        common::REV,
        checkpoint_files(&common::asset("qwen3_6-tiny")),
        None,
        Some(files.base.clone()),
    );
    let src = common::http_source(&front.base, Some("secret-token"));
    let out = tmp.path().join("q.gturbo");
    mference_install::install(&src, &out, &opts()).unwrap();
    assert!(
        files.log.lock().unwrap().iter().all(|l| !l.authorized),
        "token was sent to another host"
    );
    assert!(
        front.log.lock().unwrap().iter().all(|l| !l.authorized),
        "token sent without being asked"
    );
    assert!(
        files.log.lock().unwrap().iter().all(|l| l.range.is_some()),
        "Range was dropped on redirect"
    );
    mference_format::Install::open(&out, mference_format::VerifyPolicy::FullSha256).unwrap();
}

#[test]
fn the_token_is_sent_after_the_server_asks_for_it() {
    let tmp = tempfile::tempdir().unwrap();
    let srv = Server::start(
        "127.0.0.1:0",
        common::REPO,
        common::REV,
        checkpoint_files(&common::asset("gemma4-tiny")),
        Some("tok"),
        None,
    );
    let src = common::http_source(&srv.base, Some("tok"));
    mference_install::install(&src, &tmp.path().join("g.gturbo"), &opts()).unwrap();
    let log = srv.log.lock().unwrap();
    assert_eq!(log[0].status, 401, "first request goes without a token");
    assert!(log.iter().skip(1).all(|l| l.status != 401));
}

#[test]
fn a_wrong_index_pin_is_refused_before_writing() {
    let tmp = tempfile::tempdir().unwrap();
    let srv = common::serve("gemma4-tiny");
    let o = InstallOptions {
        pin: Some(mference_install::checkpoint::Pin {
            index_sha256: "00".repeat(32),
        }),
        ..opts()
    };
    let out = tmp.path().join("g.gturbo");
    let err = common::install_from(&srv, &out, &o).unwrap_err();
    assert!(
        matches!(err, mference_install::InstallError::PinMismatch { .. }),
        "{err}"
    );
    assert!(!out.exists() && !tmp.path().join("g.gturbo.partial").exists());
    assert!(srv.data_ranges().is_empty());
}

/// `err` reports an unreachable source (not an invalid checkpoint) and names the URL once.
fn assert_unreachable(err: mference_install::InstallError) {
    let msg = err.to_string();
    assert!(
        matches!(
            err,
            mference_install::InstallError::SourceUnreachable { .. }
        ),
        "{msg}"
    );
    assert_eq!(msg.matches("http://").count(), 1, "{msg}");
}

#[test]
fn a_server_that_goes_away_is_unreachable_and_its_url_is_named_once() {
    let tmp = tempfile::tempdir().unwrap();
    let srv = common::serve("gemma4-tiny");
    // Every attempt at the first data range finds the connection closed without an answer.
    for _ in 0..4 {
        srv.push_fault(Fault::Close);
    }
    assert_unreachable(
        common::install_from(&srv, &tmp.path().join("g.gturbo"), &opts()).unwrap_err(),
    );
}

#[test]
fn a_refused_connection_is_unreachable_and_its_url_is_named_once() {
    // A port nothing listens on: bind one, then close it.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let tmp = tempfile::tempdir().unwrap();
    let src = common::http_source(&format!("http://127.0.0.1:{port}"), None);
    assert_unreachable(
        mference_install::install(&src, &tmp.path().join("g.gturbo"), &opts()).unwrap_err(),
    );
}
