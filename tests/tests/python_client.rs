//! Runs the published-client conformance suite (`tests/python`, pytest against
//! `pegaflow-llm-cu13==0.25.1`) from cargo.
//!
//! Ignored by default: it needs the repo's `.venv` (`scripts/python-venv.sh`) and a built
//! server binary (`cargo build --bin pegaflow-server`, or `PEGAFLOW_SERVER_BIN`), and takes
//! about a minute. Run it with
//! `cargo test -p pegaflow-tests --test python_client -- --ignored --nocapture`.
//! Extra pytest arguments can be passed in `PEGAFLOW_PYTEST_ARGS` (whitespace separated).

use std::path::PathBuf;
use std::process::Command;

fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("tests/ has a parent")
        .to_path_buf()
}

#[test]
#[ignore = "needs .venv (scripts/python-venv.sh) and target/debug/pegaflow-server; ~1 min"]
fn published_python_client_conformance_suite() {
    let root = repo_root();
    let venv_python = root.join(".venv/bin/python");
    assert!(
        venv_python.is_file(),
        "no virtual environment at {}: run scripts/python-venv.sh",
        venv_python.display()
    );
    let bin = std::env::var_os("PEGAFLOW_SERVER_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| root.join("target/debug/pegaflow-server"));
    assert!(
        bin.is_file(),
        "no server binary at {}: run `cargo build --bin pegaflow-server` or set PEGAFLOW_SERVER_BIN",
        bin.display()
    );
    let extra = std::env::var("PEGAFLOW_PYTEST_ARGS").unwrap_or_default();
    let status = Command::new(root.join("tests/python/run.sh"))
        .args(extra.split_whitespace())
        .env("PEGAFLOW_SERVER_BIN", &bin)
        .status()
        .expect("cannot run tests/python/run.sh");
    assert!(
        status.success(),
        "the Python conformance suite failed: {status}"
    );
}
