//! Wire ↔ domain: turns the Engine service's `pb::` requests into the engine's commands
//! ([`crate::engine::command`]) and its answers back into `pb::` responses.
//!
//! Owns the pure shape checks of every request (versions, signs, list lengths, caps, empty
//! ids), with the same codes and messages the server has always answered. Must never: look at
//! server state (instances, leases, the store) or have a side effect — a request it refuses
//! has changed nothing. Checks that come after a state lookup stay in the engine, so the order
//! in which a request with several faults is refused is unchanged.

use std::collections::HashSet;

use pegaflow_api::{is_side_channel_safe_id, TransferMode};
use pegaflow_proto as pb;

use crate::engine::command::{
    LeaseLoad, LoadCommand, LoadCompletion, QueryAnswer, QueryCommand, RegisterCommand,
    RegisterLayer, SaveCommand, SaveLayer, MAX_HASH_BYTES,
};
use crate::error::{EngineError, EngineResult};
use crate::plugin::{NativeView, RegistrationPayload};

/// The published client's version this server speaks.
pub const SERVER_VERSION: &str = pb::PUBLISHED_CLIENT_VERSION;

/// Whether `v` is a client version this server accepts: the published 0.25.x client, or this
/// project's native client of the same wire revision.
pub fn accepts_client_version(v: &str) -> bool {
    if v == pb::NATIVE_CLIENT_VERSION {
        return true;
    }
    match v.strip_prefix("0.25.") {
        Some(patch) => !patch.is_empty() && patch.bytes().all(|b| b.is_ascii_digit()),
        None => false,
    }
}

/// A registration refused while decoding.
#[derive(Debug, Clone)]
pub struct RegisterRejected {
    /// Why.
    pub error: EngineError,
    /// For a request that looks native: the side-channel key (instance id, device id) whose
    /// pending descriptor should be discarded, so the client can resend at once.
    pub pending_fd: Option<(String, i32)>,
}

/// Decodes a RegisterContextBatch request.
pub fn register(req: pb::RegisterContextRequest) -> Result<RegisterCommand, RegisterRejected> {
    let looks_native = req.memory_kind != 0 || !req.native_kv_tensors.is_empty();
    let key = (req.instance_id.clone(), req.device_id);
    register_checked(req).map_err(|error| RegisterRejected {
        error,
        pending_fd: looks_native.then_some(key),
    })
}

fn check_register_header(req: &pb::RegisterContextRequest) -> EngineResult<TransferMode> {
    if !accepts_client_version(&req.client_version) {
        let client = if req.client_version.is_empty() {
            "<missing>"
        } else {
            &req.client_version
        };
        return Err(EngineError::precondition(format!(
            "PegaFlow version mismatch: client={client} server={SERVER_VERSION} (this server accepts 0.25.x and {})",
            pb::NATIVE_CLIENT_VERSION
        )));
    }
    if req.instance_id.is_empty() {
        return Err(EngineError::invalid("instance_id must not be empty"));
    }
    if req.device_id < 0 {
        return Err(EngineError::invalid(format!(
            "device_id must be >= 0, got {}",
            req.device_id
        )));
    }
    if req.tp_size == 0 {
        return Err(EngineError::invalid("tp_size must be > 0"));
    }
    if req.world_size == 0 {
        return Err(EngineError::invalid("world_size must be > 0"));
    }
    if req.tp_rank >= req.tp_size {
        return Err(EngineError::invalid(format!(
            "tp_rank {} must be < tp_size {}",
            req.tp_rank, req.tp_size
        )));
    }
    TransferMode::from_wire(req.transfer_mode)
        .ok_or_else(|| EngineError::invalid(format!("unknown transfer_mode {}", req.transfer_mode)))
}

/// Every per-layer list has one entry per layer name; names are non-empty and distinct.
fn check_register_layers(req: &pb::RegisterContextRequest) -> EngineResult<()> {
    let n = req.layer_names.len();
    if n == 0 {
        return Err(EngineError::invalid(
            "at least one layer must be registered",
        ));
    }
    let lens = [
        ("num_blocks", req.num_blocks.len()),
        ("bytes_per_block", req.bytes_per_block.len()),
        ("kv_stride_bytes", req.kv_stride_bytes.len()),
        ("segments", req.segments.len()),
    ];
    for (name, len) in lens {
        if len != n {
            return Err(EngineError::invalid(format!(
                "{name} has {len} entries but layer_names has {n}"
            )));
        }
    }
    if !req.layer_group_ids.is_empty() && req.layer_group_ids.len() != n {
        return Err(EngineError::invalid(format!(
            "layer_group_ids has {} entries but layer_names has {n}",
            req.layer_group_ids.len()
        )));
    }
    let mut seen = HashSet::new();
    for name in &req.layer_names {
        if name.is_empty() {
            return Err(EngineError::invalid("layer names must not be empty"));
        }
        if !seen.insert(name.as_str()) {
            return Err(EngineError::invalid(format!("duplicate layer name {name}")));
        }
    }
    Ok(())
}

/// The side-channel payload of a native registration, and its per-layer block strides.
fn native_payload(req: &pb::RegisterContextRequest) -> EngineResult<RegistrationPayload> {
    let n = req.layer_names.len();
    if req.client_version != pb::NATIVE_CLIENT_VERSION {
        return Err(EngineError::precondition(format!(
            "native registration fields need client_version {} (the native wire revision), got {}",
            pb::NATIVE_CLIENT_VERSION,
            req.client_version
        )));
    }
    if !req.wrapper_bytes.is_empty() {
        return Err(EngineError::invalid(
            "a registration carries either wrapper_bytes or native_kv_tensors, not both",
        ));
    }
    if req.memory_kind <= 0 {
        return Err(EngineError::invalid(format!(
            "native registration needs a memory_kind (field 102) > 0, got {}",
            req.memory_kind
        )));
    }
    if req.native_kv_tensors.len() != n {
        return Err(EngineError::invalid(format!(
            "native_kv_tensors has {} entries but layer_names has {n}",
            req.native_kv_tensors.len()
        )));
    }
    if !is_side_channel_safe_id(&req.instance_id) {
        return Err(EngineError::invalid(format!(
            "native instance_id {:?} must be 1-128 characters of [A-Za-z0-9_-]",
            req.instance_id
        )));
    }
    if req.native_alloc_size == 0 {
        return Err(EngineError::invalid("native_alloc_size must be > 0"));
    }
    let mut views = Vec::with_capacity(n);
    for (i, t) in req.native_kv_tensors.iter().enumerate() {
        if t.size_bytes == 0 || t.block_stride_bytes == 0 {
            return Err(EngineError::invalid(format!(
                "native_kv_tensors[{i}] needs size_bytes > 0 and block_stride_bytes > 0"
            )));
        }
        if t.offset_bytes.checked_add(t.size_bytes).is_none() {
            return Err(EngineError::invalid(format!(
                "native_kv_tensors[{i}] offset + size overflows"
            )));
        }
        views.push(NativeView {
            offset_bytes: t.offset_bytes,
            size_bytes: t.size_bytes,
            block_stride_bytes: t.block_stride_bytes,
        });
    }
    Ok(RegistrationPayload::SideChannel {
        memory_kind: req.memory_kind,
        alloc_size: req.native_alloc_size,
        views,
    })
}

fn register_checked(mut req: pb::RegisterContextRequest) -> EngineResult<RegisterCommand> {
    let transfer_mode = check_register_header(&req)?;
    check_register_layers(&req)?;
    let n = req.layer_names.len();
    let native = req.memory_kind != 0 || !req.native_kv_tensors.is_empty();
    let payload = if native {
        native_payload(&req)?
    } else {
        if req.wrapper_bytes.len() != n {
            return Err(EngineError::invalid(format!(
                "wrapper_bytes has {} entries but layer_names has {n}",
                req.wrapper_bytes.len()
            )));
        }
        RegistrationPayload::LayerBlobs(std::mem::take(&mut req.wrapper_bytes))
    };
    let groups = if req.layer_group_ids.is_empty() {
        vec![0; n]
    } else {
        std::mem::take(&mut req.layer_group_ids)
    };
    if req.page_first && groups.iter().any(|&g| g != 0) {
        return Err(EngineError::invalid(
            "page_first cannot be combined with more than one storage group",
        ));
    }
    let strides: Option<Vec<u64>> = match &payload {
        RegistrationPayload::SideChannel { views, .. } => {
            Some(views.iter().map(|v| v.block_stride_bytes).collect())
        }
        RegistrationPayload::LayerBlobs(_) => None,
    };
    let layers = std::mem::take(&mut req.layer_names)
        .into_iter()
        .enumerate()
        .map(|(i, name)| RegisterLayer {
            name,
            num_blocks: req.num_blocks[i],
            bytes_per_block: req.bytes_per_block[i],
            segments: req.segments[i],
            kv_stride_bytes: req.kv_stride_bytes[i],
            block_stride_bytes: strides.as_ref().map(|s| s[i]),
            group: groups[i],
        })
        .collect();
    Ok(RegisterCommand {
        instance_id: req.instance_id,
        namespace: req.namespace,
        device_id: req.device_id,
        tp_rank: req.tp_rank,
        pp_rank: req.pp_rank,
        tp_size: req.tp_size,
        world_size: req.world_size,
        page_first: req.page_first,
        transfer_mode,
        layers,
        payload,
    })
}

/// Decodes a Save request.
pub fn save(req: pb::SaveRequest) -> EngineResult<SaveCommand> {
    if req.device_id < 0 {
        return Err(EngineError::invalid(format!(
            "device_id must be >= 0, got {}",
            req.device_id
        )));
    }
    for s in &req.saves {
        if let Some(h) = s.block_hashes.iter().find(|h| h.len() > MAX_HASH_BYTES) {
            return Err(EngineError::invalid(format!(
                "layer {}: a block hash of {} bytes exceeds the {MAX_HASH_BYTES}-byte limit",
                s.layer_name,
                h.len()
            )));
        }
        if s.block_ids.len() != s.block_hashes.len() {
            return Err(EngineError::invalid(format!(
                "layer {}: {} block_ids but {} block_hashes",
                s.layer_name,
                s.block_ids.len(),
                s.block_hashes.len()
            )));
        }
    }
    Ok(SaveCommand {
        instance_id: req.instance_id,
        device_id: req.device_id,
        tp_rank: req.tp_rank,
        pp_rank: req.pp_rank,
        layers: req
            .saves
            .into_iter()
            .map(|s| SaveLayer {
                name: s.layer_name,
                block_ids: s.block_ids,
                hashes: s.block_hashes,
            })
            .collect(),
    })
}

/// Decodes a Load request.
pub fn load(req: pb::LoadRequest) -> EngineResult<LoadCommand> {
    let completion = if req.wait_for_completion {
        if !req.load_state_shm.is_empty() {
            return Err(EngineError::invalid(
                "a load with wait_for_completion must not name a load_state_shm",
            ));
        }
        LoadCompletion::Wait
    } else {
        LoadCompletion::StateWord(req.load_state_shm)
    };
    Ok(LoadCommand {
        instance_id: req.instance_id,
        tp_rank: req.tp_rank,
        device_id: req.device_id,
        completion,
        groups: req.groups.into_iter().map(|g| g.layer_names).collect(),
        leases: req
            .loads
            .into_iter()
            .map(|l| LeaseLoad {
                lease: l.lease,
                targets_by_group: l
                    .block_ids_by_group
                    .into_iter()
                    .map(|g| {
                        g.targets
                            .into_iter()
                            .map(|t| t.target.map(|pb::load_block_target::Target::BlockId(b)| b))
                            .collect()
                    })
                    .collect(),
            })
            .collect(),
    })
}

/// Decodes a QueryPrefetch request.
pub fn query(req: pb::QueryRequest) -> EngineResult<QueryCommand> {
    if req.req_id.is_empty() {
        return Err(EngineError::invalid("req_id must not be empty"));
    }
    Ok(QueryCommand {
        instance_id: req.instance_id,
        req_id: req.req_id,
        hashes: req.block_hashes,
        group_id: req.group_id,
        wait_for_full_prefix: req.wait_for_full_prefix,
    })
}

/// Encodes a query answer.
pub fn query_response(answer: QueryAnswer) -> pb::QueryResponse {
    let outcome = match answer {
        QueryAnswer::Ready {
            num_hit_blocks,
            lease,
            hit_positions,
        } => pb::query_response::Outcome::Ready(pb::QueryReady {
            num_hit_blocks,
            lease: lease.map(|l| l.to_vec()).unwrap_or_default(),
            hit_positions,
        }),
        QueryAnswer::Loading => pb::query_response::Outcome::Loading(pb::QueryLoading {}),
    };
    pb::QueryResponse {
        outcome: Some(outcome),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn version_gate() {
        assert!(accepts_client_version("0.25.1"));
        assert!(accepts_client_version("0.25.7"));
        assert!(accepts_client_version(pb::NATIVE_CLIENT_VERSION));
        assert!(!accepts_client_version("0.26.0"));
        assert!(!accepts_client_version("0.25."));
        assert!(!accepts_client_version("0.25.1+native-v0"));
        assert!(!accepts_client_version(""));
    }

    #[test]
    fn load_targets_decode_with_skips() {
        let req = pb::LoadRequest {
            instance_id: "i".into(),
            wait_for_completion: true,
            groups: vec![pb::LoadGroup {
                layer_names: vec!["l0".into()],
            }],
            loads: vec![pb::LeaseLoad {
                lease: vec![1; 16],
                block_ids_by_group: vec![pb::LoadBlockIds {
                    targets: vec![
                        pb::LoadBlockTarget {
                            target: Some(pb::load_block_target::Target::BlockId(3)),
                        },
                        pb::LoadBlockTarget { target: None },
                    ],
                }],
            }],
            ..Default::default()
        };
        let cmd = load(req).unwrap();
        assert_eq!(cmd.completion, LoadCompletion::Wait);
        assert_eq!(cmd.leases[0].targets_by_group, vec![vec![Some(3), None]]);
    }

    #[test]
    fn waiting_load_names_no_state_word() {
        let req = pb::LoadRequest {
            wait_for_completion: true,
            load_state_shm: "x".into(),
            ..Default::default()
        };
        assert!(matches!(load(req), Err(EngineError::InvalidArgument(_))));
    }

    #[test]
    fn native_looking_rejection_names_the_fd_key() {
        let req = pb::RegisterContextRequest {
            instance_id: "n1".into(),
            device_id: 2,
            memory_kind: 1,
            ..Default::default()
        };
        let r = register(req).unwrap_err();
        assert_eq!(r.pending_fd, Some(("n1".to_string(), 2)));
    }
}
