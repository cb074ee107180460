//! Wire ↔ domain: turns the Engine service's `pb::` requests into the engine's commands
//! ([`crate::engine::command`]) and its answers back into `pb::` responses.
//!
//! Owns the pure shape checks of every request (versions, signs, list lengths, caps, empty
//! ids), with the same codes and messages the server has always answered, and the input
//! bounds of every RPC of the Engine service (the `MAX_*` constants below: every id, name and
//! list a client sends is bounded here, before anything echoes it or allocates for it). Must
//! never: look at server state (instances, leases, the store) or have a side effect — a
//! request it refuses has changed nothing. Checks that come after a state lookup stay in the
//! engine, so the order in which a request with several faults is refused is unchanged.
//!
//! A value past a bound is INVALID_ARGUMENT naming the field and the limit, e.g.
//! `instance_id is 17000 bytes; the limit is 256 bytes`; no message echoes more than a short
//! prefix of a client string ([`crate::error::echo`]).

use std::collections::HashSet;

use pegaflow_api::{is_side_channel_safe_id, TransferMode};
use pegaflow_proto as pb;

pub use crate::engine::command::MAX_HASH_BYTES;
use crate::engine::command::{
    LeaseLoad, LoadCommand, LoadCompletion, QueryAnswer, QueryCommand, RegisterCommand,
    RegisterLayer, SaveCommand, SaveLayer,
};
use crate::error::{echo, EngineError, EngineResult};
use crate::plugin::{NativeAllocationSpec, NativeTensorView, NativeView, RegistrationPayload};

pub use pegaflow_api::limits::{
    MAX_BLOCKS_PER_LIST, MAX_INSTANCE_ID_BYTES, MAX_LAYERS_PER_REQUEST, MAX_LAYER_NAME_BYTES,
    MAX_LOAD_STATE_NAME_BYTES, MAX_NAMESPACE_BYTES, MAX_PEER_ID_BYTES, MAX_REQ_ID_BYTES,
    MIN_HASH_BYTES,
};

/// INVALID_ARGUMENT: `field` is `len` bytes, over `max`.
fn too_long(field: impl std::fmt::Display, len: usize, max: usize) -> EngineError {
    EngineError::invalid(format!("{field} is {len} bytes; the limit is {max} bytes"))
}

/// `value` is at most `max` bytes.
fn check_len(field: &str, value: &str, max: usize) -> EngineResult<()> {
    if value.len() > max {
        return Err(too_long(field, value.len(), max));
    }
    Ok(())
}

/// A list has at most `max` entries.
fn check_count(field: impl std::fmt::Display, n: usize, max: usize) -> EngineResult<()> {
    if n > max {
        return Err(EngineError::invalid(format!(
            "{field} has {n} entries; the limit is {max}"
        )));
    }
    Ok(())
}

/// Layer names: at most [`MAX_LAYER_NAME_BYTES`] each.
fn check_layer_names(field: &str, names: &[String]) -> EngineResult<()> {
    match names
        .iter()
        .enumerate()
        .find(|(_, n)| n.len() > MAX_LAYER_NAME_BYTES)
    {
        Some((i, n)) => Err(too_long(
            format_args!("{field}[{i}]"),
            n.len(),
            MAX_LAYER_NAME_BYTES,
        )),
        None => Ok(()),
    }
}

/// A block-hash list: at most [`MAX_BLOCKS_PER_LIST`] hashes of
/// [`MIN_HASH_BYTES`]..=[`MAX_HASH_BYTES`] bytes each.
fn check_hashes<'a, I>(field: &str, hashes: I) -> EngineResult<()>
where
    I: IntoIterator<Item = &'a [u8]>,
    I::IntoIter: ExactSizeIterator,
{
    let hashes = hashes.into_iter();
    check_count(field, hashes.len(), MAX_BLOCKS_PER_LIST)?;
    for (i, h) in hashes.enumerate() {
        if h.len() < MIN_HASH_BYTES {
            return Err(EngineError::invalid(format!(
                "{field}[{i}] is empty: a block hash is {MIN_HASH_BYTES} to {MAX_HASH_BYTES} bytes"
            )));
        }
        if h.len() > MAX_HASH_BYTES {
            return Err(too_long(
                format_args!("{field}[{i}]"),
                h.len(),
                MAX_HASH_BYTES,
            ));
        }
    }
    Ok(())
}

/// Whether `name` is a shared-memory object name `LoadStateWriter::attach` can open: 1 to
/// [`MAX_LOAD_STATE_NAME_BYTES`] bytes, no `/` and no NUL, not `.` or `..`.
fn check_load_state_name(name: &str) -> EngineResult<()> {
    check_len("load_state_shm", name, MAX_LOAD_STATE_NAME_BYTES)?;
    if name.is_empty() {
        return Err(EngineError::invalid(
            "load_state_shm must name the load-state object (or set wait_for_completion)",
        ));
    }
    if name.contains(['/', '\0']) || name == "." || name == ".." {
        return Err(EngineError::invalid(format!(
            "load_state_shm {:?} is not a shared-memory object name (no '/', no NUL, not . or ..)",
            echo(name)
        )));
    }
    Ok(())
}

/// The published client's version this server speaks.
pub const SERVER_VERSION: &str = pb::PUBLISHED_CLIENT_VERSION;

/// Whether `v` is a client version this server accepts: the published 0.25.x client, or this
/// project's native client of wire revision v1 or v2.
pub fn accepts_client_version(v: &str) -> bool {
    if v == pb::NATIVE_CLIENT_VERSION || v == pb::NATIVE_V2_CLIENT_VERSION {
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
    /// The side-channel key (instance id, device id) whose descriptors should be discarded,
    /// so the client can resend at once: every refused request's, native-looking or not (a
    /// native client whose request lost its native fields still sent a descriptor first);
    /// `None` for an id no side-channel message can carry.
    pub pending_fd: Option<(String, i32)>,
}

/// Decodes a RegisterContextBatch request.
pub fn register(req: pb::RegisterContextRequest) -> Result<RegisterCommand, RegisterRejected> {
    let key =
        is_side_channel_safe_id(&req.instance_id).then(|| (req.instance_id.clone(), req.device_id));
    register_checked(req).map_err(|error| RegisterRejected {
        error,
        pending_fd: key,
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
            "PegaFlow version mismatch: client={} server={SERVER_VERSION} (this server accepts 0.25.x, {} and {})",
            echo(client),
            pb::NATIVE_CLIENT_VERSION,
            pb::NATIVE_V2_CLIENT_VERSION
        )));
    }
    if req.instance_id.is_empty() {
        return Err(EngineError::invalid("instance_id must not be empty"));
    }
    check_len("instance_id", &req.instance_id, MAX_INSTANCE_ID_BYTES)?;
    check_len("namespace", &req.namespace, MAX_NAMESPACE_BYTES)?;
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
    check_count("layer_names", n, MAX_LAYERS_PER_REQUEST)?;
    check_layer_names("layer_names", &req.layer_names)?;
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
            return Err(EngineError::invalid(format!(
                "duplicate layer name {}",
                echo(name)
            )));
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
            echo(&req.client_version)
        )));
    }
    if has_v2_fields(req) {
        return Err(revision_mismatch(
            &req.client_version,
            "it carries native registration v2 fields (native_allocations, allocation_index)",
        ));
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
            echo(&req.instance_id)
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

pub use pegaflow_api::fd::MAX_NATIVE_ALLOCATIONS;

/// Whether the request carries any native field (v1 or v2).
fn looks_native(req: &pb::RegisterContextRequest) -> bool {
    req.memory_kind != 0 || !req.native_kv_tensors.is_empty() || has_v2_fields(req)
}

/// Whether the request carries a field only native registration v2 has.
fn has_v2_fields(req: &pb::RegisterContextRequest) -> bool {
    !req.native_allocations.is_empty()
        || req
            .native_kv_tensors
            .iter()
            .any(|t| t.allocation_index != 0)
}

/// FAILED_PRECONDITION: the request's fields are of another native wire revision than its
/// `client_version` says; names both revisions.
fn revision_mismatch(client_version: &str, why: &str) -> EngineError {
    EngineError::precondition(format!(
        "native registration revision mismatch: client={} but {why}; server={SERVER_VERSION} \
         speaks {} (one allocation: native_alloc_size) and {} (native_allocations)",
        echo(if client_version.is_empty() {
            "<missing>"
        } else {
            client_version
        }),
        pb::NATIVE_CLIENT_VERSION,
        pb::NATIVE_V2_CLIENT_VERSION
    ))
}

/// The payload of a native registration v2 (`0.25.1+native-v2`): every allocation and view
/// checked against the stated sizes, all layers in one storage group.
fn native_v2_payload(req: &pb::RegisterContextRequest) -> EngineResult<RegistrationPayload> {
    let n = req.layer_names.len();
    if req.native_allocations.is_empty() {
        return Err(revision_mismatch(
            &req.client_version,
            "the request has no native_allocations (field 103): a one-allocation registration \
             is revision v1",
        ));
    }
    if !req.wrapper_bytes.is_empty() {
        return Err(EngineError::invalid(
            "a registration carries either wrapper_bytes or native tensors, not both",
        ));
    }
    if req.native_alloc_size != 0 {
        return Err(EngineError::invalid(
            "a native v2 registration states sizes per allocation; native_alloc_size (field 101) must be 0",
        ));
    }
    if req.memory_kind <= 0 {
        return Err(EngineError::invalid(format!(
            "native registration needs a memory_kind (field 102) > 0, got {}",
            req.memory_kind
        )));
    }
    check_count(
        "native_allocations",
        req.native_allocations.len(),
        MAX_NATIVE_ALLOCATIONS,
    )?;
    if req.native_kv_tensors.len() != n {
        return Err(EngineError::invalid(format!(
            "native_kv_tensors has {} entries but layer_names has {n}",
            req.native_kv_tensors.len()
        )));
    }
    if !is_side_channel_safe_id(&req.instance_id) {
        return Err(EngineError::invalid(format!(
            "native instance_id {:?} must be 1-128 characters of [A-Za-z0-9_-]",
            echo(&req.instance_id)
        )));
    }
    if req.layer_group_ids.iter().any(|&g| g != 0) {
        return Err(EngineError::invalid(
            "a native v2 registration is one storage group (its arenas share block ids): layer_group_ids must be 0",
        ));
    }
    let ipc = req.memory_kind == pb::MemoryKind::CudaIpc as i32;
    let mut allocations = Vec::with_capacity(req.native_allocations.len());
    let mut handles = std::collections::HashMap::new();
    for (i, a) in req.native_allocations.iter().enumerate() {
        if a.size_bytes == 0 {
            return Err(EngineError::invalid(format!(
                "native_allocations[{i}].size_bytes must be > 0"
            )));
        }
        let ipc_handle = if ipc {
            let h: [u8; pb::CUDA_IPC_HANDLE_BYTES] =
                a.cuda_ipc_handle.as_slice().try_into().map_err(|_| {
                    EngineError::invalid(format!(
                        "native_allocations[{i}].cuda_ipc_handle is {} bytes; a CUDA IPC handle is {}",
                        a.cuda_ipc_handle.len(),
                        pb::CUDA_IPC_HANDLE_BYTES
                    ))
                })?;
            if let Some(j) = handles.insert(h, i) {
                return Err(EngineError::invalid(format!(
                    "native_allocations[{j}] and [{i}] carry the same CUDA IPC handle (name each allocation once)"
                )));
            }
            Some(h)
        } else {
            if !a.cuda_ipc_handle.is_empty() {
                return Err(EngineError::invalid(format!(
                    "native_allocations[{i}] carries a cuda_ipc_handle but memory_kind {} is not CUDA_IPC",
                    req.memory_kind
                )));
            }
            None
        };
        allocations.push(NativeAllocationSpec {
            size_bytes: a.size_bytes,
            ipc_handle,
        });
    }
    let mut used = vec![false; allocations.len()];
    let mut views = Vec::with_capacity(n);
    for (i, t) in req.native_kv_tensors.iter().enumerate() {
        let ai = t.allocation_index as usize;
        let Some(a) = allocations.get(ai) else {
            return Err(EngineError::invalid(format!(
                "native_kv_tensors[{i}].allocation_index {ai} is not one of the {} allocations",
                allocations.len()
            )));
        };
        used[ai] = true;
        if t.size_bytes == 0 || t.block_stride_bytes == 0 {
            return Err(EngineError::invalid(format!(
                "native_kv_tensors[{i}] needs size_bytes > 0 and block_stride_bytes > 0"
            )));
        }
        if t.offset_bytes
            .checked_add(t.size_bytes)
            .is_none_or(|end| end > a.size_bytes)
        {
            return Err(EngineError::invalid(format!(
                "native_kv_tensors[{i}]: view at offset {} of {} bytes exceeds allocation {ai} of {} bytes",
                t.offset_bytes, t.size_bytes, a.size_bytes
            )));
        }
        views.push(NativeTensorView {
            allocation: ai,
            view: NativeView {
                offset_bytes: t.offset_bytes,
                size_bytes: t.size_bytes,
                block_stride_bytes: t.block_stride_bytes,
            },
        });
    }
    if let Some(i) = used.iter().position(|u| !u) {
        return Err(EngineError::invalid(format!(
            "native_allocations[{i}] is not used by any tensor"
        )));
    }
    Ok(RegistrationPayload::NativeV2 {
        memory_kind: req.memory_kind,
        allocations,
        views,
    })
}

fn register_checked(mut req: pb::RegisterContextRequest) -> EngineResult<RegisterCommand> {
    let transfer_mode = check_register_header(&req)?;
    check_register_layers(&req)?;
    let n = req.layer_names.len();
    let payload = if req.client_version == pb::NATIVE_V2_CLIENT_VERSION {
        native_v2_payload(&req)?
    } else if looks_native(&req) {
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
        RegistrationPayload::NativeV2 { views, .. } => {
            Some(views.iter().map(|v| v.view.block_stride_bytes).collect())
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
    check_len("instance_id", &req.instance_id, MAX_INSTANCE_ID_BYTES)?;
    check_count("saves", req.saves.len(), MAX_LAYERS_PER_REQUEST)?;
    for (i, s) in req.saves.iter().enumerate() {
        if s.layer_name.len() > MAX_LAYER_NAME_BYTES {
            return Err(too_long(
                format_args!("saves[{i}].layer_name"),
                s.layer_name.len(),
                MAX_LAYER_NAME_BYTES,
            ));
        }
        check_hashes(&format!("saves[{i}].block_hashes"), &s.block_hashes)?;
        if s.block_ids.len() != s.block_hashes.len() {
            return Err(EngineError::invalid(format!(
                "layer {}: {} block_ids but {} block_hashes",
                echo(&s.layer_name),
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

/// The load-state word a refused Load should still report −1 to: the request's
/// `load_state_shm` when it is one ([`load`] refuses it otherwise) and the load does not wait.
pub fn load_state_word(req: &pb::LoadRequest) -> Option<&str> {
    (!req.wait_for_completion && check_load_state_name(&req.load_state_shm).is_ok())
        .then_some(req.load_state_shm.as_str())
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
        check_load_state_name(&req.load_state_shm)?;
        LoadCompletion::StateWord(req.load_state_shm)
    };
    check_len("instance_id", &req.instance_id, MAX_INSTANCE_ID_BYTES)?;
    let names: usize = req.groups.iter().map(|g| g.layer_names.len()).sum();
    check_count("groups (layer names)", names, MAX_LAYERS_PER_REQUEST)?;
    for (gi, g) in req.groups.iter().enumerate() {
        check_layer_names(&format!("groups[{gi}].layer_names"), &g.layer_names)?;
    }
    check_count("loads", req.loads.len(), MAX_BLOCKS_PER_LIST)?;
    for (li, l) in req.loads.iter().enumerate() {
        check_count(
            format_args!("loads[{li}].block_ids_by_group"),
            l.block_ids_by_group.len(),
            MAX_LAYERS_PER_REQUEST,
        )?;
        for (gi, g) in l.block_ids_by_group.iter().enumerate() {
            check_count(
                format_args!("loads[{li}].block_ids_by_group[{gi}].targets"),
                g.targets.len(),
                MAX_BLOCKS_PER_LIST,
            )?;
        }
    }
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
    check_len("instance_id", &req.instance_id, MAX_INSTANCE_ID_BYTES)?;
    check_len("req_id", &req.req_id, MAX_REQ_ID_BYTES)?;
    check_hashes("block_hashes", req.block_hashes.iter().map(Vec::as_slice))?;
    Ok(QueryCommand {
        instance_id: req.instance_id,
        req_id: req.req_id,
        hashes: req.block_hashes,
        group_id: req.group_id,
        wait_for_full_prefix: req.wait_for_full_prefix,
    })
}

/// Decodes a Release request: the lease token (16 bytes).
pub fn release(req: pb::ReleaseRequest) -> EngineResult<Vec<u8>> {
    crate::engine::parse_lease(&req.lease)?;
    Ok(req.lease)
}

/// Decodes an UnregisterContext request: the instance id (bounded; an empty or unknown one is
/// the engine's FAILED_PRECONDITION).
pub fn unregister(req: pb::UnregisterRequest) -> EngineResult<String> {
    check_len("instance_id", &req.instance_id, MAX_INSTANCE_ID_BYTES)?;
    Ok(req.instance_id)
}

/// Decodes a Session request: the instance id it watches (non-empty, bounded; the namespace
/// is bounded too, and otherwise unused).
pub fn session(req: pb::SessionRequest) -> EngineResult<String> {
    if req.instance_id.is_empty() {
        return Err(EngineError::invalid("instance_id must not be empty"));
    }
    check_len("instance_id", &req.instance_id, MAX_INSTANCE_ID_BYTES)?;
    check_len("namespace", &req.namespace, MAX_NAMESPACE_BYTES)?;
    Ok(req.instance_id)
}

/// Bounds of a QueryBlocksForTransfer request (handed to the peer delegate as it is).
pub fn check_query_blocks_for_transfer(
    req: &pb::QueryBlocksForTransferRequest,
) -> EngineResult<()> {
    check_len("namespace", &req.namespace, MAX_NAMESPACE_BYTES)?;
    check_len("requester_id", &req.requester_id, MAX_PEER_ID_BYTES)?;
    check_hashes("block_hashes", req.block_hashes.iter().map(Vec::as_slice))
}

/// Bounds of a ReleaseTransferLock request (handed to the peer delegate as it is).
pub fn check_release_transfer_lock(req: &pb::ReleaseTransferLockRequest) -> EngineResult<()> {
    check_len(
        "transfer_session_id",
        &req.transfer_session_id,
        MAX_PEER_ID_BYTES,
    )
}

/// Bounds of an RdmaHandshake request (handed to the peer delegate as it is).
pub fn check_rdma_handshake(req: &pb::RdmaHandshakeRequest) -> EngineResult<()> {
    check_len("requester_id", &req.requester_id, MAX_PEER_ID_BYTES)
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

    fn invalid_message<T: std::fmt::Debug>(r: EngineResult<T>) -> String {
        match r {
            Err(EngineError::InvalidArgument(m)) => m,
            other => panic!("expected INVALID_ARGUMENT, got {other:?}"),
        }
    }

    #[test]
    fn ids_and_names_are_bounded_naming_the_field_and_the_limit() {
        let big = "x".repeat(MAX_INSTANCE_ID_BYTES + 1);
        let m = invalid_message(save(pb::SaveRequest {
            instance_id: big.clone(),
            ..Default::default()
        }));
        assert_eq!(m, "instance_id is 257 bytes; the limit is 256 bytes");
        let at_limit = pb::SaveRequest {
            instance_id: "x".repeat(MAX_INSTANCE_ID_BYTES),
            ..Default::default()
        };
        assert!(save(at_limit).is_ok());
        let m = invalid_message(save(pb::SaveRequest {
            saves: vec![pb::SaveLayer {
                layer_name: "L".repeat(1 << 20),
                ..Default::default()
            }],
            ..Default::default()
        }));
        assert_eq!(
            m,
            "saves[0].layer_name is 1048576 bytes; the limit is 256 bytes"
        );
        let m = invalid_message(query(pb::QueryRequest {
            req_id: "r".repeat(MAX_REQ_ID_BYTES + 1),
            ..Default::default()
        }));
        assert!(m.starts_with("req_id is 1025 bytes"), "{m}");
        let m = invalid_message(unregister(pb::UnregisterRequest {
            instance_id: big.clone(),
        }));
        assert!(m.starts_with("instance_id is"), "{m}");
        let m = invalid_message(session(pb::SessionRequest {
            instance_id: "s".into(),
            namespace: "n".repeat(MAX_NAMESPACE_BYTES + 1),
            ..Default::default()
        }));
        assert!(m.starts_with("namespace is 1025 bytes"), "{m}");
        let mut reg = pb::RegisterContextRequest {
            instance_id: "i".into(),
            tp_size: 1,
            world_size: 1,
            client_version: pb::PUBLISHED_CLIENT_VERSION.into(),
            layer_names: vec!["ok".into(), "L".repeat(MAX_LAYER_NAME_BYTES + 1)],
            ..Default::default()
        };
        let m = invalid_message(register(reg.clone()).map_err(|r| r.error));
        assert!(m.starts_with("layer_names[1] is 257 bytes"), "{m}");
        reg.client_version = "v".repeat(1 << 20);
        let e = register(reg).unwrap_err().error.to_string();
        assert!(e.len() < 300, "the version is echoed as a prefix: {e}");
        let m = invalid_message(load(pb::LoadRequest {
            load_state_shm: "pega_load_x".into(),
            groups: vec![pb::LoadGroup {
                layer_names: vec!["L".repeat(MAX_LAYER_NAME_BYTES + 1)],
            }],
            ..Default::default()
        }));
        assert!(
            m.starts_with("groups[0].layer_names[0] is 257 bytes"),
            "{m}"
        );
    }

    #[test]
    fn block_hashes_are_one_to_max_bytes_and_lists_are_bounded() {
        let q = |hashes: Vec<Vec<u8>>| {
            query(pb::QueryRequest {
                req_id: "r".into(),
                block_hashes: hashes,
                ..Default::default()
            })
        };
        let m = invalid_message(q(vec![vec![1], vec![]]));
        assert!(m.starts_with("block_hashes[1] is empty"), "{m}");
        let m = invalid_message(q(vec![vec![0; MAX_HASH_BYTES + 1]]));
        assert_eq!(m, "block_hashes[0] is 1025 bytes; the limit is 1024 bytes");
        assert!(q(vec![vec![0; MAX_HASH_BYTES]; 2]).is_ok());
        let m = invalid_message(q(vec![vec![1]; MAX_BLOCKS_PER_LIST + 1]));
        assert_eq!(m, "block_hashes has 1048577 entries; the limit is 1048576");
        let m = invalid_message(save(pb::SaveRequest {
            saves: vec![pb::SaveLayer {
                layer_name: "l".into(),
                block_ids: vec![0],
                block_hashes: vec![vec![]].into(),
            }],
            ..Default::default()
        }));
        assert!(m.starts_with("saves[0].block_hashes[0] is empty"), "{m}");
        let peer = pb::QueryBlocksForTransferRequest {
            block_hashes: vec![vec![]],
            ..Default::default()
        };
        assert!(check_query_blocks_for_transfer(&peer).is_err());
    }

    #[test]
    fn load_state_names_must_be_shm_object_names() {
        let long = "p".repeat(MAX_LOAD_STATE_NAME_BYTES + 1);
        for bad in ["", "a/b", "/pega_load_x", ".", "..", "a\0b", long.as_str()] {
            let req = pb::LoadRequest {
                load_state_shm: bad.into(),
                ..Default::default()
            };
            assert_eq!(load_state_word(&req), None, "{bad:?}");
            let m = invalid_message(load(req));
            assert!(m.contains("load_state_shm"), "{bad:?}: {m}");
            assert!(m.len() < 200, "{m}");
        }
        let req = pb::LoadRequest {
            load_state_shm: "pega_load_0123".into(),
            instance_id: "i".repeat(MAX_INSTANCE_ID_BYTES + 1),
            ..Default::default()
        };
        assert_eq!(load_state_word(&req), Some("pega_load_0123"));
        assert!(load(req).is_err());
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

    fn v2_request() -> pb::RegisterContextRequest {
        pb::RegisterContextRequest {
            instance_id: "v2-inst".into(),
            tp_size: 1,
            world_size: 1,
            client_version: pb::NATIVE_V2_CLIENT_VERSION.into(),
            layer_names: vec!["mla".into(), "idxk".into()],
            num_blocks: vec![4, 4],
            bytes_per_block: vec![100, 10],
            kv_stride_bytes: vec![0, 0],
            segments: vec![1, 1],
            memory_kind: pb::MemoryKind::HostMemfd as i32,
            native_allocations: vec![
                pb::NativeAllocation {
                    size_bytes: 400,
                    cuda_ipc_handle: vec![],
                },
                pb::NativeAllocation {
                    size_bytes: 40,
                    cuda_ipc_handle: vec![],
                },
            ],
            native_kv_tensors: vec![
                pb::NativeKvTensor {
                    offset_bytes: 0,
                    size_bytes: 400,
                    block_stride_bytes: 100,
                    allocation_index: 0,
                },
                pb::NativeKvTensor {
                    offset_bytes: 0,
                    size_bytes: 40,
                    block_stride_bytes: 10,
                    allocation_index: 1,
                },
            ],
            ..Default::default()
        }
    }

    #[test]
    fn native_v2_decodes_allocations_and_views() {
        let cmd = register(v2_request()).unwrap();
        let RegistrationPayload::NativeV2 {
            memory_kind,
            allocations,
            views,
        } = &cmd.payload
        else {
            panic!("{:?}", cmd.payload)
        };
        assert_eq!(*memory_kind, pb::MemoryKind::HostMemfd as i32);
        assert_eq!(allocations.len(), 2);
        assert_eq!(views[1].allocation, 1);
        assert_eq!(cmd.layers[1].block_stride_bytes, Some(10));
        assert!(cmd.native());
    }

    #[test]
    fn native_v2_bad_shapes_are_refused_naming_the_entry() {
        type Edit = fn(&mut pb::RegisterContextRequest);
        let cases: Vec<(Edit, &str)> = vec![
            (
                |r| r.native_alloc_size = 440,
                "native_alloc_size (field 101) must be 0",
            ),
            (|r| r.memory_kind = 0, "memory_kind (field 102) > 0"),
            (
                |r| r.native_allocations[1].size_bytes = 0,
                "native_allocations[1].size_bytes",
            ),
            (
                |r| r.native_kv_tensors[1].allocation_index = 2,
                "allocation_index 2 is not one of the 2",
            ),
            (
                |r| r.native_kv_tensors[1].offset_bytes = 1,
                "exceeds allocation 1 of 40 bytes",
            ),
            (
                |r| r.native_kv_tensors[1].allocation_index = 0,
                "native_allocations[1] is not used",
            ),
            (
                |r| r.native_allocations[0].cuda_ipc_handle = vec![1; 64],
                "carries a cuda_ipc_handle",
            ),
            (|r| r.layer_group_ids = vec![0, 1], "one storage group"),
            (
                |r| r.native_kv_tensors.truncate(1),
                "native_kv_tensors has 1 entries",
            ),
            (
                |r| r.instance_id = "bad/id".into(),
                "must be 1-128 characters",
            ),
            (
                |r| {
                    r.memory_kind = pb::MemoryKind::CudaIpc as i32;
                    r.native_allocations[0].cuda_ipc_handle = vec![1; 64];
                    r.native_allocations[1].cuda_ipc_handle = vec![1; 63];
                },
                "cuda_ipc_handle is 63 bytes",
            ),
            (
                |r| {
                    r.memory_kind = pb::MemoryKind::CudaIpc as i32;
                    r.native_allocations[0].cuda_ipc_handle = vec![1; 64];
                    r.native_allocations[1].cuda_ipc_handle = vec![1; 64];
                },
                "carry the same CUDA IPC handle",
            ),
        ];
        for (edit, want) in cases {
            let mut r = v2_request();
            edit(&mut r);
            let rej = register(r).unwrap_err();
            // Every refusal names the side-channel key, so its pending descriptors are closed;
            // but an id no side-channel message can carry (the channel refuses the message).
            let key = if want == "must be 1-128 characters" {
                None
            } else {
                Some(0)
            };
            assert_eq!(rej.pending_fd.as_ref().map(|k| k.1), key, "{want}");
            let m = invalid_message::<()>(Err(rej.error));
            assert!(m.contains(want), "{want:?} not in {m:?}");
        }
    }

    #[test]
    fn native_revision_mismatch_is_a_precondition_both_ways() {
        let mut r = v2_request();
        r.client_version = pb::NATIVE_CLIENT_VERSION.into();
        let e = register(r).unwrap_err();
        assert_eq!(e.pending_fd, Some(("v2-inst".to_string(), 0)));
        let m = e.error.to_string();
        assert!(matches!(e.error, EngineError::FailedPrecondition(_)), "{m}");
        assert!(
            m.contains("client=0.25.1+native-v1") && m.contains("0.25.1+native-v2"),
            "{m}"
        );
        let mut r = v2_request();
        r.native_allocations.clear();
        r.native_kv_tensors
            .iter_mut()
            .for_each(|t| t.allocation_index = 0);
        r.native_alloc_size = 400;
        let e = register(r).unwrap_err();
        let m = e.error.to_string();
        assert!(matches!(e.error, EngineError::FailedPrecondition(_)), "{m}");
        assert!(
            m.contains("client=0.25.1+native-v2") && m.contains("0.25.1+native-v1"),
            "{m}"
        );
        assert!(accepts_client_version(pb::NATIVE_V2_CLIENT_VERSION));
        assert!(!accepts_client_version("0.25.1+native-v3"));
    }
}
