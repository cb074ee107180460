//! Byte-level goldens of the batch encoding, derived by hand from the MessagePack spec and
//! vLLM's struct definitions (each byte annotated). tests/python/test_kv_events.py checks
//! the same bytes against msgspec itself.

use bytes::Bytes;
use pegaflow_events_zmq::{
    encode_batch, BlockHashForm, BlockRemoved, BlockStored, Encoding, EventBatch,
    ExternalBlockHash, KvEvent, Medium,
};

/// Hex with spaces and `#` comments to bytes.
fn hex(s: &str) -> Vec<u8> {
    let digits: String = s
        .lines()
        .map(|l| l.split('#').next().unwrap_or(""))
        .flat_map(|l| l.chars())
        .filter(|c| !c.is_whitespace())
        .collect();
    (0..digits.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&digits[i..i + 2], 16).unwrap())
        .collect()
}

fn ascii(s: &str) -> String {
    s.bytes().map(|b| format!("{b:02x}")).collect()
}

fn stored() -> KvEvent {
    KvEvent::Stored(BlockStored {
        block_hashes: vec![
            ExternalBlockHash::Int(1),
            ExternalBlockHash::Int(u64::MAX),
            ExternalBlockHash::Bytes(Bytes::from_static(b"ab")),
        ],
        parent_block_hash: None,
        token_ids: vec![1, 200, 70_000],
        block_size: 16,
        lora_id: None,
        medium: Some(Medium::CPU),
        lora_name: None,
    })
}

#[test]
fn array_batch_of_a_block_stored() {
    let got = encode_batch(1.5, &[stored()], None, Encoding::Array);
    let want = hex(&format!(
        "93                      # KVEventBatch: array of 3
         cb 3ff8000000000000     # ts = 1.5 as float64
         91                      # events: array of 1
         98                      # BlockStored: array of 8 (tag + 7 fields)
         ab {bs}                 # tag: fixstr(11) 'BlockStored'
         93 01                   # block_hashes: array of 3; 1 as positive fixint
         cf ffffffffffffffff     # 2^64-1 as uint64
         c4 02 6162              # b'ab' as bin8
         c0                      # parent_block_hash = None
         93 01 ccc8 ce00011170   # token_ids [1, 200 (uint8), 70000 (uint32)]
         10                      # block_size 16
         c0                      # lora_id = None
         a3 {cpu}                # medium 'CPU'
         c0                      # lora_name = None
         c0                      # data_parallel_rank = None",
        bs = ascii("BlockStored"),
        cpu = ascii("CPU"),
    ));
    assert_eq!(got, want);
}

#[test]
fn array_batch_of_removed_and_cleared_with_a_rank() {
    let events = [
        KvEvent::Removed(BlockRemoved {
            block_hashes: vec![ExternalBlockHash::Int(5), ExternalBlockHash::Int(300)],
            medium: Some(Medium::DISK),
        }),
        KvEvent::Removed(BlockRemoved {
            block_hashes: vec![],
            medium: None,
        }),
        KvEvent::AllCleared,
    ];
    let got = EventBatch {
        ts: 0.0,
        events: events.to_vec(),
        data_parallel_rank: Some(3),
    }
    .encode(Encoding::Array);
    let want = hex(&format!(
        "93 cb 0000000000000000 93   # batch, ts 0.0, 3 events
         93 ac {br} 92 05 cd012c a4 {disk}   # ['BlockRemoved', [5, 300 (uint16)], 'DISK']
         93 ac {br} 90 c0            # ['BlockRemoved', [], None]
         91 b0 {abc}                 # ['AllBlocksCleared']: fixstr(16)
         03                          # data_parallel_rank 3",
        br = ascii("BlockRemoved"),
        disk = ascii("DISK"),
        abc = ascii("AllBlocksCleared"),
    ));
    assert_eq!(got, want);
}

#[test]
fn map_events_carry_their_field_names_in_vllms_order() {
    let events = [
        KvEvent::Stored(BlockStored {
            block_hashes: vec![ExternalBlockHash::Int(7)],
            parent_block_hash: Some(ExternalBlockHash::Int(6)),
            token_ids: vec![],
            block_size: 256,
            lora_id: Some(2),
            medium: Some(Medium::named("cxl")),
            lora_name: Some("a".into()),
        }),
        KvEvent::Removed(BlockRemoved {
            block_hashes: vec![ExternalBlockHash::Int(7)],
            medium: Some(Medium::CPU),
        }),
        KvEvent::AllCleared,
    ];
    let got = encode_batch(1.5, &events, Some(0), Encoding::Map);
    let want = hex(&format!(
        "93 cb 3ff8000000000000 93
         88 a4 {ty} ab {bs}          # {{'type': 'BlockStored', (8 keys)
            ac {bh} 91 07            #  'block_hashes': [7],
            b1 {pbh} 06              #  'parent_block_hash': 6,
            a9 {ti} 90               #  'token_ids': [],
            aa {bsz} cd0100          #  'block_size': 256 (uint16),
            a7 {li} 02               #  'lora_id': 2,
            a6 {me} a3 {cxl}         #  'medium': 'cxl',
            a9 {ln} a1 61            #  'lora_name': 'a'}}
         83 a4 {ty} ac {br}          # {{'type': 'BlockRemoved',
            ac {bh} 91 07            #  'block_hashes': [7],
            a6 {me} a3 {cpu}         #  'medium': 'CPU'}}
         81 a4 {ty} b0 {abc}         # {{'type': 'AllBlocksCleared'}}
         00                          # data_parallel_rank 0",
        ty = ascii("type"),
        bs = ascii("BlockStored"),
        br = ascii("BlockRemoved"),
        abc = ascii("AllBlocksCleared"),
        bh = ascii("block_hashes"),
        pbh = ascii("parent_block_hash"),
        ti = ascii("token_ids"),
        bsz = ascii("block_size"),
        li = ascii("lora_id"),
        me = ascii("medium"),
        ln = ascii("lora_name"),
        cxl = ascii("cxl"),
        cpu = ascii("CPU"),
    ));
    assert_eq!(got, want);
}

#[test]
fn long_lists_and_strings_switch_to_16_bit_lengths() {
    let ev = KvEvent::Stored(BlockStored {
        block_hashes: (0..16).map(ExternalBlockHash::Int).collect(),
        parent_block_hash: None,
        token_ids: vec![0; 16],
        block_size: 1,
        lora_id: None,
        medium: Some(Medium::named("x".repeat(40))),
        lora_name: None,
    });
    let got = encode_batch(0.0, &[ev], None, Encoding::Array);
    // 16 elements no longer fit a fixarray (up to 15): array16 = dc 0010.
    let hashes: String = (0..16u8).map(|i| format!("{i:02x}")).collect();
    let want = hex(&format!(
        "93 cb 0000000000000000 91 98 ab {bs}
         dc0010 {hashes}          # block_hashes: array16 of 16
         c0
         dc0010 {zeros}           # token_ids: array16 of 16 zeros
         01 c0
         d9 28 {x40}              # medium: str8 of 40 (fixstr stops at 31)
         c0 c0",
        bs = ascii("BlockStored"),
        zeros = "00".repeat(16),
        x40 = ascii(&"x".repeat(40)),
    ));
    assert_eq!(got, want);
}

#[test]
fn int_block_hashes_are_vllms_low_64_bits() {
    let digest: Vec<u8> = (1..=32).collect();
    // int.from_bytes(bytes(range(1, 33)), "big") & (2**64 - 1) = 0x191a1b1c1d1e1f20
    assert_eq!(
        ExternalBlockHash::from_digest(&digest, BlockHashForm::Int),
        ExternalBlockHash::Int(0x191a_1b1c_1d1e_1f20)
    );
    assert_eq!(
        ExternalBlockHash::int_from_digest(&[0x01, 0x02]),
        ExternalBlockHash::Int(0x0102)
    );
    assert_eq!(
        ExternalBlockHash::int_from_digest(&[]),
        ExternalBlockHash::Int(0)
    );
    assert_eq!(
        ExternalBlockHash::from_digest(&digest, BlockHashForm::Bytes),
        ExternalBlockHash::Bytes(Bytes::from(digest.clone()))
    );
}

#[test]
fn a_decoder_reads_back_every_field() {
    // An independent decoder (rmpv) sees the structure the goldens spell out.
    let bytes = encode_batch(2.25, &[stored()], Some(9), Encoding::Map);
    let v = rmpv::decode::read_value(&mut bytes.as_slice()).unwrap();
    let top = v.as_array().unwrap();
    assert_eq!(top[0].as_f64(), Some(2.25));
    assert_eq!(top[2].as_u64(), Some(9));
    let ev = top[1].as_array().unwrap()[0].as_map().unwrap();
    let field = |k: &str| {
        ev.iter()
            .find(|(key, _)| key.as_str() == Some(k))
            .map(|(_, v)| v.clone())
            .unwrap()
    };
    assert_eq!(field("type").as_str(), Some("BlockStored"));
    let hashes = field("block_hashes");
    let hashes = hashes.as_array().unwrap();
    assert_eq!(hashes[1].as_u64(), Some(u64::MAX));
    assert_eq!(hashes[2].as_slice(), Some(&b"ab"[..]));
    assert!(field("parent_block_hash").is_nil());
    assert_eq!(
        field("token_ids").as_array().unwrap()[2].as_u64(),
        Some(70_000)
    );
    assert_eq!(field("medium").as_str(), Some("CPU"));
}
