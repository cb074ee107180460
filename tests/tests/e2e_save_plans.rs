//! Randomised Saves against a model of what a Save must store: the server plans a Save whose
//! layers all carry one hash list without per-(block, layer) records (its uniform plan) and
//! any other Save from listed records; both must store the same bytes. Each round drives one
//! instance through Saves of random layer subsets, hash lists (repeats and already sealed
//! hashes included) and device block ids, shared by every layer or drawn per layer, then
//! checks the bytes each Save copied (resident and repeated hashes are not copied), every
//! hash's residency, and loads each sealed one back, layer by layer.

use std::collections::HashMap;

use pegaflow_api::load_state::LOAD_SUCCESS;
use pegaflow_tests::harness::*;

const LAYERS: usize = 4;
const SHAPE: KvShape = KvShape {
    layers: LAYERS,
    num_blocks: 16,
    segment_bytes: 64,
};
/// Device blocks Saves read from; the Loads land in [`TARGET`].
const SOURCES: u32 = 12;
const TARGET: u32 = 13;
const UNIVERSE: usize = 6;

/// A small deterministic generator (xorshift64*), so a failing round can be replayed.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

/// The content tag of device block `b` (what [`KvCache::fill`] wrote there).
fn source_tag(b: u32) -> Vec<u8> {
    format!("device-block-{b}").into_bytes()
}

/// One Save as the test builds it: per layer (by index), its (device block id, hash) list.
type SaveSpec = Vec<(usize, Vec<(u32, Vec<u8>)>)>;

/// What the server must hold per hash: each layer's slot, from the device block whose bytes
/// it took (the first Save to bring a slot wins; a sealed block takes nothing more).
#[derive(Default)]
struct Model {
    partial: HashMap<Vec<u8>, [Option<u32>; LAYERS]>,
    sealed: HashMap<Vec<u8>, [u32; LAYERS]>,
}

impl Model {
    /// Bytes one Save must copy: per layer, one part per distinct hash not sealed before it
    /// (partly saved hashes are copied again; their seal keeps the slots filled first).
    fn copied_bytes(&self, layers: &SaveSpec) -> u64 {
        layers
            .iter()
            .map(|(_, list)| {
                let fresh: std::collections::HashSet<&Vec<u8>> = list
                    .iter()
                    .map(|(_, h)| h)
                    .filter(|h| !self.sealed.contains_key(*h))
                    .collect();
                (fresh.len() * 2 * SHAPE.segment_bytes) as u64
            })
            .sum()
    }

    /// Applies one Save: per layer, its (device block id, hash) list.
    fn save(&mut self, layers: &SaveSpec) {
        for (l, list) in layers {
            for (id, hash) in list {
                if self.sealed.contains_key(hash) {
                    continue;
                }
                let slots = self.partial.entry(hash.clone()).or_default();
                // Within one layer of one Save the first position of a hash wins, and across
                // Saves the first to fill a slot does: both are "keep what is there".
                if slots[*l].is_none() {
                    slots[*l] = Some(*id);
                }
            }
        }
        let done: Vec<Vec<u8>> = self
            .partial
            .iter()
            .filter(|(_, s)| s.iter().all(Option::is_some))
            .map(|(h, _)| h.clone())
            .collect();
        for h in done {
            let s = self.partial.remove(&h).expect("listed");
            self.sealed.insert(h, s.map(|b| b.expect("filled")));
        }
    }
}

/// One random Save: a random subset of the layers in random order; either one (ids, hashes)
/// list for all of them (a uniform Save), one hash list with per-layer ids (also uniform),
/// or a list per layer (listed).
fn random_save(rng: &mut Rng, universe: &[Vec<u8>]) -> SaveSpec {
    let mut order: Vec<usize> = (0..LAYERS).collect();
    // A third of the Saves carry every layer in order (a complete block sealed straight from
    // the Save's own records); the rest a shuffled subset.
    let chosen = if rng.below(3) == 0 {
        &order[..]
    } else {
        for i in (1..LAYERS).rev() {
            order.swap(i, rng.below(i + 1));
        }
        &order[..1 + rng.below(LAYERS)]
    };
    let list = |rng: &mut Rng| -> Vec<(u32, Vec<u8>)> {
        (0..1 + rng.below(8))
            .map(|_| {
                (
                    rng.below(SOURCES as usize) as u32,
                    universe[rng.below(universe.len())].clone(),
                )
            })
            .collect()
    };
    match rng.below(3) {
        0 => {
            let shared = list(rng);
            chosen.iter().map(|&l| (l, shared.clone())).collect()
        }
        1 => {
            let shared = list(rng);
            chosen
                .iter()
                .map(|&l| {
                    let ids = shared
                        .iter()
                        .map(|(_, h)| (rng.below(SOURCES as usize) as u32, h.clone()))
                        .collect();
                    (l, ids)
                })
                .collect()
        }
        _ => chosen.iter().map(|&l| (l, list(rng))).collect(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_saves_store_what_the_model_says() {
    let srv = TestServer::start(ServerOptions::default()).await;
    for round in 0..40u64 {
        let mut rng = Rng(0x9E37_79B9_7F4A_7C15 ^ (round + 1).wrapping_mul(0xD1B5_4A32_D192_ED03));
        let inst = format!("plans-{round}");
        let mut w = Worker::register(&srv, &inst, &format!("ns-{round}"), SHAPE, 0, 1, 0).await;
        for b in 0..SOURCES {
            w.kv.fill(b as usize, &source_tag(b));
        }
        let universe: Vec<Vec<u8>> = (0..UNIVERSE).map(|i| hash_of(&inst, i)).collect();
        let mut model = Model::default();
        for step in 0..4 {
            let save = random_save(&mut rng, &universe);
            let req = save
                .iter()
                .map(|(l, list)| {
                    (
                        KvShape::layer_name(*l),
                        list.iter().map(|(id, _)| *id).collect(),
                        list.iter().map(|(_, h)| h.clone()).collect(),
                    )
                })
                .collect();
            let copied = srv.handle.engine.metrics().save_bytes.get();
            w.client
                .save(&inst, 0, 0, 0, req)
                .await
                .unwrap_or_else(|e| panic!("round {round} step {step}: save {save:?}: {e}"));
            assert_eq!(
                srv.handle.engine.metrics().save_bytes.get() - copied,
                model.copied_bytes(&save),
                "round {round} step {step}: bytes copied by {save:?}"
            );
            model.save(&save);
            for (i, h) in universe.iter().enumerate() {
                let q = w.client.query(&inst, vec![h.clone()], "q").await.unwrap();
                let (n, lease) = ready(q);
                let want = model.sealed.get(h);
                assert_eq!(
                    n,
                    want.is_some() as u64,
                    "round {round} step {step}: hash {i} resident after {save:?}"
                );
                let Some(sources) = want else { continue };
                w.kv.poison(TARGET as usize, 0xEE);
                assert_eq!(w.load(&lease, &[TARGET]).await.unwrap(), LOAD_SUCCESS);
                for (l, &b) in sources.iter().enumerate() {
                    for s in 0..2 {
                        let o = w.kv.segment_offset(l, TARGET as usize, s);
                        let got = &w.kv.mem.as_slice()[o..o + SHAPE.segment_bytes];
                        assert!(
                            got == pattern(&source_tag(b), l, s, SHAPE.segment_bytes).as_slice(),
                            "round {round} step {step}: hash {i} layer {l} segment {s} should \
                             hold device block {b}'s bytes"
                        );
                    }
                }
            }
        }
    }
}
