//! `pegaflow-server`'s honest start-up, run as the binary: `--check-config` runs the start-up
//! checks that need no side effect and agrees with a real start; PegaFlow's cross-node flags
//! (`--nics`, `--metaserver-addr`) behave as in PegaFlow's deployments (issue 46).

use std::process::Command;
use std::time::{Duration, Instant};

use pegaflow_runtime::config::PipelineConfig;

mod cli_support;
use cli_support::*;

/// The binary started with `args` on free loopback ports; `Err((code, stderr))` when it
/// exits within 20 s, `Ok(child, http_addr)` once it answers `/health`.
fn start(args: &[&str]) -> Result<(KillOnDrop, String), (Option<i32>, String)> {
    let http = format!("127.0.0.1:{}", free_port());
    let grpc = format!("127.0.0.1:{}", free_port());
    let mut child = KillOnDrop(
        Command::new(env!("CARGO_BIN_EXE_pegaflow-server"))
            .args(["--addr", &grpc, "--http-addr", &http, "--pool-size", "64mb"])
            .args(args)
            .env("NO_COLOR", "1")
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap(),
    );
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if let Some(status) = child.0.try_wait().unwrap() {
            let mut err = String::new();
            std::io::Read::read_to_string(&mut child.0.stderr.take().unwrap(), &mut err).unwrap();
            return Err((status.code(), err));
        }
        if health(&http).is_some() {
            return Ok((child, http));
        }
        assert!(Instant::now() < deadline, "{args:?}: no answer within 20 s");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A side-channel directory that cannot be created (a regular file where a directory must
/// be) fails `--check-config` with exit 1 and the reason, as start-up itself fails; before,
/// `--check-config` said "pipeline is valid" and exited 0.
#[test]
fn check_config_finds_a_side_channel_directory_that_cannot_be_created() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("a-file");
    std::fs::write(&file, b"x").unwrap();
    let sock = file.join("sub/fd.sock");
    let sock = sock.to_str().unwrap();
    let args = [
        "--addr",
        "127.0.0.1:0",
        "--http-addr",
        "127.0.0.1:0",
        "--fd-socket-path",
        sock,
    ];
    let mut check = args.to_vec();
    check.push("--check-config");
    let (code, out, err) = run_any(&check);
    assert_eq!(code, Some(1), "{out}{err}");
    assert!(
        out.starts_with("start-up would fail: 1 problem below"),
        "{out}"
    );
    assert!(!out.contains("pipeline is valid"), "{out}");
    assert!(
        out.lines().any(|l| l.starts_with("  FAIL  fd channel ")
            && l.contains("cannot be created")
            && l.contains("is not a directory")),
        "{out}"
    );
    // Start-up agrees.
    let (code, err) = start(&["--fd-socket-path", sock]).map(|_| ()).unwrap_err();
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("side channel"), "{err}");
}

/// A missing side-channel directory is created at start-up (mode 0700, logged), as
/// `--check-config` says it will be and docs/OPERATIONS.md section 6.7 documents.
#[test]
fn a_missing_side_channel_directory_is_created_and_logged() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("run/pegaflow/fd.sock");
    let sock = sock.to_str().unwrap();
    let (code, out, err) = run_any(&[
        "--addr",
        "127.0.0.1:0",
        "--http-addr",
        "127.0.0.1:0",
        "--fd-socket-path",
        sock,
        "--check-config",
    ]);
    assert_eq!(code, Some(0), "{out}{err}");
    assert!(out.starts_with("pipeline is valid\n"), "{out}");
    assert!(
        out.contains("start-up creates its missing directories under"),
        "{out}"
    );
    let (mut child, _) = start(&["--fd-socket-path", sock]).unwrap();
    let made = dir.path().join("run/pegaflow");
    assert!(made.is_dir());
    use std::os::unix::fs::PermissionsExt;
    assert_eq!(
        std::fs::metadata(&made).unwrap().permissions().mode() & 0o777,
        0o700
    );
    child.0.kill().unwrap();
    let mut log = String::new();
    std::io::Read::read_to_string(&mut child.0.stdout.take().unwrap(), &mut log).unwrap();
    assert!(
        log.contains("created the side channel's directory (mode 0700)"),
        "{log}"
    );
}

/// `--use-hugepages` on a machine without the reserved huge pages it needs: `--check-config`
/// says so and exits 1, as start-up fails (skipped where the machine has them, or may hand
/// out surplus ones).
#[test]
fn check_config_finds_missing_huge_pages() {
    let read = |file: &str| -> u64 {
        std::fs::read_to_string(format!("/sys/kernel/mm/hugepages/hugepages-2048kB/{file}"))
            .ok()
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0)
    };
    let (free, surplus) = (read("free_hugepages"), read("nr_overcommit_hugepages"));
    if free >= 512 || surplus > 0 {
        pegaflow_test_skip::skip!(
            "this machine has {free} free 2 MiB huge pages ({surplus} surplus allowed)"
        );
        return;
    }
    let (code, out, err) = run_any(&[
        "--addr",
        "127.0.0.1:0",
        "--http-addr",
        "127.0.0.1:0",
        "--use-hugepages",
        "--pool-size",
        "1gb",
        "--check-config",
    ]);
    assert_eq!(code, Some(1), "{out}{err}");
    assert!(
        out.contains("FAIL  dram tier: use_hugepages needs 512 free 2 MiB huge pages")
            && out.contains("vm.nr_hugepages"),
        "{out}"
    );
}

/// Ports: one in use now is a warning (a running server may hold it, e.g. the one this
/// pipeline is for), one that cannot be bound at all fails; what only start-up can find is
/// listed as not checked.
#[test]
fn check_config_checks_ports_and_says_what_it_could_not_check() {
    let held = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let busy = held.local_addr().unwrap().to_string();
    let (code, out, err) = run_any(&[
        "--addr",
        &busy,
        "--http-addr",
        "127.0.0.1:0",
        "--check-config",
    ]);
    assert_eq!(code, Some(0), "{out}{err}");
    assert!(
        out.contains(&format!("  warn  grpc addr {busy}: in use now")),
        "{out}"
    );
    assert!(
        out.contains("  ok    http addr 127.0.0.1:0: can be bound"),
        "{out}"
    );
    assert!(out.contains("not checked (start-up finds these):"), "{out}");
    assert!(out.contains("memcpy transport"), "{out}");
    // An address of no interface here (TEST-NET-1).
    let (code, out, err) = run_any(&[
        "--addr",
        "127.0.0.1:0",
        "--http-addr",
        "192.0.2.1:9091",
        "--check-config",
    ]);
    assert_eq!(code, Some(1), "{out}{err}");
    assert!(
        out.contains("  FAIL  http addr 192.0.2.1:9091: cannot be bound"),
        "{out}"
    );
    drop(held);
}

/// An SSD path under a regular file cannot be created: `--check-config` fails naming it; one
/// whose parents are missing is created (and says so).
#[test]
fn check_config_checks_the_ssd_paths() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("a-file");
    std::fs::write(&file, b"x").unwrap();
    let bad = file.join("ssd");
    let good = dir.path().join("nvme/pegaflow");
    let (code, out, err) = run_any(&[
        "--addr",
        "127.0.0.1:0",
        "--http-addr",
        "127.0.0.1:0",
        "--ssd-cache-path",
        bad.to_str().unwrap(),
        "--check-config",
    ]);
    assert_eq!(code, Some(1), "{out}{err}");
    assert!(
        out.contains("  FAIL  ssd tier: ") && out.contains("cannot be created"),
        "{out}"
    );
    let (code, out, err) = run_any(&[
        "--addr",
        "127.0.0.1:0",
        "--http-addr",
        "127.0.0.1:0",
        "--ssd-cache-path",
        good.to_str().unwrap(),
        "--ssd-cache-capacity",
        "1gb",
        "--check-config",
    ]);
    assert_eq!(code, Some(0), "{out}{err}");
    assert!(
        out.contains("does not exist: start-up creates it under"),
        "{out}"
    );
    assert!(out.contains("free space against the capacity"), "{out}");
    assert!(!good.exists(), "--check-config created nothing");
}

/// `--nics` is the `rdma` kind's flag in the default build (it used to be refused: "no
/// cross-node transport declares this flag"), read as PegaFlow reads it (commas and/or
/// spaces; an empty name is an error), and with `--metaserver-addr` it configures the RDMA
/// peer path and the directory. A NIC that cannot be opened (no libibverbs, or no such
/// device) fails start-up naming what is missing, as a bad NIC fails PegaFlow's.
#[test]
fn nics_with_metaserver_addr_configure_rdma_and_fail_start_up_without_the_nic() {
    let help = run(&["--help"]);
    let nics = help
        .split("--nics <NIC>")
        .nth(1)
        .expect("--help lists --nics");
    assert!(
        !nics[..200.min(nics.len())].contains("[needs"),
        "--nics is a real flag here: {nics}"
    );
    let text = run(&[
        "--print-config",
        "--nics",
        "mlx5_0,mlx5_1",
        "mlx5_2",
        "--metaserver-addr",
        "http://10.0.0.5:50056",
    ]);
    let p = PipelineConfig::from_toml(&text).unwrap();
    let peer = p.peer.expect("--nics adds [peer]");
    assert_eq!(peer.kind, "rdma");
    assert_eq!(
        peer.settings["nics"],
        toml::Value::Array(vec!["mlx5_0,mlx5_1".into(), "mlx5_2".into()])
    );
    assert_eq!(p.directory.expect("and the directory").kind, "metaserver");
    for bad in ["mlx5_0,,mlx5_1", "mlx5_0,", ""] {
        let (code, _, err) = run_any(&["--check-config", "--nics", bad]);
        assert_eq!(code, Some(2), "{bad:?}: {err}");
        assert!(err.contains("an empty NIC name"), "{bad:?}: {err}");
    }
    let meta = format!("http://127.0.0.1:{}", free_port());
    let (code, err) = start(&[
        "--nics",
        "pegaflow-test-no-such-nic",
        "--metaserver-addr",
        &meta,
    ])
    .map(|_| ())
    .unwrap_err();
    assert_eq!(code, Some(1), "{err}");
    assert!(
        err.contains("cannot open the NICs [\"pegaflow-test-no-such-nic\"] (--nics)")
            && (err.contains("libibverbs") || err.contains("RDMA device")),
        "{err}"
    );
}

/// `--metaserver-addr` without a peer path (no `--nics`, no `--peer-data-addr`) used to
/// advertise blocks that no peer could fetch from this node, silently. It now serves them
/// over TCP on the host of `--addr` (any free port), says so at start-up, and `/health?
/// verbose=1` shows the peer path; a peer path given keeps it.
#[test]
fn metaserver_addr_alone_serves_peers_over_tcp() {
    let text = run(&[
        "--print-config",
        "--addr",
        "10.1.2.3:50055",
        "--metaserver-addr",
        "http://10.0.0.5:50056",
    ]);
    let p = PipelineConfig::from_toml(&text).unwrap();
    let peer = p.peer.expect("a peer path is added");
    assert_eq!(peer.kind, "tcp");
    assert_eq!(peer.settings["data_addr"].as_str(), Some("10.1.2.3:0"));
    let text = run(&[
        "--print-config",
        "--metaserver-addr",
        "http://10.0.0.5:50056",
        "--peer-data-addr",
        "0.0.0.0:50060",
    ]);
    let p = PipelineConfig::from_toml(&text).unwrap();
    assert_eq!(
        p.peer.unwrap().settings["data_addr"].as_str(),
        Some("0.0.0.0:50060"),
        "a peer path given is kept"
    );
    let meta = format!("http://127.0.0.1:{}", free_port());
    let (mut child, http) = start(&["--metaserver-addr", &meta]).unwrap();
    let detail = get(&http, "/health?verbose=1").unwrap();
    assert!(
        detail.contains("\npeer tcp: ok; serves peers and fetches from those the directory names"),
        "{detail}"
    );
    child.0.kill().unwrap();
    let mut log = String::new();
    std::io::Read::read_to_string(&mut child.0.stdout.take().unwrap(), &mut log).unwrap();
    assert!(
        log.contains("--metaserver-addr without a peer path")
            && log.contains("data port on 127.0.0.1:0"),
        "{log}"
    );
}
