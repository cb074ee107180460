//! The files under `deploy/` stay in step with the code: every Grafana query names only metric
//! families this server registers, the Dockerfile builds binaries the workspace has, and the
//! systemd units pass only flags the binaries accept.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use pegaflow_tests::harness::*;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("workspace root")
        .to_path_buf()
}

fn read(rel: &str) -> String {
    std::fs::read_to_string(root().join(rel)).unwrap_or_else(|e| panic!("{rel}: {e}"))
}

/// Every `expr` string anywhere in the dashboard.
fn exprs(v: &serde_json::Value, out: &mut Vec<String>) {
    match v {
        serde_json::Value::Object(m) => {
            for (k, v) in m {
                match (k.as_str(), v) {
                    ("expr", serde_json::Value::String(s)) => out.push(s.clone()),
                    _ => exprs(v, out),
                }
            }
        }
        serde_json::Value::Array(a) => a.iter().for_each(|v| exprs(v, out)),
        _ => {}
    }
}

/// The `pegaflow_*` identifiers of a PromQL expression.
fn metric_names(expr: &str) -> Vec<String> {
    let mut names = Vec::new();
    let mut cur = String::new();
    for ch in expr.chars().chain(std::iter::once(' ')) {
        if ch.is_ascii_alphanumeric() || ch == '_' || ch == ':' {
            cur.push(ch);
        } else {
            if cur.starts_with("pegaflow_") {
                names.push(std::mem::take(&mut cur));
            }
            cur.clear();
        }
    }
    names
}

/// A histogram's series name back to its family name.
fn family(name: &str) -> &str {
    ["_bucket", "_sum", "_count"]
        .iter()
        .find_map(|s| name.strip_suffix(s))
        .unwrap_or(name)
}

/// Families registered only when their part is configured (a directory, an ssd tier), or
/// vectors with no sample until their first labelled observation. Each must still appear as a
/// literal in the module that registers it.
const LAZY: &[(&str, &str)] = &[
    ("pegaflow_directory_up", "pegaflow-runtime/src/cluster.rs"),
    (
        "pegaflow_directory_pending_hashes",
        "pegaflow-runtime/src/cluster.rs",
    ),
    (
        "pegaflow_directory_resyncs_total",
        "pegaflow-runtime/src/cluster.rs",
    ),
    ("pegaflow_ssd_write_bytes_total", "tiers/ssd/src/metrics.rs"),
    (
        "pegaflow_ssd_prefetch_bytes_total",
        "tiers/ssd/src/metrics.rs",
    ),
    ("pegaflow_ssd_used_bytes", "tiers/ssd/src/metrics.rs"),
    ("pegaflow_ssd_capacity_bytes", "tiers/ssd/src/metrics.rs"),
    // Vectors labelled per tier / direction / listener: empty on a bare DRAM-only server.
    (
        "pegaflow_tier_used_bytes",
        "pegaflow-runtime/src/metrics.rs",
    ),
    (
        "pegaflow_transfer_failures_total",
        "pegaflow-runtime/src/metrics.rs",
    ),
    (
        "pegaflow_connections_refused_total",
        "pegaflow-runtime/src/metrics.rs",
    ),
];

#[tokio::test]
async fn dashboard_queries_name_registered_metrics() {
    let srv = TestServer::start(ServerOptions::default()).await;
    // One RPC so the per-method vectors carry a sample.
    let mut c = srv.client().await;
    c.health().await.expect("health");
    let text = srv.handle.engine.metrics().render();
    let mut registered = BTreeSet::new();
    for line in text.lines() {
        let name = match line.strip_prefix("# TYPE ") {
            Some(rest) => rest.split_whitespace().next(),
            None if !line.starts_with('#') => line.split(['{', ' ']).next(),
            None => None,
        };
        if let Some(n) = name.filter(|n| !n.is_empty()) {
            registered.insert(family(n).to_string());
        }
    }
    srv.shutdown().await;

    let dash: serde_json::Value =
        serde_json::from_str(&read("deploy/grafana-dashboard.json")).expect("dashboard is JSON");
    assert!(
        dash["schemaVersion"].as_u64().unwrap_or(0) >= 36,
        "schemaVersion"
    );
    assert!(
        dash["templating"]["list"]
            .as_array()
            .expect("templating")
            .iter()
            .any(|v| v["type"] == "datasource" && v["query"] == "prometheus"),
        "a Prometheus datasource variable"
    );
    let mut all = Vec::new();
    exprs(&dash, &mut all);
    assert!(all.len() >= 10, "{} queries", all.len());
    let mut unknown = Vec::new();
    for e in &all {
        let names = metric_names(e);
        assert!(!names.is_empty(), "query names no pegaflow metric: {e}");
        for n in names {
            let f = family(&n);
            if registered.contains(f) {
                continue;
            }
            match LAZY.iter().find(|(name, _)| *name == f) {
                Some((_, src)) => assert!(
                    read(src).contains(&format!("\"{f}\"")),
                    "{f} is allowed as lazily registered but {src} does not name it"
                ),
                None => unknown.push(format!("{f} (in {e})")),
            }
        }
    }
    assert!(
        unknown.is_empty(),
        "dashboard names unregistered metrics: {unknown:#?}\nregistered: {registered:?}"
    );
}

/// `[[bin]]` names of every Cargo.toml in the workspace (root and member crates).
fn workspace_bins() -> BTreeSet<String> {
    let root_toml: toml::Value = toml::from_str(&read("Cargo.toml")).expect("Cargo.toml");
    let mut files = vec!["Cargo.toml".to_string()];
    for m in root_toml["workspace"]["members"]
        .as_array()
        .expect("members")
    {
        files.push(format!("{}/Cargo.toml", m.as_str().expect("member")));
    }
    let mut bins = BTreeSet::new();
    for f in files {
        let t: toml::Value = toml::from_str(&read(&f)).unwrap_or_else(|e| panic!("{f}: {e}"));
        for b in t
            .get("bin")
            .and_then(|b| b.as_array())
            .into_iter()
            .flatten()
        {
            bins.insert(b["name"].as_str().expect("bin name").to_string());
        }
    }
    bins
}

#[test]
fn dockerfile_builds_workspace_binaries() {
    let bins = workspace_bins();
    let docker = read("deploy/Dockerfile");
    let build = docker
        .lines()
        .find(|l| l.contains("cargo build") && !l.trim_start().starts_with('#'))
        .expect("a cargo build line");
    let targets: Vec<&str> = build
        .split_whitespace()
        .collect::<Vec<_>>()
        .windows(2)
        .filter(|w| w[0] == "--bin")
        .map(|w| w[1])
        .collect();
    assert!(targets.contains(&"pegaflow-server"), "{build}");
    assert!(targets.contains(&"pegaflow-metaserver"), "{build}");
    for t in targets {
        assert!(
            bins.contains(t),
            "Dockerfile builds {t}; workspace bins: {bins:?}"
        );
        assert!(
            docker.contains(&format!("/{t}")),
            "the image does not copy {t}"
        );
    }
    assert!(docker.contains("EXPOSE 50055 9091"));
    assert!(docker.contains("0.0.0.0:50055"));
}

/// The `ExecStart=` line of a unit, continuation lines joined, and the binary it runs.
fn exec_start(unit: &str) -> (String, Vec<String>) {
    let text = read(unit);
    let mut joined = String::new();
    let mut inside = false;
    for line in text.lines() {
        let l = line.trim();
        if l.starts_with("ExecStart=") {
            inside = true;
        }
        if inside {
            let (body, cont) = match l.strip_suffix('\\') {
                Some(b) => (b, true),
                None => (l, false),
            };
            joined.push_str(body.trim_start_matches("ExecStart="));
            joined.push(' ');
            if !cont {
                break;
            }
        }
    }
    let mut words = joined.split_whitespace().map(str::to_string);
    let bin = words
        .next()
        .unwrap_or_else(|| panic!("{unit}: no ExecStart"));
    let name = bin.rsplit('/').next().expect("bin name").to_string();
    let flags = words
        .filter(|w| w.starts_with("--"))
        .map(|w| w.split('=').next().expect("flag").to_string())
        .collect();
    (name, flags)
}

#[test]
fn systemd_units_pass_accepted_flags() {
    let bins = workspace_bins();
    for unit in [
        "deploy/pegaflow-server.service",
        "deploy/pegaflow-metaserver.service",
    ] {
        let (bin, flags) = exec_start(unit);
        assert!(
            bins.contains(&bin),
            "{unit} runs {bin}; workspace bins: {bins:?}"
        );
        assert!(!flags.is_empty(), "{unit}: no flags");
        let exe = root().join("target/debug").join(&bin);
        if !exe.exists() {
            pegaflow_tests::skip_part!("{unit}: {} not built", exe.display());
            continue;
        }
        let out = std::process::Command::new(&exe)
            .arg("--help")
            .output()
            .expect("run --help");
        assert!(out.status.success(), "{bin} --help failed");
        let help = String::from_utf8_lossy(&out.stdout);
        for f in flags {
            let accepted = help
                .split(|c: char| c.is_whitespace() || c == ',' || c == '[' || c == '=')
                .any(|w| w == f);
            assert!(accepted, "{unit}: {bin} --help does not list {f}");
        }
    }
}
