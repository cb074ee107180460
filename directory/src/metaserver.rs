//! `metaserver`: a client of any PegaFlow-compatible MetaServer (our `pegaflow-metaserver`,
//! or PegaFlow's own), speaking the MetaServer gRPC service of engine-wire.md §11 with
//! PegaFlow's field numbers. `--metaserver-addr URL` (PegaFlow's flag) turns it on.
//!
//! Owns: the mapping between the [`Directory`] contract and the five RPCs, the per-call
//! deadline, and restart detection. PegaFlow's MetaServer does not say when it lost a node's
//! entries (a restart re-creates the node silently at its next heartbeat), so each session
//! plants a canary: one hash (its session id) in a namespace of its own. After every
//! heartbeat the client asks for the canary (and plants it again, renewing it where entries
//! expire); when the MetaServer no longer lists this node for it, the entries are gone and the
//! heartbeat answers `state_lost` (the publisher then re-inserts what DRAM holds). The canary
//! costs one entry per node and two small RPCs per heartbeat.
//!
//! Must never: wait longer than `timeout_ms` for an RPC (a MetaServer that is down or frozen
//! answers `Unavailable`), or fail to start because the MetaServer is not up yet (the channel
//! connects lazily).

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use parking_lot::Mutex;
use pegaflow_plugin::{
    defaults_of, parse_settings, ConfigSchema, Directory, DirectoryError, DirectoryFactory,
    FactoryFlag, FlagValue, HeartbeatAnswer, InsertAnswer, NodeId, NodePrefix, PluginOption,
    RuntimeContext,
};
use pegaflow_proto as pb;
use pegaflow_proto::meta_server_client::MetaServerClient;
use serde::{Deserialize, Serialize};
use tonic::transport::{Channel, Endpoint};

/// The namespace of the restart canaries (one hash per session: the session id).
pub const CANARY_NAMESPACE: &str = "pegaflow.directory.canary";

/// Hashes per Insert/Remove RPC, at most (PegaFlow's client sends at most 16,384).
pub const MAX_HASHES_PER_RPC: usize = 16_384;

/// `[directory] kind = "metaserver"` settings.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields, default)]
pub struct MetaServerConfig {
    /// The MetaServer's URL (`http://host:50056`; `host:port` alone means http).
    pub addr: String,
    /// Deadline of every RPC, in milliseconds (connecting included).
    pub timeout_ms: u64,
}

impl MetaServerConfig {
    /// The MetaServer endpoint these settings name, without connecting (the factory's
    /// settings check and the constructor).
    ///
    /// # Errors
    /// An empty or malformed address, a zero timeout.
    pub fn endpoint(&self) -> anyhow::Result<Endpoint> {
        if self.addr.trim().is_empty() {
            anyhow::bail!(
                "the metaserver directory needs addr (the MetaServer URL, e.g. http://10.0.0.5:50056; --metaserver-addr)"
            );
        }
        if self.timeout_ms == 0 {
            anyhow::bail!("[directory] timeout_ms must be > 0");
        }
        Endpoint::from_shared(normalize_url(&self.addr))
            .map_err(|e| anyhow::anyhow!("invalid MetaServer address {:?}: {e}", self.addr))
    }
}

impl Default for MetaServerConfig {
    fn default() -> Self {
        Self {
            addr: String::new(),
            timeout_ms: 1_000,
        }
    }
}

/// The MetaServer client.
pub struct MetaServerDirectory {
    client: MetaServerClient<Channel>,
    url: String,
    timeout: Duration,
    /// Sessions whose canary this client planted (and has not seen lost since).
    planted: Mutex<HashSet<NodeId>>,
}

impl std::fmt::Debug for MetaServerDirectory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MetaServerDirectory")
            .field("url", &self.url)
            .finish()
    }
}

/// A cap of the MetaServer (our `pegaflow-metaserver` answers RESOURCE_EXHAUSTED with the
/// figures when a node, its entries or its store would pass one, or it is busy).
fn limit_reached(s: &tonic::Status) -> DirectoryError {
    DirectoryError::LimitReached {
        limit: "metaserver",
        message: s.message().to_string(),
    }
}

/// `host:port` → `http://host:port`; a URL with a scheme is kept.
fn normalize_url(addr: &str) -> String {
    let a = addr.trim();
    if a.contains("://") {
        a.to_string()
    } else {
        format!("http://{a}")
    }
}

impl MetaServerDirectory {
    /// A client of the MetaServer at `config.addr`. Connects lazily: a MetaServer that is
    /// not up yet makes calls answer `Unavailable` until it is.
    ///
    /// # Errors
    /// An empty or malformed address, a zero timeout.
    pub fn new(config: &MetaServerConfig) -> anyhow::Result<Self> {
        let endpoint = config.endpoint()?;
        let url = normalize_url(&config.addr);
        let timeout = Duration::from_millis(config.timeout_ms);
        let endpoint = endpoint
            .connect_timeout(timeout)
            .timeout(timeout)
            .tcp_nodelay(true);
        Ok(Self {
            client: MetaServerClient::new(endpoint.connect_lazy()),
            url,
            timeout,
            planted: Mutex::new(HashSet::new()),
        })
    }

    /// The MetaServer URL.
    pub fn url(&self) -> &str {
        &self.url
    }

    fn client(&self) -> MetaServerClient<Channel> {
        self.client.clone()
    }

    /// Runs one RPC under the deadline.
    async fn rpc<T>(
        &self,
        f: impl std::future::Future<Output = Result<tonic::Response<T>, tonic::Status>>,
    ) -> Result<T, tonic::Status> {
        match tokio::time::timeout(self.timeout, f).await {
            Ok(r) => r.map(tonic::Response::into_inner),
            Err(_) => Err(tonic::Status::deadline_exceeded(format!(
                "no answer within {} ms",
                self.timeout.as_millis()
            ))),
        }
    }

    fn unavailable(&self, s: &tonic::Status) -> DirectoryError {
        DirectoryError::Unavailable(format!(
            "MetaServer {}: {} ({:?})",
            self.url,
            s.message(),
            s.code()
        ))
    }

    /// Maps a status of an insert/remove/unregister (where FAILED_PRECONDITION means "this
    /// session is not the registered one").
    fn session_error(&self, node: &NodeId, s: tonic::Status) -> DirectoryError {
        match s.code() {
            tonic::Code::FailedPrecondition | tonic::Code::NotFound => {
                DirectoryError::UnknownNode(format!("{} ({})", node.addr, s.message()))
            }
            tonic::Code::InvalidArgument => DirectoryError::Invalid(s.message().to_string()),
            tonic::Code::ResourceExhausted => limit_reached(&s),
            _ => self.unavailable(&s),
        }
    }

    /// A response `status` field that says failure (PegaFlow answers some refusals there).
    fn status_error(node: &NodeId, st: Option<&pb::ResponseStatus>) -> Option<DirectoryError> {
        match st {
            Some(s) if !s.ok => Some(DirectoryError::UnknownNode(format!(
                "{} ({})",
                node.addr, s.message
            ))),
            _ => None,
        }
    }

    async fn plant_canary(&self, node: &NodeId) -> Result<(), DirectoryError> {
        let req = pb::InsertBlockHashesRequest {
            namespace: CANARY_NAMESPACE.into(),
            block_hashes: vec![node.session.as_bytes().to_vec()],
            node: node.addr.clone(),
            node_id: node.session.clone(),
        };
        let mut c = self.client();
        let r = self
            .rpc(c.insert_block_hashes(req))
            .await
            .map_err(|s| self.session_error(node, s))?;
        if let Some(e) = Self::status_error(node, r.status.as_ref()) {
            return Err(e);
        }
        self.planted.lock().insert(node.clone());
        Ok(())
    }

    async fn canary_alive(&self, node: &NodeId) -> Result<bool, DirectoryError> {
        let req = pb::QueryPrefixBlocksRequest {
            namespace: CANARY_NAMESPACE.into(),
            block_hashes: vec![node.session.as_bytes().to_vec()],
            exclude_node: String::new(),
        };
        let mut c = self.client();
        let r = self
            .rpc(c.query_prefix_blocks(req))
            .await
            .map_err(|s| self.unavailable(&s))?;
        Ok(r.nodes
            .iter()
            .any(|n| n.node == node.addr && n.prefix_len > 0))
    }

    async fn heartbeat_rpc(&self, node: &NodeId) -> Result<Duration, DirectoryError> {
        let req = pb::HeartbeatNodeRequest {
            node: node.addr.clone(),
            node_id: node.session.clone(),
        };
        let mut c = self.client();
        let r = self
            .rpc(c.heartbeat_node(req))
            .await
            .map_err(|s| match s.code() {
                tonic::Code::FailedPrecondition | tonic::Code::AlreadyExists => {
                    DirectoryError::SessionConflict(format!("{} ({})", node.addr, s.message()))
                }
                tonic::Code::InvalidArgument => DirectoryError::Invalid(s.message().to_string()),
                tonic::Code::ResourceExhausted => limit_reached(&s),
                _ => self.unavailable(&s),
            })?;
        Ok(Duration::from_secs(r.stale_after_secs.max(1)))
    }

    /// Calls `call` once per chunk of at most [`MAX_HASHES_PER_RPC`] hashes, in order.
    async fn batched<F, Fut>(&self, hashes: &[Vec<u8>], mut call: F) -> Vec<Fut::Output>
    where
        F: FnMut(MetaServerClient<Channel>, Vec<Vec<u8>>) -> Fut,
        Fut: std::future::Future,
    {
        let mut out = Vec::new();
        for chunk in hashes.chunks(MAX_HASHES_PER_RPC) {
            out.push(call(self.client(), chunk.to_vec()).await);
        }
        out
    }
}

#[async_trait]
impl Directory for MetaServerDirectory {
    fn kind(&self) -> &'static str {
        "metaserver"
    }

    async fn heartbeat(&self, node: &NodeId) -> Result<HeartbeatAnswer, DirectoryError> {
        let stale_after = self.heartbeat_rpc(node).await?;
        let planted = self.planted.lock().contains(node);
        let state_lost = !planted || !self.canary_alive(node).await?;
        if state_lost {
            self.planted.lock().remove(node);
        }
        // Planted again on every heartbeat (idempotent): a MetaServer whose entries expire
        // some time after their last insert (ours over Redis) keeps the canary as long as the
        // node lives, so its absence means lost entries, not age.
        self.plant_canary(node).await?;
        Ok(HeartbeatAnswer {
            stale_after,
            state_lost,
        })
    }

    async fn insert(
        &self,
        node: &NodeId,
        namespace: &str,
        hashes: &[Vec<u8>],
    ) -> Result<InsertAnswer, DirectoryError> {
        let results = self
            .batched(hashes, |mut c, chunk| {
                let req = pb::InsertBlockHashesRequest {
                    namespace: namespace.into(),
                    block_hashes: chunk,
                    node: node.addr.clone(),
                    node_id: node.session.clone(),
                };
                async move { self.rpc(c.insert_block_hashes(req)).await }
            })
            .await;
        let mut answer = InsertAnswer::default();
        for r in results {
            let r = r.map_err(|s| self.session_error(node, s))?;
            if let Some(e) = Self::status_error(node, r.status.as_ref()) {
                return Err(e);
            }
            answer.inserted += r.inserted_count;
            answer.reclaimable.extend(r.reclaimable_hashes);
        }
        Ok(answer)
    }

    async fn remove(
        &self,
        node: &NodeId,
        namespace: &str,
        hashes: &[Vec<u8>],
    ) -> Result<u64, DirectoryError> {
        let results = self
            .batched(hashes, |mut c, chunk| {
                let req = pb::RemoveBlockHashesRequest {
                    namespace: namespace.into(),
                    block_hashes: chunk,
                    node: node.addr.clone(),
                    node_id: node.session.clone(),
                };
                async move { self.rpc(c.remove_block_hashes(req)).await }
            })
            .await;
        let mut removed = 0;
        for r in results {
            let r = r.map_err(|s| self.session_error(node, s))?;
            if let Some(e) = Self::status_error(node, r.status.as_ref()) {
                return Err(e);
            }
            removed += r.removed_count;
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
            return Err(DirectoryError::Invalid(
                "a prefix query needs at least one hash".into(),
            ));
        }
        let req = pb::QueryPrefixBlocksRequest {
            namespace: namespace.into(),
            block_hashes: hashes.to_vec(),
            exclude_node: exclude.unwrap_or_default().into(),
        };
        let mut c = self.client();
        let r = self
            .rpc(c.query_prefix_blocks(req))
            .await
            .map_err(|s| match s.code() {
                tonic::Code::InvalidArgument => DirectoryError::Invalid(s.message().to_string()),
                _ => self.unavailable(&s),
            })?;
        // The MetaServer's plan, segments in hash order, as it answered.
        Ok(r.nodes
            .into_iter()
            .filter(|n| n.prefix_len > 0)
            .map(|n| NodePrefix {
                node: n.node,
                prefix_len: n.prefix_len,
            })
            .collect())
    }

    async fn unregister(&self, node: &NodeId) -> Result<u64, DirectoryError> {
        let req = pb::UnregisterNodeRequest {
            node: node.addr.clone(),
            node_id: node.session.clone(),
        };
        let mut c = self.client();
        let r = self
            .rpc(c.unregister_node(req))
            .await
            .map_err(|s| self.session_error(node, s))?;
        self.planted.lock().remove(node);
        Ok(r.removed_owners)
    }

    async fn resync(&self, node: &NodeId) -> Result<u64, DirectoryError> {
        // The protocol has no "forget my entries": leave and come back under the same
        // session (the address is ours while we are live, so no one can take it between).
        let n = self.unregister(node).await?;
        self.heartbeat_rpc(node).await?;
        self.plant_canary(node).await?;
        // The canary was one of the owners removed.
        Ok(n.saturating_sub(1))
    }
}

fn build(t: &toml::Table, _ctx: &RuntimeContext) -> anyhow::Result<Arc<dyn Directory>> {
    let c: MetaServerConfig = parse_settings("metaserver directory", t)?;
    Ok(Arc::new(MetaServerDirectory::new(&c)?))
}

inventory::submit! {
    DirectoryFactory {
        kind: "metaserver",
        summary: "a client of a PegaFlow-compatible MetaServer (ours or PegaFlow's pegaflow-metaserver)",
        config: ConfigSchema {
            defaults: defaults_of::<MetaServerConfig>,
            check: |w, t| parse_settings::<MetaServerConfig>(w, t)?.endpoint().map(drop),
            options: &[
                PluginOption {
                    name: "addr",
                    help: "MetaServer URL, e.g. http://10.0.0.5:50056 (host:port means http)",
                },
                PluginOption {
                    name: "timeout_ms",
                    help: "deadline of every RPC, in milliseconds",
                },
            ],
        },
        flags: &[FactoryFlag {
            long: "metaserver-addr",
            value_name: "URL",
            help: "MetaServer URL (e.g. http://10.0.0.5:50056) of the cross-node block directory: this server advertises the blocks its DRAM holds there (the [directory] kind \"metaserver\")",
            setting: "addr",
            value: FlagValue::Text,
            adds_entry: true,
        }],
        build,
    }
}
