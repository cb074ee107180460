//! `pegaflow-server`'s command line, run as the binary: the flags its linked factories declare
//! (`--pool-size`, `--pool-shards` from the dram tier) are listed and applied exactly as in the
//! third-party binary (`examples/tests/pipelines.rs` checks `pegaflow-server-verify` against
//! the same expectation).

use std::process::Command;

use pegaflow_runtime::config::PipelineConfig;

fn run(args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_pegaflow-server"))
        .args(args)
        .output()
        .unwrap();
    assert!(out.status.success(), "{args:?}: {out:?}");
    String::from_utf8(out.stdout).unwrap()
}

#[test]
fn declared_flags_are_listed_and_applied() {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/examples/pipelines/default.toml"
    );
    let mut expected = PipelineConfig::from_toml(&std::fs::read_to_string(path).unwrap()).unwrap();
    expected.tiers[0]
        .settings
        .insert("capacity".into(), toml::Value::String("1gb".into()));
    assert_eq!(
        run(&["--print-config", "--pool-size", "1gb"]),
        expected.to_toml()
    );
    let help = run(&["--help"]);
    assert!(
        help.contains("--pool-size <SIZE>") && help.contains("Host-DRAM tier capacity"),
        "{help}"
    );
    assert!(
        help.contains("--pool-shards <N>") && help.contains("Sub-pools of the DRAM tier"),
        "{help}"
    );
    let out = Command::new(env!("CARGO_BIN_EXE_pegaflow-server"))
        .args(["--pool-shards", "0"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "{out:?}");
}

/// `--metaserver-addr` (declared by the linked `metaserver` directory) adds the `[directory]`
/// table; `--metaserver-queue-depth` sets its queue and needs a directory.
#[test]
fn metaserver_flags_configure_the_directory() {
    let text = run(&[
        "--print-config",
        "--metaserver-addr",
        "http://10.0.0.5:50056",
        "--metaserver-queue-depth",
        "1000",
    ]);
    let p = PipelineConfig::from_toml(&text).unwrap();
    let d = p.directory.expect("the flag adds [directory]");
    assert_eq!(d.kind, "metaserver");
    assert_eq!(
        d.settings.get("addr").and_then(|v| v.as_str()),
        Some("http://10.0.0.5:50056")
    );
    assert_eq!(d.queue_depth, 1000);
    let help = run(&["--help"]);
    assert!(help.contains("--metaserver-addr <URL>"), "{help}");
    let out = Command::new(env!("CARGO_BIN_EXE_pegaflow-server"))
        .args(["--metaserver-queue-depth", "10"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("has no directory"), "{err}");
}
