//! The client side of the fd side channel: one connection, one `sendmsg` carrying the payload
//! `instance_id \0 device_id` (decimal) and exactly one descriptor as SCM_RIGHTS
//! (`native-clients.md` §1.4). The server keeps its own duplicate; the caller keeps its fd.
//!
//! Native registration v2 sends one message per allocation, with the payload
//! `instance_id \0 device_id \0 allocation_index` ([`send_allocation_fd`]).

use std::io::{IoSlice, Read};
use std::os::fd::{AsRawFd, BorrowedFd};
use std::os::unix::net::UnixStream;
use std::path::Path;

use nix::sys::socket::{sendmsg, ControlMessage, MsgFlags};

use crate::ApiError;

/// The side-channel payload for `(instance_id, device_id)`.
pub fn side_channel_payload(instance_id: &str, device_id: i32) -> Vec<u8> {
    let mut p = Vec::with_capacity(instance_id.len() + 12);
    p.extend_from_slice(instance_id.as_bytes());
    p.push(0);
    p.extend_from_slice(device_id.to_string().as_bytes());
    p
}

/// The side-channel payload of allocation `index` of a native registration v2:
/// `instance_id \0 device_id \0 index` (both numbers decimal).
pub fn allocation_payload(instance_id: &str, device_id: i32, index: u32) -> Vec<u8> {
    let mut p = side_channel_payload(instance_id, device_id);
    p.push(0);
    p.extend_from_slice(index.to_string().as_bytes());
    p
}

/// Connects to the side channel at `socket_path` and sends `fd` under
/// `(instance_id, device_id)`. Returns once the message is written; the server does not answer.
pub fn send_fd(
    socket_path: &Path,
    instance_id: &str,
    device_id: i32,
    fd: BorrowedFd<'_>,
) -> Result<(), ApiError> {
    send_payload(
        socket_path,
        instance_id,
        side_channel_payload(instance_id, device_id),
        fd,
    )
    .map(drop)
}

/// Most allocations one native registration v2 names (the server's limit): no more than the
/// side channel holds pending by default (1,024 descriptors), since a client files every
/// allocation's descriptor before its registration is read.
pub const MAX_NATIVE_ALLOCATIONS: usize = 1024;

/// How long [`send_allocation_fd`] waits for the server's acknowledgement.
pub const ACK_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// Connects to the side channel at `socket_path`, sends `fd` as allocation `index` of the
/// native registration v2 of `(instance_id, device_id)`, and waits (up to [`ACK_TIMEOUT`])
/// for the server's one-byte acknowledgement. Blocks the calling thread for one local round
/// trip.
///
/// Errors: [`ApiError::InvalidArgument`] for an instance id outside `[A-Za-z0-9_-]{1,128}`;
/// [`ApiError::Rejected`] (rpc "side channel") when the server refused the descriptor (one is
/// already pending under the key, or too many are pending); [`ApiError::Io`] when connecting
/// or `sendmsg` fails, or the server closed the connection without an acknowledgement (kind
/// `UnexpectedEof`: nothing was filed, e.g. its connection slots were busy, or it does not
/// speak native v2), which the caller may retry.
pub fn send_allocation_fd(
    socket_path: &Path,
    instance_id: &str,
    device_id: i32,
    index: u32,
    fd: BorrowedFd<'_>,
) -> Result<(), ApiError> {
    let stream = send_payload(
        socket_path,
        instance_id,
        allocation_payload(instance_id, device_id, index),
        fd,
    )?;
    let what = format!("acknowledgement of allocation {index} on the fd side channel");
    stream
        .set_read_timeout(Some(ACK_TIMEOUT))
        .map_err(|e| ApiError::io(what.clone(), e))?;
    let mut ack = [0u8; 1];
    let n = (&stream)
        .read(&mut ack)
        .map_err(|e| ApiError::io(what.clone(), e))?;
    if n == 0 {
        return Err(ApiError::io(
            what,
            std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                "the server closed the connection without acknowledging (nothing filed: its \
                 connection slots were busy, the message was malformed, or the server does not \
                 speak native registration v2)",
            ),
        ));
    }
    match ack[0] {
        0 => Ok(()),
        1 => Err(ApiError::Rejected {
            rpc: "side channel",
            message: format!(
                "a descriptor is already pending for allocation {index} of instance {instance_id} device {device_id}"
            ),
        }),
        2 => Err(ApiError::Rejected {
            rpc: "side channel",
            message: "the server has too many descriptors pending; retry later".into(),
        }),
        other => Err(ApiError::Rejected {
            rpc: "side channel",
            message: format!("unknown acknowledgement byte {other}"),
        }),
    }
}

fn send_payload(
    socket_path: &Path,
    instance_id: &str,
    payload: Vec<u8>,
    fd: BorrowedFd<'_>,
) -> Result<UnixStream, ApiError> {
    if !crate::is_side_channel_safe_id(instance_id) {
        return Err(ApiError::InvalidArgument(format!(
            "instance_id {instance_id:?} must be 1-128 characters of [A-Za-z0-9_-]"
        )));
    }
    let stream = UnixStream::connect(socket_path)
        .map_err(|e| ApiError::io(format!("connect {}", socket_path.display()), e))?;
    let fds = [fd.as_raw_fd()];
    let cmsg = [ControlMessage::ScmRights(&fds)];
    sendmsg::<()>(
        stream.as_raw_fd(),
        &[IoSlice::new(&payload)],
        &cmsg,
        MsgFlags::MSG_NOSIGNAL,
        None,
    )
    .map_err(|e| ApiError::io("sendmsg on the fd side channel", e.into()))?;
    Ok(stream)
}
