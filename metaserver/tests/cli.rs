//! The command line of `pegaflow-metaserver`: `--help` lists PegaFlow's flags and ours, and
//! a bad value exits with status 2 and a message naming the flag.

mod common;

use std::process::Command;
use std::time::Duration;

fn run(args: &[&str]) -> (Option<i32>, String) {
    run_env(args, &[])
}

fn run_env(args: &[&str], env: &[(&str, &str)]) -> (Option<i32>, String) {
    let mut cmd = Command::new(common::our_binary());
    cmd.args(args)
        .env_remove("PEGAFLOW_METASERVER_MIN_RECLAIMABLE_OWNER_COUNT")
        .env_remove("PEGAFLOW_METASERVER_ENABLE_DECODE_BACKUP");
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().expect("run pegaflow-metaserver");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.code(), text)
}

#[test]
fn help_lists_every_flag_with_its_default() {
    let (code, text) = run(&["--help"]);
    assert_eq!(code, Some(0), "{text}");
    for flag in [
        "--addr",
        "--http-addr",
        "--log-level",
        "--node-stale-secs",
        "--ttl-minutes",
        "--sweep-interval-secs",
        "--min-reclaimable-owner-count",
        "--enable-decode-backup",
        "--backup-target-delay-secs",
        "--redis",
        "--redis-key-prefix",
        "--redis-timeout-ms",
        "--max-nodes",
        "--max-blocks-per-node",
        "--max-store-bytes",
    ] {
        assert!(text.contains(flag), "--help does not list {flag}:\n{text}");
    }
    for default in [
        "[default: 127.0.0.1:50056]",
        "[default: 0.0.0.0:9092]",
        "[default: info]",
        "[default: 30]",
        "[default: 120]",
        "[default: 600]",
        "[default: 3]",
        "PEGAFLOW_METASERVER_MIN_RECLAIMABLE_OWNER_COUNT",
    ] {
        assert!(text.contains(default), "--help lacks {default}:\n{text}");
    }
    let (code, text) = run(&["--version"]);
    assert_eq!(code, Some(0), "{text}");
    assert!(text.starts_with("pegaflow-metaserver "), "{text}");
}

#[test]
fn bad_values_exit_2_with_a_message() {
    let cases: &[(&[&str], &str)] = &[
        (&["--log-level", "bogus"], "--log-level"),
        (
            &["--ttl-minutes", "0"],
            "--ttl-minutes must be greater than 0",
        ),
        (
            &["--ttl-minutes", "1", "--node-stale-secs", "61"],
            "--ttl-minutes (1) must be >= --node-stale-secs (61)",
        ),
        (&["--sweep-interval-secs", "0"], "--sweep-interval-secs"),
        (&["--node-stale-secs", "0"], "--node-stale-secs"),
        (&["--min-reclaimable-owner-count", "1"], "at least 2"),
        (&["--enable-decode-backup"], "decode backup"),
        (&["--backup-target-delay-secs", "180"], "decode backup"),
        (&["--addr", "nonsense"], "--addr"),
        (&["--ttl-minutes", "-1"], "-1"),
        (&["--redis-key-prefix", "x:"], "--redis"),
        (&["--no-such-flag"], "--no-such-flag"),
        (&["--max-nodes", "0"], "--max-nodes must be greater than 0"),
        (
            &["--max-blocks-per-node", "0"],
            "--max-blocks-per-node must be greater than 0",
        ),
        (&["--max-store-bytes", "512KiB"], "at least 1 MiB"),
        (&["--max-store-bytes", "lots"], "--max-store-bytes"),
    ];
    for (args, want) in cases {
        let (code, text) = run(args);
        assert_eq!(code, Some(2), "{args:?} should exit 2:\n{text}");
        assert!(
            text.contains(want),
            "{args:?}: message lacks {want:?}:\n{text}"
        );
    }
    let (code, text) = run_env(&[], &[("PEGAFLOW_METASERVER_ENABLE_DECODE_BACKUP", "true")]);
    assert_eq!(code, Some(2), "{text}");
    assert!(text.contains("decode backup"), "{text}");
    let (code, text) = run_env(
        &[],
        &[("PEGAFLOW_METASERVER_MIN_RECLAIMABLE_OWNER_COUNT", "1")],
    );
    assert_eq!(code, Some(2), "the environment variable is read:\n{text}");
}

#[test]
fn a_port_in_use_fails_to_start_with_status_1() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap().to_string();
    let http = format!("127.0.0.1:{}", common::free_port());
    let (code, text) = run(&["--addr", &addr, "--http-addr", &http]);
    assert_eq!(code, Some(1), "{text}");
    assert!(text.contains("cannot bind the gRPC address"), "{text}");
}

#[test]
fn sigterm_and_sigint_stop_it_cleanly() {
    let mut s = common::Server::start(&common::our_binary(), &[]);
    let status = s.terminate(Duration::from_secs(10));
    assert_eq!(status.code(), Some(0), "{}", s.log_text());
    assert!(s.log_text().contains("SIGTERM"), "{}", s.log_text());
    let mut s = common::Server::start(&common::our_binary(), &[]);
    let status = s.signal(nix::sys::signal::Signal::SIGINT, Duration::from_secs(10));
    assert_eq!(status.code(), Some(0), "{}", s.log_text());
    assert!(s.log_text().contains("SIGINT"), "{}", s.log_text());
}
