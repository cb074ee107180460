//! The data port against real sockets: a locked block's bytes come back exact through
//! [`TcpDataPath`] over several connections; a read outside the locked slots, or of an
//! unknown session, is refused (the source never sends other memory); the requester's last
//! connection closing releases its sessions at once; a silent or lying peer makes a pull
//! fail by its deadline, never hang or write past its buffers.

use std::sync::Arc;
use std::time::{Duration, Instant};

use pegaflow_runtime::block::{BlockShape, SealedBlock};
use pegaflow_runtime::{
    Extent, HostBuffer, HostMemory, PeerDataError, PeerDataPath, PeerRead, RemoteRange,
};
use pegaflow_transport_tcp::client::TcpDataPath;
use pegaflow_transport_tcp::locks::{Locked, Locks};
use pegaflow_transport_tcp::metrics::PeerMetrics;
use pegaflow_transport_tcp::serve::{serve, ServeLimits};
use pegaflow_transport_tcp::wire;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Heap memory that frees its boxes when the buffer goes.
struct Heap(parking_lot::Mutex<Vec<Box<[u8]>>>);

impl HostMemory for Heap {
    fn release(&self, extents: &[Extent]) {
        self.0
            .lock()
            .retain(|b| !extents.iter().any(|e| e.addr == b.as_ptr() as usize));
    }
}

/// A host buffer of `len` bytes in `parts` extents.
fn buffer(heap: &Arc<Heap>, len: usize, parts: usize) -> HostBuffer {
    let mut extents = Vec::new();
    let per = len / parts;
    for i in 0..parts {
        let l = if i + 1 == parts { len - per * i } else { per };
        let b = vec![0u8; l].into_boxed_slice();
        extents.push(Extent {
            addr: b.as_ptr() as usize,
            len: l,
        });
        heap.0.lock().push(b);
    }
    HostBuffer::new(extents, heap.clone() as Arc<dyn HostMemory>)
}

struct Source {
    addr: String,
    locks: Arc<Locks>,
    block: Arc<SealedBlock>,
    bytes: Vec<u8>,
    session: String,
}

/// A data port serving one locked block of 4 slots × 64 KiB.
async fn source(lease: Duration) -> Source {
    let heap = Arc::new(Heap(parking_lot::Mutex::new(Vec::new())));
    let shape = BlockShape::new(vec![65536u64; 4]);
    let buf = buffer(&heap, 4 * 65536, 1);
    let bytes: Vec<u8> = (0..4 * 65536).map(|i| (i * 7 % 251) as u8).collect();
    buf.write_at(0, &bytes);
    let block = Arc::new(SealedBlock::from_buffer(0, &shape, Arc::new(buf), 0));
    let pieces: Vec<(u64, u64)> = block
        .pieces()
        .iter()
        .map(|e| (e.addr as u64, e.len as u64))
        .collect();
    let metrics = PeerMetrics::new(&prometheus::Registry::new());
    let locks = Arc::new(Locks::new(
        lease,
        Duration::from_secs(60),
        1000,
        metrics.clone(),
    ));
    let session = locks
        .lock("requester-1", Locked::new(vec![block.clone()], pieces))
        .unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    tokio::spawn(serve(
        listener,
        locks.clone(),
        ServeLimits {
            max_connections: 16,
            io_timeout: Duration::from_secs(2),
            idle_timeout: Duration::from_secs(60),
            max_read_bytes: 1 << 30,
        },
        metrics,
    ));
    Source {
        addr,
        locks,
        block,
        bytes,
        session,
    }
}

fn remote(b: &SealedBlock) -> Vec<RemoteRange> {
    b.slots
        .iter()
        .flat_map(|s| s.buf.pieces(s.offset, s.len))
        .map(|e| RemoteRange {
            addr: e.addr as u64,
            len: e.len as u64,
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_locked_block_comes_back_exact_over_several_connections() {
    let src = source(Duration::from_secs(30)).await;
    let heap = Arc::new(Heap(parking_lot::Mutex::new(Vec::new())));
    // A fragmented destination: the reads land across its extents.
    let dest = Arc::new(buffer(&heap, 4 * 65536, 3));
    let path = TcpDataPath::new("requester-1".into(), 4, Duration::from_secs(1));
    let deadline = Instant::now() + Duration::from_secs(5);
    path.connect(&src.addr, deadline).await.unwrap();
    path.pull(
        &src.addr,
        &src.session,
        vec![PeerRead {
            dest: dest.clone(),
            dest_offset: 0,
            ranges: remote(&src.block),
        }],
        deadline,
    )
    .await
    .unwrap();
    let mut got = vec![0u8; 4 * 65536];
    dest.read_at(0, &mut got);
    assert!(got == src.bytes, "every byte exact");
}

/// Raw hello + one read on a fresh connection: the status of the answer.
async fn raw_read(
    addr: &str,
    requester: &str,
    session: &str,
    ranges: &[wire::Range],
) -> wire::Status {
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    let mut hello = wire::request_header(wire::Op::Hello, requester.len()).to_vec();
    hello.extend_from_slice(requester.as_bytes());
    s.write_all(&hello).await.unwrap();
    let mut h = [0u8; wire::RESP_HEADER];
    s.read_exact(&mut h).await.unwrap();
    s.write_all(&wire::encode_read(5, session, ranges))
        .await
        .unwrap();
    s.read_exact(&mut h).await.unwrap();
    let (status, seq, len) = wire::parse_response_header(&h).unwrap();
    assert_eq!(seq, 5);
    let mut rest = vec![0u8; len as usize];
    s.read_exact(&mut rest).await.unwrap();
    status
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reads_outside_the_locked_slots_or_of_unknown_sessions_are_refused() {
    let src = source(Duration::from_secs(30)).await;
    let first = remote(&src.block)[0];
    let inside = wire::Range {
        addr: first.addr,
        len: first.len,
    };
    assert_eq!(
        raw_read(&src.addr, "r2", &src.session, &[inside]).await,
        wire::Status::Ok
    );
    for bad in [
        wire::Range {
            addr: first.addr - 1,
            len: 2,
        },
        wire::Range {
            addr: first.addr,
            len: 4 * 65536 + 1,
        },
        wire::Range {
            addr: 0x1000,
            len: 16,
        },
        wire::Range {
            addr: u64::MAX - 1,
            len: 8,
        },
    ] {
        assert_eq!(
            raw_read(&src.addr, "r2", &src.session, &[inside, bad]).await,
            wire::Status::OutOfBounds,
            "{bad:?}"
        );
    }
    assert_eq!(
        raw_read(&src.addr, "r2", "no-such-session", &[inside]).await,
        wire::Status::NoSession
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_requesters_last_connection_closing_releases_its_sessions() {
    let src = source(Duration::from_secs(30)).await;
    let path = TcpDataPath::new("requester-1".into(), 2, Duration::from_secs(1));
    path.connect(&src.addr, Instant::now() + Duration::from_secs(2))
        .await
        .unwrap();
    assert_eq!(src.locks.held_blocks(), 1);
    drop(path); // closes the idle connection
    let t0 = Instant::now();
    while src.locks.held_blocks() != 0 {
        assert!(t0.elapsed() < Duration::from_secs(1), "released at once");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_or_lying_peer_fails_the_pull_by_its_deadline() {
    let heap = Arc::new(Heap(parking_lot::Mutex::new(Vec::new())));
    // Silent: accepts, never answers the hello.
    let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let silent_addr = silent.local_addr().unwrap().to_string();
    tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((s, _)) = silent.accept().await {
            held.push(s);
        }
    });
    let path = TcpDataPath::new("r".into(), 2, Duration::from_millis(200));
    let t0 = Instant::now();
    let e = path
        .connect(&silent_addr, Instant::now() + Duration::from_millis(300))
        .await
        .unwrap_err();
    assert_eq!(e, PeerDataError::Timeout);
    assert!(t0.elapsed() < Duration::from_millis(800));

    // Lying: acks the hello, then answers a read with more bytes than asked.
    let liar = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let liar_addr = liar.local_addr().unwrap().to_string();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = liar.accept().await {
            tokio::spawn(async move {
                let mut h = [0u8; wire::REQ_HEADER];
                let _ = s.read_exact(&mut h).await;
                let (_, len) = wire::parse_request_header(&h).unwrap();
                let mut b = vec![0u8; len];
                let _ = s.read_exact(&mut b).await;
                let _ = s
                    .write_all(&wire::response_header(wire::Status::Ok, 0, 0))
                    .await;
                let _ = s.read_exact(&mut h).await;
                let (_, len) = wire::parse_request_header(&h).unwrap();
                let mut b = vec![0u8; len];
                let _ = s.read_exact(&mut b).await;
                let seq = wire::decode_read(&b).unwrap().seq;
                let _ = s
                    .write_all(&wire::response_header(wire::Status::Ok, seq, 1 << 20))
                    .await;
                let _ = s.write_all(&vec![0xAB; 1 << 20]).await;
            });
        }
    });
    let dest = Arc::new(buffer(&heap, 4096, 1));
    let e = path
        .pull(
            &liar_addr,
            "s",
            vec![PeerRead {
                dest: dest.clone(),
                dest_offset: 0,
                ranges: vec![RemoteRange {
                    addr: 0x1000,
                    len: 4096,
                }],
            }],
            Instant::now() + Duration::from_secs(2),
        )
        .await
        .unwrap_err();
    assert!(matches!(e, PeerDataError::Refused(_)), "{e:?}");
    // Ranges that overrun their destination are refused before any I/O.
    let e = path
        .pull(
            &liar_addr,
            "s",
            vec![PeerRead {
                dest,
                dest_offset: 1,
                ranges: vec![RemoteRange {
                    addr: 0x1000,
                    len: 4096,
                }],
            }],
            Instant::now() + Duration::from_secs(2),
        )
        .await
        .unwrap_err();
    assert!(matches!(e, PeerDataError::Refused(_)), "{e:?}");
}
