//! The peer rung (requesting side): [`PeerFetcher`] over any [`PeerDataPath`].
//!
//! One fetch: handshake with the holder once (`RdmaHandshake`, whose metadata carries the
//! data endpoint: `pegaflow-tcp/1 port=N`), make sure a data connection is up, lock the run
//! there (`QueryBlocksForTransfer`), check the answer, allocate host buffers for exactly
//! what will be read, pull, release the lock (`ReleaseTransferLock`, sent by a guard on
//! every exit), hand the landed blocks to the stack. The whole fetch runs under one
//! deadline: `fetch_timeout_ms`, or the promotion's, whichever comes first.
//!
//! Checks on the holder's answer (a peer can never make us read outside our buffers, or
//! keep wrong bytes): only a prefix of blocks whose hashes match the request in order is
//! used; a block without slots, with a slot of zero or of more than [`MAX_SLOT_BYTES`], or
//! whose slot shape differs from the loading instance's is where the prefix stops; the
//! fetch reads at most `max_fetch_bytes`. Buffers are sized from the checked shape, and
//! the data path writes only inside them. The holder's `numa_node` is ignored: placement
//! is this node's business, and a fetch allocates what it reads, no more.
//!
//! Failure: a holder that times out, is unreachable, refuses, or answers garbage is marked
//! suspect for `suspect_secs` (the stack skips it and falls through to the lower tiers);
//! a holder that simply held fewer blocks than the directory said (a stale advertisement)
//! is not: its short answer ends the rung, and the node is not asked for that continuation
//! again for `stale_secs` (no retry loop).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use parking_lot::Mutex;
use pegaflow_plugin::block::{BlockKey, BlockShape, SealedBlock};
use pegaflow_plugin::BlockHost;
use pegaflow_plugin::{PeerDataError, PeerDataPath, PeerFetcher, PeerRead, RemoteRange};
use pegaflow_proto as pb;
use tonic::transport::{Channel, Endpoint};

use crate::metrics::PeerMetrics;

/// The handshake metadata prefix of this data path's protocol.
pub const HANDSHAKE: &str = "pegaflow-tcp/1";
/// The largest slot a peer may describe (1 GiB).
pub const MAX_SLOT_BYTES: u64 = 1 << 30;

type Client = pb::engine_client::EngineClient<Channel>;

/// Settings of the requesting side.
#[derive(Debug, Clone, Copy)]
pub struct FetchLimits {
    /// Longest fetch, lock to release.
    pub fetch_timeout: Duration,
    /// Longest wait for a connection (gRPC or data).
    pub connect_timeout: Duration,
    /// How long a failed peer is skipped.
    pub suspect_for: Duration,
    /// How long a node that denied holding an advertised block is not asked for it again.
    pub stale_for: Duration,
    /// Bytes one fetch reads at most.
    pub max_fetch_bytes: u64,
}

struct Peer {
    client: Client,
    /// The data endpoint, once the handshake told it.
    endpoint: Option<String>,
}

/// Why a fetch ended short: the failure metric's `reason`, and whether the peer is to blame.
#[derive(Debug)]
struct Failure {
    reason: &'static str,
    detail: String,
    suspect: bool,
}

impl Failure {
    fn suspect(reason: &'static str, detail: impl std::fmt::Display) -> Self {
        Self {
            reason,
            detail: detail.to_string(),
            suspect: true,
        }
    }
    fn benign(reason: &'static str, detail: impl std::fmt::Display) -> Self {
        Self {
            reason,
            detail: detail.to_string(),
            suspect: false,
        }
    }
}

/// Why a handshake failed.
#[derive(Debug)]
pub enum HandshakeError {
    /// The `RdmaHandshake` call itself failed (a gRPC status).
    Rpc(tonic::Status),
    /// The peer answered, in a protocol this data path does not speak, or with metadata it
    /// cannot use (the message says what).
    Refused(String),
    /// Setting up the data connection the answer describes failed.
    Data(PeerDataError),
}

/// One `RdmaHandshake` round trip with a peer, as the fetcher offers it to a [`Handshake`]:
/// sends `metadata`, returns the peer's answer metadata.
#[async_trait]
pub trait Exchange: Send {
    /// Sends `metadata` in an `RdmaHandshake` and returns the answer's metadata.
    async fn exchange(&mut self, metadata: Vec<u8>) -> Result<Vec<u8>, tonic::Status>;
}

/// The data path's half of the handshake: what the requester sends in `RdmaHandshake`, and
/// what the answer means (the data endpoint later handed to [`PeerDataPath::connect`] and
/// [`PeerDataPath::pull`]). TCP's ([`TcpHandshake`]) names its protocol and reads the data
/// port; an RDMA data path offers its queue pairs and connects them to the answer's.
#[async_trait]
pub trait Handshake: Send + Sync + 'static {
    /// Handshakes with `node` (its advertised `ip:port`) through `rpc`, by `deadline`;
    /// returns the data endpoint.
    async fn handshake(
        &self,
        node: &str,
        rpc: &mut dyn Exchange,
        deadline: Instant,
    ) -> Result<String, HandshakeError>;
    /// Whether data moves without the holder's CPU (one-sided reads): the holder's lease is
    /// then not renewed by reads, so the fetcher releases the lock right after the pull and
    /// keeps the bytes only if the holder confirms the lock was still held (it released
    /// every locked block), i.e. the blocks could not have been freed and reused under the
    /// reads.
    fn one_sided(&self) -> bool {
        false
    }
}

/// The TCP handshake: metadata [`HANDSHAKE`], answered `pegaflow-tcp/1 port=N`; the data
/// endpoint is the node's host on port N.
#[derive(Debug, Default, Clone, Copy)]
pub struct TcpHandshake;

#[async_trait]
impl Handshake for TcpHandshake {
    async fn handshake(
        &self,
        node: &str,
        rpc: &mut dyn Exchange,
        _deadline: Instant,
    ) -> Result<String, HandshakeError> {
        let answer = rpc
            .exchange(HANDSHAKE.as_bytes().to_vec())
            .await
            .map_err(HandshakeError::Rpc)?;
        let port = parse_handshake(&answer).ok_or_else(|| {
            HandshakeError::Refused(
                "the peer does not speak the tcp data path (handshake metadata)".into(),
            )
        })?;
        Ok(data_endpoint(node, port))
    }
}

struct ClientExchange<'a> {
    client: &'a mut Client,
    requester_id: &'a str,
}

#[async_trait]
impl Exchange for ClientExchange<'_> {
    async fn exchange(&mut self, metadata: Vec<u8>) -> Result<Vec<u8>, tonic::Status> {
        Ok(self
            .client
            .rdma_handshake(pb::RdmaHandshakeRequest {
                requester_id: self.requester_id.to_owned(),
                handshake_metadata: metadata,
            })
            .await?
            .into_inner()
            .handshake_metadata)
    }
}

/// The fetcher.
pub struct Fetcher {
    requester_id: String,
    data: Arc<dyn PeerDataPath>,
    handshake: Arc<dyn Handshake>,
    limits: FetchLimits,
    peers: Mutex<HashMap<String, Peer>>,
    suspects: Mutex<HashMap<String, Instant>>,
    /// `(node, hash)` a node answered it does not hold, though the directory listed it,
    /// until when: the next query of that continuation skips the node (no retry loop).
    stale: Mutex<HashMap<(String, Vec<u8>), Instant>>,
    metrics: PeerMetrics,
}

/// Stale advertisements remembered at most (beyond it, expired ones go, then all).
const MAX_STALE: usize = 65_536;

impl std::fmt::Debug for Fetcher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Fetcher")
            .field("requester_id", &self.requester_id)
            .field("data", &self.data.kind())
            .finish()
    }
}

/// Sends ReleaseTransferLock when dropped (every exit of a fetch: success, failure, a
/// timeout dropping the fetch future), detached and bounded by 2 s.
struct LockGuard {
    client: Client,
    /// `None` once released by the fetch itself (a one-sided pull's confirmed release).
    session: Option<String>,
}

impl Drop for LockGuard {
    fn drop(&mut self) {
        let mut client = self.client.clone();
        let Some(session) = self.session.take() else {
            return;
        };
        tokio::spawn(async move {
            let r = tokio::time::timeout(
                Duration::from_secs(2),
                client.release_transfer_lock(pb::ReleaseTransferLockRequest {
                    transfer_session_id: session.clone(),
                }),
            )
            .await;
            if !matches!(r, Ok(Ok(_))) {
                tracing::debug!(
                    session,
                    "ReleaseTransferLock failed; the peer's lease ends the lock"
                );
            }
        });
    }
}

/// The data endpoint `host:port` of `node` (`ip:port`, `[v6]:port` or `host:port`) on `port`.
pub fn data_endpoint(node: &str, port: u16) -> String {
    match node.parse::<SocketAddr>() {
        Ok(a) => SocketAddr::new(a.ip(), port).to_string(),
        Err(_) => match node.rsplit_once(':') {
            Some((host, _)) => format!("{host}:{port}"),
            None => format!("{node}:{port}"),
        },
    }
}

/// The data port a handshake answer names, if it speaks this protocol.
pub fn parse_handshake(meta: &[u8]) -> Option<u16> {
    let s = std::str::from_utf8(meta).ok()?;
    let rest = s.strip_prefix(HANDSHAKE)?.trim();
    rest.strip_prefix("port=")?.parse().ok()
}

impl Fetcher {
    /// A fetcher identifying itself to peers as `requester_id`, moving data over `data`.
    pub fn new(
        requester_id: String,
        data: Arc<dyn PeerDataPath>,
        limits: FetchLimits,
        metrics: PeerMetrics,
    ) -> Self {
        Self {
            requester_id,
            data,
            handshake: Arc::new(TcpHandshake),
            limits,
            peers: Mutex::new(HashMap::new()),
            suspects: Mutex::new(HashMap::new()),
            stale: Mutex::new(HashMap::new()),
            metrics,
        }
    }

    /// The same fetcher handshaking through `h` instead of [`TcpHandshake`] (an RDMA data
    /// path offers its queue pairs in the handshake).
    pub fn with_handshake(mut self, h: Arc<dyn Handshake>) -> Self {
        self.handshake = h;
        self
    }

    /// The id this fetcher names itself with to peers.
    pub fn requester_id(&self) -> &str {
        &self.requester_id
    }

    fn mark_suspect(&self, node: &str) {
        let mut s = self.suspects.lock();
        let now = Instant::now();
        s.retain(|_, until| *until > now);
        s.insert(node.to_owned(), now + self.limits.suspect_for);
        self.metrics.suspect_peers.set(s.len() as i64);
        // Reconnect and handshake afresh next time.
        self.peers.lock().remove(node);
    }

    fn note_stale(&self, node: &str, hash: &[u8]) {
        let mut s = self.stale.lock();
        let now = Instant::now();
        if s.len() >= MAX_STALE {
            s.retain(|_, until| *until > now);
            if s.len() >= MAX_STALE {
                s.clear();
            }
        }
        s.insert(
            (node.to_owned(), hash.to_vec()),
            now + self.limits.stale_for,
        );
    }

    fn client(&self, node: &str) -> Result<(Client, Option<String>), Failure> {
        let mut peers = self.peers.lock();
        if let Some(p) = peers.get(node) {
            return Ok((p.client.clone(), p.endpoint.clone()));
        }
        let ep = Endpoint::from_shared(format!("http://{node}"))
            .map_err(|e| Failure::suspect("unreachable", e))?
            .connect_timeout(self.limits.connect_timeout)
            .tcp_nodelay(true);
        let client = pb::engine_client::EngineClient::new(ep.connect_lazy())
            .max_decoding_message_size(64 << 20);
        peers.insert(
            node.to_owned(),
            Peer {
                client: client.clone(),
                endpoint: None,
            },
        );
        Ok((client, None))
    }

    /// Asks `node` for its data endpoint (`RdmaHandshake`, through the data path's
    /// [`Handshake`]) and caches it.
    async fn handshake(
        &self,
        client: &mut Client,
        node: &str,
        deadline: Instant,
    ) -> Result<String, Failure> {
        let mut rpc = ClientExchange {
            client,
            requester_id: &self.requester_id,
        };
        let e = self
            .handshake
            .handshake(node, &mut rpc, deadline)
            .await
            .map_err(|e| match e {
                HandshakeError::Rpc(s) => rpc_failure("handshake", s),
                HandshakeError::Refused(m) => Failure::suspect("handshake", m),
                HandshakeError::Data(d) => data_failure(d),
            })?;
        if let Some(p) = self.peers.lock().get_mut(node) {
            p.endpoint = Some(e.clone());
        }
        Ok(e)
    }

    async fn fetch_inner(
        &self,
        stack: &Arc<dyn BlockHost>,
        node: &str,
        keys: &[BlockKey],
        expect: Option<&BlockShape>,
        deadline: Instant,
    ) -> Result<Vec<Arc<SealedBlock>>, Failure> {
        let (mut client, cached) = self.client(node)?;
        let endpoint = match &cached {
            Some(e) => e.clone(),
            None => self.handshake(&mut client, node, deadline).await?,
        };
        // A live data connection before anything is locked there. A cached endpoint may be
        // out of date (the peer restarted on another data port): handshake again, once.
        let endpoint = match self.data.connect(&endpoint, deadline).await {
            Ok(()) => endpoint,
            Err(PeerDataError::Unreachable(_)) if cached.is_some() => {
                let e = self.handshake(&mut client, node, deadline).await?;
                self.data
                    .connect(&e, deadline)
                    .await
                    .map_err(data_failure)?;
                e
            }
            Err(e) => return Err(data_failure(e)),
        };
        let namespace = keys
            .first()
            .map(|k| k.namespace.to_string())
            .unwrap_or_default();
        let answer = client
            .query_blocks_for_transfer(pb::QueryBlocksForTransferRequest {
                namespace,
                block_hashes: keys.iter().map(|k| k.hash.to_vec()).collect(),
                requester_id: self.requester_id.clone(),
            })
            .await
            .map_err(|e| rpc_failure("rpc", e))?
            .into_inner();
        let mut guard = (!answer.transfer_session_id.is_empty()).then(|| LockGuard {
            client: client.clone(),
            session: Some(answer.transfer_session_id.clone()),
        });
        if answer.status.as_ref().is_some_and(|s| !s.ok) {
            let msg = answer.status.map(|s| s.message).unwrap_or_default();
            return Err(Failure::suspect("refused", msg));
        }
        // The session id goes into every read frame: one the wire cannot carry (or none for
        // blocks it claims to have locked) is a peer that does not speak this protocol.
        if answer.transfer_session_id.len() > crate::wire::MAX_ID_BYTES
            || (answer.transfer_session_id.is_empty() && !answer.blocks.is_empty())
        {
            return Err(Failure::suspect(
                "bad_answer",
                format!(
                    "transfer session id of {} bytes for {} blocks (1 to {} bytes expected)",
                    answer.transfer_session_id.len(),
                    answer.blocks.len(),
                    crate::wire::MAX_ID_BYTES
                ),
            ));
        }
        // The usable prefix of the answer.
        let mut shapes: Vec<BlockShape> = Vec::new();
        let mut ranges: Vec<Vec<RemoteRange>> = Vec::new();
        let mut bytes = 0u64;
        let mut bad = None;
        for (b, key) in answer.blocks.iter().zip(keys) {
            if b.block_hash.as_slice() != &*key.hash {
                break;
            }
            match check_block(b) {
                Ok((shape, rr)) => {
                    if expect.is_some_and(|e| *e != shape) {
                        bad = Some("slot shape differs from the instance's".to_string());
                        break;
                    }
                    let len = shape.len_bytes();
                    if bytes + len > self.limits.max_fetch_bytes {
                        break;
                    }
                    bytes += len;
                    shapes.push(shape);
                    ranges.push(rr);
                }
                Err(e) => {
                    bad = Some(e);
                    break;
                }
            }
        }
        if let Some(e) = bad {
            self.metrics
                .fetch_failures
                .with_label_values(&["bad_answer"])
                .inc();
            tracing::debug!(node, error = %e, "peer answer unusable from here on");
        }
        if shapes.len() < keys.len() {
            // A stale advertisement (or an unusable answer): take what there is, and skip
            // this node for the rest of the run for a while (no retry loop).
            self.metrics
                .fetch_failures
                .with_label_values(&["short"])
                .inc();
            self.note_stale(node, &keys[shapes.len()].hash);
        }
        if shapes.is_empty() {
            return Ok(Vec::new());
        }
        let lens: Vec<usize> = shapes.iter().map(|s| s.len_bytes() as usize).collect();
        let bufs = stack
            .allocate(&lens)
            .map_err(|e| Failure::benign("no_memory", e))?;
        let reads: Vec<PeerRead> = bufs
            .into_iter()
            .zip(ranges)
            .map(|(b, rr)| PeerRead {
                dest: Arc::new(b),
                dest_offset: 0,
                ranges: rr,
            })
            .collect();
        let dests: Vec<_> = reads.iter().map(|r| r.dest.clone()).collect();
        self.data
            .pull(&endpoint, &answer.transfer_session_id, reads, deadline)
            .await
            .map_err(data_failure)?;
        if self.handshake.one_sided() {
            // The holder saw none of the reads: its lease was not renewed by them. The bytes
            // are the holder's only if the lock outlived the pull (else the blocks may have
            // been freed and reused under the reads).
            let locked = answer.blocks.len() as u64;
            let released = client
                .release_transfer_lock(pb::ReleaseTransferLockRequest {
                    transfer_session_id: answer.transfer_session_id.clone(),
                })
                .await
                .map_err(|e| rpc_failure("lock_lost", e))?
                .into_inner()
                .released_blocks;
            // Released: the guard has nothing left to do. Until here (the call failed or this
            // future was dropped), dropping the guard still sends the release.
            if let Some(g) = guard.as_mut() {
                g.session = None;
            }
            if released < locked {
                return Err(Failure::suspect(
                    "lock_lost",
                    format!(
                        "the holder released {released} of {locked} locked blocks after a one-sided pull: its lock ended during the reads"
                    ),
                ));
            }
        }
        let pool = stack.pool();
        let blocks: Vec<Arc<SealedBlock>> = dests
            .into_iter()
            .zip(&shapes)
            .map(|(d, s)| {
                let fp = pool.footprint_bytes(d.len());
                Arc::new(SealedBlock::from_buffer(0, s, d, fp))
            })
            .collect();
        self.metrics.fetch_blocks.inc_by(blocks.len() as u64);
        self.metrics.fetch_bytes.inc_by(bytes);
        Ok(blocks)
    }
}

/// A block's shape and remote ranges, if its description is sane.
fn check_block(b: &pb::TransferBlockInfo) -> Result<(BlockShape, Vec<RemoteRange>), String> {
    if b.slots.is_empty() {
        return Err("a block without slots".into());
    }
    let mut lens = Vec::with_capacity(b.slots.len());
    let mut rr = Vec::with_capacity(b.slots.len() * 2);
    for s in &b.slots {
        let len = s
            .k_size
            .checked_add(s.v_size)
            .filter(|&l| l > 0 && l <= MAX_SLOT_BYTES)
            .ok_or_else(|| format!("a slot of {} + {} bytes", s.k_size, s.v_size))?;
        if s.k_size > 0 {
            rr.push(RemoteRange {
                addr: s.k_ptr,
                len: s.k_size,
            });
        }
        if s.v_size > 0 {
            rr.push(RemoteRange {
                addr: s.v_ptr,
                len: s.v_size,
            });
        }
        lens.push(len);
    }
    Ok((BlockShape::new(lens), rr))
}

fn rpc_failure(reason: &'static str, e: tonic::Status) -> Failure {
    match e.code() {
        tonic::Code::Unavailable | tonic::Code::DeadlineExceeded | tonic::Code::Unknown => {
            Failure::suspect("unreachable", e.message())
        }
        _ => Failure::suspect(reason, format!("{}: {}", e.code(), e.message())),
    }
}

fn data_failure(e: PeerDataError) -> Failure {
    match e {
        PeerDataError::Timeout => Failure::suspect("timeout", e),
        PeerDataError::Unreachable(_) => Failure::suspect("unreachable", e),
        PeerDataError::Refused(_) => Failure::suspect("refused", e),
    }
}

#[async_trait]
impl PeerFetcher for Fetcher {
    fn kind(&self) -> &'static str {
        self.data.kind()
    }

    fn skip(&self, node: &str, first_hash: &[u8]) -> Option<&'static str> {
        let now = Instant::now();
        if self
            .suspects
            .lock()
            .get(node)
            .is_some_and(|until| *until > now)
        {
            return Some("suspect");
        }
        let key = (node.to_owned(), first_hash.to_vec());
        let mut stale = self.stale.lock();
        match stale.get(&key) {
            Some(until) if *until > now => Some("stale"),
            Some(_) => {
                stale.remove(&key);
                None
            }
            None => None,
        }
    }

    async fn fetch(
        &self,
        stack: &Arc<dyn BlockHost>,
        node: &str,
        keys: &[BlockKey],
        expect: Option<&BlockShape>,
        deadline: Instant,
    ) -> Vec<Arc<SealedBlock>> {
        if keys.is_empty() || self.skip(node, &keys[0].hash).is_some() {
            return Vec::new();
        }
        let t0 = Instant::now();
        let deadline = deadline.min(t0 + self.limits.fetch_timeout);
        let r = tokio::time::timeout_at(
            deadline.into(),
            self.fetch_inner(stack, node, keys, expect, deadline),
        )
        .await
        .unwrap_or_else(|_| Err(Failure::suspect("timeout", "the fetch deadline passed")));
        self.metrics
            .fetch_duration
            .observe(t0.elapsed().as_secs_f64());
        match r {
            Ok(b) => b,
            Err(f) => {
                self.metrics
                    .fetch_failures
                    .with_label_values(&[f.reason])
                    .inc();
                if f.suspect {
                    tracing::warn!(node, reason = f.reason, error = %f.detail, suspect_secs = self.limits.suspect_for.as_secs(), "peer fetch failed; the peer is suspect, the query falls through");
                    self.mark_suspect(node);
                } else {
                    tracing::debug!(node, reason = f.reason, error = %f.detail, "peer fetch ended short");
                }
                Vec::new()
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_data_endpoint_keeps_the_nodes_host() {
        assert_eq!(data_endpoint("10.0.0.7:50055", 6000), "10.0.0.7:6000");
        assert_eq!(data_endpoint("[::1]:50055", 6000), "[::1]:6000");
        assert_eq!(data_endpoint("node-a:50055", 6000), "node-a:6000");
        assert_eq!(parse_handshake(b"pegaflow-tcp/1 port=6000"), Some(6000));
        assert_eq!(parse_handshake(b"rdma stuff"), None);
        assert_eq!(parse_handshake(b"pegaflow-tcp/1 port=99999"), None);
    }

    #[test]
    fn insane_block_descriptions_are_refused() {
        let slot = |k, v| pb::TransferSlotInfo {
            k_ptr: 0x1000,
            k_size: k,
            v_ptr: 0x9000,
            v_size: v,
            numa_node: 7,
        };
        let block = |slots| pb::TransferBlockInfo {
            block_hash: vec![1],
            slots,
        };
        assert!(check_block(&block(vec![])).is_err(), "0 slots");
        assert!(check_block(&block(vec![slot(0, 0)])).is_err(), "empty slot");
        assert!(
            check_block(&block(vec![slot(u64::MAX, 1)])).is_err(),
            "overflow"
        );
        assert!(check_block(&block(vec![slot(MAX_SLOT_BYTES, 1)])).is_err());
        let (shape, rr) = check_block(&block(vec![slot(100, 28), slot(128, 0)])).unwrap();
        assert_eq!(&*shape.slot_lens, &[128, 128]);
        assert_eq!(rr.len(), 3);
    }
}
