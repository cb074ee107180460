//! The pipeline's and the command line's unit tests.

use super::*;
use crate::plugin::{
    check_parses, defaults_of, BuiltTier, ConfigSchema, FactoryFlag, FlagValue, PluginOption,
    RuntimeContext, TierFactory,
};
use clap::{CommandFactory, Parser};

/// The settings of the test landing tier below.
#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
struct TestPoolConfig {
    #[serde(with = "size")]
    capacity: u64,
    shards: usize,
}

impl Default for TestPoolConfig {
    fn default() -> Self {
        Self {
            capacity: 3 << 30,
            shards: 1,
        }
    }
}

fn never_built(_: &toml::Table, _: &RuntimeContext) -> anyhow::Result<BuiltTier> {
    bail!("the config tests build no tier")
}

// A landing tier declaring the flags the DRAM tier declares in pegaflow-server.
inventory::submit! {
    TierFactory {
        kind: "test-pool",
        summary: "config tests: a landing tier that is never built",
        config: ConfigSchema {
            defaults: defaults_of::<TestPoolConfig>,
            check: check_parses::<TestPoolConfig>,
            options: &[
                PluginOption { name: "capacity", help: "bytes" },
                PluginOption { name: "shards", help: "sub-pools" },
            ],
        },
        flags: &[
            FactoryFlag {
                long: "pool-size",
                value_name: "SIZE",
                help: "Test pool capacity",
                setting: "capacity",
                value: FlagValue::Size,
                adds_entry: false,
            },
            FactoryFlag {
                long: "pool-shards",
                value_name: "N",
                help: "Test pool shards",
                setting: "shards",
                value: FlagValue::Integer { min: 1 },
                adds_entry: false,
            },
        ],
        default_landing: true,
        build: never_built,
    }
}

fn capacity(p: &PipelineConfig) -> u64 {
    #[derive(Deserialize)]
    struct Capacity {
        #[serde(with = "size")]
        capacity: u64,
    }
    let c: Capacity = toml::Value::Table(p.tiers[0].settings.clone())
        .try_into()
        .unwrap();
    c.capacity
}

#[test]
fn sizes() {
    assert_eq!(parse_size("30gb").unwrap(), 30 << 30);
    assert_eq!(parse_size("16 MB").unwrap(), 16 << 20);
    assert_eq!(parse_size("1.5kb").unwrap(), 1536);
    assert_eq!(parse_size("4096").unwrap(), 4096);
    assert_eq!(parse_size("2TiB").unwrap(), 2 << 40);
    assert!(parse_size("12 parsecs").is_err());
    assert!(parse_size("gb").is_err());
    assert!(parse_size("-1gb").is_err());
}

#[test]
fn default_pipeline_and_overrides() {
    let cli = Cli::parse_from([
        "pegaflow-server",
        "--addr",
        "127.0.0.1:1",
        "--pool-size",
        "1gb",
        "--fd-socket-path",
        "/tmp/x.sock",
    ]);
    let p = cli.pipeline().unwrap();
    assert_eq!(p.server.addr, "127.0.0.1:1");
    assert_eq!(p.server.http_addr, "0.0.0.0:9091");
    assert_eq!(capacity(&p), 1 << 30);
    assert_eq!(p.fd_channel.unwrap().path, PathBuf::from("/tmp/x.sock"));
    let p = Cli::parse_from(["pegaflow-server", "--devices", "0, 2"])
        .pipeline()
        .unwrap();
    assert_eq!(p.server.devices, Some(vec![0, 2]));
    assert!(p.server.numa_affinity, "NUMA placement is on by default");
    let cli = Cli::parse_from(["pegaflow-server", "--disable-numa-affinity"]);
    assert!(!cli.pipeline().unwrap().server.numa_affinity);
    assert!(
        !cli.notes().iter().any(|n| n.contains("numa")),
        "the flag does something now: no 'nothing to disable' note"
    );
    assert!(Cli::parse_from(["pegaflow-server", "--devices", "x"])
        .pipeline()
        .is_err());
    let d = Cli::parse_from(["pegaflow-server"]).pipeline().unwrap();
    assert!(d.fd_channel.is_none(), "the side channel is off by default");
    assert_eq!(d.server.addr, "127.0.0.1:50055");
}

#[test]
fn file_then_flags() {
    let dir = tempfile::tempdir().unwrap();
    let f = dir.path().join("p.toml");
    std::fs::write(
        &f,
        "[server]\naddr = \"127.0.0.1:7\"\nlog_level = \"debug\"\n[[tier]]\nkind = \"dram\"\ncapacity = \"2gb\"\n",
    )
    .unwrap();
    let cli = Cli::parse_from([
        "pegaflow-server",
        "--config",
        f.to_str().unwrap(),
        "--log-level",
        "warn",
    ]);
    let p = cli.pipeline().unwrap();
    assert_eq!(p.server.addr, "127.0.0.1:7");
    assert_eq!(p.server.log_level, "warn");
    assert_eq!(capacity(&p), 2 << 30);
}

#[test]
fn unsupported_flags_fail_with_the_missing_part() {
    let e = Cli::parse_from(["pegaflow-server", "--ssd-cache-path", "/x"])
        .pipeline()
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("--ssd-cache-path needs an SSD tier")
            && e.contains("none is linked into this binary"),
        "{e}"
    );
    // A placeholder takes any number of values (`--use-hugepages` alone, repeated paths).
    let e = Cli::parse_from(["pegaflow-server", "--use-hugepages"])
        .pipeline()
        .unwrap_err()
        .to_string();
    assert!(e.contains("--use-hugepages needs a landing tier"), "{e}");
    let p = Cli::parse_from(["pegaflow-server", "--max-prefetch-blocks", "64"])
        .pipeline()
        .unwrap();
    assert_eq!(p.store.max_promote_blocks, 64);
    assert!(Cli::try_parse_from(["pegaflow-server", "--max-prefetch-blocks", "0"]).is_err());
    let e = Cli::parse_from(["pegaflow-server", "--log-level", "=="])
        .pipeline()
        .unwrap_err()
        .to_string();
    assert!(e.contains("invalid log level"), "{e}");
    let p = Cli::parse_from([
        "pegaflow-server",
        "--python-registry",
        "false",
        "--pool-shards",
        "2",
    ])
    .pipeline()
    .unwrap();
    assert!(!p.server.python_registry);
    let e = Cli::parse_from(["pegaflow-server", "--nics", "mlx5_0"])
        .pipeline()
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("--nics needs") && e.contains("none is linked"),
        "{e}"
    );
}

#[test]
fn size_settings_read_strings_and_bytes_and_write_units() {
    assert_eq!(size::to_value(30 << 30), toml::Value::String("30gb".into()));
    assert_eq!(
        size::to_value(3 << 19),
        toml::Value::String("1536kb".into())
    );
    assert_eq!(size::to_value(1000), toml::Value::Integer(1000));
    assert_eq!(size::to_value(0), toml::Value::Integer(0));
    let t = toml::Table::try_from(TestPoolConfig::default()).unwrap();
    assert_eq!(t["capacity"], toml::Value::String("3gb".into()));
    let parse = |text: &str| -> Result<TestPoolConfig, String> {
        toml::from_str(text).map_err(|e| e.to_string())
    };
    assert_eq!(parse("capacity = 4096").unwrap().capacity, 4096);
    assert_eq!(parse("capacity = \"1.5kb\"").unwrap().capacity, 1536);
    let e = parse("capacity = -1").unwrap_err();
    assert!(e.contains("negative"), "{e}");
    let e = parse("capacity = \"lots\"").unwrap_err();
    assert!(e.contains("invalid size"), "{e}");
    let e = parse("capacity = true").unwrap_err();
    assert!(e.contains("a size like"), "{e}");
}

#[test]
fn flag_values_parse_into_settings() {
    use toml::Value;
    assert_eq!(
        FlagValue::Size.parse("64mb"),
        Ok(Value::String("64mb".into()))
    );
    assert_eq!(FlagValue::Size.parse("1000"), Ok(Value::Integer(1000)));
    assert!(FlagValue::Size.parse("big").is_err());
    assert_eq!(
        FlagValue::Integer { min: 2 }.parse("2"),
        Ok(Value::Integer(2))
    );
    assert!(FlagValue::Integer { min: 2 }.parse("1").is_err());
    assert_eq!(FlagValue::Bool.parse("false"), Ok(Value::Boolean(false)));
    assert!(FlagValue::Bool.parse("yes").is_err());
    assert_eq!(
        FlagValue::Text.parse("a b"),
        Ok(Value::String("a b".into()))
    );
}

#[test]
fn a_pipeline_without_tiers_gets_the_default_landing_tier() {
    let p = PipelineConfig::from_toml("[server]\naddr = \"127.0.0.1:1\"\n").unwrap();
    assert_eq!(p.tiers.len(), 1);
    assert_eq!(p.tiers[0].kind, "test-pool");
    assert_eq!(p.tiers[0].settings, defaults_of::<TestPoolConfig>());
    let p = PipelineConfig::from_toml("[[tier]]\nkind = \"other\"\n").unwrap();
    assert_eq!(p.tiers.len(), 1, "named tiers are kept as they are");
    assert_eq!(p.tiers[0].kind, "other");
}

#[test]
fn declared_flags_are_on_the_command_line_and_set_their_setting() {
    let help = Cli::command().render_long_help().to_string();
    assert!(
        help.contains("--pool-size <SIZE>") && help.contains("Test pool capacity"),
        "{help}"
    );
    assert!(help.contains("--pool-shards <N>"), "{help}");
    let p = Cli::parse_from([
        "pegaflow-server",
        "--pool-shards",
        "3",
        "--pool-size",
        "2gb",
    ])
    .pipeline()
    .unwrap();
    assert_eq!(p.tiers[0].settings["shards"], toml::Value::Integer(3));
    assert!(
        p.to_toml().contains("capacity = \"2gb\""),
        "{}",
        p.to_toml()
    );
    let e = Cli::try_parse_from(["pegaflow-server", "--pool-shards", "0"]).unwrap_err();
    assert!(e.to_string().contains("must be an integer >= 1"), "{e}");
    let e = Cli::try_parse_from(["pegaflow-server", "--pool-size", "lots"]).unwrap_err();
    assert!(e.to_string().contains("invalid size"), "{e}");
    let dir = tempfile::tempdir().unwrap();
    let f = dir.path().join("p.toml");
    std::fs::write(&f, "[[tier]]\nkind = \"other\"\n").unwrap();
    let e = Cli::parse_from([
        "pegaflow-server",
        "--config",
        f.to_str().unwrap(),
        "--pool-size",
        "1gb",
    ])
    .pipeline()
    .unwrap_err()
    .to_string();
    assert_eq!(
        e,
        "--pool-size given but the pipeline has no test-pool tier"
    );
}

#[test]
fn admin_allow_parses_matches_and_round_trips() {
    let ip = |s: &str| Some(s.parse::<std::net::IpAddr>().unwrap());
    let d = AdminAllow::default();
    assert_eq!(d.to_string(), "loopback");
    assert!(d.permits(ip("127.0.0.1")) && d.permits(ip("127.9.9.9")));
    assert!(d.permits(ip("::1")) && d.permits(ip("::ffff:127.0.0.1")));
    assert!(!d.permits(ip("10.0.0.1")) && !d.permits(None));
    let any = AdminAllow::parse("ANY").unwrap();
    assert_eq!(any, AdminAllow::any());
    assert!(any.permits(ip("8.8.8.8")) && any.permits(None));
    let l = AdminAllow::parse(" 10.0.0.0/8, loopback ,fd00::/8,192.168.1.7").unwrap();
    assert_eq!(l.to_string(), "10.0.0.0/8,loopback,fd00::/8,192.168.1.7/32");
    assert!(l.permits(ip("10.200.3.4")) && l.permits(ip("::ffff:10.1.1.1")));
    assert!(l.permits(ip("fd12::1")) && l.permits(ip("192.168.1.7")));
    assert!(l.permits(ip("127.0.0.1")));
    assert!(!l.permits(ip("11.0.0.1")) && !l.permits(ip("192.168.1.8")));
    assert!(!l.permits(ip("fe80::1")));
    let only = AdminAllow::parse("10.0.0.0/8").unwrap();
    assert!(
        !only.permits(ip("127.0.0.1")),
        "a list without loopback excludes it"
    );
    assert!(AdminAllow::parse("0.0.0.0/0")
        .unwrap()
        .permits(ip("1.2.3.4")));
    for bad in [
        "",
        " , ",
        "10.0.0.0/33",
        "::/129",
        "localhost",
        "10.0.0.0/x",
    ] {
        assert!(AdminAllow::parse(bad).is_err(), "{bad:?}");
    }
    // In a pipeline: a string or a list; printed back as it reads.
    let p = PipelineConfig::from_toml("[server]\nadmin_allow = [\"loopback\", \"10.0.0.0/8\"]\n")
        .unwrap();
    assert_eq!(
        p.server.admin_allow,
        AdminAllow::parse("loopback,10.0.0.0/8").unwrap()
    );
    assert!(
        p.to_toml()
            .contains("admin_allow = [\n    \"loopback\",\n    \"10.0.0.0/8\",\n]"),
        "{}",
        p.to_toml()
    );
    let d = PipelineConfig::embedded_default();
    assert!(
        d.to_toml().contains("admin_allow = \"loopback\""),
        "{}",
        d.to_toml()
    );
    assert_eq!(
        PipelineConfig::from_toml(&d.to_toml())
            .unwrap()
            .server
            .admin_allow,
        d.server.admin_allow
    );
    assert!(PipelineConfig::from_toml("[server]\nadmin_allow = \"10.0.0.0/40\"\n").is_err());
    // On the command line.
    let p = Cli::parse_from(["pegaflow-server", "--admin-allow", "any"])
        .pipeline()
        .unwrap();
    assert_eq!(p.server.admin_allow, AdminAllow::any());
    let e = Cli::try_parse_from(["pegaflow-server", "--admin-allow", "nobody"]).unwrap_err();
    assert!(e.to_string().contains("not `any`, `loopback`"), "{e}");
}

#[test]
fn connection_caps() {
    assert_eq!(
        default_max_connections(Some(20_000), 100, 256),
        20_000 - 100 - 1024 - 256
    );
    assert_eq!(default_max_connections(Some(1 << 20), 100, 256), 65_536);
    assert_eq!(default_max_connections(None, 100, 256), 65_536);
    assert_eq!(
        default_max_connections(Some(1024), 30, 256),
        64,
        "the floor"
    );
    let p = Cli::parse_from(["pegaflow-server", "--max-connections", "100"])
        .pipeline()
        .unwrap();
    assert_eq!(p.server.max_connections, Some(100));
    assert_eq!(p.server.max_http_connections, 256);
    assert_eq!(
        Cli::parse_from(["pegaflow-server"])
            .pipeline()
            .unwrap()
            .server
            .max_connections,
        None
    );
    assert!(Cli::try_parse_from(["pegaflow-server", "--max-connections", "0"]).is_err());
    let p = PipelineConfig::from_toml("[server]\nmax_connections = 0\n").unwrap();
    assert!(p.server.validate().is_err());
    let p = PipelineConfig::from_toml("[server]\nmax_http_connections = 0\n").unwrap();
    assert!(p.server.validate().is_err());
}

#[test]
fn unknown_pipeline_keys_are_rejected() {
    assert!(PipelineConfig::from_toml("[server]\nadr = \"x\"\n").is_err());
}
