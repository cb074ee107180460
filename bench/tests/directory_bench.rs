//! Smoke test of `pegaflow-directory-bench --quick`: it runs every backend it can (the
//! MetaServer only where its binary is built), the backfill phase against its own
//! `redis-server`, exits 0, prints the table and writes the JSON. Skips (reported by
//! `pegaflow_test_skip::skip!`) where `redis-server` is not installed.

use std::process::Command;
use std::time::{Duration, Instant};

fn redis_server_installed() -> bool {
    std::env::var_os("PATH")
        .is_some_and(|p| std::env::split_paths(&p).any(|d| d.join("redis-server").is_file()))
}

#[test]
fn quick_run_prints_the_table() {
    if !redis_server_installed() {
        pegaflow_test_skip::skip!("redis-server is not installed");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("directory.json");
    let t = Instant::now();
    let out = Command::new(env!("CARGO_BIN_EXE_pegaflow-directory-bench"))
        .arg("--quick")
        .arg("--json")
        .arg(&json)
        .output()
        .expect("runs the bench");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "exit {}\nstdout:\n{stdout}\nstderr:\n{stderr}",
        out.status
    );
    assert!(
        stdout.contains("backend") && stdout.contains("inserts/s") && stdout.contains("p99 ms"),
        "no table header:\n{stdout}"
    );
    assert!(
        stdout.contains("backfill after FLUSHALL"),
        "no backfill line:\n{stdout}"
    );
    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let backends: Vec<&str> = report["results"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["backend"].as_str().unwrap())
        .collect();
    assert!(
        backends.contains(&"memory") && backends.contains(&"redis"),
        "{backends:?}\n{stdout}"
    );
    assert!(report["backfill"]["total_s"].as_f64().unwrap() > 0.0);
    assert!(
        t.elapsed() < Duration::from_secs(60),
        "the quick run took {:?}",
        t.elapsed()
    );
}
