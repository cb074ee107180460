//! Peer fetch between two network namespaces joined by a veth pair (two "hosts" with their
//! own addresses, nothing on loopback in common): the directory's Redis runs in the first,
//! a server in each; a block saved in the first is fetched over TCP by the second and loads
//! byte-exact there. The test creates the namespaces and the veth pair as root and removes
//! them however it ends (a Drop guard); without root, `ip`, `redis-server` or the server
//! binary it reports itself skipped (`pegaflow_tests::skip!`) and returns.

mod peer_support;

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use peer_support::*;
use pegaflow_tests::harness::KvShape;

const SHAPE: KvShape = KvShape {
    layers: 2,
    num_blocks: 32,
    segment_bytes: 8192,
};

/// Two namespaces and a veth pair between them, removed on drop (with what runs inside).
struct Netns {
    a: String,
    b: String,
    ip_a: String,
    ip_b: String,
    redis: Option<Child>,
}

fn ip(args: &[&str]) -> Result<(), String> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .map_err(|e| format!("ip {}: {e}", args.join(" ")))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "ip {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

impl Netns {
    fn create() -> Result<Self, String> {
        let id = std::process::id();
        let octet = 10 + id % 200;
        let n = Self {
            a: format!("pfa{id}"),
            b: format!("pfb{id}"),
            ip_a: format!("10.213.{octet}.1"),
            ip_b: format!("10.213.{octet}.2"),
            redis: None,
        };
        let (va, vb) = (format!("pfva{id}"), format!("pfvb{id}"));
        ip(&["netns", "add", &n.a])?;
        ip(&["netns", "add", &n.b])?;
        ip(&["link", "add", &va, "type", "veth", "peer", "name", &vb])?;
        ip(&["link", "set", &va, "netns", &n.a])?;
        ip(&["link", "set", &vb, "netns", &n.b])?;
        for (ns, dev, addr) in [(&n.a, &va, &n.ip_a), (&n.b, &vb, &n.ip_b)] {
            ip(&["-n", ns, "addr", "add", &format!("{addr}/24"), "dev", dev])?;
            ip(&["-n", ns, "link", "set", dev, "up"])?;
            ip(&["-n", ns, "link", "set", "lo", "up"])?;
        }
        Ok(n)
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        if let Some(mut r) = self.redis.take() {
            let _ = r.kill();
            let _ = r.wait();
        }
        // Deleting a namespace removes the veth end inside it, and with it the pair.
        let _ = ip(&["netns", "del", &self.a]);
        let _ = ip(&["netns", "del", &self.b]);
    }
}

#[test]
fn a_block_crosses_a_veth_pair_between_network_namespaces() {
    let test = "a_block_crosses_a_veth_pair_between_network_namespaces";
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        pegaflow_tests::skip!("{test}: needs root to create network namespaces");
        return;
    }
    if Command::new("ip").arg("-V").output().is_err() {
        pegaflow_tests::skip!("{test}: the `ip` command (iproute2) is missing");
        return;
    }
    let Some(redis_bin) = pegaflow_tests::redis::redis_server_bin() else {
        pegaflow_tests::skip!("{test}: redis-server is not installed");
        return;
    };
    let Some(bin) = server_bin(test) else {
        return;
    };
    let mut net = match Netns::create() {
        Ok(n) => n,
        Err(e) => {
            pegaflow_tests::skip!("{test}: cannot create network namespaces here: {e}");
            return;
        }
    };
    let redis_port = 6379;
    net.redis = Some(
        Command::new("ip")
            .args(["netns", "exec", &net.a])
            .arg(&redis_bin)
            .args(["--port", &redis_port.to_string(), "--bind", &net.ip_a])
            .args(["--save", "", "--appendonly", "no", "--protected-mode", "no"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn redis-server in the namespace"),
    );
    let redis_addr = format!("{}:{redis_port}", net.ip_a);
    let up = in_netns(Some(&net.a), || {
        let end = Instant::now() + Duration::from_secs(10);
        while std::net::TcpStream::connect(&redis_addr).is_err() {
            if Instant::now() > end {
                return false;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        true
    });
    assert!(up, "redis-server listens in namespace {}", net.a);
    let dir = Some((format!("redis://{redis_addr}"), "pf:netns:".to_string()));
    let a = Node::start(
        &bin,
        "source",
        &NodeOpts {
            directory: dir.clone(),
            ip: net.ip_a.clone(),
            netns: Some(net.a.clone()),
            ..NodeOpts::default()
        },
    );
    let b = Node::start(
        &bin,
        "requester",
        &NodeOpts {
            directory: dir,
            ip: net.ip_b.clone(),
            netns: Some(net.b.clone()),
            ..NodeOpts::default()
        },
    );
    let hs = hashes("netns", 16);
    // The source's worker registers and saves from inside the first namespace.
    let a_ns = net.a.clone();
    let hs_a = hs.clone();
    block_on_in_netns(Some(&a_ns), async {
        let mut wa = worker(&a, "inst-a", SHAPE).await;
        save(&mut wa, 0, &hs_a).await;
    });
    // The requester's worker fetches, loads and checks from inside the second.
    let b_ns = net.b.clone();
    let hs_b = hs.clone();
    let settled = block_on_in_netns(Some(&b_ns), async {
        let mut wb = worker(&b, "inst-b", SHAPE).await;
        let s = settle_all(&mut wb, &hs_b, 16, Duration::from_secs(15)).await;
        load_exact(&mut wb, &s.lease, 8, &hs_b).await;
        s
    });
    assert!(settled.loading > 0, "fetched across the pair: {settled:?}");
    assert_eq!(b.metric("pegaflow_peer_fetch_blocks_total", &[]), 16.0);
    assert!(
        a.metric("pegaflow_peer_serve_bytes_total", &[]) >= 16.0 * 2.0 * 2.0 * 8192.0,
        "the source sent the bytes over its data port"
    );
    drop(b);
    drop(a);
    drop(net);
}
