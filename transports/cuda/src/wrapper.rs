//! The pickled `pegaflow.ipc_wrapper.CudaIPCWrapper` the published Python client sends, one per
//! layer (engine-wire.md §8): parsed without Python or torch.
//!
//! Owns: turning the pickle's object graph ([`crate::pickle`]) into a [`CudaIpcWrapper`] (the
//! torch `_share_cuda_()` handle tuple, dtype and element size, shape, stride, storage offset,
//! device UUID), classifying the memory handle ([`MemHandle`]), and the byte arithmetic that
//! places the tensor inside the IPC allocation ([`CudaIpcWrapper::data_offset_bytes`],
//! [`CudaIpcWrapper::registrable_bytes`]). It also builds such pickles ([`encode_wrapper`]) the
//! way torch and CPython do, for tests and native tools.
//!
//! Must never: touch a GPU, panic on any input (all arithmetic is checked), or misread an
//! expandable-segment handle as an IPC handle (it is refused, naming
//! `PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`).

use crate::pickle::{self, Encoder, PickleError, Value};

/// Size of a `cudaIpcMemHandle_t` / `CUipcMemHandle`, in bytes.
pub const IPC_HANDLE_BYTES: usize = 64;
/// Size of a `cudaIpcEventHandle_t` / `CUipcEventHandle`, in bytes.
pub const IPC_EVENT_HANDLE_BYTES: usize = 64;

/// Why a wrapper could not be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WrapperError {
    /// The bytes are not a pickle this parser reads.
    #[error("CudaIPCWrapper pickle: {0}")]
    Pickle(#[from] PickleError),
    /// The pickle decodes but does not hold a well-formed `CudaIPCWrapper`.
    #[error("CudaIPCWrapper: {0}")]
    Invalid(String),
    /// The tensor lives in an expandable segment, which has no CUDA IPC handle.
    #[error(
        "CudaIPCWrapper: the tensor was allocated by PyTorch with expandable segments \
         (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True); its handle is not a CUDA IPC \
         handle and this server cannot import it. Start the engine without \
         expandable_segments:True (or set expandable_segments:False) to register its KV cache"
    )]
    ExpandableSegment,
}

fn invalid(what: impl Into<String>) -> WrapperError {
    WrapperError::Invalid(what.into())
}

/// The memory handle in `handle[1]`, classified.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MemHandle {
    /// A `cudaIpcMemHandle_t` for the base of the caching allocator's block: open it with
    /// `cuIpcOpenMemHandle`.
    Ipc {
        /// The ShareableHandle version byte (1 or 2), or `None` for old torch's raw 64 bytes.
        version: Option<u8>,
        /// The 64 handle bytes.
        handle: [u8; IPC_HANDLE_BYTES],
    },
    /// An expandable segment (type `'e'`): shared through a file descriptor of the producer,
    /// not importable here.
    ExpandableSegment {
        /// The ShareableHandle version byte.
        version: u8,
        /// The payload after the version and type bytes.
        payload: Vec<u8>,
    },
}

impl MemHandle {
    /// Classifies `handle[1]`: version byte (1 or 2) + `'c'` + 64 bytes is IPC; version byte +
    /// `'e'` + payload is an expandable segment; exactly 64 bytes is old torch's raw IPC handle.
    ///
    /// Errors: [`WrapperError::Invalid`] for any other shape.
    pub fn classify(b: &[u8]) -> Result<Self, WrapperError> {
        match b {
            [v @ (1 | 2), b'c', rest @ ..] if rest.len() == IPC_HANDLE_BYTES => {
                let mut handle = [0u8; IPC_HANDLE_BYTES];
                handle.copy_from_slice(rest);
                Ok(MemHandle::Ipc {
                    version: Some(*v),
                    handle,
                })
            }
            [v @ (1 | 2), b'e', rest @ ..] => Ok(MemHandle::ExpandableSegment {
                version: *v,
                payload: rest.to_vec(),
            }),
            _ if b.len() == IPC_HANDLE_BYTES => {
                let mut handle = [0u8; IPC_HANDLE_BYTES];
                handle.copy_from_slice(b);
                Ok(MemHandle::Ipc {
                    version: None,
                    handle,
                })
            }
            [v, t, ..] => Err(invalid(format!(
                "unrecognised memory handle: {} bytes, version byte {v}, type byte 0x{t:02x} \
                 (expected version 1 or 2 and type 'c' with a 64-byte cudaIpcMemHandle_t)",
                b.len()
            ))),
            _ => Err(invalid(format!(
                "unrecognised memory handle of {} bytes",
                b.len()
            ))),
        }
    }
}

/// A torch dtype: its name (without `torch.`) and element size.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Dtype {
    /// The attribute name in module `torch`, e.g. `bfloat16`.
    pub name: String,
    /// Bytes per element.
    pub itemsize: u64,
}

/// The element size of torch dtype `name` (its attribute name in `torch`), or `None` when
/// unknown. Covers the canonical names and torch's aliases (`half`, `float`, `long`, ...).
pub fn dtype_itemsize(name: &str) -> Option<u64> {
    Some(match name {
        "bool" | "uint8" | "int8" | "quint8" | "qint8" | "quint4x2" | "quint2x4" => 1,
        "float8_e4m3fn" | "float8_e5m2" | "float8_e4m3fnuz" | "float8_e5m2fnuz"
        | "float8_e8m0fnu" | "float4_e2m1fn_x2" | "bits8" => 1,
        "int16" | "short" | "uint16" | "float16" | "half" | "bfloat16" | "bits16" => 2,
        "int32" | "int" | "uint32" | "float32" | "float" | "qint32" | "complex32" | "chalf" => 4,
        "int64" | "long" | "uint64" | "float64" | "double" | "complex64" | "cfloat" => 8,
        "complex128" | "cdouble" => 16,
        _ => return None,
    })
}

/// One layer's pickled `CudaIPCWrapper`, decoded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CudaIpcWrapper {
    /// `handle[0]`: the producer's device index (relative to its CUDA_VISIBLE_DEVICES: use
    /// [`CudaIpcWrapper::device_uuid`] to find the device).
    pub device_index: i64,
    /// `handle[1]`, raw.
    pub raw_handle: Vec<u8>,
    /// `handle[2]`: the storage's size in bytes.
    pub storage_size_bytes: u64,
    /// `handle[3]`: the storage's byte offset inside the IPC allocation.
    pub storage_offset_bytes: u64,
    /// `handle[4]`: name of torch's producer-side ref-counter shm file.
    pub ref_counter_name: Vec<u8>,
    /// `handle[5]`: slot in that file.
    pub ref_counter_slot: i64,
    /// `handle[6]`: the `cudaIpcEventHandle_t` (64 bytes when present).
    pub event_handle: Vec<u8>,
    /// `handle[7]`: whether the consumer should wait on that event before first access.
    pub event_sync_required: bool,
    /// Element type.
    pub dtype: Dtype,
    /// Tensor shape, in elements.
    pub shape: Vec<u64>,
    /// Tensor stride, in elements.
    pub stride: Vec<i64>,
    /// The tensor's offset into its storage, in elements.
    pub storage_offset: u64,
    /// The CUDA device UUID, lowercase `xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx` (a `GPU-` prefix,
    /// if the producer sent one, is removed).
    pub device_uuid: String,
}

impl CudaIpcWrapper {
    /// The classified memory handle.
    ///
    /// Errors: as [`MemHandle::classify`].
    pub fn mem_handle(&self) -> Result<MemHandle, WrapperError> {
        MemHandle::classify(&self.raw_handle)
    }

    /// The 64-byte IPC handle to open.
    ///
    /// Errors: [`WrapperError::ExpandableSegment`] for an expandable segment,
    /// [`WrapperError::Invalid`] for an unrecognised handle.
    pub fn ipc_handle(&self) -> Result<[u8; IPC_HANDLE_BYTES], WrapperError> {
        match self.mem_handle()? {
            MemHandle::Ipc { handle, .. } => Ok(handle),
            MemHandle::ExpandableSegment { .. } => Err(WrapperError::ExpandableSegment),
        }
    }

    /// The 64-byte IPC event handle, when the producer asks for a wait and sent one.
    pub fn ipc_event_handle(&self) -> Option<[u8; IPC_EVENT_HANDLE_BYTES]> {
        if !self.event_sync_required || self.event_handle.len() != IPC_EVENT_HANDLE_BYTES {
            return None;
        }
        let mut h = [0u8; IPC_EVENT_HANDLE_BYTES];
        h.copy_from_slice(&self.event_handle);
        Some(h)
    }

    /// `storage_offset * itemsize`: the tensor's first byte relative to its storage.
    ///
    /// Errors: [`WrapperError::Invalid`] on overflow or when it lies past the storage's end.
    pub fn view_offset_bytes(&self) -> Result<u64, WrapperError> {
        let off = self
            .storage_offset
            .checked_mul(self.dtype.itemsize)
            .ok_or_else(|| invalid("storage_offset * itemsize overflows"))?;
        if off > self.storage_size_bytes {
            return Err(invalid(format!(
                "storage offset of {off} bytes lies past the storage's {} bytes",
                self.storage_size_bytes
            )));
        }
        Ok(off)
    }

    /// The tensor's first byte relative to the IPC allocation's base:
    /// `handle[3] + storage_offset * itemsize`.
    ///
    /// Errors: as [`CudaIpcWrapper::view_offset_bytes`], or on overflow.
    pub fn data_offset_bytes(&self) -> Result<u64, WrapperError> {
        self.storage_offset_bytes
            .checked_add(self.view_offset_bytes()?)
            .ok_or_else(|| invalid("data offset overflows"))
    }

    /// Bytes addressable from the tensor's first byte to the storage's end:
    /// `handle[2] - storage_offset * itemsize`.
    ///
    /// Errors: as [`CudaIpcWrapper::view_offset_bytes`].
    pub fn registrable_bytes(&self) -> Result<u64, WrapperError> {
        Ok(self.storage_size_bytes - self.view_offset_bytes()?)
    }

    /// The end of the storage relative to the allocation's base: `handle[3] + handle[2]`.
    ///
    /// Errors: [`WrapperError::Invalid`] on overflow.
    pub fn storage_end_bytes(&self) -> Result<u64, WrapperError> {
        self.storage_offset_bytes
            .checked_add(self.storage_size_bytes)
            .ok_or_else(|| invalid("storage end overflows"))
    }

    /// Bytes the view itself spans from its first element (0 for an empty tensor):
    /// `(1 + Σ (shape_i - 1) * stride_i) * itemsize`.
    ///
    /// Errors: [`WrapperError::Invalid`] for negative strides or on overflow.
    pub fn view_span_bytes(&self) -> Result<u64, WrapperError> {
        if self.shape.contains(&0) {
            return Ok(0);
        }
        let mut last: u64 = 0;
        for (&n, &s) in self.shape.iter().zip(&self.stride) {
            let s = u64::try_from(s).map_err(|_| invalid("negative stride"))?;
            last = (n - 1)
                .checked_mul(s)
                .and_then(|x| x.checked_add(last))
                .ok_or_else(|| invalid("tensor span overflows"))?;
        }
        last.checked_add(1)
            .and_then(|e| e.checked_mul(self.dtype.itemsize))
            .ok_or_else(|| invalid("tensor span overflows"))
    }
}

fn int(v: &Value, what: &str) -> Result<i128, WrapperError> {
    match v {
        Value::Int(i) => Ok(*i),
        Value::Bool(b) => Ok(i128::from(*b)),
        other => Err(invalid(format!(
            "{what} must be an int, not {}",
            other.type_name()
        ))),
    }
}

fn uint(v: &Value, what: &str) -> Result<u64, WrapperError> {
    let i = int(v, what)?;
    u64::try_from(i).map_err(|_| invalid(format!("{what} = {i} is out of range")))
}

fn sint(v: &Value, what: &str) -> Result<i64, WrapperError> {
    let i = int(v, what)?;
    i64::try_from(i).map_err(|_| invalid(format!("{what} = {i} is out of range")))
}

fn bytes<'a>(v: &'a Value, what: &str) -> Result<&'a [u8], WrapperError> {
    match v {
        Value::Bytes(b) => Ok(b),
        other => Err(invalid(format!(
            "{what} must be bytes, not {}",
            other.type_name()
        ))),
    }
}

fn seq<'a>(v: &'a Value, what: &str) -> Result<&'a [Value], WrapperError> {
    match v {
        Value::Tuple(t) | Value::List(t) => Ok(t),
        other => Err(invalid(format!(
            "{what} must be a tuple, not {}",
            other.type_name()
        ))),
    }
}

fn field<'a>(state: &'a Value, key: &str) -> Result<&'a Value, WrapperError> {
    state
        .dict_get(key)
        .ok_or_else(|| invalid(format!("missing field {key:?}")))
}

/// Normalises a CUDA device UUID to lowercase `8-4-4-4-12` hex without a `GPU-` prefix.
///
/// Errors: [`WrapperError::Invalid`] when `s` is not such a UUID.
pub fn normalize_uuid(s: &str) -> Result<String, WrapperError> {
    let t = s.strip_prefix("GPU-").unwrap_or(s);
    let ok = t.len() == 36
        && t.char_indices().all(|(i, c)| {
            if matches!(i, 8 | 13 | 18 | 23) {
                c == '-'
            } else {
                c.is_ascii_hexdigit()
            }
        });
    if !ok {
        return Err(invalid(format!(
            "device_uuid {s:?} is not a CUDA device UUID (xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx)"
        )));
    }
    Ok(t.to_ascii_lowercase())
}

/// Decodes one pickled `CudaIPCWrapper`.
///
/// Errors: [`WrapperError::Pickle`] when the bytes are not a readable pickle,
/// [`WrapperError::Invalid`] when a field is missing or of the wrong type or out of range.
/// Expandable-segment handles decode fine here; [`CudaIpcWrapper::ipc_handle`] refuses them.
pub fn parse_wrapper(buf: &[u8]) -> Result<CudaIpcWrapper, WrapperError> {
    let root = pickle::decode(buf)?;
    let Value::Call {
        callable, state, ..
    } = &root
    else {
        return Err(invalid(format!(
            "top-level value is a {}, not an object",
            root.type_name()
        )));
    };
    match &**callable {
        Value::Global { name, .. } if &**name == "CudaIPCWrapper" => {}
        Value::Global { module, name } => {
            return Err(invalid(format!(
                "object is a {module}.{name}, not a CudaIPCWrapper"
            )))
        }
        other => return Err(invalid(format!("object class is a {}", other.type_name()))),
    }
    let state = state
        .as_deref()
        .ok_or_else(|| invalid("object has no state (BUILD)"))?;
    if !matches!(state, Value::Dict(_)) {
        return Err(invalid(format!(
            "state is a {}, not a dict",
            state.type_name()
        )));
    }

    let handle = seq(field(state, "handle")?, "handle")?;
    if handle.len() != 8 {
        return Err(invalid(format!(
            "handle has {} items, expected 8",
            handle.len()
        )));
    }
    let raw_handle = bytes(&handle[1], "handle[1]")?.to_vec();
    let event_sync_required = match &handle[7] {
        Value::Bool(b) => *b,
        Value::Int(i) => *i != 0,
        other => {
            return Err(invalid(format!(
                "handle[7] must be a bool, not {}",
                other.type_name()
            )))
        }
    };

    let dtype = match field(state, "dtype")? {
        Value::Global { module, name } if &**module == "torch" => {
            let itemsize = dtype_itemsize(name)
                .ok_or_else(|| invalid(format!("unsupported dtype torch.{name}")))?;
            Dtype {
                name: name.to_string(),
                itemsize,
            }
        }
        Value::Global { module, name } => {
            return Err(invalid(format!(
                "dtype {module}.{name} is not a torch dtype"
            )))
        }
        other => return Err(invalid(format!("dtype is a {}", other.type_name()))),
    };

    // torch.Size((dims...)) reduces to Call{Global(torch, Size), ((dims...),)}; accept a
    // plain tuple too.
    let shape_v = field(state, "shape")?;
    let dims = match shape_v {
        Value::Call { callable, args, .. } if matches!(&**callable, Value::Global { name, .. } if &**name == "Size") =>
        {
            let a = seq(args, "torch.Size arguments")?;
            match a {
                [inner] => seq(inner, "torch.Size argument")?,
                [] => &[][..],
                _ => return Err(invalid("torch.Size takes one argument")),
            }
        }
        other => seq(other, "shape")?,
    };
    let shape = dims
        .iter()
        .map(|d| uint(d, "shape dimension"))
        .collect::<Result<Vec<_>, _>>()?;
    let stride = seq(field(state, "stride")?, "stride")?
        .iter()
        .map(|d| sint(d, "stride"))
        .collect::<Result<Vec<_>, _>>()?;
    if stride.len() != shape.len() {
        return Err(invalid(format!(
            "stride has {} dimensions, shape {}",
            stride.len(),
            shape.len()
        )));
    }
    let storage_offset = uint(field(state, "storage_offset")?, "storage_offset")?;
    let device_uuid = match field(state, "device_uuid")? {
        Value::Str(s) => normalize_uuid(s)?,
        other => return Err(invalid(format!("device_uuid is a {}", other.type_name()))),
    };

    Ok(CudaIpcWrapper {
        device_index: sint(&handle[0], "handle[0]")?,
        raw_handle,
        storage_size_bytes: uint(&handle[2], "handle[2] (storage size)")?,
        storage_offset_bytes: uint(&handle[3], "handle[3] (storage offset)")?,
        ref_counter_name: bytes(&handle[4], "handle[4]")?.to_vec(),
        ref_counter_slot: sint(&handle[5], "handle[5]")?,
        event_handle: bytes(&handle[6], "handle[6]")?.to_vec(),
        event_sync_required,
        dtype,
        shape,
        stride,
        storage_offset,
        device_uuid,
    })
}

/// Builds the pickle `pickle.dumps(CudaIPCWrapper(tensor))` produces under CPython's protocol 4
/// with torch (same opcodes and memo use as the golden samples), from decoded fields.
pub fn encode_wrapper(w: &CudaIpcWrapper) -> Vec<u8> {
    let mut e = Encoder::new();
    e.global("pegaflow.ipc_wrapper", "CudaIPCWrapper")
        .empty_tuple()
        .newobj()
        .empty_dict()
        .mark();
    e.str("handle").mark();
    e.int(w.device_index.into())
        .bytes(&w.raw_handle)
        .int(w.storage_size_bytes.into())
        .int(w.storage_offset_bytes.into())
        .bytes(&w.ref_counter_name)
        .int(w.ref_counter_slot.into())
        .bytes(&w.event_handle)
        .bool(w.event_sync_required)
        .tuple();
    e.str("dtype").global("torch", &w.dtype.name);
    e.str("shape").global("torch", "Size").mark();
    for &d in &w.shape {
        e.int(d.into());
    }
    e.tuple().tuple1().reduce();
    e.str("stride").mark();
    for &s in &w.stride {
        e.int(s.into());
    }
    e.tuple();
    e.str("storage_offset").int(w.storage_offset.into());
    e.str("device_uuid").str(&w.device_uuid);
    e.setitems().build();
    e.finish()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn unhex(s: &str) -> Vec<u8> {
        let s = s.trim();
        (0..s.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
            .collect()
    }

    fn golden(name: &str) -> Vec<u8> {
        let p = format!("{}/testdata/{name}.pickle.hex", env!("CARGO_MANIFEST_DIR"));
        unhex(&std::fs::read_to_string(p).unwrap())
    }

    fn facts(name: &str) -> serde_json::Value {
        let p = format!("{}/testdata/{name}.facts.json", env!("CARGO_MANIFEST_DIR"));
        serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
    }

    fn check_facts(name: &str) -> CudaIpcWrapper {
        let bytes = golden(name);
        let f = facts(name);
        assert_eq!(bytes.len() as u64, f["pickle_len"].as_u64().unwrap());
        let w = parse_wrapper(&bytes).unwrap();
        assert_eq!(w.device_index, f["handle0_device"].as_i64().unwrap());
        assert_eq!(
            w.raw_handle.len() as u64,
            f["handle1_len"].as_u64().unwrap()
        );
        let prefix = unhex(f["handle1_prefix_hex"].as_str().unwrap());
        assert_eq!(&w.raw_handle[..prefix.len()], &prefix[..]);
        assert_eq!(w.storage_size_bytes, f["handle2_size"].as_u64().unwrap());
        assert_eq!(
            w.storage_offset_bytes,
            f["handle3_offset"].as_u64().unwrap()
        );
        assert_eq!(w.storage_offset, f["storage_offset"].as_u64().unwrap());
        let shape: Vec<u64> = f["shape"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap())
            .collect();
        assert_eq!(w.shape, shape);
        let stride: Vec<i64> = f["stride"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_i64().unwrap())
            .collect();
        assert_eq!(w.stride, stride);
        assert_eq!(
            format!("torch.{}", w.dtype.name),
            f["dtype"].as_str().unwrap()
        );
        assert_eq!(w.dtype.itemsize, 2);
        assert_eq!(w.device_uuid, f["device_uuid"].as_str().unwrap());
        let types: Vec<&str> = f["handle_types"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_str().unwrap())
            .collect();
        assert_eq!(
            types,
            ["int", "bytes", "int", "int", "bytes", "int", "bytes", "bool"]
        );
        let data_minus_storage =
            f["data_ptr"].as_u64().unwrap() - f["storage_ptr"].as_u64().unwrap();
        assert_eq!(data_minus_storage, 65536);
        assert_eq!(w.view_offset_bytes().unwrap(), data_minus_storage);
        assert_eq!(
            w.data_offset_bytes().unwrap(),
            f["handle3_offset"].as_u64().unwrap() + data_minus_storage
        );
        assert_eq!(
            w.registrable_bytes().unwrap(),
            f["handle2_size"].as_u64().unwrap() - data_minus_storage
        );
        // The view [2, 4, 16, 8, 128] at stride [131072, ...] spans to the storage's end.
        assert!(w.view_span_bytes().unwrap() <= w.registrable_bytes().unwrap());
        w
    }

    #[test]
    fn golden_default_allocator() {
        let w = check_facts("wrapper_default");
        let h = w.ipc_handle().unwrap();
        assert_eq!(&h[..], &w.raw_handle[2..]);
        assert!(matches!(
            w.mem_handle().unwrap(),
            MemHandle::Ipc {
                version: Some(2),
                ..
            }
        ));
        assert_eq!(w.event_handle.len(), 64);
        assert_eq!(w.ref_counter_slot, 0);
        assert!(String::from_utf8_lossy(&w.ref_counter_name).starts_with("/torch_"));
        // Re-encoding reproduces the pickle torch made, byte for byte.
        assert_eq!(encode_wrapper(&w), golden("wrapper_default"));
    }

    #[test]
    fn golden_expandable_is_refused_with_the_setting_named() {
        let w = check_facts("wrapper_expandable");
        assert!(matches!(
            w.mem_handle().unwrap(),
            MemHandle::ExpandableSegment { version: 2, ref payload } if payload.len() == 28
        ));
        let err = w.ipc_handle().unwrap_err();
        assert_eq!(err, WrapperError::ExpandableSegment);
        assert!(err
            .to_string()
            .contains("PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"));
    }

    #[test]
    fn golden_sample_p4() {
        let bytes = golden("sample_wrapper_p4");
        assert_eq!(bytes.len(), 411);
        let w = parse_wrapper(&bytes).unwrap();
        assert_eq!(w.device_index, 3);
        let expect_handle: Vec<u8> = (0x10..0x50).collect();
        assert_eq!(w.ipc_handle().unwrap().to_vec(), expect_handle);
        assert_eq!(w.storage_size_bytes, 65_536_000);
        assert_eq!(w.storage_offset_bytes, 2_097_152);
        assert_eq!(w.ref_counter_name, b"/torch_12345_678_0");
        assert_eq!(w.ref_counter_slot, 7);
        assert_eq!(w.event_handle, (0x80..0xc0).collect::<Vec<u8>>());
        assert!(w.event_sync_required);
        assert!(w.ipc_event_handle().is_some());
        assert_eq!(
            w.dtype,
            Dtype {
                name: "bfloat16".into(),
                itemsize: 2
            }
        );
        assert_eq!(w.shape, [2, 1000, 16, 8, 128]);
        assert_eq!(w.stride, [16_384_000, 16384, 1024, 128, 1]);
        assert_eq!(w.storage_offset, 0);
        assert_eq!(w.device_uuid, "0a1b2c3d-4e5f-6071-8293-a4b5c6d7e8f9");
        assert_eq!(w.data_offset_bytes().unwrap(), 2_097_152);
        assert_eq!(w.registrable_bytes().unwrap(), 65_536_000);
        assert_eq!(w.view_span_bytes().unwrap(), 65_536_000);
        // The sample reuses the memoized "torch" string through BINGET; ours writes it again,
        // as real torch pickles do. Both decode to the same wrapper.
        assert_eq!(parse_wrapper(&encode_wrapper(&w)).unwrap(), w);
    }

    #[test]
    fn handle_classification() {
        let raw: Vec<u8> = (0..64).collect();
        assert!(matches!(
            MemHandle::classify(&raw).unwrap(),
            MemHandle::Ipc { version: None, .. }
        ));
        let mut v1 = vec![1, b'c'];
        v1.extend(&raw);
        assert!(matches!(
            MemHandle::classify(&v1).unwrap(),
            MemHandle::Ipc {
                version: Some(1),
                ..
            }
        ));
        assert!(MemHandle::classify(&[2, b'c', 0, 0]).is_err());
        assert!(MemHandle::classify(&[9, b'c']).is_err());
        assert!(MemHandle::classify(&[]).is_err());
        assert!(matches!(
            MemHandle::classify(&[1, b'e', 7]).unwrap(),
            MemHandle::ExpandableSegment { version: 1, .. }
        ));
    }

    #[test]
    fn dtypes() {
        for (n, s) in [
            ("bfloat16", 2),
            ("float16", 2),
            ("float32", 4),
            ("float8_e4m3fn", 1),
            ("float8_e5m2", 1),
            ("uint8", 1),
            ("int8", 1),
            ("int32", 4),
            ("int64", 8),
            ("float64", 8),
            ("complex128", 16),
        ] {
            assert_eq!(dtype_itemsize(n), Some(s), "{n}");
        }
        assert_eq!(dtype_itemsize("Size"), None);
    }

    #[test]
    fn uuid_normalisation() {
        assert_eq!(
            normalize_uuid("GPU-40EEAB74-845d-74c0-e059-9baa5f60a9a5").unwrap(),
            "40eeab74-845d-74c0-e059-9baa5f60a9a5"
        );
        assert!(normalize_uuid("40eeab74845d74c0e0599baa5f60a9a5").is_err());
        assert!(normalize_uuid("40eeab74-845d-74c0-e059-9baa5f60a9a").is_err());
    }

    fn sample() -> CudaIpcWrapper {
        parse_wrapper(&golden("wrapper_default")).unwrap()
    }

    #[test]
    fn offsets_are_checked() {
        let mut w = sample();
        w.storage_offset = u64::MAX / 2;
        assert!(w.data_offset_bytes().is_err());
        assert!(w.registrable_bytes().is_err());
        w.storage_offset = w.storage_size_bytes / 2 + 1; // * 2 bytes > storage size
        assert!(w.registrable_bytes().is_err());
        w.storage_offset = w.storage_size_bytes / 2; // exactly the end: 0 bytes left
        assert_eq!(w.registrable_bytes().unwrap(), 0);
        w.storage_offset_bytes = u64::MAX;
        assert!(w.data_offset_bytes().is_err());
        assert!(w.storage_end_bytes().is_err());
    }

    #[test]
    fn large_sizes_use_long1() {
        let mut w = sample();
        w.storage_size_bytes = 80 << 30; // > 2^31: LONG1
        w.storage_offset_bytes = 3 << 30;
        let p = encode_wrapper(&w);
        assert_eq!(parse_wrapper(&p).unwrap(), w);
    }

    #[test]
    fn wrong_class_and_fields_are_invalid() {
        let mut p = golden("wrapper_default");
        // "CudaIPCWrapper" -> "CudaIPCWrappeX"
        let i = p.windows(14).position(|w| w == b"CudaIPCWrapper").unwrap();
        p[i + 13] = b'X';
        assert!(matches!(parse_wrapper(&p), Err(WrapperError::Invalid(_))));
        let mut p = golden("wrapper_default");
        let i = p.windows(8).position(|w| w == b"bfloat16").unwrap();
        p[i..i + 8].copy_from_slice(b"bfloat99");
        let e = parse_wrapper(&p).unwrap_err();
        assert!(
            e.to_string().contains("unsupported dtype torch.bfloat99"),
            "{e}"
        );
    }

    proptest! {
        #[test]
        fn random_bytes_never_panic(data in proptest::collection::vec(any::<u8>(), 0..600)) {
            let _ = parse_wrapper(&data);
        }

        #[test]
        fn every_truncation_is_an_error(cut in 0usize..420) {
            let mut p = golden("wrapper_default");
            p.truncate(cut);
            prop_assert!(parse_wrapper(&p).is_err());
        }

        #[test]
        fn mutations_of_the_full_pickle_never_panic(
            flips in proptest::collection::vec((0usize..420, any::<u8>()), 1..8),
        ) {
            let mut p = golden("wrapper_default");
            for (i, b) in flips {
                let n = p.len();
                p[i % n] = b;
            }
            if let Ok(w) = parse_wrapper(&p) {
                let _ = (w.data_offset_bytes(), w.registrable_bytes(), w.view_span_bytes());
                let _ = w.ipc_handle();
            }
        }

        #[test]
        fn encode_parse_roundtrip(
            dev in 0i64..16,
            size in any::<u64>(),
            soff in any::<u64>(),
            slot in any::<i64>(),
            shape in proptest::collection::vec(0u64..1 << 40, 0..6),
            sync in any::<bool>(),
            off in any::<u64>(),
        ) {
            let mut w = sample();
            w.device_index = dev;
            w.storage_size_bytes = size;
            w.storage_offset_bytes = soff;
            w.ref_counter_slot = slot;
            w.stride = shape.iter().map(|&d| d as i64).collect();
            w.shape = shape;
            w.event_sync_required = sync;
            w.storage_offset = off;
            prop_assert_eq!(parse_wrapper(&encode_wrapper(&w)).unwrap(), w);
        }
    }
}
