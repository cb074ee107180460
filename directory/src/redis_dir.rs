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
//! # Limits
//! The scripts read node records named by the owners they find (keys not passed in
//! `KEYS`), so Redis Cluster is not supported: use a single primary (behind a Sentinel-managed
//! address or a proxy to one primary is fine). A call that answered `Unavailable` after its
//! script was sent may still be applied when Redis wakes up; re-running a script changes
//! nothing more (at worst a count or a reclaimable hash is not reported), and the directory
//! is a hint that holders re-validate.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use async_trait::async_trait;
use futures::stream::{FuturesUnordered, StreamExt};
use pegaflow_runtime::{
    defaults_of, parse_settings, ConfigSchema, Directory, DirectoryError, DirectoryFactory,
    HeartbeatAnswer, InsertAnswer, NodeId, NodePrefix, PluginOption, RuntimeContext,
};
use redis::aio::MultiplexedConnection;
use redis::{AsyncConnectionConfig, Cmd, RedisError, Script, Value};
use serde::{Deserialize, Serialize};

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

/// Creates the node record, refreshes it, or refuses another session. KEYS[1] node record;
/// ARGV: session, stale ms, fresh tag, server run_id ('' = unknown), the tag the caller last
/// heard of ('' = none). Returns {-1} (conflict) or {lost, tag}: lost is 1 when the record
/// is new, was reloaded by another server process (then it gets the fresh tag), or holds a
/// tag the caller has not heard of (an earlier answer was lost on the way).
const HEARTBEAT_LUA: &str = r"
local rec = redis.call('HMGET', KEYS[1], 'session', 'run', 'tag')
if not rec[1] then
  redis.call('HSET', KEYS[1], 'session', ARGV[1], 'tag', ARGV[3], 'owned', 0, 'run', ARGV[4])
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return {1, ARGV[3]}
end
if rec[1] ~= ARGV[1] then return {-1} end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
if (ARGV[4] ~= '' and rec[2] ~= ARGV[4]) or not rec[3] then
  redis.call('HSET', KEYS[1], 'tag', ARGV[3], 'owned', 0, 'run', ARGV[4])
  return {1, ARGV[3]}
end
if rec[3] ~= ARGV[5] then return {1, rec[3]} end
return {0, rec[3]}
";

/// Records ownership. KEYS[1] node record, KEYS[2..] block keys; ARGV: session, addr, ttl
/// secs, stale ms, min reclaimable (0 = off), node key prefix. Returns {-1} (unknown
/// session) or {0, newly owned, 1-based positions of reclaimable keys...}.
const INSERT_LUA: &str = r"
local rec = redis.call('HMGET', KEYS[1], 'session', 'tag')
if rec[1] ~= ARGV[1] or not rec[2] then return {-1} end
local tag, addr, ttl, minr = rec[2], ARGV[2], ARGV[3], tonumber(ARGV[5])
local tags = {[addr] = tag}
local function live(a)
  local t = tags[a]
  if t == nil then
    t = redis.call('HGET', ARGV[6] .. a, 'tag')
    tags[a] = t
  end
  return t
end
local out = {0, 0}
local added = 0
for i = 2, #KEYS do
  local k = KEYS[i]
  if redis.call('HGET', k, addr) ~= tag then
    redis.call('HSET', k, addr, tag)
    added = added + 1
    if minr > 0 and redis.call('HLEN', k) >= minr then
      local f = redis.call('HGETALL', k)
      local n = 0
      for j = 1, #f, 2 do
        if live(f[j]) == f[j + 1] then n = n + 1 else redis.call('HDEL', k, f[j]) end
      end
      if n >= minr then out[#out + 1] = i - 1 end
    end
  end
  redis.call('EXPIRE', k, ttl)
end
if added > 0 then redis.call('HINCRBY', KEYS[1], 'owned', added) end
redis.call('PEXPIRE', KEYS[1], ARGV[4])
out[2] = added
return out
";

/// Drops ownership. KEYS[1] node record, KEYS[2..] block keys; ARGV: session, addr. The
/// address's field is deleted when it holds the caller's tag (counted) or a dead earlier tag
/// of the same address (not counted; never visible again). Returns the count, or -1.
const REMOVE_LUA: &str = r"
local rec = redis.call('HMGET', KEYS[1], 'session', 'tag')
if rec[1] ~= ARGV[1] or not rec[2] then return -1 end
local removed = 0
for i = 2, #KEYS do
  local v = redis.call('HGET', KEYS[i], ARGV[2])
  if v then
    redis.call('HDEL', KEYS[i], ARGV[2])
    if v == rec[2] then removed = removed + 1 end
  end
end
if removed > 0 then redis.call('HINCRBY', KEYS[1], 'owned', -removed) end
return removed
";

/// The live owners' runs over consecutive keys. KEYS: block keys in order; ARGV[1] node key
/// prefix. Returns {stop, {addr, start, len, start, len, ...}, ...}: `stop` is the 0-based
/// position of the first key no live owner holds (#KEYS when there is none; the scan ends
/// there), and each owner's runs (0-based start, length) before it, in order.
const QUERY_LUA: &str = r"
local tags = {}
local function live(a)
  local t = tags[a]
  if t == nil then
    t = redis.call('HGET', ARGV[1] .. a, 'tag')
    tags[a] = t
  end
  return t
end
local runs, order, last = {}, {}, {}
local stop = #KEYS
for i = 1, #KEYS do
  local f = redis.call('HGETALL', KEYS[i])
  local any = false
  for j = 1, #f, 2 do
    local a = f[j]
    if live(a) == f[j + 1] then
      any = true
      local r = runs[a]
      if r == nil then
        r = {a}
        runs[a] = r
        order[#order + 1] = a
      end
      if last[a] == i - 1 then
        r[#r] = r[#r] + 1
      else
        r[#r + 1] = i - 1
        r[#r + 1] = 1
      end
      last[a] = i
    end
  end
  if not any then
    stop = i - 1
    break
  end
end
local out = {stop}
for _, a in ipairs(order) do out[#out + 1] = runs[a] end
return out
";

/// Forgets the session's entries by drawing a new tag. KEYS[1] node record; ARGV: session,
/// fresh tag. Returns the entries owned under the old tag, or -1.
const RESYNC_LUA: &str = r"
local rec = redis.call('HMGET', KEYS[1], 'session', 'owned')
if rec[1] ~= ARGV[1] then return -1 end
redis.call('HSET', KEYS[1], 'tag', ARGV[2], 'owned', 0)
return tonumber(rec[2] or '0')
";

/// Forgets the node. KEYS[1] node record; ARGV: session. Returns the entries it owned, or -1.
const UNREGISTER_LUA: &str = r"
local rec = redis.call('HMGET', KEYS[1], 'session', 'owned')
if rec[1] ~= ARGV[1] then return -1 end
redis.call('DEL', KEYS[1])
return tonumber(rec[2] or '0')
";

/// The scripts, hashed once.
struct Scripts {
    heartbeat: Script,
    insert: Script,
    remove: Script,
    query: Script,
    resync: Script,
    unregister: Script,
}

impl Scripts {
    fn new() -> Self {
        Self {
            heartbeat: Script::new(HEARTBEAT_LUA),
            insert: Script::new(INSERT_LUA),
            remove: Script::new(REMOVE_LUA),
            query: Script::new(QUERY_LUA),
            resync: Script::new(RESYNC_LUA),
            unregister: Script::new(UNREGISTER_LUA),
        }
    }
}

/// One established connection and what was learnt when it was made.
#[derive(Clone)]
struct Live {
    /// Distinguishes connections, so that a failed call drops only the one it used.
    id: u64,
    conn: MultiplexedConnection,
    /// The server process's `run_id` (`INFO server`); empty when the server hides it.
    run_id: Arc<str>,
}

#[derive(Default)]
struct LinkState {
    current: Option<Live>,
    next_id: u64,
    /// The last failed connection attempt: when, and why.
    failed: Option<(Instant, String)>,
}

/// A lazily made, remade-after-failure multiplexed connection. The state lock is never held
/// across an await; `connecting` lets one caller connect while the others wait for it (each
/// within its own call's timeout).
struct Link {
    client: redis::Client,
    options: AsyncConnectionConfig,
    /// After a failed attempt, calls fail at once for this long instead of reconnecting.
    retry_after: Duration,
    state: parking_lot::Mutex<LinkState>,
    connecting: tokio::sync::Mutex<()>,
}

impl Link {
    fn cached(&self) -> Option<Live> {
        self.state.lock().current.clone()
    }

    /// The current connection, made now if there is none (then `true` comes with it).
    async fn get(&self) -> Result<(Live, bool), String> {
        if let Some(l) = self.cached() {
            return Ok((l, false));
        }
        let _one = self.connecting.lock().await;
        {
            let st = self.state.lock();
            if let Some(l) = &st.current {
                return Ok((l.clone(), false));
            }
            if let Some((at, why)) = &st.failed {
                if at.elapsed() < self.retry_after {
                    return Err(why.clone());
                }
            }
        }
        match self.open().await {
            Ok((conn, run_id)) => {
                let mut st = self.state.lock();
                st.next_id += 1;
                let live = Live {
                    id: st.next_id,
                    conn,
                    run_id: run_id.into(),
                };
                st.current = Some(live.clone());
                st.failed = None;
                Ok((live, true))
            }
            Err(e) => {
                let why = format!("cannot connect: {e}");
                self.state.lock().failed = Some((Instant::now(), why.clone()));
                Err(why)
            }
        }
    }

    /// Connects and reads the server's `run_id`.
    async fn open(&self) -> redis::RedisResult<(MultiplexedConnection, String)> {
        let mut conn = self
            .client
            .get_multiplexed_async_connection_with_config(&self.options)
            .await?;
        let run_id = match redis::cmd("INFO")
            .arg("server")
            .query_async::<String>(&mut conn)
            .await
        {
            Ok(info) => info
                .lines()
                .find_map(|l| l.strip_prefix("run_id:"))
                .map(|s| s.trim().to_string())
                .unwrap_or_default(),
            Err(e) if is_link_error(&e) => return Err(e),
            Err(e) => {
                tracing::debug!(
                    "redis directory: INFO refused ({e}); restarts that keep data go unnoticed"
                );
                String::new()
            }
        };
        Ok((conn, run_id))
    }

    /// Forgets connection `id` (if it is still the current one) so the next call reconnects.
    fn drop_conn(&self, id: u64) {
        let mut st = self.state.lock();
        if st.current.as_ref().is_some_and(|l| l.id == id) {
            st.current = None;
        }
    }
}

/// Errors after which the connection is not trusted any more.
fn is_link_error(e: &RedisError) -> bool {
    e.is_io_error() || e.is_timeout() || e.is_connection_dropped() || e.is_unrecoverable_error()
}

/// How one try of a call failed.
enum Attempt {
    /// The connection broke (or was found broken): the commands may not have run.
    Dead(RedisError),
    /// Redis did not answer within the timeout.
    Silent,
    /// Redis answered with an error (out of memory, loading, a replica, ...).
    Refused(RedisError),
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
            link: Link {
                client,
                options,
                retry_after: cfg.timeout().min(Duration::from_secs(1)),
                state: parking_lot::Mutex::new(LinkState::default()),
                connecting: tokio::sync::Mutex::new(()),
            },
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

    /// Runs a one-key node script (heartbeat, resync, unregister) with the arguments `args`
    /// makes from the connection's server `run_id`, and returns its answer.
    async fn node_script(
        &self,
        script: &Script,
        node: &NodeId,
        args: impl Fn(&str) -> Vec<String> + Send + Sync,
    ) -> Result<Value, DirectoryError> {
        let key = self.node_key(&node.addr);
        let mut out = self
            .eval(script, |run_id| {
                let args = args(run_id);
                let args: Vec<&str> = args.iter().map(String::as_str).collect();
                vec![Self::evalsha(script, &[key.as_str()], &args)]
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

fn as_int(v: &Value) -> Option<i64> {
    match v {
        Value::Int(n) => Some(*n),
        _ => None,
    }
}

fn as_text(v: &Value) -> Option<String> {
    match v {
        Value::BulkString(b) => String::from_utf8(b.clone()).ok(),
        Value::SimpleString(s) => Some(s.clone()),
        _ => None,
    }
}

/// Each live owner's address with its runs of positions: `(start, end)` or `(start, len)`.
type OwnerRuns = Vec<(String, Vec<(u32, u32)>)>;

/// A query script's answer: the stop position and each owner's `(start, len)` runs.
fn parse_query_answer(v: &Value) -> Option<(u32, OwnerRuns)> {
    let Value::Array(items) = v else {
        return None;
    };
    let (stop, rest) = items.split_first()?;
    let stop = u32::try_from(as_int(stop)?).ok()?;
    let mut owners = Vec::with_capacity(rest.len());
    for o in rest {
        let Value::Array(o) = o else {
            return None;
        };
        let (addr, nums) = o.split_first()?;
        let nums: Vec<u32> = nums
            .iter()
            .map(|n| as_int(n).and_then(|n| u32::try_from(n).ok()))
            .collect::<Option<_>>()?;
        let pairs = nums.chunks_exact(2);
        if !pairs.remainder().is_empty() {
            return None;
        }
        let runs = pairs.map(|p| (p[0], p[1])).collect();
        owners.push((as_text(addr)?, runs));
    }
    Some((stop, owners))
}

/// The greedy cover plan of positions `0..stop`: from each position, the owner whose run
/// there reaches furthest (ties: the smallest address) takes the rest of its run. `owners`
/// holds each live owner's runs as sorted, disjoint `[start, end)` ranges.
fn cover_plan(owners: &[(String, Vec<(u32, u32)>)], stop: u32) -> Vec<NodePrefix> {
    let mut plan = Vec::new();
    let mut p = 0u32;
    while p < stop {
        let mut best: Option<(&str, u32)> = None;
        for (addr, runs) in owners {
            let i = runs.partition_point(|&(s, _)| s <= p);
            let Some(&(_, end)) = i.checked_sub(1).and_then(|i| runs.get(i)) else {
                continue;
            };
            if end <= p {
                continue;
            }
            let len = end.min(stop) - p;
            let better = match best {
                None => true,
                Some((b, l)) => len > l || (len == l && addr.as_str() < b),
            };
            if better {
                best = Some((addr, len));
            }
        }
        let Some((addr, len)) = best else { break };
        plan.push(NodePrefix {
            node: addr.to_string(),
            prefix_len: len,
        });
        p += len;
    }
    plan
}

fn usable(node: &NodeId) -> bool {
    !node.addr.is_empty() && !node.session.is_empty()
}

#[async_trait]
impl Directory for RedisDirectory {
    fn kind(&self) -> &'static str {
        "redis"
    }

    async fn heartbeat(&self, node: &NodeId) -> Result<HeartbeatAnswer, DirectoryError> {
        if !usable(node) {
            return Err(DirectoryError::Invalid(
                "heartbeat needs a node address and a session".into(),
            ));
        }
        let stale_ms = (self.cfg.stale_after_secs * 1000).to_string();
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
                ]
            })
            .await?;
        let items = match &answer {
            Value::Array(items) => items.as_slice(),
            _ => &[],
        };
        match items {
            [Value::Int(-1)] => Err(DirectoryError::SessionConflict(node.addr.clone())),
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
        if !usable(node) {
            return Err(DirectoryError::UnknownNode(node.addr.clone()));
        }
        let node_key = self.node_key(&node.addr);
        let ttl = (self.cfg.ttl_minutes * 60).to_string();
        let stale_ms = (self.cfg.stale_after_secs * 1000).to_string();
        let minr = self.cfg.min_reclaimable_owners.to_string();
        let prefix = self.node_key_prefix();
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
        ];
        let out = self
            .eval_node_batches(script, &node_key, &batches, &args)
            .await?;
        let mut answer = InsertAnswer::default();
        for (i, v) in out.iter().enumerate() {
            let Value::Array(items) = v else {
                return Err(self.unavailable(format_args!("unexpected insert answer {v:?}")));
            };
            let ints: Option<Vec<i64>> = items.iter().map(as_int).collect();
            let Some(ints) = ints else {
                return Err(self.unavailable(format_args!("unexpected insert answer {v:?}")));
            };
            match ints.as_slice() {
                [-1, ..] => return Err(DirectoryError::UnknownNode(node.addr.clone())),
                [0, _added, positions @ ..] => {
                    let base = i * self.cfg.script_batch;
                    for &p in positions {
                        if let Some(h) = usize::try_from(p)
                            .ok()
                            .and_then(|p| p.checked_sub(1))
                            .and_then(|p| hashes.get(base + p))
                        {
                            answer.reclaimable.push(h.clone());
                        }
                    }
                }
                _ => return Err(self.unavailable(format_args!("unexpected insert answer {v:?}"))),
            }
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
        if !usable(node) {
            return Err(DirectoryError::UnknownNode(node.addr.clone()));
        }
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
        if !usable(node) {
            return Err(DirectoryError::UnknownNode(node.addr.clone()));
        }
        let n = self
            .node_count(&self.scripts.unregister, node, |_| {
                vec![node.session.clone()]
            })
            .await?;
        self.known_tags.lock().remove(node);
        Ok(n)
    }

    async fn resync(&self, node: &NodeId) -> Result<u64, DirectoryError> {
        if !usable(node) {
            return Err(DirectoryError::UnknownNode(node.addr.clone()));
        }
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

    fn owners(v: &[(&str, &[(u32, u32)])]) -> OwnerRuns {
        v.iter().map(|(a, r)| (a.to_string(), r.to_vec())).collect()
    }

    fn plan(v: &[(&str, u32)]) -> Vec<NodePrefix> {
        v.iter()
            .map(|(n, l)| NodePrefix {
                node: n.to_string(),
                prefix_len: *l,
            })
            .collect()
    }

    #[test]
    fn cover_plan_is_greedy_by_reach_then_address() {
        // The longest run from each position wins; the walk goes on where it ends.
        let o = owners(&[("a", &[(0, 5)]), ("b", &[(2, 9)])]);
        assert_eq!(cover_plan(&o, 10), plan(&[("a", 5), ("b", 4)]));
        // Alternating holders; a node may serve several segments.
        let o = owners(&[("a", &[(0, 3), (5, 8)]), ("b", &[(3, 5)])]);
        assert_eq!(cover_plan(&o, 8), plan(&[("a", 3), ("b", 2), ("a", 3)]));
        // Ties go to the smaller address, whatever the order the owners came in.
        let o = owners(&[("c", &[(0, 4)]), ("b", &[(0, 4)])]);
        assert_eq!(cover_plan(&o, 4), plan(&[("b", 4)]));
        // The plan ends at `stop` even where a run would go on.
        let o = owners(&[("a", &[(0, 9)])]);
        assert_eq!(cover_plan(&o, 4), plan(&[("a", 4)]));
        assert!(cover_plan(&o, 0).is_empty());
        assert!(cover_plan(&[], 3).is_empty());
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
