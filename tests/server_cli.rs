//! `pegaflow-server`'s command line, run as the binary: the flags its linked factories declare
//! (`--pool-size`, `--pool-shards` from the dram tier) are listed and applied exactly as in the
//! third-party binary (`examples/tests/pipelines.rs` checks `pegaflow-server-verify` against
//! the same expectation). And the binary's accept loop when descriptors run out.

use std::process::Command;
use std::time::{Duration, Instant};

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

/// The CPU time (user + system) of process `pid`, in seconds (USER_HZ = 100 on Linux).
fn cpu_secs(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .unwrap()
        .1
        .split_whitespace()
        .collect();
    let ticks: u64 = fields[11].parse::<u64>().unwrap() + fields[12].parse::<u64>().unwrap();
    ticks as f64 / 100.0
}

/// `GET /health` over a fresh connection, `None` when it does not answer within 2 s.
fn health(addr: &str) -> Option<String> {
    use std::io::{Read, Write};
    let addr: std::net::SocketAddr = addr.parse().unwrap();
    let mut s = std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(2)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
    s.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .ok()?;
    let mut out = String::new();
    s.read_to_string(&mut out).ok()?;
    Some(out)
}

/// A flood beyond the open-file limit (256 here; `--max-connections` set above it, so the cap
/// does not refuse first): accepts fail with EMFILE and the server backs off instead of
/// spinning (its CPU time over 3 s stays far below the 3 s a spinning accept loop burns),
/// logs the burst once, and serves again as soon as the flood ends.
#[test]
fn accept_backs_off_when_descriptors_run_out() {
    use std::io::BufRead;
    use std::process::Stdio;
    let child = Command::new("sh")
        .arg("-c")
        .arg("ulimit -n 256 && exec \"$0\" \"$@\"")
        .arg(env!("CARGO_BIN_EXE_pegaflow-server"))
        .args([
            "--addr",
            "127.0.0.1:0",
            "--http-addr",
            "127.0.0.1:0",
            "--pool-size",
            "64mb",
            "--max-connections",
            "100000",
            "--log-level",
            "info",
        ])
        .env("NO_COLOR", "1")
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let mut child = KillOnDrop(child);
    let pid = child.0.id();
    let (tx, rx) = std::sync::mpsc::channel::<String>();
    let stdout = child.0.stdout.take().unwrap();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let mut log = Vec::new();
    let field = |line: &str, key: &str| -> Option<String> {
        line.split_whitespace()
            .find_map(|w| w.strip_prefix(key))
            .map(str::to_string)
    };
    let (grpc, http) = loop {
        let line = rx
            .recv_timeout(Duration::from_secs(30))
            .unwrap_or_else(|_| panic!("the server did not start:\n{}", log.join("\n")));
        log.push(line.clone());
        if line.contains("serving") {
            break (
                field(&line, "grpc_addr=").unwrap(),
                field(&line, "http_addr=").unwrap(),
            );
        }
    };
    assert!(health(&http).is_some_and(|r| r.starts_with("HTTP/1.1 200")));

    let mut flood = Vec::new();
    // 256 descriptors and a listen backlog of 128: ~240 accepted, the rest wait in the backlog.
    for _ in 0..300 {
        let addr = grpc.parse().unwrap();
        flood.push(std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(5)).unwrap());
    }
    std::thread::sleep(Duration::from_millis(500));
    let t0 = Instant::now();
    let cpu0 = cpu_secs(pid);
    std::thread::sleep(Duration::from_secs(3));
    let cpu = cpu_secs(pid) - cpu0;
    let wall = t0.elapsed().as_secs_f64();
    eprintln!("the server used {cpu:.2} s of CPU in {wall:.2} s of the flood");
    assert!(
        child.0.try_wait().unwrap().is_none(),
        "the server died in the flood"
    );
    assert!(
        cpu < 1.0,
        "the server burned {cpu:.2} s of CPU in {wall:.2} s of a flood: the accept loop spins"
    );
    while let Ok(line) = rx.try_recv() {
        log.push(line);
    }
    assert!(
        log.iter()
            .any(|l| l.contains("accept failed: backing off") && l.contains("Too many open files")),
        "the EMFILE burst is logged:\n{}",
        log.join("\n")
    );
    let bursts = log.iter().filter(|l| l.contains("backing off")).count();
    assert_eq!(bursts, 1, "one line per burst:\n{}", log.join("\n"));

    drop(flood);
    let t0 = Instant::now();
    let answered = loop {
        match health(&http) {
            Some(r) => break r,
            None if t0.elapsed() < Duration::from_secs(10) => {
                std::thread::sleep(Duration::from_millis(50))
            }
            None => panic!("/health does not answer after the flood"),
        }
    };
    assert!(answered.starts_with("HTTP/1.1 200"), "{answered}");
}

/// A child process killed (and reaped) when the test ends, passed or failed.
struct KillOnDrop(std::process::Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The binary run with `args`: (exit code, stdout, stderr).
fn run_any(args: &[&str]) -> (Option<i32>, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_pegaflow-server"))
        .args(args)
        .env("NO_COLOR", "1")
        .output()
        .unwrap();
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// A log level the server does not know fails start-up with the configuration-error code
/// (2), listing the accepted levels; levels in any case and filter directives pass.
#[test]
fn unknown_log_levels_are_refused() {
    for bad in [
        "verbose",
        "warning",
        "debug2",
        "pegaflow_runtime=loud",
        "info,,",
    ] {
        let (code, _, err) = run_any(&["--log-level", bad, "--pool-size", "64mb"]);
        assert_eq!(code, Some(2), "{bad}: {err}");
        assert!(
            err.contains("invalid log level")
                && err.contains("error, warn, info, debug, trace, off"),
            "{bad}: {err}"
        );
    }
    for good in ["WARN", "off", "pegaflow_runtime=debug,info"] {
        let (code, _, err) = run_any(&["--check-config", "--log-level", good]);
        assert_eq!(code, Some(0), "{good}: {err}");
    }
}

/// `--addr` takes a host name: `localhost:0` starts a server that serves.
#[test]
fn host_names_are_resolved_for_addr() {
    use std::io::BufRead;
    use std::process::Stdio;
    let child = Command::new(env!("CARGO_BIN_EXE_pegaflow-server"))
        .args([
            "--addr",
            "localhost:0",
            "--http-addr",
            "127.0.0.1:0",
            "--pool-size",
            "64mb",
        ])
        .env("NO_COLOR", "1")
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let mut child = KillOnDrop(child);
    let stdout = child.0.stdout.take().unwrap();
    let mut log = Vec::new();
    for line in std::io::BufReader::new(stdout).lines() {
        let line = line.unwrap();
        log.push(line.clone());
        if line.contains("serving") {
            break;
        }
    }
    assert!(
        log.iter().any(|l| l.contains("serving")),
        "the server did not start:\n{}",
        log.join("\n")
    );
    assert!(
        log.iter()
            .any(|l| l.contains("addr localhost:0 resolves to")),
        "{}",
        log.join("\n")
    );
    let (code, _, err) = run_any(&["--check-config", "--addr", "no-port-here"]);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("expected host:port"), "{err}");
}

/// A bare size below 1 MiB is refused naming the flag and suggesting a unit.
#[test]
fn a_bare_small_pool_size_is_refused() {
    let (code, _, err) = run_any(&["--pool-size", "30"]);
    assert_eq!(code, Some(2), "{err}");
    assert!(
        err.contains("--pool-size 30: 30 bytes is smaller than a block; did you mean 30gb?"),
        "{err}"
    );
    let (code, _, err) = run_any(&["--check-config", "--pool-size", "67108864"]);
    assert_eq!(code, Some(0), "a bare byte count of 64 MiB is fine: {err}");
}

/// `--check-config` names a typo'd key and fails; on a good pipeline it prints what will run
/// and exits 0. `--print-config` refuses the typo too.
#[test]
fn check_config_validates_backend_settings() {
    let dir = std::env::temp_dir().join(format!("pegaflow-server-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let dir = TempDir(dir);
    let bad = dir.0.join("bad.toml");
    std::fs::write(&bad, "[[tier]]\nkind = \"dram\"\ncapacty = \"1gb\"\n").unwrap();
    let bad = bad.to_str().unwrap();
    for flag in ["--check-config", "--print-config"] {
        let (code, out, err) = run_any(&[flag, "--config", bad]);
        assert_eq!(code, Some(2), "{flag}: {out}{err}");
        assert!(
            err.contains("dram tier") && err.contains("capacty") && err.contains("capacity"),
            "{flag}: {err}"
        );
        assert!(out.is_empty(), "{flag} printed {out}");
    }
    let good = dir.0.join("good.toml");
    std::fs::write(
        &good,
        "[[tier]]\nkind = \"dram\"\ncapacity = \"1gb\"\n[[transport]]\nkind = \"memcpy\"\n",
    )
    .unwrap();
    let (code, out, err) = run_any(&["--check-config", "--config", good.to_str().unwrap()]);
    assert_eq!(code, Some(0), "{err}");
    assert!(out.contains("pipeline is valid"), "{out}");
    assert!(out.contains("tiers:       dram"), "{out}");
    assert!(out.contains("transports:  memcpy"), "{out}");
    assert!(out.contains("registrars:"), "{out}");
    let bad_kind = dir.0.join("kind.toml");
    std::fs::write(&bad_kind, "[[transport]]\nkind = \"memcopy\"\n").unwrap();
    let (code, _, err) = run_any(&["--check-config", "--config", bad_kind.to_str().unwrap()]);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("memcopy"), "{err}");
}

/// A directory removed when the test ends.
struct TempDir(std::path::PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Every flag of PegaFlow 0.25.1's server (the published wheel's `pegaflow-server-py --help`)
/// is a flag here too: flags of parts this build lacks parse and fail start-up naming the part.
#[test]
fn every_flag_of_pegaflows_server_is_accepted() {
    let lib = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(".venv/lib");
    let theirs = std::fs::read_dir(&lib).ok().and_then(|d| {
        d.filter_map(Result::ok)
            .map(|e| e.path().join("site-packages/pegaflow/pegaflow-server-py"))
            .find(|p| p.is_file())
    });
    let Some(theirs) = theirs else {
        println!("SKIP: every_flag_of_pegaflows_server_is_accepted: the wheel is not installed (scripts/python-venv.sh)");
        return;
    };
    let flags = |help: &str| -> std::collections::BTreeSet<String> {
        help.lines()
            .filter_map(|l| {
                let t = l.trim_start();
                let t = t
                    .strip_prefix("-h, ")
                    .or(t.strip_prefix("-V, "))
                    .unwrap_or(t);
                t.strip_prefix("--")
                    .map(|r| r.split([' ', '<', '=']).next().unwrap_or("").to_string())
            })
            .filter(|f| !f.is_empty())
            .collect()
    };
    let out = Command::new(&theirs).arg("--help").output().unwrap();
    let theirs = flags(&String::from_utf8_lossy(&out.stdout));
    assert!(theirs.len() > 20, "parsed PegaFlow's --help: {theirs:?}");
    let ours = flags(&run(&["--help"]));
    let missing: Vec<&String> = theirs.difference(&ours).collect();
    assert!(
        missing.is_empty(),
        "PegaFlow flags missing here: {missing:?}"
    );
    // A flag of a part this build lacks fails start-up naming the part.
    let out = Command::new(env!("CARGO_BIN_EXE_pegaflow-server"))
        .args(["--backup-max-bandwidth", "2gb"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    assert!(String::from_utf8_lossy(&out.stderr).contains("decode backup"));
}

/// The README's pipeline example, as printed, passes `--check-config` (and with the flag the
/// README shows next to it).
#[test]
fn the_readme_pipeline_example_is_valid() {
    let readme =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/README.md")).unwrap();
    let start = readme
        .find("```toml\n")
        .expect("README.md has a ```toml example")
        + "```toml\n".len();
    let end = start + readme[start..].find("```").expect("the example ends");
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("pipeline.toml");
    std::fs::write(&path, &readme[start..end]).unwrap();
    let p = path.to_str().unwrap();
    run(&["--config", p, "--check-config"]);
    run(&["--config", p, "--pool-size", "64gb", "--check-config"]);
}
