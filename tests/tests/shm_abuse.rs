//! Nothing a client does to memory it shares with the server may crash the server (issue 14):
//! a load-state object truncated, regrown, resized or unlinked around an asynchronous Load; a
//! host memfd that cannot be sealed against shrinking; a sealed KV memfd the client tries to
//! shrink. The server runs in this process, so a server crash is this test binary dying of
//! SIGBUS.
//!
//! The Load copies here go through the `memcpy` transport wrapped in a `fault` layer that
//! delays every copy by [`COPY_DELAY_MS`]: an asynchronous Load's RPC returns long before the
//! server writes the completion word, so whatever the test does to the object right after the
//! RPC deterministically happens between the server's attach and its write.
//!
//! Never read a [`LoadState`] whose object the test truncated: the test's own mapping of it
//! would fault.

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::fcntl::{fcntl, FcntlArg, SealFlag};
use nix::sys::memfd::{memfd_create, MFdFlags};
use pegaflow_api::load_state::{LoadState, LOAD_SUCCESS};
use pegaflow_proto as pb;
use pegaflow_runtime::config::PluginConfig;
use pegaflow_tests::harness::*;
use tonic::Code;

const SHAPE: KvShape = KvShape {
    layers: 2,
    num_blocks: 8,
    segment_bytes: 256,
};

/// How long the `fault` layer holds every copy before running it.
const COPY_DELAY_MS: i64 = 300;

fn shm_path(state: &LoadState) -> String {
    format!("/dev/shm/{}", state.name())
}

fn resize(state: &LoadState, len: u64) {
    std::fs::OpenOptions::new()
        .write(true)
        .open(shm_path(state))
        .expect("open load state")
        .set_len(len)
        .expect("resize load state");
}

fn host_memfd_registrar(require_shrink_seal: Option<bool>) -> PluginConfig {
    let mut settings = toml::Table::new();
    if let Some(v) = require_shrink_seal {
        settings.insert("require_shrink_seal".into(), toml::Value::Boolean(v));
    }
    PluginConfig {
        kind: "host-memfd".into(),
        layers: vec![],
        settings,
    }
}

/// A server whose copies each wait [`COPY_DELAY_MS`] first.
async fn slow_copy_server() -> TestServer {
    TestServer::start_with(ServerOptions::default(), |p| {
        let mut fault = toml::Table::new();
        fault.insert("kind".into(), toml::Value::String("fault".into()));
        fault.insert("delay_ms".into(), toml::Value::Integer(COPY_DELAY_MS));
        p.transports = Some(vec![PluginConfig {
            kind: "memcpy".into(),
            layers: vec![toml::Value::Table(fault)],
            settings: toml::Table::new(),
        }]);
    })
    .await
}

/// A server with the host-memfd registrar configured as given (`None`: its defaults).
async fn server_with_registrar(require_shrink_seal: Option<bool>) -> TestServer {
    TestServer::start_with(ServerOptions::default(), |p| {
        p.registrars = Some(vec![host_memfd_registrar(require_shrink_seal)]);
    })
    .await
}

fn load_failures(srv: &TestServer) -> u64 {
    srv.handle.engine.metrics().load_failures.get()
}

async fn wait_until(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !done() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// A worker `tag` with blocks 0 and 1 saved, and the lease of a query for them.
async fn saved_worker(srv: &TestServer, tag: &str) -> (Worker, Vec<Vec<u8>>, Vec<u8>) {
    let mut w = Worker::register(srv, tag, "ns", SHAPE, 0, 1, 0).await;
    let hs: Vec<Vec<u8>> = (0..2).map(|i| hash_of(tag, i)).collect();
    w.kv.fill(0, &hs[0]);
    w.kv.fill(1, &hs[1]);
    w.save(&[0, 1], &hs).await.unwrap();
    let (n, lease) = ready(w.client.query(tag, hs.clone(), "q").await.unwrap());
    assert_eq!(n, 2);
    (w, hs, lease)
}

/// Starts an asynchronous Load of `lease` into blocks 2 and 3 reporting to `state`.
async fn start_load(w: &mut Worker, state: &LoadState, lease: &[u8]) -> Result<(), String> {
    let req = w.load_request(state, lease, &[Some(2), Some(3)]);
    w.client.load(req).await.map_err(|e| e.to_string())
}

/// The server still answers and still moves bytes: Health, then a fresh worker's Save, Query
/// and Load with a fresh load state.
async fn still_serving(srv: &TestServer, tag: &str) {
    let mut c = srv.client().await;
    c.health().await.expect("health after the abuse");
    let (mut w, hs, lease) = saved_worker(srv, tag).await;
    let state = LoadState::create().unwrap();
    start_load(&mut w, &state, &lease).await.unwrap();
    assert_eq!(wait_state(&state).await, LOAD_SUCCESS, "{tag}");
    assert!(w.kv.holds(2, &hs[0]) && w.kv.holds(3, &hs[1]), "{tag}");
}

// (a) The load-state object, abused while the server holds it.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn load_state_truncated_after_the_rpc_fails_the_load_without_a_crash() {
    let srv = slow_copy_server().await;
    let (mut w, hs, lease) = saved_worker(&srv, "trunc").await;
    let before = load_failures(&srv);
    let state = LoadState::create().unwrap();
    start_load(&mut w, &state, &lease).await.unwrap();
    // The RPC returned; the copy waits COPY_DELAY_MS; the completion word goes last.
    resize(&state, 0);
    // The server cannot tell the client: the load counts as failed (a SIGBUS here before).
    wait_until("the load to be counted failed", || {
        load_failures(&srv) > before
    })
    .await;
    // The bytes themselves landed; only the word could not be written.
    assert!(w.kv.holds(2, &hs[0]) && w.kv.holds(3, &hs[1]));
    assert_eq!(
        std::fs::metadata(shm_path(&state)).unwrap().len(),
        0,
        "the server must not regrow a shrunk object"
    );
    still_serving(&srv, "trunc-after").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn load_state_truncated_and_regrown_after_the_rpc_still_completes() {
    let srv = slow_copy_server().await;
    let (mut w, _hs, lease) = saved_worker(&srv, "regrow").await;
    let state = LoadState::create().unwrap();
    start_load(&mut w, &state, &lease).await.unwrap();
    resize(&state, 0);
    resize(&state, 32);
    // The object is large enough again: the word lands in its (fresh, zeroed) pages, which
    // the client's mapping now shows.
    assert_eq!(wait_state(&state).await, LOAD_SUCCESS);
    still_serving(&srv, "regrow-after").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn load_state_resized_huge_after_the_rpc_still_completes() {
    let srv = slow_copy_server().await;
    let (mut w, _hs, lease) = saved_worker(&srv, "huge").await;
    let state = LoadState::create().unwrap();
    start_load(&mut w, &state, &lease).await.unwrap();
    resize(&state, 1 << 40);
    assert_eq!(wait_state(&state).await, LOAD_SUCCESS);
    still_serving(&srv, "huge-after").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn load_state_unlinked_after_the_rpc_still_completes() {
    let srv = slow_copy_server().await;
    let (mut w, _hs, lease) = saved_worker(&srv, "unlink").await;
    let state = LoadState::create().unwrap();
    start_load(&mut w, &state, &lease).await.unwrap();
    // What PyLoadState's drop does; the server keeps what it opened.
    std::fs::remove_file(shm_path(&state)).unwrap();
    assert_eq!(wait_state(&state).await, LOAD_SUCCESS);
    still_serving(&srv, "unlink-after").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn load_state_abused_before_the_rpc_is_refused_and_consumes_nothing() {
    let srv = slow_copy_server().await;
    let (mut w, hs, lease) = saved_worker(&srv, "before").await;
    // Truncated to nothing, or to less than the 32-byte struct.
    for len in [0, 20] {
        let state = LoadState::create().unwrap();
        resize(&state, len);
        let e = start_load(&mut w, &state, &lease).await.unwrap_err();
        assert!(e.contains("load state"), "{e}");
    }
    // Unlinked.
    let state = LoadState::create().unwrap();
    std::fs::remove_file(shm_path(&state)).unwrap();
    let e = start_load(&mut w, &state, &lease).await.unwrap_err();
    assert!(e.contains("load state"), "{e}");
    // Resized huge before the RPC: the header is still there, the load goes through, and it
    // consumes the lease the refused attempts left alone.
    let state = LoadState::create().unwrap();
    resize(&state, 1 << 40);
    start_load(&mut w, &state, &lease).await.unwrap();
    assert_eq!(wait_state(&state).await, LOAD_SUCCESS);
    assert!(w.kv.holds(2, &hs[0]) && w.kv.holds(3, &hs[1]));
    still_serving(&srv, "before-after").await;
}

// (b) Host memfds the server cannot seal against shrinking.

/// A memfd of the cache's size, created with `flags`, that `kv`'s registration describes.
fn memfd_for(kv: &KvCache, flags: MFdFlags) -> OwnedFd {
    let fd = memfd_create(c"shm-abuse-kv", MFdFlags::MFD_CLOEXEC | flags).unwrap();
    nix::unistd::ftruncate(&fd, kv.mem.len() as libc::off_t).unwrap();
    fd
}

/// Registers `kv`'s layout for instance `id` with `fd` as its memory.
async fn register_fd(
    srv: &TestServer,
    kv: &KvCache,
    id: &str,
    fd: &OwnedFd,
) -> Result<(), pegaflow_api::ApiError> {
    pegaflow_api::fd::send_fd(&srv.socket, id, 0, fd.as_fd()).unwrap();
    let mut c = srv.client().await;
    c.register(
        kv.registration(id, "ns", 0, 1, 0)
            .to_request(pb::MemoryKind::HostMemfd, kv.mem.len() as u64),
    )
    .await
}

fn seals(fd: BorrowedFd<'_>) -> SealFlag {
    SealFlag::from_bits_truncate(fcntl(fd, FcntlArg::F_GET_SEALS).unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unsealable_memfds_are_refused_by_default() {
    for srv in [
        server_with_registrar(None).await,
        server_with_registrar(Some(true)).await,
    ] {
        let kv = KvCache::new(SHAPE);
        // Created without MFD_ALLOW_SEALING: it can never be sealed.
        let fd = memfd_for(&kv, MFdFlags::empty());
        let e = register_fd(&srv, &kv, "unsealable", &fd).await.unwrap_err();
        assert_eq!(e.code(), Some(Code::InvalidArgument), "{e}");
        let msg = e.to_string();
        assert!(
            msg.contains("cannot be sealed against shrinking") && msg.contains("MFD_ALLOW_SEALING"),
            "{msg}"
        );
        // Sealable, but the client sealed the seals first: just as unsafe, just as refused.
        let fd = memfd_for(&kv, MFdFlags::MFD_ALLOW_SEALING);
        fcntl(fd.as_fd(), FcntlArg::F_ADD_SEALS(SealFlag::F_SEAL_SEAL)).unwrap();
        let e = register_fd(&srv, &kv, "seal-sealed", &fd)
            .await
            .unwrap_err();
        assert!(e.to_string().contains("MFD_ALLOW_SEALING"), "{e}");
        // Already sealed against shrinking by the client (and the seals then sealed): safe.
        let fd = memfd_for(&kv, MFdFlags::MFD_ALLOW_SEALING);
        fcntl(
            fd.as_fd(),
            FcntlArg::F_ADD_SEALS(SealFlag::F_SEAL_SHRINK | SealFlag::F_SEAL_SEAL),
        )
        .unwrap();
        register_fd(&srv, &kv, "pre-sealed", &fd).await.unwrap();
        // The Rust SDK's memfds are sealable: a native client keeps working.
        still_serving(&srv, "sdk-memfd").await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unsealable_memfds_are_accepted_when_the_operator_opts_out() {
    let srv = server_with_registrar(Some(false)).await;
    let kv = KvCache::new(SHAPE);
    let fd = memfd_for(&kv, MFdFlags::empty());
    register_fd(&srv, &kv, "opt-out", &fd).await.unwrap();
    assert!(!seals(fd.as_fd()).contains(SealFlag::F_SEAL_SHRINK));
    // (Shrinking it now would crash the server: that is what the operator accepted.)
    let mut c = srv.client().await;
    c.save(
        "opt-out",
        0,
        0,
        0,
        (0..SHAPE.layers)
            .map(|l| (KvShape::layer_name(l), vec![0], vec![hash_of("opt-out", 0)]))
            .collect(),
    )
    .await
    .unwrap();
    still_serving(&srv, "opt-out-after").await;
}

// (c) A sealed KV memfd.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_registered_kv_memfd_cannot_be_shrunk_by_its_client() {
    let srv = server_with_registrar(None).await;
    let (mut w, hs, lease) = saved_worker(&srv, "sealed").await;
    let fd = w.kv.mem.fd();
    assert!(
        seals(fd).contains(SealFlag::F_SEAL_SHRINK),
        "{:?}",
        seals(fd)
    );
    let len = w.kv.mem.len() as libc::off_t;
    for smaller in [0, len / 2, len - 1] {
        assert_eq!(nix::unistd::ftruncate(fd, smaller), Err(Errno::EPERM));
    }
    // Growing is allowed and harmless: the server maps only the registered length.
    nix::unistd::ftruncate(fd, len + 4096).unwrap();
    // The server keeps serving this instance, through Load and Save.
    w.kv.poison(2, 0xAA);
    w.kv.poison(3, 0xAA);
    let state = LoadState::create().unwrap();
    start_load(&mut w, &state, &lease).await.unwrap();
    assert_eq!(wait_state(&state).await, LOAD_SUCCESS);
    assert!(w.kv.holds(2, &hs[0]) && w.kv.holds(3, &hs[1]));
    let more = vec![hash_of("sealed-more", 0)];
    w.kv.fill(4, &more[0]);
    w.save(&[4], &more).await.unwrap();
    let (n, _lease) = ready(w.client.query("sealed", more.clone(), "q2").await.unwrap());
    assert_eq!(n, 1);
    still_serving(&srv, "sealed-after").await;
}
