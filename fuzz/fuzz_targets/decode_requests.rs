//! Every Engine request body through protobuf decoding and the server's request validation
//! (`pegaflow_runtime::decode`): arbitrary bytes must decode or be refused, never panic, and a
//! refusal's status message must stay within the 1 KiB cap. The first byte picks the request
//! type; the rest is the body.
#![no_main]

use libfuzzer_sys::fuzz_target;
use pegaflow_proto as pb;
use pegaflow_runtime::decode;
use prost::Message;

fn check<T>(r: Result<T, pegaflow_runtime::error::EngineError>) {
    if let Err(e) = r {
        let status = e.to_status();
        assert!(status.message().len() <= 1100, "status message of {} bytes", status.message().len());
    }
}

fuzz_target!(|data: &[u8]| {
    let Some((&kind, body)) = data.split_first() else {
        return;
    };
    match kind % 10 {
        0 => {
            if let Ok(r) = pb::RegisterContextRequest::decode(body) {
                let _ = decode::register(r);
            }
        }
        1 => {
            if let Ok(r) = pb::SaveRequest::decode(body) {
                check(decode::save(r));
            }
        }
        2 => {
            if let Ok(r) = pb::LoadRequest::decode(body) {
                let _ = decode::load_state_word(&r);
                check(decode::load(r));
            }
        }
        3 => {
            if let Ok(r) = pb::QueryRequest::decode(body) {
                check(decode::query(r));
            }
        }
        4 => {
            if let Ok(r) = pb::ReleaseRequest::decode(body) {
                check(decode::release(r));
            }
        }
        5 => {
            if let Ok(r) = pb::UnregisterRequest::decode(body) {
                check(decode::unregister(r));
            }
        }
        6 => {
            if let Ok(r) = pb::SessionRequest::decode(body) {
                check(decode::session(r));
            }
        }
        7 => {
            if let Ok(r) = pb::QueryBlocksForTransferRequest::decode(body) {
                check(decode::check_query_blocks_for_transfer(&r));
            }
        }
        8 => {
            if let Ok(r) = pb::ReleaseTransferLockRequest::decode(body) {
                check(decode::check_release_transfer_lock(&r));
            }
        }
        _ => {
            if let Ok(r) = pb::RdmaHandshakeRequest::decode(body) {
                check(decode::check_rdma_handshake(&r));
            }
        }
    }
});
