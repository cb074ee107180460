//! `SaveRequest` and `SaveLayer` (engine.proto) by hand, so that a Save's block hashes decode
//! into one buffer per layer instead of one heap allocation per hash.
//!
//! A 256-block Save of a 32-layer model carries 8,192 hashes. Decoded as `repeated bytes` into
//! `Vec<Vec<u8>>`, each hash costs a reference-counted split of the request buffer, an
//! allocation, a copy and a free: on the 2-core development VM that was ~1.1 ms of the ~1.6 ms
//! of server CPU per Save request, serial with the copy (docs/benchmarks/log/cuda.md §13). Here:
//! - [`HashList`] keeps a layer's hashes back to back in one `Vec<u8>` with their end offsets,
//!   so a layer costs two growing vectors whatever its block count;
//! - [`SaveRequest`] decodes each `SaveLayer` from one contiguous slice when the request buffer
//!   holds it in one piece (a unary gRPC request always does), so the per-field work is a
//!   slice's pointer bump rather than a call into the request buffer.
//!
//! The wire format is engine.proto's, unchanged. `SaveRequest`: 1 `instance_id` (string),
//! 2 `tp_rank` (uint32), 3 `device_id` (int32), 4 `saves` (repeated `SaveLayer`), 5 `pp_rank`
//! (uint32). `SaveLayer`: 1 `layer_name` (string), 2 `block_ids` (repeated uint32; packed on
//! encode, packed or not on decode, as proto3 wants), 3 `block_hashes` (repeated bytes, one
//! length-delimited field per hash). Unknown fields are skipped; scalars follow proto3's
//! last-one-wins. The byte-for-byte equivalence with the generated code is tested against
//! `prost`-derived twins of both messages (tests below and `tests/golden.rs`).

use std::fmt;
use std::ops::Index;

use prost::bytes::{Buf, BufMut};
use prost::encoding::{
    check_wire_type, decode_key, decode_varint, encode_key, encode_varint, encoded_len_varint,
    int32, key_len, message, skip_field, string, uint32, DecodeContext, WireType,
};
use prost::DecodeError;

/// A list of block hashes (byte strings), stored back to back in one buffer.
///
/// Shape: `len()` hashes; hash `i` is `bytes[ends[i-1]..ends[i]]`. Iterating yields `&[u8]`;
/// indexing by position gives the hash as `[u8]`. Two lists are equal when they hold the same
/// hashes in the same order. Built from `Vec<Vec<u8>>` (or any iterator of byte slices) with
/// `From` / `collect`, or [`HashList::push`].
#[derive(Clone, Default, PartialEq, Eq, Hash)]
pub struct HashList {
    bytes: Vec<u8>,
    ends: Vec<u32>,
}

impl HashList {
    /// An empty list.
    pub const fn new() -> Self {
        Self {
            bytes: Vec::new(),
            ends: Vec::new(),
        }
    }

    /// An empty list with room for `hashes` hashes of `bytes` bytes in all.
    pub fn with_capacity(hashes: usize, bytes: usize) -> Self {
        Self {
            bytes: Vec::with_capacity(bytes),
            ends: Vec::with_capacity(hashes),
        }
    }

    /// Number of hashes.
    pub fn len(&self) -> usize {
        self.ends.len()
    }

    /// True when there is no hash.
    pub fn is_empty(&self) -> bool {
        self.ends.is_empty()
    }

    /// Bytes of all hashes together.
    pub fn total_bytes(&self) -> usize {
        self.bytes.len()
    }

    /// Appends `hash`.
    ///
    /// # Panics
    /// When the list would hold more than `u32::MAX` bytes (4 GiB; a request is at most
    /// 64 MiB, and decoding refuses such a list rather than panicking).
    pub fn push(&mut self, hash: &[u8]) {
        self.bytes.extend_from_slice(hash);
        self.ends
            .push(u32::try_from(self.bytes.len()).expect("HashList holds at most 4 GiB"));
    }

    /// The hash at `i`, if there is one.
    pub fn get(&self, i: usize) -> Option<&[u8]> {
        let end = *self.ends.get(i)? as usize;
        let start = if i == 0 { 0 } else { self.ends[i - 1] as usize };
        Some(&self.bytes[start..end])
    }

    /// The hashes in order.
    pub fn iter(&self) -> Iter<'_> {
        Iter {
            list: self,
            front: 0,
            back: self.ends.len(),
        }
    }

    /// Removes every hash (keeps the buffers).
    pub fn clear(&mut self) {
        self.bytes.clear();
        self.ends.clear();
    }

    /// Appends a hash of `len` bytes read from `buf` (which holds at least that many).
    fn push_from(&mut self, buf: &mut impl Buf, len: usize) -> Result<(), DecodeError> {
        let start = self.bytes.len();
        let end = start + len;
        let Ok(end32) = u32::try_from(end) else {
            return Err(buffer_underflow());
        };
        if buf.chunk().len() >= len {
            self.bytes.extend_from_slice(&buf.chunk()[..len]);
            buf.advance(len);
        } else {
            self.bytes.resize(end, 0);
            buf.copy_to_slice(&mut self.bytes[start..end]);
        }
        self.ends.push(end32);
        Ok(())
    }
}

impl Index<usize> for HashList {
    type Output = [u8];

    /// The hash at `i`. Panics when `i >= len()`, like a slice.
    fn index(&self, i: usize) -> &[u8] {
        match self.get(i) {
            Some(h) => h,
            None => panic!("hash index {i} out of range for a list of {}", self.len()),
        }
    }
}

/// Equal to a list of byte strings holding the same hashes in the same order.
impl<T: AsRef<[u8]>> PartialEq<[T]> for HashList {
    fn eq(&self, other: &[T]) -> bool {
        self.len() == other.len() && self.iter().zip(other).all(|(a, b)| a == b.as_ref())
    }
}

impl<T: AsRef<[u8]>, const N: usize> PartialEq<[T; N]> for HashList {
    fn eq(&self, other: &[T; N]) -> bool {
        *self == other[..]
    }
}

impl<T: AsRef<[u8]>> PartialEq<Vec<T>> for HashList {
    fn eq(&self, other: &Vec<T>) -> bool {
        *self == other[..]
    }
}

impl fmt::Debug for HashList {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.iter()).finish()
    }
}

impl<T: AsRef<[u8]>> FromIterator<T> for HashList {
    fn from_iter<I: IntoIterator<Item = T>>(iter: I) -> Self {
        let mut l = Self::new();
        for h in iter {
            l.push(h.as_ref());
        }
        l
    }
}

impl From<Vec<Vec<u8>>> for HashList {
    fn from(v: Vec<Vec<u8>>) -> Self {
        let mut l = Self::with_capacity(v.len(), v.iter().map(Vec::len).sum());
        for h in &v {
            l.push(h);
        }
        l
    }
}

impl From<&[&[u8]]> for HashList {
    fn from(v: &[&[u8]]) -> Self {
        v.iter().collect()
    }
}

impl<'a> IntoIterator for &'a HashList {
    type Item = &'a [u8];
    type IntoIter = Iter<'a>;

    fn into_iter(self) -> Iter<'a> {
        self.iter()
    }
}

/// Iterator over a [`HashList`]'s hashes.
#[derive(Clone, Debug)]
pub struct Iter<'a> {
    list: &'a HashList,
    front: usize,
    back: usize,
}

impl<'a> Iterator for Iter<'a> {
    type Item = &'a [u8];

    fn next(&mut self) -> Option<&'a [u8]> {
        if self.front == self.back {
            return None;
        }
        let start = if self.front == 0 {
            0
        } else {
            self.list.ends[self.front - 1] as usize
        };
        let end = self.list.ends[self.front] as usize;
        self.front += 1;
        Some(&self.list.bytes[start..end])
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        let n = self.back - self.front;
        (n, Some(n))
    }
}

impl DoubleEndedIterator for Iter<'_> {
    fn next_back(&mut self) -> Option<Self::Item> {
        if self.front == self.back {
            return None;
        }
        self.back -= 1;
        self.list.get(self.back)
    }
}

impl ExactSizeIterator for Iter<'_> {}

/// One layer of a Save request (engine.proto `SaveLayer`): the device block ids to save and
/// their hashes, one hash per id.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SaveLayer {
    /// Field 1: the layer's registered name.
    pub layer_name: String,
    /// Field 2: device block ids.
    pub block_ids: Vec<u32>,
    /// Field 3: block hashes, one per block id.
    pub block_hashes: HashList,
}

impl SaveLayer {
    /// Appends one `block_hashes` entry (its length, then its bytes) read from `buf`. On the
    /// first hash the list is sized from the block ids already decoded (one hash each, as long
    /// as the first), so it is allocated about once; without ids it grows as it goes.
    fn merge_hash(&mut self, buf: &mut impl Buf) -> Result<(), DecodeError> {
        let len = decode_varint(buf)?;
        if len > buf.remaining() as u64 {
            return Err(buffer_underflow());
        }
        let len = len as usize;
        if self.block_hashes.ends.capacity() == 0 && !self.block_ids.is_empty() {
            // One hash per block id (field 2 comes first on the wire), each as long as the
            // first: sized once for a well-formed layer, never more than the ids and what is
            // left of the buffer allow.
            let n = self.block_ids.len();
            self.block_hashes.ends.reserve(n);
            self.block_hashes
                .bytes
                .reserve(n.saturating_mul(len).min(buf.remaining()));
        }
        self.block_hashes.push_from(buf, len)
    }

    /// Merges the fields encoded in `s` (one whole `SaveLayer` body) into `self`: hashes and
    /// packed block ids in a loop over the slice, anything else through
    /// [`prost::Message::merge_field`].
    fn merge_slice(&mut self, mut s: &[u8]) -> Result<(), DecodeError> {
        let at = |field| at(NAME, field);
        while !s.is_empty() {
            let (tag, wire_type) = decode_key(&mut s)?;
            match (tag, wire_type) {
                (3, WireType::LengthDelimited) => {
                    self.merge_hash(&mut s).map_err(at("block_hashes"))?;
                }
                (2, WireType::LengthDelimited) => {
                    let len = decode_varint(&mut s).map_err(at("block_ids"))?;
                    if len > s.len() as u64 {
                        return Err(at("block_ids")(buffer_underflow()));
                    }
                    let (mut packed, rest) = s.split_at(len as usize);
                    // At least one byte per value.
                    self.block_ids.reserve(packed.len());
                    while !packed.is_empty() {
                        // uint32 takes a varint's low 32 bits, as the generated code does.
                        let v = decode_varint(&mut packed).map_err(at("block_ids"))?;
                        self.block_ids.push(v as u32);
                    }
                    s = rest;
                }
                _ => {
                    prost::Message::merge_field(
                        self,
                        tag,
                        wire_type,
                        &mut s,
                        DecodeContext::default(),
                    )?;
                }
            }
        }
        Ok(())
    }
}

const NAME: &str = "SaveLayer";

impl prost::Message for SaveLayer {
    fn encode_raw(&self, buf: &mut impl BufMut) {
        if !self.layer_name.is_empty() {
            string::encode(1, &self.layer_name, buf);
        }
        uint32::encode_packed(2, &self.block_ids, buf);
        for h in &self.block_hashes {
            encode_key(3, WireType::LengthDelimited, buf);
            encode_varint(h.len() as u64, buf);
            buf.put_slice(h);
        }
    }

    fn merge_field(
        &mut self,
        tag: u32,
        wire_type: WireType,
        buf: &mut impl Buf,
        ctx: DecodeContext,
    ) -> Result<(), DecodeError> {
        let at = |field| at(NAME, field);
        match tag {
            1 => string::merge(wire_type, &mut self.layer_name, buf, ctx).map_err(at("layer_name")),
            2 => uint32::merge_repeated(wire_type, &mut self.block_ids, buf, ctx)
                .map_err(at("block_ids")),
            3 => check_wire_type(WireType::LengthDelimited, wire_type)
                .and_then(|()| self.merge_hash(buf))
                .map_err(at("block_hashes")),
            _ => skip_field(wire_type, tag, buf, ctx),
        }
    }

    fn encoded_len(&self) -> usize {
        let name = if self.layer_name.is_empty() {
            0
        } else {
            string::encoded_len(1, &self.layer_name)
        };
        let hashes: usize = self
            .block_hashes
            .iter()
            .map(|h| encoded_len_varint(h.len() as u64) + h.len())
            .sum();
        name + uint32::encoded_len_packed(2, &self.block_ids)
            + key_len(3) * self.block_hashes.len()
            + hashes
    }

    fn clear(&mut self) {
        self.layer_name.clear();
        self.block_ids.clear();
        self.block_hashes.clear();
    }
}

/// Most `SaveLayer`s one request may decode into: 65,536. The server refuses more than 4,096
/// layers anyway, after decoding; this bound keeps a hostile request of empty layers (two
/// bytes each) from growing a list of millions of them first.
pub const MAX_DECODED_LAYERS: usize = 1 << 16;

/// A Save request (engine.proto `SaveRequest`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SaveRequest {
    /// Field 1: the instance.
    pub instance_id: String,
    /// Field 2: the worker's TP rank.
    pub tp_rank: u32,
    /// Field 3: the worker's device id.
    pub device_id: i32,
    /// Field 4: per layer, the blocks to save.
    pub saves: Vec<SaveLayer>,
    /// Field 5: the worker's PP rank.
    pub pp_rank: u32,
}

const REQUEST: &str = "SaveRequest";

impl prost::Message for SaveRequest {
    fn encode_raw(&self, buf: &mut impl BufMut) {
        if !self.instance_id.is_empty() {
            string::encode(1, &self.instance_id, buf);
        }
        if self.tp_rank != 0 {
            uint32::encode(2, &self.tp_rank, buf);
        }
        if self.device_id != 0 {
            int32::encode(3, &self.device_id, buf);
        }
        for l in &self.saves {
            message::encode(4, l, buf);
        }
        if self.pp_rank != 0 {
            uint32::encode(5, &self.pp_rank, buf);
        }
    }

    fn merge_field(
        &mut self,
        tag: u32,
        wire_type: WireType,
        buf: &mut impl Buf,
        ctx: DecodeContext,
    ) -> Result<(), DecodeError> {
        let at = |field| at(REQUEST, field);
        match tag {
            1 => {
                string::merge(wire_type, &mut self.instance_id, buf, ctx).map_err(at("instance_id"))
            }
            2 => uint32::merge(wire_type, &mut self.tp_rank, buf, ctx).map_err(at("tp_rank")),
            3 => int32::merge(wire_type, &mut self.device_id, buf, ctx).map_err(at("device_id")),
            4 => (|| {
                check_wire_type(WireType::LengthDelimited, wire_type)?;
                if self.saves.len() >= MAX_DECODED_LAYERS {
                    return Err(too_many_layers());
                }
                let len = decode_varint(buf)?;
                if len > buf.remaining() as u64 {
                    return Err(buffer_underflow());
                }
                let len = len as usize;
                let mut layer = SaveLayer::default();
                if buf.chunk().len() >= len {
                    // The whole layer in one slice: decode it there, then step over it.
                    layer.merge_slice(&buf.chunk()[..len])?;
                    buf.advance(len);
                } else {
                    layer.merge_slice(&buf.copy_to_bytes(len))?;
                }
                self.saves.push(layer);
                Ok(())
            })()
            .map_err(at("saves")),
            5 => uint32::merge(wire_type, &mut self.pp_rank, buf, ctx).map_err(at("pp_rank")),
            _ => skip_field(wire_type, tag, buf, ctx),
        }
    }

    fn encoded_len(&self) -> usize {
        (if self.instance_id.is_empty() {
            0
        } else {
            string::encoded_len(1, &self.instance_id)
        }) + (if self.tp_rank == 0 {
            0
        } else {
            uint32::encoded_len(2, &self.tp_rank)
        }) + (if self.device_id == 0 {
            0
        } else {
            int32::encoded_len(3, &self.device_id)
        }) + message::encoded_len_repeated(4, &self.saves)
            + (if self.pp_rank == 0 {
                0
            } else {
                uint32::encoded_len(5, &self.pp_rank)
            })
    }

    fn clear(&mut self) {
        *self = Self::default();
    }
}

/// Adds `message.field` to a decode error's location (as the generated code does).
fn at(message: &'static str, field: &'static str) -> impl Fn(DecodeError) -> DecodeError {
    move |mut e| {
        e.push(message, field);
        e
    }
}

/// The error for a request of more than [`MAX_DECODED_LAYERS`] layers.
#[cold]
fn too_many_layers() -> DecodeError {
    // prost 0.14 offers no other way to build an error with a message of one's own outside
    // its crate; the constructor is kept through 0.14.
    #[allow(deprecated)]
    DecodeError::new(format!("more than {MAX_DECODED_LAYERS} layers"))
}

/// prost's own "buffer underflow" error, made the only way prost offers outside its crate
/// without a deprecated constructor: skipping a fixed 8-byte field of an empty buffer.
#[cold]
fn buffer_underflow() -> DecodeError {
    match skip_field(
        WireType::SixtyFourBit,
        1,
        &mut &[][..],
        DecodeContext::default(),
    ) {
        Err(e) => e,
        Ok(()) => unreachable!("skipping 8 bytes of an empty buffer cannot succeed"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use prost::Message;

    /// The generated shape of `SaveLayer` (what `prost-build` emits for engine.proto).
    #[derive(Clone, PartialEq, prost::Message)]
    struct Generated {
        #[prost(string, tag = "1")]
        layer_name: String,
        #[prost(uint32, repeated, tag = "2")]
        block_ids: Vec<u32>,
        #[prost(bytes = "vec", repeated, tag = "3")]
        block_hashes: Vec<Vec<u8>>,
    }

    /// The generated shape of `SaveRequest`, with its `saves` in the generated form.
    #[derive(Clone, PartialEq, prost::Message)]
    struct GeneratedRequest {
        #[prost(string, tag = "1")]
        instance_id: String,
        #[prost(uint32, tag = "2")]
        tp_rank: u32,
        #[prost(int32, tag = "3")]
        device_id: i32,
        #[prost(message, repeated, tag = "4")]
        saves: Vec<Generated>,
        #[prost(uint32, tag = "5")]
        pp_rank: u32,
    }

    fn ours(g: &Generated) -> SaveLayer {
        SaveLayer {
            layer_name: g.layer_name.clone(),
            block_ids: g.block_ids.clone(),
            block_hashes: g.block_hashes.clone().into(),
        }
    }

    fn layer() -> impl Strategy<Value = Generated> {
        (
            "[a-z.0-9]{0,12}",
            proptest::collection::vec(any::<u32>(), 0..40),
            proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..70), 0..40),
        )
            .prop_map(|(layer_name, block_ids, block_hashes)| Generated {
                layer_name,
                block_ids,
                block_hashes,
            })
    }

    proptest! {
        /// Encoding is byte-identical to the generated code, and each decodes the other's bytes
        /// to the same values.
        #[test]
        fn wire_identical_to_the_generated_code(g in layer()) {
            let o = ours(&g);
            let gb = g.encode_to_vec();
            prop_assert_eq!(o.encode_to_vec(), gb.clone());
            prop_assert_eq!(o.encoded_len(), gb.len());
            prop_assert_eq!(SaveLayer::decode(&gb[..]).unwrap(), o.clone());
            prop_assert_eq!(Generated::decode(&o.encode_to_vec()[..]).unwrap(), g);
        }

        /// Nested in a request, as the server decodes it: several layers, fields around them.
        #[test]
        fn nested_in_a_request(layers in proptest::collection::vec(layer(), 0..5), inst in "[a-z]{0,8}", dev in any::<i32>()) {
            let g = GeneratedRequest { instance_id: inst, tp_rank: 3, device_id: dev, saves: layers, pp_rank: 1 };
            let bytes = g.encode_to_vec();
            let o = SaveRequest::decode(&bytes[..]).unwrap();
            prop_assert_eq!(&o.instance_id, &g.instance_id);
            prop_assert_eq!((o.tp_rank, o.device_id, o.pp_rank), (g.tp_rank, g.device_id, g.pp_rank));
            prop_assert_eq!(o.saves.len(), g.saves.len());
            for (a, b) in o.saves.iter().zip(&g.saves) {
                prop_assert_eq!(a, &ours(b));
            }
            prop_assert_eq!(o.encode_to_vec(), bytes.clone());
            prop_assert_eq!(o.encoded_len(), bytes.len());
            prop_assert_eq!(GeneratedRequest::decode(&o.encode_to_vec()[..]).unwrap(), g);
            // The same bytes from a buffer in two pieces (the copy fallback for a layer that
            // spans them) decode to the same request.
            let cut = bytes.len() / 2;
            let split = prost::bytes::Buf::chain(&bytes[..cut], &bytes[cut..]);
            prop_assert_eq!(SaveRequest::decode(split).unwrap(), o);
        }

        /// Truncated input is an error, never a panic or a wrong value.
        #[test]
        fn truncation_is_an_error(g in layer(), cut in any::<prop::sample::Index>()) {
            let bytes = g.encode_to_vec();
            prop_assume!(!bytes.is_empty());
            let at = cut.index(bytes.len());
            match SaveLayer::decode(&bytes[..at]) {
                Ok(d) => {
                    // A cut between two fields leaves a valid shorter message: a prefix.
                    let full = ours(&g);
                    prop_assert!(d.block_hashes.len() <= full.block_hashes.len());
                    for (a, b) in d.block_hashes.iter().zip(full.block_hashes.iter()) {
                        prop_assert_eq!(a, b);
                    }
                }
                Err(_) => {}
            }
        }
    }

    #[test]
    fn request_scalars_last_one_wins_and_errors_name_the_field() {
        // tp_rank 1 then 2; an unknown fixed64 field 7; a layer with a bad hash length.
        let mut bytes = vec![0x10, 0x01, 0x10, 0x02, 0x39, 0, 0, 0, 0, 0, 0, 0, 0];
        let r = SaveRequest::decode(&bytes[..]).unwrap();
        assert_eq!(r.tp_rank, 2);
        bytes.extend_from_slice(&[0x22, 0x02, 0x1a, 0x05]);
        let e = SaveRequest::decode(&bytes[..]).unwrap_err().to_string();
        assert!(e.contains("SaveRequest.saves"), "{e}");
        assert!(e.contains("SaveLayer.block_hashes"), "{e}");
        // A layer longer than the request.
        let e = SaveRequest::decode(&[0x22, 0x09, 0x1a][..])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("buffer underflow") && e.contains("SaveRequest.saves"),
            "{e}"
        );
    }

    #[test]
    fn hostile_layers_are_bounded() {
        // More empty layers than MAX_DECODED_LAYERS: refused while decoding.
        let bytes: Vec<u8> = [0x22u8, 0x00].repeat(MAX_DECODED_LAYERS + 1);
        let e = SaveRequest::decode(&bytes[..]).unwrap_err().to_string();
        assert!(e.contains("more than 65536 layers"), "{e}");
        assert_eq!(
            SaveRequest::decode(&bytes[..2 * MAX_DECODED_LAYERS])
                .unwrap()
                .saves
                .len(),
            MAX_DECODED_LAYERS
        );
        // One 1-byte hash then a large unknown field: nothing is reserved from the body's
        // length without block ids.
        let mut body = vec![0x1a, 0x01, b'h', 0x4a];
        let junk = 1 << 20;
        prost::encoding::encode_varint(junk as u64, &mut body);
        body.resize(body.len() + junk, 0);
        let mut req = vec![0x22];
        prost::encoding::encode_varint(body.len() as u64, &mut req);
        req.extend_from_slice(&body);
        let r = SaveRequest::decode(&req[..]).unwrap();
        let h = &r.saves[0].block_hashes;
        assert_eq!(h.iter().collect::<Vec<_>>(), vec![&b"h"[..]]);
        assert!(
            h.bytes.capacity() < 4096 && h.ends.capacity() < 1024,
            "{h:?}"
        );
        // With block ids first, the list is sized from them.
        let g = Generated {
            layer_name: "l".into(),
            block_ids: (0..100).collect(),
            block_hashes: (0..100u8).map(|i| vec![i; 32]).collect(),
        };
        let d = SaveRequest::decode(
            &GeneratedRequest {
                saves: vec![g],
                ..Default::default()
            }
            .encode_to_vec()[..],
        )
        .unwrap();
        let h = &d.saves[0].block_hashes;
        assert_eq!(
            (h.len(), h.ends.capacity(), h.bytes.capacity()),
            (100, 100, 3200)
        );
    }

    #[test]
    fn unpacked_block_ids_and_unknown_fields_decode() {
        // field 2 unpacked (two varints), an unknown varint field 9, one hash "ab".
        let bytes = [0x10, 0x05, 0x48, 0x01, 0x10, 0x07, 0x1a, 0x02, b'a', b'b'];
        let d = SaveLayer::decode(&bytes[..]).unwrap();
        assert_eq!(d.block_ids, vec![5, 7]);
        assert_eq!(d.block_hashes.iter().collect::<Vec<_>>(), vec![&b"ab"[..]]);
        // The same body as a request's layer (the slice path), next to a packed one.
        let mut req = vec![0x22, bytes.len() as u8];
        req.extend_from_slice(&bytes);
        req.extend_from_slice(&[0x22, 0x04, 0x12, 0x02, 0x01, 0x02]);
        let r = SaveRequest::decode(&req[..]).unwrap();
        assert_eq!(r.saves[0], d);
        assert_eq!(r.saves[1].block_ids, vec![1, 2]);
    }

    #[test]
    fn a_hash_longer_than_the_buffer_is_a_buffer_underflow() {
        let bytes = [0x1a, 0x05, b'a', b'b'];
        let e = SaveLayer::decode(&bytes[..]).unwrap_err().to_string();
        assert!(e.contains("buffer underflow"), "{e}");
        assert!(e.contains("SaveLayer.block_hashes"), "{e}");
        // A hash field with the wrong wire type.
        let e = SaveLayer::decode(&[0x18, 0x01][..])
            .unwrap_err()
            .to_string();
        assert!(e.contains("SaveLayer.block_hashes"), "{e}");
    }

    #[test]
    fn hash_list_accessors() {
        let l: HashList = vec![b"abc".to_vec(), vec![], b"d".to_vec()].into();
        assert_eq!(l.len(), 3);
        assert_eq!(l.total_bytes(), 4);
        assert_eq!(&l[0], b"abc");
        assert_eq!(&l[1], b"");
        assert_eq!(l.get(2), Some(&b"d"[..]));
        assert_eq!(l.get(3), None);
        assert_eq!(
            l.iter().rev().collect::<Vec<_>>(),
            vec![&b"d"[..], b"", b"abc"]
        );
        assert_eq!(l.iter().len(), 3);
        assert_eq!(format!("{l:?}"), "[[97, 98, 99], [], [100]]");
        let m: HashList = [&b"abc"[..], b"", b"d"].iter().collect();
        assert_eq!(l, m);
        let n: HashList = [&b"ab"[..], b"c", b"d"].iter().collect();
        assert_ne!(l, n, "same bytes, other boundaries");
    }

    #[test]
    #[should_panic(expected = "hash index 1 out of range for a list of 1")]
    fn indexing_past_the_end_panics() {
        let l: HashList = [b"a"].iter().collect();
        let _ = &l[1];
    }
}
