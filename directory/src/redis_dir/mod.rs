//! The `redis` directory kind: the cross-node block directory kept in one Redis (or Valkey)
//! primary, shared by every node that points at it.
//!
//! It owns the directory's keys under its `key_prefix` and nothing else in the database. It
//! never sweeps: staleness and the registration TTL are Redis's native key expiry. It never
//! waits on a silent Redis longer than `timeout_ms`: a call to a Redis that is down, frozen
//! or too slow answers [`DirectoryError::Unavailable`] (connecting and the first answer
//! within `timeout_ms` of the call, each further script answer of a long batch within
//! `timeout_ms` of the one before). [`RedisDirectory::connect`] succeeds while Redis is down:
//! the one multiplexed connection is made by the first call, dropped after a failure or a
//! timeout and made again by a later call (a connection found dead is remade and the call
//! sent again, once, so the first call after a Redis restart succeeds).
//!
//! # Schema
//! - `<prefix>node:<addr>`: a hash `{session, tag, owned, run}` per registered address, with
//!   a `PEXPIRE` of `stale_after_secs` renewed by every heartbeat and insert: the key's
//!   existence *is* the node's liveness. `tag` is a random 64-bit token (16 hex digits) drawn
//!   afresh whenever the node's earlier entries must stop counting (a new registration, a
//!   resync, a Redis restart); `owned` counts the entries inserted under the current tag and
//!   not removed (an upper bound: expired block keys are not subtracted); `run` is the
//!   `run_id` of the Redis process that last saw the node.
//! - `<prefix>b:<namespace>:<hash in hex>`: a hash mapping each owner's `addr` to the `tag`
//!   it inserted under, with an `EXPIRE` of `ttl_minutes` renewed by every insert.
//! - `<prefix>nodes`: the live-node index, a sorted set of addresses scored by when their
//!   record expires (Redis's clock, ms), updated with the record; what `max_nodes` counts
//!   (entries past their score are dropped before counting).
//!
//! An owner is *visible* when its address's node record exists and holds the same tag: a
//! node that went stale, unregistered, resynced or was taken over is invisible at once, and
//! its dead entries are deleted lazily (by inserts and removals touching the key) or expire.
//!
//! Every call is one pipelined round trip of one Lua script (`EVALSHA`, loaded on
//! `NOSCRIPT`), so each check-then-write is atomic on the server: heartbeat (create, refresh,
//! or [`DirectoryError::SessionConflict`]), insert and remove (refused for a session that
//! does not hold the record; removal deletes only the caller's own tag), unregister and
//! resync (O(1): the tag changes, the entries are not walked). A prefix query's script
//! answers the live owners' runs up to the first hash no live owner holds; the greedy cover
//! plan (the contract's, PegaFlow's) is built from them here. Batches longer than
//! `script_batch` hashes are split into several scripts in the same pipeline (a query's runs
//! are joined across them).
//!
//! # Losing state
//! A flush, a restart without persistence, or an expired record leaves the node record
//! absent: the next heartbeat creates it and answers [`HeartbeatAnswer::state_lost`]. A
//! restart *with* data kept (RDB/AOF reload, or a failover to a replica) is seen through the
//! server's `run_id` (read on every new connection and kept in the record): a change draws a
//! new tag (the reloaded entries, possibly older than what the node advertised, stop
//! counting) and also answers `state_lost`. The directory also remembers the tag each node
//! identity last heard of: a heartbeat finding another one answers `state_lost` too, so a
//! reply that told of a new record and was lost (a timeout) is told again.
//!
//! # Bounds
//! Every field is checked before anything is sent ([`crate::limits`]: the storage server's
//! figures; `Invalid` otherwise). A heartbeat creating a record while `max_nodes` records are
//! live, and an insert that would give the record more than `max_blocks_per_node` owned
//! entries, answer `LimitReached`; a refused insert keeps nothing (the script refusing undoes
//! its own keys, and the entries earlier scripts of the call added are removed again). A
//! query's plan has at most [`crate::limits::MAX_PLAN_SEGMENTS`] segments. `owned` is an
//! upper bound (entries that expired still count until a resync or re-registration resets
//! it). Redis's own memory is bounded by its `maxmemory` (a write it refuses answers
//! `Unavailable`).
//!
//! # Topology and late writes
//! The scripts read node records named by the owners they find (keys not passed in
//! `KEYS`), so Redis Cluster is not supported: use a single primary (behind a Sentinel-managed
//! address or a proxy to one primary is fine). A call that answered `Unavailable` after its
//! script was sent may still be applied when Redis wakes up; re-running a script changes
//! nothing more (at worst a count or a reclaimable hash is not reported), and the directory
//! is a hint that holders re-validate.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context};
use async_trait::async_trait;
use futures::stream::{FuturesUnordered, StreamExt};
use pegaflow_plugin::{
    defaults_of, parse_settings, ConfigSchema, Directory, DirectoryError, DirectoryFactory,
    HeartbeatAnswer, InsertAnswer, NodeId, NodePrefix, PluginOption, RuntimeContext,
};
use redis::{AsyncConnectionConfig, Cmd, RedisError, Script, Value};
use serde::{Deserialize, Serialize};

use self::answers::{
    as_int, as_text, cover_plan, parse_insert_answer, parse_query_answer, InsertScript, OwnerRuns,
};
use self::link::{is_link_error, Attempt, Link, Live};
use self::scripts::Scripts;
use crate::limits::{self, echo, Caps};

mod answers;
mod link;
mod scripts;

/// The `[directory] kind = "redis"` table.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields, default)]
pub struct RedisConfig {
    /// Where Redis is: `redis://[user:password@]host:port[/db]` or `redis+unix:///path`.
    /// Default `redis://127.0.0.1:6379`.
    pub url: String,
    /// Prefix of every key the directory writes (several directories can share one Redis
    /// under different prefixes). Default `pegaflow:dir:`.
    pub key_prefix: String,
    /// Seconds without a heartbeat (or insert) after which a node is hidden and its address
    /// may be taken over by another session (PegaFlow's `--node-stale-secs`). Default 30.
    pub stale_after_secs: u64,
    /// Minutes a block entry lives after its last insert (PegaFlow's `--ttl-minutes`); at
    /// least `stale_after_secs`. Default 120.
    pub ttl_minutes: u64,
    /// Milliseconds Redis may stay silent during a call: connecting and the first answer
    /// must come within it, and each further script answer of a batch within it of the one
    /// before; past it the call answers `Unavailable`. Default 250.
    pub timeout_ms: u64,
    /// Visible owners (the inserting node included) at which a hash the node just became an
    /// owner of is answered as reclaimable; 0 reports none. Default 3 (PegaFlow's).
    pub min_reclaimable_owners: u32,
    /// Hashes per script invocation; longer batches are split and pipelined (a script runs
    /// alone on the server, so this bounds how long it holds Redis). Default 1024.
    pub script_batch: usize,
    /// Live nodes (node records) at most: the heartbeat registering one more address is
    /// refused with `LimitReached`. Default: [`Caps::defaults`] (from this machine's memory);
    /// must be > 0. Every process sharing the key prefix should use the same value.
    pub max_nodes: u64,
    /// Entries one node session may own (the record's `owned` count): an insert that would
    /// pass it is refused with `LimitReached` and keeps nothing. Default: [`Caps::defaults`];
    /// must be > 0.
    pub max_blocks_per_node: u64,
}

impl Default for RedisConfig {
    fn default() -> Self {
        Self {
            url: "redis://127.0.0.1:6379".into(),
            key_prefix: "pegaflow:dir:".into(),
            stale_after_secs: 30,
            ttl_minutes: 120,
            timeout_ms: 250,
            min_reclaimable_owners: 3,
            script_batch: 1024,
            max_nodes: Caps::defaults().max_nodes,
            max_blocks_per_node: Caps::defaults().max_blocks_per_node,
        }
    }
}

impl RedisConfig {
    /// Checks the settings (without contacting Redis).
    ///
    /// # Errors
    /// A zero duration or batch, a TTL shorter than the stale interval, an empty key prefix.
    pub fn check(&self) -> anyhow::Result<()> {
        if self.stale_after_secs == 0 {
            bail!("redis directory: stale_after_secs must be > 0");
        }
        if self.ttl_minutes == 0 {
            bail!("redis directory: ttl_minutes must be > 0");
        }
        if self.ttl_minutes.saturating_mul(60) < self.stale_after_secs {
            bail!(
                "redis directory: ttl_minutes ({} min) must be at least stale_after_secs ({} s)",
                self.ttl_minutes,
                self.stale_after_secs
            );
        }
        if self.timeout_ms == 0 {
            bail!("redis directory: timeout_ms must be > 0");
        }
        if self.script_batch == 0 {
            bail!("redis directory: script_batch must be > 0");
        }
        if self.key_prefix.is_empty() {
            bail!("redis directory: key_prefix must not be empty");
        }
        if self.max_nodes == 0 || self.max_blocks_per_node == 0 {
            bail!("redis directory: max_nodes and max_blocks_per_node must be > 0");
        }
        Ok(())
    }

    /// `stale_after_secs` as a duration.
    pub fn stale_after(&self) -> Duration {
        Duration::from_secs(self.stale_after_secs)
    }

    /// `timeout_ms` as a duration.
    pub fn timeout(&self) -> Duration {
        Duration::from_millis(self.timeout_ms)
    }
}

/// The cross-node directory in one Redis primary. See the module documentation.
pub struct RedisDirectory {
    cfg: RedisConfig,
    /// The URL without its password, for messages.
    shown_url: String,
    link: Link,
    scripts: Scripts,
    /// Redis was unreachable at the last call (so a transition is logged once).
    down: AtomicBool,
    /// Per node identity, the record tag of its last answered heartbeat or resync: a
    /// heartbeat finding another tag answers `state_lost` (a reply that told of a new
    /// record, then was lost to a timeout, is not lost for the node).
    known_tags: parking_lot::Mutex<HashMap<NodeId, String>>,
}

impl RedisDirectory {
    /// A directory over the Redis `cfg.url` names. Nothing is contacted here: the
    /// connection is made by the first call (and remade after a failure), so the server
    /// starts while Redis is down and its calls answer `Unavailable` until Redis is up.
    ///
    /// # Errors
    /// A bad setting ([`RedisConfig::check`]) or a URL the client cannot parse.
    pub fn connect(cfg: RedisConfig) -> anyhow::Result<Self> {
        cfg.check()?;
        let shown_url = redact_url(&cfg.url);
        let client = redis::Client::open(cfg.url.as_str())
            .with_context(|| format!("redis directory: bad url {shown_url}"))?;
        // No response timeout on the connection: `eval` bounds every wait itself.
        let options = AsyncConnectionConfig::new().set_connection_timeout(cfg.timeout());
        Ok(Self {
            link: Link::new(client, options, cfg.timeout().min(Duration::from_secs(1))),
            shown_url,
            scripts: Scripts::new(),
            down: AtomicBool::new(false),
            known_tags: parking_lot::Mutex::new(HashMap::new()),
            cfg,
        })
    }

    /// The settings it runs with.
    pub fn config(&self) -> &RedisConfig {
        &self.cfg
    }

    fn node_key_prefix(&self) -> String {
        format!("{}node:", self.cfg.key_prefix)
    }

    fn node_key(&self, addr: &str) -> String {
        format!("{}node:{addr}", self.cfg.key_prefix)
    }

    /// The live-node index: a sorted set of addresses by record expiry (server ms), what
    /// `max_nodes` counts.
    fn node_index_key(&self) -> String {
        format!("{}nodes", self.cfg.key_prefix)
    }

    fn block_key(&self, namespace: &str, hash: &[u8]) -> String {
        let mut k =
            String::with_capacity(self.cfg.key_prefix.len() + namespace.len() + 4 + 2 * hash.len());
        k.push_str(&self.cfg.key_prefix);
        k.push_str("b:");
        k.push_str(namespace);
        k.push(':');
        for b in hash {
            k.push(char::from(HEX[usize::from(b >> 4)]));
            k.push(char::from(HEX[usize::from(b & 0xf)]));
        }
        k
    }

    fn unavailable(&self, why: impl std::fmt::Display) -> DirectoryError {
        let msg = format!("redis at {}: {why}", self.shown_url);
        if !self.down.swap(true, Ordering::Relaxed) {
            tracing::warn!("directory unreachable: {msg}");
        }
        DirectoryError::Unavailable(msg)
    }

    fn mark_up(&self) {
        if self.down.swap(false, Ordering::Relaxed) {
            tracing::info!("directory: redis at {} answers again", self.shown_url);
        }
    }

    /// Runs the commands `build` makes (given the connection's server `run_id`), all
    /// commands of `script`, pipelined on one connection; the commands that answer
    /// `NOSCRIPT` run again once the script is loaded. The answers come in command order.
    /// A connection found dead (Redis restarted since the last call) is remade and the
    /// commands sent again, once.
    ///
    /// The timeout is on progress: connecting and the first answer must come within
    /// `timeout_ms` of the call's start, and every further answer within `timeout_ms` of the
    /// one before (a batch of many scripts may take longer in all; a frozen Redis fails the
    /// call after `timeout_ms`).
    async fn eval(
        &self,
        script: &Script,
        build: impl Fn(&str) -> Vec<Cmd> + Send + Sync,
    ) -> Result<Vec<Value>, DirectoryError> {
        let mut deadline = tokio::time::Instant::now() + self.cfg.timeout();
        let mut retried = false;
        loop {
            let (live, fresh) = match tokio::time::timeout_at(deadline, self.link.get()).await {
                Ok(Ok(l)) => l,
                Ok(Err(why)) => return Err(self.unavailable(why)),
                Err(_) => {
                    return Err(self.unavailable(format_args!(
                        "no connection within {} ms",
                        self.cfg.timeout_ms
                    )))
                }
            };
            let cmds = build(&live.run_id);
            match self.attempt(script, &live, &cmds, &mut deadline).await {
                Ok(v) => {
                    self.mark_up();
                    return Ok(v);
                }
                Err(Attempt::Dead(_)) if !fresh && !retried => {
                    self.link.drop_conn(live.id);
                    retried = true;
                }
                Err(Attempt::Dead(e)) => {
                    self.link.drop_conn(live.id);
                    return Err(self.unavailable(e));
                }
                Err(Attempt::Silent) => {
                    self.link.drop_conn(live.id);
                    return Err(
                        self.unavailable(format_args!("no answer for {} ms", self.cfg.timeout_ms))
                    );
                }
                Err(Attempt::Refused(e)) => {
                    // A replica now (a failover behind the same address): connect again.
                    if e.kind() == redis::ErrorKind::ReadOnly {
                        self.link.drop_conn(live.id);
                    }
                    return Err(self.unavailable(e));
                }
            }
        }
    }

    /// One try of [`Self::eval`] on `live`; `deadline` moves on with every answer.
    async fn attempt(
        &self,
        script: &Script,
        live: &Live,
        cmds: &[Cmd],
        deadline: &mut tokio::time::Instant,
    ) -> Result<Vec<Value>, Attempt> {
        let t = self.cfg.timeout();
        let sort = |e: RedisError| {
            if is_link_error(&e) {
                if e.is_timeout() {
                    Attempt::Silent
                } else {
                    Attempt::Dead(e)
                }
            } else {
                Attempt::Refused(e)
            }
        };
        let mut out: Vec<Value> = vec![Value::Nil; cmds.len()];
        let mut todo: Vec<usize> = (0..cmds.len()).collect();
        let mut loaded = false;
        while !todo.is_empty() {
            let mut pending: FuturesUnordered<_> = todo
                .iter()
                .map(|&i| {
                    let mut conn = live.conn.clone();
                    let c = &cmds[i];
                    async move { (i, c.query_async::<Value>(&mut conn).await) }
                })
                .collect();
            let mut again = Vec::new();
            loop {
                match tokio::time::timeout_at(*deadline, pending.next()).await {
                    Ok(None) => break,
                    Ok(Some((i, r))) => match r {
                        Ok(v) => {
                            *deadline = tokio::time::Instant::now() + t;
                            out[i] = v;
                        }
                        Err(e) if e.kind() == redis::ErrorKind::NoScriptError && !loaded => {
                            *deadline = tokio::time::Instant::now() + t;
                            again.push(i);
                        }
                        Err(e) => return Err(sort(e)),
                    },
                    Err(_) => return Err(Attempt::Silent),
                }
            }
            drop(pending);
            if !again.is_empty() {
                let mut conn = live.conn.clone();
                match tokio::time::timeout_at(*deadline, script.load_async(&mut conn)).await {
                    Ok(Ok(_)) => *deadline = tokio::time::Instant::now() + t,
                    Ok(Err(e)) => return Err(sort(e)),
                    Err(_) => return Err(Attempt::Silent),
                }
                loaded = true;
            }
            todo = again;
        }
        Ok(out)
    }

    /// One `EVALSHA` of `script` over `keys` and `args`.
    fn evalsha(script: &Script, keys: &[&str], args: &[&str]) -> Cmd {
        let mut c = redis::cmd("EVALSHA");
        c.arg(script.get_hash()).arg(keys.len()).arg(keys).arg(args);
        c
    }

    /// Runs `script` once per batch of block keys, each call's keys being the node record
    /// `node_key` followed by the batch, with the same `args`; the answers in batch order.
    async fn eval_node_batches(
        &self,
        script: &Script,
        node_key: &str,
        batches: &[Vec<String>],
        args: &[&str],
    ) -> Result<Vec<Value>, DirectoryError> {
        self.eval(script, |_| {
            batches
                .iter()
                .map(|b| {
                    let keys: Vec<&str> = std::iter::once(node_key)
                        .chain(b.iter().map(String::as_str))
                        .collect();
                    Self::evalsha(script, &keys, args)
                })
                .collect()
        })
        .await
    }

    /// Runs a node script (heartbeat, resync, unregister; its keys the node record and the
    /// live-node index) with the arguments `args` makes from the connection's server
    /// `run_id`, and returns its answer.
    async fn node_script(
        &self,
        script: &Script,
        node: &NodeId,
        args: impl Fn(&str) -> Vec<String> + Send + Sync,
    ) -> Result<Value, DirectoryError> {
        let key = self.node_key(&node.addr);
        let index = self.node_index_key();
        let mut out = self
            .eval(script, |run_id| {
                let args = args(run_id);
                let args: Vec<&str> = args.iter().map(String::as_str).collect();
                vec![Self::evalsha(
                    script,
                    &[key.as_str(), index.as_str()],
                    &args,
                )]
            })
            .await?;
        out.pop()
            .ok_or_else(|| self.unavailable("no script answer"))
    }

    /// As [`Self::node_script`], for the scripts answering a count or -1 (unknown session).
    async fn node_count(
        &self,
        script: &Script,
        node: &NodeId,
        args: impl Fn(&str) -> Vec<String> + Send + Sync,
    ) -> Result<u64, DirectoryError> {
        match self.node_script(script, node, args).await? {
            Value::Int(-1) => Err(DirectoryError::UnknownNode(node.addr.clone())),
            Value::Int(n) => Ok(n.max(0) as u64),
            other => Err(self.unavailable(format_args!("unexpected script answer {other:?}"))),
        }
    }

    /// The block keys of `hashes`, split into script batches.
    fn batches(&self, namespace: &str, hashes: &[Vec<u8>]) -> Vec<Vec<String>> {
        hashes
            .chunks(self.cfg.script_batch)
            .map(|c| c.iter().map(|h| self.block_key(namespace, h)).collect())
            .collect()
    }
}

const HEX: &[u8; 16] = b"0123456789abcdef";

/// A fresh random tag: 16 hex digits.
fn fresh_tag() -> String {
    format!("{:016x}", rand::random::<u64>())
}

/// `url` with any password replaced by `***`.
fn redact_url(url: &str) -> String {
    let Some(scheme_end) = url.find("://").map(|i| i + 3) else {
        return url.to_string();
    };
    let rest = &url[scheme_end..];
    let authority_end = rest.find('/').unwrap_or(rest.len());
    match rest[..authority_end].rfind('@') {
        Some(at) => {
            let user = rest[..at].split(':').next().unwrap_or("");
            let user = if rest[..at].contains(':') {
                format!("{user}:***")
            } else {
                "***".to_string()
            };
            format!("{}{user}{}", &url[..scheme_end], &rest[at..])
        }
        None => url.to_string(),
    }
}

#[async_trait]
impl Directory for RedisDirectory {
    fn kind(&self) -> &'static str {
        "redis"
    }

    async fn heartbeat(&self, node: &NodeId) -> Result<HeartbeatAnswer, DirectoryError> {
        limits::check_node(node)?;
        let stale_ms = (self.cfg.stale_after_secs * 1000).to_string();
        let max_nodes = self.cfg.max_nodes.to_string();
        let known = self
            .known_tags
            .lock()
            .get(node)
            .cloned()
            .unwrap_or_default();
        let answer = self
            .node_script(&self.scripts.heartbeat, node, |run_id| {
                vec![
                    node.session.clone(),
                    stale_ms.clone(),
                    fresh_tag(),
                    run_id.to_string(),
                    known.clone(),
                    node.addr.clone(),
                    max_nodes.clone(),
                ]
            })
            .await?;
        let items = match &answer {
            Value::Array(items) => items.as_slice(),
            _ => &[],
        };
        match items {
            [Value::Int(-1)] => Err(DirectoryError::SessionConflict(node.addr.clone())),
            [Value::Int(-2), Value::Int(n)] => Err(DirectoryError::LimitReached {
                limit: "max_nodes",
                message: format!(
                    "the directory has {n} live nodes; the limit is {} (max_nodes): a node \
                     leaves when it unregisters or goes stale",
                    self.cfg.max_nodes
                ),
            }),
            [Value::Int(lost @ (0 | 1)), tag] => {
                let Some(tag) = as_text(tag) else {
                    return Err(
                        self.unavailable(format_args!("unexpected heartbeat answer {answer:?}"))
                    );
                };
                self.known_tags.lock().insert(node.clone(), tag);
                Ok(HeartbeatAnswer {
                    stale_after: self.cfg.stale_after(),
                    state_lost: *lost == 1,
                })
            }
            _ => Err(self.unavailable(format_args!("unexpected heartbeat answer {answer:?}"))),
        }
    }

    async fn insert(
        &self,
        node: &NodeId,
        namespace: &str,
        hashes: &[Vec<u8>],
    ) -> Result<InsertAnswer, DirectoryError> {
        limits::check_node(node)?;
        limits::check_namespace(namespace)?;
        limits::check_hashes(hashes)?;
        let node_key = self.node_key(&node.addr);
        let ttl = (self.cfg.ttl_minutes * 60).to_string();
        let stale_ms = (self.cfg.stale_after_secs * 1000).to_string();
        let minr = self.cfg.min_reclaimable_owners.to_string();
        let prefix = self.node_key_prefix();
        let index = self.node_index_key();
        let max = self.cfg.max_blocks_per_node.to_string();
        let mut batches = self.batches(namespace, hashes);
        if batches.is_empty() {
            // Still check the session, so an unknown node hears so.
            batches.push(Vec::new());
        }
        let script = &self.scripts.insert;
        let args = [
            node.session.as_str(),
            node.addr.as_str(),
            &ttl,
            &stale_ms,
            &minr,
            &prefix,
            &index,
            &max,
        ];
        let out = self
            .eval_node_batches(script, &node_key, &batches, &args)
            .await?;
        let mut answer = InsertAnswer::default();
        // Keys the scripts that ran made the node an owner of (undone if one was refused).
        let mut added: Vec<String> = Vec::new();
        let mut refused = None;
        for (i, v) in out.iter().enumerate() {
            let Some(a) = parse_insert_answer(v) else {
                return Err(self.unavailable(format_args!("unexpected insert answer {v:?}")));
            };
            match a {
                InsertScript::UnknownSession => {
                    return Err(DirectoryError::UnknownNode(node.addr.clone()))
                }
                InsertScript::Full { owned } => refused = Some(owned),
                InsertScript::Done { marks, reclaimable } => {
                    let base = i * self.cfg.script_batch;
                    for (j, m) in marks.iter().enumerate() {
                        if *m == b'1' {
                            added.extend(batches[i].get(j).cloned());
                        }
                    }
                    for p in reclaimable {
                        if let Some(h) = p.checked_sub(1).and_then(|p| hashes.get(base + p)) {
                            answer.reclaimable.push(h.clone());
                        }
                    }
                }
            }
        }
        if let Some(owned) = refused {
            if !added.is_empty() {
                let undo: Vec<Vec<String>> = added
                    .chunks(self.cfg.script_batch)
                    .map(<[String]>::to_vec)
                    .collect();
                let margs = [node.session.as_str(), node.addr.as_str()];
                if let Err(e) = self
                    .eval_node_batches(&self.scripts.remove, &node_key, &undo, &margs)
                    .await
                {
                    tracing::warn!(node = %echo(&node.addr), error = %e,
                        "redis directory: cannot take back the entries of a refused insert");
                }
            }
            return Err(DirectoryError::LimitReached {
                limit: "max_blocks_per_node",
                message: format!(
                    "node {} owns {owned} block entries; the limit is {} (max_blocks_per_node); \
                     nothing of this insert was kept",
                    echo(&node.addr),
                    self.cfg.max_blocks_per_node
                ),
            });
        }
        answer.inserted = hashes.len() as u64;
        Ok(answer)
    }

    async fn remove(
        &self,
        node: &NodeId,
        namespace: &str,
        hashes: &[Vec<u8>],
    ) -> Result<u64, DirectoryError> {
        limits::check_node(node)?;
        limits::check_namespace(namespace)?;
        limits::check_hashes(hashes)?;
        let node_key = self.node_key(&node.addr);
        let mut batches = self.batches(namespace, hashes);
        if batches.is_empty() {
            batches.push(Vec::new());
        }
        let script = &self.scripts.remove;
        let args = [node.session.as_str(), node.addr.as_str()];
        let out = self
            .eval_node_batches(script, &node_key, &batches, &args)
            .await?;
        let mut removed = 0u64;
        for v in &out {
            match as_int(v) {
                Some(-1) => return Err(DirectoryError::UnknownNode(node.addr.clone())),
                Some(n) if n >= 0 => removed += n as u64,
                _ => return Err(self.unavailable(format_args!("unexpected remove answer {v:?}"))),
            }
        }
        Ok(removed)
    }

    async fn query_prefix(
        &self,
        namespace: &str,
        hashes: &[Vec<u8>],
        exclude: Option<&str>,
    ) -> Result<Vec<NodePrefix>, DirectoryError> {
        limits::check_namespace(namespace)?;
        limits::check_hashes(hashes)?;
        limits::check_exclude(exclude)?;
        if hashes.is_empty() {
            return Err(DirectoryError::Invalid("empty hash list".into()));
        }
        let batches = self.batches(namespace, hashes);
        let prefix = self.node_key_prefix();
        let script = &self.scripts.query;
        let out = self
            .eval(script, |_| {
                batches
                    .iter()
                    .map(|b| {
                        let keys: Vec<&str> = b.iter().map(String::as_str).collect();
                        Self::evalsha(script, &keys, &[&prefix])
                    })
                    .collect()
            })
            .await?;
        // Each chunk's runs, shifted to positions in `hashes` and joined across chunk
        // boundaries; the scan ends at the first position nobody live holds.
        let mut owners: OwnerRuns = Vec::new();
        let mut stop = hashes.len() as u32;
        let mut base = 0u32;
        for (c, v) in out.iter().enumerate() {
            let Some((chunk_stop, runs)) = parse_query_answer(v) else {
                return Err(self.unavailable(format_args!("unexpected query answer {v:?}")));
            };
            for (addr, list) in runs {
                let at = match owners.iter().position(|(a, _)| *a == addr) {
                    Some(at) => at,
                    None => {
                        owners.push((addr, Vec::new()));
                        owners.len() - 1
                    }
                };
                let mine = &mut owners[at].1;
                for (start, len) in list {
                    let (start, end) = (base + start, base + start + len);
                    match mine.last_mut() {
                        Some(last) if last.1 == start => last.1 = end,
                        _ => mine.push((start, end)),
                    }
                }
            }
            let chunk_len = batches[c].len() as u32;
            if chunk_stop < chunk_len {
                stop = base + chunk_stop;
                break;
            }
            base += chunk_len;
        }
        // An excluded address holds nothing: the plan stops where the others stop.
        if let Some(x) = exclude {
            owners.retain(|(a, _)| a != x);
        }
        Ok(cover_plan(&owners, stop))
    }

    async fn unregister(&self, node: &NodeId) -> Result<u64, DirectoryError> {
        limits::check_node(node)?;
        let n = self
            .node_count(&self.scripts.unregister, node, |_| {
                vec![node.session.clone(), node.addr.clone()]
            })
            .await?;
        self.known_tags.lock().remove(node);
        Ok(n)
    }

    async fn resync(&self, node: &NodeId) -> Result<u64, DirectoryError> {
        limits::check_node(node)?;
        let tag = fresh_tag();
        let n = self
            .node_count(&self.scripts.resync, node, |_| {
                vec![node.session.clone(), tag.clone()]
            })
            .await?;
        self.known_tags.lock().insert(node.clone(), tag);
        Ok(n)
    }
}

fn build_redis(table: &toml::Table, _ctx: &RuntimeContext) -> anyhow::Result<Arc<dyn Directory>> {
    let cfg: RedisConfig = parse_settings("redis directory", table)?;
    Ok(Arc::new(RedisDirectory::connect(cfg)?))
}

inventory::submit! {
    DirectoryFactory {
        kind: "redis",
        summary: "the block directory in one Redis/Valkey primary shared by all nodes: native key expiry, server-side scripts, short timeouts",
        config: ConfigSchema {
            defaults: defaults_of::<RedisConfig>,
            check: |w, t| parse_settings::<RedisConfig>(w, t)?.check(),
            options: &[
                PluginOption { name: "url", help: "Redis to use: redis://[user:password@]host:port[/db] or redis+unix:///path (a single primary; Redis Cluster is not supported)" },
                PluginOption { name: "key_prefix", help: "prefix of every key the directory writes (directories sharing one Redis need different prefixes)" },
                PluginOption { name: "stale_after_secs", help: "seconds without a heartbeat after which a node is hidden and its address may be taken over (PegaFlow's --node-stale-secs)" },
                PluginOption { name: "ttl_minutes", help: "minutes a block entry lives after its last insert (PegaFlow's --ttl-minutes); at least stale_after_secs" },
                PluginOption { name: "timeout_ms", help: "milliseconds Redis may stay silent during a call (connecting and the first answer, then each further script answer of a batch); past it the call answers unavailable" },
                PluginOption { name: "min_reclaimable_owners", help: "live owners at which a block the node just inserted is reported reclaimable; 0 reports none" },
                PluginOption { name: "script_batch", help: "hashes per server-side script; larger batches are split and pipelined" },
                PluginOption { name: "max_nodes", help: "live nodes at most; the heartbeat registering one more address is refused (default: from this machine's memory, as pegaflow-metaserver's --max-nodes)" },
                PluginOption { name: "max_blocks_per_node", help: "entries one node session may own; an insert that would pass it is refused whole (default: as pegaflow-metaserver's --max-blocks-per-node)" },
            ],
        },
        flags: &[],
        build: build_redis,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn redacts_passwords() {
        assert_eq!(
            redact_url("redis://127.0.0.1:6379"),
            "redis://127.0.0.1:6379"
        );
        assert_eq!(redact_url("redis://u:pw@h:1/0"), "redis://u:***@h:1/0");
        assert_eq!(redact_url("redis://:pw@h:1"), "redis://:***@h:1");
        assert_eq!(redact_url("redis://pw@h:1"), "redis://***@h:1");
        assert_eq!(
            redact_url("redis+unix:///tmp/r.sock"),
            "redis+unix:///tmp/r.sock"
        );
    }

    #[test]
    fn checks_settings() {
        assert!(RedisConfig::default().check().is_ok());
        let bad = RedisConfig {
            ttl_minutes: 1,
            stale_after_secs: 61,
            ..RedisConfig::default()
        };
        assert!(bad.check().is_err());
        assert!(RedisConfig {
            timeout_ms: 0,
            ..RedisConfig::default()
        }
        .check()
        .is_err());
    }

    #[test]
    fn parses_its_table_and_refuses_unknown_keys() {
        let t: toml::Table = toml::from_str("url = \"redis://h:1\"\ntimeout_ms = 100").unwrap();
        let c: RedisConfig = parse_settings("redis directory", &t).unwrap();
        assert_eq!(c.url, "redis://h:1");
        assert_eq!(c.timeout_ms, 100);
        assert_eq!(c.stale_after_secs, 30);
        let t: toml::Table = toml::from_str("urll = \"x\"").unwrap();
        assert!(parse_settings::<RedisConfig>("redis directory", &t).is_err());
    }

    #[test]
    fn block_keys_are_prefixed_hex() {
        let d = RedisDirectory::connect(RedisConfig::default()).unwrap();
        assert_eq!(d.block_key("ns", &[0x01, 0xab]), "pegaflow:dir:b:ns:01ab");
        assert_eq!(
            d.node_key("10.0.0.1:50055"),
            "pegaflow:dir:node:10.0.0.1:50055"
        );
    }

    #[test]
    fn schema_is_documented() {
        let f = inventory::iter::<DirectoryFactory>()
            .find(|f| f.kind == "redis")
            .unwrap();
        assert!(
            f.config.doc_problems().is_empty(),
            "{:?}",
            f.config.doc_problems()
        );
    }
}
