//! Query leases: opaque 16-byte tokens pinning a query's hit blocks until every worker of the
//! instance has loaded them, the client releases them, or they expire.
//!
//! Lease states: `live(remaining = world_size)` → (each Load consumes one) → `consumed`
//! (removed); `live` → `released` (removed) by Release or by the instance's teardown;
//! `live` → `expired` (removed) once `expires_at` passes (sweeps run lazily and every 30 s).
//! A lease pins its blocks by holding their `Arc`s: the index never evicts them.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use pegaflow_api::LEASE_BYTES;

use crate::block::SealedBlock;
use crate::error::{EngineError, EngineResult};

/// A live lease.
#[derive(Debug)]
struct Lease {
    instance_id: Arc<str>,
    blocks: Arc<[Arc<SealedBlock>]>,
    remaining: u32,
    expires_at: Instant,
}

#[derive(Default)]
struct Inner {
    leases: HashMap<[u8; LEASE_BYTES], Lease>,
    per_instance: HashMap<Arc<str>, usize>,
}

/// All live leases of the server.
pub struct LeaseTable {
    inner: Mutex<Inner>,
    expired: std::sync::atomic::AtomicU64,
    ttl: Duration,
    max_per_instance: usize,
}

impl std::fmt::Debug for LeaseTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LeaseTable")
            .field("live", &self.len())
            .finish()
    }
}

/// Parses a lease token from the wire: exactly 16 bytes.
pub fn parse_lease(bytes: &[u8]) -> EngineResult<[u8; LEASE_BYTES]> {
    if bytes.is_empty() {
        return Err(EngineError::invalid("query lease id must be non-empty"));
    }
    bytes.try_into().map_err(|_| {
        EngineError::invalid(format!(
            "query lease id must be {LEASE_BYTES} bytes, got {}",
            bytes.len()
        ))
    })
}

const UNKNOWN: &str = "query lease is unknown or expired";

impl LeaseTable {
    /// A table whose leases live `ttl` and of which one instance may hold `max_per_instance`.
    pub fn new(ttl: Duration, max_per_instance: usize) -> Self {
        Self {
            inner: Mutex::new(Inner::default()),
            expired: std::sync::atomic::AtomicU64::new(0),
            ttl,
            max_per_instance,
        }
    }

    fn remove_locked(inner: &mut Inner, id: &[u8; LEASE_BYTES]) -> Option<Lease> {
        let l = inner.leases.remove(id)?;
        if let Some(c) = inner.per_instance.get_mut(&l.instance_id) {
            *c -= 1;
            if *c == 0 {
                inner.per_instance.remove(&l.instance_id);
            }
        }
        Some(l)
    }

    /// Leases removed because they expired, since start (every path that notices counts).
    pub fn expired_total(&self) -> u64 {
        self.expired.load(std::sync::atomic::Ordering::Relaxed)
    }

    fn note_expired(&self, n: usize) {
        self.expired
            .fetch_add(n as u64, std::sync::atomic::Ordering::Relaxed);
    }

    fn sweep_locked(inner: &mut Inner, now: Instant) -> usize {
        let expired: Vec<[u8; LEASE_BYTES]> = inner
            .leases
            .iter()
            .filter(|(_, l)| l.expires_at <= now)
            .map(|(k, _)| *k)
            .collect();
        for k in &expired {
            Self::remove_locked(inner, k);
        }
        expired.len()
    }

    /// Mints a lease over `blocks` for `instance_id`, consumable `consumers` times (≥ 1).
    pub fn mint(
        &self,
        instance_id: &Arc<str>,
        blocks: Vec<Arc<SealedBlock>>,
        consumers: u32,
    ) -> EngineResult<[u8; LEASE_BYTES]> {
        // A version-4 UUID from the thread's CSPRNG (`rand`'s ThreadRng, seeded from the OS):
        // as unguessable as `Uuid::new_v4`, without a `getrandom` system call per query.
        let id = uuid::Builder::from_random_bytes(rand::random())
            .into_uuid()
            .into_bytes();
        let mut g = self.inner.lock();
        let count = g.per_instance.get(instance_id).copied().unwrap_or(0);
        if count >= self.max_per_instance {
            let n = Self::sweep_locked(&mut g, Instant::now());
            self.note_expired(n);
            if g.per_instance.get(instance_id).copied().unwrap_or(0) >= self.max_per_instance {
                return Err(EngineError::ResourceExhausted(format!(
                    "instance {instance_id} holds {} live leases (the limit); load or release some",
                    self.max_per_instance
                )));
            }
        }
        g.leases.insert(
            id,
            Lease {
                instance_id: instance_id.clone(),
                blocks: blocks.into(),
                remaining: consumers.max(1),
                expires_at: Instant::now() + self.ttl,
            },
        );
        *g.per_instance.entry(instance_id.clone()).or_insert(0) += 1;
        Ok(id)
    }

    /// The blocks of a live lease of `instance_id`, without consuming it.
    pub fn peek(
        &self,
        id: &[u8; LEASE_BYTES],
        instance_id: &str,
    ) -> EngineResult<Arc<[Arc<SealedBlock>]>> {
        let g = self.inner.lock();
        let l = g
            .leases
            .get(id)
            .filter(|l| l.expires_at > Instant::now())
            .ok_or_else(|| EngineError::precondition(UNKNOWN))?;
        if &*l.instance_id != instance_id {
            return Err(EngineError::precondition(format!(
                "query lease belongs to instance {}, got {instance_id}",
                l.instance_id
            )));
        }
        Ok(l.blocks.clone())
    }

    /// Consumes one share of a lease (one worker's Load). The last share removes it.
    pub fn consume(
        &self,
        id: &[u8; LEASE_BYTES],
        instance_id: &str,
    ) -> EngineResult<Arc<[Arc<SealedBlock>]>> {
        let mut g = self.inner.lock();
        let now = Instant::now();
        let l = match g.leases.get_mut(id) {
            Some(l) if l.expires_at > now => l,
            Some(_) => {
                Self::remove_locked(&mut g, id);
                self.note_expired(1);
                return Err(EngineError::precondition(UNKNOWN));
            }
            None => return Err(EngineError::precondition(UNKNOWN)),
        };
        if &*l.instance_id != instance_id {
            return Err(EngineError::precondition(format!(
                "query lease belongs to instance {}, got {instance_id}",
                l.instance_id
            )));
        }
        l.remaining -= 1;
        let blocks = l.blocks.clone();
        if l.remaining == 0 {
            Self::remove_locked(&mut g, id);
        }
        Ok(blocks)
    }

    /// Releases a lease whatever its remaining shares. Unknown, expired or already released →
    /// FAILED_PRECONDITION.
    pub fn release(&self, id: &[u8; LEASE_BYTES]) -> EngineResult<()> {
        let mut g = self.inner.lock();
        match Self::remove_locked(&mut g, id) {
            Some(l) if l.expires_at > Instant::now() => Ok(()),
            Some(_) => {
                self.note_expired(1);
                Err(EngineError::precondition(UNKNOWN))
            }
            None => Err(EngineError::precondition(UNKNOWN)),
        }
    }

    /// Drops every lease of `instance_id`; returns how many.
    pub fn drop_instance(&self, instance_id: &str) -> usize {
        let mut g = self.inner.lock();
        let ids: Vec<[u8; LEASE_BYTES]> = g
            .leases
            .iter()
            .filter(|(_, l)| &*l.instance_id == instance_id)
            .map(|(k, _)| *k)
            .collect();
        for k in &ids {
            Self::remove_locked(&mut g, k);
        }
        ids.len()
    }

    /// Removes expired leases; returns how many.
    pub fn sweep(&self) -> usize {
        let n = Self::sweep_locked(&mut self.inner.lock(), Instant::now());
        self.note_expired(n);
        n
    }

    /// Live leases (expired ones not yet swept included).
    pub fn len(&self) -> usize {
        self.inner.lock().leases.len()
    }

    /// Whether no lease is live.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn consume_counts_and_instance_binding() {
        let t = LeaseTable::new(Duration::from_secs(60), 10);
        let a: Arc<str> = "a".into();
        let id = t.mint(&a, vec![], 2).unwrap();
        assert!(t
            .consume(&id, "b")
            .unwrap_err()
            .to_string()
            .contains("belongs to instance a"));
        t.consume(&id, "a").unwrap();
        t.consume(&id, "a").unwrap();
        assert_eq!(
            t.consume(&id, "a").unwrap_err(),
            EngineError::precondition(UNKNOWN)
        );
    }

    #[test]
    fn release_twice_and_expiry() {
        let t = LeaseTable::new(Duration::from_millis(20), 10);
        let a: Arc<str> = "a".into();
        let id = t.mint(&a, vec![], 1).unwrap();
        t.release(&id).unwrap();
        assert!(t.release(&id).is_err());
        let id2 = t.mint(&a, vec![], 1).unwrap();
        std::thread::sleep(Duration::from_millis(30));
        assert!(t.peek(&id2, "a").is_err());
        assert_eq!(t.sweep(), 1);
        assert!(t.is_empty());
        assert_eq!(t.expired_total(), 1);
    }

    #[test]
    fn per_instance_limit() {
        let t = LeaseTable::new(Duration::from_secs(60), 2);
        let a: Arc<str> = "a".into();
        t.mint(&a, vec![], 1).unwrap();
        let id = t.mint(&a, vec![], 1).unwrap();
        assert!(matches!(
            t.mint(&a, vec![], 1),
            Err(EngineError::ResourceExhausted(_))
        ));
        t.release(&id).unwrap();
        t.mint(&a, vec![], 1).unwrap();
        assert_eq!(t.drop_instance("a"), 2);
    }

    #[test]
    fn parse() {
        assert!(parse_lease(&[]).is_err());
        assert!(parse_lease(&[1; 15]).is_err());
        assert!(parse_lease(&[1; 16]).is_ok());
    }
}
