//! The gRPC codec of the MetaServer: message bodies pass through undecoded, both ways.
//!
//! tonic's prost codec decodes a request while it polls the connection, on an async worker
//! thread, and answers a body that does not decode INTERNAL. With this codec the service
//! gets the body as it came (no copy: the bytes are split off tonic's receive buffer),
//! decodes it itself — on a blocking thread when it is large — and answers a body that does
//! not decode INVALID_ARGUMENT ([`crate::service`]). Responses arrive encoded.

use prost::bytes::{Buf, BufMut, Bytes};
use tonic::codec::{Codec, DecodeBuf, Decoder, EncodeBuf, Encoder};
use tonic::Status;

/// Passes message bodies through as [`Bytes`].
#[derive(Debug, Clone, Copy, Default)]
pub struct RawCodec;

/// Writes an encoded message.
#[derive(Debug, Default)]
pub struct RawEncoder;

/// Hands over a message's bytes.
#[derive(Debug, Default)]
pub struct RawDecoder;

impl Encoder for RawEncoder {
    type Item = Bytes;
    type Error = Status;

    fn encode(&mut self, item: Bytes, dst: &mut EncodeBuf<'_>) -> Result<(), Status> {
        dst.put_slice(&item);
        Ok(())
    }
}

impl Decoder for RawDecoder {
    type Item = Bytes;
    type Error = Status;

    fn decode(&mut self, src: &mut DecodeBuf<'_>) -> Result<Option<Bytes>, Status> {
        let n = src.remaining();
        Ok(Some(src.copy_to_bytes(n)))
    }
}

impl Codec for RawCodec {
    type Encode = Bytes;
    type Decode = Bytes;
    type Encoder = RawEncoder;
    type Decoder = RawDecoder;

    fn encoder(&mut self) -> RawEncoder {
        RawEncoder
    }

    fn decoder(&mut self) -> RawDecoder {
        RawDecoder
    }
}
