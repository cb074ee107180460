//! Reading a few counters from a server's Prometheus `/metrics` endpoint (plain HTTP/1.0 on
//! loopback; no client library needed for one GET).

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use anyhow::Context;

/// The server counters a replay reports.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct ServerCounters {
    /// `pegaflow_cache_block_evictions_total`.
    pub evictions: u64,
    /// `pegaflow_cache_block_insertions_total`.
    pub insertions: u64,
    /// `pegaflow_cache_block_hits_total`.
    pub hits: u64,
    /// `pegaflow_save_bytes_total`.
    pub save_bytes: u64,
    /// `pegaflow_load_bytes_total`.
    pub load_bytes: u64,
}

impl ServerCounters {
    /// The counters of an in-process engine, once every Save that answered before this call
    /// is sealed and indexed (a Save answers before its seal, which counts the insertions;
    /// blocks the calling thread until then).
    ///
    /// A server scraped over HTTP ([`ServerCounters::scrape`]) has no such barrier: right
    /// after a Save its insertions may not be counted yet.
    pub fn of_engine(engine: &pegaflow_runtime::engine::Engine) -> Self {
        // The read-only view of the index waits for the pending seals.
        let _ = engine.index();
        let m = engine.metrics();
        Self {
            evictions: m.cache_block_evictions.get(),
            insertions: m.cache_block_insertions.get(),
            hits: m.cache_block_hits.get(),
            save_bytes: m.save_bytes.get(),
            load_bytes: m.load_bytes.get(),
        }
    }

    /// The counters in Prometheus text `text` (missing ones read 0).
    pub fn parse(text: &str) -> Self {
        let mut v: HashMap<&str, f64> = HashMap::new();
        for line in text.lines() {
            if line.starts_with('#') {
                continue;
            }
            let mut it = line.split_whitespace();
            if let (Some(name), Some(val)) = (it.next(), it.next()) {
                if let Ok(x) = val.parse::<f64>() {
                    v.insert(name, x);
                }
            }
        }
        let g = |k: &str| v.get(k).copied().unwrap_or(0.0) as u64;
        Self {
            evictions: g("pegaflow_cache_block_evictions_total"),
            insertions: g("pegaflow_cache_block_insertions_total"),
            hits: g("pegaflow_cache_block_hits_total"),
            save_bytes: g("pegaflow_save_bytes_total"),
            load_bytes: g("pegaflow_load_bytes_total"),
        }
    }

    /// Fetches `http://{addr}/metrics` and parses it.
    pub fn scrape(addr: &str) -> anyhow::Result<Self> {
        let mut s =
            TcpStream::connect(addr).with_context(|| format!("cannot connect to {addr}"))?;
        s.set_read_timeout(Some(Duration::from_secs(10)))?;
        write!(s, "GET /metrics HTTP/1.0\r\nHost: {addr}\r\n\r\n")?;
        let mut body = String::new();
        s.read_to_string(&mut body)
            .with_context(|| format!("cannot read http://{addr}/metrics"))?;
        let (head, text) = body
            .split_once("\r\n\r\n")
            .with_context(|| format!("http://{addr}/metrics: malformed HTTP response"))?;
        if !head.starts_with("HTTP/1.1 200") && !head.starts_with("HTTP/1.0 200") {
            anyhow::bail!(
                "http://{addr}/metrics answered {}",
                head.lines().next().unwrap_or("")
            );
        }
        Ok(Self::parse(text))
    }

    /// `self - before`, counter by counter.
    pub fn since(&self, before: &Self) -> Self {
        Self {
            evictions: self.evictions.saturating_sub(before.evictions),
            insertions: self.insertions.saturating_sub(before.insertions),
            hits: self.hits.saturating_sub(before.hits),
            save_bytes: self.save_bytes.saturating_sub(before.save_bytes),
            load_bytes: self.load_bytes.saturating_sub(before.load_bytes),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_prometheus_text() {
        let t = "# HELP x y\n# TYPE pegaflow_cache_block_evictions_total counter\n\
                 pegaflow_cache_block_evictions_total 12\npegaflow_save_bytes_total 1.5e3\n\
                 pegaflow_rpc_requests_total{method=\"Save\"} 3\n";
        let c = ServerCounters::parse(t);
        assert_eq!(c.evictions, 12);
        assert_eq!(c.save_bytes, 1500);
        assert_eq!(c.insertions, 0);
    }
}
