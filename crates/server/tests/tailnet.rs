//! `--bind tailnet` runs `tailscale ip -4` and accepts exactly one 100.64.0.0/10 address. A fake
//! `tailscale` on PATH plays each case (this binary has one test, so changing PATH is safe).

use std::os::unix::fs::PermissionsExt;

use mference_server::{BindMode, ServerError};

#[test]
fn tailnet_bind_takes_exactly_one_tailnet_address() {
    let dir = tempfile::tempdir().unwrap();
    let fake = dir.path().join("tailscale");
    let path = std::env::var("PATH").unwrap_or_default();
    // This binary has a single test, so no other thread reads the environment meanwhile.
    std::env::set_var("PATH", format!("{}:{path}", dir.path().display()));
    let play = |script: &str| {
        std::fs::write(
            &fake,
            format!("#!/bin/sh\n[ \"$1 $2\" = \"ip -4\" ] || exit 9\n{script}\n"),
        )
        .unwrap();
        std::fs::set_permissions(&fake, std::fs::Permissions::from_mode(0o755)).unwrap();
        BindMode::Tailnet.resolve()
    };
    assert_eq!(
        play("echo 100.101.7.9").unwrap(),
        "100.101.7.9".parse::<std::net::IpAddr>().unwrap()
    );
    for bad in [
        "echo 192.168.1.20",
        "echo 100.128.0.1",
        "printf '100.101.7.9\\n100.101.7.10\\n'",
        "true",
        "echo 'not logged in' >&2; exit 1",
    ] {
        match play(bad) {
            Err(ServerError::Tailnet(_)) => {}
            other => panic!("{bad}: {other:?}"),
        }
    }
    std::fs::remove_file(&fake).unwrap();
    std::env::set_var("PATH", "/nonexistent");
    assert!(matches!(
        BindMode::Tailnet.resolve(),
        Err(ServerError::Tailnet(_))
    ));
    std::env::set_var("PATH", path);
}
