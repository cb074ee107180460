//! Golden decode tests: every request the published client `pegaflow-llm-cu13==0.25.1` was seen
//! sending (`testdata/captured_requests.txt`, captured on the wire, see
//! `shared/protocol/engine-wire.md` §3) decodes with our `engine.proto` to exactly the values the
//! client was called with, and re-encodes to the captured bytes.
//!
//! The capture file is a sequence of blocks:
//!
//! ```text
//! ### <name>  RETURNED … | RAISED …
//! path: /pegaflow.Engine/<Method>  len=<n>  metadata=[…]
//! hex: <request body as hex, possibly empty>
//! decode_raw:
//!   …
//! ```
//!
//! Blocks without a `hex:` line (constructor errors, markers) carry no request.

use std::collections::{BTreeSet, HashMap};

use pb::load_block_target::Target;
use pegaflow_proto as pb;
use prost::Message;

const CAPTURE: &str = include_str!("../testdata/captured_requests.txt");

/// One captured request.
#[derive(Debug, Clone)]
struct Capture {
    /// The `### name` of the block (up to the first double space).
    name: String,
    /// What the Python call did (`RETURNED …` / `RAISED …`).
    outcome: String,
    /// The gRPC path.
    path: String,
    /// The `len=` the capture recorded.
    len: usize,
    /// The request body.
    bytes: Vec<u8>,
}

fn parse_captures(text: &str) -> Vec<Capture> {
    let mut out = Vec::new();
    let mut header: Option<(String, String)> = None;
    let mut path: Option<(String, usize)> = None;
    for (lineno, line) in text.lines().enumerate() {
        let lineno = lineno + 1;
        if let Some(rest) = line.strip_prefix("### ") {
            let (name, outcome) = match rest.find("  ") {
                Some(i) => (&rest[..i], rest[i..].trim()),
                None => (rest.trim_end(), ""),
            };
            header = Some((name.to_string(), outcome.to_string()));
            path = None;
        } else if let Some(rest) = line.strip_prefix("path: ") {
            let mut words = rest.split_whitespace();
            let p = words
                .next()
                .unwrap_or_else(|| panic!("line {lineno}: empty path"));
            let len = words
                .find_map(|w| w.strip_prefix("len="))
                .unwrap_or_else(|| panic!("line {lineno}: path line without len="))
                .parse::<usize>()
                .unwrap_or_else(|e| panic!("line {lineno}: bad len: {e}"));
            path = Some((p.to_string(), len));
        } else if let Some(rest) = line.strip_prefix("hex:") {
            let (name, outcome) = header
                .clone()
                .unwrap_or_else(|| panic!("line {lineno}: hex line before any ### header"));
            let (p, len) = path
                .clone()
                .unwrap_or_else(|| panic!("line {lineno}: hex line of {name} without a path line"));
            let bytes = hex::decode(rest.trim())
                .unwrap_or_else(|e| panic!("line {lineno}: hex of {name} does not decode: {e}"));
            out.push(Capture {
                name,
                outcome,
                path: p,
                len,
                bytes,
            });
        }
    }
    out
}

fn captures() -> Vec<Capture> {
    parse_captures(CAPTURE)
}

fn capture(name: &str) -> Capture {
    captures()
        .into_iter()
        .find(|c| c.name == name)
        .unwrap_or_else(|| panic!("no capture named {name}"))
}

/// A request decoded as the type its path calls for.
#[derive(Debug, Clone, PartialEq)]
enum Req {
    Health(pb::HealthRequest),
    Register(pb::RegisterContextRequest),
    Save(pb::SaveRequest),
    Load(pb::LoadRequest),
    Query(pb::QueryRequest),
    Release(pb::ReleaseRequest),
    Unregister(pb::UnregisterRequest),
    Shutdown(pb::ShutdownRequest),
    Session(pb::SessionRequest),
}

/// The nine Engine methods the published client calls (`engine-wire.md` §2).
const CLIENT_PATHS: [&str; 9] = [
    "/pegaflow.Engine/Health",
    "/pegaflow.Engine/RegisterContextBatch",
    "/pegaflow.Engine/Save",
    "/pegaflow.Engine/Load",
    "/pegaflow.Engine/QueryPrefetch",
    "/pegaflow.Engine/Release",
    "/pegaflow.Engine/UnregisterContext",
    "/pegaflow.Engine/Shutdown",
    "/pegaflow.Engine/Session",
];

fn decode(path: &str, b: &[u8]) -> Result<Req, prost::DecodeError> {
    Ok(match path {
        "/pegaflow.Engine/Health" => Req::Health(pb::HealthRequest::decode(b)?),
        "/pegaflow.Engine/RegisterContextBatch" => {
            Req::Register(pb::RegisterContextRequest::decode(b)?)
        }
        "/pegaflow.Engine/Save" => Req::Save(pb::SaveRequest::decode(b)?),
        "/pegaflow.Engine/Load" => Req::Load(pb::LoadRequest::decode(b)?),
        "/pegaflow.Engine/QueryPrefetch" => Req::Query(pb::QueryRequest::decode(b)?),
        "/pegaflow.Engine/Release" => Req::Release(pb::ReleaseRequest::decode(b)?),
        "/pegaflow.Engine/UnregisterContext" => Req::Unregister(pb::UnregisterRequest::decode(b)?),
        "/pegaflow.Engine/Shutdown" => Req::Shutdown(pb::ShutdownRequest::decode(b)?),
        "/pegaflow.Engine/Session" => Req::Session(pb::SessionRequest::decode(b)?),
        other => panic!("unexpected path {other}"),
    })
}

fn encode(r: &Req) -> Vec<u8> {
    match r {
        Req::Health(m) => m.encode_to_vec(),
        Req::Register(m) => m.encode_to_vec(),
        Req::Save(m) => m.encode_to_vec(),
        Req::Load(m) => m.encode_to_vec(),
        Req::Query(m) => m.encode_to_vec(),
        Req::Release(m) => m.encode_to_vec(),
        Req::Unregister(m) => m.encode_to_vec(),
        Req::Shutdown(m) => m.encode_to_vec(),
        Req::Session(m) => m.encode_to_vec(),
    }
}

fn decode_capture(c: &Capture) -> Req {
    decode(&c.path, &c.bytes)
        .unwrap_or_else(|e| panic!("{}: does not decode as {}: {e}", c.name, c.path))
}

fn s(v: &str) -> String {
    v.to_string()
}

fn strings(v: &[&str]) -> Vec<String> {
    v.iter().map(|x| x.to_string()).collect()
}

fn bytes_list(v: &[&[u8]]) -> Vec<Vec<u8>> {
    v.iter().map(|x| x.to_vec()).collect()
}

/// A one-layer Python registration as the client builds it (everything else default).
#[allow(clippy::too_many_arguments)]
fn register_one(
    instance: &str,
    namespace: &str,
    device_id: i32,
    layers: &[&str],
    wrappers: &[&[u8]],
    num_blocks: u64,
    bytes_per_block: u64,
) -> pb::RegisterContextRequest {
    pb::RegisterContextRequest {
        instance_id: s(instance),
        namespace: s(namespace),
        tp_rank: 0,
        tp_size: 1,
        world_size: 1,
        device_id,
        layer_names: strings(layers),
        wrapper_bytes: bytes_list(wrappers),
        num_blocks: vec![num_blocks],
        bytes_per_block: vec![bytes_per_block],
        kv_stride_bytes: vec![0],
        segments: vec![1],
        pp_rank: 0,
        client_version: s("0.25.1"),
        transfer_mode: pb::TransferMode::Direct as i32,
        page_first: false,
        layer_group_ids: vec![],
        native_kv_tensors: vec![],
        native_alloc_size: 0,
        native_allocations: vec![],
        memory_kind: pb::MemoryKind::Unspecified as i32,
    }
}

fn save_layer(name: &str, ids: &[u32], hashes: &[&[u8]]) -> pb::SaveLayer {
    pb::SaveLayer {
        layer_name: s(name),
        block_ids: ids.to_vec(),
        block_hashes: hashes.into(),
    }
}

/// `None` = an absent LoadBlockTarget (Python `None`), `Some(n)` = block id n.
fn targets(v: &[Option<u32>]) -> pb::LoadBlockIds {
    pb::LoadBlockIds {
        targets: v
            .iter()
            .map(|t| pb::LoadBlockTarget {
                target: t.map(Target::BlockId),
            })
            .collect(),
    }
}

fn lease_load(lease: &[u8], by_group: &[&[Option<u32>]]) -> pb::LeaseLoad {
    pb::LeaseLoad {
        lease: lease.to_vec(),
        block_ids_by_group: by_group.iter().map(|g| targets(g)).collect(),
    }
}

fn query(
    instance: &str,
    hashes: &[&[u8]],
    req_id: &str,
    wait: bool,
    group: u32,
) -> pb::QueryRequest {
    pb::QueryRequest {
        instance_id: s(instance),
        block_hashes: bytes_list(hashes),
        req_id: s(req_id),
        wait_for_full_prefix: wait,
        group_id: group,
    }
}

fn session(instance: &str, namespace: &str, tp: u32, world: u32) -> pb::SessionRequest {
    pb::SessionRequest {
        instance_id: s(instance),
        namespace: s(namespace),
        tp_size: tp,
        world_size: world,
    }
}

/// The request the client was called with, for every captured name. `None` = no expectation
/// written (a test fails on that: every capture must be covered).
fn expected(name: &str) -> Option<Req> {
    // Groups of captures made with the same call (only the server's answer differed).
    let health = name == "health"
        || name == "health_slow_12s"
        || name == "health_while_session"
        || name == "health_after_session_end"
        || name == "health_after_session_abort"
        || name == "health_after_restart"
        || name.starts_with("health_ok")
        || name.starts_with("health_notok")
        || name.starts_with("health_status")
        || name.starts_with("health_no_status")
        || name.starts_with("health_unknown")
        || name.starts_with("health_garbage")
        || name.starts_with("health_err_");
    if health {
        return Some(Req::Health(pb::HealthRequest {}));
    }
    if name == "shutdown" || name.starts_with("shutdown_notok") || name.starts_with("shutdown_err_")
    {
        return Some(Req::Shutdown(pb::ShutdownRequest {}));
    }
    if name.starts_with("register_notok") || name.starts_with("register_err_") {
        return Some(Req::Register(register_one(
            "i",
            "n",
            0,
            &["L"],
            &[b"W"],
            1,
            1,
        )));
    }
    if name.starts_with("save_notok") || name.starts_with("save_err_") {
        return Some(Req::Save(pb::SaveRequest {
            instance_id: s("i"),
            saves: vec![save_layer("l", &[1], &[b"h"])],
            ..Default::default()
        }));
    }
    if name.starts_with("load_notok") || name.starts_with("load_err_") {
        return Some(Req::Load(pb::LoadRequest {
            instance_id: s("i"),
            load_state_shm: s("s"),
            groups: vec![pb::LoadGroup {
                layer_names: strings(&["l"]),
            }],
            loads: vec![lease_load(b"x", &[&[Some(1)]])],
            ..Default::default()
        }));
    }
    if name.starts_with("q_") || name.starts_with("query_err_") {
        return Some(Req::Query(query("i", &[b"h"], "r", false, 0)));
    }
    if name == "release_with_junk_response" || name.starts_with("release_err_") {
        return Some(Req::Release(pb::ReleaseRequest {
            lease: b"L".to_vec(),
        }));
    }
    if name.starts_with("unregister_notok") || name.starts_with("unregister_err_") {
        return Some(Req::Unregister(pb::UnregisterRequest {
            instance_id: s("i"),
        }));
    }
    if name == "session_abort_invalid" || name == "session_abort_unavailable" {
        return Some(Req::Session(session("i", "n", 1, 1)));
    }

    Some(match name {
        "register_full" => Req::Register(pb::RegisterContextRequest {
            instance_id: s("inst-A"),
            namespace: s("ns-B"),
            tp_rank: 3,
            tp_size: 8,
            world_size: 16,
            device_id: 5,
            layer_names: strings(&["layer.0", "layer.1", "layer.2"]),
            wrapper_bytes: bytes_list(&[b"\xa1\xa1", b"\xb2\xb2\xb2", b"\xc3"]),
            num_blocks: vec![1001, 1002, 1003],
            bytes_per_block: vec![2001, 2002, 2003],
            kv_stride_bytes: vec![3001, 3002, 3003],
            segments: vec![1, 2, 3],
            pp_rank: 2,
            client_version: s("0.25.1"),
            transfer_mode: pb::TransferMode::Kernel as i32,
            page_first: true,
            layer_group_ids: vec![0, 1, 7],
            native_kv_tensors: vec![],
            native_alloc_size: 0,
            native_allocations: vec![],
            memory_kind: 0,
        }),
        "register_min_direct_nogroups" => {
            Req::Register(register_one("inst-A", "", 0, &["L"], &[b"W"], 10, 20))
        }
        "register_neg_device" => {
            Req::Register(register_one("inst-A", "ns", -1, &["L"], &[b"W"], 10, 20))
        }
        "register_mismatched_lists" => Req::Register(register_one(
            "inst-A",
            "ns",
            0,
            &["L", "M"],
            &[b"W"],
            10,
            20,
        )),
        "register_empty_group_ids" => {
            Req::Register(register_one("inst-A", "ns", 0, &["L"], &[b"W"], 10, 20))
        }
        "register_big_values" => Req::Register(pb::RegisterContextRequest {
            instance_id: s("inst-A"),
            namespace: s("ns"),
            tp_rank: u32::MAX,
            tp_size: u32::MAX,
            world_size: u32::MAX,
            device_id: i32::MAX,
            layer_names: strings(&["L"]),
            wrapper_bytes: vec![vec![]],
            num_blocks: vec![u64::MAX],
            bytes_per_block: vec![1 << 63],
            kv_stride_bytes: vec![1 << 40],
            segments: vec![u32::MAX],
            pp_rank: u32::MAX,
            client_version: s("0.25.1"),
            transfer_mode: 0,
            page_first: false,
            layer_group_ids: vec![u32::MAX],
            native_kv_tensors: vec![],
            native_alloc_size: 0,
            native_allocations: vec![],
            memory_kind: 0,
        }),
        "save" => Req::Save(pb::SaveRequest {
            instance_id: s("inst-S"),
            tp_rank: 6,
            device_id: 9,
            saves: vec![
                save_layer(
                    "layer.0",
                    &[11, 12, 13],
                    &[
                        b"\x01\x01\x01\x01",
                        b"\x02\x02\x02\x02",
                        b"\x03\x03\x03\x03",
                    ],
                ),
                save_layer("layer.1", &[21], &[b"\xff\xee"]),
            ],
            pp_rank: 4,
        }),
        "save_empty" => Req::Save(pb::SaveRequest {
            instance_id: s("inst-S"),
            ..Default::default()
        }),
        "save_mismatch" => Req::Save(pb::SaveRequest {
            instance_id: s("inst-S"),
            saves: vec![save_layer("l", &[1, 2], &[b"x"])],
            ..Default::default()
        }),
        "save_neg_device" => Req::Save(pb::SaveRequest {
            instance_id: s("inst-S"),
            device_id: -3,
            saves: vec![save_layer("l", &[1], &[b"x"])],
            ..Default::default()
        }),
        "load" => Req::Load(pb::LoadRequest {
            instance_id: s("inst-L"),
            tp_rank: 7,
            device_id: 3,
            load_state_shm: s("pega_load_2c5d75f05b0e43fe905d003763ddc69c"),
            groups: vec![
                pb::LoadGroup {
                    layer_names: strings(&["layer.0", "layer.1"]),
                },
                pb::LoadGroup {
                    layer_names: strings(&["layer.9"]),
                },
            ],
            loads: vec![
                lease_load(
                    b"LEASE-ONE",
                    &[&[Some(5), None, Some(0)], &[None, Some(9), None]],
                ),
                lease_load(b"LEASE-TWO", &[&[Some(11)], &[None]]),
            ],
            wait_for_completion: false,
        }),
        "load_no_loads" => Req::Load(pb::LoadRequest {
            instance_id: s("inst-L"),
            load_state_shm: s("shm-x"),
            groups: vec![pb::LoadGroup {
                layer_names: strings(&["a"]),
            }],
            ..Default::default()
        }),
        "load_empty_groups" => Req::Load(pb::LoadRequest {
            instance_id: s("inst-L"),
            loads: vec![lease_load(b"", &[])],
            ..Default::default()
        }),
        "load_neg_device" => Req::Load(pb::LoadRequest {
            instance_id: s("inst-L"),
            device_id: -1,
            ..Default::default()
        }),
        "query_full" => Req::Query(query(
            "inst-Q",
            &[b"\xaa\xaa\xaa", b"\xbb\xbb", b""],
            "req-42",
            true,
            6,
        )),
        "query_default" => Req::Query(query("inst-Q", &[b"\xcc"], "req-43", false, 0)),
        "query_empty" => Req::Query(query("inst-Q", &[], "", false, 0)),
        "release" => Req::Release(pb::ReleaseRequest {
            lease: b"LEASE-REL".to_vec(),
        }),
        "release_empty" => Req::Release(pb::ReleaseRequest { lease: vec![] }),
        "unregister" => Req::Unregister(pb::UnregisterRequest {
            instance_id: s("inst-U"),
        }),
        "session_hold" => Req::Session(session("inst-SESS", "ns-SESS", 4, 12)),
        "session_replace" => Req::Session(session("inst-SESS2", "ns2", 1, 1)),
        "session_server_ends_ok" => Req::Session(session("i-end", "n", 1, 1)),
        "session_server_aborts_late" => Req::Session(session("i-late", "n", 1, 1)),
        "session_no_headers_8s" => Req::Session(session("i-nohdr", "n", 1, 1)),
        _ => return None,
    })
}

#[test]
fn capture_file_parses_completely() {
    let all = captures();
    // Every `hex:` line of the file became a capture.
    let hex_lines = CAPTURE.lines().filter(|l| l.starts_with("hex:")).count();
    assert_eq!(all.len(), hex_lines);
    assert!(all.len() >= 100, "only {} captures parsed", all.len());
    let mut names = BTreeSet::new();
    let mut per_path: HashMap<&str, usize> = HashMap::new();
    for c in &all {
        assert!(
            names.insert(c.name.clone()),
            "capture name {} appears twice",
            c.name
        );
        assert_eq!(
            c.bytes.len(),
            c.len,
            "{}: len= disagrees with the hex",
            c.name
        );
        assert!(
            CLIENT_PATHS.contains(&c.path.as_str()),
            "{}: path {} is not one of the client's nine methods",
            c.name,
            c.path
        );
        assert!(
            c.outcome.starts_with("RETURNED") || c.outcome.starts_with("RAISED"),
            "{}: outcome {:?}",
            c.name,
            c.outcome
        );
        *per_path
            .entry(CLIENT_PATHS.iter().find(|p| **p == c.path).unwrap())
            .or_default() += 1;
    }
    for p in CLIENT_PATHS {
        assert!(
            per_path.get(p).copied().unwrap_or(0) > 0,
            "no capture of {p}"
        );
    }
}

#[test]
fn every_capture_decodes_to_the_values_the_client_was_called_with() {
    let mut missing = Vec::new();
    for c in captures() {
        let got = decode_capture(&c);
        match expected(&c.name) {
            Some(want) => assert_eq!(got, want, "capture {} decodes to other values", c.name),
            None => missing.push(c.name.clone()),
        }
    }
    assert!(
        missing.is_empty(),
        "captures without an expectation: {missing:?}"
    );
}

#[test]
fn every_capture_reencodes_to_the_captured_bytes() {
    // The client emits proto3's canonical form (ascending field numbers, defaults omitted,
    // packed repeated scalars, empty repeated elements kept), which is also prost's.
    for c in captures() {
        let re = encode(&decode_capture(&c));
        assert_eq!(
            hex::encode(&re),
            hex::encode(&c.bytes),
            "capture {} does not re-encode byte for byte",
            c.name
        );
    }
}

#[test]
fn register_full_carries_every_field() {
    let c = capture("register_full");
    assert_eq!(c.path, "/pegaflow.Engine/RegisterContextBatch");
    let r = pb::RegisterContextRequest::decode(&c.bytes[..]).unwrap();
    assert_eq!(r.instance_id, "inst-A");
    assert_eq!(r.namespace, "ns-B");
    assert_eq!(
        (r.tp_rank, r.tp_size, r.world_size, r.pp_rank),
        (3, 8, 16, 2)
    );
    assert_eq!(r.device_id, 5);
    assert_eq!(r.layer_names, ["layer.0", "layer.1", "layer.2"]);
    assert_eq!(
        r.wrapper_bytes,
        [vec![0xa1, 0xa1], vec![0xb2; 3], vec![0xc3]]
    );
    assert_eq!(r.num_blocks, [1001, 1002, 1003]);
    assert_eq!(r.bytes_per_block, [2001, 2002, 2003]);
    assert_eq!(r.kv_stride_bytes, [3001, 3002, 3003]);
    assert_eq!(r.segments, [1, 2, 3]);
    assert_eq!(r.client_version, pb::PUBLISHED_CLIENT_VERSION);
    assert_eq!(r.transfer_mode(), pb::TransferMode::Kernel);
    assert!(r.page_first);
    // Field 19 is layer_group_ids (packed uint32), never the VMM branch's native tensors.
    assert_eq!(r.layer_group_ids, [0, 1, 7]);
    assert!(r.native_kv_tensors.is_empty());
    assert_eq!(r.native_alloc_size, 0);
    assert_eq!(r.memory_kind(), pb::MemoryKind::Unspecified);
    // The tail of the wire: `9a 01 03 00 01 07` is field 19, packed, three values.
    assert!(c.bytes.ends_with(&[0x9a, 0x01, 0x03, 0x00, 0x01, 0x07]));
}

#[test]
fn negative_device_ids_are_sign_extended_varints() {
    let c = capture("register_neg_device");
    let r = pb::RegisterContextRequest::decode(&c.bytes[..]).unwrap();
    assert_eq!(r.device_id, -1);
    let ten = [
        0x30, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01,
    ];
    assert!(
        c.bytes.windows(ten.len()).any(|w| w == ten),
        "field 6 as a 10-byte varint"
    );

    let s = pb::SaveRequest::decode(&capture("save_neg_device").bytes[..]).unwrap();
    assert_eq!(s.device_id, -3);
    let l = pb::LoadRequest::decode(&capture("load_neg_device").bytes[..]).unwrap();
    assert_eq!(l.device_id, -1);
}

#[test]
fn register_big_values_keep_their_full_range() {
    let r = pb::RegisterContextRequest::decode(&capture("register_big_values").bytes[..]).unwrap();
    assert_eq!(
        (r.tp_rank, r.tp_size, r.world_size, r.pp_rank),
        (u32::MAX, u32::MAX, u32::MAX, u32::MAX)
    );
    assert_eq!(r.device_id, i32::MAX);
    assert_eq!(r.num_blocks, [u64::MAX]);
    assert_eq!(r.bytes_per_block, [1u64 << 63]);
    assert_eq!(r.kv_stride_bytes, [1u64 << 40]);
    assert_eq!(r.segments, [u32::MAX]);
    assert_eq!(r.layer_group_ids, [u32::MAX]);
    // An empty wrapper is still one entry.
    assert_eq!(r.wrapper_bytes, [Vec::<u8>::new()]);
}

#[test]
fn mismatched_register_lists_arrive_as_sent() {
    // The client checks nothing; the server must see (and refuse) the mismatch.
    let r = pb::RegisterContextRequest::decode(&capture("register_mismatched_lists").bytes[..])
        .unwrap();
    assert_eq!(r.layer_names.len(), 2);
    assert_eq!(r.wrapper_bytes.len(), 1);
    assert_eq!(r.num_blocks.len(), 1);
    let r = pb::RegisterContextRequest::decode(&capture("register_min_direct_nogroups").bytes[..])
        .unwrap();
    assert_eq!(r.transfer_mode(), pb::TransferMode::Direct);
    assert!(!r.page_first);
    assert!(r.layer_group_ids.is_empty());
    assert_eq!(r.kv_stride_bytes, [0], "a [0] list is emitted, not omitted");
}

#[test]
fn save_with_two_layers_and_pp_rank_after_saves() {
    let c = capture("save");
    let r = pb::SaveRequest::decode(&c.bytes[..]).unwrap();
    assert_eq!(r.instance_id, "inst-S");
    assert_eq!((r.tp_rank, r.pp_rank, r.device_id), (6, 4, 9));
    assert_eq!(r.saves.len(), 2);
    assert_eq!(r.saves[0].layer_name, "layer.0");
    assert_eq!(r.saves[0].block_ids, [11, 12, 13]);
    assert_eq!(
        r.saves[0].block_hashes,
        [vec![1u8; 4], vec![2u8; 4], vec![3u8; 4]]
    );
    assert_eq!(r.saves[1].layer_name, "layer.1");
    assert_eq!(r.saves[1].block_ids, [21]);
    assert_eq!(r.saves[1].block_hashes, [vec![0xffu8, 0xee]]);
    // pp_rank (field 5) is the last thing on the wire.
    assert!(c.bytes.ends_with(&[0x28, 0x04]));

    let m = pb::SaveRequest::decode(&capture("save_mismatch").bytes[..]).unwrap();
    assert_eq!(m.saves[0].block_ids, [1, 2]);
    assert_eq!(
        m.saves[0].block_hashes,
        [b"x".to_vec()],
        "ids/hashes mismatch reaches the server"
    );
    let e = pb::SaveRequest::decode(&capture("save_empty").bytes[..]).unwrap();
    assert!(e.saves.is_empty());
    assert_eq!(e.instance_id, "inst-S");
}

fn ids(t: &pb::LoadBlockIds) -> Vec<Option<u32>> {
    t.targets
        .iter()
        .map(|x| x.target.map(|Target::BlockId(b)| b))
        .collect()
}

#[test]
fn load_tells_an_absent_target_from_block_zero() {
    let r = pb::LoadRequest::decode(&capture("load").bytes[..]).unwrap();
    assert_eq!(r.instance_id, "inst-L");
    assert_eq!((r.tp_rank, r.device_id), (7, 3));
    assert_eq!(
        r.load_state_shm,
        "pega_load_2c5d75f05b0e43fe905d003763ddc69c"
    );
    assert_eq!(r.groups.len(), 2);
    assert_eq!(r.groups[0].layer_names, ["layer.0", "layer.1"]);
    assert_eq!(r.groups[1].layer_names, ["layer.9"]);
    assert!(
        !r.wait_for_completion,
        "the published client never sends field 100"
    );
    assert_eq!(r.loads.len(), 2);

    let one = &r.loads[0];
    assert_eq!(one.lease, b"LEASE-ONE");
    assert_eq!(one.block_ids_by_group.len(), 2);
    assert_eq!(ids(&one.block_ids_by_group[0]), [Some(5), None, Some(0)]);
    assert_eq!(ids(&one.block_ids_by_group[1]), [None, Some(9), None]);
    // Absent (`0a 00`) and block 0 (`0a 02 08 00`) are different values.
    assert_eq!(one.block_ids_by_group[0].targets[1].target, None);
    assert_eq!(
        one.block_ids_by_group[0].targets[2].target,
        Some(Target::BlockId(0))
    );
    assert_ne!(
        one.block_ids_by_group[0].targets[1],
        one.block_ids_by_group[0].targets[2]
    );

    let two = &r.loads[1];
    assert_eq!(two.lease, b"LEASE-TWO");
    assert_eq!(ids(&two.block_ids_by_group[0]), [Some(11)]);
    assert_eq!(ids(&two.block_ids_by_group[1]), [None]);

    // Empty LeaseLoad `(b"", [])` is a zero-length message, still present.
    let e = pb::LoadRequest::decode(&capture("load_empty_groups").bytes[..]).unwrap();
    assert!(e.groups.is_empty());
    assert_eq!(e.loads, [pb::LeaseLoad::default()]);
    let n = pb::LoadRequest::decode(&capture("load_no_loads").bytes[..]).unwrap();
    assert!(n.loads.is_empty());
    assert_eq!(n.load_state_shm, "shm-x");
}

#[test]
fn query_fields_and_empty_hashes() {
    let q = pb::QueryRequest::decode(&capture("query_full").bytes[..]).unwrap();
    assert_eq!(q.instance_id, "inst-Q");
    assert_eq!(
        q.block_hashes,
        [vec![0xaa; 3], vec![0xbb; 2], vec![]],
        "an empty hash is kept"
    );
    assert_eq!(q.req_id, "req-42");
    assert!(q.wait_for_full_prefix);
    assert_eq!(q.group_id, 6);

    let d = pb::QueryRequest::decode(&capture("query_default").bytes[..]).unwrap();
    assert_eq!(
        (d.req_id.as_str(), d.wait_for_full_prefix, d.group_id),
        ("req-43", false, 0)
    );
    assert_eq!(d.block_hashes, [vec![0xcc]]);

    // query_prefetch(…, req_id="") sends no req_id at all: the server must refuse it itself.
    let e = pb::QueryRequest::decode(&capture("query_empty").bytes[..]).unwrap();
    assert!(e.req_id.is_empty());
    assert!(e.block_hashes.is_empty());
}

#[test]
fn release_unregister_shutdown_health_and_session() {
    let r = pb::ReleaseRequest::decode(&capture("release").bytes[..]).unwrap();
    assert_eq!(r.lease, b"LEASE-REL");
    let e = capture("release_empty");
    assert!(e.bytes.is_empty(), "release(b\"\") sends an empty body");
    assert!(pb::ReleaseRequest::decode(&e.bytes[..])
        .unwrap()
        .lease
        .is_empty());

    let u = pb::UnregisterRequest::decode(&capture("unregister").bytes[..]).unwrap();
    assert_eq!(u.instance_id, "inst-U");
    assert!(capture("shutdown").bytes.is_empty());
    assert!(capture("health").bytes.is_empty());

    let s = pb::SessionRequest::decode(&capture("session_hold").bytes[..]).unwrap();
    assert_eq!(s, session("inst-SESS", "ns-SESS", 4, 12));
    let s = pb::SessionRequest::decode(&capture("session_replace").bytes[..]).unwrap();
    assert_eq!(s, session("inst-SESS2", "ns2", 1, 1));
}

#[test]
fn captured_requests_carry_no_extension_fields() {
    // Fields >= 100 are this project's; the published client must never send them.
    for c in captures() {
        let mut buf = &c.bytes[..];
        let mut tags = Vec::new();
        while !buf.is_empty() {
            let (tag, wire) = prost::encoding::decode_key(&mut buf).unwrap();
            tags.push(tag);
            prost::encoding::skip_field(wire, tag, &mut buf, Default::default()).unwrap();
        }
        assert!(
            tags.iter().all(|&t| t < 100),
            "{}: top-level tags {tags:?}",
            c.name
        );
        assert!(
            tags.windows(2).all(|w| w[0] <= w[1]),
            "{}: tags not ascending: {tags:?}",
            c.name
        );
    }
}

// Responses the server sends, in the exact bytes the published client was observed to accept
// (`engine-wire.md` §4).

#[test]
fn ok_status_response_is_four_bytes() {
    let ok = Some(pb::ResponseStatus {
        ok: true,
        message: String::new(),
    });
    for bytes in [
        pb::RegisterContextResponse { status: ok.clone() }.encode_to_vec(),
        pb::SaveResponse { status: ok.clone() }.encode_to_vec(),
        pb::LoadResponse { status: ok.clone() }.encode_to_vec(),
        pb::UnregisterResponse { status: ok.clone() }.encode_to_vec(),
        pb::ShutdownResponse { status: ok.clone() }.encode_to_vec(),
        pb::HealthResponse {
            status: ok.clone(),
            fd_socket_path: String::new(),
        }
        .encode_to_vec(),
    ] {
        assert_eq!(hex::encode(bytes), "0a020801");
    }
    // A status with ok=false and no message is still present (`0a 00`): the client reads
    // (False, ""), not "missing status".
    let empty = pb::HealthResponse {
        status: Some(pb::ResponseStatus::default()),
        fd_socket_path: String::new(),
    };
    assert_eq!(hex::encode(empty.encode_to_vec()), "0a00");
}

#[test]
fn query_responses_match_the_observed_forms() {
    use pb::query_response::Outcome;
    let miss = pb::QueryResponse {
        outcome: Some(Outcome::Ready(pb::QueryReady::default())),
    };
    assert_eq!(
        hex::encode(miss.encode_to_vec()),
        "1200",
        "an empty QueryReady is the miss"
    );
    let loading = pb::QueryResponse {
        outcome: Some(Outcome::Loading(pb::QueryLoading {})),
    };
    assert_eq!(hex::encode(loading.encode_to_vec()), "0a00");

    let full = pb::QueryResponse {
        outcome: Some(Outcome::Ready(pb::QueryReady {
            num_hit_blocks: 5,
            lease: b"LEASE\x00\x01".to_vec(),
            hit_positions: vec![0, 2, 4, 300],
        })),
    };
    let enc = full.encode_to_vec();
    // hit_positions packed: `1a 05 00 02 04 ac 02`.
    assert!(
        hex::encode(&enc).ends_with("1a05000204ac02"),
        "{}",
        hex::encode(&enc)
    );
    assert_eq!(pb::QueryResponse::decode(&enc[..]).unwrap(), full);

    // Unpacked hit positions (`18 01 18 03`) are accepted too.
    let unpacked = hex::decode("120a080212024c3218011803").unwrap();
    match pb::QueryResponse::decode(&unpacked[..]).unwrap().outcome {
        Some(Outcome::Ready(r)) => {
            assert_eq!(r.num_hit_blocks, 2);
            assert_eq!(r.lease, b"L2");
            assert_eq!(r.hit_positions, [1, 3]);
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn native_v2_fields_are_this_projects_numbers() {
    // Native registration v2 adds fields 103 (RegisterContextRequest.native_allocations),
    // 100 (NativeKvTensor.allocation_index), and 100/101 of NativeAllocation: none collides
    // with a field 0.25.1 sends (all < 100, checked above).
    let r = pb::RegisterContextRequest {
        native_allocations: vec![pb::NativeAllocation {
            size_bytes: 5,
            cuda_ipc_handle: vec![7; 64],
        }],
        native_kv_tensors: vec![pb::NativeKvTensor {
            allocation_index: 2,
            ..Default::default()
        }],
        memory_kind: pb::MemoryKind::CudaIpc as i32,
        ..Default::default()
    };
    let enc = r.encode_to_vec();
    let mut buf = &enc[..];
    let mut tags = Vec::new();
    while !buf.is_empty() {
        let (tag, wire) = prost::encoding::decode_key(&mut buf).unwrap();
        tags.push(tag);
        prost::encoding::skip_field(wire, tag, &mut buf, Default::default()).unwrap();
    }
    assert_eq!(tags, [100, 102, 103]);
    // NativeKvTensor { allocation_index: 2 } is field 100 (varint): a0 06 02.
    assert_eq!(
        hex::encode(
            pb::NativeKvTensor {
                allocation_index: 2,
                ..Default::default()
            }
            .encode_to_vec()
        ),
        "a00602"
    );
    // NativeAllocation: size_bytes = 100 (varint), cuda_ipc_handle = 101 (bytes).
    let a = pb::NativeAllocation {
        size_bytes: 5,
        cuda_ipc_handle: vec![1],
    }
    .encode_to_vec();
    assert_eq!(hex::encode(a), "a00605aa060101");
    assert_eq!(pb::MemoryKind::CudaIpc as i32, 3);
    assert_eq!(pb::NATIVE_V2_CLIENT_VERSION, "0.25.1+native-v2");
}
