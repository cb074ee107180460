//! The shipped pipelines parse and build; the third-party backend registers without any edit
//! to the runtime and carries a real save/load; unknown kinds fail start-up listing the kinds.

use pegaflow_api::load_state::LOAD_SUCCESS;
use pegaflow_runtime::config::PipelineConfig;
use pegaflow_tests::harness::*;

use pegaflow_examples as _;

fn load(name: &str) -> PipelineConfig {
    let path = format!("{}/pipelines/{name}", env!("CARGO_MANIFEST_DIR"));
    PipelineConfig::from_toml(&std::fs::read_to_string(path).unwrap()).unwrap()
}

#[test]
fn shipped_pipelines_parse() {
    for f in [
        "default.toml",
        "cpu-engines.toml",
        "verify.toml",
        "two-tier.toml",
    ] {
        let p = load(f);
        assert_eq!(p.tiers[0].kind, "dram", "{f}");
    }
    // The embedded default names no tier: it gets the declared default landing tier with
    // that tier's defaults, which default.toml writes out.
    assert!(!pegaflow_runtime::config::DEFAULT_PIPELINE.contains("[[tier]]"));
    let d = load("default.toml");
    let e = PipelineConfig::embedded_default();
    assert_eq!(
        d.to_toml(),
        e.to_toml(),
        "default.toml is the embedded default"
    );
    assert_eq!(
        pegaflow_plugin::default_landing_tier().unwrap().kind,
        "dram"
    );
}

#[test]
fn every_linked_factory_documents_its_settings() {
    // Tiers (dram, heap-store), transports (memcpy, memcpy-verify), registrars (host-memfd)
    // and the runtime's layers: every default has help, every help and flag names a setting.
    let problems = pegaflow_plugin::doc_problems();
    assert!(problems.is_empty(), "{problems:#?}");
    let listing = pegaflow_plugin::describe_plugins();
    let dram = pegaflow_tier_dram::DramSettings::default();
    assert_eq!(dram.capacity, pegaflow_tier_dram::DEFAULT_CAPACITY);
    assert!(
        listing.contains("capacity = \"30gb\"    pool size"),
        "the dram default capacity renders from DramSettings::default(): {listing}"
    );
    assert!(
        listing.contains("--pool-size <SIZE> sets capacity"),
        "{listing}"
    );
    assert!(listing.contains("window_keys = 1048576"), "{listing}");
    assert!(listing.contains("evict = true"), "{listing}");
}

/// What `--print-config --pool-size 1gb` must print: default.toml with a 1 GiB tier.
fn expected_print_config() -> String {
    let mut p = load("default.toml");
    p.tiers[0]
        .settings
        .insert("capacity".into(), toml::Value::String("1gb".into()));
    p.to_toml()
}

#[test]
fn the_third_party_binary_has_the_runtime_cli() {
    let bin = env!("CARGO_BIN_EXE_pegaflow-server-verify");
    let run = |args: &[&str]| {
        let out = std::process::Command::new(bin).args(args).output().unwrap();
        assert!(out.status.success(), "{args:?}: {out:?}");
        String::from_utf8(out.stdout).unwrap()
    };
    assert_eq!(
        run(&["--print-config", "--pool-size", "1gb"]),
        expected_print_config()
    );
    let help = run(&["--help"]);
    assert!(
        help.contains("--pool-size <SIZE>") && help.contains("Host-DRAM tier capacity"),
        "{help}"
    );
    assert!(help.contains("--pool-shards <N>"), "{help}");
    let out = std::process::Command::new(bin)
        .args(["--ssd-cache-path", "/x"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--ssd-cache-path needs"));
}

#[test]
fn the_third_party_kind_is_listed() {
    let listing = pegaflow_plugin::describe_plugins();
    assert!(listing.contains("memcpy-verify"), "{listing}");
    assert!(pegaflow_plugin::known_transports().contains("memcpy-verify"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_kinds_fail_start_up_with_the_known_kinds() {
    let mut p = PipelineConfig::embedded_default();
    p.server.addr = "127.0.0.1:0".into();
    p.server.http_addr = "127.0.0.1:0".into();
    p.tiers[0].kind = "nvme-of-dreams".into();
    let e = pegaflow_runtime::start(p).await.unwrap_err().to_string();
    assert!(e.contains("unknown tier kind \"nvme-of-dreams\""), "{e}");
    assert!(e.contains("dram"), "{e}");
    let mut p = PipelineConfig::from_toml(
        "[[tier]]\nkind = \"dram\"\ncapacity = \"1mb\"\n[[transport]]\nkind = \"rdma\"\n",
    )
    .unwrap();
    p.server.addr = "127.0.0.1:0".into();
    p.server.http_addr = "127.0.0.1:0".into();
    let e = pegaflow_runtime::start(p).await.unwrap_err().to_string();
    assert!(
        e.contains("unknown transport kind \"rdma\"") && e.contains("memcpy-verify"),
        "{e}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_third_party_transport_carries_a_roundtrip() {
    let dir = tempfile::tempdir().unwrap();
    let mut p = load("verify.toml");
    p.server.addr = "127.0.0.1:0".into();
    p.server.http_addr = "127.0.0.1:0".into();
    p.fd_channel.as_mut().unwrap().path = dir.path().join("fd.sock");
    let handle = pegaflow_runtime::start(p).await.unwrap();
    let srv = TestServer::from_handle(handle, dir.path().join("fd.sock"), dir);
    let shape = KvShape {
        layers: 2,
        num_blocks: 8,
        segment_bytes: 512,
    };
    let mut w = Worker::register(&srv, "tp", "ns", shape, 0, 1, 0).await;
    let hs: Vec<Vec<u8>> = (0..3).map(|i| hash_of("tp", i)).collect();
    for (i, h) in hs.iter().enumerate() {
        w.kv.fill(i, h);
    }
    w.save(&[0, 1, 2], &hs).await.unwrap();
    let (n, lease) = ready(w.client.query("tp", hs.clone(), "q").await.unwrap());
    assert_eq!(n, 3);
    assert_eq!(w.load(&lease, &[5, 6, 7]).await.unwrap(), LOAD_SUCCESS);
    for (i, h) in hs.iter().enumerate() {
        assert!(w.kv.holds(5 + i, h));
    }
}

#[test]
fn enable_lfu_admission_adds_the_admission_layer_to_lower_tiers_only() {
    use clap::Parser;
    use pegaflow_runtime::config::Cli;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("p.toml");
    std::fs::write(
        &path,
        "[[tier]]\nkind = \"dram\"\ncapacity = \"1mb\"\n[[tier]]\nkind = \"heap-store\"\nlayers = [\"metrics\"]\n",
    )
    .unwrap();
    let cli = Cli::try_parse_from([
        "pegaflow-server",
        "--config",
        path.to_str().unwrap(),
        "--enable-lfu-admission",
    ])
    .unwrap();
    let p = cli.pipeline().unwrap();
    assert!(p.tiers[0].layers.is_empty());
    assert_eq!(
        p.tiers[1].layers,
        vec![
            toml::Value::String("metrics".into()),
            toml::Value::String("admission".into())
        ]
    );
    // Without a tier below DRAM the flag has nothing to act on: start-up refuses it.
    let cli = Cli::try_parse_from(["pegaflow-server", "--enable-lfu-admission"]).unwrap();
    let e = format!("{:#}", cli.pipeline().unwrap_err());
    assert!(e.contains("below DRAM"), "{e}");
}
