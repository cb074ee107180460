//! A client process for the soak test (`tests/tests/soak.rs`): registers a host-memfd KV
//! cache over the side channel under a Session (opened first, as native clients do), and loops Save → QueryPrefetch → Load →
//! byte check → Release over a shared key space (so clients share blocks and the server
//! evicts), until killed or `ROUNDS` rounds are done.
//!
//! ```text
//! soak_client ENDPOINT SOCKET INSTANCE_ID SEED ROUNDS
//! ```
//!
//! Prints `round N` after each verified round. Exits 3 when a loaded block does not hold
//! the bytes saved under its hash (corruption), 2 on a bad command line, 1 when the server
//! cannot be reached.

use pegaflow_api::client::{single_group_load, EngineClient, LoadCompletion, QueryOutcome};
use pegaflow_api::load_state::{LoadState, LOAD_SUCCESS};
use pegaflow_tests::harness::{hash_of, KvCache, KvShape};
use pegaflow_tests::pool_suite::Rng;

/// The cache every soak client registers.
pub const SHAPE: KvShape = KvShape {
    layers: 2,
    num_blocks: 32,
    segment_bytes: 4096,
};
/// Distinct hashes the clients draw from (shared among them).
const KEYS: usize = 256;
/// Blocks per Save.
const BATCH: usize = 8;

#[tokio::main(flavor = "current_thread")]
async fn main() -> std::process::ExitCode {
    let a: Vec<String> = std::env::args().collect();
    if a.len() != 6 {
        eprintln!("usage: soak_client ENDPOINT SOCKET INSTANCE_ID SEED ROUNDS");
        return std::process::ExitCode::from(2);
    }
    let (endpoint, socket, id) = (&a[1], std::path::Path::new(&a[2]), &a[3]);
    let (Ok(seed), Ok(rounds)) = (a[4].parse::<u64>(), a[5].parse::<u64>()) else {
        eprintln!("SEED and ROUNDS are integers");
        return std::process::ExitCode::from(2);
    };
    let Ok(mut c) = EngineClient::connect(endpoint).await else {
        return std::process::ExitCode::from(1);
    };
    // The native lifecycle: the Session first, then the registration it covers.
    let _session = match c.session(id, "soak", 1, 1).await {
        Ok(s) => s,
        Err(e) => {
            eprintln!("session: {e}");
            return std::process::ExitCode::from(1);
        }
    };
    let mut kv = KvCache::new(SHAPE);
    let reg = kv.registration(id, "soak", 0, 1, 0);
    if let Err(e) = c.register_host_memfd(socket, &reg, &kv.mem).await {
        eprintln!("register: {e}");
        return std::process::ExitCode::from(1);
    }
    let mut r = Rng::new(seed);
    for round in 0..rounds {
        let first = r.range(0, KEYS - BATCH);
        let hs: Vec<Vec<u8>> = (first..first + BATCH).map(|i| hash_of("soak", i)).collect();
        let ids: Vec<u32> = (0..BATCH as u32).collect();
        for (b, h) in hs.iter().enumerate() {
            kv.fill(b, h);
        }
        let saves = (0..SHAPE.layers)
            .map(|l| (KvShape::layer_name(l), ids.clone(), hs.clone()))
            .collect();
        if let Err(e) = c.save(id, 0, 0, 0, saves).await {
            // A full pool under eviction pressure is an answer, not a failure.
            eprintln!("save: {e}");
            continue;
        }
        let q = match c.query(id, hs.clone(), &format!("r{round}")).await {
            Ok(q) => q,
            Err(e) => {
                eprintln!("query: {e}");
                continue;
            }
        };
        let QueryOutcome::Ready {
            num_hit_blocks,
            lease,
            ..
        } = q
        else {
            continue;
        };
        let n = num_hit_blocks as usize;
        if n == 0 {
            continue;
        }
        // Load the hit prefix into blocks 16.., poisoned first.
        for b in 0..n {
            kv.poison(16 + b, 0xEE);
        }
        let state = LoadState::create().expect("load state");
        let req = single_group_load(
            id,
            0,
            0,
            (0..SHAPE.layers).map(KvShape::layer_name).collect(),
            &lease,
            (0..n).map(|b| Some((16 + b) as u32)),
            LoadCompletion::StateWord(state.name()),
        );
        if let Err(e) = c.load(req).await {
            eprintln!("load: {e}");
            let _ = c.release(&lease).await;
            continue;
        }
        let mut done = 0;
        for _ in 0..10_000 {
            done = state.get();
            if done != 0 {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(1)).await;
        }
        if done == LOAD_SUCCESS {
            for (b, h) in hs.iter().take(n).enumerate() {
                if !kv.holds(16 + b, h) {
                    eprintln!("CORRUPT: block {b} of round {round} does not hold {h:?}");
                    return std::process::ExitCode::from(3);
                }
            }
        }
        let _ = c.release(&lease).await;
        println!("round {round}");
    }
    std::process::ExitCode::SUCCESS
}
