//! The `[events]` settings of the ZMQ publisher and their checks.
//!
//! Owns the serde config struct, its defaults (vLLM's `KVEventsConfig` where vLLM has the
//! setting) and endpoint parsing. It never opens a socket: binding happens in the publisher,
//! which reports a taken port or an unreachable address as [`crate::EventsError::Bind`].

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use serde::{Deserialize, Serialize};

use crate::error::EventsError;
use crate::event::{BlockHashForm, Encoding};

/// The most events one batch may carry (`max_events_per_batch`'s ceiling).
pub const MAX_EVENTS_PER_BATCH_LIMIT: usize = 65_536;

/// Whether the PUB socket binds or connects (`[events] endpoint_mode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum EndpointMode {
    /// vLLM's rule: bind when the endpoint has `*` or `::`, or is `ipc://`; connect otherwise
    /// (so `tcp://127.0.0.1:5557` connects, to an XSUB proxy for instance).
    #[default]
    Auto,
    /// Always bind (`tcp://127.0.0.1:5557` listens on loopback only).
    Bind,
    /// Always connect, retrying in the background until the peer is there.
    Connect,
}

/// The `[events] kind = "zmq"` table (without `kind`, which the plugin registry consumes).
///
/// Defaults follow vLLM's `KVEventsConfig`: PUB on `tcp://*:5557`, no replay socket, topic
/// `""`, 10,000 batches kept for replay.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ZmqEventsConfig {
    /// The PUB socket: `tcp://*:PORT` (all IPv4 interfaces), `tcp://[::]:PORT`,
    /// `tcp://ADDR:PORT`, `tcp://HOST:PORT` or `ipc:///path`. Port 0 picks a free port
    /// ([`crate::EventPublisher::pub_endpoint`] tells which). Default `tcp://*:5557`.
    pub endpoint: String,
    /// Bind or connect the PUB socket. Default `auto` (vLLM's rule, see [`EndpointMode`]).
    pub endpoint_mode: EndpointMode,
    /// The replay socket (a ROUTER, always bound), e.g. `tcp://*:5558`. Unset: no replay.
    pub replay_endpoint: Option<String>,
    /// First frame of every PUB message; SUB sockets filter on its prefix. Default `""`.
    pub topic: String,
    /// Event shape inside a batch: `array` (vLLM through 0.23, default) or `map` (newer vLLM).
    pub encoding: Encoding,
    /// How block digests are sent: `int` (low 64 bits, vLLM's default) or `bytes`. The
    /// publisher does not convert: [`crate::EventPublisher::block_hash`] applies it.
    pub block_hash: BlockHashForm,
    /// Batches kept for replay (vLLM's `buffer_steps`). Default 10,000; at least 1.
    pub buffer_steps: usize,
    /// Payload bytes kept for replay: the oldest batches leave first when either bound is
    /// reached. Default 64 MiB (67108864); at least 1 MiB.
    pub replay_buffer_bytes: u64,
    /// Batches the PUB socket queues per subscriber connection (libzmq's send high-water
    /// mark); past it that subscriber's copies are dropped and it sees a gap in `seq`. Bounds
    /// the memory a stalled subscriber can hold to `hwm` batches. Default 10,000 (vLLM's
    /// `hwm` is 100,000); 1 to 1,000,000 (0, libzmq's "unlimited", is refused).
    pub hwm: usize,
    /// Events that may wait for the publisher thread; a submission that would exceed it is
    /// dropped and counted. Default 100,000 (vLLM's `max_queue_size`); at least 1.
    pub queue_capacity_events: usize,
    /// Most events in one PUB message; queued submissions are merged up to it and a larger
    /// one is split. Default 1,024; 1 to [`MAX_EVENTS_PER_BATCH_LIMIT`].
    pub max_events_per_batch: usize,
    /// Sent in every batch as `data_parallel_rank`; unset sends `nil`. Unlike vLLM, the
    /// endpoint's port is not offset by it.
    pub data_parallel_rank: Option<u32>,
    /// Milliseconds one replay answer may take to hand to a requester before the rest of it
    /// is abandoned (a requester that stopped reading). Default 5,000; at least 1.
    pub replay_timeout_ms: u64,
}

impl Default for ZmqEventsConfig {
    fn default() -> Self {
        Self {
            endpoint: "tcp://*:5557".into(),
            endpoint_mode: EndpointMode::Auto,
            replay_endpoint: None,
            topic: String::new(),
            encoding: Encoding::Array,
            block_hash: BlockHashForm::Int,
            buffer_steps: 10_000,
            replay_buffer_bytes: 64 << 20,
            hwm: 10_000,
            queue_capacity_events: 100_000,
            max_events_per_batch: 1024,
            data_parallel_rank: None,
            replay_timeout_ms: 5_000,
        }
    }
}

/// Where a socket goes, parsed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Target {
    /// `tcp://HOST:PORT`; `host` is `*`, an address or a name.
    Tcp { host: TcpHost, port: u16 },
    /// `ipc://PATH`.
    Ipc(String),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum TcpHost {
    Ip(IpAddr),
    Name(String),
}

impl TcpHost {
    pub(crate) fn as_string(&self) -> String {
        match self {
            TcpHost::Ip(IpAddr::V6(a)) => format!("[{a}]"),
            TcpHost::Ip(a) => a.to_string(),
            TcpHost::Name(n) => n.clone(),
        }
    }
}

/// Parses `endpoint` for the `key` setting.
pub(crate) fn parse_endpoint(key: &'static str, endpoint: &str) -> Result<Target, EventsError> {
    let bad = |reason: String| EventsError::Config { key, reason };
    if let Some(path) = endpoint.strip_prefix("ipc://") {
        if path.is_empty() {
            return Err(bad(format!("{endpoint:?} names no socket path")));
        }
        return Ok(Target::Ipc(path.to_string()));
    }
    let Some(rest) = endpoint.strip_prefix("tcp://") else {
        return Err(bad(format!(
            "{endpoint:?} is not tcp://HOST:PORT or ipc://PATH (inproc:// is not supported)"
        )));
    };
    let Some((host, port)) = rest.rsplit_once(':') else {
        return Err(bad(format!("{endpoint:?} has no :PORT")));
    };
    let port: u16 = port
        .parse()
        .map_err(|_| bad(format!("{endpoint:?}: port {port:?} is not 0-65535")))?;
    let host = match host {
        "" => {
            return Err(bad(format!(
                "{endpoint:?} has no host (use * for all interfaces)"
            )))
        }
        "*" => TcpHost::Ip(IpAddr::V4(Ipv4Addr::UNSPECIFIED)),
        h if h.starts_with('[') && h.ends_with(']') => {
            let a: Ipv6Addr = h[1..h.len() - 1]
                .parse()
                .map_err(|_| bad(format!("{endpoint:?}: {h} is not an IPv6 address")))?;
            TcpHost::Ip(IpAddr::V6(a))
        }
        h => match h.parse::<IpAddr>() {
            Ok(a) => TcpHost::Ip(a),
            Err(_) if h.contains(':') => {
                return Err(bad(format!(
                "{endpoint:?}: {h} is not an IP address (IPv6 goes in brackets: tcp://[::1]:5557)"
            )))
            }
            Err(_) => TcpHost::Name(h.to_string()),
        },
    };
    Ok(Target::Tcp { host, port })
}

impl ZmqEventsConfig {
    /// Checks every setting; the error names the key and what is wrong.
    pub fn check(&self) -> Result<(), EventsError> {
        let bad = |key: &'static str, reason: String| Err(EventsError::Config { key, reason });
        let pub_target = parse_endpoint("endpoint", &self.endpoint)?;
        if let (
            false,
            Target::Tcp {
                host: TcpHost::Ip(ip),
                ..
            },
        ) = (self.binds_pub(), &pub_target)
        {
            if ip.is_unspecified() {
                return bad(
                    "endpoint",
                    format!(
                        "{:?} cannot be connected to; use endpoint_mode = \"bind\" or name the peer",
                        self.endpoint
                    ),
                );
            }
        }
        if let Some(r) = &self.replay_endpoint {
            let replay = parse_endpoint("replay_endpoint", r)?;
            let any_port = matches!(replay, Target::Tcp { port: 0, .. });
            if *r == self.endpoint && !any_port {
                return bad(
                    "replay_endpoint",
                    format!("{r:?} is also the PUB endpoint; give the replay socket its own port"),
                );
            }
        }
        if self.buffer_steps == 0 {
            return bad("buffer_steps", "must be at least 1".into());
        }
        if self.replay_buffer_bytes < 1 << 20 {
            return bad(
                "replay_buffer_bytes",
                format!(
                    "{} is below the minimum of 1048576 (1 MiB)",
                    self.replay_buffer_bytes
                ),
            );
        }
        if self.hwm == 0 || self.hwm > 1_000_000 {
            return bad(
                "hwm",
                format!("{} is outside 1-1000000 (0 would be unlimited)", self.hwm),
            );
        }
        if self.queue_capacity_events == 0 {
            return bad("queue_capacity_events", "must be at least 1".into());
        }
        if self.max_events_per_batch == 0 || self.max_events_per_batch > MAX_EVENTS_PER_BATCH_LIMIT
        {
            return bad(
                "max_events_per_batch",
                format!(
                    "{} is outside 1-{MAX_EVENTS_PER_BATCH_LIMIT}",
                    self.max_events_per_batch
                ),
            );
        }
        if self.replay_timeout_ms == 0 {
            return bad("replay_timeout_ms", "must be at least 1".into());
        }
        Ok(())
    }

    /// Whether the PUB socket binds (`endpoint_mode`, vLLM's rule under `auto`).
    pub fn binds_pub(&self) -> bool {
        match self.endpoint_mode {
            EndpointMode::Bind => true,
            EndpointMode::Connect => false,
            EndpointMode::Auto => {
                self.endpoint.contains('*')
                    || self.endpoint.contains("::")
                    || self.endpoint.starts_with("ipc://")
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(s: &str) -> ZmqEventsConfig {
        toml::from_str(s).unwrap()
    }

    #[test]
    fn defaults_are_vllms_and_pass_the_check() {
        let c = ZmqEventsConfig::default();
        assert_eq!(c.endpoint, "tcp://*:5557");
        assert_eq!(c.replay_endpoint, None);
        assert_eq!(c.topic, "");
        assert_eq!(c.buffer_steps, 10_000);
        assert_eq!(c.queue_capacity_events, 100_000);
        assert!(c.binds_pub());
        c.check().unwrap();
        // An empty table is the defaults.
        assert_eq!(parse(""), c);
    }

    #[test]
    fn a_full_table_parses() {
        let c = parse(
            r#"
            endpoint = "tcp://127.0.0.1:6000"
            endpoint_mode = "bind"
            replay_endpoint = "tcp://*:6001"
            topic = "kv-events"
            encoding = "map"
            block_hash = "bytes"
            buffer_steps = 5
            replay_buffer_bytes = 2097152
            hwm = 50
            queue_capacity_events = 7
            max_events_per_batch = 3
            data_parallel_rank = 2
            replay_timeout_ms = 100
            "#,
        );
        assert_eq!(c.encoding, Encoding::Map);
        assert_eq!(c.block_hash, BlockHashForm::Bytes);
        assert_eq!(c.data_parallel_rank, Some(2));
        assert!(c.binds_pub());
        c.check().unwrap();
    }

    #[test]
    fn unknown_keys_and_bad_values_are_refused() {
        let e = toml::from_str::<ZmqEventsConfig>("max_queue_size = 5").unwrap_err();
        assert!(
            e.to_string().contains("unknown field `max_queue_size`"),
            "{e}"
        );
        let e = toml::from_str::<ZmqEventsConfig>("encoding = \"json\"").unwrap_err();
        assert!(e.to_string().contains("unknown variant"), "{e}");

        let check = |f: &dyn Fn(&mut ZmqEventsConfig)| {
            let mut c = ZmqEventsConfig::default();
            f(&mut c);
            c.check().unwrap_err().to_string()
        };
        assert!(check(&|c| c.buffer_steps = 0).contains("buffer_steps"));
        assert!(check(&|c| c.replay_buffer_bytes = 1000).contains("replay_buffer_bytes"));
        assert!(check(&|c| c.queue_capacity_events = 0).contains("queue_capacity_events"));
        assert!(check(&|c| c.hwm = 0).contains("hwm"));
        assert!(check(&|c| c.max_events_per_batch = 0).contains("max_events_per_batch"));
        assert!(check(&|c| c.max_events_per_batch = 70_000).contains("max_events_per_batch"));
        assert!(check(&|c| c.replay_timeout_ms = 0).contains("replay_timeout_ms"));
        assert!(check(&|c| c.endpoint = "inproc://x".into()).contains("inproc"));
        assert!(check(&|c| c.endpoint = "tcp://*".into()).contains("no :PORT"));
        assert!(check(&|c| c.endpoint = "tcp://*:99999".into()).contains("port"));
        assert!(check(&|c| c.endpoint = "tcp://:5557".into()).contains("no host"));
        assert!(check(&|c| c.endpoint = "udp://x:1".into()).contains("tcp://"));
        assert!(check(&|c| c.endpoint = "ipc://".into()).contains("path"));
        assert!(check(&|c| c.endpoint = "tcp://fe80::zz:5557".into()).contains("not an IP"));
        assert!(check(&|c| c.replay_endpoint = Some(c.endpoint.clone())).contains("own port"));
        assert!(check(&|c| {
            c.endpoint = "tcp://0.0.0.0:5557".into();
            c.endpoint_mode = EndpointMode::Connect;
        })
        .contains("cannot be connected"));
    }

    #[test]
    fn auto_mode_follows_vllms_rule() {
        let mode = |e: &str| ZmqEventsConfig {
            endpoint: e.into(),
            ..Default::default()
        };
        assert!(mode("tcp://*:5557").binds_pub());
        assert!(mode("tcp://[::]:5557").binds_pub());
        assert!(mode("ipc:///tmp/x").binds_pub());
        assert!(!mode("tcp://127.0.0.1:5557").binds_pub());
        assert!(!mode("tcp://router.local:5557").binds_pub());
    }

    #[test]
    fn endpoints_parse() {
        assert_eq!(
            parse_endpoint("endpoint", "tcp://*:0").unwrap(),
            Target::Tcp {
                host: TcpHost::Ip(IpAddr::V4(Ipv4Addr::UNSPECIFIED)),
                port: 0
            }
        );
        assert_eq!(
            parse_endpoint("endpoint", "tcp://[::1]:7").unwrap(),
            Target::Tcp {
                host: TcpHost::Ip("::1".parse().unwrap()),
                port: 7
            }
        );
        assert_eq!(
            parse_endpoint("endpoint", "tcp://localhost:7").unwrap(),
            Target::Tcp {
                host: TcpHost::Name("localhost".into()),
                port: 7
            }
        );
        assert_eq!(
            parse_endpoint("endpoint", "ipc:///run/x.sock").unwrap(),
            Target::Ipc("/run/x.sock".into())
        );
    }
}
