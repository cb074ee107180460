//! The client side of the fd side channel: one connection, one `sendmsg` carrying the payload
//! `instance_id \0 device_id` (decimal) and exactly one descriptor as SCM_RIGHTS
//! (`native-clients.md` §1.4). The server keeps its own duplicate; the caller keeps its fd.

use std::io::IoSlice;
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

/// Connects to the side channel at `socket_path` and sends `fd` under
/// `(instance_id, device_id)`. Returns once the message is written; the server does not answer.
pub fn send_fd(
    socket_path: &Path,
    instance_id: &str,
    device_id: i32,
    fd: BorrowedFd<'_>,
) -> Result<(), ApiError> {
    if !crate::is_side_channel_safe_id(instance_id) {
        return Err(ApiError::InvalidArgument(format!(
            "instance_id {instance_id:?} must be 1-128 characters of [A-Za-z0-9_-]"
        )));
    }
    let stream = UnixStream::connect(socket_path)
        .map_err(|e| ApiError::io(format!("connect {}", socket_path.display()), e))?;
    let payload = side_channel_payload(instance_id, device_id);
    let fds = [fd.as_raw_fd()];
    let cmsg = [ControlMessage::ScmRights(&fds)];
    sendmsg::<()>(
        stream.as_raw_fd(),
        &[IoSlice::new(&payload)],
        &cmsg,
        MsgFlags::empty(),
        None,
    )
    .map_err(|e| ApiError::io("sendmsg on the fd side channel", e.into()))?;
    Ok(())
}
