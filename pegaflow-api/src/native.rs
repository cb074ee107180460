//! The high-level client for native (Rust) engines: the caller gives an endpoint and a
//! namespace; the client finds the side channel through Health, mints a fresh instance id per
//! registration attempt, keeps a Session open, sends the allocation's fd, registers, and then
//! drives saves and loads. Loads always wait for completion; `unregister` flushes the saves it
//! submitted first; `release` fails when the server rejects the lease.
//!
//! Tiers, routing and the side channel's path are the server's business: nothing here takes
//! them from the user.

use std::os::fd::BorrowedFd;
use std::path::PathBuf;

use pegaflow_proto as pb;

use crate::client::{EngineClient, NativeLayer, NativeRegistration, QueryOutcome};
use crate::ApiError;

/// Memory a native engine can hand to the server: an exportable allocation with an fd.
pub trait ExportableMemory {
    /// The descriptor sent on the side channel (the server keeps its own duplicate).
    fn export_fd(&self) -> BorrowedFd<'_>;
    /// The allocation's size in bytes (for VMM: granularity-aligned).
    fn alloc_size(&self) -> u64;
    /// What kind of memory it is.
    fn memory_kind(&self) -> pb::MemoryKind;
}

impl ExportableMemory for crate::memfd::HostMemfd {
    fn export_fd(&self) -> BorrowedFd<'_> {
        self.fd()
    }
    fn alloc_size(&self) -> u64 {
        self.len() as u64
    }
    fn memory_kind(&self) -> pb::MemoryKind {
        pb::MemoryKind::HostMemfd
    }
}

/// A fresh instance id: `<base>-<32 hex>` (never reused across attempts or processes).
pub fn fresh_instance_id(base: &str) -> String {
    format!("{base}-{}", uuid::Uuid::new_v4().simple())
}

/// A registered native engine (one GPU or one host allocation, one worker).
#[derive(Debug)]
pub struct NativeEngine {
    client: EngineClient,
    socket: PathBuf,
    namespace: String,
    instance_id: String,
    device_id: i32,
    session: Option<tonic::Streaming<pb::SessionEvent>>,
    saves_since_flush: u64,
}

impl NativeEngine {
    /// Connects to `endpoint` and checks the server's side channel is enabled.
    pub async fn connect(endpoint: &str, namespace: &str) -> Result<Connected, ApiError> {
        let mut client = EngineClient::connect(endpoint).await?;
        let path = client.health().await?;
        if path.is_empty() {
            return Err(ApiError::Rejected {
                rpc: "Health",
                message:
                    "the server's fd side channel is disabled (start it with --fd-socket-path)"
                        .into(),
            });
        }
        Ok(Connected {
            client,
            socket: PathBuf::from(path),
            namespace: namespace.to_string(),
        })
    }

    /// The instance id of this registration.
    pub fn instance_id(&self) -> &str {
        &self.instance_id
    }

    /// Saves device blocks `block_ids` of every listed layer under `hashes`.
    pub async fn save(
        &mut self,
        layers: &[&str],
        block_ids: &[u32],
        hashes: &[Vec<u8>],
    ) -> Result<(), ApiError> {
        let saves = layers
            .iter()
            .map(|l| (l.to_string(), block_ids.to_vec(), hashes.to_vec()))
            .collect();
        self.saves_since_flush += 1;
        self.client
            .save(&self.instance_id, 0, 0, self.device_id, saves)
            .await
    }

    /// Asks which prefix of `hashes` is cached; the hits are leased.
    pub async fn query(
        &mut self,
        hashes: Vec<Vec<u8>>,
        req_id: &str,
    ) -> Result<(u64, Vec<u8>), ApiError> {
        loop {
            match self
                .client
                .query(&self.instance_id, hashes.clone(), req_id)
                .await?
            {
                QueryOutcome::Ready {
                    num_hit_blocks,
                    lease,
                    ..
                } => return Ok((num_hit_blocks, lease)),
                QueryOutcome::Loading => {
                    tokio::time::sleep(std::time::Duration::from_millis(1)).await
                }
            }
        }
    }

    /// Loads a lease into `targets` of every listed layer; returns when the copy is done.
    pub async fn load(
        &mut self,
        layers: &[&str],
        lease: &[u8],
        targets: &[u32],
    ) -> Result<(), ApiError> {
        let req = crate::client::single_group_load(
            &self.instance_id,
            0,
            self.device_id,
            layers.iter().map(|s| s.to_string()).collect(),
            lease,
            targets.iter().map(|&b| Some(b)),
            crate::client::LoadCompletion::Wait,
        );
        self.client.load(req).await
    }

    /// Releases a lease that will not be loaded. Errors when the server rejects it.
    pub async fn release(&mut self, lease: &[u8]) -> Result<(), ApiError> {
        self.client.release(lease).await
    }

    /// Waits until every save submitted so far is sealed and queryable.
    pub async fn flush(&mut self) -> Result<(), ApiError> {
        self.client.flush().await?;
        self.saves_since_flush = 0;
        Ok(())
    }

    /// Flushes submitted saves, unregisters, and closes the session.
    pub async fn unregister(mut self) -> Result<(), ApiError> {
        if self.saves_since_flush > 0 {
            self.flush().await?;
        }
        let r = self.client.unregister(&self.instance_id).await;
        self.session.take();
        r
    }
}

/// A connection whose server has the side channel on; register to get a [`NativeEngine`].
#[derive(Debug)]
pub struct Connected {
    client: EngineClient,
    socket: PathBuf,
    namespace: String,
}

impl Connected {
    /// The side channel's path, as the server advertises it.
    pub fn socket_path(&self) -> &std::path::Path {
        &self.socket
    }

    /// Registers `memory` with `layers` under a fresh id `<base>-<uuid>`: opens the Session,
    /// sends the fd, then RegisterContextBatch. On failure the attempt's id is unregistered
    /// (best effort) and the error returned; retry with a new call (a new id).
    pub async fn register<M: ExportableMemory>(
        mut self,
        base: &str,
        device_id: i32,
        memory: &M,
        layers: Vec<NativeLayer>,
    ) -> Result<NativeEngine, ApiError> {
        let instance_id = fresh_instance_id(base);
        if !crate::is_side_channel_safe_id(&instance_id) {
            return Err(ApiError::InvalidArgument(format!(
                "instance id base {base:?} must be characters of [A-Za-z0-9_-]"
            )));
        }
        let session = self
            .client
            .session(&instance_id, &self.namespace, 1, 1)
            .await?;
        let reg = NativeRegistration {
            instance_id: instance_id.clone(),
            namespace: self.namespace.clone(),
            tp_rank: 0,
            tp_size: 1,
            world_size: 1,
            pp_rank: 0,
            device_id,
            layers,
            layer_group_ids: vec![],
            page_first: false,
        };
        crate::fd::send_fd(&self.socket, &instance_id, device_id, memory.export_fd())?;
        if let Err(e) = self
            .client
            .register(reg.to_request(memory.memory_kind(), memory.alloc_size()))
            .await
        {
            let _ = self.client.unregister(&instance_id).await;
            return Err(e);
        }
        Ok(NativeEngine {
            client: self.client,
            socket: self.socket,
            namespace: self.namespace,
            instance_id,
            device_id,
            session: Some(session),
            saves_since_flush: 0,
        })
    }
}

impl NativeEngine {
    /// The namespace.
    pub fn namespace(&self) -> &str {
        &self.namespace
    }

    /// The side channel's path.
    pub fn socket_path(&self) -> &std::path::Path {
        &self.socket
    }
}
