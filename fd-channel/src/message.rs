//! One side-channel message on the wire: the single `recvmsg`, the ownership of every
//! descriptor it carries, and the parsing of its key (see the parent module for the format).

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

use tokio::io::Interest;
use tokio::net::UnixStream;

use super::{Key, MAX_KEY_PAYLOAD, MAX_RECEIVED_FDS};

/// Bytes of control space: room for `MAX_RECEIVED_FDS` descriptors in one `SCM_RIGHTS` message.
// SAFETY: CMSG_SPACE is pure arithmetic on its argument.
const CONTROL_BYTES: usize =
    unsafe { libc::CMSG_SPACE((MAX_RECEIVED_FDS * std::mem::size_of::<RawFd>()) as u32) } as usize;
/// Why a message was rejected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MalformedMessage {
    /// The kernel truncated the payload (`MSG_TRUNC`) or the control data (`MSG_CTRUNC`).
    #[error("message truncated (payload or control data larger than the receive buffers)")]
    Truncated,
    /// A control message other than `SCM_RIGHTS`, or one with an impossible length.
    #[error("unexpected control message (only one SCM_RIGHTS is allowed)")]
    UnexpectedControl,
    /// Not exactly one descriptor.
    #[error("expected exactly one descriptor, got {0}")]
    FdCount(usize),
    /// The payload exceeds [`MAX_KEY_PAYLOAD`] bytes.
    #[error("payload longer than {MAX_KEY_PAYLOAD} bytes")]
    Oversized,
    /// No NUL between instance id and device id.
    #[error("payload has no NUL between instance id and device id")]
    NoSeparator,
    /// The instance id is not 1-128 bytes of `[A-Za-z0-9_-]`.
    #[error("instance id {0:?} is not 1-128 characters of [A-Za-z0-9_-]")]
    UnsafeInstanceId(String),
    /// The device id is not a decimal i32.
    #[error("device id {0:?} is not a decimal 32-bit integer")]
    BadDeviceId(String),
    /// The allocation index of a v2 message is not a decimal integer below
    /// [`pegaflow_api::fd::MAX_NATIVE_ALLOCATIONS`].
    #[error("allocation index {0:?} is not a decimal integer below the most allocations one registration names")]
    BadAllocationIndex(String),
}

/// One `recvmsg` worth of data: everything is owned, so dropping it closes every descriptor.
pub(super) struct RawMessage {
    payload: Vec<u8>,
    flags: libc::c_int,
    fds: Vec<OwnedFd>,
    unexpected_control: bool,
}

impl RawMessage {
    /// Nothing arrived: the sender closed the connection without sending.
    pub(super) fn is_empty(&self) -> bool {
        self.payload.is_empty()
            && self.fds.is_empty()
            && !self.unexpected_control
            && self.flags & (libc::MSG_TRUNC | libc::MSG_CTRUNC) == 0
    }

    /// Validates the message and parses its key; on error every descriptor is closed.
    pub(super) fn into_key(mut self) -> Result<(Key, OwnedFd), MalformedMessage> {
        if self.flags & (libc::MSG_TRUNC | libc::MSG_CTRUNC) != 0 {
            return Err(MalformedMessage::Truncated);
        }
        if self.unexpected_control {
            return Err(MalformedMessage::UnexpectedControl);
        }
        if self.fds.len() != 1 {
            return Err(MalformedMessage::FdCount(self.fds.len()));
        }
        if self.payload.len() > MAX_KEY_PAYLOAD {
            return Err(MalformedMessage::Oversized);
        }
        let key = parse_key(&self.payload)?;
        let fd = self.fds.pop().ok_or(MalformedMessage::FdCount(0))?;
        Ok((key, fd))
    }
}

/// Parses `instance_id \0 device_id [\0...]` (v1) or `instance_id \0 device_id \0 index
/// [\0...]` (native registration v2).
pub(super) fn parse_key(payload: &[u8]) -> Result<Key, MalformedMessage> {
    let nul = payload
        .iter()
        .position(|&b| b == 0)
        .ok_or(MalformedMessage::NoSeparator)?;
    let (id, rest) = (&payload[..nul], &payload[nul + 1..]);
    let instance_id = match std::str::from_utf8(id) {
        Ok(s) if pegaflow_api::is_side_channel_safe_id(s) => s.to_owned(),
        _ => {
            return Err(MalformedMessage::UnsafeInstanceId(
                String::from_utf8_lossy(id).into_owned(),
            ))
        }
    };
    let end = rest.iter().rposition(|&b| b != 0).map_or(0, |i| i + 1);
    let rest = &rest[..end];
    let (device, index) = match rest.iter().position(|&b| b == 0) {
        Some(i) => (&rest[..i], Some(&rest[i + 1..])),
        None => (rest, None),
    };
    let device_id = std::str::from_utf8(device)
        .ok()
        .filter(|s| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit() || b == b'-'))
        .and_then(|s| s.parse::<i32>().ok())
        .ok_or_else(|| {
            MalformedMessage::BadDeviceId(String::from_utf8_lossy(device).into_owned())
        })?;
    let index = match index {
        None => None,
        Some(ix) => Some(
            std::str::from_utf8(ix)
                .ok()
                .filter(|s| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()))
                .and_then(|s| s.parse::<u32>().ok())
                .filter(|&i| (i as usize) < pegaflow_api::fd::MAX_NATIVE_ALLOCATIONS)
                .ok_or_else(|| {
                    MalformedMessage::BadAllocationIndex(String::from_utf8_lossy(ix).into_owned())
                })?,
        ),
    };
    Ok((instance_id, device_id, index))
}

/// Waits for the connection to become readable and performs the one `recvmsg`.
pub(super) async fn receive_message(stream: &UnixStream) -> io::Result<RawMessage> {
    loop {
        stream.readable().await?;
        match stream.try_io(Interest::READABLE, || recv_with_fds(stream.as_raw_fd())) {
            Ok(m) => return Ok(m),
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted
                ) =>
            {
                continue
            }
            Err(e) => return Err(e),
        }
    }
}

/// One non-blocking `recvmsg` with `MSG_CMSG_CLOEXEC`, a payload buffer one byte larger than
/// [`MAX_KEY_PAYLOAD`] (a stream socket never reports `MSG_TRUNC`, so the extra byte is what
/// detects an oversized payload) and control space for [`MAX_RECEIVED_FDS`] descriptors.
/// Every descriptor in every `SCM_RIGHTS` control message becomes an [`OwnedFd`] before this
/// returns.
pub(super) fn recv_with_fds(sock: RawFd) -> io::Result<RawMessage> {
    let mut payload = [0u8; MAX_KEY_PAYLOAD + 1];
    // u64 words keep the control buffer aligned for `cmsghdr`.
    let mut control = [0u64; CONTROL_BYTES.div_ceil(8)];
    let mut iov = libc::iovec {
        iov_base: payload.as_mut_ptr().cast(),
        iov_len: payload.len(),
    };
    // SAFETY: msghdr is a plain C struct; all-zero is a valid (empty) value.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = CONTROL_BYTES as _;
    // SAFETY: msg points at live buffers of the stated sizes for the duration of the call.
    let n = unsafe { libc::recvmsg(sock, &mut msg, libc::MSG_CMSG_CLOEXEC | libc::MSG_DONTWAIT) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    let mut fds = Vec::new();
    let mut unexpected_control = false;
    let control_start = control.as_ptr() as usize;
    let control_len = (msg.msg_controllen as usize).min(CONTROL_BYTES);
    // SAFETY: CMSG_LEN is pure arithmetic.
    let header_len = unsafe { libc::CMSG_LEN(0) } as usize;
    // SAFETY: msg's control pointer and length describe the buffer the kernel filled.
    let mut cmsg = unsafe { libc::CMSG_FIRSTHDR(&msg) };
    while !cmsg.is_null() {
        // SAFETY: CMSG_FIRSTHDR/CMSG_NXTHDR only return headers that start inside the
        // control buffer with room for a full header; the buffer is aligned for cmsghdr.
        let hdr = unsafe { &*cmsg };
        let offset = cmsg as usize - control_start;
        let len = hdr.cmsg_len as usize;
        if len < header_len || offset + len > control_len {
            // The kernel never writes this; stop walking rather than read past the data.
            unexpected_control = true;
            break;
        }
        if hdr.cmsg_level == libc::SOL_SOCKET && hdr.cmsg_type == libc::SCM_RIGHTS {
            let count = (len - header_len) / std::mem::size_of::<RawFd>();
            // SAFETY: the data of this header lies inside the control buffer (checked above).
            let data = unsafe { libc::CMSG_DATA(cmsg) }.cast::<RawFd>();
            for i in 0..count {
                // SAFETY: i < count keeps the read inside this header's data; the data may be
                // unaligned for RawFd in principle, hence read_unaligned.
                let raw = unsafe { std::ptr::read_unaligned(data.add(i)) };
                if raw >= 0 {
                    // SAFETY: the kernel just installed this descriptor in our table for us;
                    // nothing else owns it.
                    fds.push(unsafe { OwnedFd::from_raw_fd(raw) });
                }
            }
        } else {
            unexpected_control = true;
        }
        // SAFETY: msg and cmsg describe the control buffer as above.
        cmsg = unsafe { libc::CMSG_NXTHDR(&msg, cmsg) };
    }
    Ok(RawMessage {
        payload: payload[..n as usize].to_vec(),
        flags: msg.msg_flags,
        fds,
        unexpected_control,
    })
}
